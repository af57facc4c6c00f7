//! Expanding what a user names — files, directories, globs, object-store prefixes, Delta
//! tables — into the input files to read, in a deterministic order.

use std::path::{Path, PathBuf};

use super::input::{IPC_EXTENSIONS, InputSource, PARQUET_EXTENSIONS};
use crate::error::{Error, Result};
use crate::storage::{Location, StorageOptions};

fn is_data_file(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
        .is_some_and(|e| {
            PARQUET_EXTENSIONS.contains(&e.as_str()) || IPC_EXTENSIONS.contains(&e.as_str())
        })
}

/// Hidden and marker files (`.tmp`, `_SUCCESS`, `_delta_log`) are never data.
fn is_hidden(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with('.') || n.starts_with('_'))
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).map_err(Error::io(dir))? {
        let path = entry.map_err(Error::io(dir))?.path();
        if is_hidden(&path) {
            continue;
        }
        if path.is_dir() {
            walk(&path, out)?;
        } else if is_data_file(&path) {
            out.push(path);
        }
    }
    Ok(())
}

/// Expands the inputs, in the order given: a file or object is itself, a directory or
/// prefix every data file below it in sorted order, a glob its matches in sorted order,
/// and a Delta Lake table (with the `delta` feature) the data files of its latest version.
/// Inputs are local paths or URLs (`s3://bucket/prefix/*.parquet`).
///
/// # Errors
/// An empty list, a path that does not exist, a directory, prefix or glob with no data
/// files, or a store that cannot be listed.
pub fn expand_inputs(inputs: &[String], storage: &StorageOptions) -> Result<Vec<InputSource>> {
    if inputs.is_empty() {
        return Err(Error::NoInput(
            "give at least one file, directory or glob".to_owned(),
        ));
    }
    let mut files = Vec::new();
    for input in inputs {
        #[cfg(feature = "delta")]
        if let Some(found) = crate::read::delta::table_files(input, storage)? {
            files.extend(found);
            continue;
        }
        let found: Vec<InputSource> = match Location::parse(input, storage)? {
            Location::Local(path) => expand_local(input, &path)?
                .into_iter()
                .map(InputSource::Local)
                .collect(),
            Location::Remote(remote) => remote
                .expand(is_data_file)?
                .into_iter()
                .map(InputSource::Remote)
                .collect(),
        };
        if found.is_empty() {
            return Err(Error::NoInput(format!(
                "'{input}' holds no Parquet or Arrow IPC file"
            )));
        }
        files.extend(found);
    }
    Ok(files)
}

fn expand_local(input: &str, path: &Path) -> Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    if path.is_dir() {
        walk(path, &mut found)?;
    } else if path.exists() {
        found.push(path.to_path_buf());
    } else if input.contains(['*', '?', '[']) {
        let pattern = glob::glob(&path.to_string_lossy())
            .map_err(|e| Error::InvalidArgument(format!("bad glob '{input}': {e}")))?;
        for entry in pattern {
            let entry = entry.map_err(|e| Error::InvalidArgument(format!("{input}: {e}")))?;
            if entry.is_dir() {
                walk(&entry, &mut found)?;
            } else if is_data_file(&entry) && !is_hidden(&entry) {
                found.push(entry);
            }
        }
    } else {
        return Err(Error::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory"),
        });
    }
    found.sort();
    Ok(found)
}
