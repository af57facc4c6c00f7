//! `idem merge`: idempotent upserts of event batches into a Delta Lake table.
//!
//! ```text
//!  batch     inputs ──dedup (tombstones kept)──▶ one winner per key ──▶ KeyedRows
//!  state     table snapshot: files + stats, the tombstone state file, applied fingerprints
//!  guard     winner vs live tombstone: an update at or below a delete's version is blocked
//!  find      files that may hold batch keys (bucket, key statistics) ──key + version
//!            columns only──▶ which table rows the batch meets, at which versions
//!  decide    strictly newer: update / delete; otherwise stale; absent: insert
//!  write     files holding replaced or deleted rows are rewritten without them; new rows
//!            go to new files sorted by key (one file per touched bucket with --buckets)
//!  commit    one Delta transaction: remove + add, the new tombstone state (table
//!            metadata), and the batch's fingerprint (an application `txn`), against the
//!            version read — if another writer got there first, start again from `state`
//! ```
//!
//! Every commit is made against the exact version it read (no automatic rebase), so two
//! concurrent merges serialise: the loser re-reads and re-decides, and no key is lost or
//! duplicated. Files written by a merge that does not commit (a conflict, an error, a kill)
//! are never referenced by the log, so readers cannot see them; `idem vacuum` removes them.

