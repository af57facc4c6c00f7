//! The dedup: files in, one row per key out, with late materialisation — the `idem dedup`
//! job, and the two passes that every other job (merge, verify, cluster) runs through
//! [`dedup_rows`].
//!
//! ```text
//!  pass 1  every file, key + version + op columns only ──▶ KeepMaxTable
//!          (or, under --memory-limit, one key partition at a time: see `decide`)
//!                                                            │ finish
//!                      positions to keep, tie rows  ◀────────┘
//!  pass 2  every file, all columns, only the selected rows (Parquet row selection)
//!            ├─ kept rows ──▶ OutputWriter (temporary name)
//!            └─ tie rows  ──▶ TieCheck (conflicts)
//!          or, for a wide schema, column by column (see `by_field`): per output row
//!          group, one field's selected rows at a time, kept ones to the writer, tied ones
//!          hashed into their rows' sums
//!  commit  rename into place
//! ```
//!
//! The table holds keys, versions and positions, never whole rows, so memory grows with
//! the number of distinct keys rather than the width or length of the input; written
//! column by column, a wide output holds two fields' readers and writers, not all of
//! them.
//!
//! * `decide`: pass 1, in memory or by key partitions through spill files;
//! * `plan`: the rows pass 2 reads from each file; `pipeline`: two threads and a queue;
//! * `fetch`: pass 2 row by row; `by_field`: pass 2 column by column;
//! * `report`: what a dedup reports.
//!
//! It may import the reading and writing layers, the state, idem-core; no other job.

mod by_field;
mod decide;
mod fetch;
mod pipeline;
mod plan;
mod report;

#[cfg(feature = "ballista")]
pub use report::ClusterRun;
pub(crate) use report::DedupRun;
pub use report::{DedupReport, FileRows};

use std::time::Instant;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use idem_core::{DedupSpec, DedupStats, TiePolicy};

use crate::error::{Error, Result};
use crate::progress::Progress;
use crate::read::expand::expand_inputs;
use crate::read::input::{InputFile, TextLayout};
use crate::read::schema::unify;
use crate::state::{self, Prepared, StateFilter, StateOptions, WinnerFilter};
use crate::storage::StorageOptions;
use crate::write::output::OutputWriter;
use by_field::{COLUMNWISE_FROM_FIELDS, Winners};
use decide::{Decision, decide};
use fetch::{KeepAll, fetch_rows};

/// Default rows per part file of a directory output.
pub const DEFAULT_MAX_ROWS_PER_FILE: usize = 10_000_000;

/// What to deduplicate, where to, and how.
#[derive(Debug, Clone)]
pub struct DedupJob {
    /// Files, directories or globs, in input order.
    pub inputs: Vec<String>,
    /// A `.parquet` file, or a directory of parts: a local path or a URL.
    pub output: String,
    /// Key, version and policies.
    pub spec: DedupSpec,
    /// Rows per part file of a directory output.
    pub max_rows_per_file: usize,
    /// Bytes the dedup's state may use (`--memory-limit`); beyond it, pass 1 runs one key
    /// partition at a time through spill files. `None`: no limit.
    pub memory_limit: Option<u64>,
    /// Configuration of object stores, over what the environment gives.
    pub storage: StorageOptions,
    /// Dedup across runs (`--state`): only keys not emitted by earlier runs leave this one.
    pub state: Option<StateOptions>,
}

impl DedupJob {
    /// A job with the default spec.
    pub fn new(inputs: Vec<String>, output: impl Into<String>) -> Self {
        Self {
            inputs,
            output: output.into(),
            spec: DedupSpec::default(),
            max_rows_per_file: DEFAULT_MAX_ROWS_PER_FILE,
            memory_limit: None,
            storage: StorageOptions::default(),
            state: None,
        }
    }
}

