//! A Parquet file writer that encodes and compresses its columns on two threads.
//!
//! Encoding and zstd compression of the output are most of a dedup's CPU time, and
//! `ArrowWriter` does them one column after another on the calling thread. This writer
//! makes the same calls — each batch's column into that column's writer, row groups closed
//! at the same rows — on two threads, so the file holds the same bytes as `ArrowWriter`
//! would write, only sooner. (With [`ChunkTuning::Adaptive`], each column chunk's
//! dictionary and codec follow what they did two row groups before: see
//! [`crate::write::chunk_settings`].)
//!
//! ```text
//!   write(batch) ──▶ batches in flight [n, n+1, …], in row groups g (ended), g+1 (open)
//!   either thread: the (row group, field) furthest behind encodes its next batch
//!                  (compute_leaves + ArrowColumnWriter::write), or closes its row group
//!                  at the row group's end; whoever closes the oldest row group's last
//!                  field appends the group to the file
//! ```
//!
//! No thread waits for the others after each batch, nor at a row group's end: a field that
//! costs more than the rest (free text beside integers: half of all the encoding in a 10M
//! dedup) falls behind while the other thread goes on with the cheap ones, and, as two row
//! groups are open at once, the costly field of one group and of the next are encoded at
//! the same time, one on each thread. With one group open, that field was one thread's
//! chain of work that the rest of the dedup waited on.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use arrow::array::{AsArray, RecordBatch};
use arrow::datatypes::{DataType, SchemaRef};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_writer::{ArrowColumnChunk, ArrowColumnWriter};
use parquet::errors::{ParquetError, Result};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::types::SchemaDescriptor;

use crate::write::bounds::{BoundsPlan, FieldWriter};
use crate::write::chunk_settings::{ChunkSettings, ChunkTuning};
use crate::write::direct::OutputFile;

/// Threads encoding columns besides the one calling [`ParallelWriter::write`], which hands
/// out batches and, while it would otherwise wait for room, encodes too.
const HELPER_THREADS: usize = 1;
/// Row groups being encoded at once: one per encoding thread, so that each thread can
/// take the costliest field of its own group. Each open group holds a set of column
/// writers and its compressed pages until it is appended...
const OPEN_GROUPS: usize = 2;
// A group's chunk settings come from the group two before it, which must be in the file
// when the group starts (see `chunk_settings`).
const _: () = assert!(OPEN_GROUPS <= 2);
/// ... so a group opens beside another only if that one was handed at most this many
/// bytes: rows of a few hundred bytes (a 10M dedup's group is ~22 MB) get both threads
/// on their costliest field, while a group of 2.5 KB rows (~330 MB) has the file to
/// itself: two of them cost 420 MB more peak memory for a fifth less time.
const SHARED_GROUP_BYTES: usize = 64 << 20;
/// Batches handed out and not yet encoded by every field: room for the costliest field to
/// lag a whole row group behind the others (128 Ki rows are 16 of the dedup's 8 Ki-row
/// write chunks), so that it is being encoded in two groups at once...
const BATCHES_IN_FLIGHT: usize = 36;
/// ... unless they hold this many bytes (one batch always goes). On a 10M dedup, where
/// 36 batches are ~50 MB, pass 2 took 4.50 s with ~22 batches in flight and 4.09–4.19 s
/// with 36 (medians of 5).
const BYTES_IN_FLIGHT: usize = 64 << 20;

/// The bytes `batch`'s rows occupy, counted for [`BYTES_IN_FLIGHT`]: a slice of a larger
/// batch (the output's chunks are slices of the filtered reads) counts only its own rows,
/// not the whole buffers it shares with its neighbours. Text and binary read as views
/// count the values they point to, which Arrow's slice size leaves out.
fn batch_bytes(batch: &RecordBatch) -> usize {
    batch
        .columns()
        .iter()
        .map(|column| {
            let own = column
                .to_data()
                .get_slice_memory_size()
                .unwrap_or_else(|_| column.get_array_memory_size());
            let pointed_to = match column.data_type() {
                DataType::Utf8View => column.as_string_view().total_buffer_bytes_used(),
                DataType::BinaryView => column.as_binary_view().total_buffer_bytes_used(),
                _ => 0,
            };
            own + pointed_to
        })
        .sum()
}