mod keyed;
mod table;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::{
    Array, ArrayRef, BooleanArray, Int64Array, RecordBatch, RecordBatchOptions, UInt32Array,
};
use arrow::compute::{
    SortColumn, concat_batches, filter_record_batch, lexsort_to_indices, take_record_batch,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use deltalake_core::kernel::engine::arrow_conversion::{TryFromArrow, TryIntoArrow};
use deltalake_core::kernel::transaction::{CommitBuilder, CommitProperties, TransactionError};
use deltalake_core::kernel::{Action, Add, MetadataExt, Remove, StructType, Transaction};
use deltalake_core::protocol::{DeltaOperation, MergePredicate, SaveMode};
use deltalake_core::{DeltaTable, DeltaTableError};
use idem_core::{DedupSpec, DedupStats};
use serde::Serialize;
use serde_json::{Value, json};

use crate::dedup::{DedupJob, FileRows, Progress, dedup_rows};
use crate::error::{Error, Result};
use crate::input::{InputFile, InputSource};
use crate::schema::conform;
use crate::storage::StorageOptions;
use keyed::{KeyedRows, key_hashes};
use table::{Table, now_millis};

/// Table property: the key columns the table was created with.
const KEY_PROPERTY: &str = "idem.key";
/// Table property: the version columns.
const VERSION_PROPERTY: &str = "idem.version";
/// Table property: number of buckets, when rows are clustered into files by key hash.
const BUCKETS_PROPERTY: &str = "idem.buckets";
/// Table property: the tombstone state file of this table version (relative path, or empty).
const TOMBSTONES_PROPERTY: &str = "idem.tombstones";
/// Column of the tombstone state: when the delete was applied, milliseconds since the epoch.
const DELETED_AT: &str = "_idem_deleted_at_ms";
/// Default tombstone retention: 7 days.
pub const DEFAULT_TOMBSTONE_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// Default rows per data file written by a merge.
pub const DEFAULT_ROWS_PER_TABLE_FILE: usize = 1 << 20;

/// What to merge into which table, and how.
#[derive(Debug, Clone)]
pub struct MergeJob {
    /// Files, directories or globs of the batch.
    pub inputs: Vec<String>,
    /// The Delta table: a local path or a URL (created if absent).
    pub table: String,
    /// Key, version and policies, as for a dedup.
    pub spec: DedupSpec,
    /// At table creation: cluster rows into this many files by key hash.
    pub buckets: Option<u32>,
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
            spec: DedupSpec::default(),
            buckets: None,
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
    /// The table.
    pub table: String,
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

/// The batch, deduplicated and indexed, ready to meet the table.
struct Batch {
    winners: KeyedRows,
    /// Whether each winner is a delete.
    tombstone: Vec<bool>,
    schema: SchemaRef,
    spec: DedupSpec,
    fingerprint: String,
}

/// Runs a merge. The table changes by exactly one commit, or not at all.
///
/// # Errors
/// Bad inputs (as for a dedup), a batch whose schema or policy does not fit the table, a
/// table idem cannot rewrite (partitioned, deletion vectors, column mapping), a storage
/// failure, or other writers winning every one of `max_attempts` commits.
pub fn run_merge(job: &MergeJob, progress: &dyn Progress) -> Result<MergeReport> {
    let started = Instant::now();
    let table = Table::open(&job.table, &job.storage)?;
    let (batch, stats, inputs) = read_batch(job, &table, progress)?;
    let mut report = MergeReport {
        table: job.table.clone(),
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
        match merge_once(job, &table, &batch, &mut report)? {
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
        "{}: other writers committed first {} times in a row; nothing was changed by this run",
        job.table, job.max_attempts
    )))
}

/// Dedups the batch's files with tombstones kept, and indexes the winners.
fn read_batch(
    job: &MergeJob,
    table: &Table,
    progress: &dyn Progress,
) -> Result<(Batch, DedupStats, Vec<FileRows>)> {
    let mut spec = job.spec.clone();
    if let Some(deletes) = spec.options.deletes.as_mut() {
        deletes.keep_tombstones = true;
    }
    let dedup = DedupJob {
        inputs: job.inputs.clone(),
        output: job.table.clone(),
        spec: spec.clone(),
        max_rows_per_file: usize::MAX,
        memory_limit: None,
        storage: job.storage.clone(),
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
    let where_ = table.display("");
    let batches = batches
        .iter()
        .map(|b| relabel(b, &schema))
        .collect::<Result<Vec<_>>>()?;
    let rows = concat_batches(&schema, &batches).map_err(Error::arrow(&where_))?;
    drop(batches);
    let tombstone = tombstone_mask(&rows, &spec).map_err(Error::arrow(&where_))?;
    let winners =
        KeyedRows::try_new(rows, &spec.keys, &spec.versions).map_err(Error::arrow(&where_))?;
    let fingerprint = fingerprint(&run.files, &job.spec)?;
    let inputs = run
        .files
        .iter()
        .map(|f| FileRows {
            path: f.path().display().to_string(),
            rows: f.num_rows(),
        })
        .collect();
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
    let Some(deletes) = &spec.options.deletes else {
        return Ok(vec![false; rows.num_rows()]);
    };
    let op = rows.column_by_name(&deletes.op_column).ok_or_else(|| {
        arrow::error::ArrowError::SchemaError(format!(
            "op column '{}' not found",
            deletes.op_column
        ))
    })?;
    let op = arrow::compute::cast(op, &DataType::Utf8)?;
    let op = op
        .as_any()
        .downcast_ref::<arrow::array::StringArray>()
        .ok_or_else(|| arrow::error::ArrowError::CastError("op column as text".to_owned()))?;
    Ok((0..op.len())
        .map(|row| op.is_valid(row) && deletes.delete_values.iter().any(|d| d == op.value(row)))
        .collect())
}

/// A batch's identity: its files (name, size, ETag or modification time, rows) and the
/// policy that decides its rows. The same files merged again have the same fingerprint.
fn fingerprint(files: &[InputFile], spec: &DedupSpec) -> Result<String> {
    let mut parts: Vec<String> = Vec::with_capacity(files.len() + 1);
    for file in files {
        let identity = match file.source() {
            InputSource::Local(path) => {
                let meta = std::fs::metadata(path).map_err(Error::io(path))?;
                let modified = meta
                    .modified()
                    .ok()
                    .and_then(|m| m.duration_since(std::time::UNIX_EPOCH).ok())
                    .map_or(0, |d| d.as_nanos());
                let path = std::path::absolute(path).map_err(Error::io(path))?;
                format!("{}\u{1f}{}\u{1f}{modified}", path.display(), meta.len())
            }
            InputSource::Remote(remote) => format!(
                "{}\u{1f}{}\u{1f}{}",
                remote.display_path().display(),
                remote.size(),
                remote.version()
            ),
        };
        parts.push(format!("{identity}\u{1f}{}", file.num_rows()));
    }
    parts.sort();
    let deletes = spec.options.deletes.as_ref().map_or(String::new(), |d| {
        format!("{}={}", d.op_column, d.delete_values.join(","))
    });
    parts.push(format!(
        "key={}\u{1f}version={}\u{1f}on_tie={}\u{1f}deletes={deletes}",
        spec.keys.join(","),
        spec.versions.join(","),
        spec.options.on_tie
    ));
    let digest = twox_hash::XxHash3_128::oneshot(parts.join("\u{1e}").as_bytes());
    Ok(format!("{digest:032x}"))
}

/// How one attempt ended.
enum Attempt {
    Done,
    /// Another writer committed since the version read; start again.
    Conflict,
}

/// One data file of the table.
struct TableFile {
    path: String,
    size: u64,
    rows: Option<u64>,
    /// Bounds of the first key column, from the file's statistics.
    first_key_bounds: Option<(Value, Value)>,
    bucket: Option<u32>,
}

/// What the table was at the version read.
struct Snapshot {
    table: Option<DeltaTable>,
    schema: SchemaRef,
    files: Vec<TableFile>,
    buckets: Option<u32>,
    configuration: HashMap<String, String>,
}

/// What the batch does to one winner's key.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Insert,
    Update,
    Delete,
    DeleteWithoutRow,
    Stale,
    Blocked,
}

fn merge_once(
    job: &MergeJob,
    table: &Table,
    batch: &Batch,
    report: &mut MergeReport,
) -> Result<Attempt> {
    let snapshot = read_snapshot(job, table, batch)?;
    let app_id = format!("idem-merge-{}", batch.fingerprint);
    if let Some(delta) = &snapshot.table {
        let state = delta.snapshot().map_err(|e| table.error(e))?;
        let applied = table
            .block_on(state.transaction_version(table.log_store.as_ref(), &app_id))?
            .map_err(|e| table.error(e))?;
        if applied.is_some() {
            report.already_applied = true;
            report.table_version = Some(state.version());
            report.table_files = snapshot.files.len() as u64;
            return Ok(Attempt::Done);
        }
    }
    let now = now_millis();
    let tombstones = read_tombstones(table, &snapshot, batch, job.tombstone_retention, now)?;
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
    let found = find_rows(table, &snapshot, batch, &outcome, report)?;
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
    report.table_files = snapshot.files.len() as u64;
    report.table_rows = snapshot
        .files
        .iter()
        .map(|f| f.rows)
        .sum::<Option<u64>>()
        .map(|rows| (rows + report.inserted).saturating_sub(report.deleted));

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
    if !data_change && !tombstones_change {
        report.committed = false;
        report.table_version = snapshot.table.as_ref().and_then(|t| t.version());
        return Ok(Attempt::Done);
    }

    let mut written = Written::new(table);
    let mut actions: Vec<Action> = Vec::new();
    if data_change {
        write_data(
            job,
            table,
            &snapshot,
            batch,
            &outcome,
            &found,
            &mut written,
            &mut actions,
            report,
        )?;
    }
    let mut configuration = snapshot.configuration.clone();
    if tombstones_change || snapshot.table.is_none() {
        let state = next_tombstones(batch, &tombstones, &new_tombstones, &forgotten, now)?;
        let path = match state {
            Some(rows) if rows.num_rows() > 0 => {
                let path = format!("_idem/tombstones-{}.parquet", unique_id());
                written.push(path.clone());
                table.write_data_file(&path, &rows.schema(), &[rows])?;
                path
            }
            _ => String::new(),
        };
        configuration.insert(TOMBSTONES_PROPERTY.to_owned(), path);
    }

    let txn = Transaction::new_with_last_update(&app_id, 1, Some(now));
    let info = json!({
        "fingerprint": batch.fingerprint,
        "inputFiles": report.input_files,
        "inserted": report.inserted,
        "updated": report.updated,
        "deleted": report.deleted,
        "stale": report.stale,
        "resurrectionsBlocked": report.resurrections_blocked,
    });
    let properties = CommitProperties::default()
        .with_max_retries(0)
        .with_application_transaction(txn)
        .with_metadata([("idem".to_owned(), info)]);
    let committed = match &snapshot.table {
        None => create_table(
            job,
            table,
            batch,
            &snapshot,
            configuration,
            actions,
            properties,
        ),
        Some(delta) => commit_to(table, delta, &snapshot, configuration, actions, properties),
    };
    match committed {
        Ok(version) => {
            written.keep();
            report.created = snapshot.table.is_none();
            report.committed = true;
            report.table_version = Some(version);
            Ok(Attempt::Done)
        }
        Err(e) if is_conflict(&e) => Ok(Attempt::Conflict),
        Err(e) => Err(table.error(e)),
    }
}

/// Whether a commit failed because another writer committed first.
fn is_conflict(error: &DeltaTableError) -> bool {
    match error {
        DeltaTableError::Transaction { source } => matches!(
            source,
            TransactionError::VersionAlreadyExists(_)
                | TransactionError::MaxCommitAttempts(_)
                | TransactionError::CommitConflict(_)
        ),
        DeltaTableError::VersionAlreadyExists(_) => true,
        DeltaTableError::CommitValidation { .. } => false,
        other => other.to_string().contains("already exists"),
    }
}

/// Files this attempt wrote; deleted again unless the commit referencing them succeeds.
struct Written<'a> {
    table: &'a Table,
    paths: Vec<String>,
}

