//! `idem merge`: idempotent upserts of event batches into a table — the semantics, the
//! same for every target.
//!
//! ```text
//!  batch     inputs ──dedup (tombstones kept)──▶ one winner per key ──▶ KeyedRows, in the
//!            types the target stores
//!  state     the target as of one version: its rows' keys, the tombstone state, the
//!            fingerprints of the batches applied to it
//!  guard     winner vs live tombstone: an update at or below a delete's version is blocked
//!  find      the target's versions of the batch's keys (the target finds them its way)
//!  decide    strictly newer: update / delete; otherwise stale; absent: insert
//!  commit    the target applies the decisions, the new tombstone state and the batch's
//!            fingerprint (the run marker) in one atomic step against the version read —
//!            if another writer got there first, start again from `state`
//! ```
//!
//! A target is a [`Target`]: `delta` (Delta Lake tables, feature `delta`) and `postgres`
//! (PostgreSQL tables, feature `postgres`) are the two. The semantics
//! here import the dedup and the reading layer; a target may import those and the
//! writing layer, never another target.

mod convert;
#[cfg(feature = "delta")]
mod delta;
mod keyed;
#[cfg(feature = "postgres")]
mod postgres;
mod target;
mod tombstones;

#[cfg(feature = "delta")]
pub use delta::{VacuumReport, run_vacuum};

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::{RecordBatch, RecordBatchOptions};
use arrow::compute::concat_batches;
use arrow::datatypes::{Field, Schema, SchemaRef};
use idem_core::{DedupSpec, DedupStats};
use serde::Serialize;

use crate::dedup::{DedupJob, FileRows, dedup_rows};
use crate::error::{Error, Result};
use crate::progress::Progress;
use crate::read::expand::expand_inputs;
use crate::read::input::{InputFile, fingerprint};
use crate::storage::StorageOptions;
use crate::units::{now_millis, thousands};
use keyed::KeyedRows;
use target::{Attempt, Change, FoundVersions, Target};
use tombstones::next_tombstones;

/// Default tombstone retention: 7 days.
pub const DEFAULT_TOMBSTONE_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// Default rows per data file written by a merge.
pub const DEFAULT_ROWS_PER_TABLE_FILE: usize = 1 << 20;

/// What to merge into which table, and how.
#[derive(Debug, Clone)]
pub struct MergeJob {
    /// Files, directories or globs of the batch.
    pub inputs: Vec<String>,
    /// The target: a Delta table's path or URL (created if absent), or a PostgreSQL
    /// database as `postgres://…` with the table in [`MergeJob::target_table`].
    pub table: String,
    /// The table in a database target, `[SCHEMA.]NAME` (created if absent).
    pub target_table: Option<String>,
    /// Key, version and policies, as for a dedup.
    pub spec: DedupSpec,
    /// At table creation: cluster rows into this many files by key hash (per partition).
    pub buckets: Option<u32>,
    /// At table creation: partition the table by these columns (Hive-style directories).
    pub partition_by: Vec<String>,
    /// How long a delete keeps blocking older updates of its key.
    pub tombstone_retention: Duration,
    /// Rows per new data file (unbucketed tables).
    pub max_rows_per_file: usize,
    /// Configuration of object stores.
    pub storage: StorageOptions,
    /// Attempts before giving up when other writers keep committing first.
    pub max_attempts: u32,
}

impl MergeJob {
    /// A job with the default spec and settings.
    pub fn new(inputs: Vec<String>, table: impl Into<String>) -> Self {
        Self {
            inputs,
            table: table.into(),
            target_table: None,
            spec: DedupSpec::default(),
            buckets: None,
            partition_by: Vec::new(),
            tombstone_retention: DEFAULT_TOMBSTONE_RETENTION,
            max_rows_per_file: DEFAULT_ROWS_PER_TABLE_FILE,
            storage: StorageOptions::default(),
            max_attempts: 10,
        }
    }
}

