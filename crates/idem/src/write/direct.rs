//! Output files written around the page cache (`O_DIRECT`) where the file system allows it.
//!
//! A buffered `write` copies every byte into freshly allocated page-cache pages. On the
//! virtual machines idem is measured on, a fresh guest page costs the host a fault: writing
//! 400 MiB that way took ~1 s of system time, against 0.03 s with `O_DIRECT` (`dd`, in
//! `benches/RESULTS.md`), and the copy was ~9 % of a 10M-row dedup's samples. An output is
//! written once and read by another process later, so caching it while it is written buys
//! nothing.
//!
//! `O_DIRECT` needs aligned buffers, lengths and offsets: bytes are gathered in
//! [`ALIGNMENT`]-aligned buffers and written in whole blocks; the tail of the file, shorter
//! than a block, is written at [`OutputFile::finish`] with `O_DIRECT` switched off. Where
//! the file system refuses `O_DIRECT` (tmpfs, some network file systems), at open or at the
//! first write, the file is written through the page cache as before: the bytes are the same.
//!
//! An `O_DIRECT` write returns only once the device has the bytes, and the thread that
//! writes a Parquet file is one of those encoding it. So the writes happen on a thread of
//! their own: the writer fills one buffer while the previous one is being written.
//!
//! ```text
//!   write(bytes) ──▶ current buffer ──full──▶ [queue] ──▶ I/O thread: write(2) ──┐
//!        ▲                                                                       │
//!        └──────────────────── emptied buffers, to fill again ◀──────────────────┘
//!                                   every SYNC_EVERY_BYTES written ──▶ sync thread: fdatasync(2)
//! ```
//!
//! The output is synced before it is published (see `crate::write::output`). Left to that one
//! sync, the whole file's flush falls at the end of the run, with nothing else to do:
//! ~0.1 s for a 360 MB file on the VMs idem is measured on, with both cores idle. A third
//! thread syncs what is written every [`SYNC_EVERY_BYTES`] while the run goes on, so that
//! the last sync finds only the tail to flush.

use std::fs::File;
use std::io::{self, Write};
use std::path::Path;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;

/// The alignment of buffers, lengths and file offsets under `O_DIRECT`: the page size,
/// a multiple of every block size Linux file systems use.
const ALIGNMENT: usize = 4096;

/// Bytes gathered before a write: large enough that a write's fixed cost is negligible,
/// small beside an output row group (which is buffered whole anyway).
const BUFFER_BYTES: usize = 4 << 20;

/// Buffers per file: one being filled, one being written, and one queued, so that a
/// burst of bytes (a row group appended at once) rarely waits for the device.
const BUFFERS: usize = 3;

/// Bytes written between two background syncs. A sync stalls the writes behind it while
/// the device flushes, for longer the more there is to flush: every 64 MiB, a 10M dedup
/// stopped for up to 0.1 s at a time; every 16 MiB, its stalls fit in the buffers above.
/// Alternating 8 rounds at 10M against no background syncs: wall 0.964 (16 MiB) and
/// 0.977 (64 MiB), paired medians (`benches/RESULTS.md`).
const SYNC_EVERY_BYTES: usize = 16 << 20;

/// A new file, written through [`Write`] and completed by [`OutputFile::finish`].
pub(crate) struct OutputFile {
    /// The buffer being filled.
    current: Block,
    /// Buffers allocated so far, at most [`BUFFERS`].
    allocated: usize,
    /// Whether the file was opened with `O_DIRECT` (the I/O thread may switch it off).
    direct: bool,
    /// Full buffers to the I/O thread; `None` once it is told to finish.
    to_write: Option<SyncSender<Block>>,
    /// Buffers the I/O thread has written, to fill again.
    written: Receiver<Block>,
    /// The I/O thread: the file and whether it is still `O_DIRECT`, or the first error.
    io: Option<JoinHandle<io::Result<(File, bool)>>>,
}

