//! Dedup of batches already in memory: the whole pipeline in one call.

use arrow::array::RecordBatch;
use arrow::compute::interleave_record_batch;
use arrow::datatypes::SchemaRef;
use arrow::error::ArrowError;

use crate::options::DedupSpec;
use crate::stats::DedupStats;
use crate::table::KeepMaxTable;
use crate::ties::TieCheck;

/// Rows per output batch of [`dedup_batches`].
const OUTPUT_BATCH_ROWS: usize = 8192;

/// Deduplicates `batches` (all of `schema`): one row per key, the one with the maximum
/// version, in input order, with tombstones and ties handled as `spec` says. The output
/// comes in batches of at most 8192 rows, gathered from the input without concatenating it.
///
/// This holds every input row in memory; for files, `idem` reads only keys and versions
/// first and fetches the winning rows afterwards.
///
/// # Example
/// ```
/// # use std::sync::Arc;
/// # use arrow::array::{Int64Array, RecordBatch, StringArray};
/// # use arrow::datatypes::{DataType, Field, Schema};
/// use idem_core::{DedupSpec, dedup_batches};
/// let schema = Arc::new(Schema::new(vec![
///     Field::new("id", DataType::Utf8, false),
///     Field::new("lsn", DataType::Int64, false),
/// ]));
/// let batch = RecordBatch::try_new(Arc::clone(&schema), vec![
///     Arc::new(StringArray::from(vec!["a", "b", "a"])),
///     Arc::new(Int64Array::from(vec![1, 1, 2])),
/// ])?;
/// let (out, stats) = dedup_batches(&schema, &[batch], &DedupSpec::new(["id"], ["lsn"]))?;
/// assert_eq!(out.iter().map(|b| b.num_rows()).sum::<usize>(), 2);
/// assert_eq!(stats.superseded, 1);
/// # Ok::<(), arrow::error::ArrowError>(())
/// ```
///
/// # Errors
/// As [`KeepMaxTable::update`], and under `--on-tie error` a conflicting tie.
pub fn dedup_batches(
    schema: &SchemaRef,
    batches: &[RecordBatch],
    spec: &DedupSpec,
) -> Result<(Vec<RecordBatch>, DedupStats), ArrowError> {
    let mut table = KeepMaxTable::try_new(schema, spec)?;
    for batch in batches {
        table.update(batch)?;
    }
    let resolution = table.finish();
    let locate = Locator::new(batches);
    let sources: Vec<&RecordBatch> = batches.iter().collect();

    let mut check = TieCheck::try_new(schema, spec, resolution.tie_groups)?;
    for chunk in resolution.tie_rows.chunks(OUTPUT_BATCH_ROWS) {
        let indices: Vec<(usize, usize)> = chunk.iter().map(|t| locate.at(t.position)).collect();
        let groups: Vec<u32> = chunk.iter().map(|t| t.group).collect();
        check.observe(&interleave_record_batch(&sources, &indices)?, &groups)?;
    }
    let mut output = Vec::with_capacity(resolution.keep.len().div_ceil(OUTPUT_BATCH_ROWS));
    for chunk in resolution.keep.chunks(OUTPUT_BATCH_ROWS) {
        let indices: Vec<(usize, usize)> = chunk.iter().map(|&p| locate.at(p)).collect();
        output.push(interleave_record_batch(&sources, &indices)?);
    }
    let mut stats = resolution.stats;
    stats.conflicts = check.conflicts();
    Ok((output, stats))
}

/// Maps a position (a row's ordinal across all batches) to `(batch, row)`.
struct Locator {
    /// Position of each batch's first row.
    starts: Vec<u64>,
}

impl Locator {
    fn new(batches: &[RecordBatch]) -> Self {
        let mut next = 0u64;
        let starts = batches
            .iter()
            .map(|b| {
                let start = next;
                next += b.num_rows() as u64;
                start
            })
            .collect();
        Self { starts }
    }

    fn at(&self, position: u64) -> (usize, usize) {
        // The last batch starting at or before the position; empty batches share a start
        // with their successor, so take the last of equals.
        let batch = self.starts.partition_point(|&s| s <= position) - 1;
        (batch, (position - self.starts[batch]) as usize)
    }
}
