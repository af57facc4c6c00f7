//! Atomic Parquet output: everything is written under a temporary name beside the target
//! and renamed into place only when the whole job has succeeded.
//!
//! * A target ending in `.parquet` is one file: written as `.NAME.idem-tmp-PID`, then renamed
//!   over the target (atomic on POSIX file systems).
//! * Any other target is a directory of `part-NNNNN.parquet` files: written into the
//!   directory `.NAME.idem-tmp-PID`; an existing target is moved aside, the new one renamed
//!   into place, the old one removed. A crash can leave only a hidden temporary behind, never
//!   a half-written target.
//!
//! Dropping an [`OutputWriter`] without [`OutputWriter::commit`] removes the temporaries.
//!
//! A rename is only as durable as what it publishes: after a power loss, a file system may
//! keep the rename but not the file's data or size (ext4, XFS), and a reader then finds an
//! empty or truncated target where the job reported success. So the files are synced
//! before the rename, and the directory that holds the renamed entry after it: once
//! [`OutputWriter::commit`] returns, the output survives a crash of the machine.
//!
//! On object storage ([`OutputWriter::create`] with a URL) the files are written to a local
//! staging directory first and uploaded at commit:
//!
//! * one file is one upload, which the store makes visible only when it completes: readers
//!   see the previous object or the new one, never part of it;
//! * a directory's parts are uploaded under a hidden `_idem-staging-…/` prefix beside them,
//!   then copied into place by the store, the previous output's other objects deleted and the
//!   staging prefix removed. A failure before that last step leaves the previous output as it
//!   was; object stores have no multi-object transaction, so a reader listing the directory
//!   *during* it can see old and new parts together — write one file, or merge into a table,
//!   when readers must never see that.

use std::path::{Path, PathBuf};

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;

use super::by_field::{self, ColumnSource};
use super::chunk_settings::ChunkTuning;
use super::columns::ParallelWriter;
use super::direct::OutputFile;
use super::properties::{WRITE_CHUNK_ROWS, writer_properties};
use super::publish::{
    hidden_sibling, parent_directory, publish_parts, replace_directory, sync_directory, sync_file,
};
use crate::error::{Error, Result};
use crate::storage::{Location, RemoteLocation, StorageOptions};

/// Writes batches of one schema as zstd Parquet, atomically (see the module docs).
pub struct OutputWriter {
    target: PathBuf,
    temp: PathBuf,
    single_file: bool,
    schema: SchemaRef,
    max_rows_per_file: usize,
    writer: Option<ParallelWriter>,
    /// Rows not yet handed to the Parquet writer, fewer than [`WRITE_CHUNK_ROWS`].
    pending: Vec<RecordBatch>,
    pending_rows: usize,
    rows_in_part: usize,
    files: Vec<PathBuf>,
    created_dirs: Vec<PathBuf>,
    committed: bool,
    /// Where to upload at commit, when the target is on object storage.
    remote: Option<RemoteTarget>,
}

/// An object-storage target and the local directory its files are staged in.
struct RemoteTarget {
    location: RemoteLocation,
    /// Removed (with the files in it) when the upload is done or abandoned.
    _staging: tempfile::TempDir,
}

impl std::fmt::Debug for OutputWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutputWriter")
            .field("target", &self.target)
            .field("temp", &self.temp)
            .finish()
    }
}

impl OutputWriter {
    /// Prepares to write `target`, a local path or a URL (`s3://bucket/out.parquet`); see
    /// [`OutputWriter::try_new`] for the two kinds of target.
    ///
    /// # Errors
    /// As [`OutputWriter::try_new`], or a store that cannot be configured or asked.
    pub fn create(
        target: &str,
        schema: SchemaRef,
        max_rows_per_file: usize,
        storage: &StorageOptions,
    ) -> Result<Self> {
        let location = match Location::parse(target, storage)? {
            Location::Local(path) => return Self::try_new(&path, schema, max_rows_per_file),
            Location::Remote(location) => location,
        };
        let name = location.file_name().ok_or_else(|| {
            Error::InvalidArgument(format!("output '{target}' has no file or directory name"))
        })?;
        let staging = tempfile::Builder::new()
            .prefix("idem-upload-")
            .tempdir()
            .map_err(Error::io(std::env::temp_dir()))?;
        let mut writer = Self::try_new(&staging.path().join(name), schema, max_rows_per_file)?;
        if !writer.single_file && location.is_object()? {
            return Err(Error::InvalidArgument(format!(
                "output '{target}' is an existing object; a directory output needs a prefix \
                 (or name the output *.parquet for one file)"
            )));
        }
        writer.remote = Some(RemoteTarget {
            location,
            _staging: staging,
        });
        Ok(writer)
    }

