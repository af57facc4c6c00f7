//! Output files written around the page cache (`O_DIRECT`) where the file system allows it.
//!
//! A buffered `write` copies every byte into freshly allocated page-cache pages. On the
//! virtual machines idem is measured on, a fresh guest page costs the host a fault: writing
//! 400 MiB that way took ~1 s of system time, against 0.03 s with `O_DIRECT` (`dd`, in
//! `benches/RESULTS.md`), and the copy was ~9 % of a 10M-row dedup's samples. An output is
//! written once and read by another process later, so caching it while it is written buys
//! nothing.
//!
//! `O_DIRECT` needs aligned buffers, lengths and offsets: bytes are gathered in a
//! [`ALIGNMENT`]-aligned buffer and written in whole blocks; the tail of the file, shorter
//! than a block, is written at [`OutputFile::finish`] with `O_DIRECT` switched off. Where
//! the file system refuses `O_DIRECT` (tmpfs, some network file systems), at open or at the
//! first write, the file is written through the page cache as before: the bytes are the same.

use std::fs::File;
use std::io::{self, Write};
use std::path::Path;

/// The alignment of buffers, lengths and file offsets under `O_DIRECT`: the page size,
/// a multiple of every block size Linux file systems use.
const ALIGNMENT: usize = 4096;

/// Bytes gathered before a write: large enough that a write's fixed cost is negligible,
/// small beside an output row group (which is buffered whole anyway).
const BUFFER_BYTES: usize = 4 << 20;

/// A new file, written through [`Write`] and completed by [`OutputFile::finish`].
pub(crate) struct OutputFile {
    file: File,
    /// `ALIGNMENT` bytes more than `BUFFER_BYTES`, so that an aligned window fits.
    storage: Vec<u8>,
    /// Where the aligned window starts in `storage`.
    start: usize,
    /// Bytes of the window in use.
    len: usize,
    /// Whether `file` is still open with `O_DIRECT`.
    direct: bool,
}

impl OutputFile {
    /// Creates (or truncates) the file at `path`, with `O_DIRECT` where possible.
    ///
    /// # Errors
    /// The file cannot be created.
    pub(crate) fn create(path: &Path) -> io::Result<Self> {
        let storage = vec![0u8; BUFFER_BYTES + ALIGNMENT];
        let start = storage.as_ptr().align_offset(ALIGNMENT);
        let direct_file = if start < ALIGNMENT {
            open_direct(path).ok()
        } else {
            None
        };
        let (file, direct) = match direct_file {
            Some(file) => (file, true),
            None => (File::create(path)?, false),
        };
        Ok(Self {
            file,
            storage,
            start: start.min(ALIGNMENT),
            len: 0,
            direct,
        })
    }

    /// Writes what is still buffered and returns the file, every byte written.
    ///
    /// # Errors
    /// A write fails.
    pub(crate) fn finish(mut self) -> io::Result<File> {
        self.write_whole_blocks()?;
        if self.len > 0 {
            self.stop_direct()?;
            self.write_whole_blocks()?;
        }
        Ok(self.file)
    }

    /// Writes the buffered bytes out, all of them when buffered, else the whole blocks
    /// among them, keeping the rest at the start of the window.
    fn write_whole_blocks(&mut self) -> io::Result<()> {
        let ready = if self.direct {
            self.len / ALIGNMENT * ALIGNMENT
        } else {
            self.len
        };
        if ready == 0 {
            return Ok(());
        }
        let window = self.start..self.start + ready;
        match self.file.write_all(&self.storage[window.clone()]) {
            Ok(()) => {}
            // The file system accepted O_DIRECT at open but not this write (an alignment
            // it needs larger than ours): nothing was written, so write buffered instead.
            Err(error) if self.direct && error.kind() == io::ErrorKind::InvalidInput => {
                self.stop_direct()?;
                self.file.write_all(&self.storage[window])?;
            }
            Err(error) => return Err(error),
        }
        self.storage
            .copy_within(self.start + ready..self.start + self.len, self.start);
        self.len -= ready;
        Ok(())
    }

    fn stop_direct(&mut self) -> io::Result<()> {
        if self.direct {
            clear_direct(&self.file)?;
            self.direct = false;
        }
        Ok(())
    }
}

impl Write for OutputFile {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        if self.len == BUFFER_BYTES {
            self.write_whole_blocks()?;
        }
        let take = bytes.len().min(BUFFER_BYTES - self.len);
        let at = self.start + self.len;
        self.storage[at..at + take].copy_from_slice(&bytes[..take]);
        self.len += take;
        Ok(take)
    }

    /// Writes the whole blocks buffered: under `O_DIRECT` a shorter tail can only be
    /// written at [`OutputFile::finish`], as the file's last bytes.
    fn flush(&mut self) -> io::Result<()> {
        self.write_whole_blocks()
    }
}

#[cfg(target_os = "linux")]
fn open_direct(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let flags = rustix::fs::OFlags::DIRECT.bits();
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(i32::try_from(flags).map_err(io::Error::other)?)
        .open(path)
}

#[cfg(not(target_os = "linux"))]
fn open_direct(_path: &Path) -> io::Result<File> {
    Err(io::Error::from(io::ErrorKind::Unsupported))
}

#[cfg(target_os = "linux")]
fn clear_direct(file: &File) -> io::Result<()> {
    use rustix::fs::{OFlags, fcntl_getfl, fcntl_setfl};
    let flags = fcntl_getfl(file)?;
    fcntl_setfl(file, flags - OFlags::DIRECT)?;
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn clear_direct(_file: &File) -> io::Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes that tell their position: a shifted or dropped chunk changes them.
    fn pattern(len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i % 251) as u8 ^ (i / 251) as u8)
            .collect()
    }

    fn written_back(chunk_sizes: &[usize]) -> (Vec<u8>, Vec<u8>, bool) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("out.bin");
        let total = chunk_sizes.iter().sum();
        let expected = pattern(total);
        let mut file = OutputFile::create(&path).expect("create");
        let direct = file.direct;
        let mut offset = 0;
        for &size in chunk_sizes {
            file.write_all(&expected[offset..offset + size])
                .expect("write");
            file.flush().expect("flush");
            offset += size;
        }
        drop(file.finish().expect("finish"));
        (std::fs::read(&path).expect("read"), expected, direct)
    }

    #[test]
    fn every_byte_lands_in_order_whatever_the_chunking() {
        for chunks in [
            vec![],
            vec![1],
            vec![ALIGNMENT],
            vec![ALIGNMENT - 1, 2, ALIGNMENT * 3 + 7],
            vec![BUFFER_BYTES + 1],
            vec![BUFFER_BYTES * 2 + ALIGNMENT * 5 + 123, 9, 8192, 3],
        ] {
            let (back, expected, _) = written_back(&chunks);
            assert_eq!(back.len(), expected.len(), "{chunks:?}");
            assert!(back == expected, "bytes differ for chunks {chunks:?}");
        }
    }

    #[test]
    fn o_direct_is_used_wherever_the_file_system_accepts_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let accepted = open_direct(&dir.path().join("probe.bin")).is_ok();
        let (_, _, direct) = written_back(&[10]);
        assert_eq!(direct, accepted);
    }
}
