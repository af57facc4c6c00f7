//! The dedup job: files in, one row per key out, with late materialisation.
//!
//! ```text
//!  pass 1  every file, key + version + op columns only ──▶ KeepMaxTable
//!          (or, under --memory-limit, one key partition at a time: see `decide`)
//!                                                            │ finish
//!                      positions to keep, tie rows  ◀────────┘
//!  pass 2  every file, all columns, only the selected rows (Parquet row selection)
//!            ├─ kept rows ──▶ OutputWriter (temporary name)
//!            └─ tie rows  ──▶ TieCheck (conflicts)
//!          or, for a wide schema, column by column (see `columnwise`): per output row
//!          group, one field's selected rows at a time, kept ones to the writer, tied ones
//!          hashed into their rows' sums
//!  commit  rename into place
//! ```
//!
//! The table holds keys, versions and positions, never whole rows, so memory grows with
//! the number of distinct keys rather than the width or length of the input; written
//! column by column, a wide output holds two fields' readers and writers, not all of
//! them.

use std::ops::{ControlFlow, Range};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use arrow::array::BooleanBufferBuilder;
use arrow::array::{BooleanArray, RecordBatch};
use arrow::buffer::BooleanBuffer;
use arrow::compute::filter_record_batch;
use arrow::datatypes::SchemaRef;
use idem_core::{DedupSpec, DedupStats, TieCheck, TieHasher, TiePolicy, TieRow, describe_row};
use serde::Serialize;

use crate::columnwise::{COLUMNWISE_FROM_FIELDS, Winners};
use crate::decide::{Decision, decide};
use crate::error::{Error, Result};
use crate::input::{InputFile, TextLayout, expand_inputs};
use crate::output::OutputWriter;
use crate::schema::{conform, unify, with_views};
use crate::state::{self, Prepared, StateFilter, StateOptions, StateReport};
use crate::storage::StorageOptions;

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

/// Receives progress of a long job; the CLI draws a bar with it.
pub trait Progress: Sync {
    /// A phase starts that will cover `total_rows` rows.
    fn phase(&self, _name: &str, _total_rows: u64) {}
    /// `rows` more rows of the current phase are done.
    fn advance(&self, _rows: u64) {}
}

/// Progress that goes nowhere.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;

impl Progress for NoProgress {}

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
    pub cluster: Option<crate::cluster::ClusterRun>,
}

