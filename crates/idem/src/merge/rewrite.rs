//! Copy-on-write: the files holding replaced or deleted rows are rewritten without them,
//! new rows go to new files sorted by key (one file per touched bucket with buckets).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use arrow::array::{BooleanArray, RecordBatch, UInt32Array};
use arrow::compute::{
    SortColumn, concat_batches, filter_record_batch, lexsort_to_indices, take_record_batch,
};
use arrow::datatypes::SchemaRef;
use deltalake_core::kernel::{Action, Add, Remove};

use super::find::Found;
use super::keyed::key_hashes;
use super::table::{Table, now_millis};
use super::{Batch, MergeJob, MergeReport, Outcome, Snapshot, TableFile, Written, unique_id};
use crate::error::{Error, Result};
use crate::input::InputFile;
use crate::schema::conform;

/// Rewrites the files that hold replaced or deleted rows, and writes the new rows.
#[allow(clippy::too_many_arguments)]
pub(super) fn write_data(
    job: &MergeJob,
    table: &Table,
    snapshot: &Snapshot,
    batch: &Batch,
    outcome: &[Outcome],
    found: &Found,
    written: &mut Written<'_>,
    actions: &mut Vec<Action>,
    report: &mut MergeReport,
) -> Result<()> {
    let winners = &batch.winners;
    let replaced = |o: Outcome| matches!(o, Outcome::Update | Outcome::Delete);
    // Rows to drop, per file.
    let mut drop_rows: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for &(winner, file, row) in &found.matches {
        if replaced(outcome[winner as usize]) {
            drop_rows.entry(file).or_default().push(row);
        }
    }
    let new_rows: Vec<u32> = (0..winners.len())
        .filter(|&r| matches!(outcome[r], Outcome::Insert | Outcome::Update))
        .map(|r| r as u32)
        .collect();
    let schema = &snapshot.schema;
    let fresh = take_record_batch(winners.rows(), &UInt32Array::from(new_rows.clone()))
        .map_err(Error::arrow(table.display("")))?;
    let fresh = conform(&fresh, schema, false, &table.display(""))?;

    // Files to rewrite: with buckets, every file of a touched bucket (the bucket becomes one
    // file again); without, the files that lose rows.
    let mut rewrite: Vec<usize> = Vec::new();
    let mut touched_buckets: BTreeSet<u32> = BTreeSet::new();
    let fresh_buckets: Option<Vec<u32>> = match snapshot.buckets {
        Some(n) => {
            let hashes =
                key_hashes(&fresh, &batch.spec.keys).map_err(Error::arrow(table.display("")))?;
            let buckets: Vec<u32> = hashes
                .iter()
                .map(|h| (h % u64::from(n.max(1))) as u32)
                .collect();
            touched_buckets.extend(buckets.iter().copied());
            for &file in drop_rows.keys() {
                if let Some(b) = snapshot.files[file as usize].bucket {
                    touched_buckets.insert(b);
                }
            }
            // Files another writer added without a bucket are always scanned; rewritten,
            // they stay bucketless (below).
            rewrite.extend((0..snapshot.files.len()).filter(|&i| {
                snapshot.files[i]
                    .bucket
                    .is_some_and(|b| touched_buckets.contains(&b))
            }));
            Some(buckets)
        }
        None => {
            rewrite.extend(drop_rows.keys().map(|&f| f as usize));
            None
        }
    };

    let mut out = Out {
        table,
        schema,
        written,
        actions,
        report,
    };
    let empty = Vec::new();
    let dropped_in = |index: usize| -> BTreeSet<u32> {
        drop_rows
            .get(&(index as u32))
            .unwrap_or(&empty)
            .iter()
            .copied()
            .collect()
    };
    match fresh_buckets {
        Some(fresh_buckets) => {
            // One bucket at a time, so memory holds one bucket's rows.
            for bucket in &touched_buckets {
                let mut parts = Vec::new();
                for &index in rewrite
                    .iter()
                    .filter(|&&i| snapshot.files[i].bucket == Some(*bucket))
                {
                    parts.extend(out.survivors(&snapshot.files[index], &dropped_in(index))?);
                }
                let pick: Vec<u32> = (0..fresh.num_rows() as u32)
                    .filter(|&r| fresh_buckets[r as usize] == *bucket)
                    .collect();
                parts.push(
                    take_record_batch(&fresh, &UInt32Array::from(pick))
                        .map_err(Error::arrow(table.display("")))?,
                );
                let rows =
                    concat_batches(schema, &parts).map_err(Error::arrow(table.display("")))?;
                if rows.num_rows() > 0 {
                    let rows = sort_by_key(&rows, &batch.spec.keys)?;
                    out.add(&format!("bucket-{bucket:05}"), &rows)?;
                }
            }
            for (&index, _) in drop_rows
                .iter()
                .filter(|(i, _)| snapshot.files[**i as usize].bucket.is_none())
            {
                let index = index as usize;
                let parts = out.survivors(&snapshot.files[index], &dropped_in(index))?;
                let rows =
                    concat_batches(schema, &parts).map_err(Error::arrow(table.display("")))?;
                if rows.num_rows() > 0 {
                    out.add("part", &rows)?;
                }
            }
        }
        None => {
            // A rewritten file keeps its other rows together: they were clustered by key
            // when written.
            for &index in &rewrite {
                let parts = out.survivors(&snapshot.files[index], &dropped_in(index))?;
                let rows =
                    concat_batches(schema, &parts).map_err(Error::arrow(table.display("")))?;
                if rows.num_rows() > 0 {
                    out.add("part", &rows)?;
                }
            }
            if fresh.num_rows() > 0 {
                let sorted = sort_by_key(&fresh, &batch.spec.keys)?;
                let per_file = job.max_rows_per_file.max(1);
                let mut start = 0;
                while start < sorted.num_rows() {
                    let len = per_file.min(sorted.num_rows() - start);
                    out.add("part", &sorted.slice(start, len))?;
                    start += len;
                }
            }
        }
    }
    Ok(())
}

