//! A Delta Lake table, read: where its files and its log are, its snapshot, its schema, and
//! the data files of its latest version (how every command reads a table given as input).
//! deltalake-core keeps the log; writing to a table is [`crate::merge`]'s (its `delta`
//! target adds the write side of [`Table`]).

pub(crate) mod partition;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use deltalake_core::logstore::{LogStoreRef, StorageConfig, default_logstore};
use deltalake_core::{DeltaTable, DeltaTableError};
use object_store::ObjectStore;
use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjectPath;
use object_store::prefix::PrefixStore;
use url::Url;

use crate::error::{Error, Result};
use crate::read::input::{ConstantColumns, InputSource};
use crate::storage::{Location, RemoteLocation, StorageOptions, block_on, object_store_for};
use partition::Partitioning;

/// Where a table's files are, and its log.
pub(crate) struct Table {
    /// The table's URL, with a trailing slash.
    pub url: Url,
    /// The table as the user named it, for messages.
    pub name: String,
    pub log_store: LogStoreRef,
    pub(crate) files: Files,
}

/// The root of a table's data files, on the local disk or a store.
pub(crate) enum Files {
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
pub(crate) fn table_schema(
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
pub(crate) fn check_readable(table: &Table, configuration: &HashMap<String, String>) -> Result<()> {
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

pub(crate) fn deletion_vector_error(table: &Table, path: &str) -> Error {
    Error::InvalidArgument(format!(
        "{}: file {path} has a deletion vector, which idem does not support",
        table.name
    ))
}