impl DedupReport {
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
        Prepared::Ready(filter) => write_dedup(&job, progress, started, Some(*filter)),
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
    let decided = decide_job(job, progress)?;
    let (writer, mut run) = match state.as_mut() {
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
    };
    let staged = state.map(StateFilter::stage).transpose()?;
    let output_files = writer.commit()?;
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

/// The last say over a dedup's winners (the state across runs has it).
pub(crate) trait WinnerFilter {
    /// Pass 1 is done (its key table freed) and about `rows` winners will come: the time
    /// to load what the filter needs and make room for them.
    fn expect(&mut self, _rows: u64) -> Result<()> {
        Ok(())
    }
    /// The rows of `batch`, winners read from the file at `path`, that go on.
    fn filter(&mut self, batch: RecordBatch, path: &Path) -> Result<RecordBatch>;
}

/// Every winner goes on.
struct KeepAll;

impl WinnerFilter for KeepAll {
    fn filter(&mut self, batch: RecordBatch, _path: &Path) -> Result<RecordBatch> {
        Ok(batch)
    }
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
    fn into_run(self, kept_per_file: Vec<u64>, conflicts: u64, fetch_started: Instant) -> DedupRun {
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

/// Pass 2 row by row: reads the winners' whole rows (and tied rows, to compare them) and
/// hands them to `sink` through `filter`, text and binary columns in `layout`: views for
/// a Parquet writer, which takes them as it takes the schema's own types; as stored for
/// sinks that hold on to the rows or build batches of the job's schema.
fn fetch_rows<S>(
    job: &DedupJob,
    progress: &dyn Progress,
    decided: Decided,
    open: impl FnOnce(&SchemaRef) -> Result<S>,
    filter: &mut dyn WinnerFilter,
    layout: TextLayout,
    mut sink: impl FnMut(&mut S, RecordBatch) -> Result<()>,
) -> Result<(S, DedupRun)> {
    let mut decided = decided;
    let (files, schema) = (&decided.files, &decided.schema);
    let decision = &mut decided.decision;
    let first_path = files
        .first()
        .map(|f| f.path().to_path_buf())
        .unwrap_or_default();
    let fetch_started = Instant::now();
    let mut check = TieCheck::try_new(schema, &job.spec, decision.tie_groups)
        .map_err(Error::arrow(&first_path))?;
    let mut output = open(schema)?;
    filter.expect(decision.stats.rows_out)?;
    progress.phase(
        "writing",
        decision.stats.rows_out + decision.stats.tombstones_kept,
    );
    // Decoding and selecting run on a second thread while this one encodes and compresses.
    let selection = &mut decision.selection;
    let rows_schema = match layout {
        TextLayout::Views => Arc::new(with_views(schema)),
        TextLayout::AsStored => Arc::clone(schema),
    };
    let mut kept_per_file = vec![0u64; files.len()];
    let files_read = files;
    let hasher = check.hasher();
    pipeline(
        FETCH_DEPTH,
        |send| {
            let mut start = 0u64;
            for (index, file) in files.iter().enumerate() {
                let end = start + file.num_rows();
                let plan = match selection.plan(start, end) {
                    Ok(plan) => plan,
                    Err(e) => {
                        send(Err(e));
                        return;
                    }
                };
                start = end;
                if plan.rows_read() > 0
                    && !fetch_planned(index, file, &plan, &rows_schema, layout, &hasher, send)
                {
                    return;
                }
            }
        },
        |fetched| {
            match fetched {
                Fetched::Kept(index, kept) => {
                    let rows = kept.num_rows() as u64;
                    let kept = filter.filter(kept, files_read[index].path())?;
                    kept_per_file[index] += kept.num_rows() as u64;
                    if kept.num_rows() > 0 {
                        sink(&mut output, kept)?;
                    }
                    progress.advance(rows);
                }
                Fetched::Tied(tied) => {
                    let describe =
                        |i: usize| describe_row(&tied.batch, &job.spec, tied.rows[i] as usize);
                    check
                        .observe_hashed(&tied.groups, &tied.hashes, describe)
                        .map_err(Error::arrow(tied.path))?;
                }
            }
            Ok(ControlFlow::Continue(()))
        },
    )?;
    let conflicts = check.conflicts();
    Ok((
        output,
        decided.into_run(kept_per_file, conflicts, fetch_started),
    ))
}

/// Whether pass 2 goes column by column (see [`crate::columnwise`]): for a wide schema of
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

/// Gaps between selected rows shorter than this are read and dropped by pass 2's own
/// filter (row by row, or field by field for a wide schema) instead of being skipped by
/// the Parquet reader. A selection fragmented into
/// short runs makes the reader decode every row anyway and filter its batch with a mask
/// (its `RowSelectionPolicy::Auto`, at about the same run length), and pass 2 then
/// filtered that batch a second time by its keep mask: one copy of every kept value too
/// many. Reading the short gaps leaves the reader long runs, which it decodes straight
/// into its batch, and the keep mask drops the gaps with the losers in one filter.
pub(crate) const DECODE_GAPS_BELOW: u64 = 32;

/// Whole-row batches in flight between pass 2's reader and its writer: enough to ride
/// out their speeds' ups and downs, few enough that wide rows stay cheap.
const FETCH_DEPTH: usize = 4;

/// Runs `produce` on a second thread and `consume` on this one, joined by a queue of at
/// most `depth` items in flight. `produce` gets a `send` that returns false once the
/// consumer has stopped, which it must heed by returning; an error it sends ends the
/// pipeline with that error, and `consume` may stop it early with `Break`.
pub(crate) fn pipeline<T: Send>(
    depth: usize,
    produce: impl FnOnce(&dyn Fn(Result<T>) -> bool) + Send,
    mut consume: impl FnMut(T) -> Result<ControlFlow<()>>,
) -> Result<()> {
    std::thread::scope(|scope| {
        let (sender, receiver) = std::sync::mpsc::sync_channel::<Result<T>>(depth);
        scope.spawn(move || produce(&|item| sender.send(item).is_ok()));
        // Returning early drops the receiver, which stops the producer at its next send.
        for item in receiver {
            if consume(item?)?.is_break() {
                break;
            }
        }
        Ok(())
    })
}

/// What pass 2's reader hands to its writer.
enum Fetched<'a> {
    /// Rows to write, from the file at this index.
    Kept(usize, RecordBatch),
    /// Tie rows of a file, hashed, to compare.
    Tied(TiedRows<'a>),
}

/// Tie rows among a batch's rows, hashed where they were read: their hashes are all a
/// [`TieCheck`] compares, and the batch is at hand to name a conflicting row's key.
struct TiedRows<'a> {
    path: &'a Path,
    batch: RecordBatch,
    rows: Vec<u32>,
    groups: Vec<u32>,
    hashes: Vec<u128>,
}

/// Reads the planned rows of one file, text in `layout`, and sends them on as kept and tied
/// batches of `schema` (the job's, with text as views for `TextLayout::Views`: see
/// [`with_views`]). Returns false when the consumer has stopped.
fn fetch_planned<'a>(
    index: usize,
    file: &'a InputFile,
    plan: &FilePlan,
    schema: &SchemaRef,
    layout: TextLayout,
    hasher: &TieHasher,
    send: &dyn Fn(Result<Fetched<'a>>) -> bool,
) -> bool {
    let batches = match file.read_ranges_as(plan.ranges(), layout) {
        Ok(batches) => batches,
        Err(e) => {
            send(Err(e));
            return false;
        }
    };
    let mut cursor = 0;
    for batch in batches {
        let batch = match batch.and_then(|b| conform(&b, schema, false, file.path())) {
            Ok(batch) => batch,
            Err(e) => {
                send(Err(e));
                return false;
            }
        };
        let n = batch.num_rows();
        let (keep, (tie_rows, groups)) = plan.slice(cursor, n);
        cursor += n;
        if keep.true_count() > 0 {
            let kept = filter_record_batch(&batch, &keep).map_err(Error::arrow(file.path()));
            if !send(kept.map(|kept| Fetched::Kept(index, kept))) {
                return false;
            }
        }
        if !tie_rows.is_empty() {
            let tied = hasher
                .hash_rows(&batch, &tie_rows)
                .map_err(Error::arrow(file.path()))
                .map(|hashes| {
                    Fetched::Tied(TiedRows {
                        path: file.path(),
                        batch,
                        rows: tie_rows,
                        groups,
                        hashes,
                    })
                });
            if !send(tied) {
                return false;
            }
        }
    }
    if cursor != plan.rows_read() {
        send(Err(Error::InvalidArgument(format!(
            "{}: expected {} selected rows, read {cursor}; was the file changed during the run?",
            file.path().display(),
            plan.rows_read()
        ))));
        return false;
    }
    true
}

/// The rows pass 2 reads from one file, as runs: which of them it keeps, which are tied.
///
/// Built a 64-row word at a time from the winners' bits: nearly every row of a file is
/// read (short gaps are), so a list of row numbers and a flag per row cost a pass over the
/// rows and 13 bytes each, where runs, a bit per row and the tied rows alone do not.
pub(crate) struct FilePlan {
    /// Runs of the file's rows to read, ascending, apart by at least the plan's gap.
    ranges: Vec<Range<u64>>,
    /// A bit per row read, in order: whether the row is kept.
    keep: BooleanBuffer,
    /// The tied rows among those read: their index among them and their tie group,
    /// ascending.
    ties: Vec<(u64, u32)>,
}

impl FilePlan {
    /// The plan of a file whose first row is at position `start`: `keep` has a bit per
    /// row of the file, set for its kept rows, and `ties` are its tied rows, ascending.
    /// Every gap of fewer than `gaps_below` rows between two rows kept or tied is read too,
    /// as rows neither kept nor tied (see [`DECODE_GAPS_BELOW`]).
    pub(crate) fn new(
        keep: &BooleanBuffer,
        ties: impl Iterator<Item = TieRow>,
        start: u64,
        gaps_below: u64,
    ) -> Self {
        let ties: Vec<(u64, u32)> = ties.map(|t| (t.position - start, t.group)).collect();
        let mut wanted = BooleanBufferBuilder::new(keep.len());
        wanted.append_buffer(keep);
        for &(row, _) in &ties {
            wanted.set_bit(row as usize, true);
        }
        let mut ranges: Vec<Range<u64>> = Vec::new();
        for (from, to) in wanted.finish().set_slices() {
            let (from, to) = (from as u64, to as u64);
            match ranges.last_mut() {
                Some(last) if from - last.end < gaps_below => last.end = to,
                _ => ranges.push(from..to),
            }
        }
        let read: u64 = ranges.iter().map(|r| r.end - r.start).sum();
        let mut kept = BooleanBufferBuilder::new(read as usize);
        for range in &ranges {
            kept.append_buffer(
                &keep.slice(range.start as usize, (range.end - range.start) as usize),
            );
        }
        // Each tied row's index among the rows read: the rows of the runs before its own,
        // and its place in its run.
        let mut runs = ranges.iter().peekable();
        let mut read_before = 0;
        let ties = ties
            .into_iter()
            .map(|(row, group)| {
                while let Some(run) = runs.next_if(|run| run.end <= row) {
                    read_before += run.end - run.start;
                }
                let run_start = runs.peek().map_or(row, |run| run.start);
                (read_before + row - run_start, group)
            })
            .collect();
        Self {
            ranges,
            keep: kept.finish(),
            ties,
        }
    }

