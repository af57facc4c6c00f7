//! The Delta Lake target: a merge's decisions as one Delta commit.
//!
//! ```text
//!  snapshot  the log at one version: data files with their statistics, the tombstone
//!            state file (table property `idem.tombstones`), applied batches (`txn`)
//!  find      files that may hold batch keys (bucket, key statistics) ──key + version
//!            columns only──▶ which table rows the batch meets, at which versions
//!  write     files holding replaced or deleted rows are rewritten without them; new rows
//!            go to new files sorted by key (one file per touched bucket with --buckets)
//!  commit    one Delta transaction: remove + add, the new tombstone state (table
//!            metadata), and the batch's fingerprint (an application `txn`), against the
//!            version read
//! ```
//!
//! Every commit is made against the exact version it read (no automatic rebase), so two
//! concurrent merges serialise: the loser re-reads and re-decides, and no key is lost or
//! duplicated. Files written by a merge that does not commit (a conflict, an error, a kill)
//! are never referenced by the log, so readers cannot see them; `idem vacuum` removes them.

mod files;
mod find;
mod rewrite;
mod types;
mod vacuum;

pub use vacuum::{VacuumReport, run_vacuum};

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arrow::array::RecordBatch;
use arrow::compute::concat_batches;
use arrow::datatypes::SchemaRef;
use deltalake_core::kernel::engine::arrow_conversion::TryFromArrow;
use deltalake_core::kernel::transaction::{CommitBuilder, CommitProperties, TransactionError};
use deltalake_core::kernel::{Action, MetadataExt, StructType, Transaction};
use deltalake_core::protocol::{DeltaOperation, MergePredicate, SaveMode};
use deltalake_core::{DeltaTable, DeltaTableError};
use serde_json::{Value, json};

use super::target::{Attempt, Change, FoundVersions, Target};
use super::tombstones::{Tombstones, live_tombstones};
use super::{Batch, MergeJob, MergeReport};
use crate::error::{Error, Result};
use crate::read::delta::partition::{PartitionValues, Partitioning};
use crate::read::delta::{Table, check_readable, deletion_vector_error, table_schema};
use crate::read::input::{ConstantColumns, InputFile};
use crate::storage::StorageOptions;
use find::{Found, find_rows};
use rewrite::write_data;

/// A Delta table as a merge target.
pub(super) struct DeltaTarget {
    table: Table,
    /// The columns of the table as it was when the merge started (`None`: no table yet),
    /// which the batch is stored in.
    columns: Option<SchemaRef>,
}

impl DeltaTarget {
    /// The table at `location` (a path or URL; it need not exist yet).
    pub(super) fn open(location: &str, storage: &StorageOptions) -> Result<Self> {
        Ok(Self {
            table: Table::open(location, storage)?,
            columns: None,
        })
    }
}

impl FoundVersions for Found {
    fn version(&self, row: usize, width: usize) -> Option<&[u8]> {
        Found::version(self, row, width)
    }
}

impl Target for DeltaTarget {
    type Snapshot = Snapshot;
    type Found = Found;

    fn display(&self) -> PathBuf {
        self.table.display("")
    }

    fn prepare(&mut self, job: &MergeJob, fingerprint: &str) -> Result<Option<u64>> {
        let table = &self.table;
        let Some(delta) = table.load()? else {
            return Ok(None);
        };
        check_creation_options(job, table, &delta)?;
        if let Some(version) = applied_at(table, &delta, &app_id(fingerprint))? {
            return Ok(Some(version));
        }
        self.columns = Some(table_schema(
            table,
            delta.snapshot().map_err(|e| table.error(e))?,
        )?);
        Ok(None)
    }

    fn to_stored(&self, rows: &RecordBatch) -> Result<RecordBatch> {
        let name = &self.table.name;
        let schema = match &self.columns {
            Some(columns) => types::schema_in_table(&rows.schema(), columns, name)?,
            None => types::stored_schema(&rows.schema(), name)?,
        };
        types::to_stored(rows, &schema, name)
    }

    fn snapshot(&self, job: &MergeJob, batch: &Batch) -> Result<Snapshot> {
        read_snapshot(job, &self.table, batch)
    }

    fn version(&self, snapshot: &Snapshot) -> Option<u64> {
        snapshot.table.as_ref().and_then(DeltaTable::version)
    }

