//! The PostgreSQL target: a merge's decisions as one transaction.
//!
//! ```text
//!  snapshot  BEGIN; an advisory lock per target table (idem's writers of one table take
//!            turns, so no two of them deadlock or decide on a stale read); the batch's
//!            keys COPYed (binary) into a temporary table
//!  state     the run table idem.runs (target, fingerprint) and the target's tombstone
//!            table in schema idem: key and version columns, when the delete was applied
//!  find      the target's versions of the batch's keys: one join, streamed back by COPY
//!  commit    the rows to insert, update or delete COPYed into a temporary table, then one
//!            INSERT … ON CONFLICT (key) DO UPDATE … WHERE <newer> and one DELETE … WHERE
//!            <newer>; the tombstones of the batch's keys replaced; the run recorded;
//!            COMMIT
//! ```
//!
//! The statements carry the version guard themselves, so that a writer that is not idem,
//! committing between the read and the write, still cannot make a row go back in
//! version: if the statements then touch other rows than decided, the attempt is rolled
//! back and made again, as for a serialization failure or a deadlock. A kill at any moment
//! leaves the transaction uncommitted, which the server rolls back.

use std::cell::Cell;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arrow::array::{Array, ArrayRef, BooleanArray, RecordBatch, StringArray};
use arrow::compute::{SortColumn, lexsort_to_indices};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use bytes::{BufMut, Bytes, BytesMut};
use futures::SinkExt;
use tokio_postgres::Client;

use super::convert::{self, Stored};
use super::target::{Attempt, Change, FoundVersions, Target};
use super::tombstones::{DELETED_AT, Tombstones, live_tombstones};
use super::{Batch, MergeJob, MergeReport, Outcome};
use crate::error::{Error, Result};
use crate::pg::copy::{HEADER, RowEncoder, format_pg_lsn};
use crate::pg::table::TableColumns;
use crate::pg::types::PgType;
use crate::pg::{Database, describe, is_retryable, literal, quote};
use idem_core::version::parse_pg_lsn;

/// Bytes of one COPY message.
const COPY_CHUNK: usize = 1 << 20;
/// The advisory lock held while idem's own schema is created.
const BOOTSTRAP_LOCK: i64 = 0x1de3_0000_0001;

/// A PostgreSQL table as a merge target.
pub(super) struct PostgresTarget {
    db: Database,
    /// `schema.name`, unquoted: how runs and messages name the table.
    name: String,
    /// `"schema"."name"`.
    qualified: String,
    /// The tombstone table, quoted, in schema `idem`.
    tombstone_table: String,
    /// Version columns (stored as `pg_lsn` when they are text).
    versions: Vec<String>,
    /// The table's columns as the merge started (`None`: no table yet).
    columns: Option<TableColumns>,
    /// Whether an attempt's transaction is open.
    open: Cell<bool>,
    /// Whether this session holds the table's advisory lock.
    locked: Cell<bool>,
}

/// One attempt's view: what exists, as of the lock.
pub(super) struct Snapshot {
    exists: bool,
    tombstones_exist: bool,
    /// The latest run recorded for the table.
    run: Option<u64>,
    /// Each batch column's type in the table.
    types: Vec<PgType>,
    /// The winners in the table's key order (as its key index orders them, for the
    /// built-in types idem maps keys to), so that the statements walk that index
    /// front to back, and every writer takes row locks in one order.
    key_order: Vec<usize>,
}

/// Where the table holds the batch's keys.
pub(super) struct Found {
    at: Vec<u32>,
    versions: Vec<u8>,
}

impl FoundVersions for Found {
    fn version(&self, row: usize, width: usize) -> Option<&[u8]> {
        let at = *self.at.get(row)?;
        (at != u32::MAX).then(|| &self.versions[at as usize * width..(at as usize + 1) * width])
    }
}

/// How an attempt's statements ended, short of committing.
enum Failure {
    /// A serialization failure, a deadlock, or rows changed under the attempt: again.
    Retry,
    /// Anything else, in one line.
    Fatal(String),
}

impl From<tokio_postgres::Error> for Failure {
    fn from(e: tokio_postgres::Error) -> Self {
        if is_retryable(&e) {
            Self::Retry
        } else {
            Self::Fatal(describe(&e))
        }
    }
}

