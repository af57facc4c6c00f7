//! A Parquet file writer that encodes and compresses its columns on two threads.
//!
//! Encoding and zstd compression of the output are most of a dedup's CPU time, and
//! `ArrowWriter` does them one column after another on the calling thread. This writer
//! makes the same calls — each batch's column into that column's writer, row groups closed
//! at the same rows — on two threads, so the file holds the same bytes as `ArrowWriter`
//! would write, only sooner.
//!
//! ```text
//!   write(batch) ──▶ batches in flight [n, n+1, …]
//!   either thread: the field furthest behind encodes its next batch
//!                  (compute_leaves + ArrowColumnWriter::write), or closes its row group
//!                  at the row group's end; whoever closes a row group's last field
//!                  appends the group to the file and makes the next group's writers
//! ```
//!
//! No thread waits for the others after each batch: a field that costs more than the rest
//! (UUID text beside integers) falls a few batches behind while the other thread goes on
//! with the cheap ones, so both cores stay busy alongside the reader that feeds `write`.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_writer::{
    ArrowColumnChunk, ArrowColumnWriter, ArrowRowGroupWriterFactory, compute_leaves,
};
use parquet::errors::{ParquetError, Result};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::types::SchemaDescriptor;

use crate::direct::OutputFile;

/// Threads encoding columns besides the one calling [`ParallelWriter::write`], which hands
/// out batches and, while it would otherwise wait for room, encodes too.
const HELPER_THREADS: usize = 1;
/// Batches handed out and not yet encoded by every field: room for one field to lag
/// behind the others...
const BATCHES_IN_FLIGHT: usize = 4;
/// ... unless they hold this many bytes (one batch always goes): with wide rows the lag
/// buys little, as there are enough columns to share out, and would cost memory.
const BYTES_IN_FLIGHT: usize = 8 << 20;

