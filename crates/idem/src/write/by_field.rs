//! Writing a Parquet file a column at a time, for wide schemas: the values come from a
//! [`ColumnSource`] one field of one row group at a time (a dedup's winners, in
//! [`crate::dedup`]).
//!
//! A row-wise pass 2 reads whole rows and hands them to a writer that encodes every
//! column of the row group it builds, so every column's reader (its decoded dictionary, its
//! pages, a zstd decompression context) and every column's writer (its pages, a zstd
//! compression workspace) are alive at once: with 100 columns that is ~300 MB, whatever
//! the number of rows. Here each output row group is written one field after another:
//!
//! ```text
//!  for each output row group (the same rows as the row-wise writer's):
//!    two threads take the next field ──▶ its winners in the group's rows, read from the
//!                                        inputs with a row selection (that column only)
//!                                    ──▶ encoded and compressed into a column chunk
//!    this thread appends the chunks in field order, then closes the group
//! ```
//!
//! so only two fields' readers and writers are alive at a time. Each column writer gets the
//! same slices as from the row-wise [`super::OutputWriter`] (its [`WRITE_CHUNK_ROWS`] grid, cut at
//! row groups and part files), so the files are byte for byte the same.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use arrow::array::{Array, ArrayRef, new_null_array};
use arrow::datatypes::{DataType, SchemaRef};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_writer::ArrowColumnChunk;
use parquet::file::properties::WriterProperties;

use super::bounds::{BoundsPlan, FieldWriter};
use super::chunk_settings::{ChunkSettings, ChunkTuning};
use super::columns::{field_leaves, split_by_field};
use super::direct::OutputFile;
use super::properties::WRITE_CHUNK_ROWS;
use crate::error::{Error, Result};

/// Threads that read and encode fields.
const FIELD_THREADS: usize = 2;

/// Fields a thread may take beyond the first not yet appended: bounds the finished column
/// chunks waiting for a slower field before them.
const FIELDS_AHEAD: usize = 16;

/// Where the values of an output written column by column come from.
pub(crate) trait ColumnSource: Sync {
    /// Output rows from `rows.start` are next: loads what fetching them needs and returns
    /// the end of those that exist, at most `rows.end` (`rows.start`: no more rows).
    fn prepare(&mut self, rows: Range<u64>) -> Result<u64>;

    /// The values of field `field` of output rows `rows`, which [`Self::prepare`] covered,
    /// in order: `rows.end - rows.start` values in all, in arrays of any lengths.
    fn fetch(&self, field: usize, rows: Range<u64>) -> Result<Vec<ArrayRef>>;
}

/// Writes output rows from `first_row` on, up to `max_rows` of them, into a new Parquet file
/// at `path`, one row group after another and in each one field after another. Returns the
/// rows written.
pub(crate) fn write_part(
    path: &Path,
    schema: &SchemaRef,
    properties: WriterProperties,
    first_row: u64,
    max_rows: u64,
    source: &mut dyn ColumnSource,
    written: &mut dyn FnMut(u64),
) -> Result<u64> {
    let group_rows = properties
        .max_row_group_row_count()
        .unwrap_or(usize::MAX)
        .max(1) as u64;
    let file = OutputFile::create(path).map_err(Error::io(path))?;
    let bounds = BoundsPlan::new(schema, &properties);
    let (mut file, _) = ArrowWriter::try_new(file, Arc::clone(schema), Some(properties))
        .and_then(ArrowWriter::into_serialized_writer)
        .map_err(Error::parquet(path))?;
    let leaves = field_leaves(file.schema_descr(), schema).map_err(Error::parquet(path))?;
    // The row-wise writer's settings, so that the file is the same.
    let mut settings = ChunkSettings::new(ChunkTuning::Adaptive, &file, Arc::clone(schema));
    let last_row = first_row.saturating_add(max_rows);
    let mut start = first_row;
    let mut group = 0;
    while start < last_row {
        let end = source.prepare(start..(start.saturating_add(group_rows)).min(last_row))?;
        if end == start {
            break;
        }
        let writers = settings
            .start_group(group)
            .column_writers()
            .map_err(Error::parquet(path))?;
        let mut row_group = file.next_row_group().map_err(Error::parquet(path))?;
        let mut leaf = 0;
        encode_group(
            path,
            schema,
            split_by_field(writers, &leaves, schema, &bounds),
            start..end,
            &*source,
            &mut |chunks| {
                for chunk in chunks {
                    settings.observe(group, leaf, &chunk);
                    leaf += 1;
                    chunk
                        .append_to_row_group(&mut row_group)
                        .map_err(Error::parquet(path))?;
                }
                Ok(())
            },
        )?;
        row_group.close().map_err(Error::parquet(path))?;
        written(end - start);
        start = end;
        group += 1;
    }
    file.into_inner()
        .map_err(Error::parquet(path))?
        .finish()
        .map_err(Error::io(path))?;
    Ok(start - first_row)
}