/// What a merge did; `--stats` writes it as JSON.
///
/// Every distinct key of the batch is counted once in exactly one of `inserted`, `updated`,
/// `deleted`, `deletes_without_row`, `stale` and `resurrections_blocked`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct MergeReport {
    /// The table: as given for a Delta table, `schema.name` in a database.
    pub table: String,
    /// The database of a PostgreSQL target, as `postgres://user@host:port/database`
    /// (never with a password).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub database: Option<String>,
    /// Rows read from the batch's files.
    pub rows_in: u64,
    /// Batch rows dropped as exact duplicates of a kept row (same key and version).
    pub duplicates: u64,
    /// Batch rows dropped because the batch has a newer version of their key.
    pub superseded: u64,
    /// Keys whose tied rows at the maximum version differ.
    pub conflicts: u64,
    /// Batch rows with a null key column.
    pub null_keys: u64,
    /// Distinct keys in the batch.
    pub distinct_keys: u64,
    /// `(duplicates + superseded) / rows_in`.
    pub duplicate_rate: f64,
    /// Keys new to the table.
    pub inserted: u64,
    /// Table rows replaced by a strictly newer version.
    pub updated: u64,
    /// Table rows removed by a strictly newer delete.
    pub deleted: u64,
    /// Deletes of keys the table does not hold (remembered as tombstones).
    pub deletes_without_row: u64,
    /// Batch winners at or below the version the table (or a tombstone) already has:
    /// replays, dropped.
    pub stale: u64,
    /// Updates dropped because a remembered delete of their key is at least as new.
    pub resurrections_blocked: u64,
    /// Tombstones remembered after the merge.
    pub tombstones: u64,
    /// Tombstones that passed the retention horizon and were forgotten.
    pub tombstones_expired: u64,
    /// Data files in the table before the merge.
    pub table_files: u64,
    /// Rows in the table after the merge (from the files' statistics; absent when a file
    /// has none).
    pub table_rows: Option<u64>,
    /// Files whose key and version columns were read.
    pub files_scanned: u64,
    /// Files skipped by bucket or key statistics.
    pub files_pruned: u64,
    /// Files replaced by rewritten ones.
    pub files_removed: u64,
    /// Files written.
    pub files_added: u64,
    /// Unchanged rows copied from removed files into new ones.
    pub rows_rewritten: u64,
    /// Table version after the merge (the committed one, or the one found unchanged).
    pub table_version: Option<u64>,
    /// Whether this run created the table.
    pub created: bool,
    /// Whether this run committed a new table version.
    pub committed: bool,
    /// Whether the batch had been applied before (same files, same policy): nothing done.
    pub already_applied: bool,
    /// The batch's fingerprint (input files with size and ETag / mtime, and the policy).
    pub fingerprint: String,
    /// Commit attempts (more than one when other writers committed first).
    pub attempts: u32,
    /// Key columns.
    pub key: Vec<String>,
    /// Version columns.
    pub version: Vec<String>,
    /// Number of input files.
    pub input_files: usize,
    /// Rows per input file.
    pub inputs: Vec<FileRows>,
    /// Wall time of the whole job.
    pub elapsed_seconds: f64,
}

impl MergeReport {
    /// The one-line summary the CLI prints after a merge.
    pub fn summary(&self) -> String {
        let version = self.table_version.map_or("-".to_owned(), |v| v.to_string());
        if self.already_applied {
            format!(
                "idem: already applied: this batch (fingerprint {}) is in {} as of version {version}; nothing to do",
                self.fingerprint, self.table
            )
        } else {
            let counts = format!(
                "idem: {} rows in → {} inserted, {} updated, {} deleted, {} stale, {} resurrections blocked",
                thousands(self.rows_in),
                thousands(self.inserted),
                thousands(self.updated),
                thousands(self.deleted),
                thousands(self.stale),
                thousands(self.resurrections_blocked),
            );
            let (committed, unchanged) = if self.database.is_some() {
                ("committed as run", "nothing to commit; last run")
            } else {
                ("committed version", "nothing to commit; table at version")
            };
            let files = if self.database.is_some() {
                String::new()
            } else {
                format!(
                    "; {} files rewritten, {} added",
                    self.files_removed, self.files_added
                )
            };
            format!(
                "{counts}{files}; {} {version} in {:.2} s",
                if self.committed { committed } else { unchanged },
                self.elapsed_seconds
            )
        }
    }
}