    fn size(&self, snapshot: &Snapshot) -> (u64, Option<u64>) {
        let rows = snapshot.files.iter().map(|f| f.rows).sum::<Option<u64>>();
        (snapshot.files.len() as u64, rows)
    }

    fn applied_in(&self, snapshot: &Snapshot, fingerprint: &str) -> Result<Option<u64>> {
        match &snapshot.table {
            Some(delta) => applied_at(&self.table, delta, &app_id(fingerprint)),
            None => Ok(None),
        }
    }

    fn tombstones(
        &self,
        snapshot: &Snapshot,
        batch: &Batch,
        retention: Duration,
        now: i64,
    ) -> Result<Tombstones> {
        let Some(path) = snapshot
            .configuration
            .get(TOMBSTONES_PROPERTY)
            .filter(|p| !p.is_empty())
        else {
            return Ok(Tombstones {
                rows: None,
                expired: 0,
            });
        };
        let source = self.table.state_file(path)?;
        let file = InputFile::open(&source)?;
        let display = source.path();
        let names: Vec<&str> = file
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .collect();
        let batches = file.read_columns(&names)?.collect::<Result<Vec<_>>>()?;
        let rows = concat_batches(file.schema(), &batches).map_err(Error::arrow(&display))?;
        live_tombstones(rows, &display, batch, retention, now)
    }

    fn find(
        &self,
        snapshot: &Snapshot,
        batch: &Batch,
        decided: &[Option<super::Outcome>],
        report: &mut MergeReport,
    ) -> Result<Found> {
        find_rows(&self.table, snapshot, batch, decided, report)
    }

    fn commit(
        &self,
        job: &MergeJob,
        snapshot: &Snapshot,
        batch: &Batch,
        change: Change<'_, Found>,
        report: &mut MergeReport,
    ) -> Result<Attempt> {
        let table = &self.table;
        let mut written = Written::new(table);
        let mut actions: Vec<Action> = Vec::new();
        if change.data_change {
            write_data(
                job,
                table,
                snapshot,
                batch,
                change.outcome,
                change.found,
                &mut written,
                &mut actions,
                report,
            )?;
        }
        let mut configuration = snapshot.configuration.clone();
        if let Some(rows) = change.tombstones {
            let path = if rows.num_rows() > 0 {
                let path = format!("_idem/tombstones-{}.parquet", unique_id());
                written.push(path.clone());
                table.write_data_file(&path, &rows.schema(), &[rows], None)?;
                path
            } else {
                String::new()
            };
            configuration.insert(TOMBSTONES_PROPERTY.to_owned(), path);
        }

        let txn =
            Transaction::new_with_last_update(app_id(&batch.fingerprint), 1, Some(change.now));
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
                snapshot,
                configuration,
                actions,
                properties,
            ),
            Some(delta) => commit_to(table, delta, snapshot, configuration, actions, properties),
        };
        match committed {
            Ok(version) => {
                written.keep();
                report.table_version = Some(version);
                Ok(Attempt::Done)
            }
            Err(e) if is_conflict(&e) => Ok(Attempt::Conflict),
            Err(e) => Err(table.error(e)),
        }
    }
}

/// Table property: the key columns the table was created with.
const KEY_PROPERTY: &str = "idem.key";
/// Table property: the version columns.
const VERSION_PROPERTY: &str = "idem.version";
/// Table property: number of buckets, when rows are clustered into files by key hash.
const BUCKETS_PROPERTY: &str = "idem.buckets";
/// Table property: the tombstone state file of this table version (relative path, or empty).
const TOMBSTONES_PROPERTY: &str = "idem.tombstones";

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

/// One data file of the table.
pub(super) struct TableFile {
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
    fn source(&self, table: &Table) -> crate::read::input::InputSource {
        table.data_file(
            &self.path,
            self.size,
            self.partition.as_ref().map(|p| &p.columns),
        )
    }
}

/// What the table was at the version read.
pub(crate) struct Snapshot {
    table: Option<DeltaTable>,
    schema: SchemaRef,
    files: Vec<TableFile>,
    buckets: Option<u32>,
    partitioning: Option<Partitioning>,
    configuration: HashMap<String, String>,
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
        if !crate::read::schema::same_family(found.data_type(), field.data_type()) {
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