/// A buffer whose window starts at an [`ALIGNMENT`] boundary.
struct Block {
    /// `ALIGNMENT` bytes more than `BUFFER_BYTES`, so that an aligned window fits.
    storage: Vec<u8>,
    /// Where the aligned window starts in `storage`.
    start: usize,
    /// Bytes of the window in use.
    len: usize,
}

impl Block {
    fn new() -> Self {
        let storage = vec![0u8; BUFFER_BYTES + ALIGNMENT];
        // Never more than ALIGNMENT for bytes; were it, `O_DIRECT` writes would be refused
        // and the file written buffered.
        let start = storage.as_ptr().align_offset(ALIGNMENT).min(ALIGNMENT);
        Self {
            storage,
            start,
            len: 0,
        }
    }

    /// A buffer with no storage, left in the last one's place at the finish, after
    /// which nothing is written.
    fn unallocated() -> Self {
        Self {
            storage: Vec::new(),
            start: 0,
            len: 0,
        }
    }

    fn bytes(&self) -> &[u8] {
        &self.storage[self.start..self.start + self.len]
    }

    fn room(&self) -> usize {
        BUFFER_BYTES - self.len
    }

    /// Appends as much of `bytes` as fits; returns how much did.
    fn fill(&mut self, bytes: &[u8]) -> usize {
        let take = bytes.len().min(self.room());
        let at = self.start + self.len;
        self.storage[at..at + take].copy_from_slice(&bytes[..take]);
        self.len += take;
        take
    }
}

impl OutputFile {
    /// Creates (or truncates) the file at `path`, with `O_DIRECT` where possible.
    ///
    /// # Errors
    /// The file cannot be created, or its I/O thread cannot be started.
    pub(crate) fn create(path: &Path) -> io::Result<Self> {
        Self::create_syncing_every(path, SYNC_EVERY_BYTES)
    }

    /// [`Self::create`], syncing in the background every `sync_every` bytes written.
    fn create_syncing_every(path: &Path, sync_every: usize) -> io::Result<Self> {
        let (file, direct) = match open_direct(path) {
            Ok(file) => (file, true),
            Err(_) => (File::create(path)?, false),
        };
        let (to_write, queued) = sync_channel::<Block>(BUFFERS);
        let (to_fill, written) = sync_channel::<Block>(BUFFERS);
        let io = std::thread::Builder::new()
            .name("idem-write".to_owned())
            .spawn(move || write_queued(file, direct, sync_every, &queued, &to_fill))?;
        Ok(Self {
            current: Block::new(),
            allocated: 1,
            direct,
            to_write: Some(to_write),
            written,
            io: Some(io),
        })
    }

    /// Writes what is still buffered and returns the file, every byte written.
    ///
    /// # Errors
    /// A write fails.
    pub(crate) fn finish(mut self) -> io::Result<File> {
        let ready = self.whole_blocks();
        let tail = self.current.bytes()[ready..].to_vec();
        if ready > 0 {
            // Nothing follows the tail, so no buffer goes on in its place.
            self.queue_current(ready, Block::unallocated())?;
        }
        drop(self.to_write.take());
        let (mut file, direct) = self.join()?;
        if !tail.is_empty() {
            if direct {
                clear_direct(&file)?;
            }
            file.write_all(&tail)?;
        }
        Ok(file)
    }

    /// How many of the buffered bytes can be written now: under `O_DIRECT` the whole
    /// blocks among them, else all of them.
    fn whole_blocks(&self) -> usize {
        if self.direct {
            self.current.len / ALIGNMENT * ALIGNMENT
        } else {
            self.current.len
        }
    }

    /// Queues the whole blocks buffered for the I/O thread and goes on in an empty
    /// buffer, which starts with the bytes after them.
    fn queue_whole_blocks(&mut self) -> io::Result<()> {
        let ready = self.whole_blocks();
        if ready == 0 {
            return Ok(());
        }
        let mut next = self.empty_buffer()?;
        next.fill(&self.current.bytes()[ready..]);
        self.queue_current(ready, next)
    }

    /// Queues the first `ready` bytes of the current buffer and goes on in `next`.
    fn queue_current(&mut self, ready: usize, next: Block) -> io::Result<()> {
        let mut full = std::mem::replace(&mut self.current, next);
        full.len = ready;
        self.queue(full)
    }

