//! Pass 2 a column at a time, for wide schemas.
//!
//! The row-wise pass 2 reads whole rows and hands them to a writer that encodes every
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
//! same slices as from the row-wise [`OutputWriter`] (its [`WRITE_CHUNK_ROWS`] grid, cut at
//! row groups and part files), so the files are byte for byte the same.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use arrow::array::{Array, ArrayRef, BooleanArray, new_null_array};
use arrow::datatypes::{DataType, Schema, SchemaRef};
use idem_core::mix_value_hashes_at;
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_writer::ArrowColumnChunk;
use parquet::file::properties::WriterProperties;

use crate::bounds::{BoundsPlan, FieldWriter};
use crate::chunk_settings::{ChunkSettings, ChunkTuning};
use crate::columns::{field_leaves, split_by_field};
use crate::decide::Selection;
use crate::direct::OutputFile;
use crate::error::{Error, Result};
use crate::input::{InputFile, RowsToRead};
use crate::output::WRITE_CHUNK_ROWS;
use crate::schema::{conform, with_views};

/// Fields from which a dedup's pass 2 goes column by column. Below, whole rows cost little
/// memory and the row-wise pass keeps both cores busier.
pub(crate) const COLUMNWISE_FROM_FIELDS: usize = 32;

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

/// A dedup's winners, as a [`ColumnSource`]: output row `n` is the `n`-th kept row in
/// input order. Each file's plan is made when the output reaches the file and dropped once
/// it is past, so that only a file or two's are held.
///
/// The rows tied at a key's winning version are compared on the way, column by column:
/// each read of a field takes the tied rows with the kept ones, adds the hash of each tied
/// row's value (mixed with the field's number) to the row's sum, and once every field is
/// read, rows of one key with different sums differ in some column — what
/// [`idem_core::TieCheck`] finds from whole rows.
pub(crate) struct Winners<'a> {
    files: &'a [InputFile],
    schema: SchemaRef,
    /// Fields whose values are compared between tied rows: all but the key's.
    compared: Vec<bool>,
    selection: &'a mut Selection,
    /// The next file to plan, and the position of its first row.
    next_file: usize,
    next_position: u64,
    /// Planned files, in input order.
    planned: VecDeque<PlannedFile>,
    /// Output rows of every file planned so far.
    planned_rows: u64,
    kept_per_file: Vec<u64>,
    /// The slices of the planned files that the output rows last prepared own.
    current: Vec<FileSlice>,
    /// The tie group of every tied row planned so far, by tie number.
    tie_groups: Vec<u32>,
    /// Every tied row's sum of value hashes, by tie number.
    tie_sums: Mutex<Vec<u128>>,
}

/// One file's plan: the rows pass 2 reads, in order.
struct PlannedFile {
    file: usize,
    /// The output row of the file's first kept row.
    first_row: u64,
    rows: Vec<u64>,
    keep: Vec<bool>,
    /// The tie number of each row, [`NOT_TIED`] for none.
    tie: Vec<u32>,
    /// The index into `rows` of each kept row.
    kept_at: Vec<usize>,
}

/// No tie number.
const NOT_TIED: u32 = u32::MAX;

/// The rows of one file that a range of output rows owns: its kept rows, and the tied rows
/// among or just before them.
struct FileSlice {
    file: usize,
    rows: RowsToRead,
    /// Which of `rows` are kept; `None` when all are.
    keep: Option<BooleanArray>,
    /// (index into `rows`, tie number) of the tied rows, ascending.
    ties: Vec<(usize, u32)>,
}

impl PlannedFile {
    fn end_row(&self) -> u64 {
        self.first_row + self.kept_at.len() as u64
    }

    /// The indices into `rows` that output rows `rows` own: a row after `n` kept rows of
    /// the file belongs with output row `first_row + n`; with `last`, the rows after the
    /// last kept row belong to the range too.
    fn owned(&self, rows: &Range<u64>, last: bool) -> Range<usize> {
        // The index of the first row after `n` kept rows.
        let after = |n: u64| match usize::try_from(n).unwrap_or(usize::MAX) {
            0 => 0,
            n if n > self.kept_at.len() => self.rows.len(),
            n => self.kept_at[n - 1] + 1,
        };
        let start = after(rows.start.saturating_sub(self.first_row));
        let end = if last {
            self.rows.len()
        } else {
            after(rows.end.saturating_sub(self.first_row))
        };
        start..end.max(start)
    }
}