    /// The runs of rows to read.
    pub(crate) fn ranges(&self) -> &[Range<u64>] {
        &self.ranges
    }

    /// How many rows are read.
    pub(crate) fn rows_read(&self) -> usize {
        self.keep.len()
    }

    /// The rows, whether each is kept, and the tie group of each (`u32::MAX` for none).
    pub(crate) fn into_parts(self) -> (Vec<u64>, Vec<bool>, Vec<u32>) {
        let rows: Vec<u64> = self.ranges.iter().flat_map(Range::clone).collect();
        let keep = self.keep.iter().collect();
        let mut group = vec![u32::MAX; rows.len()];
        for (at, tie) in self.ties {
            group[at as usize] = tie;
        }
        (rows, keep, group)
    }

    /// The keep mask and the (row, group) tie list of rows read `cursor..cursor + n`.
    fn slice(&self, cursor: usize, n: usize) -> (BooleanArray, (Vec<u32>, Vec<u32>)) {
        let end = (cursor + n).min(self.keep.len());
        let cursor = cursor.min(end);
        let keep = BooleanArray::new(self.keep.slice(cursor, end - cursor), None);
        let (from, to) = (cursor as u64, end as u64);
        let first = self.ties.partition_point(|&(at, _)| at < from);
        let ties = self.ties[first..]
            .iter()
            .take_while(|&&(at, _)| at < to)
            .map(|&(at, group)| ((at - from) as u32, group))
            .unzip();
        (keep, ties)
    }
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

