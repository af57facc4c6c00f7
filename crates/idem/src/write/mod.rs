//! Writing: zstd Parquet that is the same bytes for the same rows, published atomically.
//!
//! * [`output`]: [`OutputWriter`], one file or a directory of parts, written under a
//!   temporary name and renamed (or uploaded) into place on commit;
//! * `properties`: the writer settings of every file idem writes;
//! * `columns`: the writer that encodes and compresses columns on two threads, and
//!   `chunk_settings`: its per-column choices; `bounds`: the statistics it computes;
//! * `by_field`: writing a file one field at a time from a column source (wide schemas);
//! * `direct`: the output file, with O_DIRECT where the disk allows;
//! * `publish`: renames, syncs, staged uploads.
//!
//! It may import `storage`, `error` and idem-core, never the reading
//! layer or a job: what it writes comes to it as batches or through a `ColumnSource`.

pub(crate) mod bounds;
pub(crate) mod by_field;
pub(crate) mod chunk_settings;
pub(crate) mod columns;
pub(crate) mod direct;
pub mod output;
pub(crate) mod properties;
pub(crate) mod publish;

pub use output::OutputWriter;