    /// Prepares to write `target` (a `.parquet` file, or else a directory of parts).
    ///
    /// # Errors
    /// The parent directory cannot be created, or the target is an existing path of the
    /// other kind (a directory where a file is asked for, or the reverse).
    pub fn try_new(target: &Path, schema: SchemaRef, max_rows_per_file: usize) -> Result<Self> {
        let single_file = target
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| e.eq_ignore_ascii_case("parquet"));
        if single_file && target.is_dir() {
            return Err(Error::InvalidArgument(format!(
                "output '{}' ends in .parquet but is a directory",
                target.display()
            )));
        }
        if !single_file && target.is_file() {
            return Err(Error::InvalidArgument(format!(
                "output '{}' is an existing file; a directory output needs a directory path \
                 (or name the output *.parquet for one file)",
                target.display()
            )));
        }
        let mut created_dirs = Vec::new();
        let parent = target
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let mut missing = Vec::new();
        let mut dir = Some(parent);
        while let Some(d) = dir.filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
            missing.push(d.to_path_buf());
            dir = d.parent();
        }
        for d in missing.into_iter().rev() {
            std::fs::create_dir(&d).map_err(Error::io(&d))?;
            created_dirs.push(d);
        }
        let temp = hidden_sibling(target, "tmp")?;
        let mut writer = Self {
            target: target.to_path_buf(),
            temp,
            single_file,
            schema,
            max_rows_per_file: max_rows_per_file.max(1),
            writer: None,
            pending: Vec::new(),
            pending_rows: 0,
            rows_in_part: 0,
            files: Vec::new(),
            created_dirs,
            committed: false,
            remote: None,
        };
        if !single_file {
            std::fs::create_dir(&writer.temp).map_err(Error::io(&writer.temp))?;
        }
        writer.open_part()?;
        Ok(writer)
    }

    /// The path of the next part file.
    fn next_part(&self) -> PathBuf {
        if self.single_file {
            self.temp.clone()
        } else {
            self.temp
                .join(format!("part-{:05}.parquet", self.files.len()))
        }
    }

    fn open_part(&mut self) -> Result<()> {
        let path = self.next_part();
        let file = OutputFile::create(&path).map_err(Error::io(&path))?;
        let writer = writer_properties(&self.schema)
            .and_then(|properties| {
                ParallelWriter::try_new(
                    file,
                    SchemaRef::clone(&self.schema),
                    properties,
                    ChunkTuning::Adaptive,
                )
            })
            .map_err(Error::parquet(&path))?;
        self.writer = Some(writer);
        self.files.push(path);
        self.rows_in_part = 0;
        Ok(())
    }

    fn close_part(&mut self) -> Result<()> {
        if let Some(writer) = self.writer.take() {
            let path = self.files.last().cloned().unwrap_or_default();
            writer.close().map_err(Error::parquet(&path))?;
        }
        Ok(())
    }

    /// Appends rows, starting a new part file when the current one is full.
    pub fn write(&mut self, batch: &RecordBatch) -> Result<()> {
        let mut offset = 0;
        while offset < batch.num_rows() {
            let take = (WRITE_CHUNK_ROWS - self.pending_rows).min(batch.num_rows() - offset);
            self.pending.push(batch.slice(offset, take));
            self.pending_rows += take;
            offset += take;
            if self.pending_rows == WRITE_CHUNK_ROWS {
                self.write_pending()?;
            }
        }
        Ok(())
    }

    /// Writes every row of `source` column by column (see [`super::by_field`]), into the
    /// same files, row groups and bytes as [`Self::write`] would, and tells `written` of
    /// every row group done. Only for a writer nothing was written to.
    pub(crate) fn write_columnwise(
        &mut self,
        source: &mut dyn ColumnSource,
        written: &mut dyn FnMut(u64),
    ) -> Result<()> {
        if self.rows_in_part > 0 || self.pending_rows > 0 || self.files.len() != 1 {
            return Err(Error::InvalidArgument(
                "column-by-column writing of an output already written to".to_owned(),
            ));
        }
        // The row-wise writer of the first part goes: its file is written again from the
        // start.
        drop(self.writer.take());
        let max_rows = if self.single_file {
            u64::MAX
        } else {
            self.max_rows_per_file as u64
        };
        let mut first_row = 0;
        loop {
            let path = self.files.last().cloned().unwrap_or_default();
            let rows = by_field::write_part(
                &path,
                &self.schema,
                writer_properties(&self.schema).map_err(Error::parquet(&path))?,
                first_row,
                max_rows,
                source,
                written,
            )?;
            first_row += rows;
            self.rows_in_part = usize::try_from(rows).unwrap_or(usize::MAX);
            if rows < max_rows || source.prepare(first_row..first_row + 1)? == first_row {
                return Ok(());
            }
            self.files.push(self.next_part());
        }
    }

    /// Hands the pending rows to the Parquet writer as one batch.
    fn write_pending(&mut self) -> Result<()> {
        let chunk = match self.pending.len() {
            0 => return Ok(()),
            1 => self.pending.remove(0),
            // In the pending rows' own layout (text as views, from a dedup), which the
            // Parquet writer takes as it takes the output schema's.
            _ => arrow::compute::concat_batches(&self.pending[0].schema(), &self.pending)
                .map_err(Error::arrow(self.files.last().cloned().unwrap_or_default()))?,
        };
        self.pending.clear();
        self.pending_rows = 0;
        self.write_rows(&chunk)
    }

    fn write_rows(&mut self, batch: &RecordBatch) -> Result<()> {
        let mut offset = 0;
        while offset < batch.num_rows() {
            if !self.single_file && self.rows_in_part >= self.max_rows_per_file {
                self.close_part()?;
                self.open_part()?;
            }
            let room = if self.single_file {
                usize::MAX
            } else {
                self.max_rows_per_file - self.rows_in_part
            };
            let take = room.min(batch.num_rows() - offset);
            let path = self.files.last().cloned().unwrap_or_default();
            if let Some(writer) = self.writer.as_mut() {
                writer
                    .write(&batch.slice(offset, take))
                    .map_err(Error::parquet(&path))?;
            }
            self.rows_in_part += take;
            offset += take;
        }
        Ok(())
    }

    /// Finishes the files and moves them into place (uploads them, for a URL target).
    /// Returns the final file paths (URLs as paths).
    pub fn commit(mut self) -> Result<Vec<PathBuf>> {
        let remote = self.remote.take();
        let single_file = self.single_file;
        let files = self.commit_local()?;
        match remote {
            None => Ok(files),
            Some(remote) => publish(&remote, &files, single_file),
        }
    }

    fn commit_local(mut self) -> Result<Vec<PathBuf>> {
        self.write_pending()?;
        self.close_part()?;
        if self.single_file {
            sync_file(&self.temp)?;
            std::fs::rename(&self.temp, &self.target).map_err(Error::io(&self.target))?;
            self.committed = true;
            sync_directory(&parent_directory(&self.target))?;
            return Ok(vec![self.target.clone()]);
        }
        replace_directory(&self.temp, &self.target)?;
        self.committed = true;
        Ok(self
            .files
            .iter()
            .filter_map(|f| f.file_name().map(|n| self.target.join(n)))
            .collect())
    }
}

