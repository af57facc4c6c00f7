//! A Delta Lake table as `idem merge` sees it: deltalake-core keeps the log (snapshots,
//! put-if-absent commits, checkpoints); idem writes the data files itself and describes them
//! with `add` actions whose statistics it computes.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, RecordBatch};
use arrow::compute::{cast, max, max_string, min, min_string};
use arrow::datatypes::{DataType, Int64Type, SchemaRef};
use deltalake_core::kernel::Add;
use deltalake_core::logstore::{LogStoreRef, StorageConfig, default_logstore};
use deltalake_core::{DeltaTable, DeltaTableError};
use object_store::ObjectStore;
use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjectPath;
use object_store::prefix::PrefixStore;
use serde_json::{Map, Value, json};
use url::Url;

use super::partition::{PartitionValues, Partitioning};
use crate::error::{Error, Result};
use crate::input::{ConstantColumns, InputSource};
use crate::output::OutputWriter;
use crate::storage::{Location, RemoteLocation, StorageOptions, block_on, object_store_for};

/// Where a table's files are, and its log.
pub(crate) struct Table {
    /// The table's URL, with a trailing slash.
    pub url: Url,
    /// The table as the user named it, for messages.
    pub name: String,
    pub log_store: LogStoreRef,
    files: Files,
}

enum Files {
    Local(PathBuf),
    Remote(RemoteLocation),
}

impl Table {
    /// Resolves a path or URL to a table location (which need not hold a table yet).
    pub fn open(location: &str, storage: &StorageOptions) -> Result<Self> {
        let name = location.trim_end_matches('/').to_owned();
        let (url, files, root_store): (Url, Files, Arc<dyn ObjectStore>) =
            match Location::parse(location, storage)? {
                Location::Local(path) => {
                    std::fs::create_dir_all(&path).map_err(Error::io(&path))?;
                    let path = std::path::absolute(&path).map_err(Error::io(&path))?;
                    let url = Url::from_directory_path(&path).map_err(|()| {
                        Error::InvalidArgument(format!(
                            "'{}': not a usable table path",
                            path.display()
                        ))
                    })?;
                    (url, Files::Local(path), Arc::new(LocalFileSystem::new()))
                }
                Location::Remote(remote) => {
                    let mut url = Url::parse(&remote.url())
                        .map_err(|e| Error::InvalidArgument(format!("'{location}': {e}")))?;
                    if !url.path().ends_with('/') {
                        url.set_path(&format!("{}/", url.path()));
                    }
                    let store = object_store_for(&url, storage)?;
                    (url, Files::Remote(remote), store)
                }
            };
        let prefix = ObjectPath::from_url_path(url.path())
            .map_err(|e| Error::InvalidArgument(format!("'{location}': {e}")))?;
        let prefixed: Arc<dyn ObjectStore> =
            Arc::new(PrefixStore::new(Arc::clone(&root_store), prefix));
        let log_store = default_logstore(prefixed, root_store, &url, &StorageConfig::default());
        Ok(Self {
            url,
            name,
            log_store,
            files,
        })
    }

    /// Loads the latest version, or `None` where there is no table yet.
    pub fn load(&self) -> Result<Option<DeltaTable>> {
        let mut table = DeltaTable::new(Arc::clone(&self.log_store));
        match self.block_on(table.load())? {
            Ok(()) => Ok(Some(table)),
            Err(DeltaTableError::NotATable(_)) => Ok(None),
            Err(source) => Err(self.error(source)),
        }
    }

    /// Runs a future of the Delta stack to completion.
    pub fn block_on<F: Future>(&self, future: F) -> Result<F::Output> {
        block_on(future).map_err(Error::io(&self.name))
    }

    /// A Delta error, naming the table.
    pub fn error(&self, source: DeltaTableError) -> Error {
        Error::Delta {
            table: self.name.clone(),
            source: Box::new(source),
        }
    }

