//! Which table rows a batch meets: files pruned by bucket and key statistics, then only
//! the key and version columns of the rest read, two files at a time.

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;

use arrow::array::{Array, Int64Array, RecordBatch, StringArray, UInt32Array};
use arrow::datatypes::{DataType, Schema, SchemaRef};
use serde_json::Value;

use super::Snapshot;
use crate::error::{Error, Result};
use crate::merge::{Batch, MergeReport, Outcome};
use crate::read::delta::Table;
use crate::read::delta::partition::PartitionValues;
use crate::read::input::InputFile;
use crate::read::schema::conform;

/// A table row that holds a batch key: (winner, file, row in file, encoded table version).
type Match = (u32, u32, u32, Vec<u8>);

/// Where the table holds the batch's keys: every match (file, row) and the greatest version
/// per winner.
pub(crate) struct Found {
    pub(super) matches: Vec<(u32, u32, u32)>,
    versions: Vec<u8>,
    present: Vec<bool>,
}

impl Found {
    pub(super) fn version(&self, row: usize, width: usize) -> Option<&[u8]> {
        self.present[row].then(|| &self.versions[row * width..(row + 1) * width])
    }
}

pub(super) fn find_rows(
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
    let partitions = key_partitions(snapshot, batch, &active)?;
    let candidates: Vec<usize> = (0..snapshot.files.len())
        .filter(|&i| {
            let file = &snapshot.files[i];
            let in_bucket = match (&buckets, file.bucket) {
                (Some(wanted), Some(b)) => wanted.contains(&b),
                _ => true,
            };
            let in_partition = match (&partitions, &file.partition) {
                (Some(wanted), Some(p)) => wanted.contains(&p.values),
                _ => true,
            };
            in_bucket && in_partition && first_keys.may_meet(file.first_key_bounds.as_ref())
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
    let decision_schema = project_schema(&snapshot.schema, &columns);
    // Two readers: decoding Parquet is the cost, and it parallelises by file.
    let threads = candidates.len().clamp(1, 2);
    let results: Vec<Result<Vec<Match>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let candidates = &candidates;
                let columns = &columns;
                let decision_schema = &decision_schema;
                scope.spawn(move || {
                    let mut out = Vec::new();
                    for &index in candidates.iter().skip(t).step_by(threads) {
                        let input = InputFile::open(&snapshot.files[index].source(table))?;
                        let mut offset = 0u32;
                        for piece in input.read_columns(columns)? {
                            let piece = conform(&piece?, decision_schema, false, input.path())?;
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

/// The partitions that can hold the active winners' keys, when every partition column is a
/// key column (a key then lives in one partition); `None` when a key may be in any.
fn key_partitions(
    snapshot: &Snapshot,
    batch: &Batch,
    active: &[usize],
) -> Result<Option<HashSet<PartitionValues>>> {
    let Some(partitioning) = &snapshot.partitioning else {
        return Ok(None);
    };
    if !partitioning
        .columns()
        .iter()
        .all(|c| batch.spec.keys.contains(c))
    {
        return Ok(None);
    }
    let (partitions, of_row) = partitioning.of_rows(batch.winners.rows())?;
    let wanted: BTreeSet<u32> = active.iter().map(|&r| of_row[r]).collect();
    Ok(Some(
        wanted
            .into_iter()
            .map(|p| partitions[p as usize].clone())
            .collect(),
    ))
}

fn project_schema(schema: &SchemaRef, columns: &[&str]) -> SchemaRef {
    Arc::new(Schema::new(
        columns
            .iter()
            .filter_map(|c| schema.field_with_name(c).ok().cloned())
            .collect::<Vec<_>>(),
    ))
}

/// The first index in `0..len` for which `below` is false (`below` holds for a prefix).
fn first_not_below(len: usize, below: impl Fn(usize) -> bool) -> usize {
    let (mut low, mut high) = (0, len);
    while low < high {
        let middle = low + (high - low) / 2;
        if below(middle) {
            low = middle + 1;
        } else {
            high = middle;
        }
    }
    low
}

/// The batch's values of the first key column, sorted, to test files' key ranges against.
enum FirstKeys {
    Integers(Vec<i64>),
    /// Sorted; kept as one Arrow array rather than a `String` per key.
    Strings(StringArray),
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
                match arrow::compute::sort(&values, None) {
                    Ok(sorted) => sorted
                        .as_any()
                        .downcast_ref::<StringArray>()
                        .map_or(Self::Unknown, |v| Self::Strings(v.clone())),
                    Err(_) => Self::Unknown,
                }
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
                    let at = first_not_below(v.len(), |i| v.value(i) < l);
                    at < v.len() && v.value(at) <= h
                }
                _ => true,
            },
            Self::Unknown => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn key_ranges_prune_files_that_cannot_hold_a_batch_key() {
        let keys = FirstKeys::Integers(vec![3, 10, 20]);
        assert!(keys.may_meet(Some(&(json!(1), json!(3)))));
        assert!(!keys.may_meet(Some(&(json!(4), json!(9)))));
        assert!(!keys.may_meet(Some(&(json!(21), json!(99)))));
        assert!(keys.may_meet(None));
        let keys = FirstKeys::Strings(StringArray::from(vec!["b", "m"]));
        assert!(keys.may_meet(Some(&(json!("a"), json!("c")))));
        assert!(!keys.may_meet(Some(&(json!("c"), json!("l")))));
        assert!(FirstKeys::Unknown.may_meet(Some(&(json!(0), json!(0)))));
    }
}