impl PostgresTarget {
    /// Connects to the database at `location` (a `postgres://` URL, the libpq environment
    /// filling the rest) for `table` (`[SCHEMA.]NAME`).
    pub(super) fn open(location: &str, table: &str) -> Result<Self> {
        let (db, qualified, name) = Database::open_table(location, table)?;
        let tombstone_name = format!("tombstones:{name}");
        // PostgreSQL cuts identifiers at 63 bytes: a long name is hashed rather than cut.
        let tombstone_table = if tombstone_name.len() <= 63 {
            format!("idem.{}", quote(&tombstone_name))
        } else {
            let hash = twox_hash::XxHash3_64::oneshot(name.as_bytes());
            format!("idem.{}", quote(&format!("tombstones:{hash:016x}")))
        };
        Ok(Self {
            qualified,
            name,
            tombstone_table,
            db,
            versions: Vec::new(),
            columns: None,
            open: Cell::new(false),
            locked: Cell::new(false),
        })
    }

    fn fail(&self, message: impl std::fmt::Display) -> Error {
        Error::Postgres {
            target: format!("{} table {}", self.db.display(), self.name),
            message: message.to_string(),
        }
    }

    /// The run that applied the batch with `fingerprint`, if one did.
    fn applied(&self, fingerprint: &str) -> Result<Option<u64>> {
        let (name, fingerprint) = (self.name.clone(), fingerprint.to_owned());
        let row = self.db.run(|c| async move {
            let runs: bool = c
                .query_one("SELECT to_regclass('idem.runs') IS NOT NULL", &[])
                .await?
                .get(0);
            if !runs {
                return Ok(None);
            }
            c.query_opt(
                "SELECT id FROM idem.runs WHERE target = $1 AND fingerprint = $2",
                &[&name, &fingerprint],
            )
            .await
        })?;
        Ok(row.map(|r| r.get::<_, i64>(0) as u64))
    }

    /// The table's columns, if it exists; an error if it has no primary key or unique
    /// index on exactly the key columns.
    fn read_columns(&self, keys: &[String]) -> Result<Option<TableColumns>> {
        let Some(columns) = self.db.table_columns(&self.qualified)? else {
            return Ok(None);
        };
        if !columns.is_unique_on(keys) {
            return Err(self.fail(format!(
                "no primary key or unique index on exactly the key columns ({}): \
                 idem's upsert finds rows by one",
                keys.join(", ")
            )));
        }
        Ok(Some(columns))
    }

    /// Each batch column's type in the table (`columns`), or the type idem creates it
    /// with where there is no table.
    fn types_in(&self, schema: &Schema, columns: Option<&TableColumns>) -> Result<Vec<PgType>> {
        let error = |column: &str, reason: String| Error::TargetType {
            target: self.name.clone(),
            column: column.to_owned(),
            reason,
        };
        schema
            .fields()
            .iter()
            .map(|field| {
                let is_version = self.versions.contains(field.name());
                let own = PgType::for_arrow(field.data_type(), is_version)
                    .map_err(|reason| error(field.name(), reason))?;
                let Some(columns) = columns else {
                    return Ok(own);
                };
                let Some(column) = columns.get(field.name()) else {
                    return Err(error(
                        field.name(),
                        format!("the table has no such column (it has {})", columns.names()),
                    ));
                };
                match &column.pg {
                    Some(table_type) if own.storable_in(table_type) => Ok(*table_type),
                    _ => Err(error(
                        field.name(),
                        format!(
                            "the batch's {} (stored as {}) does not fit the table's {}",
                            field.data_type(),
                            own.sql(),
                            column.shown
                        ),
                    )),
                }
            })
            .collect()
    }

    /// Ends an open attempt without committing, and lets the next writer in.
    fn rollback(&self) -> Result<()> {
        if self.open.replace(false) {
            self.db.execute_batch("ROLLBACK")?;
        }
        self.unlock()
    }

    fn unlock(&self) -> Result<()> {
        if self.locked.replace(false) {
            self.db
                .execute_batch(&format!("SELECT pg_advisory_unlock({})", self.lock_key()))?;
        }
        Ok(())
    }