/// Writes record batches to one Parquet file, columns encoded in parallel.
pub(crate) struct ParallelWriter {
    shared: Arc<Shared>,
    /// The helper threads; joined at [`ParallelWriter::close`], stopped and joined on drop.
    helpers: Vec<JoinHandle<()>>,
    max_row_group_rows: usize,
    rows_in_group: usize,
    /// Whether the newest of [`Encoding::groups`] still takes batches.
    group_open: bool,
}

/// What the writing threads share.
struct Shared {
    schema: SchemaRef,
    /// The leaf columns of each top-level field, as indices into the file's columns.
    leaves: Vec<Range<usize>>,
    /// The fields whose statistics are computed here.
    bounds: BoundsPlan,
    state: Mutex<Encoding>,
    /// Signalled at every change of `state`: a batch handed out, a task done, the end.
    changed: Condvar,
    /// Taken by [`ParallelWriter::close`] to write the footer. Locked by the thread
    /// appending a row group, which takes it before it lets go of `state` (never the other
    /// way round), so that groups are appended in order.
    file: Mutex<Option<SerializedFileWriter<OutputFile>>>,
}

/// The encoding's progress, under [`Shared::state`]'s lock.
struct Encoding {
    /// Batches not yet encoded by every field, oldest first, numbered from `first_batch`,
    /// each with its [`batch_bytes`] (counted once, outside the lock).
    batches: VecDeque<(RecordBatch, usize)>,
    first_batch: u64,
    /// The memory of `batches`.
    batch_bytes: usize,
    /// Row groups not yet appended to the file, oldest first; at most [`OPEN_GROUPS`].
    groups: VecDeque<Group>,
    /// Row groups appended to the file, `groups[0]`'s number.
    groups_appended: u64,
    /// Chooses each row group's column settings, and learns from the chunks appended.
    settings: ChunkSettings,
    /// The first error a thread met, for [`ParallelWriter`] to return.
    error: Option<ParquetError>,
    /// Set on an error, or when the writer is dropped: the threads stop.
    stopped: bool,
    /// No more batches will come: the helpers end once nothing is left to do.
    finished: bool,
}

/// A row group being encoded.
struct Group {
    /// The number of the batch the group ends before, once it has ended.
    end: Option<u64>,
    /// The bytes of the batches handed out into it (see [`batch_bytes`]).
    bytes: usize,
    fields: Vec<FieldEncoder>,
}

/// One top-level field's writers in one row group, and how far they have got.
struct FieldEncoder {
    /// The field's writers; `None` while a thread has them, and once closed.
    writers: Option<FieldWriter>,
    /// The number of the next batch to encode.
    next_batch: u64,
    /// The closed column chunks, once the field has closed the group.
    chunks: Option<Vec<ArrowColumnChunk>>,
}

/// Work for a thread, taken from [`Encoding`] with the writers of a field of a row group
/// (numbered from the file's first).
enum Task {
    Encode(u64, usize, RecordBatch, FieldWriter),
    Close(u64, usize, FieldWriter),
}

/// A finished [`Task`], to put back into [`Encoding`].
enum Done {
    Encoded(u64, usize, FieldWriter),
    Closed(u64, usize, Vec<ArrowColumnChunk>),
}

impl ParallelWriter {
    /// A writer of `schema` into `file`, with `ArrowWriter`'s metadata (the Arrow schema
    /// in the footer) and `properties`, each column chunk's dictionary and codec chosen
    /// as `tuning` says.
    pub(crate) fn try_new(
        file: OutputFile,
        schema: SchemaRef,
        properties: WriterProperties,
        tuning: ChunkTuning,
    ) -> Result<Self> {
        let max_row_group_rows = properties
            .max_row_group_row_count()
            .unwrap_or(usize::MAX)
            .max(1);
        let bounds = BoundsPlan::new(&schema, &properties);
        let (file, _) = ArrowWriter::try_new(file, SchemaRef::clone(&schema), Some(properties))?
            .into_serialized_writer()?;
        let leaves = field_leaves(file.schema_descr(), &schema)?;
        let settings = ChunkSettings::new(tuning, &file, SchemaRef::clone(&schema));
        let shared = Arc::new(Shared {
            schema,
            leaves,
            bounds,
            state: Mutex::new(Encoding {
                batches: VecDeque::new(),
                first_batch: 0,
                batch_bytes: 0,
                groups: VecDeque::new(),
                groups_appended: 0,
                settings,
                error: None,
                stopped: false,
                finished: false,
            }),
            changed: Condvar::new(),
            file: Mutex::new(Some(file)),
        });
        let mut writer = Self {
            shared: Arc::clone(&shared),
            helpers: Vec::with_capacity(HELPER_THREADS),
            max_row_group_rows,
            rows_in_group: 0,
            group_open: false,
        };
        for _ in 0..HELPER_THREADS {
            let shared = Arc::clone(&shared);
            let helper = std::thread::Builder::new()
                .name("idem-encode".to_owned())
                .spawn(move || shared.help())?;
            writer.helpers.push(helper);
        }
        Ok(writer)
    }

