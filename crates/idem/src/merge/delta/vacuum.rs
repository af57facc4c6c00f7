//! `idem vacuum`: deltalake-core's vacuum in full mode, plus idem's own hidden files.

use std::time::Duration;

use serde::Serialize;

use super::TOMBSTONES_PROPERTY;
use crate::error::{Error, Result};
use crate::read::delta::Table;
use crate::storage::StorageOptions;

/// What `idem vacuum` removed (or would remove, in a dry run).
#[derive(Debug, Clone, Default, Serialize)]
pub struct VacuumReport {
    /// The table.
    pub table: String,
    /// Whether nothing was deleted, only listed.
    pub dry_run: bool,
    /// Files older than this many seconds were eligible.
    pub retention_seconds: u64,
    /// Data files no version within the retention references, and files of merges that
    /// never committed (relative paths).
    pub files_deleted: Vec<String>,
    /// Old tombstone state files and abandoned temporaries of idem itself.
    pub state_files_deleted: Vec<String>,
}

/// Removes files no committed table version within `retention` needs: data files removed
/// by earlier merges, files written by merges that were killed or lost a commit race, and
/// superseded tombstone state. Readers of versions older than `retention` may fail after it.
///
/// # Errors
/// No table at the location, or a storage failure.
pub fn run_vacuum(
    location: &str,
    retention: Duration,
    dry_run: bool,
    storage: &StorageOptions,
) -> Result<VacuumReport> {
    use futures::TryStreamExt;
    let table = Table::open(location, storage)?;
    let Some(delta) = table.load()? else {
        return Err(Error::InvalidArgument(format!(
            "{location}: no Delta table here"
        )));
    };
    let current_state = delta
        .snapshot()
        .map_err(|e| table.error(e))?
        .metadata()
        .configuration()
        .get(TOMBSTONES_PROPERTY)
        .cloned()
        .unwrap_or_default();
    let store = delta.log_store().object_store(None);
    let period = chrono::Duration::from_std(retention)
        .map_err(|_| Error::InvalidArgument(format!("retention {retention:?} is too long")))?;
    let (_, metrics) = table
        .block_on(
            delta
                .vacuum()
                .with_mode(deltalake_core::operations::vacuum::VacuumMode::Full)
                .with_retention_period(period)
                .with_enforce_retention_duration(false)
                .with_dry_run(dry_run)
                .into_future(),
        )?
        .map_err(|e| table.error(e))?;
    // Vacuum leaves hidden names alone: idem's state directory and its writers' temporaries.
    let horizon = chrono::Utc::now() - period;
    let listed: Vec<object_store::ObjectMeta> = table
        .block_on(store.list(None).try_collect::<Vec<_>>())?
        .map_err(|source| Error::Storage {
            url: table.url.to_string(),
            source,
        })?;
    let mut state_files_deleted = Vec::new();
    for meta in listed {
        let name = meta.location.as_ref();
        let is_old_state = name.starts_with("_idem/") && name != current_state;
        let is_temporary =
            !name.contains('/') && name.starts_with('.') && name.contains(".idem-tmp-");
        if (is_old_state || is_temporary) && meta.last_modified < horizon {
            if !dry_run {
                table
                    .block_on(object_store::ObjectStoreExt::delete(
                        store.as_ref(),
                        &meta.location,
                    ))?
                    .map_err(|source| Error::Storage {
                        url: format!("{}{name}", table.url),
                        source,
                    })?;
            }
            state_files_deleted.push(name.to_owned());
        }
    }
    Ok(VacuumReport {
        table: location.to_owned(),
        dry_run,
        retention_seconds: retention.as_secs(),
        files_deleted: metrics.files_deleted,
        state_files_deleted,
    })
}