impl<'a> Winners<'a> {
    /// The winners of `files` (whose unified schema is `schema`) that `selection` keeps,
    /// `keys` the dedup's key columns.
    pub(crate) fn new(
        files: &'a [InputFile],
        schema: SchemaRef,
        keys: &[String],
        selection: &'a mut Selection,
    ) -> Self {
        Self {
            compared: schema
                .fields()
                .iter()
                .map(|f| !keys.contains(f.name()))
                .collect(),
            files,
            schema,
            selection,
            next_file: 0,
            next_position: 0,
            planned: VecDeque::new(),
            planned_rows: 0,
            kept_per_file: vec![0; files.len()],
            current: Vec::new(),
            tie_groups: Vec::new(),
            tie_sums: Mutex::new(Vec::new()),
        }
    }

    /// Plans the files not yet planned; returns the kept rows of each file and the number
    /// of tie groups whose rows differ (each tied row must have been read by then).
    pub(crate) fn finish(mut self) -> Result<(Vec<u64>, u64)> {
        while self.plan_next()? {}
        let sums = self
            .tie_sums
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        let groups = self.tie_groups.iter().max().map_or(0, |&g| g as usize + 1);
        let mut first: Vec<Option<u128>> = vec![None; groups];
        let mut conflicted = vec![false; groups];
        for (&group, &sum) in self.tie_groups.iter().zip(&sums) {
            let g = group as usize;
            match first[g] {
                None => first[g] = Some(sum),
                Some(seen) if seen != sum => conflicted[g] = true,
                Some(_) => {}
            }
        }
        let conflicts = conflicted.iter().filter(|&&c| c).count() as u64;
        Ok((self.kept_per_file, conflicts))
    }

    /// Plans the next file; false when every file is planned.
    fn plan_next(&mut self) -> Result<bool> {
        let Some(file) = self.files.get(self.next_file) else {
            return Ok(false);
        };
        let end = self.next_position + file.num_rows();
        let (rows, keep, groups) = self.selection.plan(self.next_position, end)?.into_parts();
        let kept_at: Vec<usize> = (0..rows.len()).filter(|&i| keep[i]).collect();
        self.kept_per_file[self.next_file] = kept_at.len() as u64;
        let tie = groups
            .iter()
            .map(|&group| {
                if group == u32::MAX {
                    return NOT_TIED;
                }
                self.tie_groups.push(group);
                (self.tie_groups.len() - 1) as u32
            })
            .collect();
        let tied = self.tie_groups.len();
        self.tie_sums
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .resize(tied, 0);
        if !rows.is_empty() {
            let first_row = self.planned_rows;
            self.planned_rows += kept_at.len() as u64;
            self.planned.push_back(PlannedFile {
                file: self.next_file,
                first_row,
                rows,
                keep,
                tie,
                kept_at,
            });
        }
        self.next_file += 1;
        self.next_position = end;
        Ok(true)
    }