/// The batch, deduplicated and indexed, ready to meet the table.
struct Batch {
    /// One row per key, in the target's stored types.
    winners: KeyedRows,
    /// Whether each winner is a delete.
    tombstone: Vec<bool>,
    /// The winners' schema.
    schema: SchemaRef,
    /// The spec, with tombstones kept.
    spec: DedupSpec,
    /// The batch's input files and policy, hashed: the run marker.
    fingerprint: String,
}

/// Runs a merge. The table changes by exactly one commit, or not at all.
///
/// # Errors
/// Bad inputs (as for a dedup), a batch whose schema or policy does not fit the table, a
/// table idem cannot rewrite (partitioned, deletion vectors, column mapping), a storage
/// failure, or other writers winning every one of `max_attempts` commits.
pub fn run_merge(job: &MergeJob, progress: &dyn Progress) -> Result<MergeReport> {
    if crate::pg::is_postgres_url(&job.table) {
        #[cfg(feature = "postgres")]
        {
            let table = job.target_table.as_deref().ok_or_else(|| {
                Error::InvalidArgument("a PostgreSQL target needs --table [SCHEMA.]NAME".to_owned())
            })?;
            let target = postgres::PostgresTarget::open(&job.table, table)?;
            return merge_into(target, job, progress);
        }
        #[cfg(not(feature = "postgres"))]
        return Err(Error::InvalidArgument(
            "this idem was built without PostgreSQL targets (feature `postgres`)".to_owned(),
        ));
    }
    if job.target_table.is_some() {
        return Err(Error::InvalidArgument(format!(
            "{}: --table names a table in a database (postgres://…); a Delta table is the --into path itself",
            job.table
        )));
    }
    #[cfg(feature = "delta")]
    {
        let target = delta::DeltaTarget::open(&job.table, &job.storage)?;
        merge_into(target, job, progress)
    }
    #[cfg(not(feature = "delta"))]
    Err(Error::InvalidArgument(format!(
        "{}: this idem was built without Delta targets (feature `delta`)",
        job.table
    )))
}

/// [`run_merge`] into one target.
fn merge_into<T: Target>(
    mut target: T,
    job: &MergeJob,
    progress: &dyn Progress,
) -> Result<MergeReport> {
    let started = Instant::now();
    let name = target.report_name(job);
    let database = target.database();
    // A batch applied before is recognised from its files alone, before any row is read.
    let files: Vec<InputFile> = expand_inputs(&job.inputs, &job.storage)?
        .iter()
        .map(InputFile::open)
        .collect::<Result<_>>()?;
    let early = fingerprint(&files, &job.spec)?;
    if let Some(version) = target.prepare(job, &early)? {
        return Ok(MergeReport {
            table: name,
            database,
            rows_in: files.iter().map(InputFile::num_rows).sum(),
            already_applied: true,
            table_version: Some(version),
            fingerprint: early,
            attempts: 1,
            key: job.spec.keys.clone(),
            version: job.spec.versions.clone(),
            input_files: files.len(),
            inputs: files.iter().map(|f| FileRows::new(f, None)).collect(),
            elapsed_seconds: started.elapsed().as_secs_f64(),
            ..MergeReport::default()
        });
    }
    drop(files);
    let (batch, stats, inputs) = read_batch(job, &target, progress)?;
    let mut report = MergeReport {
        table: name.clone(),
        database,
        rows_in: stats.rows_in,
        duplicates: stats.duplicates,
        superseded: stats.superseded,
        conflicts: stats.conflicts,
        null_keys: stats.null_keys,
        distinct_keys: stats.distinct_keys,
        duplicate_rate: stats.duplicate_rate(),
        fingerprint: batch.fingerprint.clone(),
        key: job.spec.keys.clone(),
        version: job.spec.versions.clone(),
        input_files: inputs.len(),
        inputs,
        ..MergeReport::default()
    };
    progress.phase("merging", batch.winners.len() as u64);
    for attempt in 1..=job.max_attempts.max(1) {
        report.attempts = attempt;
        match merge_once(&target, job, &batch, &mut report)? {
            Attempt::Done => {
                report.elapsed_seconds = started.elapsed().as_secs_f64();
                return Ok(report);
            }
            Attempt::Conflict => {
                // Spread retries of writers that collided, deterministically per process.
                let jitter = u64::from(std::process::id() % 97);
                std::thread::sleep(Duration::from_millis(20 * u64::from(attempt) + jitter));
            }
        }
    }
    Err(Error::InvalidArgument(format!(
        "{name}: other writers committed first {} times in a row; nothing was changed by this run",
        job.max_attempts
    )))
}

