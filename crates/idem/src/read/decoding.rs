//! Decoding bytes from outside without trusting them.
//!
//! parquet-rs and arrow-ipc return errors for most damage, but not all: some corrupt
//! footers and pages reach an `assert!`, an `unwrap()` or an `unimplemented!` inside them
//! (found by `tests/corruption.rs`: arrow-ipc's `fb_to_schema` on unknown type tags and
//! odd integer widths, parquet-rs's `ColumnChunkMetaData::byte_range` on negative offsets,
//! its fixed-length byte array reader on a dictionary-encoded page without a dictionary).
//! idem checks what it can before calling them (the footer's embedded Arrow schema, the
//! column chunks' ranges), and runs every decoding step under [`guarded`], which turns a
//! decoder's panic into the file's ordinary error. [`quiet_decoder_panics`], installed by
//! the binary, keeps such a caught panic from printing a backtrace.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::Arc;

use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions};
use parquet::file::metadata::ParquetMetaData;
use parquet::file::reader::ChunkReader;

use crate::error::{Error, Result};

thread_local! {
    /// How many [`guarded`] calls this thread is inside.
    static DECODING: Cell<u32> = const { Cell::new(0) };
}

/// Runs one decoding step of `path`, turning a panic in the decoder into an error naming
/// the file.
pub(crate) fn guarded<T>(path: &Path, decode: impl FnOnce() -> Result<T>) -> Result<T> {
    DECODING.with(|depth| depth.set(depth.get() + 1));
    let outcome = catch_unwind(AssertUnwindSafe(decode));
    DECODING.with(|depth| depth.set(depth.get() - 1));
    outcome.unwrap_or_else(|payload| {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".to_owned());
        Err(Error::InvalidArgument(format!(
            "{}: corrupt data: the decoder stopped on it ({})",
            path.display(),
            message.lines().next().unwrap_or_default()
        )))
    })
}

/// An iterator of decoded items whose every step runs under [`guarded`]; it ends after
/// the first error it makes of a panic.
pub(crate) fn guarded_iter<T>(
    path: std::path::PathBuf,
    mut inner: impl Iterator<Item = Result<T>> + Send,
) -> impl Iterator<Item = Result<T>> + Send {
    let mut failed = false;
    std::iter::from_fn(move || {
        if failed {
            return None;
        }
        match guarded(&path, || Ok(inner.next())) {
            Ok(next) => next,
            Err(e) => {
                failed = true;
                Some(Err(e))
            }
        }
    })
}

/// Installs a panic hook that stays silent for panics `guarded` catches (they become
/// errors) and leaves every other panic to the hook before it.
pub fn quiet_decoder_panics() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if DECODING.with(Cell::get) == 0 {
            previous(info);
        }
    }));
}

/// Reads a Parquet footer, checking what its decoders would trust: the embedded Arrow
/// schema before arrow-ipc decodes it, the column chunks' byte ranges before parquet-rs
/// asserts on them.
pub(crate) fn load_parquet_metadata<R: ChunkReader>(
    reader: &R,
    options: ArrowReaderOptions,
    path: &Path,
) -> Result<ArrowReaderMetadata> {
    guarded(path, || {
        let footer =
            ArrowReaderMetadata::load(reader, options.clone().with_skip_arrow_metadata(true))
                .map_err(Error::parquet(path))?;
        check_embedded_schema(footer.metadata(), path)?;
        check_column_ranges(footer.metadata(), reader.len(), path)?;
        ArrowReaderMetadata::try_new(Arc::clone(footer.metadata()), options)
            .map_err(Error::parquet(path))
    })
}

fn check_column_ranges(metadata: &ParquetMetaData, file_len: u64, path: &Path) -> Result<()> {
    for (group, row_group) in metadata.row_groups().iter().enumerate() {
        for chunk in row_group.columns() {
            let start = chunk
                .dictionary_page_offset()
                .unwrap_or(chunk.data_page_offset());
            let fits = u64::try_from(start)
                .ok()
                .zip(u64::try_from(chunk.compressed_size()).ok())
                .and_then(|(start, len)| start.checked_add(len))
                .is_some_and(|end| end <= file_len);
            if !fits {
                return Err(corrupt(
                    path,
                    "Parquet footer",
                    &format!(
                        "column '{}' of row group {group} lies outside the file \
                         (offset {start}, {} bytes)",
                        chunk.column_path(),
                        chunk.compressed_size()
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Refuses a Parquet file whose footer embeds an Arrow schema that arrow-ipc cannot decode
/// (it would panic on it: see [`crate::read::ipc_schema`]).
fn check_embedded_schema(metadata: &ParquetMetaData, path: &Path) -> Result<()> {
    use base64::Engine;
    let Some(encoded) = metadata
        .file_metadata()
        .key_value_metadata()
        .into_iter()
        .flatten()
        .find(|kv| kv.key == parquet::arrow::ARROW_SCHEMA_META_KEY)
        .and_then(|kv| kv.value.as_deref())
    else {
        return Ok(());
    };
    let problem = match base64::engine::general_purpose::STANDARD.decode(encoded) {
        Err(e) => format!("not base64: {e}"),
        Ok(bytes) => {
            // Parquet writers prefix the message with IPC's continuation marker and length.
            let message = if bytes.len() > 8 && bytes[..4] == [0xff; 4] {
                &bytes[8..]
            } else {
                &bytes[..]
            };
            match crate::read::ipc_schema::check_message(message) {
                Ok(()) => return Ok(()),
                Err(problem) => problem,
            }
        }
    };
    Err(corrupt(
        path,
        "embedded Arrow schema (ARROW:schema) in the Parquet footer",
        &problem,
    ))
}

/// The error for a damaged part of a file.
pub(crate) fn corrupt(path: &Path, what: &str, problem: &str) -> Error {
    Error::InvalidArgument(format!("{}: corrupt {what}: {problem}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panicking_decoder_becomes_an_error_naming_the_file() {
        let err = guarded(Path::new("x.parquet"), || -> Result<()> {
            panic!("column start and length should not be negative")
        })
        .expect_err("caught");
        assert_eq!(
            err.to_string(),
            "x.parquet: corrupt data: the decoder stopped on it (column start and length \
             should not be negative)"
        );
        assert_eq!(DECODING.with(Cell::get), 0);
        let mut items = guarded_iter(
            "y.arrow".into(),
            [Ok(1), Ok(2)].into_iter().map(|i: Result<i32>| {
                if matches!(i, Ok(2)) {
                    panic!("bad page")
                }
                i
            }),
        );
        assert_eq!(items.next().map(|r| r.ok()), Some(Some(1)));
        assert!(matches!(items.next(), Some(Err(_))));
        assert!(items.next().is_none());
    }
}