/// The fields of one row group waiting to be taken, and how far the appending has got.
struct FieldQueue {
    writers: VecDeque<FieldWriter>,
    /// The number of the field `writers` starts with.
    next: usize,
    appended: usize,
    stopped: bool,
}

/// Encodes output rows `rows` of every field on [`FIELD_THREADS`] threads and passes each
/// field's column chunks to `append`, in field order.
fn encode_group(
    path: &Path,
    schema: &SchemaRef,
    writers: Vec<FieldWriter>,
    rows: Range<u64>,
    source: &dyn ColumnSource,
    append: &mut dyn FnMut(Vec<ArrowColumnChunk>) -> Result<()>,
) -> Result<()> {
    let fields = writers.len();
    let queue = Mutex::new(FieldQueue {
        writers: writers.into(),
        next: 0,
        appended: 0,
        stopped: false,
    });
    let changed = Condvar::new();
    let lock = || queue.lock().unwrap_or_else(PoisonError::into_inner);
    std::thread::scope(|scope| {
        let (sender, receiver) = std::sync::mpsc::channel();
        for _ in 0..FIELD_THREADS {
            let sender = sender.clone();
            let rows = rows.clone();
            let (changed, lock) = (&changed, &lock);
            scope.spawn(move || {
                while let Some((field, writers)) = take_field(lock(), changed) {
                    let encoded = encode_field(path, schema, field, writers, rows.clone(), source);
                    let failed = encoded.is_err();
                    if sender.send(encoded.map(|chunks| (field, chunks))).is_err() || failed {
                        return;
                    }
                }
            });
        }
        drop(sender);
        let mut waiting = BTreeMap::new();
        let mut appended = 0;
        let outcome: Result<()> = receiver.iter().try_for_each(|encoded| {
            let (field, chunks) = encoded?;
            waiting.insert(field, chunks);
            while let Some(chunks) = waiting.remove(&appended) {
                append(chunks)?;
                appended += 1;
                lock().appended = appended;
                changed.notify_all();
            }
            Ok(())
        });
        if outcome.is_err() || appended < fields {
            lock().stopped = true;
            changed.notify_all();
        }
        outcome?;
        if appended < fields {
            return Err(Error::InvalidArgument(format!(
                "{}: {} of {fields} columns encoded",
                path.display(),
                appended
            )));
        }
        Ok(())
    })
}

/// The next field to encode, once it is within [`FIELDS_AHEAD`] of the appending; `None`
/// when none is left or the group was stopped.
fn take_field(
    mut queue: MutexGuard<'_, FieldQueue>,
    changed: &Condvar,
) -> Option<(usize, FieldWriter)> {
    loop {
        if queue.stopped {
            return None;
        }
        if queue.next < queue.appended + FIELDS_AHEAD {
            let writers = queue.writers.pop_front()?;
            queue.next += 1;
            return Some((queue.next - 1, writers));
        }
        queue = changed.wait(queue).unwrap_or_else(PoisonError::into_inner);
    }
}