    /// Appends `batch`, closing row groups at the row count the properties give.
    pub(crate) fn write(&mut self, batch: &RecordBatch) -> Result<()> {
        let mut offset = 0;
        while offset < batch.num_rows() {
            let take =
                (self.max_row_group_rows - self.rows_in_group).min(batch.num_rows() - offset);
            self.hand_out(batch.slice(offset, take))?;
            self.rows_in_group += take;
            offset += take;
            if self.rows_in_group == self.max_row_group_rows {
                self.end_row_group();
            }
        }
        Ok(())
    }

    /// Queues `batch` for encoding, once there is room for it in flight, in a new row
    /// group if the last one has ended.
    fn hand_out(&mut self, batch: RecordBatch) -> Result<()> {
        if !self.group_open {
            self.open_group()?;
        }
        let bytes = batch_bytes(&batch);
        let mut state = self.shared.work_until(|state| {
            state.batches.is_empty()
                || (state.batches.len() < BATCHES_IN_FLIGHT && state.batch_bytes < BYTES_IN_FLIGHT)
        })?;
        state.batch_bytes += bytes;
        if let Some(group) = state.groups.back_mut() {
            group.bytes += bytes;
        }
        state.batches.push_back((batch, bytes));
        drop(state);
        self.shared.changed.notify_all();
        Ok(())
    }

    /// Starts the next row group, with its own writers, once fewer than [`OPEN_GROUPS`]
    /// are being encoded and those are small enough to share the file with it.
    fn open_group(&mut self) -> Result<()> {
        let mut state = self.shared.work_until(|state| {
            state.groups.is_empty()
                || (state.groups.len() < OPEN_GROUPS
                    && state.groups.iter().all(|g| g.bytes <= SHARED_GROUP_BYTES))
        })?;
        // Neither changes before the group is in place: only this thread hands out
        // batches and opens groups, and appending a group moves one into the other.
        let index = state.groups_appended + state.groups.len() as u64;
        let first_batch = state.handed_out();
        let index = usize::try_from(index)
            .map_err(|_| ParquetError::General("too many row groups".to_owned()))?;
        // Under the lock: the settings learn from groups appended by any thread. At most
        // one group is being encoded now, so group `index - 2`, which they are chosen
        // from, is in the file. The writers are made after, without it.
        let group = state.settings.start_group(index);
        drop(state);
        let fields = split_by_field(
            group.column_writers()?,
            &self.shared.leaves,
            &self.shared.schema,
            &self.shared.bounds,
        )
        .into_iter()
        .map(|writers| FieldEncoder {
            writers: Some(writers),
            next_batch: first_batch,
            chunks: None,
        })
        .collect();
        self.shared.lock().groups.push_back(Group {
            end: None,
            bytes: 0,
            fields,
        });
        self.group_open = true;
        Ok(())
    }

    /// Ends the current row group after the batches handed out so far.
    fn end_row_group(&mut self) {
        let mut state = self.shared.lock();
        let end = state.handed_out();
        if let Some(group) = state.groups.back_mut() {
            group.end = Some(end);
        }
        drop(state);
        self.group_open = false;
        self.rows_in_group = 0;
        self.shared.changed.notify_all();
    }

    /// Writes the last row group and the footer.
    pub(crate) fn close(mut self) -> Result<()> {
        if self.rows_in_group > 0 {
            self.end_row_group();
        }
        self.shared.lock().finished = true;
        self.shared.changed.notify_all();
        drop(self.shared.work_until(|state| state.groups.is_empty())?);
        for helper in std::mem::take(&mut self.helpers) {
            helper
                .join()
                .map_err(|_| ParquetError::General("encoding thread panicked".into()))?;
        }
        let writer = self.shared.file().take();
        writer
            .ok_or_else(|| ParquetError::General("file already closed".to_owned()))?
            .into_inner()?
            .finish()?;
        Ok(())
    }
}