    /// A file's keep bits: `rows` bits, set at `kept`.
    fn bits(rows: usize, kept: &[usize]) -> BooleanBuffer {
        let mut bits = BooleanBufferBuilder::new(rows);
        bits.append_n(rows, false);
        for &row in kept {
            bits.set_bit(row, true);
        }
        bits.finish()
    }

    fn tie(position: u64, group: u32) -> TieRow {
        TieRow { position, group }
    }

    #[test]
    fn short_gaps_are_read_and_neither_kept_nor_tied() {
        // Positions start at 100: rows 0, 1, 3, 40 and 100 of the file are wanted.
        let keep = bits(120, &[0, 1, 40, 100]);
        let plan = FilePlan::new(&keep, [tie(103, 0), tie(200, 1)].into_iter(), 100, 4);
        // The gap of one row (2) is read; those of 36 and 59 rows are skipped.
        assert_eq!(plan.ranges(), [0..4, 40..41, 100..101]);
        let (rows, kept, groups) =
            FilePlan::new(&keep, [tie(103, 0), tie(200, 1)].into_iter(), 100, 4).into_parts();
        assert_eq!(rows, [0, 1, 2, 3, 40, 100]);
        assert_eq!(kept, [true, true, false, false, true, true]);
        assert_eq!(groups, [u32::MAX, u32::MAX, u32::MAX, 0, u32::MAX, 1]);

        let (keep, (tie_rows, groups)) = plan.slice(1, 3);
        assert_eq!(keep, BooleanArray::from(vec![true, false, false]));
        assert_eq!((tie_rows, groups), (vec![2], vec![0]));
        let (keep, (tie_rows, groups)) = plan.slice(4, 10);
        assert_eq!(keep, BooleanArray::from(vec![true, true]));
        assert_eq!((tie_rows, groups), (vec![1], vec![1]));

        let dense = FilePlan::new(&bits(3, &[0, 1, 2]), std::iter::empty(), 0, 32);
        assert_eq!(dense.ranges(), std::slice::from_ref(&(0..3)));
        let none = FilePlan::new(&bits(5, &[]), std::iter::empty(), 10, 32);
        assert_eq!(none.rows_read(), 0);
        assert!(none.ranges().is_empty());
    }