    /// A buffer to fill: one the I/O thread has written, or a new one while fewer than
    /// [`BUFFERS`] exist, or else the next one it writes.
    fn empty_buffer(&mut self) -> io::Result<Block> {
        let reused = match self.written.try_recv() {
            Ok(block) => Some(block),
            Err(_) if self.allocated < BUFFERS => {
                self.allocated += 1;
                Some(Block::new())
            }
            Err(_) => None,
        };
        let mut block = match reused {
            Some(block) => block,
            // Disconnected only when the I/O thread stopped, on an error it returns.
            None => match self.written.recv() {
                Ok(block) => block,
                Err(_) => return Err(self.stopped()),
            },
        };
        block.len = 0;
        Ok(block)
    }

    fn queue(&mut self, block: Block) -> io::Result<()> {
        let sent = self
            .to_write
            .as_ref()
            .is_some_and(|queue| queue.send(block).is_ok());
        if sent { Ok(()) } else { Err(self.stopped()) }
    }

    /// The error the I/O thread stopped on.
    fn stopped(&mut self) -> io::Error {
        drop(self.to_write.take());
        match self.join() {
            Err(error) => error,
            Ok(_) => io::Error::other("the output's I/O thread stopped"),
        }
    }

    fn join(&mut self) -> io::Result<(File, bool)> {
        self.io
            .take()
            .ok_or_else(|| io::Error::other("the output's I/O thread already ended"))?
            .join()
            .map_err(|_| io::Error::other("the output's I/O thread panicked"))?
    }
}

impl Drop for OutputFile {
    fn drop(&mut self) {
        // An abandoned file: the I/O thread ends once its queue is closed.
        drop(self.to_write.take());
        if let Some(io) = self.io.take() {
            drop(io.join());
        }
    }
}

/// The I/O thread: writes each queued buffer in order and hands it back, until the queue
/// closes, and has the file synced every `sync_every` bytes. Stops at the first error of a
/// write or a sync, which it returns.
fn write_queued(
    mut file: File,
    mut direct: bool,
    sync_every: usize,
    queued: &Receiver<Block>,
    to_fill: &SyncSender<Block>,
) -> io::Result<(File, bool)> {
    let mut syncer = Syncer::start(&file)?;
    let mut unsynced = 0;
    for block in queued {
        match file.write_all(block.bytes()) {
            Ok(()) => {}
            // The file system accepted O_DIRECT at open but not this write (an alignment
            // it needs larger than ours): nothing was written, so write buffered instead.
            Err(error) if direct && error.kind() == io::ErrorKind::InvalidInput => {
                clear_direct(&file)?;
                direct = false;
                file.write_all(block.bytes())?;
            }
            Err(error) => return Err(error),
        }
        unsynced += block.len;
        // A sync still running when the next is due takes the bytes since in its stride.
        if unsynced >= sync_every && syncer.request()? {
            unsynced = 0;
        }
        // The writer may have finished and stopped taking buffers back.
        drop(to_fill.try_send(block));
    }
    syncer.finish()?;
    Ok((file, direct))
}

/// A thread that syncs a file's data whenever asked, on its own handle to the file.
struct Syncer {
    /// Requests; a request waits here while the previous sync runs. `None` once finished.
    requests: Option<SyncSender<()>>,
    /// The thread, which returns the first error of a sync and stops.
    thread: Option<JoinHandle<io::Result<()>>>,
}

impl Syncer {
    fn start(file: &File) -> io::Result<Self> {
        // The same open file: a write error the kernel reports to a sync on this handle
        // is reported once, to that sync, so its error must reach the writer (below).
        let file = file.try_clone()?;
        let (requests, received) = sync_channel::<()>(1);
        let thread = std::thread::Builder::new()
            .name("idem-sync".to_owned())
            .spawn(move || {
                for () in received {
                    file.sync_data()?;
                }
                Ok(())
            })?;
        Ok(Self {
            requests: Some(requests),
            thread: Some(thread),
        })
    }