/// Reads field `field` of output rows `rows` and encodes it, cut at the row-wise writer's
/// [`WRITE_CHUNK_ROWS`] grid, into column chunks.
fn encode_field(
    path: &Path,
    schema: &SchemaRef,
    field: usize,
    mut writers: FieldWriter,
    rows: Range<u64>,
    source: &dyn ColumnSource,
) -> Result<Vec<ArrowColumnChunk>> {
    let definition = schema.field(field);
    let grid = WRITE_CHUNK_ROWS as u64;
    let mut row = rows.start;
    let mut pieces: Vec<ArrayRef> = Vec::new();
    for array in source.fetch(field, rows.clone())? {
        let mut offset = 0;
        while offset < array.len() {
            let piece_end = ((row / grid + 1) * grid).min(rows.end);
            let take = usize::try_from(piece_end - row)
                .unwrap_or(usize::MAX)
                .min(array.len() - offset);
            pieces.push(array.slice(offset, take));
            offset += take;
            row += take as u64;
            if row == piece_end {
                let piece = concat_arrays(&pieces, definition.data_type(), path)?;
                pieces.clear();
                writers
                    .write(definition, &piece)
                    .map_err(Error::parquet(path))?;
            }
        }
    }
    if row != rows.end {
        return Err(Error::InvalidArgument(format!(
            "{}: column '{}' had {} of the {} values of rows {rows:?}",
            path.display(),
            definition.name(),
            row - rows.start,
            rows.end - rows.start
        )));
    }
    writers.close().map_err(Error::parquet(path))
}

/// `parts` as one array.
fn concat_arrays(parts: &[ArrayRef], data_type: &DataType, path: &Path) -> Result<ArrayRef> {
    match parts {
        [] => Ok(new_null_array(data_type, 0)),
        [one] => Ok(Arc::clone(one)),
        _ => {
            let parts: Vec<&dyn Array> = parts.iter().map(AsRef::as_ref).collect();
            arrow::compute::concat(&parts).map_err(Error::arrow(path))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{ArrayRef, RecordBatch};
    use arrow::compute::concat_batches;
    use parquet::file::properties::WriterProperties;

    use super::*;
    use crate::write::columns::ParallelWriter;
    use crate::write::columns::tests::{chunk_layout, noise_and_kinds};
    use crate::write::properties::writer_properties;

    /// The rows of one batch, served a field at a time.
    struct InMemory(RecordBatch);

    impl ColumnSource for InMemory {
        fn prepare(&mut self, rows: Range<u64>) -> Result<u64> {
            Ok(rows.end.min(self.0.num_rows() as u64))
        }

        fn fetch(&self, field: usize, rows: Range<u64>) -> Result<Vec<ArrayRef>> {
            let start = rows.start as usize;
            Ok(vec![
                self.0
                    .column(field)
                    .slice(start, (rows.end - rows.start) as usize),
            ])
        }
    }

    #[test]
    fn many_row_groups_with_adapted_chunks_come_out_as_the_row_wise_writer_writes_them() {
        let batches: Vec<RecordBatch> = (0..14)
            .map(|i| noise_and_kinds(i * WRITE_CHUNK_ROWS as u64, WRITE_CHUNK_ROWS as u64))
            .collect();
        let schema = batches[0].schema();
        // Two write chunks a group: seven groups, the later ones without the noise's
        // dictionary and then without its zstd.
        let properties = || -> WriterProperties {
            writer_properties(&schema)
                .expect("properties")
                .into_builder()
                .set_max_row_group_row_count(Some(2 * WRITE_CHUNK_ROWS))
                .build()
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let row_wise = dir.path().join("rows.parquet");
        let mut writer = ParallelWriter::try_new(
            OutputFile::create(&row_wise).expect("create"),
            Arc::clone(&schema),
            properties(),
            ChunkTuning::Adaptive,
        )
        .expect("writer");
        for batch in &batches {
            writer.write(batch).expect("write");
        }
        writer.close().expect("close");

        let column_wise = dir.path().join("columns.parquet");
        let mut source = InMemory(concat_batches(&schema, &batches).expect("concat"));
        let rows = write_part(
            &column_wise,
            &schema,
            properties(),
            0,
            u64::MAX,
            &mut source,
            &mut |_| {},
        )
        .expect("write part");
        assert_eq!(rows, 14 * WRITE_CHUNK_ROWS as u64);
        let read = |path: &Path| std::fs::read(path).expect("read");
        assert!(read(&row_wise) == read(&column_wise), "the same bytes");

        let layout = chunk_layout(&column_wise);
        assert_eq!(layout.len(), 7);
        let (_, codec) = layout[6][0];
        assert_eq!(codec, parquet::basic::Compression::UNCOMPRESSED);
    }
}