impl<'a> Written<'a> {
    fn new(table: &'a Table) -> Self {
        Self {
            table,
            paths: Vec::new(),
        }
    }

    fn push(&mut self, path: String) {
        self.paths.push(path);
    }

    fn keep(&mut self) {
        self.paths.clear();
    }
}

impl Drop for Written<'_> {
    fn drop(&mut self) {
        // Best effort: what is left is unreferenced, invisible to readers, and vacuumable.
        for path in &self.paths {
            let _ = self.table.delete_file(path);
        }
    }
}

fn unique_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let seed = format!(
        "{nanos}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    format!("{:032x}", twox_hash::XxHash3_128::oneshot(seed.as_bytes()))
}

fn read_snapshot(job: &MergeJob, table: &Table, batch: &Batch) -> Result<Snapshot> {
    let Some(delta) = table.load()? else {
        return Ok(Snapshot {
            table: None,
            schema: Arc::clone(&batch.schema),
            files: Vec::new(),
            buckets: job.buckets,
            configuration: HashMap::new(),
        });
    };
    let state = delta.snapshot().map_err(|e| table.error(e))?;
    let metadata = state.metadata();
    let configuration: HashMap<String, String> = metadata.configuration().clone();
    check_readable(table, metadata.partition_columns(), &configuration)?;
    for (property, columns) in [
        (KEY_PROPERTY, &batch.spec.keys),
        (VERSION_PROPERTY, &batch.spec.versions),
    ] {
        if let Some(recorded) = configuration.get(property)
            && *recorded != columns.join(",")
        {
            return Err(Error::InvalidArgument(format!(
                "{}: the table was created with {} {recorded}, this merge uses {}",
                table.name,
                property.trim_start_matches("idem."),
                columns.join(",")
            )));
        }
    }
    let buckets = match configuration.get(BUCKETS_PROPERTY) {
        Some(n) => Some(n.parse::<u32>().map_err(|_| {
            Error::InvalidArgument(format!("{}: bad {BUCKETS_PROPERTY} '{n}'", table.name))
        })?),
        None => None,
    };
    if job.buckets.is_some() && job.buckets != buckets {
        return Err(Error::InvalidArgument(format!(
            "{}: --buckets applies when a table is created; this table has {}",
            table.name,
            buckets.map_or("no buckets".to_owned(), |b| format!("{b} buckets"))
        )));
    }
    let kernel_schema = state.schema();
    let schema: Schema = kernel_schema
        .as_ref()
        .try_into_arrow()
        .map_err(|e: arrow::error::ArrowError| Error::arrow(table.display(""))(e))?;
    let schema = Arc::new(schema);
    check_batch_schema(table, &schema, &batch.schema)?;
    let first_key = &batch.spec.keys[0];
    let mut files = Vec::new();
    for view in state.log_data().iter() {
        if view.deletion_vector_descriptor().is_some() {
            return Err(deletion_vector_error(table, &view.path()));
        }
        let path = view.path().to_string();
        let stats: Option<Value> = view.stats().and_then(|s| serde_json::from_str(&s).ok());
        let first_key_bounds = stats.as_ref().and_then(|s| {
            let low = s.get("minValues")?.get(first_key)?.clone();
            let high = s.get("maxValues")?.get(first_key)?.clone();
            Some((low, high))
        });
        files.push(TableFile {
            bucket: buckets.and_then(|_| bucket_of_path(&path)),
            size: view.size().max(0) as u64,
            rows: view.num_records().map(|n| n as u64),
            first_key_bounds,
            path,
        });
    }
    Ok(Snapshot {
        table: Some(delta),
        schema,
        files,
        buckets,
        configuration,
    })
}

/// The batch must have the table's columns with the table's types: no silent drift.
fn check_batch_schema(
    table: &Table,
    table_schema: &SchemaRef,
    batch_schema: &SchemaRef,
) -> Result<()> {
    for field in table_schema.fields() {
        let Ok(found) = batch_schema.field_with_name(field.name()) else {
            return Err(Error::MissingRequiredColumn {
                path: table.display(""),
                column: field.name().clone(),
            });
        };
        if !crate::schema::same_family(found.data_type(), field.data_type()) {
            return Err(Error::SchemaMismatch {
                path: table.display(""),
                column: field.name().clone(),
                expected: field.data_type().to_string(),
                found: found.data_type().to_string(),
            });
        }
    }
    if let Some(extra) = batch_schema
        .fields()
        .iter()
        .find(|f| table_schema.field_with_name(f.name()).is_err())
    {
        return Err(Error::InvalidArgument(format!(
            "{}: the batch has a column '{}' the table does not have; add it to the table \
             first (schema evolution is not automatic)",
            table.name,
            extra.name()
        )));
    }
    Ok(())
}