/// Dedups the batch's files with tombstones kept, converts the winners to the types the
/// target stores, and indexes them.
fn read_batch(
    job: &MergeJob,
    target: &impl Target,
    progress: &dyn Progress,
) -> Result<(Batch, DedupStats, Vec<FileRows>)> {
    let mut spec = job.spec.clone();
    if let Some(deletes) = spec.options.deletes.as_mut() {
        deletes.keep_tombstones = true;
    }
    let dedup = DedupJob {
        inputs: job.inputs.clone(),
        output: target.report_name(job),
        spec: spec.clone(),
        max_rows_per_file: usize::MAX,
        memory_limit: None,
        storage: job.storage.clone(),
        state: None,
    };
    let (batches, run) = dedup_rows(
        &dedup,
        progress,
        |_| Ok(Vec::new()),
        |batches: &mut Vec<RecordBatch>, kept| {
            batches.push(kept);
            Ok(())
        },
    )?;
    let schema = nullable(&run.schema);
    let where_ = target.display();
    let batches = batches
        .iter()
        .map(|b| relabel(b, &schema))
        .collect::<Result<Vec<_>>>()?;
    let rows = concat_batches(&schema, &batches).map_err(Error::arrow(&where_))?;
    drop(batches);
    // The dedup compared the batch's own types; the conversions are order-preserving and
    // injective, so the winners stay the winners, and from here on the batch and the
    // table's rows are compared in one representation.
    let rows = target.to_stored(&rows)?;
    let schema = rows.schema();
    let tombstone = tombstone_mask(&rows, &spec).map_err(Error::arrow(&where_))?;
    let winners =
        KeyedRows::try_new(rows, &spec.keys, &spec.versions).map_err(Error::arrow(&where_))?;
    let fingerprint = fingerprint(&run.files, &job.spec)?;
    let inputs = run.file_rows();
    Ok((
        Batch {
            winners,
            tombstone,
            schema,
            spec,
            fingerprint,
        },
        run.stats,
        inputs,
    ))
}

/// Table columns are nullable, as Delta writers make them: a later batch may have nulls
/// where the first had none.
fn nullable(schema: &SchemaRef) -> SchemaRef {
    let fields: Vec<Field> = schema
        .fields()
        .iter()
        .map(|f| f.as_ref().clone().with_nullable(true))
        .collect();
    Arc::new(Schema::new(fields))
}

/// The same columns under `schema` (which differs only in nullability and metadata).
fn relabel(batch: &RecordBatch, schema: &SchemaRef) -> Result<RecordBatch> {
    let options = RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
    RecordBatch::try_new_with_options(Arc::clone(schema), batch.columns().to_vec(), &options)
        .map_err(Error::arrow(""))
}

/// Which rows are deletes under the spec's policy (compared as text, like the dedup).
fn tombstone_mask(rows: &RecordBatch, spec: &DedupSpec) -> arrow::error::Result<Vec<bool>> {
    let mut mask = Vec::with_capacity(rows.num_rows());
    match &spec.options.deletes {
        None => mask.resize(rows.num_rows(), false),
        Some(deletes) => {
            let op = rows.column_by_name(&deletes.op_column).ok_or_else(|| {
                arrow::error::ArrowError::SchemaError(format!(
                    "op column '{}' not found",
                    deletes.op_column
                ))
            })?;
            deletes.mark_tombstones(op, &mut mask)?;
        }
    }
    Ok(mask)
}

/// What the batch does to one winner's key.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Outcome {
    Insert,
    Update,
    Delete,
    DeleteWithoutRow,
    Stale,
    Blocked,
}