    /// A data file of the table, by its path relative to the table's root, with the
    /// partition columns its rows get from the log.
    pub fn data_file(
        &self,
        relative: &str,
        size: u64,
        partition: Option<&Arc<ConstantColumns>>,
    ) -> InputSource {
        let file = match &self.files {
            Files::Local(root) => InputSource::Local(root.join(relative)),
            Files::Remote(root) => InputSource::Remote(root.join(relative).file_of_size(size)),
        };
        match partition {
            None => file,
            Some(columns) => InputSource::Partitioned {
                file: Box::new(file),
                columns: Arc::clone(columns),
            },
        }
    }

    /// A state file of the table (its size asked of the store).
    pub fn state_file(&self, relative: &str) -> Result<InputSource> {
        match &self.files {
            Files::Local(root) => Ok(InputSource::Local(root.join(relative))),
            Files::Remote(root) => {
                let location = root.join(relative);
                location
                    .expand(|_| true)?
                    .into_iter()
                    .next()
                    .map(InputSource::Remote)
                    .ok_or_else(|| Error::InvalidArgument(format!("{}: missing", location.url())))
            }
        }
    }

    /// The path of a file for messages.
    pub fn display(&self, relative: &str) -> PathBuf {
        PathBuf::from(format!("{}{relative}", self.url))
    }

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

/// The data files of the latest version of the Delta table at `input`, or `None` where
/// `input` is not a table (no `_delta_log`). This is how every command reads a table: only
/// the files the log references, never removed or uncommitted ones.
///
/// # Errors
/// A table that cannot be loaded, or one idem cannot read correctly (partitioned, deletion
/// vectors, column mapping).
pub(crate) fn table_files(
    input: &str,
    storage: &StorageOptions,
) -> Result<Option<Vec<InputSource>>> {
    if input.contains(['*', '?', '[']) {
        return Ok(None);
    }
    let is_table = match crate::storage::Location::parse(input, storage)? {
        crate::storage::Location::Local(path) => path.join("_delta_log").is_dir(),
        crate::storage::Location::Remote(remote) => {
            remote.join("_delta_log").has_objects_below()?
        }
    };
    if !is_table {
        return Ok(None);
    }
    let table = Table::open(input, storage)?;
    let Some(delta) = table.load()? else {
        return Ok(None);
    };
    let state = delta.snapshot().map_err(|e| table.error(e))?;
    check_readable(&table, state.metadata().configuration())?;
    let schema = table_schema(&table, state)?;
    let partitioning =
        Partitioning::try_new(state.metadata().partition_columns(), &schema, &table.name)?;
    let mut files = Vec::new();
    for view in state.log_data().iter() {
        if view.deletion_vector_descriptor().is_some() {
            return Err(deletion_vector_error(&table, &view.path()));
        }
        let path = view.path().to_string();
        let partition = match &partitioning {
            None => None,
            Some(p) => Some(p.of_file(&view.partition_values_map(), &path)?.1),
        };
        files.push((path, view.size().max(0) as u64, partition));
    }
    files.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(Some(
        files
            .into_iter()
            .map(|(path, size, partition)| table.data_file(&path, size, partition.as_ref()))
            .collect(),
    ))
}

/// The table's columns as Arrow sees them (partition columns included).
pub(super) fn table_schema(
    table: &Table,
    state: &deltalake_core::table::state::DeltaTableState,
) -> Result<SchemaRef> {
    use deltalake_core::kernel::engine::arrow_conversion::TryIntoArrow;
    let schema: arrow::datatypes::Schema = state
        .schema()
        .as_ref()
        .try_into_arrow()
        .map_err(|e: arrow::error::ArrowError| Error::arrow(table.display(""))(e))?;
    Ok(Arc::new(schema))
}

/// What idem can read and rewrite: Parquet files holding the table's columns by name.
pub(super) fn check_readable(table: &Table, configuration: &HashMap<String, String>) -> Result<()> {
    if let Some(mode) = configuration.get("delta.columnMapping.mode")
        && mode != "none"
    {
        return Err(Error::InvalidArgument(format!(
            "{}: column mapping ({mode}) is not supported by idem",
            table.name
        )));
    }
    Ok(())
}

pub(super) fn deletion_vector_error(table: &Table, path: &str) -> Error {
    Error::InvalidArgument(format!(
        "{}: file {path} has a deletion vector, which idem does not support",
        table.name
    ))
}

/// Milliseconds since the Unix epoch.
pub(crate) fn now_millis() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
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