fn bucket_of_path(path: &str) -> Option<u32> {
    let name = path.rsplit('/').next()?;
    name.strip_prefix("bucket-")?
        .split('-')
        .next()?
        .parse()
        .ok()
}

/// The live tombstones of the version read.
struct Tombstones {
    rows: Option<KeyedRows>,
    expired: u64,
}

fn read_tombstones(
    table: &Table,
    snapshot: &Snapshot,
    batch: &Batch,
    retention: Duration,
    now: i64,
) -> Result<Tombstones> {
    let none = Tombstones {
        rows: None,
        expired: 0,
    };
    let Some(path) = snapshot
        .configuration
        .get(TOMBSTONES_PROPERTY)
        .filter(|p| !p.is_empty())
    else {
        return Ok(none);
    };
    let source = table.state_file(path)?;
    let file = InputFile::open(&source)?;
    let display = source.path();
    let mut batches = Vec::new();
    for b in file.read_columns(
        &file
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .collect::<Vec<_>>(),
    )? {
        batches.push(b?);
    }
    let rows = concat_batches(file.schema(), &batches).map_err(Error::arrow(&display))?;
    let horizon = now.saturating_sub(retention.as_millis().min(i64::MAX as u128) as i64);
    let deleted_at = rows
        .column_by_name(DELETED_AT)
        .and_then(|c| c.as_any().downcast_ref::<Int64Array>())
        .ok_or_else(|| {
            Error::InvalidArgument(format!("{}: not an idem tombstone file", display.display()))
        })?;
    let live: BooleanArray = deleted_at
        .iter()
        .map(|t| Some(t.is_some_and(|t| t >= horizon)))
        .collect();
    let expired = live.false_count() as u64;
    let rows = filter_record_batch(&rows, &live).map_err(Error::arrow(&display))?;
    let rows = KeyedRows::try_new(rows, &batch.spec.keys, &batch.spec.versions)
        .map_err(Error::arrow(&display))?;
    Ok(Tombstones {
        rows: Some(rows),
        expired,
    })
}

/// Kept tombstones plus the batch's new ones: key and version columns and when.
fn next_tombstones(
    batch: &Batch,
    tombstones: &Tombstones,
    new: &[u32],
    forgotten: &BTreeSet<u32>,
    now: i64,
) -> Result<Option<RecordBatch>> {
    let columns: Vec<&String> = batch.spec.keys.iter().chain(&batch.spec.versions).collect();
    let project = |rows: &RecordBatch, take: &[u32], deleted_at: ArrayRef| -> Result<RecordBatch> {
        let taken =
            take_record_batch(rows, &UInt32Array::from(take.to_vec())).map_err(Error::arrow(""))?;
        let mut fields = Vec::new();
        let mut arrays = Vec::new();
        for name in &columns {
            let index = taken.schema().index_of(name).map_err(Error::arrow(""))?;
            fields.push(taken.schema().field(index).clone().with_nullable(true));
            arrays.push(Arc::clone(taken.column(index)));
        }
        fields.push(Field::new(DELETED_AT, DataType::Int64, true));
        arrays.push(deleted_at);
        RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays).map_err(Error::arrow(""))
    };
    let fresh = project(
        batch.winners.rows(),
        new,
        Arc::new(Int64Array::from(vec![now; new.len()])),
    )?;
    let Some(old) = &tombstones.rows else {
        return Ok(Some(fresh));
    };
    let kept: Vec<u32> = (0..old.len() as u32)
        .filter(|t| !forgotten.contains(t))
        .collect();
    let old_rows = old.rows();
    let when = old_rows
        .column_by_name(DELETED_AT)
        .cloned()
        .ok_or_else(|| {
            Error::InvalidArgument("tombstone state without deletion times".to_owned())
        })?;
    let when = arrow::compute::take(&when, &UInt32Array::from(kept.clone()), None)
        .map_err(Error::arrow(""))?;
    let kept = project(old_rows, &kept, when)?;
    let kept = conform(&kept, &fresh.schema(), false, std::path::Path::new(""))?;
    Ok(Some(
        concat_batches(&fresh.schema(), [&kept, &fresh]).map_err(Error::arrow(""))?,
    ))
}

/// A table row that holds a batch key: (winner, file, row in file, encoded table version).
type Match = (u32, u32, u32, Vec<u8>);

/// Where the table holds the batch's keys: every match (file, row) and the greatest version
/// per winner.
struct Found {
    matches: Vec<(u32, u32, u32)>,
    versions: Vec<u8>,
    present: Vec<bool>,
}

impl Found {
    fn version(&self, row: usize, width: usize) -> Option<&[u8]> {
        self.present[row].then(|| &self.versions[row * width..(row + 1) * width])
    }
}