/// One attempt: the target as of one version, the guard, the decisions, and the target's
/// commit of them.
fn merge_once<T: Target>(
    target: &T,
    job: &MergeJob,
    batch: &Batch,
    report: &mut MergeReport,
) -> Result<Attempt> {
    let snapshot = target.snapshot(job, batch)?;
    let (table_files, table_rows) = target.size(&snapshot);
    report.table_files = table_files;
    if let Some(version) = target.applied_in(&snapshot, &batch.fingerprint)? {
        report.already_applied = true;
        report.table_version = Some(version);
        return Ok(Attempt::Done);
    }
    let now = now_millis();
    let tombstones = target.tombstones(&snapshot, batch, job.tombstone_retention, now)?;
    report.tombstones_expired = tombstones.expired;
    let winners = &batch.winners;

    // Guard against resurrections first: a remembered delete at or above a winner's version.
    let mut outcome: Vec<Option<Outcome>> = vec![None; winners.len()];
    let mut tombstone_of: Vec<Option<u32>> = vec![None; winners.len()];
    if let Some(known) = &tombstones.rows {
        for row in 0..winners.len() {
            if let Some(t) = known.find(winners.hash(row), winners.key(row)) {
                tombstone_of[row] = Some(t);
                if winners.version(row) <= known.version(t as usize) {
                    outcome[row] = Some(if batch.tombstone[row] {
                        Outcome::Stale
                    } else {
                        Outcome::Blocked
                    });
                }
            }
        }
    }

    // Find the table rows the batch meets.
    let found = target.find(&snapshot, batch, &outcome, report)?;
    let width = winners.version_width();
    for (row, decided) in outcome.iter_mut().enumerate() {
        if decided.is_some() {
            continue;
        }
        let newer = found
            .version(row, width)
            .is_none_or(|v| winners.version(row) > v);
        let present = found.version(row, width).is_some();
        *decided = Some(match (batch.tombstone[row], present, newer) {
            (_, true, false) => Outcome::Stale,
            (true, true, true) => Outcome::Delete,
            (true, false, _) => Outcome::DeleteWithoutRow,
            (false, true, true) => Outcome::Update,
            (false, false, _) => Outcome::Insert,
        });
    }
    let outcome: Vec<Outcome> = outcome
        .into_iter()
        .map(|o| o.unwrap_or(Outcome::Stale))
        .collect();
    let count = |o: Outcome| outcome.iter().filter(|x| **x == o).count() as u64;
    report.inserted = count(Outcome::Insert);
    report.updated = count(Outcome::Update);
    report.deleted = count(Outcome::Delete);
    report.deletes_without_row = count(Outcome::DeleteWithoutRow);
    report.stale = count(Outcome::Stale);
    report.resurrections_blocked = count(Outcome::Blocked);
    report.table_rows =
        table_rows.map(|rows| (rows + report.inserted).saturating_sub(report.deleted));

    // The tombstone state after this batch: deletes are remembered (replacing an older
    // tombstone of the key), updates and inserts newer than a tombstone end it.
    let remembers = |o: Outcome| matches!(o, Outcome::Delete | Outcome::DeleteWithoutRow);
    let ends = |o: Outcome| matches!(o, Outcome::Insert | Outcome::Update);
    let new_tombstones: Vec<u32> = (0..winners.len())
        .filter(|&r| remembers(outcome[r]))
        .map(|r| r as u32)
        .collect();
    let mut forgotten: BTreeSet<u32> = BTreeSet::new();
    for row in 0..winners.len() {
        if let Some(t) = tombstone_of[row]
            && (remembers(outcome[row]) || ends(outcome[row]))
        {
            forgotten.insert(t);
        }
    }
    let tombstones_change = !new_tombstones.is_empty() || !forgotten.is_empty();
    let data_change = report.inserted + report.updated + report.deleted > 0;
    let kept_tombstones =
        tombstones.rows.as_ref().map_or(0, |t| t.len() as u64) - forgotten.len() as u64;
    report.tombstones = kept_tombstones + new_tombstones.len() as u64;
    let exists = target.version(&snapshot).is_some();
    if !data_change && !tombstones_change {
        report.committed = false;
        report.table_version = target.version(&snapshot);
        return Ok(Attempt::Done);
    }
    // A new target records its (possibly empty) tombstone state from the start.
    let next = if tombstones_change || !exists {
        next_tombstones(batch, &tombstones, &new_tombstones, &forgotten, now)?
    } else {
        None
    };
    let change = Change {
        outcome: &outcome,
        found: &found,
        data_change,
        tombstones: next,
        now,
    };
    let attempt = target.commit(job, &snapshot, batch, change, report)?;
    if let Attempt::Done = attempt {
        report.created = !exists;
        report.committed = true;
    }
    Ok(attempt)
}