impl Drop for ParallelWriter {
    fn drop(&mut self) {
        if self.helpers.is_empty() {
            return;
        }
        self.shared.lock().stopped = true;
        self.shared.changed.notify_all();
        for helper in std::mem::take(&mut self.helpers) {
            // A panic was already turned into the writer's error.
            let _ = helper.join();
        }
    }
}

/// The leaf columns of each top-level field of `schema`, as ranges of `descriptor`'s
/// columns.
pub(crate) fn field_leaves(
    descriptor: &SchemaDescriptor,
    schema: &SchemaRef,
) -> Result<Vec<Range<usize>>> {
    // Parquet lists the leaves of one field together, fields in schema order.
    let mut leaves: Vec<Range<usize>> = Vec::with_capacity(schema.fields().len());
    for leaf in 0..descriptor.num_columns() {
        let root = descriptor.get_column_root_idx(leaf);
        let fields_seen = leaves.len();
        match leaves.last_mut() {
            Some(range) if root + 1 == fields_seen => range.end = leaf + 1,
            _ if root == fields_seen => leaves.push(leaf..leaf + 1),
            _ => {
                return Err(ParquetError::General(format!(
                    "leaf column {leaf} out of field order"
                )));
            }
        }
    }
    if leaves.len() != schema.fields().len() {
        return Err(ParquetError::General(format!(
            "{} fields with leaf columns, {} in the schema",
            leaves.len(),
            schema.fields().len()
        )));
    }
    Ok(leaves)
}

/// The writers of one row group (in file column order) grouped by top-level field of
/// `schema`, with the statistics `bounds` plans.
pub(crate) fn split_by_field(
    writers: Vec<ArrowColumnWriter>,
    leaves: &[Range<usize>],
    schema: &SchemaRef,
    bounds: &BoundsPlan,
) -> Vec<FieldWriter> {
    let mut writers = writers.into_iter();
    leaves
        .iter()
        .zip(schema.fields())
        .enumerate()
        .map(|(index, (range, field))| {
            bounds.field_writer(index, field, writers.by_ref().take(range.len()).collect())
        })
        .collect()
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Encoding> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn file(&self) -> MutexGuard<'_, Option<SerializedFileWriter<OutputFile>>> {
        self.file.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A helper thread: takes tasks until the writing is finished or stopped.
    fn help(&self) {
        let _stop_on_panic = StopOnPanic(self);
        let mut state = self.lock();
        while !state.stopped {
            state = match state.next_task() {
                Some(task) => self.run(state, task),
                None if state.finished => return,
                None => self
                    .changed
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner),
            };
        }
    }

    /// Takes tasks until `ready` holds, waiting when there are none; returns the first
    /// error any thread met as soon as there is one.
    fn work_until(&self, ready: impl Fn(&Encoding) -> bool) -> Result<MutexGuard<'_, Encoding>> {
        let mut state = self.lock();
        loop {
            if let Some(error) = state.error.take() {
                return Err(error);
            }
            if state.stopped {
                return Err(ParquetError::General("column encoding stopped".to_owned()));
            }
            if ready(&state) {
                return Ok(state);
            }
            state = match state.next_task() {
                Some(task) => self.run(state, task),
                None => self
                    .changed
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner),
            };
        }
    }

    /// Runs `task` without the lock, puts its result in place and, when it closed the last
    /// field of the oldest row group, appends that group to the file, and the next ones
    /// if they were done first.
    fn run<'a>(&'a self, state: MutexGuard<'a, Encoding>, task: Task) -> MutexGuard<'a, Encoding> {
        drop(state);
        let done = task.run(&self.schema);
        let mut state = self.lock();
        state.complete(done);
        while let Some(columns) = state.take_finished_group() {
            // The file first, then the state let go: a thread finishing the next group
            // waits for this one to be in the file.
            let mut file = self.file();
            drop(state);
            let appended = append(file.as_mut(), columns);
            drop(file);
            state = self.lock();
            if let Err(error) = appended {
                state.fail(error);
                break;
            }
        }
        self.changed.notify_all();
        state
    }
}

/// Appends a row group's column chunks to the file.
fn append(
    file: Option<&mut SerializedFileWriter<OutputFile>>,
    columns: Vec<ArrowColumnChunk>,
) -> Result<()> {
    let file = file.ok_or_else(|| ParquetError::General("file already closed".to_owned()))?;
    let mut row_group = file.next_row_group()?;
    for chunk in columns {
        chunk.append_to_row_group(&mut row_group)?;
    }
    row_group.close()?;
    Ok(())
}