fn find_rows(
    table: &Table,
    snapshot: &Snapshot,
    batch: &Batch,
    outcome: &[Option<Outcome>],
    report: &mut MergeReport,
) -> Result<Found> {
    let winners = &batch.winners;
    let width = winners.version_width();
    let mut found = Found {
        matches: Vec::new(),
        versions: vec![0; winners.len() * width],
        present: vec![false; winners.len()],
    };
    let active: Vec<usize> = (0..winners.len())
        .filter(|&r| outcome[r].is_none())
        .collect();
    if active.is_empty() || snapshot.files.is_empty() {
        report.files_pruned = snapshot.files.len() as u64;
        return Ok(found);
    }
    let buckets: Option<BTreeSet<u32>> = snapshot.buckets.map(|n| {
        active
            .iter()
            .map(|&r| (winners.hash(r) % u64::from(n.max(1))) as u32)
            .collect()
    });
    let first_keys = FirstKeys::of(winners.rows(), &batch.spec.keys[0], &active);
    let candidates: Vec<usize> = (0..snapshot.files.len())
        .filter(|&i| {
            let file = &snapshot.files[i];
            let in_bucket = match (&buckets, file.bucket) {
                (Some(wanted), Some(b)) => wanted.contains(&b),
                _ => true,
            };
            in_bucket && first_keys.may_meet(file.first_key_bounds.as_ref())
        })
        .collect();
    report.files_scanned = candidates.len() as u64;
    report.files_pruned = (snapshot.files.len() - candidates.len()) as u64;
    let columns: Vec<&str> = batch
        .spec
        .keys
        .iter()
        .chain(&batch.spec.versions)
        .map(String::as_str)
        .collect();
    // Two readers: decoding Parquet is the cost, and it parallelises by file.
    let threads = candidates.len().clamp(1, 2);
    let results: Vec<Result<Vec<Match>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let candidates = &candidates;
                let columns = &columns;
                scope.spawn(move || {
                    let mut out = Vec::new();
                    for &index in candidates.iter().skip(t).step_by(threads) {
                        let file = &snapshot.files[index];
                        let source = table.data_file(&file.path, file.size);
                        let input = InputFile::open(&source)?;
                        let mut offset = 0u32;
                        for piece in input.read_columns(columns)? {
                            let piece = conform(
                                &piece?,
                                &project_schema(&snapshot.schema, columns),
                                false,
                                input.path(),
                            )?;
                            let probe =
                                winners.probe(&piece).map_err(Error::arrow(input.path()))?;
                            for (row, hit) in probe.found.iter().enumerate() {
                                if let Some(winner) = hit {
                                    let version =
                                        probe.versions[row * width..(row + 1) * width].to_vec();
                                    out.push((*winner, index as u32, offset + row as u32, version));
                                }
                            }
                            offset += piece.num_rows() as u32;
                        }
                    }
                    Ok(out)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::InvalidArgument(
                        "a reader thread panicked".to_owned(),
                    ))
                })
            })
            .collect()
    });
    for result in results {
        for (winner, file, row, version) in result? {
            let w = winner as usize;
            let slot = &mut found.versions[w * width..(w + 1) * width];
            if !found.present[w] || version.as_slice() > &*slot {
                slot.copy_from_slice(&version);
            }
            found.present[w] = true;
            found.matches.push((winner, file, row));
        }
    }
    Ok(found)
}

fn project_schema(schema: &SchemaRef, columns: &[&str]) -> SchemaRef {
    Arc::new(Schema::new(
        columns
            .iter()
            .filter_map(|c| schema.field_with_name(c).ok().cloned())
            .collect::<Vec<_>>(),
    ))
}

/// The batch's values of the first key column, sorted, to test files' key ranges against.
enum FirstKeys {
    Integers(Vec<i64>),
    Strings(Vec<String>),
    /// A type without usable statistics, or a null key: every file may hold a key.
    Unknown,
}

impl FirstKeys {
    fn of(rows: &RecordBatch, column: &str, active: &[usize]) -> Self {
        let Some(array) = rows.column_by_name(column) else {
            return Self::Unknown;
        };
        if active.iter().any(|&r| array.is_null(r)) {
            return Self::Unknown;
        }
        let picked = match arrow::compute::take(
            array,
            &UInt32Array::from(active.iter().map(|&r| r as u32).collect::<Vec<_>>()),
            None,
        ) {
            Ok(picked) => picked,
            Err(_) => return Self::Unknown,
        };
        match array.data_type() {
            DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64 => {
                let Ok(values) = arrow::compute::cast(&picked, &DataType::Int64) else {
                    return Self::Unknown;
                };
                let Some(values) = values.as_any().downcast_ref::<Int64Array>() else {
                    return Self::Unknown;
                };
                let mut v: Vec<i64> = values.values().to_vec();
                v.sort_unstable();
                Self::Integers(v)
            }
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => {
                let Ok(values) = arrow::compute::cast(&picked, &DataType::Utf8) else {
                    return Self::Unknown;
                };
                let Some(values) = values.as_any().downcast_ref::<arrow::array::StringArray>()
                else {
                    return Self::Unknown;
                };
                let mut v: Vec<String> = values.iter().flatten().map(str::to_owned).collect();
                v.sort_unstable();
                Self::Strings(v)
            }
            _ => Self::Unknown,
        }
    }

    /// Whether some batch key lies within a file's `[min, max]` of the first key column.
    fn may_meet(&self, bounds: Option<&(Value, Value)>) -> bool {
        let Some((low, high)) = bounds else {
            return true;
        };
        match self {
            Self::Integers(v) => match (low.as_i64(), high.as_i64()) {
                (Some(l), Some(h)) => {
                    let at = v.partition_point(|x| *x < l);
                    v.get(at).is_some_and(|x| *x <= h)
                }
                _ => true,
            },
            Self::Strings(v) => match (low.as_str(), high.as_str()) {
                (Some(l), Some(h)) => {
                    let at = v.partition_point(|x| x.as_str() < l);
                    v.get(at).is_some_and(|x| x.as_str() <= h)
                }
                _ => true,
            },
            Self::Unknown => true,
        }
    }
}