/// Opens the inputs, unifies their schemas and checks that every file has the columns the
/// spec reads.
pub(crate) fn open_inputs(job: &DedupJob) -> Result<(Vec<InputFile>, SchemaRef)> {
    let paths = expand_inputs(&job.inputs, &job.storage)?;
    let files: Vec<InputFile> = paths.iter().map(InputFile::open).collect::<Result<_>>()?;
    let schema = unify(files.iter().map(|f| (f.path(), f.schema())))?;
    let required = job
        .spec
        .keys
        .iter()
        .map(|k| (k, "key"))
        .chain(job.spec.versions.iter().map(|v| (v, "version")))
        .chain(
            job.spec
                .options
                .deletes
                .iter()
                .map(|d| (&d.op_column, "op")),
        );
    for (column, role) in required {
        for file in &files {
            if file.schema().field_with_name(column).is_err() {
                return Err(Error::MissingColumn {
                    path: file.path().to_path_buf(),
                    column: column.clone(),
                    role,
                    available: file
                        .schema()
                        .fields()
                        .iter()
                        .map(|f| f.name().as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
        }
    }
    Ok((files, schema))
}

/// Runs a dedup job. Nothing appears at the output path unless the whole job succeeds.
///
/// # Errors
/// Unreadable or incompatible inputs, missing columns, bad values, a conflicting tie under
/// `--on-tie error`, or a failure to write the output.
pub fn run_dedup(job: &DedupJob, progress: &dyn Progress) -> Result<DedupReport> {
    let started = Instant::now();
    let Some(state_options) = &job.state else {
        return write_dedup(job, progress, started, None);
    };
    // The state decides about deletes too: a delete of a key emitted earlier is emitted.
    let mut job = job.clone();
    if let Some(deletes) = job.spec.options.deletes.as_mut() {
        deletes.keep_tombstones = true;
    }
    match state::prepare(&job.inputs, &job.storage, &job.spec, state_options)? {
        Prepared::AlreadyApplied(state) => {
            let files: Vec<InputFile> = expand_inputs(&job.inputs, &job.storage)?
                .iter()
                .map(InputFile::open)
                .collect::<Result<_>>()?;
            let mut report = DedupReport::new(
                &job,
                &DedupRun {
                    schema: std::sync::Arc::new(arrow::datatypes::Schema::empty()),
                    stats: DedupStats::default(),
                    kept_per_file: Vec::new(),
                    key_partitions: 0,
                    table_bytes: 0,
                    decide_seconds: 0.0,
                    fetch_started: Instant::now(),
                    files: Vec::new(),
                },
            );
            report.input_files = files.len();
            report.inputs = files.iter().map(|f| FileRows::new(f, None)).collect();
            report.state = Some(*state);
            report.elapsed_seconds = started.elapsed().as_secs_f64();
            Ok(report)
        }
        Prepared::Ready(filter) => write_dedup(&job, progress, started, Some(filter)),
    }
}

/// The two passes, the output and, with a state, the state's commit after the output's.
fn write_dedup(
    job: &DedupJob,
    progress: &dyn Progress,
    started: Instant,
    mut state: Option<StateFilter>,
) -> Result<DedupReport> {
    let open = |schema: &SchemaRef| {
        OutputWriter::create(
            &job.output,
            std::sync::Arc::clone(schema),
            job.max_rows_per_file,
            &job.storage,
        )
    };
    // A state that records during the run (Redis) takes it back if the run fails.
    let written = (|| -> Result<_> {
        let decided = decide_job(job, progress)?;
        Ok(match state.as_mut() {
            None if goes_columnwise(&job.spec, &decided) => {
                fetch_columnwise(job, progress, decided, open)?
            }
            Some(state) => fetch_rows(
                job,
                progress,
                decided,
                open,
                state,
                TextLayout::Views,
                |writer, kept| writer.write(&kept),
            )?,
            None => fetch_rows(
                job,
                progress,
                decided,
                open,
                &mut KeepAll,
                TextLayout::Views,
                |writer, kept| writer.write(&kept),
            )?,
        })
    })();
    let (writer, mut run) = match written {
        Ok(written) => written,
        Err(e) => {
            if let Some(state) = state {
                state.abandon();
            }
            return Err(e);
        }
    };
    let staged = state.map(StateFilter::stage).transpose()?;
    let output_files = match writer.commit() {
        Ok(files) => files,
        Err(e) => {
            if let Some(staged) = staged {
                staged.abandon();
            }
            return Err(e);
        }
    };
    let state_report = staged.map(|s| s.commit(&job.output)).transpose()?;
    if let Some(state) = &state_report {
        // The run's counts describe what was written; the state says what it held back.
        let stats = &mut run.stats;
        stats.rows_out = run.kept_per_file.iter().sum();
        stats.tombstones_kept = state.deletes_emitted;
        stats.deleted += state.deletes_recorded;
    }
    let mut report = DedupReport::new(job, &run);
    report.state = state_report;
    report.key_partitions = run.key_partitions;
    report.output_files = output_files
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    report.table_bytes = run.table_bytes;
    report.decide_seconds = run.decide_seconds;
    report.write_seconds = run.fetch_started.elapsed().as_secs_f64();
    report.elapsed_seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

/// The two passes of a dedup of `job`'s inputs, without the output: `open` makes a sink once
/// the schema is known, and `sink` gets every batch of winning rows, in output order and in
/// that schema's types.
pub(crate) fn dedup_rows<S>(
    job: &DedupJob,
    progress: &dyn Progress,
    open: impl FnOnce(&SchemaRef) -> Result<S>,
    sink: impl FnMut(&mut S, RecordBatch) -> Result<()>,
) -> Result<(S, DedupRun)> {
    dedup_rows_filtered(job, progress, open, &mut KeepAll, sink)
}

/// [`dedup_rows`] with a last say over the winners: `filter` gets every batch of them and
/// returns the rows that go to `sink`, and to `kept` in the per-file counts.
pub(crate) fn dedup_rows_filtered<S>(
    job: &DedupJob,
    progress: &dyn Progress,
    open: impl FnOnce(&SchemaRef) -> Result<S>,
    filter: &mut dyn WinnerFilter,
    sink: impl FnMut(&mut S, RecordBatch) -> Result<()>,
) -> Result<(S, DedupRun)> {
    let decided = decide_job(job, progress)?;
    fetch_rows(
        job,
        progress,
        decided,
        open,
        filter,
        TextLayout::AsStored,
        sink,
    )
}

/// What pass 1 leaves for pass 2.
pub(crate) struct Decided {
    /// The inputs, opened.
    pub files: Vec<InputFile>,
    /// Their unified schema.
    pub schema: SchemaRef,
    /// Every key's winner.
    pub decision: Decision,
    /// Wall time of pass 1.
    pub decide_seconds: f64,
}

impl Decided {
    /// What the dedup found, once pass 2 (started at `fetch_started`) kept `kept_per_file`
    /// rows of each file and found `conflicts` keys whose tied rows differ.
    pub(crate) fn into_run(
        self,
        kept_per_file: Vec<u64>,
        conflicts: u64,
        fetch_started: Instant,
    ) -> DedupRun {
        let mut stats = self.decision.stats;
        stats.conflicts = conflicts;
        DedupRun {
            files: self.files,
            schema: self.schema,
            stats,
            kept_per_file,
            key_partitions: self.decision.partitions,
            table_bytes: self.decision.table_bytes,
            decide_seconds: self.decide_seconds,
            fetch_started,
        }
    }
}

/// Pass 1: opens `job`'s inputs and decides every key's winner.
pub(crate) fn decide_job(job: &DedupJob, progress: &dyn Progress) -> Result<Decided> {
    let (files, schema) = open_inputs(job)?;
    let decide_started = Instant::now();
    let decision = decide(&job.spec, &files, &schema, job.memory_limit, progress)?;
    Ok(Decided {
        files,
        schema,
        decision,
        decide_seconds: decide_started.elapsed().as_secs_f64(),
    })
}

/// Whether pass 2 goes column by column (see [`crate::write::by_field`]): for a wide schema of
/// Parquet inputs (whose row selection lets one column be read at a time without decoding
/// the others), when rows are kept (tied rows are compared on the way to the output's) and
/// a conflict is counted, not an error to raise with the whole row in hand.
fn goes_columnwise(spec: &DedupSpec, decided: &Decided) -> bool {
    decided.schema.fields().len() >= COLUMNWISE_FROM_FIELDS
        && decided.decision.stats.rows_out > 0
        && spec.options.on_tie != TiePolicy::Error
        && decided.files.iter().all(InputFile::is_parquet)
}

/// Pass 2 column by column, into an [`OutputWriter`].
fn fetch_columnwise(
    job: &DedupJob,
    progress: &dyn Progress,
    decided: Decided,
    open: impl FnOnce(&SchemaRef) -> Result<OutputWriter>,
) -> Result<(OutputWriter, DedupRun)> {
    let mut decided = decided;
    let fetch_started = Instant::now();
    let mut output = open(&decided.schema)?;
    let stats = &decided.decision.stats;
    progress.phase("writing", stats.rows_out + stats.tombstones_kept);
    let mut winners = Winners::new(
        &decided.files,
        SchemaRef::clone(&decided.schema),
        &job.spec.keys,
        &mut decided.decision.selection,
    );
    output.write_columnwise(&mut winners, &mut |rows| progress.advance(rows))?;
    let (kept_per_file, conflicts) = winners.finish()?;
    Ok((
        output,
        decided.into_run(kept_per_file, conflicts, fetch_started),
    ))
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::path::{Path, PathBuf};
    use std::sync::Arc;

    use arrow::array::{ArrayRef, Int64Array};
    use arrow::compute::cast;
    use arrow::datatypes::{DataType, Field, Schema};
    use parquet::arrow::ArrowWriter;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    use parquet::file::properties::WriterProperties;

    use super::*;
    use crate::generate::{GenerateOptions, generate};
    use crate::progress::NoProgress;

    /// Wide generated events in `dir`, plus two files that drifted from them: their columns
    /// in reverse order, `attr_000` narrowed to Int32, `attr_005` missing, newer versions
    /// of some keys (tied between the two files, a third of them with other contents),
    /// small row groups.
    fn wide_inputs(dir: &Path) -> Vec<String> {
        let options = GenerateOptions {
            rows: 200_000,
            files: 3,
            extra_columns: 30,
            payload_bytes: 16,
            ..GenerateOptions::default()
        };
        generate(&options, dir).expect("generate");
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .expect("dir")
            .map(|e| e.expect("entry").path())
            .collect();
        files.sort();
        let first = File::open(&files[0]).expect("open");
        let batch = ParquetRecordBatchReaderBuilder::try_new(first)
            .expect("reader")
            .with_batch_size(5000)
            .build()
            .expect("build")
            .next()
            .expect("a batch")
            .expect("read");
        let schema = batch.schema();
        let mut fields = Vec::new();
        let mut columns: Vec<ArrayRef> = Vec::new();
        for (field, column) in schema.fields().iter().zip(batch.columns()).rev() {
            let column = match field.name().as_str() {
                "attr_005" => continue,
                "attr_000" => cast(column, &DataType::Int32).expect("cast"),
                "lsn" => {
                    let lsn = column.as_any().downcast_ref::<Int64Array>().expect("lsn");
                    Arc::new(lsn.iter().map(|v| v.map(|v| v + 1)).collect::<Int64Array>())
                }
                _ => Arc::clone(column),
            };
            fields.push(Field::new(
                field.name(),
                column.data_type().clone(),
                field.is_nullable(),
            ));
            columns.push(column);
        }
        let drifted =
            RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).expect("drifted");
        // The same rows again, every third with another status: ties, some conflicting.
        let status = drifted.schema().index_of("status").expect("status");
        let mut columns = drifted.columns().to_vec();
        let statuses = columns[status]
            .as_any()
            .downcast_ref::<arrow::array::StringArray>()
            .expect("status");
        columns[status] = Arc::new(
            statuses
                .iter()
                .enumerate()
                .map(|(i, v)| if i % 3 == 0 { Some("changed") } else { v })
                .collect::<arrow::array::StringArray>(),
        );
        let conflicting = RecordBatch::try_new(drifted.schema(), columns).expect("again");
        for (name, batch) in [("zz-drifted", &drifted), ("zz-drifted-again", &conflicting)] {
            let path = dir.join(format!("{name}.parquet"));
            let properties = WriterProperties::builder()
                .set_max_row_group_row_count(Some(1000))
                .build();
            let mut writer = ArrowWriter::try_new(
                File::create(&path).expect("create"),
                batch.schema(),
                Some(properties),
            )
            .expect("writer");
            writer.write(batch).expect("write");
            writer.close().expect("close");
            files.push(path);
        }
        files.iter().map(|f| f.display().to_string()).collect()
    }

    /// The output's files, by name within the output (none for a single file), and their
    /// bytes.
    fn contents(paths: &[PathBuf], single_file: bool) -> Vec<(String, Vec<u8>)> {
        paths
            .iter()
            .map(|p| {
                let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
                let name = if single_file { "" } else { name };
                (name.to_owned(), std::fs::read(p).expect("output"))
            })
            .collect()
    }

    /// Whether two outputs are the same, without printing megabytes when they are not.
    fn same(one: &[(String, Vec<u8>)], other: &[(String, Vec<u8>)]) -> bool {
        one == other
    }

    /// An output's files, the rows kept of each input, the counts.
    type Outcome = (Vec<(String, Vec<u8>)>, Vec<u64>, DedupStats);

    /// Pass 2 both ways into `output` and `output` + "-columnwise": the files, the run.
    fn both_ways(inputs: &[String], output: &Path, max_rows_per_file: usize) -> [Outcome; 2] {
        let mut job = DedupJob::new(inputs.to_vec(), output.display().to_string());
        let single_file = output.extension().is_some();
        job.max_rows_per_file = max_rows_per_file;
        let open = |job: &DedupJob| {
            let output = job.output.clone();
            move |schema: &SchemaRef| {
                OutputWriter::try_new(Path::new(&output), Arc::clone(schema), max_rows_per_file)
            }
        };
        let decided = decide_job(&job, &NoProgress).expect("decide");
        assert!(goes_columnwise(&job.spec, &decided));
        let (writer, rows) = fetch_rows(
            &job,
            &NoProgress,
            decided,
            open(&job),
            &mut KeepAll,
            TextLayout::Views,
            |writer, kept| writer.write(&kept),
        )
        .expect("row by row");
        let row_wise = (
            contents(&writer.commit().expect("commit"), single_file),
            rows.kept_per_file,
            rows.stats,
        );
        job.output = format!("{}-columnwise", output.display());
        if single_file {
            job.output = format!("{}.parquet", job.output);
        }
        let decided = decide_job(&job, &NoProgress).expect("decide");
        let (writer, columns) =
            fetch_columnwise(&job, &NoProgress, decided, open(&job)).expect("column by column");
        let column_wise = (
            contents(&writer.commit().expect("commit"), single_file),
            columns.kept_per_file,
            columns.stats,
        );
        [row_wise, column_wise]
    }

    fn row_groups(file: &[u8]) -> usize {
        let bytes = bytes::Bytes::copy_from_slice(file);
        parquet::file::reader::FileReader::metadata(
            &parquet::file::serialized_reader::SerializedFileReader::new(bytes).expect("read"),
        )
        .num_row_groups()
    }

    /// A Parquet file of `batch` at `path`.
    fn write_file(path: &Path, batch: &RecordBatch) {
        let mut writer =
            ArrowWriter::try_new(File::create(path).expect("create"), batch.schema(), None)
                .expect("writer");
        writer.write(batch).expect("write");
        writer.close().expect("close");
    }

    #[test]
    fn text_and_binary_keep_the_unified_types_and_values_through_views() {
        use arrow::array::{
            Array, BinaryArray, DictionaryArray, LargeBinaryArray, LargeStringArray, StringArray,
        };
        use arrow::datatypes::Int32Type;
        let dir = tempfile::tempdir().expect("tempdir");
        // The first file's types win the unification: long text (views point into the
        // page), short text (inlined in the view), binary, and a dictionary key.
        let first = RecordBatch::try_from_iter([
            (
                "event_id",
                Arc::new(DictionaryArray::<Int32Type>::from_iter(["a", "b", "a"])) as ArrayRef,
            ),
            ("sequence", Arc::new(Int64Array::from(vec![0, 0, 0]))),
            ("lsn", Arc::new(Int64Array::from(vec![1, 1, 2]))),
            (
                "note",
                Arc::new(LargeStringArray::from(vec![
                    Some("old a, long enough not to be inlined"),
                    None,
                    Some("new a, long enough not to be inlined"),
                ])),
            ),
            ("short", Arc::new(StringArray::from(vec!["x", "y", "z"]))),
            (
                "blob",
                Arc::new(BinaryArray::from(vec![&b"\x00\x01"[..], b"", b"\xff"])),
            ),
            (
                "big",
                Arc::new(LargeBinaryArray::from(vec![
                    &[7u8; 20][..],
                    &[8; 20],
                    &[9; 20],
                ])),
            ),
        ])
        .expect("first");
        // Drifted: plain key text, the note in the narrower layout, a newer `b`.
        let second = RecordBatch::try_from_iter([
            (
                "event_id",
                Arc::new(StringArray::from(vec!["b", "c"])) as ArrayRef,
            ),
            ("sequence", Arc::new(Int64Array::from(vec![0, 0]))),
            ("lsn", Arc::new(Int64Array::from(vec![5, 1]))),
            (
                "note",
                Arc::new(StringArray::from(vec![
                    Some("new b, long enough not to be inlined"),
                    None,
                ])),
            ),
            ("short", Arc::new(StringArray::from(vec!["w", "v"]))),
            ("blob", Arc::new(BinaryArray::from(vec![&b"b2"[..], b"c1"]))),
            (
                "big",
                Arc::new(LargeBinaryArray::from(vec![&[5u8; 30][..], &[6; 3]])),
            ),
        ])
        .expect("second");
        let inputs: Vec<String> = [("1.parquet", &first), ("2.parquet", &second)]
            .iter()
            .map(|(name, batch)| {
                let path = dir.path().join(name);
                write_file(&path, batch);
                path.display().to_string()
            })
            .collect();
        let output = dir.path().join("out.parquet");
        let job = DedupJob::new(inputs, output.display().to_string());
        run_dedup(&job, &NoProgress).expect("dedup");

        let reader = ParquetRecordBatchReaderBuilder::try_new(File::open(&output).expect("out"))
            .expect("reader");
        let types: Vec<DataType> = reader
            .schema()
            .fields()
            .iter()
            .map(|f| f.data_type().clone())
            .collect();
        assert_eq!(
            types,
            first
                .schema()
                .fields()
                .iter()
                .map(|f| f.data_type().clone())
                .collect::<Vec<_>>()
        );
        let out = reader
            .build()
            .expect("build")
            .next()
            .expect("rows")
            .expect("read");
        // Winners in input order: a (row 2 of the first file), b and c (the second file's).
        let text = |name: &str| {
            let column =
                cast(out.column_by_name(name).expect(name), &DataType::Utf8).expect("text");
            let column = column
                .as_any()
                .downcast_ref::<StringArray>()
                .expect("utf8")
                .clone();
            (0..column.len())
                .map(|i| column.is_valid(i).then(|| column.value(i).to_owned()))
                .collect::<Vec<_>>()
        };
        let some = |values: &[&str]| {
            values
                .iter()
                .map(|v| Some((*v).to_owned()))
                .collect::<Vec<_>>()
        };
        assert_eq!(text("event_id"), some(&["a", "b", "c"]));
        assert_eq!(
            text("note"),
            vec![
                Some("new a, long enough not to be inlined".to_owned()),
                Some("new b, long enough not to be inlined".to_owned()),
                None
            ]
        );
        assert_eq!(text("short"), some(&["z", "w", "v"]));
        let blob = out.column_by_name("blob").expect("blob");
        let blob = blob.as_any().downcast_ref::<BinaryArray>().expect("binary");
        assert_eq!(
            blob.iter().collect::<Vec<_>>(),
            [Some(&b"\xff"[..]), Some(b"b2"), Some(b"c1")]
        );
        let big = out.column_by_name("big").expect("big");
        let big = big
            .as_any()
            .downcast_ref::<LargeBinaryArray>()
            .expect("large binary");
        assert_eq!(
            big.iter().collect::<Vec<_>>(),
            [Some(&[9u8; 20][..]), Some(&[5; 30]), Some(&[6; 3])]
        );
    }

    #[test]
    fn column_by_column_writes_the_same_bytes_as_row_by_row() {
        let dir = tempfile::tempdir().expect("tempdir");
        let inputs = wide_inputs(&dir.path().join("in"));

        let [rows, columns] = both_ways(&inputs, &dir.path().join("one.parquet"), usize::MAX);
        assert_eq!(rows.0.len(), 1);
        assert!(row_groups(&rows.0[0].1) >= 2, "several row groups");
        assert!(same(&rows.0, &columns.0), "the same bytes");
        assert_eq!((&rows.1, &rows.2), (&columns.1, &columns.2));
        // The last file only ties with the one before, which wins: none of its rows is kept,
        // all are compared.
        assert_eq!(rows.1.iter().filter(|&&kept| kept == 0).count(), 1);
        assert_eq!(rows.1.last(), Some(&0));
        assert!(rows.2.conflicts > 0 && rows.2.duplicates > rows.2.conflicts);

        // Parts of 30,000 rows: cut off the 8,192-row grid, the last one short.
        let [rows, columns] = both_ways(&inputs, &dir.path().join("parts"), 30_000);
        assert!(rows.0.len() >= 4, "{} parts", rows.0.len());
        assert!(same(&rows.0, &columns.0), "the same parts, the same bytes");
        assert_eq!((&rows.1, &rows.2), (&columns.1, &columns.2));
    }

    #[test]
    fn empty_inputs_and_errors_on_ties_go_row_by_row() {
        let dir = tempfile::tempdir().expect("tempdir");
        let schema = crate::generate::event_schema(40);
        let path = dir.path().join("empty.parquet");
        ArrowWriter::try_new(File::create(&path).expect("create"), schema, None)
            .expect("writer")
            .close()
            .expect("close");
        let job = DedupJob::new(vec![path.display().to_string()], "out.parquet");
        let decided = decide_job(&job, &NoProgress).expect("decide");
        assert!(!goes_columnwise(&job.spec, &decided));

        let inputs = wide_inputs(&dir.path().join("in"));
        let mut job = DedupJob::new(inputs, "out.parquet");
        let decided = decide_job(&job, &NoProgress).expect("decide");
        assert!(goes_columnwise(&job.spec, &decided));
        job.spec.options.on_tie = TiePolicy::Error;
        assert!(!goes_columnwise(&job.spec, &decided));
    }
}
