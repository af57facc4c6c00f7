//! `idem verify`: reconciliation. Does a target hold exactly what a dedup of the sources
//! gives?
//!
//! Neither side is sorted. The sources are deduplicated as `idem dedup` would (the same two
//! passes), and each winning row goes into a table from its key's 128-bit hash to its row's
//! 128-bit hash (every column, by value: see [`idem_core::RowHasher`]). The target is then
//! streamed once against that table: a key it does not hold is an extra row, a key seen
//! twice a duplicate, a different row hash a differing row; keys never seen are missing
//! rows. Both sides also get an order-independent checksum (the wrapping sum of their row
//! hashes). Reports are bounded: only the first N rows of each kind are described, and for
//! those the expected rows are fetched again (a second dedup of the sources, only when
//! something is missing or differs) to name the columns that differ.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::time::Instant;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use idem_core::{DedupSpec, DedupStats, RowHasher, describe_row};
use serde::Serialize;

use crate::dedup::{DedupJob, dedup_rows};
use crate::error::{Error, Result};
use crate::progress::{NoProgress, Progress};
use crate::read::expand::expand_inputs;
use crate::read::input::InputFile;
use crate::read::schema::conform;
use crate::storage::StorageOptions;
use crate::units::thousands;

/// What to compare.
#[derive(Debug, Clone)]
pub struct VerifyJob {
    /// The sources: files, directories, globs or URLs, in input order.
    pub sources: Vec<String>,
    /// The target: files, directories, globs or URLs holding the rows to check; or one
    /// PostgreSQL database (`postgres://…`) holding [`VerifyJob::target_table`].
    pub target: Vec<String>,
    /// The table of a PostgreSQL target, `[SCHEMA.]NAME`.
    pub target_table: Option<String>,
    /// Key, version and policies the target was deduplicated with.
    pub spec: DedupSpec,
    /// Memory limit of the sources' dedup (see [`DedupJob::memory_limit`]).
    pub memory_limit: Option<u64>,
    /// Rows of each kind of difference to describe.
    pub max_report: usize,
    /// Configuration of object stores.
    pub storage: StorageOptions,
}

impl VerifyJob {
    /// A job with the default spec, describing up to 10 rows of each kind.
    pub fn new(sources: Vec<String>, target: Vec<String>) -> Self {
        Self {
            sources,
            target,
            target_table: None,
            spec: DedupSpec::default(),
            memory_limit: None,
            max_report: 10,
            storage: StorageOptions::default(),
        }
    }
}

/// A target row whose key the sources have, with other values.
#[derive(Debug, Clone, Serialize)]
pub struct RowDifference {
    /// The key (and the target's version), as `k=v, … at version=…`.
    pub key: String,
    /// The columns whose values differ.
    pub columns: Vec<String>,
}

/// The outcome of a verification; `--json` prints it.
#[derive(Debug, Clone, Serialize)]
pub struct VerifyReport {
    /// Whether the target holds exactly the expected rows, and no others.
    pub matches: bool,
    /// Rows a dedup of the sources gives.
    pub expected_rows: u64,
    /// Rows in the target.
    pub target_rows: u64,
    /// Order-independent checksum of the expected rows (hex).
    pub expected_checksum: String,
    /// Order-independent checksum of the target's rows (hex).
    pub target_checksum: String,
    /// Target rows equal to their expected row.
    pub matching_rows: u64,
    /// Expected rows whose key the target lacks.
    pub missing_rows: u64,
    /// Target rows whose key the sources do not give.
    pub extra_rows: u64,
    /// Target rows whose key is expected but whose values differ.
    pub differing_rows: u64,
    /// Target rows whose key an earlier target row already had.
    pub duplicate_rows: u64,
    /// Columns the sources have and the target lacks.
    pub missing_columns: Vec<String>,
    /// Columns the target has and the sources lack.
    pub extra_columns: Vec<String>,
    /// Every column that differs in the described differing rows.
    pub differing_columns: Vec<String>,
    /// The first missing rows' keys.
    pub missing: Vec<String>,
    /// The first extra rows' keys.
    pub extra: Vec<String>,
    /// The first duplicated keys.
    pub duplicates: Vec<String>,
    /// The first differing rows.
    pub differing: Vec<RowDifference>,
    /// The sources' dedup counts.
    pub source: DedupStats,
    /// Source files read.
    pub source_files: usize,
    /// Target files read.
    pub target_files: usize,
    /// Wall time.
    pub elapsed_seconds: f64,
}