/// Stops the writing when a helper thread panics, so that no thread waits for it.
struct StopOnPanic<'a>(&'a Shared);

impl Drop for StopOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0
                .lock()
                .fail(ParquetError::General("encoding thread panicked".into()));
            self.0.changed.notify_all();
        }
    }
}

impl Encoding {
    /// The number of the next batch to be handed out.
    fn handed_out(&self) -> u64 {
        self.first_batch + self.batches.len() as u64
    }

    /// The next task of the (row group, field) furthest behind that has one: closing the
    /// group when the field has encoded every batch of it, else encoding its next batch.
    fn next_task(&mut self) -> Option<Task> {
        let handed_out = self.handed_out();
        let mut best: Option<(usize, usize, bool)> = None;
        let mut best_batch = u64::MAX;
        for (group_index, group) in self.groups.iter().enumerate() {
            let available = group.end.unwrap_or(u64::MAX).min(handed_out);
            for (index, field) in group.fields.iter().enumerate() {
                // Strictly behind: at equal batches the older group, which closes, goes
                // first.
                if field.writers.is_none() || field.next_batch >= best_batch {
                    continue;
                }
                let closes = group.end == Some(field.next_batch);
                if closes || field.next_batch < available {
                    best = Some((group_index, index, closes));
                    best_batch = field.next_batch;
                }
            }
        }
        let (group_index, index, closes) = best?;
        let number = self.groups_appended + group_index as u64;
        let field = &mut self.groups.get_mut(group_index)?.fields[index];
        let writers = field.writers.take()?;
        if closes {
            return Some(Task::Close(number, index, writers));
        }
        let offset = usize::try_from(field.next_batch - self.first_batch).ok()?;
        let Some((batch, _)) = self.batches.get(offset).cloned() else {
            // Unreachable: the field's next batch was handed out. Put the writers back
            // rather than lose them.
            field.writers = Some(writers);
            return None;
        };
        Some(Task::Encode(number, index, batch, writers))
    }

    /// The field `index` of row group `number`, if that group is not yet appended.
    fn field_mut(&mut self, number: u64, index: usize) -> Option<&mut FieldEncoder> {
        let group = usize::try_from(number.checked_sub(self.groups_appended)?).ok()?;
        self.groups.get_mut(group)?.fields.get_mut(index)
    }

    /// Puts a finished task's result in place.
    fn complete(&mut self, done: Result<Done>) {
        match done {
            Ok(Done::Encoded(number, index, writers)) => {
                if let Some(field) = self.field_mut(number, index) {
                    field.writers = Some(writers);
                    field.next_batch += 1;
                }
                // Every batch belongs to a group not yet appended, so the furthest
                // behind of their fields says which batches everyone has encoded.
                let encoded_by_all = self
                    .groups
                    .iter()
                    .flat_map(|group| &group.fields)
                    .map(|field| field.next_batch)
                    .min()
                    .unwrap_or_else(|| self.handed_out());
                while self.first_batch < encoded_by_all {
                    let bytes = self.batches.pop_front().map(|(_, bytes)| bytes);
                    self.batch_bytes -= bytes.unwrap_or(0);
                    self.first_batch += 1;
                }
            }
            Ok(Done::Closed(number, index, chunks)) => {
                if let Some(field) = self.field_mut(number, index) {
                    field.chunks = Some(chunks);
                }
            }
            Err(error) => self.fail(error),
        }
    }

    /// The oldest row group's column chunks, in file order, if it has ended and every
    /// field has closed it.
    fn take_finished_group(&mut self) -> Option<Vec<ArrowColumnChunk>> {
        let oldest = self.groups.front()?;
        if oldest.end.is_none() || !oldest.fields.iter().all(|f| f.chunks.is_some()) {
            return None;
        }
        let oldest = self.groups.pop_front()?;
        let chunks: Vec<ArrowColumnChunk> = oldest
            .fields
            .into_iter()
            .filter_map(|field| field.chunks)
            .flatten()
            .collect();
        if let Ok(number) = usize::try_from(self.groups_appended) {
            for (leaf, chunk) in chunks.iter().enumerate() {
                self.settings.observe(number, leaf, chunk);
            }
        }
        self.groups_appended += 1;
        Some(chunks)
    }

    fn fail(&mut self, error: ParquetError) {
        self.error.get_or_insert(error);
        self.stopped = true;
    }
}