/// Rewrites the files that hold replaced or deleted rows, and writes the new rows.
#[allow(clippy::too_many_arguments)]
fn write_data(
    job: &MergeJob,
    table: &Table,
    snapshot: &Snapshot,
    batch: &Batch,
    outcome: &[Outcome],
    found: &Found,
    written: &mut Written<'_>,
    actions: &mut Vec<Action>,
    report: &mut MergeReport,
) -> Result<()> {
    let winners = &batch.winners;
    let replaced = |o: Outcome| matches!(o, Outcome::Update | Outcome::Delete);
    // Rows to drop, per file.
    let mut drop_rows: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for &(winner, file, row) in &found.matches {
        if replaced(outcome[winner as usize]) {
            drop_rows.entry(file).or_default().push(row);
        }
    }
    let new_rows: Vec<u32> = (0..winners.len())
        .filter(|&r| matches!(outcome[r], Outcome::Insert | Outcome::Update))
        .map(|r| r as u32)
        .collect();
    let schema = &snapshot.schema;
    let fresh = take_record_batch(winners.rows(), &UInt32Array::from(new_rows.clone()))
        .map_err(Error::arrow(table.display("")))?;
    let fresh = conform(&fresh, schema, false, &table.display(""))?;

    // Files to rewrite: with buckets, every file of a touched bucket (the bucket becomes one
    // file again); without, the files that lose rows.
    let mut rewrite: Vec<usize> = Vec::new();
    let mut touched_buckets: BTreeSet<u32> = BTreeSet::new();
    let fresh_buckets: Option<Vec<u32>> = match snapshot.buckets {
        Some(n) => {
            let hashes =
                key_hashes(&fresh, &batch.spec.keys).map_err(Error::arrow(table.display("")))?;
            let buckets: Vec<u32> = hashes
                .iter()
                .map(|h| (h % u64::from(n.max(1))) as u32)
                .collect();
            touched_buckets.extend(buckets.iter().copied());
            for &file in drop_rows.keys() {
                if let Some(b) = snapshot.files[file as usize].bucket {
                    touched_buckets.insert(b);
                }
            }
            // Files another writer added without a bucket are always scanned; rewritten,
            // they stay bucketless (below).
            rewrite.extend((0..snapshot.files.len()).filter(|&i| {
                snapshot.files[i]
                    .bucket
                    .is_some_and(|b| touched_buckets.contains(&b))
            }));
            Some(buckets)
        }
        None => {
            rewrite.extend(drop_rows.keys().map(|&f| f as usize));
            None
        }
    };

    let mut out = Out {
        table,
        schema,
        written,
        actions,
        report,
    };
    let empty = Vec::new();
    let dropped_in = |index: usize| -> BTreeSet<u32> {
        drop_rows
            .get(&(index as u32))
            .unwrap_or(&empty)
            .iter()
            .copied()
            .collect()
    };
    match fresh_buckets {
        Some(fresh_buckets) => {
            // One bucket at a time, so memory holds one bucket's rows.
            for bucket in &touched_buckets {
                let mut parts = Vec::new();
                for &index in rewrite
                    .iter()
                    .filter(|&&i| snapshot.files[i].bucket == Some(*bucket))
                {
                    parts.extend(out.survivors(&snapshot.files[index], &dropped_in(index))?);
                }
                let pick: Vec<u32> = (0..fresh.num_rows() as u32)
                    .filter(|&r| fresh_buckets[r as usize] == *bucket)
                    .collect();
                parts.push(
                    take_record_batch(&fresh, &UInt32Array::from(pick))
                        .map_err(Error::arrow(table.display("")))?,
                );
                let rows =
                    concat_batches(schema, &parts).map_err(Error::arrow(table.display("")))?;
                if rows.num_rows() > 0 {
                    let rows = sort_by_key(&rows, &batch.spec.keys)?;
                    out.add(&format!("bucket-{bucket:05}"), &rows)?;
                }
            }
            for (&index, _) in drop_rows
                .iter()
                .filter(|(i, _)| snapshot.files[**i as usize].bucket.is_none())
            {
                let index = index as usize;
                let parts = out.survivors(&snapshot.files[index], &dropped_in(index))?;
                let rows =
                    concat_batches(schema, &parts).map_err(Error::arrow(table.display("")))?;
                if rows.num_rows() > 0 {
                    out.add("part", &rows)?;
                }
            }
        }
        None => {
            // A rewritten file keeps its other rows together: they were clustered by key
            // when written.
            for &index in &rewrite {
                let parts = out.survivors(&snapshot.files[index], &dropped_in(index))?;
                let rows =
                    concat_batches(schema, &parts).map_err(Error::arrow(table.display("")))?;
                if rows.num_rows() > 0 {
                    out.add("part", &rows)?;
                }
            }
            if fresh.num_rows() > 0 {
                let sorted = sort_by_key(&fresh, &batch.spec.keys)?;
                let per_file = job.max_rows_per_file.max(1);
                let mut start = 0;
                while start < sorted.num_rows() {
                    let len = per_file.min(sorted.num_rows() - start);
                    out.add("part", &sorted.slice(start, len))?;
                    start += len;
                }
            }
        }
    }
    Ok(())
}

/// Where [`write_data`] puts what it writes.
struct Out<'a, 'b> {
    table: &'a Table,
    schema: &'a SchemaRef,
    written: &'a mut Written<'b>,
    actions: &'a mut Vec<Action>,
    report: &'a mut MergeReport,
}

impl Out<'_, '_> {
    /// Reads a file without its `dropped` rows and records its removal.
    fn survivors(&mut self, file: &TableFile, dropped: &BTreeSet<u32>) -> Result<Vec<RecordBatch>> {
        let input = InputFile::open(&self.table.data_file(&file.path, file.size))?;
        let names: Vec<&str> = self
            .schema
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .collect();
        let mut offset = 0u32;
        let mut kept = Vec::new();
        for piece in input.read_columns(&names)? {
            let piece = conform(&piece?, self.schema, false, input.path())?;
            let n = piece.num_rows() as u32;
            let keep: BooleanArray = (offset..offset + n)
                .map(|r| Some(!dropped.contains(&r)))
                .collect();
            offset += n;
            let piece = filter_record_batch(&piece, &keep).map_err(Error::arrow(input.path()))?;
            if piece.num_rows() > 0 {
                self.report.rows_rewritten += piece.num_rows() as u64;
                kept.push(piece);
            }
        }
        self.actions.push(Action::Remove(Remove {
            path: file.path.clone(),
            data_change: true,
            deletion_timestamp: Some(now_millis()),
            extended_file_metadata: Some(true),
            size: Some(file.size as i64),
            partition_values: Some(HashMap::new()),
            ..Default::default()
        }));
        self.report.files_removed += 1;
        Ok(kept)
    }

    /// Writes rows as a new data file named `PREFIX-UNIQUE.parquet`.
    fn add(&mut self, prefix: &str, rows: &RecordBatch) -> Result<()> {
        let path = format!("{prefix}-{}.parquet", unique_id());
        self.written.push(path.clone());
        let add: Add =
            self.table
                .write_data_file(&path, self.schema, std::slice::from_ref(rows))?;
        self.actions.push(Action::Add(add));
        self.report.files_added += 1;
        Ok(())
    }
}

