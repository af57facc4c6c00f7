//! # idem: dedup jobs on files
//!
//! The job layer of idem: it finds and opens input files (Parquet and Arrow IPC; files,
//! directories, globs, Delta tables), unifies their schemas, runs the [`idem_core`] kernels
//! over them in two passes (keys and versions first, then only the winning rows), and
//! writes the result as Parquet under a temporary name that is renamed into place only on
//! success — or merges it into a table.
//!
//! * [`run_dedup`] with a [`DedupJob`]: the `idem dedup` command.
//! * [`run_verify`] with a [`VerifyJob`]: `idem verify`, reconciliation of a target with its
//!   sources.
//! * [`run_merge`] with a [`MergeJob`]: `idem merge`, idempotent upserts into a Delta Lake
//!   table (feature `delta`) or a PostgreSQL table (feature `postgres`).
//! * [`storage`]: inputs and outputs on object storage (`s3://`, `gs://`, `az://`).
//! * [`generate()`]: seeded, realistic event data for samples, tests and benchmarks.
//!
//! ```
//! use idem::{DedupJob, NoProgress, run_dedup};
//!
//! // The sample events committed with idem: 6,000 rows in three files.
//! let events = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/events");
//! let out = tempfile::tempdir()?;
//! let output = out.path().join("events-dedup.parquet").display().to_string();
//!
//! let mut job = DedupJob::new(vec![events.into()], &output);
//! job.spec.options.deletes = Some(idem::idem_core::DeletePolicy::new("op"));
//! let report = run_dedup(&job, &NoProgress)?;
//! let stats = report.stats;
//! assert_eq!(stats.rows_in, 6_000);
//! assert_eq!(
//!     stats.rows_in,
//!     stats.rows_out + stats.duplicates + stats.superseded + stats.deleted
//! );
//!
//! // A dedup of its own output changes nothing.
//! let again = DedupJob::new(vec![output.clone()], format!("{output}.again.parquet"));
//! assert_eq!(run_dedup(&again, &NoProgress)?.stats.rows_out, stats.rows_out);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Layers
//!
//! The modules form layers, and imports point down only: a module may use what is below
//! it, never what is above or beside it among the jobs. `tests/layers.rs` checks that the
//! module graph has no cycle.
//!
//! ```text
//!  front ends   cluster (Ballista), sql (DataFusion)   observe (metrics, report)
//!  jobs         merge (semantics; targets: delta, postgres)   verify
//!               dedup (the two passes, and the `idem dedup` job)
//!  state        state (keys emitted by earlier runs)
//!  I/O          read (inputs, schemas, decoding, Delta logs)   write (Parquet, publishing)
//!               pg (PostgreSQL connections, types, binary COPY)
//!  base         storage, progress, units, error, generate          ── idem-core below all
//! ```
//!
//! A type two layers need lives in the lower one (a file's row plan in `dedup::plan`, the
//! run report in `dedup::report`, the winner filter in `state`), and a job never imports
//! another job's internals: merge and verify use the dedup's two passes through
//! `dedup_rows`, and the dedup does not know the cluster that runs it.

#[cfg(feature = "ballista")]
pub mod cluster;
#[cfg(feature = "sql")]
mod datafusion_runtime;
mod dedup;
mod error;
pub mod generate;
#[cfg(any(feature = "delta", feature = "postgres"))]
mod merge;
pub mod observe;
mod pg;
mod progress;
pub mod read;
#[cfg(feature = "sql")]
mod sql;
mod state;
pub mod storage;
mod units;
mod verify;
pub mod write;

pub use dedup::{DEFAULT_MAX_ROWS_PER_FILE, DedupJob, DedupReport, FileRows, run_dedup};
pub use error::{Error, Result, error_line};
pub use generate::{GenerateOptions, generate, generate_to};
pub use idem_core;
#[cfg(any(feature = "delta", feature = "postgres"))]
pub use merge::{
    DEFAULT_ROWS_PER_TABLE_FILE, DEFAULT_TOMBSTONE_RETENTION, MergeJob, MergeReport, run_merge,
};
#[cfg(feature = "delta")]
pub use merge::{VacuumReport, run_vacuum};
pub use observe::{ReportOptions, check_report, metrics, write_report};
pub use pg::redact_location;
pub use progress::{NoProgress, Progress};
pub use read::quiet_decoder_panics;
#[cfg(feature = "sql")]
pub use sql::{SqlOutput, SqlRun, format_table, run_sql, run_sql_on, session};
pub use state::{LatePolicy, StateOptions, StateReport};
pub use units::{parse_duration, parse_size, thousands};
pub use verify::{RowDifference, VerifyJob, VerifyReport, run_verify};
pub use write::OutputWriter;
