//! Publishing written files atomically: renames over local targets with the syncs that
//! make them durable, and the staged copy of a directory's parts on object storage (see
//! [`super::output`] for what readers can see when).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::storage::RemoteLocation;

/// A hidden name beside `target` for this process: `.NAME.idem-TAG-PID`.
pub(crate) fn hidden_sibling(target: &Path, tag: &str) -> Result<PathBuf> {
    let name = target.file_name().and_then(|n| n.to_str()).ok_or_else(|| {
        Error::InvalidArgument(format!("output '{}' has no file name", target.display()))
    })?;
    Ok(target.with_file_name(format!(".{name}.idem-{tag}-{}", std::process::id())))
}

/// Puts the directory `temp` in place of `target`: an existing target is moved aside, the
/// new one renamed into place, the old one removed. The files of `temp` and its entries are
/// synced first, and the rename after (see the module docs).
pub(crate) fn replace_directory(temp: &Path, target: &Path) -> Result<()> {
    for entry in std::fs::read_dir(temp).map_err(Error::io(temp))? {
        let path = entry.map_err(Error::io(temp))?.path();
        if path.is_file() {
            sync_file(&path)?;
        }
    }
    sync_directory(temp)?;
    if target.exists() {
        let old = hidden_sibling(target, "old")?;
        std::fs::rename(target, &old).map_err(Error::io(target))?;
        if let Err(e) = std::fs::rename(temp, target) {
            // Put the previous output back rather than leave none.
            let _ = std::fs::rename(&old, target);
            return Err(Error::io(target)(e));
        }
        sync_directory(&parent_directory(target))?;
        std::fs::remove_dir_all(&old).map_err(Error::io(&old))
    } else {
        std::fs::rename(temp, target).map_err(Error::io(target))?;
        sync_directory(&parent_directory(target))
    }
}

/// Makes a written file's bytes and size durable.
pub(crate) fn sync_file(path: &Path) -> Result<()> {
    std::fs::File::open(path)
        .and_then(|file| file.sync_all())
        .map_err(Error::io(path))
}

/// Makes the entries of a directory (files created in it, renames into it) durable. Only
/// POSIX systems sync a directory through a handle; elsewhere this does nothing.
pub(crate) fn sync_directory(path: &Path) -> Result<()> {
    if cfg!(unix) {
        sync_file(path)?;
    }
    Ok(())
}

/// The directory holding `path` (the current one for a bare name).
pub(crate) fn parent_directory(path: &Path) -> PathBuf {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Uploads a directory output's parts under a staging prefix, then publishes them.
pub(crate) fn publish_parts(target: &RemoteLocation, files: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let staging = staging_prefix(target);
    let mut staged = Vec::new();
    for file in files {
        let uploaded = file
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| Error::InvalidArgument(format!("bad part {}", file.display())))
            .and_then(|name| {
                let object = staging.join(name);
                object.upload(file)?;
                Ok((name.to_owned(), object))
            });
        match uploaded {
            Ok(part) => staged.push(part),
            Err(e) => {
                // Best effort: the staging prefix is hidden from readers either way.
                for (_, object) in &staged {
                    let _ = object.delete();
                }
                return Err(e);
            }
        }
    }
    publish_staged(target, &staged)
}

/// A new hidden prefix under `target` to stage a directory output's objects in.
pub(crate) fn staging_prefix(target: &RemoteLocation) -> RemoteLocation {
    target.join(&format!(
        "_idem-staging-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ))
}

/// Copies objects staged under a hidden prefix of `target` into place under their names,
/// deletes the previous output's other objects, then the staged copies.
pub(crate) fn publish_staged(
    target: &RemoteLocation,
    staged: &[(String, RemoteLocation)],
) -> Result<Vec<PathBuf>> {
    let previous = target.objects_below()?;
    let mut published = Vec::new();
    for (name, object) in staged {
        let destination = target.join(name);
        object.copy_to(&destination)?;
        published.push(destination);
    }
    let kept: Vec<String> = published.iter().map(RemoteLocation::url).collect();
    for old in previous {
        if !kept.contains(&old.url()) {
            old.delete()?;
        }
    }
    for (_, object) in staged {
        object.delete()?;
    }
    Ok(published.iter().map(RemoteLocation::display_path).collect())
}

/// Replaces the local file `path` with `contents` atomically: written to a hidden
/// temporary beside it, then renamed, so that a reader (node_exporter's textfile collector,
/// a browser) never sees half of it. `option` names the flag that gave the path.
///
/// # Errors
/// A path without a file name, or a directory that cannot be written.
pub(crate) fn replace_file(path: &Path, contents: &str, option: &str) -> Result<()> {
    let name = path.file_name().and_then(|n| n.to_str()).ok_or_else(|| {
        Error::InvalidArgument(format!("{option} '{}' has no file name", path.display()))
    })?;
    let temporary = path.with_file_name(format!(".{name}.idem-tmp-{}", std::process::id()));
    std::fs::write(&temporary, contents).map_err(Error::io(&temporary))?;
    sync_file(&temporary)
        .and_then(|()| std::fs::rename(&temporary, path).map_err(Error::io(path)))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&temporary);
        })?;
    sync_directory(&parent_directory(path))
}