/// Rows ordered by key, so that files cover narrow key ranges and later merges can skip
/// them by statistics.
fn sort_by_key(rows: &RecordBatch, keys: &[String]) -> Result<RecordBatch> {
    let columns = keys
        .iter()
        .map(|k| {
            rows.column_by_name(k).map(|c| SortColumn {
                values: Arc::clone(c),
                options: None,
            })
        })
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| {
            Error::InvalidArgument("key column missing from rows to write".to_owned())
        })?;
    let order = lexsort_to_indices(&columns, None).map_err(Error::arrow(""))?;
    take_record_batch(rows, &order).map_err(Error::arrow(""))
}

fn merge_operation() -> DeltaOperation {
    DeltaOperation::Merge {
        predicate: None,
        merge_predicate: Some("target.key = source.key".to_owned()),
        matched_predicates: vec![
            MergePredicate {
                action_type: "update".to_owned(),
                predicate: Some(
                    "source.version > target.version AND NOT source.is_delete".to_owned(),
                ),
            },
            MergePredicate {
                action_type: "delete".to_owned(),
                predicate: Some("source.version > target.version AND source.is_delete".to_owned()),
            },
        ],
        not_matched_predicates: vec![MergePredicate {
            action_type: "insert".to_owned(),
            predicate: Some("NOT source.is_delete AND NOT blocked_by_tombstone".to_owned()),
        }],
        not_matched_by_source_predicates: Vec::new(),
    }
}

fn create_table(
    job: &MergeJob,
    table: &Table,
    batch: &Batch,
    snapshot: &Snapshot,
    mut configuration: HashMap<String, String>,
    actions: Vec<Action>,
    properties: CommitProperties,
) -> std::result::Result<u64, DeltaTableError> {
    let schema = StructType::try_from_arrow(snapshot.schema.as_ref()).map_err(|e| {
        DeltaTableError::Generic(format!("the batch's schema has no Delta equivalent: {e}"))
    })?;
    configuration.insert(KEY_PROPERTY.to_owned(), batch.spec.keys.join(","));
    configuration.insert(VERSION_PROPERTY.to_owned(), batch.spec.versions.join(","));
    if let Some(n) = job.buckets {
        configuration.insert(BUCKETS_PROPERTY.to_owned(), n.to_string());
    }
    let name = table
        .name
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or("events")
        .to_owned();
    let builder = DeltaTable::new(Arc::clone(&table.log_store))
        .create()
        .with_table_name(name)
        .with_columns(schema.fields().cloned())
        .with_configuration(configuration.into_iter().map(|(k, v)| (k, Some(v))))
        .with_raise_if_key_not_exists(false)
        .with_save_mode(SaveMode::ErrorIfExists)
        .with_actions(actions)
        .with_commit_properties(properties);
    let created = table
        .block_on(builder.into_future())
        .map_err(|e| DeltaTableError::Generic(e.to_string()))??;
    Ok(created.version().unwrap_or(0))
}

fn commit_to(
    table: &Table,
    delta: &DeltaTable,
    snapshot: &Snapshot,
    configuration: HashMap<String, String>,
    mut actions: Vec<Action>,
    properties: CommitProperties,
) -> std::result::Result<u64, DeltaTableError> {
    let state = delta.snapshot()?;
    if configuration != snapshot.configuration {
        let mut metadata = state.metadata().clone();
        for (key, value) in configuration {
            if snapshot.configuration.get(&key) != Some(&value) {
                metadata = metadata.add_config_key(key, value)?;
            }
        }
        actions.push(Action::Metadata(metadata));
    }
    let commit = CommitBuilder::from(properties).with_actions(actions).build(
        Some(state),
        Arc::clone(&table.log_store),
        merge_operation(),
    );
    let finalized = table
        .block_on(commit.into_future())
        .map_err(|e| DeltaTableError::Generic(e.to_string()))??;
    Ok(finalized.version())
}

/// The data files of the latest version of the Delta table at `input`, or `None` where
/// `input` is not a table (no `_delta_log`). This is how every command reads a table: only
/// the files the log references, never removed or uncommitted ones.
///
/// # Errors
/// A table that cannot be loaded, or one idem cannot read correctly (partitioned, deletion
/// vectors, column mapping).
pub(crate) fn table_files(
    input: &str,
    storage: &StorageOptions,
) -> Result<Option<Vec<InputSource>>> {
    if input.contains(['*', '?', '[']) {
        return Ok(None);
    }
    let is_table = match crate::storage::Location::parse(input, storage)? {
        crate::storage::Location::Local(path) => path.join("_delta_log").is_dir(),
        crate::storage::Location::Remote(remote) => {
            remote.join("_delta_log").has_objects_below()?
        }
    };
    if !is_table {
        return Ok(None);
    }
    let table = Table::open(input, storage)?;
    let Some(delta) = table.load()? else {
        return Ok(None);
    };
    let state = delta.snapshot().map_err(|e| table.error(e))?;
    check_readable(
        &table,
        state.metadata().partition_columns(),
        state.metadata().configuration(),
    )?;
    let mut files = Vec::new();
    for view in state.log_data().iter() {
        if view.deletion_vector_descriptor().is_some() {
            return Err(deletion_vector_error(&table, &view.path()));
        }
        files.push((view.path().to_string(), view.size().max(0) as u64));
    }
    files.sort();
    Ok(Some(
        files
            .into_iter()
            .map(|(path, size)| table.data_file(&path, size))
            .collect(),
    ))
}

/// What idem can read and rewrite: plain Parquet files with the table's columns.
fn check_readable(
    table: &Table,
    partition_columns: &[String],
    configuration: &HashMap<String, String>,
) -> Result<()> {
    if !partition_columns.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "{}: the table is partitioned by {}; idem reads and merges unpartitioned tables \
             (use --buckets to cluster by key)",
            table.name,
            partition_columns.join(", ")
        )));
    }
    if let Some(mode) = configuration.get("delta.columnMapping.mode")
        && mode != "none"
    {
        return Err(Error::InvalidArgument(format!(
            "{}: column mapping ({mode}) is not supported by idem",
            table.name
        )));
    }
    Ok(())
}