/// Where [`write_data`] puts what it writes.
struct Out<'a, 'b> {
    table: &'a Table,
    schema: &'a SchemaRef,
    written: &'a mut Written<'b>,
    actions: &'a mut Vec<Action>,
    report: &'a mut MergeReport,
}

impl Out<'_, '_> {
    /// Reads a file without its `dropped` rows and records its removal.
    fn survivors(&mut self, file: &TableFile, dropped: &BTreeSet<u32>) -> Result<Vec<RecordBatch>> {
        let input = InputFile::open(&self.table.data_file(&file.path, file.size))?;
        let names: Vec<&str> = self
            .schema
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .collect();
        let mut offset = 0u32;
        let mut kept = Vec::new();
        for piece in input.read_columns(&names)? {
            let piece = conform(&piece?, self.schema, false, input.path())?;
            let n = piece.num_rows() as u32;
            let keep: BooleanArray = (offset..offset + n)
                .map(|r| Some(!dropped.contains(&r)))
                .collect();
            offset += n;
            let piece = filter_record_batch(&piece, &keep).map_err(Error::arrow(input.path()))?;
            if piece.num_rows() > 0 {
                self.report.rows_rewritten += piece.num_rows() as u64;
                kept.push(piece);
            }
        }
        self.actions.push(Action::Remove(Remove {
            path: file.path.clone(),
            data_change: true,
            deletion_timestamp: Some(now_millis()),
            extended_file_metadata: Some(true),
            size: Some(file.size as i64),
            partition_values: Some(HashMap::new()),
            ..Default::default()
        }));
        self.report.files_removed += 1;
        Ok(kept)
    }

    /// Writes rows as a new data file named `PREFIX-UNIQUE.parquet`.
    fn add(&mut self, prefix: &str, rows: &RecordBatch) -> Result<()> {
        let path = format!("{prefix}-{}.parquet", unique_id());
        self.written.push(path.clone());
        let add: Add =
            self.table
                .write_data_file(&path, self.schema, std::slice::from_ref(rows))?;
        self.actions.push(Action::Add(add));
        self.report.files_added += 1;
        Ok(())
    }
}

/// Rows ordered by key, so that files cover narrow key ranges and later merges can skip
/// them by statistics.
fn sort_by_key(rows: &RecordBatch, keys: &[String]) -> Result<RecordBatch> {
    let columns = keys
        .iter()
        .map(|k| {
            rows.column_by_name(k).map(|c| SortColumn {
                values: Arc::clone(c),
                options: None,
            })
        })
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| {
            Error::InvalidArgument("key column missing from rows to write".to_owned())
        })?;
    let order = lexsort_to_indices(&columns, None).map_err(Error::arrow(""))?;
    take_record_batch(rows, &order).map_err(Error::arrow(""))
}
