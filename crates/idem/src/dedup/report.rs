//! What a dedup reports: its counts, per input file and in all (`--stats`), and what the
//! two passes found besides their rows, for the jobs built on them.

use std::time::Instant;

use arrow::datatypes::SchemaRef;
use idem_core::DedupStats;
use serde::Serialize;

use super::DedupJob;
use crate::read::input::InputFile;
use crate::state::StateReport;
use crate::units::thousands;

/// Rows read from one input file, and what became of them.
#[derive(Debug, Clone, Serialize)]
pub struct FileRows {
    /// The file.
    pub path: String,
    /// Its rows.
    pub rows: u64,
    /// Its rows in the result: winners (and tombstones, where kept). Absent when the rows
    /// were not deduplicated (a merge found the batch already applied).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kept: Option<u64>,
    /// Its rows not in the result: duplicates, superseded versions, deletes and null keys.
    /// A file whose share jumps points at the producer that re-sent it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dropped: Option<u64>,
}

impl FileRows {
    /// A file's counts; `kept` when its rows were deduplicated.
    pub(crate) fn new(file: &InputFile, kept: Option<u64>) -> Self {
        let rows = file.num_rows();
        Self {
            path: file.path().display().to_string(),
            rows,
            kept,
            dropped: kept.map(|k| rows.saturating_sub(k)),
        }
    }
}

/// The statistics of a dedup run; `--stats` writes it as JSON.
#[derive(Debug, Clone, Serialize)]
pub struct DedupReport {
    /// The counts: rows in and out, duplicates, superseded, deleted, conflicts, …
    #[serde(flatten)]
    pub stats: DedupStats,
    /// Number of input files.
    pub input_files: usize,
    /// `(duplicates + superseded) / rows_in`.
    pub duplicate_rate: f64,
    /// Key columns.
    pub key: Vec<String>,
    /// Version columns.
    pub version: Vec<String>,
    /// Tie policy.
    pub on_tie: String,
    /// The output path.
    pub output: String,
    /// Files written.
    pub output_files: Vec<String>,
    /// Rows per input file, in input order.
    pub inputs: Vec<FileRows>,
    /// Bytes held by the keep-max table at its largest.
    pub table_bytes: u64,
    /// `--memory-limit` in bytes, if one was given.
    pub memory_limit: Option<u64>,
    /// Key partitions pass 1 ran in: 1 in memory, more when the limit made it spill.
    pub key_partitions: u32,
    /// Wall time of the first pass (reading keys and versions, deciding winners).
    pub decide_seconds: f64,
    /// Wall time of the second pass (fetching winners, writing, committing).
    pub write_seconds: f64,
    /// Wall time of the whole job.
    pub elapsed_seconds: f64,
    /// What the state across runs did (`--state`). With it, `rows_out` counts the rows
    /// written and `state.dropped()` the winners it held back.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<StateReport>,
    /// Where the job ran, when on a cluster (`--cluster`). Per-file `kept` counts are not
    /// known there: only each file's rows are reported.
    #[cfg(feature = "ballista")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster: Option<ClusterRun>,
}

impl DedupReport {
    /// The one-line summary the CLI prints after a run.
    pub fn summary(&self) -> String {
        let report = self;
        if let Some(state) = report.state.as_ref().filter(|s| s.already_applied) {
            return format!(
                "idem: these inputs were already applied to state {} (version {}): nothing to do",
                state.location, state.version
            );
        }
        let state = report.state.as_ref().map_or_else(String::new, |s| {
            format!(
                "; state: {} seen before, {} late, {} evicted then seen, {} keys ({} bytes)",
                thousands(s.seen_before),
                thousands(s.late),
                thousands(s.evicted_then_seen),
                thousands(s.keys),
                thousands(s.bytes)
            )
        });
        format!(
            "idem: {} rows in → {} out ({} duplicates, {} superseded, {} deleted, {} conflicts) from {} files in {:.2} s → {}",
            thousands(report.stats.rows_in),
            thousands(report.stats.rows_out),
            thousands(report.stats.duplicates),
            thousands(report.stats.superseded),
            thousands(report.stats.deleted),
            thousands(report.stats.conflicts),
            report.input_files,
            report.elapsed_seconds,
            report.output
        ) + &state
    }

    pub(crate) fn new(job: &DedupJob, run: &DedupRun) -> Self {
        let stats = run.stats;
        Self {
            stats,
            input_files: run.files.len(),
            duplicate_rate: stats.duplicate_rate(),
            key: job.spec.keys.clone(),
            version: job.spec.versions.clone(),
            on_tie: job.spec.options.on_tie.to_string(),
            output: job.output.clone(),
            output_files: Vec::new(),
            inputs: run.file_rows(),
            table_bytes: 0,
            memory_limit: job.memory_limit,
            key_partitions: 1,
            decide_seconds: 0.0,
            write_seconds: 0.0,
            elapsed_seconds: 0.0,
            state: None,
            #[cfg(feature = "ballista")]
            cluster: None,
        }
    }
}

/// What a dedup of some inputs found, besides its rows.
pub(crate) struct DedupRun {
    /// The inputs, opened.
    pub files: Vec<InputFile>,
    /// Their unified schema, the schema of the rows.
    pub schema: SchemaRef,
    /// The counts, conflicts included.
    pub stats: DedupStats,
    /// Rows of each file in the result.
    pub kept_per_file: Vec<u64>,
    /// Key partitions of the first pass.
    pub key_partitions: u32,
    /// The key table's largest size.
    pub table_bytes: u64,
    /// Wall time of the first pass.
    pub decide_seconds: f64,
    /// When the second pass started.
    pub fetch_started: Instant,
}

impl DedupRun {
    /// Each input's rows, kept and dropped, in input order.
    pub fn file_rows(&self) -> Vec<FileRows> {
        self.files
            .iter()
            .zip(&self.kept_per_file)
            .map(|(file, &kept)| FileRows::new(file, Some(kept)))
            .collect()
    }
}

/// Where a dedup ran, when on a cluster (`--cluster`): filled in by [`crate::cluster`].
#[cfg(feature = "ballista")]
#[derive(Debug, Clone, Serialize)]
pub struct ClusterRun {
    /// The scheduler, `df://host:port`.
    pub scheduler: String,
    /// Key partitions: tasks of the dedup stage.
    pub partitions: usize,
    /// Parts the executors wrote.
    pub parts: usize,
}
