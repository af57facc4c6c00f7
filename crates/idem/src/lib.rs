//! # idem: dedup jobs on files
//!
//! The job layer of idem: it finds and opens input files (Parquet and Arrow IPC; files,
//! directories, globs), unifies their schemas, runs the [`idem_core`] kernels over them in
//! two passes (keys and versions first, then only the winning rows), and writes the result
//! as Parquet under a temporary name that is renamed into place only on success.
//!
//! * [`run_dedup`] with a [`DedupJob`]: the `idem dedup` command.
//! * [`run_verify`] with a [`VerifyJob`]: `idem verify`, reconciliation of a target with its
//!   sources.
//! * [`run_merge`] with a [`MergeJob`]: `idem merge`, idempotent upserts into a Delta Lake
//!   table (feature `delta`).
//! * [`storage`]: inputs and outputs on object storage (`s3://`, `gs://`, `az://`).
//! * [`generate()`]: seeded, realistic event data for samples, tests and benchmarks.
//!
//! ```no_run
//! use idem::{DedupJob, NoProgress, run_dedup};
//! let job = DedupJob::new(vec!["data/events".into()], "/tmp/events-dedup.parquet");
//! let report = run_dedup(&job, &NoProgress)?;
//! println!("{} rows in, {} out", report.stats.rows_in, report.stats.rows_out);
//! # Ok::<(), idem::Error>(())
//! ```

mod bounds;
mod chunk_settings;
#[cfg(feature = "ballista")]
pub mod cluster;
mod columns;
mod columnwise;
mod decide;
mod decoding;
mod dedup;
mod direct;
mod duration;
mod error;
pub mod generate;
pub mod input;
mod ipc_schema;
#[cfg(feature = "delta")]
mod merge;
pub mod metrics;
mod output;
mod report;
pub mod schema;
#[cfg(feature = "sql")]
mod sql;
mod state;
pub mod storage;
mod verify;

pub use decoding::quiet_decoder_panics;
pub use dedup::{
    DEFAULT_MAX_ROWS_PER_FILE, DedupJob, DedupReport, FileRows, NoProgress, Progress, run_dedup,
};
pub use duration::parse_duration;
pub use error::{Error, Result};
pub use generate::{GenerateOptions, generate, generate_to};
pub use idem_core;
#[cfg(feature = "delta")]
pub use merge::{
    DEFAULT_ROWS_PER_TABLE_FILE, DEFAULT_TOMBSTONE_RETENTION, MergeJob, MergeReport, VacuumReport,
    run_merge, run_vacuum,
};
pub use output::OutputWriter;
pub use report::{ReportOptions, check_report, write_report};
#[cfg(feature = "sql")]
pub use sql::{SqlOutput, SqlRun, format_table, run_sql, run_sql_on, session};
pub use state::{LatePolicy, StateOptions, StateReport};
pub use verify::{RowDifference, VerifyJob, VerifyReport, run_verify};