impl VerifyReport {
    /// The report as the CLI prints it: the verdict, the counts, then each list.
    pub fn to_text(&self) -> String {
        let report = self;
        let mut text = format!(
            "{}: expected {} rows (checksum {}), target has {} (checksum {})\n\
             matching {}, missing {}, extra {}, duplicated {}, differing {}",
            if report.matches { "MATCH" } else { "MISMATCH" },
            thousands(report.expected_rows),
            report.expected_checksum,
            thousands(report.target_rows),
            report.target_checksum,
            thousands(report.matching_rows),
            thousands(report.missing_rows),
            thousands(report.extra_rows),
            thousands(report.duplicate_rows),
            thousands(report.differing_rows),
        );
        let mut list = |title: &str, items: &[String]| {
            if !items.is_empty() {
                text.push_str(&format!("\n{title}:"));
                for item in items {
                    text.push_str(&format!("\n  {item}"));
                }
            }
        };
        list("columns missing from the target", &report.missing_columns);
        list("columns only in the target", &report.extra_columns);
        list("missing rows", &report.missing);
        list("extra rows", &report.extra);
        list("duplicated keys", &report.duplicates);
        let differing: Vec<String> = report
            .differing
            .iter()
            .map(|d| format!("{} (columns: {})", d.key, d.columns.join(", ")))
            .collect();
        list("differing rows", &differing);
        text
    }
}

/// Hashes that are already uniform need no more hashing.
#[derive(Default)]
struct FoldHasher(u64);

impl Hasher for FoldHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u128(&mut self, value: u128) {
        self.0 = (value as u64) ^ ((value >> 64) as u64);
    }
}

/// One expected row: its content hash, its place in the expected rows, and whether the
/// target has had its key yet.
struct Expected {
    row: u128,
    ordinal: u64,
    seen: bool,
}

type ExpectedRows = HashMap<u128, Expected, BuildHasherDefault<FoldHasher>>;

/// Key and row hashers for batches of one schema.
struct Hashers {
    key: RowHasher,
    row: RowHasher,
    columns: Vec<String>,
}

impl Hashers {
    fn try_new(schema: &SchemaRef, spec: &DedupSpec) -> Result<Self> {
        let columns: Vec<String> = schema.fields().iter().map(|f| f.name().clone()).collect();
        let key = RowHasher::try_new(schema, &spec.keys).map_err(unhashable)?;
        let row = RowHasher::try_new(schema, &columns).map_err(unhashable)?;
        Ok(Self { key, row, columns })
    }

    fn hash(&self, batch: &RecordBatch, path: &std::path::Path) -> Result<(Vec<u128>, Vec<u128>)> {
        Ok((
            self.key.hash(batch).map_err(Error::arrow(path))?,
            self.row.hash(batch).map_err(Error::arrow(path))?,
        ))
    }
}

fn unhashable(e: arrow::error::ArrowError) -> Error {
    Error::InvalidArgument(format!("cannot compare rows: {e}"))
}