/// Uploads committed local files to the remote target (see the module docs).
fn publish(remote: &RemoteTarget, files: &[PathBuf], single_file: bool) -> Result<Vec<PathBuf>> {
    let target = &remote.location;
    match files {
        // The same rule as a local target: a name ending in .parquet (any case) is one file.
        [file] if single_file => {
            target.upload(file)?;
            Ok(vec![target.display_path()])
        }
        _ => publish_parts(target, files),
    }
}

impl Drop for OutputWriter {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        drop(self.writer.take());
        if self.single_file {
            let _ = std::fs::remove_file(&self.temp);
        } else {
            let _ = std::fs::remove_dir_all(&self.temp);
        }
        for dir in self.created_dirs.iter().rev() {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::sync::Arc;

    use arrow::array::{Array, ArrayRef, Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field};
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

    use super::*;
    use arrow::datatypes::Schema;
    use parquet::basic::Encoding;

    /// Unique integers and text fill their dictionaries and fall back to the delta
    /// encodings; a column of six values keeps its dictionary; every value reads back.
    #[test]
    fn full_dictionaries_fall_back_to_delta_encodings_and_values_read_back() {
        let rows = 200_000_i64;
        let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(
            (0..rows).map(|i| 1_000_000 + i * 3),
        ));
        let texts: ArrayRef = Arc::new(StringArray::from_iter_values(
            (0..rows).map(|i| format!("event-{i:08x}")),
        ));
        let statuses: ArrayRef =
            Arc::new(StringArray::from_iter_values((0..rows).map(|i| {
                ["new", "paid", "sent", "done", "lost", "back"][i as usize % 6]
            })));
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("text", DataType::Utf8, false),
            Field::new("status", DataType::Utf8, false),
        ]));
        let batch =
            RecordBatch::try_new(Arc::clone(&schema), vec![ids, texts, statuses]).expect("batch");
        let dir = tempfile::tempdir().expect("tempdir");
        let target = dir.path().join("out.parquet");
        let mut writer = OutputWriter::try_new(&target, schema, usize::MAX).expect("writer");
        writer.write(&batch).expect("write");
        writer.commit().expect("commit");

        let reader = ParquetRecordBatchReaderBuilder::try_new(File::open(&target).expect("open"))
            .expect("reader");
        for group in reader.metadata().row_groups() {
            let encodings = |column: usize| group.column(column).encodings().collect::<Vec<_>>();
            assert!(encodings(0).contains(&Encoding::DELTA_BINARY_PACKED));
            assert!(encodings(1).contains(&Encoding::DELTA_LENGTH_BYTE_ARRAY));
            assert!(!encodings(2).contains(&Encoding::DELTA_LENGTH_BYTE_ARRAY));
            assert!(encodings(2).contains(&Encoding::RLE_DICTIONARY));
        }
        let read: Vec<RecordBatch> = reader
            .build()
            .expect("build")
            .collect::<std::result::Result<_, _>>()
            .expect("read");
        let read = arrow::compute::concat_batches(&batch.schema(), &read).expect("concat");
        assert_eq!(read, batch);
        assert_eq!(read.column(0).len(), rows as usize);
    }

    /// The new directory's files replace the old ones, no temporary is left beside them,
    /// and a temporary that cannot be synced (here: gone) is an error naming it that
    /// leaves the target as it was.
    #[test]
    fn directories_are_synced_and_swapped_or_left_alone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (temp, target) = (dir.path().join(".new"), dir.path().join("out"));
        for (directory, name) in [(&temp, "part-00000.parquet"), (&target, "stale.parquet")] {
            std::fs::create_dir(directory).expect("mkdir");
            std::fs::write(directory.join(name), name).expect("write");
        }
        replace_directory(&temp, &target).expect("replace");
        let names = |directory: &Path| {
            let mut names: Vec<String> = std::fs::read_dir(directory)
                .expect("list")
                .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            names
        };
        assert_eq!(names(&target), ["part-00000.parquet"]);
        assert_eq!(names(dir.path()), ["out"]);

        let error = replace_directory(&temp, &target).expect_err("no temporary to publish");
        assert!(error.to_string().contains(".new"), "{error}");
        assert_eq!(names(&target), ["part-00000.parquet"]);
        let error = sync_file(&temp).expect_err("nothing to sync");
        assert!(error.to_string().contains(".new"), "{error}");
        assert_eq!(parent_directory(Path::new("out.parquet")), Path::new("."));
        assert_eq!(parent_directory(&target), dir.path());
    }
}
