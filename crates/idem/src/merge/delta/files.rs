//! The write side of a Delta table: data files written by idem and described by `add`
//! actions with statistics it computes, and the removal of files a failed attempt wrote.

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, RecordBatch};
use arrow::compute::{cast, max, max_string, min, min_string};
use arrow::datatypes::{DataType, Int64Type, SchemaRef};
use deltalake_core::kernel::Add;
use serde_json::{Map, Value, json};

use crate::error::{Error, Result};
use crate::read::delta::partition::{PartitionValues, Partitioning};
use crate::read::delta::{Files, Table};
use crate::units::now_millis;
use crate::write::output::OutputWriter;

impl Table {
    /// Writes rows as one Parquet data file at `relative` and returns its `add` action,
    /// statistics included. In a partition, the partition columns are left out of the
    /// file and recorded in the action. The file is not part of the table until a commit
    /// adds it.
    pub fn write_data_file(
        &self,
        relative: &str,
        schema: &SchemaRef,
        batches: &[RecordBatch],
        partition: Option<(&Partitioning, &PartitionValues)>,
    ) -> Result<Add> {
        let stripped;
        let (schema, batches) = match partition {
            None => (Arc::clone(schema), batches),
            Some((partitioning, _)) => {
                stripped = batches
                    .iter()
                    .map(|b| partitioning.strip(b))
                    .collect::<Result<Vec<_>>>()?;
                let schema = match stripped.first() {
                    Some(first) => first.schema(),
                    None => Arc::new(arrow::datatypes::Schema::new(
                        schema
                            .fields()
                            .iter()
                            .filter(|f| !partitioning.contains(f.name()))
                            .cloned()
                            .collect::<Vec<_>>(),
                    )),
                };
                (schema, stripped.as_slice())
            }
        };
        super::types::check_stored(&schema, &self.name)?;
        if let Some(batch) = batches.iter().find(|b| {
            b.schema()
                .fields()
                .iter()
                .zip(schema.fields())
                .any(|(a, b)| a.data_type() != b.data_type())
        }) {
            return Err(Error::InvalidArgument(format!(
                "{}: rows of types ({}) do not match the data file's schema",
                self.name,
                batch
                    .schema()
                    .fields()
                    .iter()
                    .map(|f| f.data_type().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let staging;
        let local = match &self.files {
            Files::Local(root) => root.join(relative),
            Files::Remote(_) => {
                staging = tempfile::tempdir().map_err(Error::io(std::env::temp_dir()))?;
                staging.path().join(relative.replace('/', "_"))
            }
        };
        if let Some(parent) = local.parent() {
            std::fs::create_dir_all(parent).map_err(Error::io(parent))?;
        }
        let mut writer = OutputWriter::try_new(&local, schema, usize::MAX)?;
        for batch in batches {
            writer.write(batch)?;
        }
        writer.commit()?;
        let size = std::fs::metadata(&local).map_err(Error::io(&local))?.len();
        if let Files::Remote(root) = &self.files {
            root.join(relative).upload(&local)?;
        }
        Ok(Add {
            path: relative.to_owned(),
            size: size as i64,
            modification_time: now_millis(),
            data_change: true,
            stats: Some(file_stats(batches).to_string()),
            partition_values: partition.map_or_else(HashMap::new, |(p, v)| p.raw(v)),
            ..Default::default()
        })
    }

    /// Deletes a file written by this run but not committed; a missing one is fine.
    pub fn delete_file(&self, relative: &str) -> Result<()> {
        match &self.files {
            Files::Local(root) => {
                let path = root.join(relative);
                match std::fs::remove_file(&path) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io(path)(e)),
                    _ => Ok(()),
                }
            }
            Files::Remote(root) => root.join(relative).delete(),
        }
    }
}

/// Longest text value written as a file's minimum or maximum.
const MAX_STRING_BOUND: usize = 64;

/// Delta file statistics: `numRecords`, `nullCount` for every top-level column, and
/// `minValues` / `maxValues` for integer, string and date columns, exact (readers prune with
/// them; so does the next merge). Other types get no bounds, which readers treat as unknown.
pub(crate) fn file_stats(batches: &[RecordBatch]) -> Value {
    let Some(first) = batches.first() else {
        return json!({"numRecords": 0});
    };
    let schema = first.schema();
    let mut nulls = Map::new();
    let mut mins = Map::new();
    let mut maxs = Map::new();
    for (index, field) in schema.fields().iter().enumerate() {
        let columns: Vec<&ArrayRef> = batches.iter().map(|b| b.column(index)).collect();
        let null_count: usize = columns.iter().map(|c| c.null_count()).sum();
        nulls.insert(field.name().clone(), json!(null_count));
        if let Some((low, high)) = bounds(field.data_type(), &columns) {
            mins.insert(field.name().clone(), low);
            maxs.insert(field.name().clone(), high);
        }
    }
    let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
    json!({"numRecords": rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls})
}

fn bounds(data_type: &DataType, columns: &[&ArrayRef]) -> Option<(Value, Value)> {
    let mut low: Option<Value> = None;
    let mut high: Option<Value> = None;
    let mut keep = |l: Value, h: Value, less: &dyn Fn(&Value, &Value) -> bool| {
        if low.as_ref().is_none_or(|x| less(&l, x)) {
            low = Some(l);
        }
        if high.as_ref().is_none_or(|x| less(x, &h)) {
            high = Some(h);
        }
    };
    for column in columns {
        match data_type {
            DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64 => {
                let values = cast(column, &DataType::Int64).ok()?;
                let values = values.as_any().downcast_ref::<arrow::array::Int64Array>()?;
                if let (Some(l), Some(h)) = (min::<Int64Type>(values), max::<Int64Type>(values)) {
                    keep(json!(l), json!(h), &|a, b| a.as_i64() < b.as_i64());
                }
            }
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => {
                let values = cast(column, &DataType::Utf8).ok()?;
                let values = values
                    .as_any()
                    .downcast_ref::<arrow::array::StringArray>()?;
                match (min_string(values), max_string(values)) {
                    // Long text (payloads) would bloat the log for bounds nobody prunes by;
                    // a truncated maximum would not be a bound at all.
                    (Some(l), Some(h))
                        if l.len() <= MAX_STRING_BOUND && h.len() <= MAX_STRING_BOUND =>
                    {
                        keep(json!(l), json!(h), &|a, b| a.as_str() < b.as_str());
                    }
                    (Some(_), Some(_)) => return None,
                    _ => {}
                }
            }
            DataType::Date32 => {
                let days = cast(column, &DataType::Int32).ok()?;
                let days = days.as_any().downcast_ref::<arrow::array::Int32Array>()?;
                let date = |d: i32| {
                    arrow::temporal_conversions::date32_to_datetime(d)
                        .map(|t| json!(t.date().to_string()))
                };
                if let (Some(l), Some(h)) = (
                    arrow::compute::min(days).and_then(date),
                    arrow::compute::max(days).and_then(date),
                ) {
                    // ISO dates order as text.
                    keep(l, h, &|a, b| a.as_str() < b.as_str());
                }
            }
            _ => return None,
        }
    }
    Some((low?, high?))
}

#[cfg(test)]
mod tests {
    use arrow::array::{Date32Array, Int32Array, StringArray};
    use arrow::datatypes::{Field, Schema};

    use super::*;

    #[test]
    fn statistics_cover_every_batch_and_skip_what_they_cannot_bound() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Utf8, true),
            Field::new("n", DataType::Int32, true),
            Field::new("day", DataType::Date32, true),
            Field::new("x", DataType::Float64, true),
        ]));
        let batch = |ids: Vec<Option<&str>>, ns: Vec<Option<i32>>, days: Vec<i32>| {
            let rows = ids.len();
            RecordBatch::try_new(
                Arc::clone(&schema),
                vec![
                    Arc::new(StringArray::from(ids)),
                    Arc::new(Int32Array::from(ns)),
                    Arc::new(Date32Array::from(days)),
                    Arc::new(arrow::array::Float64Array::from(vec![1.0; rows])),
                ],
            )
            .expect("batch")
        };
        let stats = file_stats(&[
            batch(vec![Some("m"), None], vec![Some(5), Some(-2)], vec![0, 1]),
            batch(
                vec![Some("b"), Some("z")],
                vec![None, Some(9)],
                vec![19_000, 2],
            ),
        ]);
        assert_eq!(stats["numRecords"], 4);
        assert_eq!(stats["minValues"]["id"], "b");
        assert_eq!(stats["maxValues"]["id"], "z");
        assert_eq!(stats["minValues"]["n"], -2);
        assert_eq!(stats["maxValues"]["n"], 9);
        assert_eq!(stats["minValues"]["day"], "1970-01-01");
        assert_eq!(stats["maxValues"]["day"], "2022-01-08");
        assert_eq!(stats["nullCount"]["id"], 1);
        assert_eq!(stats["nullCount"]["n"], 1);
        assert!(stats["minValues"].get("x").is_none());
    }
}