/// Compares the target with a dedup of the sources (see the module docs).
///
/// # Errors
/// Unreadable sources or target, a key column missing from the target, or a target column
/// that cannot be cast to the sources' type.
pub fn run_verify(job: &VerifyJob, progress: &dyn Progress) -> Result<VerifyReport> {
    let started = Instant::now();
    let dedup_job = DedupJob {
        inputs: job.sources.clone(),
        output: String::new(),
        spec: job.spec.clone(),
        max_rows_per_file: 1,
        memory_limit: job.memory_limit,
        storage: job.storage.clone(),
        state: None,
    };
    let mut expected_checksum = 0u128;
    let ((hashers, expected), run) = dedup_rows(
        &dedup_job,
        progress,
        |schema| {
            Ok((
                Hashers::try_new(schema, &job.spec)?,
                ExpectedRows::default(),
            ))
        },
        |(hashers, expected), batch| {
            let (keys, rows) = hashers.hash(&batch, std::path::Path::new("(expected rows)"))?;
            for (key, row) in keys.into_iter().zip(rows) {
                expected_checksum = expected_checksum.wrapping_add(row);
                let ordinal = expected.len() as u64;
                expected.entry(key).or_insert(Expected {
                    row,
                    ordinal,
                    seen: false,
                });
            }
            Ok(())
        },
    )?;
    let mut expected = expected;
    let schema = run.schema;

    let target = TargetSide::open(job, &schema)?;
    let mut report = VerifyReport {
        matches: false,
        expected_rows: run.stats.rows_out + run.stats.tombstones_kept,
        target_rows: 0,
        expected_checksum: format!("{expected_checksum:032x}"),
        target_checksum: String::new(),
        matching_rows: 0,
        missing_rows: 0,
        extra_rows: 0,
        differing_rows: 0,
        duplicate_rows: 0,
        missing_columns: Vec::new(),
        extra_columns: Vec::new(),
        differing_columns: Vec::new(),
        missing: Vec::new(),
        extra: Vec::new(),
        duplicates: Vec::new(),
        differing: Vec::new(),
        source: run.stats,
        source_files: run.files.len(),
        target_files: target.parts(),
        elapsed_seconds: 0.0,
    };
    for (path, target_schema) in target.schemas() {
        for field in schema.fields() {
            if target_schema.field_with_name(field.name()).is_err() {
                if job.spec.keys.contains(field.name()) {
                    return Err(Error::MissingColumn {
                        path,
                        column: field.name().clone(),
                        role: "key",
                        available: target_schema
                            .fields()
                            .iter()
                            .map(|f| f.name().as_str())
                            .collect::<Vec<_>>()
                            .join(", "),
                    });
                }
                if !report.missing_columns.contains(field.name()) {
                    report.missing_columns.push(field.name().clone());
                }
            }
        }
        for field in target_schema.fields() {
            if schema.field_with_name(field.name()).is_err()
                && !report.extra_columns.contains(field.name())
            {
                report.extra_columns.push(field.name().clone());
            }
        }
    }

    // The target, streamed against the expected rows.
    let mut target_checksum = 0u128;
    let mut differing_wanted: BTreeMap<u64, RecordBatch> = BTreeMap::new();
    target.for_each_batch(&schema, &mut |batch, path| {
        let (keys, rows) = hashers.hash(&batch, path)?;
        for (index, (key, row)) in keys.into_iter().zip(rows).enumerate() {
            target_checksum = target_checksum.wrapping_add(row);
            report.target_rows += 1;
            let describe = || describe_row(&batch, &job.spec, index);
            match expected.get_mut(&key) {
                None => {
                    report.extra_rows += 1;
                    if report.extra.len() < job.max_report {
                        report.extra.push(describe());
                    }
                }
                Some(entry) if entry.seen => {
                    report.duplicate_rows += 1;
                    if report.duplicates.len() < job.max_report {
                        report.duplicates.push(describe());
                    }
                }
                Some(entry) => {
                    entry.seen = true;
                    if entry.row == row {
                        report.matching_rows += 1;
                    } else {
                        report.differing_rows += 1;
                        if differing_wanted.len() < job.max_report {
                            differing_wanted.insert(entry.ordinal, batch.slice(index, 1));
                        }
                    }
                }
            }
        }
        Ok(())
    })?;
    report.target_checksum = format!("{target_checksum:032x}");

    let mut missing_wanted: Vec<u64> = Vec::new();
    for entry in expected.values().filter(|e| !e.seen) {
        report.missing_rows += 1;
        missing_wanted.push(entry.ordinal);
    }
    missing_wanted.sort_unstable();
    missing_wanted.truncate(job.max_report);
    drop(expected);

    if !missing_wanted.is_empty() || !differing_wanted.is_empty() {
        let wanted: Vec<u64> = missing_wanted
            .iter()
            .chain(differing_wanted.keys())
            .copied()
            .collect();
        let found = expected_rows_at(&dedup_job, wanted)?;
        for ordinal in &missing_wanted {
            if let Some(row) = found.get(ordinal) {
                report.missing.push(describe_row(row, &job.spec, 0));
            }
        }
        for (ordinal, target_row) in &differing_wanted {
            let Some(expected_row) = found.get(ordinal) else {
                continue;
            };
            let mut columns = Vec::new();
            for name in &hashers.columns {
                let hasher =
                    RowHasher::try_new(&schema, std::slice::from_ref(name)).map_err(unhashable)?;
                if hasher.hash(expected_row).map_err(unhashable)?
                    != hasher.hash(target_row).map_err(unhashable)?
                {
                    columns.push(name.clone());
                }
            }
            for column in &columns {
                if !report.differing_columns.contains(column) {
                    report.differing_columns.push(column.clone());
                }
            }
            report.differing.push(RowDifference {
                key: describe_row(target_row, &job.spec, 0),
                columns,
            });
        }
    }
    report.matches = report.missing_rows == 0
        && report.extra_rows == 0
        && report.differing_rows == 0
        && report.duplicate_rows == 0
        && report.missing_columns.is_empty()
        && report.extra_columns.is_empty();
    report.elapsed_seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

/// What `idem verify` checks: files, or a table in a database.
enum TargetSide {
    Files(Vec<InputFile>),
    #[cfg(feature = "postgres")]
    Table(Box<crate::pg::table::TableReader>, SchemaRef),
}

impl TargetSide {
    /// `sources`: the sources' schema, which a table's columns are read to compare with.
    #[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
    fn open(job: &VerifyJob, sources: &SchemaRef) -> Result<Self> {
        if let [location] = job.target.as_slice()
            && crate::pg::is_postgres_url(location)
        {
            #[cfg(feature = "postgres")]
            {
                let table = job.target_table.as_deref().ok_or_else(|| {
                    Error::InvalidArgument(
                        "a PostgreSQL target needs --table [SCHEMA.]NAME".to_owned(),
                    )
                })?;
                let reader = crate::pg::table::TableReader::open(location, table)?;
                let schema = reader.schema(sources)?;
                return Ok(Self::Table(Box::new(reader), schema));
            }
            #[cfg(not(feature = "postgres"))]
            return Err(Error::InvalidArgument(
                "this idem was built without PostgreSQL targets (feature `postgres`)".to_owned(),
            ));
        }
        if job.target.iter().any(|t| crate::pg::is_postgres_url(t)) {
            return Err(Error::InvalidArgument(
                "a PostgreSQL target is checked alone: --target postgres://… --table NAME"
                    .to_owned(),
            ));
        }
        if job.target_table.is_some() {
            return Err(Error::InvalidArgument(
                "--table names a table of a PostgreSQL target (postgres://…)".to_owned(),
            ));
        }
        let targets = expand_inputs(&job.target, &job.storage)?;
        let files = targets.iter().map(InputFile::open).collect::<Result<_>>()?;
        Ok(Self::Files(files))
    }

    /// Files, or 1 for a table.
    fn parts(&self) -> usize {
        match self {
            Self::Files(files) => files.len(),
            #[cfg(feature = "postgres")]
            Self::Table(..) => 1,
        }
    }

    /// Each part's location and columns.
    fn schemas(&self) -> Vec<(std::path::PathBuf, SchemaRef)> {
        match self {
            Self::Files(files) => files
                .iter()
                .map(|f| (f.path().to_path_buf(), Arc::clone(f.schema())))
                .collect(),
            #[cfg(feature = "postgres")]
            Self::Table(reader, schema) => {
                vec![(
                    std::path::PathBuf::from(reader.display()),
                    Arc::clone(schema),
                )]
            }
        }
    }

    /// Every row, in batches converted to the sources' `schema` (columns the sources lack
    /// are not read).
    fn for_each_batch(
        &self,
        schema: &SchemaRef,
        check: &mut dyn FnMut(RecordBatch, &std::path::Path) -> Result<()>,
    ) -> Result<()> {
        match self {
            Self::Files(files) => {
                for file in files {
                    let names: Vec<&str> = file
                        .schema()
                        .fields()
                        .iter()
                        .map(|f| f.name().as_str())
                        .filter(|name| schema.field_with_name(name).is_ok())
                        .collect();
                    for batch in file.read_columns(&names)? {
                        check(conform(&batch?, schema, false, file.path())?, file.path())?;
                    }
                }
                Ok(())
            }
            #[cfg(feature = "postgres")]
            Self::Table(reader, table_schema) => {
                let fields: Vec<arrow::datatypes::Field> = table_schema
                    .fields()
                    .iter()
                    .filter(|f| schema.field_with_name(f.name()).is_ok())
                    .map(|f| f.as_ref().clone())
                    .collect();
                let projected = Arc::new(arrow::datatypes::Schema::new(fields));
                let path = std::path::PathBuf::from(reader.display());
                reader.read(&projected, |batch| {
                    check(conform(&batch, schema, false, &path)?, &path)
                })
            }
        }
    }
}

/// The expected rows at the given ordinals, each as a one-row batch, from a second dedup
/// of the sources.
fn expected_rows_at(job: &DedupJob, mut wanted: Vec<u64>) -> Result<BTreeMap<u64, RecordBatch>> {
    wanted.sort_unstable();
    wanted.dedup();
    let mut next = 0u64;
    let (found, _) = dedup_rows(
        job,
        &NoProgress,
        |_| Ok(BTreeMap::new()),
        |found, batch| {
            let end = next + batch.num_rows() as u64;
            let from = wanted.partition_point(|&o| o < next);
            for &ordinal in wanted[from..].iter().take_while(|&&o| o < end) {
                found.insert(ordinal, batch.slice((ordinal - next) as usize, 1));
            }
            next = end;
            Ok(())
        },
    )?;
    Ok(found)
}
