//! Pass 2 row by row: the winners' whole rows (and the rows tied with them, hashed to be
//! compared) read with a Parquet row selection, on a second thread, and handed on in input
//! order through the state's filter to a sink.

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use arrow::array::RecordBatch;
use arrow::compute::filter_record_batch;
use arrow::datatypes::SchemaRef;
use idem_core::{TieCheck, TieHasher, describe_row};

use super::pipeline::pipeline;
use super::plan::FilePlan;
use super::report::DedupRun;
use super::{Decided, DedupJob};
use crate::error::{Error, Result};
use crate::progress::Progress;
use crate::read::input::{InputFile, TextLayout};
use crate::read::schema::{conform, with_views};
use crate::state::WinnerFilter;

/// Every winner goes on.
pub(super) struct KeepAll;

impl WinnerFilter for KeepAll {
    fn filter(&mut self, batch: RecordBatch, _path: &Path) -> Result<RecordBatch> {
        Ok(batch)
    }
}

/// Pass 2 row by row: reads the winners' whole rows (and tied rows, to compare them) and
/// hands them to `sink` through `filter`, text and binary columns in `layout`: views for
/// a Parquet writer, which takes them as it takes the schema's own types; as stored for
/// sinks that hold on to the rows or build batches of the job's schema.
pub(super) fn fetch_rows<S>(
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

/// Whole-row batches in flight between pass 2's reader and its writer: enough to ride
/// out their speeds' ups and downs, few enough that wide rows stay cheap.
const FETCH_DEPTH: usize = 4;

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