    /// Against the row-by-row rule, on random plans: a row is read when it is kept, tied,
    /// or in a gap shorter than the limit between two such rows.
    #[test]
    fn plans_read_what_the_row_by_row_rule_reads() {
        let mut rng = idem_core::rng::SplitMix64::new(7);
        for round in 0..200 {
            let rows = (rng.next_u64() % 300) as usize;
            let start = rng.next_u64() % 1000;
            let gaps_below = rng.next_u64() % 40;
            let density = rng.next_u64() % 100;
            let kept: Vec<usize> = (0..rows)
                .filter(|_| rng.next_u64() % 100 < density)
                .collect();
            let ties: Vec<TieRow> = (0..rows)
                .filter(|_| rng.next_u64() % 100 < density / 3)
                .map(|row| tie(start + row as u64, row as u32 * 7))
                .collect();
            let wanted: Vec<u64> = (0..rows as u64)
                .filter(|row| {
                    kept.contains(&(*row as usize))
                        || ties.iter().any(|t| t.position == start + row)
                })
                .collect();
            let mut expected = Vec::new();
            for (i, &row) in wanted.iter().enumerate() {
                if let Some(&previous) = i.checked_sub(1).map(|p| &wanted[p])
                    && row - previous - 1 < gaps_below
                {
                    expected.extend(previous + 1..row);
                }
                expected.push(row);
            }
            let plan = FilePlan::new(
                &bits(rows, &kept),
                ties.clone().into_iter(),
                start,
                gaps_below,
            );
            let (read, keep, groups) = plan.into_parts();
            assert_eq!(read, expected, "round {round}");
            for (i, &row) in read.iter().enumerate() {
                assert_eq!(
                    keep[i],
                    kept.contains(&(row as usize)),
                    "round {round} row {row}"
                );
                let group = ties
                    .iter()
                    .find(|t| t.position == start + row)
                    .map_or(u32::MAX, |t| t.group);
                assert_eq!(groups[i], group, "round {round} row {row}");
            }
        }
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
