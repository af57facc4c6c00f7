//! Remembered deletes: (key, version, when) rows that a target stores with its data and
//! changes in the same commit, so that a late older update of a deleted key stays out.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use arrow::array::{Array, ArrayRef, BooleanArray, Int64Array, RecordBatch, UInt32Array};
use arrow::compute::{concat_batches, filter_record_batch, take_record_batch};
use arrow::datatypes::{DataType, Field, Schema};

use super::Batch;
use super::keyed::KeyedRows;
use crate::error::{Error, Result};
use crate::read::schema::conform;

/// Column of the tombstone state: when the delete was applied, milliseconds since the epoch.
pub(super) const DELETED_AT: &str = "_idem_deleted_at_ms";

/// The live tombstones of the version read.
pub(super) struct Tombstones {
    pub(super) rows: Option<KeyedRows>,
    pub(super) expired: u64,
}

/// The tombstones of `rows` (a stored tombstone state read from `display`) that are live
/// at `now`, in the batch's stored types.
pub(super) fn live_tombstones(
    rows: RecordBatch,
    display: &Path,
    batch: &Batch,
    retention: Duration,
    now: i64,
) -> Result<Tombstones> {
    let horizon = now.saturating_sub(retention.as_millis().min(i64::MAX as u128) as i64);
    let deleted_at = rows
        .column_by_name(DELETED_AT)
        .and_then(|c| c.as_any().downcast_ref::<Int64Array>())
        .ok_or_else(|| {
            Error::InvalidArgument(format!("{}: not an idem tombstone file", display.display()))
        })?;
    let live: BooleanArray = deleted_at
        .iter()
        .map(|t| Some(t.is_some_and(|t| t >= horizon)))
        .collect();
    let expired = live.false_count() as u64;
    let rows = filter_record_batch(&rows, &live).map_err(Error::arrow(&display))?;
    // Versions compare as encoded bytes, which depend on the type: a state file written
    // before the batch's columns were stored as the table's types is read in them.
    let winners = batch.winners.rows().schema();
    let wanted: Vec<Field> = rows
        .schema()
        .fields()
        .iter()
        .map(|f| match winners.field_with_name(f.name()) {
            Ok(w) => w.clone(),
            Err(_) => f.as_ref().clone(),
        })
        .collect();
    let rows = conform(&rows, &Arc::new(Schema::new(wanted)), false, display)?;
    let rows = KeyedRows::try_new(rows, &batch.spec.keys, &batch.spec.versions)
        .map_err(Error::arrow(&display))?;
    Ok(Tombstones {
        rows: Some(rows),
        expired,
    })
}

/// Kept tombstones plus the batch's new ones: key and version columns and when.
pub(super) fn next_tombstones(
    batch: &Batch,
    tombstones: &Tombstones,
    new: &[u32],
    forgotten: &BTreeSet<u32>,
    now: i64,
) -> Result<Option<RecordBatch>> {
    let columns: Vec<&String> = batch.spec.keys.iter().chain(&batch.spec.versions).collect();
    let project = |rows: &RecordBatch, take: &[u32], deleted_at: ArrayRef| -> Result<RecordBatch> {
        let taken =
            take_record_batch(rows, &UInt32Array::from(take.to_vec())).map_err(Error::arrow(""))?;
        let mut fields = Vec::new();
        let mut arrays = Vec::new();
        for name in &columns {
            let index = taken.schema().index_of(name).map_err(Error::arrow(""))?;
            fields.push(taken.schema().field(index).clone().with_nullable(true));
            arrays.push(Arc::clone(taken.column(index)));
        }
        fields.push(Field::new(DELETED_AT, DataType::Int64, true));
        arrays.push(deleted_at);
        RecordBatch::try_new(Arc::new(Schema::new(fields)), arrays).map_err(Error::arrow(""))
    };
    let fresh = project(
        batch.winners.rows(),
        new,
        Arc::new(Int64Array::from(vec![now; new.len()])),
    )?;
    let Some(old) = &tombstones.rows else {
        return Ok(Some(fresh));
    };
    let kept: Vec<u32> = (0..old.len() as u32)
        .filter(|t| !forgotten.contains(t))
        .collect();
    let old_rows = old.rows();
    let when = old_rows
        .column_by_name(DELETED_AT)
        .cloned()
        .ok_or_else(|| {
            Error::InvalidArgument("tombstone state without deletion times".to_owned())
        })?;
    let when = arrow::compute::take(&when, &UInt32Array::from(kept.clone()), None)
        .map_err(Error::arrow(""))?;
    let kept = project(old_rows, &kept, when)?;
    let kept = conform(&kept, &fresh.schema(), false, std::path::Path::new(""))?;
    Ok(Some(
        concat_batches(&fresh.schema(), [&kept, &fresh]).map_err(Error::arrow(""))?,
    ))
}