/// The bytes `batch`'s rows occupy, counted for [`BYTES_IN_FLIGHT`]: a slice of a larger
/// batch (the output's chunks are slices of the filtered reads) counts only its own rows,
/// not the whole buffers it shares with its neighbours.
fn batch_bytes(batch: &RecordBatch) -> usize {
    batch
        .columns()
        .iter()
        .map(|column| {
            column
                .to_data()
                .get_slice_memory_size()
                .unwrap_or_else(|_| column.get_array_memory_size())
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
}

/// What the writing threads share.
struct Shared {
    schema: SchemaRef,
    /// The leaf columns of each top-level field, as indices into the file's columns.
    leaves: Vec<Range<usize>>,
    state: Mutex<Encoding>,
    /// Signalled at every change of `state`: a batch handed out, a task done, the end.
    changed: Condvar,
    /// Locked by the thread appending a row group (they come one after another: the next
    /// group's writers are made only after it).
    file: Mutex<FileOutput>,
}

struct FileOutput {
    /// Taken by [`ParallelWriter::close`] to write the footer.
    writer: Option<SerializedFileWriter<OutputFile>>,
    factory: ArrowRowGroupWriterFactory,
}

/// The encoding's progress, under [`Shared::state`]'s lock.
struct Encoding {
    /// Batches not yet encoded by every field, oldest first, numbered from `first_batch`.
    batches: VecDeque<RecordBatch>,
    first_batch: u64,
    /// The memory of `batches`.
    batch_bytes: usize,
    fields: Vec<FieldEncoder>,
    /// Row groups not yet appended to the file, oldest first: the number of the batch
    /// each ends before, and each field's closed column chunks once it has closed them.
    groups: VecDeque<(u64, Vec<Option<Vec<ArrowColumnChunk>>>)>,
    /// Row groups appended to the file, `groups[0]`'s number.
    groups_appended: u64,
    /// The first error a thread met, for [`ParallelWriter`] to return.
    error: Option<ParquetError>,
    /// Set on an error, or when the writer is dropped: the threads stop.
    stopped: bool,
    /// No more batches will come: the helpers end once nothing is left to do.
    finished: bool,
}

/// One top-level field's writers and how far they have got.
struct FieldEncoder {
    /// The leaf writers of the field's current row group; `None` while a thread has them,
    /// and from the field's closing a row group until the group is in the file and the
    /// next group's writers are made (one set of writers at a time: each holds a zstd
    /// context).
    writers: Option<Vec<ArrowColumnWriter>>,
    /// The number of the next batch to encode.
    next_batch: u64,
    /// Row groups this field has closed.
    groups_closed: u64,
}

/// Work for a thread, taken from [`Encoding`] with the field's writers.
enum Task {
    Encode(usize, RecordBatch, Vec<ArrowColumnWriter>),
    Close(usize, Vec<ArrowColumnWriter>),
}

/// A finished [`Task`], to put back into [`Encoding`].
enum Done {
    Encoded(usize, Vec<ArrowColumnWriter>),
    Closed(usize, Vec<ArrowColumnChunk>),
}

impl ParallelWriter {
    /// A writer of `schema` into `file`, with `ArrowWriter`'s metadata (the Arrow schema
    /// in the footer) and `properties`.
    pub(crate) fn try_new(
        file: OutputFile,
        schema: SchemaRef,
        properties: WriterProperties,
    ) -> Result<Self> {
        let max_row_group_rows = properties
            .max_row_group_row_count()
            .unwrap_or(usize::MAX)
            .max(1);
        let (file, factory) =
            ArrowWriter::try_new(file, SchemaRef::clone(&schema), Some(properties))?
                .into_serialized_writer()?;
        let leaves = field_leaves(file.schema_descr(), &schema)?;
        let fields = split_by_field(factory.create_column_writers(0)?, &leaves)
            .into_iter()
            .map(|writers| FieldEncoder {
                writers: Some(writers),
                next_batch: 0,
                groups_closed: 0,
            })
            .collect();
        let shared = Arc::new(Shared {
            schema,
            leaves,
            state: Mutex::new(Encoding {
                batches: VecDeque::new(),
                first_batch: 0,
                batch_bytes: 0,
                fields,
                groups: VecDeque::new(),
                groups_appended: 0,
                error: None,
                stopped: false,
                finished: false,
            }),
            changed: Condvar::new(),
            file: Mutex::new(FileOutput {
                writer: Some(file),
                factory,
            }),
        });
        let mut writer = Self {
            shared: Arc::clone(&shared),
            helpers: Vec::with_capacity(HELPER_THREADS),
            max_row_group_rows,
            rows_in_group: 0,
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

    /// Queues `batch` for encoding, once there is room for it in flight.
    fn hand_out(&mut self, batch: RecordBatch) -> Result<()> {
        let mut state = self.shared.work_until(|state| {
            state.batches.is_empty()
                || (state.batches.len() < BATCHES_IN_FLIGHT && state.batch_bytes < BYTES_IN_FLIGHT)
        })?;
        state.batch_bytes += batch_bytes(&batch);
        state.batches.push_back(batch);
        drop(state);
        self.shared.changed.notify_all();
        Ok(())
    }

    /// Ends the current row group after the batches handed out so far.
    fn end_row_group(&mut self) {
        let mut state = self.shared.lock();
        let end = state.first_batch + state.batches.len() as u64;
        let fields = state.fields.len();
        state
            .groups
            .push_back((end, (0..fields).map(|_| None).collect()));
        drop(state);
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
        let writer = self.shared.file().writer.take();
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

/// The writers of one row group (in file column order) grouped by top-level field.
pub(crate) fn split_by_field(
    writers: Vec<ArrowColumnWriter>,
    leaves: &[Range<usize>],
) -> Vec<Vec<ArrowColumnWriter>> {
    let mut writers = writers.into_iter();
    leaves
        .iter()
        .map(|range| writers.by_ref().take(range.len()).collect())
        .collect()
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Encoding> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn file(&self) -> MutexGuard<'_, FileOutput> {
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
    /// field of the oldest row group, appends that group to the file.
    fn run<'a>(&'a self, state: MutexGuard<'a, Encoding>, task: Task) -> MutexGuard<'a, Encoding> {
        drop(state);
        let done = task.run(&self.schema);
        let mut state = self.lock();
        state.complete(done);
        if let Some((index, columns, another)) = state.take_finished_group() {
            drop(state);
            let appended = self.append(index, columns, another);
            state = self.lock();
            match appended {
                Ok(writers) => {
                    for (field, writers) in state.fields.iter_mut().zip(writers) {
                        field.writers = Some(writers);
                    }
                }
                Err(error) => state.fail(error),
            }
        }
        self.changed.notify_all();
        state
    }

    /// Appends row group `index` to the file and, if `another` will follow, returns its
    /// writers by field (none otherwise).
    fn append(
        &self,
        index: usize,
        columns: Vec<Vec<ArrowColumnChunk>>,
        another: bool,
    ) -> Result<Vec<Vec<ArrowColumnWriter>>> {
        let mut output = self.file();
        let file = output
            .writer
            .as_mut()
            .ok_or_else(|| ParquetError::General("file already closed".to_owned()))?;
        let mut row_group = file.next_row_group()?;
        for chunk in columns.into_iter().flatten() {
            chunk.append_to_row_group(&mut row_group)?;
        }
        row_group.close()?;
        if !another {
            return Ok(Vec::new());
        }
        let writers = output.factory.create_column_writers(index + 1)?;
        Ok(split_by_field(writers, &self.leaves))
    }
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
    /// The next task of the field furthest behind that has one: closing its row group when
    /// it has encoded every batch of it, else encoding its next batch.
    fn next_task(&mut self) -> Option<Task> {
        let handed_out = self.first_batch + self.batches.len() as u64;
        let mut best: Option<(usize, bool)> = None;
        let mut best_batch = u64::MAX;
        for (index, field) in self.fields.iter().enumerate() {
            if field.writers.is_none() || field.next_batch >= best_batch {
                continue;
            }
            let pending = field.groups_closed - self.groups_appended;
            let closes = usize::try_from(pending)
                .ok()
                .and_then(|pending| self.groups.get(pending))
                .is_some_and(|(end, _)| *end == field.next_batch);
            if closes || field.next_batch < handed_out {
                best = Some((index, closes));
                best_batch = field.next_batch;
            }
        }
        let (index, closes) = best?;
        let field = &mut self.fields[index];
        let writers = field.writers.take()?;
        if closes {
            return Some(Task::Close(index, writers));
        }
        let offset = usize::try_from(field.next_batch - self.first_batch).ok()?;
        let batch = self.batches.get(offset)?.clone();
        Some(Task::Encode(index, batch, writers))
    }

    /// Puts a finished task's result in place.
    fn complete(&mut self, done: Result<Done>) {
        match done {
            Ok(Done::Encoded(index, writers)) => {
                let field = &mut self.fields[index];
                field.writers = Some(writers);
                field.next_batch += 1;
                let encoded_by_all = self.fields.iter().map(|f| f.next_batch).min();
                while encoded_by_all.is_some_and(|n| self.first_batch < n) {
                    let bytes = self.batches.pop_front().map(|b| batch_bytes(&b));
                    self.batch_bytes -= bytes.unwrap_or(0);
                    self.first_batch += 1;
                }
            }
            Ok(Done::Closed(index, chunks)) => {
                let field = &mut self.fields[index];
                let group = field.groups_closed - self.groups_appended;
                field.groups_closed += 1;
                let slot = usize::try_from(group)
                    .ok()
                    .and_then(|group| self.groups.get_mut(group))
                    .and_then(|(_, columns)| columns.get_mut(index));
                if let Some(slot) = slot {
                    *slot = Some(chunks);
                }
            }
            Err(error) => self.fail(error),
        }
    }

    /// The oldest row group, if every field has closed it: its number, its columns, and
    /// whether another row group may follow.
    fn take_finished_group(&mut self) -> Option<(usize, Vec<Vec<ArrowColumnChunk>>, bool)> {
        let (_, columns) = self.groups.front()?;
        if !columns.iter().all(Option::is_some) {
            return None;
        }
        let (_, columns) = self.groups.pop_front()?;
        let index = usize::try_from(self.groups_appended).ok()?;
        self.groups_appended += 1;
        let another = !self.finished || !self.groups.is_empty();
        Some((index, columns.into_iter().flatten().collect(), another))
    }

    fn fail(&mut self, error: ParquetError) {
        self.error.get_or_insert(error);
        self.stopped = true;
    }
}

impl Task {
    fn run(self, schema: &SchemaRef) -> Result<Done> {
        match self {
            Task::Encode(index, batch, mut writers) => {
                let field = schema.field(index);
                let leaves = compute_leaves(field, batch.column(index))?;
                for (writer, leaf) in writers.iter_mut().zip(leaves) {
                    writer.write(&leaf)?;
                }
                Ok(Done::Encoded(index, writers))
            }
            Task::Close(index, writers) => {
                let chunks = writers
                    .into_iter()
                    .map(ArrowColumnWriter::close)
                    .collect::<Result<Vec<_>>>()?;
                Ok(Done::Closed(index, chunks))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::sync::Arc;

    use arrow::array::{ArrayRef, Int64Array, ListArray, StringArray, StructArray};
    use arrow::datatypes::{DataType, Field, Fields, Int64Type, Schema};

    use super::*;
    use crate::output::writer_properties;

    fn batch(start: i64, rows: usize) -> RecordBatch {
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
    fn written(
        path: &std::path::Path,
        batches: &[RecordBatch],
        properties: WriterProperties,
        parallel: bool,
    ) -> Vec<u8> {
        let schema = batches[0].schema();
        if parallel {
            let file = OutputFile::create(path).expect("create");
            let mut writer = ParallelWriter::try_new(file, schema, properties).expect("writer");
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
    fn writes_the_bytes_arrow_writer_writes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let batches: Vec<RecordBatch> = (0..40).map(|i| batch(i * 9000, 9000)).collect();
        let path = dir.path().join("out.parquet");
        let properties = writer_properties(&batches[0].schema()).expect("properties");
        let serial = written(&path, &batches, properties.clone(), false);
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
    fn a_writer_dropped_unclosed_stops_its_threads() {
        let dir = tempfile::tempdir().expect("tempdir");
        let b = batch(0, 5000);
        let mut writer = ParallelWriter::try_new(
            OutputFile::create(&dir.path().join("dropped.parquet")).expect("create"),
            b.schema(),
            writer_properties(&b.schema()).expect("properties"),
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
