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

mod find;
mod keyed;
mod partition;
mod rewrite;
mod table;
mod tombstones;
mod types;
mod vacuum;

pub(crate) use table::table_files;
pub use vacuum::{VacuumReport, run_vacuum};

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::{RecordBatch, RecordBatchOptions};
use arrow::compute::concat_batches;
use arrow::datatypes::{Field, Schema, SchemaRef};
use deltalake_core::kernel::engine::arrow_conversion::TryFromArrow;
use deltalake_core::kernel::transaction::{CommitBuilder, CommitProperties, TransactionError};
use deltalake_core::kernel::{Action, MetadataExt, StructType, Transaction};
use deltalake_core::protocol::{DeltaOperation, MergePredicate, SaveMode};
use deltalake_core::{DeltaTable, DeltaTableError};
use idem_core::{DedupSpec, DedupStats};
use serde::Serialize;
use serde_json::{Value, json};

use crate::dedup::{DedupJob, FileRows, Progress, dedup_rows};
use crate::error::{Error, Result};
use crate::input::{ConstantColumns, InputFile, expand_inputs, fingerprint};
use crate::storage::StorageOptions;
use find::find_rows;
use keyed::KeyedRows;
use partition::{PartitionValues, Partitioning};
use rewrite::write_data;
use table::{Table, now_millis};
use table::{check_readable, deletion_vector_error, table_schema};
use tombstones::{next_tombstones, read_tombstones};