    /// Asks for a sync of everything written so far. Returns false when one is already
    /// waiting to start (it will cover these bytes too), or the error of a sync that
    /// failed.
    fn request(&mut self) -> io::Result<bool> {
        let Some(requests) = self.requests.as_ref() else {
            return Ok(false);
        };
        match requests.try_send(()) {
            Ok(()) => Ok(true),
            Err(TrySendError::Full(())) => Ok(false),
            // The thread stopped, which it only does on an error.
            Err(TrySendError::Disconnected(())) => self.finish().map(|()| false),
        }
    }

    /// Waits for the syncs asked for; returns the first one's error.
    fn finish(&mut self) -> io::Result<()> {
        drop(self.requests.take());
        match self.thread.take() {
            Some(thread) => thread
                .join()
                .map_err(|_| io::Error::other("the output's sync thread panicked"))?,
            None => Ok(()),
        }
    }
}

impl Drop for Syncer {
    fn drop(&mut self) {
        // Abandoned after a failed write, whose error is the one returned.
        drop(self.finish());
    }
}

impl Write for OutputFile {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        if self.current.room() == 0 {
            self.queue_whole_blocks()?;
        }
        Ok(self.current.fill(bytes))
    }

    /// Queues the whole blocks buffered: under `O_DIRECT` a shorter tail can only be
    /// written at [`OutputFile::finish`], as the file's last bytes.
    fn flush(&mut self) -> io::Result<()> {
        self.queue_whole_blocks()
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
        written_back_syncing_every(chunk_sizes, SYNC_EVERY_BYTES)
    }

    fn written_back_syncing_every(
        chunk_sizes: &[usize],
        sync_every: usize,
    ) -> (Vec<u8>, Vec<u8>, bool) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("out.bin");
        let total = chunk_sizes.iter().sum();
        let expected = pattern(total);
        let mut file = OutputFile::create_syncing_every(&path, sync_every).expect("create");
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

    /// Syncs while the bytes are being written (after every buffer, some requested while
    /// the last still runs) leave every byte in place.
    #[test]
    fn background_syncs_leave_every_byte_in_order() {
        for sync_every in [1, ALIGNMENT, BUFFER_BYTES] {
            let chunks = [BUFFER_BYTES * 3 + 17, ALIGNMENT, 5, BUFFER_BYTES + 1];
            let (back, expected, _) = written_back_syncing_every(&chunks, sync_every);
            assert_eq!(back.len(), expected.len(), "sync every {sync_every}");
            assert!(back == expected, "bytes differ, syncing every {sync_every}");
        }
    }

    /// A sync's error reaches the writer. A character device has nothing to sync and
    /// refuses to (`EINVAL`), while `/dev/null` takes every write.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_failed_sync_is_an_error_of_the_file() {
        let mut file = OutputFile::create_syncing_every(Path::new("/dev/null"), 1).expect("create");
        let bytes = pattern(BUFFER_BYTES * (BUFFERS + 2) + 5);
        let failed = match file.write_all(&bytes) {
            Err(error) => error,
            Ok(()) => file.finish().expect_err("a device that cannot sync"),
        };
        assert_eq!(failed.kind(), io::ErrorKind::InvalidInput, "{failed}");
    }

    /// The I/O thread's error reaches the writer: at a later write or at the finish.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_failed_write_is_an_error_of_the_file() {
        let mut file = OutputFile::create(Path::new("/dev/full")).expect("create");
        let bytes = pattern(BUFFER_BYTES * (BUFFERS + 2) + 5);
        let failed = match file.write_all(&bytes) {
            Err(error) => error,
            Ok(()) => file.finish().expect_err("a full device"),
        };
        assert_eq!(failed.kind(), io::ErrorKind::StorageFull, "{failed}");
    }

    #[test]
    fn o_direct_is_used_wherever_the_file_system_accepts_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let accepted = open_direct(&dir.path().join("probe.bin")).is_ok();
        let (_, _, direct) = written_back(&[10]);
        assert_eq!(direct, accepted);
    }
}
