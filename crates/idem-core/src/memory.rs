//! Dedup of batches already in memory: the whole pipeline in one call.

use arrow::array::{RecordBatch, UInt64Array};
use arrow::compute::{concat_batches, take_record_batch};
use arrow::datatypes::SchemaRef;
use arrow::error::ArrowError;

use crate::options::DedupSpec;
use crate::stats::DedupStats;
use crate::table::KeepMaxTable;
use crate::ties::TieCheck;

/// Deduplicates `batches` (all of `schema`): one row per key, the one with the maximum
/// version, in input order, with tombstones and ties handled as `spec` says.
///
/// This holds every row in memory; for files, `idem` reads only keys and versions first and
/// fetches the winning rows afterwards.
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
/// assert_eq!(out.num_rows(), 2);
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
) -> Result<(RecordBatch, DedupStats), ArrowError> {
    let mut table = KeepMaxTable::try_new(schema, spec)?;
    for batch in batches {
        table.update(batch)?;
    }
    let resolution = table.finish();
    let all = concat_batches(schema, batches)?;
    let mut check = TieCheck::try_new(schema, spec, resolution.tie_groups)?;
    if !resolution.tie_rows.is_empty() {
        let positions =
            UInt64Array::from_iter_values(resolution.tie_rows.iter().map(|t| t.position));
        let groups: Vec<u32> = resolution.tie_rows.iter().map(|t| t.group).collect();
        check.observe(&take_record_batch(&all, &positions)?, &groups)?;
    }
    let output = take_record_batch(&all, &UInt64Array::from(resolution.keep))?;
    let mut stats = resolution.stats;
    stats.conflicts = check.conflicts();
    Ok((output, stats))
}