fn deletion_vector_error(table: &Table, path: &str) -> Error {
    Error::InvalidArgument(format!(
        "{}: file {path} has a deletion vector, which idem does not support",
        table.name
    ))
}

/// What `idem vacuum` removed (or would remove, in a dry run).
#[derive(Debug, Clone, Default, Serialize)]
pub struct VacuumReport {
    /// The table.
    pub table: String,
    /// Whether nothing was deleted, only listed.
    pub dry_run: bool,
    /// Files older than this many seconds were eligible.
    pub retention_seconds: u64,
    /// Data files no version within the retention references, and files of merges that
    /// never committed (relative paths).
    pub files_deleted: Vec<String>,
    /// Old tombstone state files and abandoned temporaries of idem itself.
    pub state_files_deleted: Vec<String>,
}

/// Removes files no committed table version within `retention` needs: data files removed
/// by earlier merges, files written by merges that were killed or lost a commit race, and
/// superseded tombstone state. Readers of versions older than `retention` may fail after it.
///
/// # Errors
/// No table at the location, or a storage failure.
pub fn run_vacuum(
    location: &str,
    retention: Duration,
    dry_run: bool,
    storage: &StorageOptions,
) -> Result<VacuumReport> {
    use futures::TryStreamExt;
    let table = Table::open(location, storage)?;
    let Some(delta) = table.load()? else {
        return Err(Error::InvalidArgument(format!(
            "{location}: no Delta table here"
        )));
    };
    let current_state = delta
        .snapshot()
        .map_err(|e| table.error(e))?
        .metadata()
        .configuration()
        .get(TOMBSTONES_PROPERTY)
        .cloned()
        .unwrap_or_default();
    let store = delta.log_store().object_store(None);
    let period = chrono::Duration::from_std(retention)
        .map_err(|_| Error::InvalidArgument(format!("retention {retention:?} is too long")))?;
    let (_, metrics) = table
        .block_on(
            delta
                .vacuum()
                .with_mode(deltalake_core::operations::vacuum::VacuumMode::Full)
                .with_retention_period(period)
                .with_enforce_retention_duration(false)
                .with_dry_run(dry_run)
                .into_future(),
        )?
        .map_err(|e| table.error(e))?;
    // Vacuum leaves hidden names alone: idem's state directory and its writers' temporaries.
    let horizon = chrono::Utc::now() - period;
    let listed: Vec<object_store::ObjectMeta> = table
        .block_on(store.list(None).try_collect::<Vec<_>>())?
        .map_err(|source| Error::Storage {
            url: table.url.to_string(),
            source,
        })?;
    let mut state_files_deleted = Vec::new();
    for meta in listed {
        let name = meta.location.as_ref();
        let is_old_state = name.starts_with("_idem/") && name != current_state;
        let is_temporary =
            !name.contains('/') && name.starts_with('.') && name.contains(".idem-tmp-");
        if (is_old_state || is_temporary) && meta.last_modified < horizon {
            if !dry_run {
                table
                    .block_on(object_store::ObjectStoreExt::delete(
                        store.as_ref(),
                        &meta.location,
                    ))?
                    .map_err(|source| Error::Storage {
                        url: format!("{}{name}", table.url),
                        source,
                    })?;
            }
            state_files_deleted.push(name.to_owned());
        }
    }
    Ok(VacuumReport {
        table: location.to_owned(),
        dry_run,
        retention_seconds: retention.as_secs(),
        files_deleted: metrics.files_deleted,
        state_files_deleted,
    })
}

/// Parses a duration: a number and a unit, `s`, `m`, `h`, `d` or `w` (`7d`, `36h`, `0s`).
///
/// # Errors
/// Anything else.
pub fn parse_duration(text: &str) -> Result<Duration> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let seconds = match unit.trim() {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        "w" => 7 * 86_400,
        _ => 0,
    };
    match number.parse::<u64>() {
        Ok(n) if seconds > 0 => Ok(Duration::from_secs(n.saturating_mul(seconds))),
        _ => Err(Error::InvalidArgument(format!(
            "bad duration '{text}': use a number and s, m, h, d or w (e.g. 7d)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units_and_refuse_the_rest() {
        assert_eq!(
            parse_duration("7d").ok(),
            Some(Duration::from_secs(604_800))
        );
        assert_eq!(
            parse_duration("36h").ok(),
            Some(Duration::from_secs(129_600))
        );
        assert_eq!(parse_duration("0s").ok(), Some(Duration::ZERO));
        assert_eq!(
            parse_duration("2w").ok(),
            Some(Duration::from_secs(1_209_600))
        );
        for bad in ["", "7", "d", "7x", "-1d", "1.5h"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bucket_numbers_come_from_file_names() {
        assert_eq!(bucket_of_path("bucket-00017-abc.parquet"), Some(17));
        assert_eq!(bucket_of_path("x/bucket-00003-abc.parquet"), Some(3));
        assert_eq!(bucket_of_path("part-abc.parquet"), None);
    }

    #[test]
    fn key_ranges_prune_files_that_cannot_hold_a_batch_key() {
        let keys = FirstKeys::Integers(vec![3, 10, 20]);
        assert!(keys.may_meet(Some(&(json!(1), json!(3)))));
        assert!(!keys.may_meet(Some(&(json!(4), json!(9)))));
        assert!(!keys.may_meet(Some(&(json!(21), json!(99)))));
        assert!(keys.may_meet(None));
        let keys = FirstKeys::Strings(vec!["b".into(), "m".into()]);
        assert!(keys.may_meet(Some(&(json!("a"), json!("c")))));
        assert!(!keys.may_meet(Some(&(json!("c"), json!("l")))));
        assert!(FirstKeys::Unknown.may_meet(Some(&(json!(0), json!(0)))));
    }
}