/// Table property: the key columns the table was created with.
const KEY_PROPERTY: &str = "idem.key";
/// Table property: the version columns.
const VERSION_PROPERTY: &str = "idem.version";
/// Table property: number of buckets, when rows are clustered into files by key hash.
const BUCKETS_PROPERTY: &str = "idem.buckets";
/// Table property: the tombstone state file of this table version (relative path, or empty).
const TOMBSTONES_PROPERTY: &str = "idem.tombstones";
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
    // A batch applied before is recognised from its files alone, before any row is read.
    let files: Vec<InputFile> = expand_inputs(&job.inputs, &job.storage)?
        .iter()
        .map(InputFile::open)
        .collect::<Result<_>>()?;
    let early = fingerprint(&files, &job.spec)?;
    let loaded = table.load()?;
    if let Some(delta) = &loaded {
        check_creation_options(job, &table, delta)?;
    }
    if let Some(delta) = &loaded
        && let Some(version) = applied_at(&table, delta, &app_id(&early))?
    {
        return Ok(MergeReport {
            table: job.table.clone(),
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
    let table_columns = match &loaded {
        Some(delta) => Some(table_schema(
            &table,
            delta.snapshot().map_err(|e| table.error(e))?,
        )?),
        None => None,
    };
    drop((files, loaded));
    let (batch, stats, inputs) = read_batch(job, &table, table_columns.as_deref(), progress)?;
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

/// Dedups the batch's files with tombstones kept, converts the winners to the types the
/// table stores (`table_columns`, or the mapping of [`types`] for a new table), and indexes
/// them.
fn read_batch(
    job: &MergeJob,
    table: &Table,
    table_columns: Option<&Schema>,
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
    let where_ = table.display("");
    let batches = batches
        .iter()
        .map(|b| relabel(b, &schema))
        .collect::<Result<Vec<_>>>()?;
    let rows = concat_batches(&schema, &batches).map_err(Error::arrow(&where_))?;
    drop(batches);
    // The dedup compared the batch's own types; the conversions are order-preserving and
    // injective, so the winners stay the winners, and from here on the batch and the
    // table's rows are compared in one representation.
    let schema = match table_columns {
        Some(columns) => types::schema_in_table(&schema, columns, &table.name)?,
        None => types::stored_schema(&schema, &table.name)?,
    };
    let rows = types::to_stored(&rows, &schema, &table.name)?;
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

/// The application id of a batch's `txn` action.
fn app_id(fingerprint: &str) -> String {
    format!("idem-merge-{fingerprint}")
}

/// The table version, when the batch with this application id has been committed to it.
fn applied_at(table: &Table, delta: &DeltaTable, app_id: &str) -> Result<Option<u64>> {
    let state = delta.snapshot().map_err(|e| table.error(e))?;
    let applied = table
        .block_on(state.transaction_version(table.log_store.as_ref(), app_id))?
        .map_err(|e| table.error(e))?;
    Ok(applied.map(|_| state.version()))
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
    partition: Option<FilePartition>,
}

/// Where a file of a partitioned table sits.
struct FilePartition {
    values: PartitionValues,
    /// The partition columns for its rows.
    columns: Arc<ConstantColumns>,
    /// Its `partitionValues` as the log has them.
    raw: HashMap<String, Option<String>>,
}

impl TableFile {
    /// The file, to read (partition columns included).
    fn source(&self, table: &Table) -> crate::input::InputSource {
        table.data_file(
            &self.path,
            self.size,
            self.partition.as_ref().map(|p| &p.columns),
        )
    }
}

/// What the table was at the version read.
struct Snapshot {
    table: Option<DeltaTable>,
    schema: SchemaRef,
    files: Vec<TableFile>,
    buckets: Option<u32>,
    partitioning: Option<Partitioning>,
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
    let app_id = app_id(&batch.fingerprint);
    if let Some(delta) = &snapshot.table
        && let Some(version) = applied_at(table, delta, &app_id)?
    {
        report.already_applied = true;
        report.table_version = Some(version);
        report.table_files = snapshot.files.len() as u64;
        return Ok(Attempt::Done);
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
                table.write_data_file(&path, &rows.schema(), &[rows], None)?;
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
        // Another writer created the table first; deltalake's create error type is
        // private, so it is known by its message.
        DeltaTableError::GenericError { source } => {
            source.to_string().contains("table already exists")
        }
        _ => false,
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
        let partitioning = Partitioning::try_new(&job.partition_by, &batch.schema, &table.name)?;
        if let Some(p) = &partitioning {
            p.check_creatable(&batch.schema, &table.name)?;
        }
        return Ok(Snapshot {
            table: None,
            schema: Arc::clone(&batch.schema),
            files: Vec::new(),
            buckets: job.buckets,
            partitioning,
            configuration: HashMap::new(),
        });
    };
    let state = delta.snapshot().map_err(|e| table.error(e))?;
    let metadata = state.metadata();
    let configuration: HashMap<String, String> = metadata.configuration().clone();
    check_readable(table, &configuration)?;
    let partition_columns = metadata.partition_columns();
    let buckets = check_creation_options(job, table, &delta)?;
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
    let schema = table_schema(table, state)?;
    check_batch_schema(table, &schema, &batch.schema)?;
    let partitioning = Partitioning::try_new(partition_columns, &schema, &table.name)?;
    let first_key = &batch.spec.keys[0];
    let mut files = Vec::new();
    for view in state.log_data().iter() {
        if view.deletion_vector_descriptor().is_some() {
            return Err(deletion_vector_error(table, &view.path()));
        }
        let path = view.path().to_string();
        let partition = match &partitioning {
            None => None,
            Some(p) => {
                let raw = view.partition_values_map();
                let (values, columns) = p.of_file(&raw, &path)?;
                Some(FilePartition {
                    values,
                    columns,
                    raw,
                })
            }
        };
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
            partition,
            path,
        });
    }
    Ok(Snapshot {
        table: Some(delta),
        schema,
        files,
        buckets,
        partitioning,
        configuration,
    })
}

/// `--buckets` and `--partition-by` apply at creation; given for an existing table, they
/// must be what it was created with. Returns the table's number of buckets.
fn check_creation_options(
    job: &MergeJob,
    table: &Table,
    delta: &DeltaTable,
) -> Result<Option<u32>> {
    let metadata = delta.snapshot().map_err(|e| table.error(e))?.metadata();
    let buckets = match metadata.configuration().get(BUCKETS_PROPERTY) {
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
    let partition_columns = metadata.partition_columns();
    if !job.partition_by.is_empty() && job.partition_by != *partition_columns {
        return Err(Error::InvalidArgument(format!(
            "{}: --partition-by applies when a table is created; this table is {}",
            table.name,
            if partition_columns.is_empty() {
                "not partitioned".to_owned()
            } else {
                format!("partitioned by {}", partition_columns.join(","))
            }
        )));
    }
    Ok(buckets)
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
        .with_partition_columns(
            snapshot
                .partitioning
                .as_ref()
                .map(Partitioning::columns)
                .unwrap_or_default(),
        )
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_numbers_come_from_file_names() {
        assert_eq!(bucket_of_path("bucket-00017-abc.parquet"), Some(17));
        assert_eq!(bucket_of_path("x/bucket-00003-abc.parquet"), Some(3));
        assert_eq!(bucket_of_path("part-abc.parquet"), None);
    }
}