impl Task {
    fn run(self, schema: &SchemaRef) -> Result<Done> {
        match self {
            Task::Encode(number, index, batch, mut writers) => {
                writers.write(schema.field(index), batch.column(index))?;
                Ok(Done::Encoded(number, index, writers))
            }
            Task::Close(number, index, writers) => {
                Ok(Done::Closed(number, index, writers.close()?))
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::fs::File;
    use std::sync::Arc;

    use arrow::array::{ArrayRef, Int64Array, ListArray, StringArray, StructArray};
    use arrow::datatypes::{DataType, Field, Fields, Int64Type, Schema};

    use super::*;
    use crate::write::properties::writer_properties;

    pub(crate) fn batch(start: i64, rows: usize) -> RecordBatch {
        let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(start..start + rows as i64));
        let names: ArrayRef = Arc::new(StringArray::from_iter(
            (start..start + rows as i64)
                .map(|i| (i % 7 != 0).then(|| format!("name-{}", i % 1000))),
        ));
        let inner = Fields::from(vec![
            Field::new("a", DataType::Int64, true),
            Field::new("b", DataType::Utf8, true),
        ]);
        let nested: ArrayRef = Arc::new(StructArray::new(
            inner,
            vec![Arc::clone(&ids), Arc::clone(&names)],
            None,
        ));
        let lists: ArrayRef = Arc::new(ListArray::from_iter_primitive::<Int64Type, _, _>(
            (start..start + rows as i64).map(|i| Some(vec![Some(i); (i % 3) as usize])),
        ));
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("name", DataType::Utf8, true),
            Field::new("nested", nested.data_type().clone(), false),
            Field::new("list", lists.data_type().clone(), true),
        ]));
        RecordBatch::try_new(schema, vec![ids, names, nested, lists]).expect("batch")
    }

    /// The bytes `ArrowWriter` (serial) or `ParallelWriter` writes for `batches`.
    /// `properties` with the Parquet writer computing chunk statistics for the fields
    /// whose statistics idem computes.
    pub(crate) fn chunk_statistics_by_writer(
        properties: &WriterProperties,
        schema: &arrow::datatypes::Schema,
    ) -> WriterProperties {
        use parquet::file::properties::EnabledStatistics;
        crate::write::bounds::set_text_statistics(
            properties.clone().into_builder(),
            schema,
            EnabledStatistics::Chunk,
        )
        .build()
    }

    pub(crate) fn written(
        path: &std::path::Path,
        batches: &[RecordBatch],
        properties: WriterProperties,
        parallel: bool,
    ) -> Vec<u8> {
        let schema = batches[0].schema();
        if parallel {
            let file = OutputFile::create(path).expect("create");
            let mut writer =
                ParallelWriter::try_new(file, schema, properties, ChunkTuning::AsConfigured)
                    .expect("writer");
            for b in batches {
                writer.write(b).expect("write");
            }
            writer.close().expect("close");
        } else {
            let file = File::create(path).expect("create");
            let mut writer = ArrowWriter::try_new(file, schema, Some(properties)).expect("writer");
            for b in batches {
                writer.write(b).expect("write");
            }
            writer.close().expect("close");
        }
        std::fs::read(path).expect("read")
    }

    #[test]
    fn a_slice_counts_its_own_rows_in_flight() {
        let whole = batch(0, 40_000);
        let slice = whole.slice(10_000, 8192);
        let (whole_bytes, slice_bytes) = (batch_bytes(&whole), batch_bytes(&slice));
        // Shared buffers would count whole; the slice's own rows (about a fifth, with the
        // nested columns' buffers counted more coarsely) well under half.
        assert!(
            slice_bytes * 2 < whole_bytes,
            "{slice_bytes} of {whole_bytes}"
        );
        assert!(slice_bytes > 0);
        assert!(whole.get_array_memory_size() >= whole_bytes);
    }

    #[test]
    fn text_read_as_views_counts_the_values_it_points_to() {
        use arrow::array::StringViewArray;
        let long = "x".repeat(1000);
        let views: ArrayRef = Arc::new(StringViewArray::from_iter_values(
            (0..100).map(|i| if i % 2 == 0 { long.as_str() } else { "short" }),
        ));
        let batch = RecordBatch::try_from_iter([("text", views)]).expect("batch");
        // 100 views of 16 bytes, and the 50 long values; the short ones sit in their views.
        assert_eq!(batch_bytes(&batch), 100 * 16 + 50 * 1000);
        assert_eq!(batch_bytes(&batch.slice(0, 10)), 10 * 16 + 5 * 1000);
    }

    #[test]
    fn writes_the_bytes_arrow_writer_writes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let batches: Vec<RecordBatch> = (0..40).map(|i| batch(i * 9000, 9000)).collect();
        let path = dir.path().join("out.parquet");
        let schema = batches[0].schema();
        let properties = writer_properties(&schema).expect("properties");
        // The text column's statistics, computed here, are the ones `ArrowWriter` writes
        // when it computes them per chunk.
        let serial = written(
            &path,
            &batches,
            chunk_statistics_by_writer(&properties, &schema),
            false,
        );
        assert!(serial.len() > 100_000);
        assert_eq!(written(&path, &batches, properties, true), serial);
    }

    #[test]
    fn many_small_row_groups_come_out_as_arrow_writer_writes_them() {
        let dir = tempfile::tempdir().expect("tempdir");
        let batches: Vec<RecordBatch> = (0..60).map(|i| batch(i * 700, 700)).collect();
        // Row groups end inside batches and every few batches, so row group ends and
        // fields falling behind meet often.
        let properties = || {
            WriterProperties::builder()
                .set_max_row_group_row_count(Some(1000))
                .build()
        };
        let path = dir.path().join("out.parquet");
        let serial = written(&path, &batches, properties(), false);
        for round in 0..5 {
            let parallel = written(&path, &batches, properties(), true);
            assert_eq!(parallel, serial, "round {round}");
        }
    }

    #[test]
    fn a_costly_field_encoded_in_two_row_groups_at_once_keeps_the_groups_in_order() {
        // One long text field beside a cheap integer: the text of one group and of the
        // next are encoded on both threads at once, and either may finish first.
        let text = |start: usize, rows: usize| -> RecordBatch {
            let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(
                (start..start + rows).map(|i| i as i64),
            ));
            let words: ArrayRef = Arc::new(StringArray::from_iter_values(
                (start..start + rows).map(|i| format!("{i:x}-").repeat(40 + i % 23)),
            ));
            RecordBatch::try_from_iter([("id", ids), ("words", words)]).expect("batch")
        };
        let batches: Vec<RecordBatch> = (0..48).map(|i| text(i * 500, 500)).collect();
        let properties = || {
            WriterProperties::builder()
                .set_max_row_group_row_count(Some(1700))
                .build()
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("out.parquet");
        let serial = written(&path, &batches, properties(), false);
        for round in 0..8 {
            let parallel = written(&path, &batches, properties(), true);
            assert_eq!(parallel, serial, "round {round}");
        }
        let reader =
            parquet::file::reader::SerializedFileReader::new(File::open(&path).expect("open"))
                .expect("reader");
        use parquet::file::reader::FileReader;
        assert_eq!(
            reader.metadata().num_row_groups(),
            24_000usize.div_ceil(1700)
        );
    }

    /// A batch of `rows` rows from `start`: `noise`, integers a delta encoding cannot
    /// pack nor zstd shrink; `kind`, text of four values.
    pub(crate) fn noise_and_kinds(start: u64, rows: u64) -> RecordBatch {
        let noise: ArrayRef = Arc::new(Int64Array::from_iter_values(
            (start..start + rows).map(|i| splitmix64(i) as i64),
        ));
        let kinds: ArrayRef = Arc::new(StringArray::from_iter_values(
            (start..start + rows)
                .map(|i| ["created", "paid", "shipped", "refunded"][(i % 4) as usize]),
        ));
        RecordBatch::try_from_iter([("noise", noise), ("kind", kinds)]).expect("batch")
    }

    /// SplitMix64's output function: consecutive inputs give unrelated outputs.
    fn splitmix64(i: u64) -> u64 {
        let mut z = i.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Per row group, per column: (has a dictionary page, codec).
    pub(crate) fn chunk_layout(
        path: &std::path::Path,
    ) -> Vec<Vec<(bool, parquet::basic::Compression)>> {
        use parquet::file::reader::FileReader;
        let reader =
            parquet::file::reader::SerializedFileReader::new(File::open(path).expect("open"))
                .expect("reader");
        reader
            .metadata()
            .row_groups()
            .iter()
            .map(|group| {
                group
                    .columns()
                    .iter()
                    .map(|c| (c.dictionary_page_offset().is_some(), c.compression()))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn a_column_drops_the_dictionary_and_zstd_that_do_not_pay_and_keeps_those_that_do() {
        use parquet::basic::{Compression, ZstdLevel};
        let group_rows = 10_000;
        let batches: Vec<RecordBatch> = (0..8).map(|i| noise_and_kinds(i * 8192, 8192)).collect();
        let schema = batches[0].schema();
        let properties = writer_properties(&schema)
            .expect("properties")
            .into_builder()
            .set_max_row_group_row_count(Some(group_rows))
            .build();
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("out.parquet");
        let write = || {
            let file = OutputFile::create(&path).expect("create");
            let mut writer = ParallelWriter::try_new(
                file,
                Arc::clone(&schema),
                properties.clone(),
                ChunkTuning::Adaptive,
            )
            .expect("writer");
            for b in &batches {
                writer.write(b).expect("write");
            }
            writer.close().expect("close");
            std::fs::read(&path).expect("read")
        };
        let first = write();
        let zstd = Compression::ZSTD(ZstdLevel::default());
        let layout = chunk_layout(&path);
        assert_eq!(layout.len(), 7);
        for (group, columns) in layout.iter().enumerate() {
            let noise = match group {
                // As configured: the 64 KiB dictionary fills (10,000 distinct values).
                0 | 1 => (true, zstd),
                // Without the dictionary, zstd saves nothing on the deltas...
                2 | 3 => (false, zstd),
                // ... so they are stored as they are.
                _ => (false, Compression::UNCOMPRESSED),
            };
            assert_eq!(columns[0], noise, "noise, group {group}");
            assert_eq!(columns[1], (true, zstd), "kind, group {group}");
        }
        // The settings follow the rows, not the threads' timing: the same bytes again.
        for round in 0..3 {
            assert!(write() == first, "round {round}");
        }
        let read: Vec<RecordBatch> =
            parquet::arrow::arrow_reader::ParquetRecordBatchReader::try_new(
                File::open(&path).expect("open"),
                100_000,
            )
            .expect("reader")
            .collect::<std::result::Result<_, _>>()
            .expect("batches");
        assert_eq!(
            arrow::compute::concat_batches(&schema, &read).expect("concat"),
            arrow::compute::concat_batches(&schema, &batches).expect("concat")
        );
    }

    #[test]
    fn as_configured_every_chunk_keeps_the_properties_settings() {
        use parquet::basic::{Compression, ZstdLevel};
        let batches: Vec<RecordBatch> = (0..8).map(|i| noise_and_kinds(i * 8192, 8192)).collect();
        let schema = batches[0].schema();
        let properties = writer_properties(&schema)
            .expect("properties")
            .into_builder()
            .set_max_row_group_row_count(Some(10_000))
            .build();
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("out.parquet");
        let serial = written(
            &path,
            &batches,
            chunk_statistics_by_writer(&properties, &schema),
            false,
        );
        assert!(written(&path, &batches, properties, true) == serial);
        let zstd = Compression::ZSTD(ZstdLevel::default());
        for columns in chunk_layout(&path) {
            assert_eq!(columns, vec![(true, zstd), (true, zstd)]);
        }
    }

    #[test]
    fn a_writer_dropped_unclosed_stops_its_threads() {
        let dir = tempfile::tempdir().expect("tempdir");
        let b = batch(0, 5000);
        let mut writer = ParallelWriter::try_new(
            OutputFile::create(&dir.path().join("dropped.parquet")).expect("create"),
            b.schema(),
            writer_properties(&b.schema()).expect("properties"),
            ChunkTuning::Adaptive,
        )
        .expect("writer");
        writer.write(&b).expect("write");
        // Would hang here if the helper waited on for batches.
        drop(writer);
    }

    #[test]
    fn an_empty_file_has_the_schema_and_no_row_group() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("empty.parquet");
        let schema = batch(0, 1).schema();
        ParallelWriter::try_new(
            OutputFile::create(&path).expect("create"),
            Arc::clone(&schema),
            writer_properties(&schema).expect("properties"),
            ChunkTuning::Adaptive,
        )
        .expect("writer")
        .close()
        .expect("close");
        let reader =
            parquet::file::reader::SerializedFileReader::new(File::open(&path).expect("open"))
                .expect("reader");
        use parquet::file::reader::FileReader;
        assert_eq!(reader.metadata().num_row_groups(), 0);
        // id, name, nested.a, nested.b, list.element
        assert_eq!(
            reader
                .metadata()
                .file_metadata()
                .schema_descr()
                .num_columns(),
            5
        );
    }
}
