//! Copy-on-write: the files holding replaced or deleted rows are rewritten without them,
//! new rows go to new files sorted by key (one file per touched bucket with buckets).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use arrow::array::{BooleanArray, RecordBatch, UInt32Array};
use arrow::compute::{
    SortColumn, concat_batches, filter_record_batch, lexsort_to_indices, take_record_batch,
};
use arrow::datatypes::SchemaRef;
use deltalake_core::kernel::{Action, Add, Remove};

use super::find::Found;
use super::{Snapshot, TableFile, Written, unique_id};
use crate::error::{Error, Result};
use crate::merge::keyed::key_hashes;
use crate::merge::{Batch, MergeJob, MergeReport, Outcome};
use crate::read::delta::Table;
use crate::read::delta::partition::{PartitionValues, Partitioning};
use crate::read::input::InputFile;
use crate::read::schema::conform;
use crate::units::now_millis;

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

    // New rows by slot: their partition (partitioned tables) and bucket (bucketed ones).
    let (partitions, partition_of): (Vec<Option<PartitionValues>>, Vec<u32>) =
        match &snapshot.partitioning {
            Some(p) => {
                let (partitions, of_row) = p.of_rows(&fresh)?;
                (partitions.into_iter().map(Some).collect(), of_row)
            }
            None => (vec![None], vec![0; fresh.num_rows()]),
        };
    let bucket_of: Vec<Option<u32>> = match snapshot.buckets {
        Some(n) => key_hashes(&fresh, &batch.spec.keys)
            .map_err(Error::arrow(table.display("")))?
            .iter()
            .map(|h| Some((h % u64::from(n.max(1))) as u32))
            .collect(),
        None => vec![None; fresh.num_rows()],
    };
    let mut by_slot: BTreeMap<(u32, Option<u32>), Vec<u32>> = BTreeMap::new();
    for (row, (partition, bucket)) in partition_of.into_iter().zip(bucket_of).enumerate() {
        by_slot
            .entry((partition, bucket))
            .or_default()
            .push(row as u32);
    }
    let fresh_slots: BTreeMap<Slot, Vec<u32>> = by_slot
        .into_iter()
        .map(|((partition, bucket), rows)| ((partitions[partition as usize].clone(), bucket), rows))
        .collect();
    let file_slots: Vec<Slot> = snapshot
        .files
        .iter()
        .map(|f| (f.partition.as_ref().map(|p| p.values.clone()), f.bucket))
        .collect();

    let mut out = Out {
        table,
        schema,
        partitioning: snapshot.partitioning.as_ref(),
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
    let take = |rows: &[u32]| {
        take_record_batch(&fresh, &UInt32Array::from(rows.to_vec()))
            .map_err(Error::arrow(table.display("")))
    };
    // Files that lose rows and belong to no bucket keep their other rows together in one
    // new file of their partition: they were clustered by key when written.
    for &index in drop_rows.keys() {
        let index = index as usize;
        if snapshot.buckets.is_some() && file_slots[index].1.is_some() {
            continue;
        }
        let parts = out.survivors(&snapshot.files[index], &dropped_in(index))?;
        let rows = concat_batches(schema, &parts).map_err(Error::arrow(table.display("")))?;
        if rows.num_rows() > 0 {
            out.add("part", &rows, file_slots[index].0.as_ref())?;
        }
    }
    if snapshot.buckets.is_some() {
        // A touched bucket (of a partition) becomes one file again: its old files'
        // surviving rows and its new rows. One bucket at a time, so memory holds one
        // bucket's rows.
        let mut touched: BTreeSet<&Slot> = fresh_slots.keys().collect();
        touched.extend(
            drop_rows
                .keys()
                .map(|&i| &file_slots[i as usize])
                .filter(|slot| slot.1.is_some()),
        );
        for slot in touched {
            let mut parts = Vec::new();
            for index in (0..snapshot.files.len()).filter(|&i| file_slots[i] == *slot) {
                parts.extend(out.survivors(&snapshot.files[index], &dropped_in(index))?);
            }
            if let Some(rows) = fresh_slots.get(slot) {
                parts.push(take(rows)?);
            }
            let rows = concat_batches(schema, &parts).map_err(Error::arrow(table.display("")))?;
            if rows.num_rows() > 0 {
                let rows = sort_by_key(&rows, &batch.spec.keys)?;
                let bucket = slot.1.unwrap_or_default();
                out.add(&format!("bucket-{bucket:05}"), &rows, slot.0.as_ref())?;
            }
        }
    } else {
        for (slot, rows) in &fresh_slots {
            let sorted = sort_by_key(&take(rows)?, &batch.spec.keys)?;
            let per_file = job.max_rows_per_file.max(1);
            let mut start = 0;
            while start < sorted.num_rows() {
                let len = per_file.min(sorted.num_rows() - start);
                out.add("part", &sorted.slice(start, len), slot.0.as_ref())?;
                start += len;
            }
        }
    }
    Ok(())
}

/// Where rows are written: a partition and a bucket, where the table has them.
type Slot = (Option<PartitionValues>, Option<u32>);

/// Where [`write_data`] puts what it writes.
struct Out<'a, 'b> {
    table: &'a Table,
    schema: &'a SchemaRef,
    partitioning: Option<&'a Partitioning>,
    written: &'a mut Written<'b>,
    actions: &'a mut Vec<Action>,
    report: &'a mut MergeReport,
}

impl Out<'_, '_> {
    /// Reads a file without its `dropped` rows and records its removal.
    fn survivors(&mut self, file: &TableFile, dropped: &BTreeSet<u32>) -> Result<Vec<RecordBatch>> {
        let input = InputFile::open(&file.source(self.table))?;
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
            partition_values: Some(
                file.partition
                    .as_ref()
                    .map(|p| p.raw.clone())
                    .unwrap_or_default(),
            ),
            ..Default::default()
        }));
        self.report.files_removed += 1;
        Ok(kept)
    }

    /// Writes rows as a new data file named `PREFIX-UNIQUE.parquet`, in the directory of
    /// its partition.
    fn add(
        &mut self,
        prefix: &str,
        rows: &RecordBatch,
        partition: Option<&PartitionValues>,
    ) -> Result<()> {
        let name = format!("{prefix}-{}.parquet", unique_id());
        let placed = self.partitioning.zip(partition);
        let path = match placed {
            Some((p, values)) => format!("{}/{name}", p.directory(values)),
            None => name,
        };
        self.written.push(path.clone());
        let add: Add =
            self.table
                .write_data_file(&path, self.schema, std::slice::from_ref(rows), placed)?;
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