    /// The advisory lock idem's writers of this table take turns by.
    fn lock_key(&self) -> String {
        format!(
            "hashtextextended({}, 0)",
            literal(&format!("idem:{}", self.name))
        )
    }

    /// `l.k1 = r.k1 AND …` over the key columns.
    fn key_match(batch: &Batch, left: &str, right: &str) -> String {
        batch
            .spec
            .keys
            .iter()
            .map(|k| format!("{left}.{q} = {right}.{q}", q = quote(k)))
            .collect::<Vec<_>>()
            .join(" AND ")
    }

    /// `name type, …` for the named batch columns.
    fn definitions(batch: &Batch, types: &[PgType], names: &[&String]) -> String {
        names
            .iter()
            .map(|name| {
                let at = batch.schema.index_of(name).unwrap_or_default();
                format!("{} {}", quote(name), types[at].sql())
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The key and version columns of `batch` (in its stored types) and their types.
    fn key_and_version(
        batch: &Batch,
        snapshot: &Snapshot,
    ) -> (Vec<String>, Vec<PgType>, Vec<Field>) {
        let names: Vec<String> = batch
            .spec
            .keys
            .iter()
            .chain(&batch.spec.versions)
            .cloned()
            .collect();
        let mut types = Vec::new();
        let mut fields = Vec::new();
        for name in &names {
            if let Ok(at) = batch.schema.index_of(name) {
                types.push(snapshot.types[at]);
                fields.push(batch.schema.field(at).clone());
            }
        }
        (names, types, fields)
    }

    /// The key and version columns (and `extra`, where given) of the rows of `table`
    /// whose keys the batch has, joined with the staged keys. `by_index`: the join probes
    /// the table's key index once per staged key, in key order, whatever the planner
    /// estimates (it prices each probe as a random read and prefers hashing all of a
    /// large table, which took 4× as long for a 1M-key batch into 10M rows).
    fn read_batch_keys(
        &self,
        table: &str,
        batch: &Batch,
        snapshot: &Snapshot,
        extra: Option<(&str, PgType, DataType)>,
        by_index: bool,
    ) -> Result<RecordBatch> {
        let (mut names, mut types, mut fields) = Self::key_and_version(batch, snapshot);
        if let Some((name, pg, arrow)) = extra {
            names.push(name.to_owned());
            types.push(pg);
            fields.push(Field::new(name, arrow, true));
        }
        let list = names
            .iter()
            .map(|n| format!("t.{}", quote(n)))
            .collect::<Vec<_>>()
            .join(", ");
        let planner = ["enable_hashjoin", "enable_mergejoin"];
        let before: Vec<String> = if by_index {
            let row = self.db.run(|c| async move {
                c.query_one(
                    "SELECT current_setting('enable_hashjoin'), current_setting('enable_mergejoin')",
                    &[],
                )
                .await
            })?;
            let settings = vec![row.get(0), row.get(1)];
            let off: Vec<String> = planner
                .iter()
                .map(|p| format!("SET LOCAL {p} = off"))
                .collect();
            self.db.execute_batch(&off.join("; "))?;
            settings
        } else {
            Vec::new()
        };
        let rows = self.db.read_all(
            &format!(
                "SELECT {list} FROM _idem_keys s JOIN {table} t ON {}",
                Self::key_match(batch, "t", "s")
            ),
            &types,
            &Arc::new(Schema::new(fields)),
        )?;
        if by_index {
            // Later joins (with the small tombstone table) are the planner's to choose again.
            let restore: Vec<String> = planner
                .iter()
                .zip(&before)
                .map(|(p, v)| format!("SET LOCAL {p} = {}", literal(v)))
                .collect();
            self.db.execute_batch(&restore.join("; "))?;
        }
        Ok(rows)
    }

    /// What commit does, up to and including COMMIT.
    fn commit_statements(
        &self,
        job: &MergeJob,
        snapshot: &Snapshot,
        batch: &Batch,
        change: &Change<'_, Found>,
        report: &MergeReport,
    ) -> Result<Committed, Failure> {
        let types = &snapshot.types;
        let names: Vec<&String> = batch.schema.fields().iter().map(|f| f.name()).collect();
        let column_list = names
            .iter()
            .map(|n| quote(n))
            .collect::<Vec<_>>()
            .join(", ");
        let keys = batch
            .spec
            .keys
            .iter()
            .map(|k| quote(k))
            .collect::<Vec<_>>()
            .join(", ");
        let winners = batch.winners.rows();
        let arrays: Vec<(&ArrayRef, PgType)> = winners
            .columns()
            .iter()
            .zip(types.iter().copied())
            .collect();
        let outcome = change.outcome;
        let apply: Vec<usize> = snapshot
            .key_order
            .iter()
            .copied()
            .filter(|&r| {
                matches!(
                    outcome[r],
                    Outcome::Insert | Outcome::Update | Outcome::Delete
                )
            })
            .collect();
        let upserts = outcome
            .iter()
            .filter(|o| matches!(o, Outcome::Insert | Outcome::Update))
            .count() as u64;
        let deletes = outcome
            .iter()
            .filter(|o| matches!(o, Outcome::Delete))
            .count() as u64;
        let (tomb_names, tomb_types, _) = Self::key_and_version(batch, snapshot);
        let stats = serde_json::json!({
            "rows_in": report.rows_in,
            "distinct_keys": report.distinct_keys,
            "inserted": report.inserted,
            "updated": report.updated,
            "deleted": report.deleted,
            "deletes_without_row": report.deletes_without_row,
            "stale": report.stale,
            "resurrections_blocked": report.resurrections_blocked,
            "attempts": report.attempts,
        })
        .to_string();
        let horizon = change
            .now
            .saturating_sub(job.tombstone_retention.as_millis().min(i64::MAX as u128) as i64);
        let tomb = &self.tombstone_table;
        let client = self.db.client();
        self.db.block_on(async {
            // A table this transaction creates is seen by no one else: its rows go straight
            // in, and its key index is built after them, in one sort rather than row by row.
            let fill_new = change.data_change && !snapshot.exists;
            if !snapshot.exists {
                let definitions = Self::definitions(batch, types, &names);
                let key = if fill_new {
                    String::new()
                } else {
                    format!(", PRIMARY KEY ({keys})")
                };
                client
                    .batch_execute(&format!("CREATE TABLE {} ({definitions}{key})", self.qualified))
                    .await?;
            }
            if !snapshot.tombstones_exist {
                let key_version: Vec<&String> = tomb_names.iter().collect();
                let definitions = Self::definitions(batch, types, &key_version);
                client
                    .batch_execute(&format!(
                        "CREATE TABLE {tomb} ({definitions}, {} bigint NOT NULL, PRIMARY KEY ({keys}))",
                        quote(DELETED_AT)
                    ))
                    .await?;
            }
            if fill_new {
                let copied = copy_in(
                    client,
                    &format!("COPY {} ({column_list}) FROM STDIN (FORMAT binary)", self.qualified),
                    &arrays,
                    apply.iter().copied(),
                )
                .await?;
                if copied != upserts {
                    return Err(Failure::Fatal(format!("{copied} rows copied of {upserts}")));
                }
                client
                    .batch_execute(&format!(
                        "ALTER TABLE {} ADD PRIMARY KEY ({keys})",
                        self.qualified
                    ))
                    .await?;
            } else if change.data_change {
                let definitions = Self::definitions(batch, types, &names);
                client
                    .batch_execute(&format!(
                        "CREATE TEMP TABLE _idem_rows ({definitions}, _idem_delete boolean) ON COMMIT DROP"
                    ))
                    .await?;
                let flags: ArrayRef = Arc::new(BooleanArray::from(batch.tombstone.clone()));
                let mut with_flags = arrays.clone();
                with_flags.push((&flags, PgType::Bool));
                copy_in(
                    client,
                    &format!("COPY _idem_rows ({column_list}, _idem_delete) FROM STDIN (FORMAT binary)"),
                    &with_flags,
                    apply.iter().copied(),
                )
                .await?;
                if upserts > 0 {
                    let set = names
                        .iter()
                        .filter(|n| !batch.spec.keys.contains(n))
                        .map(|n| format!("{q} = EXCLUDED.{q}", q = quote(n)))
                        .collect::<Vec<_>>()
                        .join(", ");
                    let written = client
                        .execute(
                            &format!(
                                "INSERT INTO {} AS _idem_t ({column_list}) \
                                 SELECT {column_list} FROM _idem_rows WHERE NOT _idem_delete \
                                 ON CONFLICT ({keys}) DO UPDATE SET {set} WHERE {}",
                                self.qualified,
                                newer("EXCLUDED", "_idem_t", &batch.spec.versions)
                            ),
                            &[],
                        )
                        .await?;
                    if written != upserts {
                        return Err(Failure::Retry);
                    }
                }
                if deletes > 0 {
                    let removed = client
                        .execute(
                            &format!(
                                "DELETE FROM {} AS _idem_t USING _idem_rows s \
                                 WHERE s._idem_delete AND {} AND {}",
                                self.qualified,
                                Self::key_match(batch, "_idem_t", "s"),
                                newer("s", "_idem_t", &batch.spec.versions)
                            ),
                            &[],
                        )
                        .await?;
                    if removed != deletes {
                        return Err(Failure::Retry);
                    }
                }
            }
            let mut expired = None;
            if let Some(next) = &change.tombstones {
                expired = Some(
                    client
                        .execute(
                            &format!("DELETE FROM {tomb} WHERE {} < $1", quote(DELETED_AT)),
                            &[&horizon],
                        )
                        .await?,
                );
                if snapshot.exists {
                    client
                        .execute(
                            &format!(
                                "DELETE FROM {tomb} AS t USING _idem_keys s WHERE {}",
                                Self::key_match(batch, "t", "s")
                            ),
                            &[],
                        )
                        .await?;
                }
                if next.num_rows() > 0 {
                    let mut columns: Vec<(&ArrayRef, PgType)> = Vec::new();
                    for (name, pg) in tomb_names.iter().zip(&tomb_types) {
                        let at = next.schema().index_of(name).map_err(|e| Failure::Fatal(e.to_string()))?;
                        columns.push((next.column(at), *pg));
                    }
                    let at = next.schema().index_of(DELETED_AT).map_err(|e| Failure::Fatal(e.to_string()))?;
                    columns.push((next.column(at), PgType::Int8));
                    let list = tomb_names
                        .iter()
                        .map(|n| quote(n))
                        .chain([quote(DELETED_AT)])
                        .collect::<Vec<_>>()
                        .join(", ");
                    copy_in(
                        client,
                        &format!("COPY {tomb} ({list}) FROM STDIN (FORMAT binary)"),
                        &columns,
                        0..next.num_rows(),
                    )
                    .await?;
                }
            }
            let tombstones: i64 = client
                .query_one(&format!("SELECT count(*) FROM {tomb}"), &[])
                .await?
                .get(0);
            let run: i64 = client
                .query_one(
                    "INSERT INTO idem.runs (target, fingerprint, stats) \
                     VALUES ($1, $2, $3::text::jsonb) RETURNING id",
                    &[&self.name, &batch.fingerprint, &stats],
                )
                .await?
                .get(0);
            client.batch_execute("COMMIT").await?;
            Ok(Committed {
                run: run as u64,
                tombstones: tombstones as u64,
                expired,
            })
        })
    }
}

impl Drop for PostgresTarget {
    fn drop(&mut self) {
        // A merge that found its batch applied, or nothing to change, ends here; closing
        // the connection would end the transaction and the lock just the same.
        drop(self.rollback());
    }
}

/// What a commit leaves to report.
struct Committed {
    run: u64,
    tombstones: u64,
    expired: Option<u64>,
}

impl Target for PostgresTarget {
    type Snapshot = Snapshot;
    type Found = Found;

    fn display(&self) -> PathBuf {
        PathBuf::from(format!("{} table {}", self.db.display(), self.name))
    }

    fn report_name(&self, _job: &MergeJob) -> String {
        self.name.clone()
    }

    fn database(&self) -> Option<String> {
        Some(self.db.display().to_owned())
    }

    fn prepare(&mut self, job: &MergeJob, fingerprint: &str) -> Result<Option<u64>> {
        if job.buckets.is_some() || !job.partition_by.is_empty() {
            return Err(Error::InvalidArgument(
                "--buckets and --partition-by shape Delta tables; a PostgreSQL table is \
                 found by its key index"
                    .to_owned(),
            ));
        }
        self.versions = job.spec.versions.clone();
        if let Some(run) = self.applied(fingerprint)? {
            return Ok(Some(run));
        }
        self.columns = self.read_columns(&job.spec.keys)?;
        Ok(None)
    }

    fn to_stored(&self, rows: &RecordBatch) -> Result<RecordBatch> {
        let schema = rows.schema();
        let types = self.types_in(&schema, self.columns.as_ref())?;
        let stored_schema: SchemaRef = Arc::new(Schema::new(
            schema
                .fields()
                .iter()
                .zip(&types)
                .map(|(f, t)| Field::new(f.name(), t.arrow(f.data_type()), true))
                .collect::<Vec<_>>(),
        ));
        let stored = convert::to_stored(
            rows,
            &stored_schema,
            &self.name,
            &Stored {
                system: "PostgreSQL",
                type_name: pg_type_name,
            },
        )?;
        // pg_lsn text in PostgreSQL's spelling, so that batch values and values read back
        // are the same strings.
        let mut columns = stored.columns().to_vec();
        for (at, pg) in types.iter().enumerate() {
            if *pg != PgType::PgLsn {
                continue;
            }
            let text = columns[at].as_any().downcast_ref::<StringArray>();
            let Some(text) = text else { continue };
            let mut spelled = Vec::with_capacity(text.len());
            for value in text.iter() {
                spelled.push(match value {
                    None => None,
                    Some(v) => Some(format_pg_lsn(parse_pg_lsn(v).ok_or_else(|| {
                        Error::TargetType {
                            target: self.name.clone(),
                            column: schema.field(at).name().clone(),
                            reason: format!("value '{v}' is not a pg_lsn (X/Y in hexadecimal)"),
                        }
                    })?)),
                });
            }
            columns[at] = Arc::new(StringArray::from(spelled));
        }
        RecordBatch::try_new(stored.schema(), columns).map_err(Error::arrow(&self.name))
    }

    fn snapshot(&self, job: &MergeJob, batch: &Batch) -> Result<Snapshot> {
        self.rollback()?;
        let key_order = key_order(batch);
        let runs: bool = self
            .db
            .run(|c| c.query_one("SELECT to_regclass('idem.runs') IS NOT NULL", &[]))?
            .get(0);
        // Session locks, taken before the transaction begins: a transaction that starts
        // after the writer before it committed sees that writer's tables (a lock taken
        // inside one would leave its cached view of the catalog as it was at BEGIN).
        if !runs {
            self.db.execute_batch(&format!(
                "SELECT pg_advisory_lock({BOOTSTRAP_LOCK}); BEGIN; \
                 CREATE SCHEMA IF NOT EXISTS idem; \
                 CREATE TABLE IF NOT EXISTS idem.runs (\
                   id bigserial PRIMARY KEY, target text NOT NULL, fingerprint text NOT NULL, \
                   stats jsonb NOT NULL, committed_at timestamptz NOT NULL DEFAULT now(), \
                   UNIQUE (target, fingerprint)); \
                 COMMIT; SELECT pg_advisory_unlock({BOOTSTRAP_LOCK})"
            ))?;
        }
        self.db
            .execute_batch(&format!("SELECT pg_advisory_lock({})", self.lock_key()))?;
        self.locked.set(true);
        self.db.execute_batch("BEGIN")?;
        self.open.set(true);
        // The table as of the lock: another writer may have created it since `prepare`.
        let columns = self.read_columns(&job.spec.keys)?;
        let types = self.types_in(&batch.schema, columns.as_ref())?;
        for (field, pg) in batch.schema.fields().iter().zip(&types) {
            if pg.arrow(field.data_type()) != *field.data_type() {
                return Err(self.fail(format!(
                    "column '{}' became {} while this merge read its batch: run it again",
                    field.name(),
                    pg.sql()
                )));
            }
        }
        let exists = columns.is_some();
        let tomb = literal(&self.tombstone_table);
        let name = self.name.clone();
        let (tombstones_exist, run) = self.db.run(|c| async move {
            let tombstones: bool = c
                .query_one(&format!("SELECT to_regclass({tomb}) IS NOT NULL"), &[])
                .await?
                .get(0);
            let run: Option<i64> = c
                .query_one("SELECT max(id) FROM idem.runs WHERE target = $1", &[&name])
                .await?
                .get(0);
            Ok((tombstones, run))
        })?;
        let snapshot = Snapshot {
            exists,
            tombstones_exist,
            run: run.map(|r| r as u64),
            types,
            key_order,
        };
        if exists {
            self.stage_keys(batch, &snapshot)?;
        }
        Ok(snapshot)
    }

    fn version(&self, snapshot: &Snapshot) -> Option<u64> {
        snapshot.exists.then_some(snapshot.run.unwrap_or(0))
    }

    fn size(&self, _snapshot: &Snapshot) -> (u64, Option<u64>) {
        // Counting a table's rows reads all of it: not done for a report.
        (0, None)
    }

    fn applied_in(&self, _snapshot: &Snapshot, fingerprint: &str) -> Result<Option<u64>> {
        let run = self.applied(fingerprint)?;
        if run.is_some() {
            self.rollback()?;
        }
        Ok(run)
    }

    fn tombstones(
        &self,
        snapshot: &Snapshot,
        batch: &Batch,
        retention: Duration,
        now: i64,
    ) -> Result<Tombstones> {
        if !(snapshot.exists && snapshot.tombstones_exist) {
            return Ok(Tombstones {
                rows: None,
                expired: 0,
            });
        }
        let deleted_at = (DELETED_AT, PgType::Int8, DataType::Int64);
        let rows = self.read_batch_keys(
            &self.tombstone_table,
            batch,
            snapshot,
            Some(deleted_at),
            false,
        )?;
        live_tombstones(rows, &self.display(), batch, retention, now)
    }

    fn find(
        &self,
        snapshot: &Snapshot,
        batch: &Batch,
        _decided: &[Option<Outcome>],
        _report: &mut MergeReport,
    ) -> Result<Found> {
        let mut at = vec![u32::MAX; batch.winners.len()];
        if !snapshot.exists {
            return Ok(Found {
                at,
                versions: Vec::new(),
            });
        }
        let rows = self.read_batch_keys(&self.qualified, batch, snapshot, None, true)?;
        let probe = batch
            .winners
            .probe(&rows)
            .map_err(Error::arrow(&self.name))?;
        for (table_row, winner) in probe.found.iter().enumerate() {
            if let Some(winner) = winner {
                at[*winner as usize] = table_row as u32;
            }
        }
        Ok(Found {
            at,
            versions: probe.versions,
        })
    }

    fn commit(
        &self,
        job: &MergeJob,
        snapshot: &Snapshot,
        batch: &Batch,
        change: Change<'_, Found>,
        report: &mut MergeReport,
    ) -> Result<Attempt> {
        match self.commit_statements(job, snapshot, batch, &change, report) {
            Ok(committed) => {
                self.open.set(false);
                self.unlock()?;
                report.table_version = Some(committed.run);
                report.tombstones = committed.tombstones;
                if let Some(expired) = committed.expired {
                    report.tombstones_expired = expired;
                }
                Ok(Attempt::Done)
            }
            Err(Failure::Retry) => {
                self.rollback()?;
                Ok(Attempt::Conflict)
            }
            Err(Failure::Fatal(message)) => {
                // The connection may be gone; the server rolls back what it cannot finish.
                drop(self.rollback());
                Err(self.fail(message))
            }
        }
    }
}

impl PostgresTarget {
    /// Copies the batch's keys, in key order, into a temporary table that the attempt's
    /// reads join with.
    fn stage_keys(&self, batch: &Batch, snapshot: &Snapshot) -> Result<()> {
        let winners = batch.winners.rows();
        let key_names: Vec<&String> = batch.spec.keys.iter().collect();
        let definitions = Self::definitions(batch, &snapshot.types, &key_names);
        let mut columns: Vec<(&ArrayRef, PgType)> = Vec::new();
        for name in &key_names {
            let at = batch
                .schema
                .index_of(name)
                .map_err(Error::arrow(&self.name))?;
            columns.push((winners.column(at), snapshot.types[at]));
        }
        let list = key_names
            .iter()
            .map(|n| quote(n))
            .collect::<Vec<_>>()
            .join(", ");
        let client = self.db.client();
        self.db
            .block_on(async {
                client
                    .batch_execute(&format!(
                        "CREATE TEMP TABLE _idem_keys ({definitions}) ON COMMIT DROP"
                    ))
                    .await?;
                copy_in(
                    client,
                    &format!("COPY _idem_keys ({list}) FROM STDIN (FORMAT binary)"),
                    &columns,
                    snapshot.key_order.iter().copied(),
                )
                .await?;
                // Without statistics the planner guesses the size of a temporary table.
                client.batch_execute("ANALYZE _idem_keys").await?;
                Ok(())
            })
            .map_err(|f| match f {
                Failure::Retry => self.fail("the server asked for a retry while staging keys"),
                Failure::Fatal(message) => self.fail(message),
            })
    }
}

/// The winners sorted by their key columns' values: the order of PostgreSQL's btree on
/// them (for text, under the C collation; under another one, still one order that every
/// writer shares). Types Arrow cannot sort fall back to the order of the encoded keys.
fn key_order(batch: &Batch) -> Vec<usize> {
    let rows = batch.winners.rows();
    let columns: Vec<SortColumn> = batch
        .spec
        .keys
        .iter()
        .filter_map(|k| rows.column_by_name(k))
        .map(|values| SortColumn {
            values: Arc::clone(values),
            options: None,
        })
        .collect();
    match lexsort_to_indices(&columns, None) {
        Ok(order) if columns.len() == batch.spec.keys.len() => {
            order.values().iter().map(|&r| r as usize).collect()
        }
        _ => {
            let mut order: Vec<usize> = (0..batch.winners.len()).collect();
            order.sort_unstable_by(|&a, &b| batch.winners.key(a).cmp(batch.winners.key(b)));
            order
        }
    }
}

/// A column type as PostgreSQL names it, for conversion messages.
fn pg_type_name(data_type: &DataType) -> String {
    PgType::for_arrow(data_type, false).map_or_else(|_| data_type.to_string(), |t| t.sql())
}

/// Sends `rows` of `columns` by binary COPY with `sql` (`COPY … FROM STDIN …`).
async fn copy_in(
    client: &Client,
    sql: &str,
    columns: &[(&ArrayRef, PgType)],
    rows: impl Iterator<Item = usize>,
) -> Result<u64, Failure> {
    let encoder = RowEncoder::try_new(columns).map_err(Failure::Fatal)?;
    let sink = client.copy_in::<_, Bytes>(sql).await?;
    futures::pin_mut!(sink);
    let mut buffer = BytesMut::with_capacity(COPY_CHUNK + (COPY_CHUNK >> 4));
    buffer.put_slice(HEADER);
    for row in rows {
        encoder.put_row(row, &mut buffer).map_err(Failure::Fatal)?;
        if buffer.len() >= COPY_CHUNK {
            sink.send(buffer.split().freeze()).await?;
        }
    }
    buffer.put_i16(-1);
    sink.send(buffer.freeze()).await?;
    Ok(sink.finish().await?)
}

/// `new` is newer than `old` in `versions`, compared left to right, a NULL below every
/// value (as idem's version encoding orders them).
fn newer(new: &str, old: &str, versions: &[String]) -> String {
    let greater = |v: &str| {
        format!("(({old}.{v} IS NULL AND {new}.{v} IS NOT NULL) OR {old}.{v} < {new}.{v})")
    };
    let mut columns = versions.iter().rev().map(|v| quote(v));
    let Some(last) = columns.next() else {
        return "false".to_owned();
    };
    let mut condition = greater(&last);
    for v in columns {
        condition = format!(
            "({} OR ({old}.{v} IS NOT DISTINCT FROM {new}.{v} AND {condition}))",
            greater(&v)
        );
    }
    condition
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guard_orders_composite_versions_left_to_right_with_nulls_lowest() {
        assert_eq!(
            newer("n", "o", &["v".to_owned()]),
            r#"((o."v" IS NULL AND n."v" IS NOT NULL) OR o."v" < n."v")"#
        );
        let two = newer("n", "o", &["a".to_owned(), "b".to_owned()]);
        assert!(two.starts_with(r#"(((o."a" IS NULL AND n."a" IS NOT NULL) OR o."a" < n."a") OR (o."a" IS NOT DISTINCT FROM n."a" AND"#), "{two}");
    }
}