    /// Adds the hashes of field `field`'s values at the tied rows of `slice` among its rows
    /// `read` (whose values are `values`) to the tied rows' sums.
    fn add_tie_hashes(
        &self,
        field: usize,
        slice: &FileSlice,
        read: Range<usize>,
        values: &ArrayRef,
    ) -> Result<()> {
        if !self.compared[field] {
            return Ok(());
        }
        let from = slice.ties.partition_point(|&(at, _)| at < read.start);
        let to = slice.ties.partition_point(|&(at, _)| at < read.end);
        if from == to {
            return Ok(());
        }
        let path = self.files[slice.file].path();
        let (at, ties): (Vec<u32>, Vec<u32>) = slice.ties[from..to]
            .iter()
            .map(|&(at, tie)| ((at - read.start) as u32, tie))
            .unzip();
        let mut hashes = vec![0u128; at.len()];
        mix_value_hashes_at(values.as_ref(), &at, &mut hashes).map_err(Error::arrow(path))?;
        // An odd multiplier per field: a bijection, so a field's differing values never
        // sum the same, and equal values in two fields do not cancel out.
        let weight = (u128::from(field as u64) << 1 | 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut sums = self.tie_sums.lock().unwrap_or_else(PoisonError::into_inner);
        for (tie, hash) in ties.into_iter().zip(hashes) {
            if let Some(sum) = sums.get_mut(tie as usize) {
                *sum = sum.wrapping_add(hash.wrapping_mul(weight));
            }
        }
        Ok(())
    }
}

impl ColumnSource for Winners<'_> {
    fn prepare(&mut self, rows: Range<u64>) -> Result<u64> {
        while self
            .planned
            .front()
            .is_some_and(|p| p.end_row() < rows.start)
        {
            self.planned.pop_front();
        }
        // Files whose first output row is the range's end are planned too: files of tied
        // rows only, right at the end, then belong to this range as its last.
        while self.planned_rows <= rows.end && self.plan_next()? {}
        let last = self.next_file == self.files.len() && self.planned_rows <= rows.end;
        let end = rows.end.min(self.planned_rows).max(rows.start);
        let owned = rows.start..end;
        self.current = if end == rows.start {
            Vec::new()
        } else {
            self.planned
                .iter()
                .filter_map(|p| {
                    let owned = p.owned(&owned, last);
                    let keep = &p.keep[owned.clone()];
                    (!owned.is_empty()).then(|| FileSlice {
                        file: p.file,
                        rows: self.files[p.file].rows_to_read(p.rows[owned.clone()].to_vec()),
                        keep: (!keep.iter().all(|&k| k)).then(|| BooleanArray::from(keep.to_vec())),
                        ties: owned
                            .clone()
                            .enumerate()
                            .filter(|&(_, i)| p.tie[i] != NOT_TIED)
                            .map(|(at, i)| (at, p.tie[i]))
                            .collect(),
                    })
                })
                .collect()
        };
        Ok(end)
    }

    fn fetch(&self, field: usize, rows: Range<u64>) -> Result<Vec<ArrayRef>> {
        let definition = self.schema.field(field);
        // Text as views, as row by row (see `with_views`).
        let target: SchemaRef = Arc::new(with_views(&Schema::new(vec![definition.clone()])));
        let mut arrays = Vec::new();
        for slice in &self.current {
            let file = &self.files[slice.file];
            let mut read = 0;
            let mut kept = |values: ArrayRef| -> Result<()> {
                let len = values.len();
                self.add_tie_hashes(field, slice, read..read + len, &values)?;
                arrays.push(match &slice.keep {
                    None => values,
                    Some(keep) => arrow::compute::filter(&values, &keep.slice(read, len))
                        .map_err(Error::arrow(file.path()))?,
                });
                read += len;
                Ok(())
            };
            match file.read_column(definition.name(), &slice.rows)? {
                Some(batches) => {
                    for batch in batches {
                        let batch = conform(&batch?, &target, false, file.path())?;
                        kept(Arc::clone(batch.column(0)))?;
                    }
                }
                None => kept(new_null_array(
                    target.field(0).data_type(),
                    slice.rows.len(),
                ))?,
            }
            if read != slice.rows.len() {
                return Err(Error::InvalidArgument(format!(
                    "{}: expected {} rows of column '{}', read {read}; was the file changed \
                     during the run?",
                    file.path().display(),
                    slice.rows.len(),
                    definition.name(),
                )));
            }
        }
        let fetched: usize = arrays.iter().map(|a| a.len()).sum();
        if fetched as u64 != rows.end - rows.start {
            return Err(Error::InvalidArgument(format!(
                "column '{}': {fetched} values for output rows {rows:?}",
                definition.name()
            )));
        }
        Ok(arrays)
    }
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
    use crate::chunk_settings::ChunkTuning;
    use crate::columns::ParallelWriter;
    use crate::columns::tests::{chunk_layout, noise_and_kinds};
    use crate::output::writer_properties;

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
