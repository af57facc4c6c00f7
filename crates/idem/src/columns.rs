//! A Parquet file writer that encodes and compresses its columns on two threads.
//!
//! Encoding and zstd compression of the output are most of a dedup's CPU time, and
//! `ArrowWriter` does them one column after another on the calling thread. This writer
//! makes the same calls — each batch's column into that column's writer, row groups closed
//! at the same rows — but hands the columns of every batch out to two threads, so the file
//! holds the same bytes as `ArrowWriter` would write, only sooner.
//!
//! ```text
//!   batch ──▶ [col 0, col 1, …, col n]  ── next column, whichever thread is free ──▶
//!             thread A: compute_leaves + ArrowColumnWriter::write   (col 0, col 3, …)
//!             thread B: compute_leaves + ArrowColumnWriter::write   (col 1, col 2, …)
//!   row group full ──▶ close every column (in parallel) ──▶ append in column order
//! ```

use std::fs::File;
use std::ops::Range;
use std::sync::{Mutex, PoisonError};

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_writer::{
    ArrowColumnChunk, ArrowColumnWriter, ArrowRowGroupWriterFactory, compute_leaves,
};
use parquet::errors::{ParquetError, Result};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;

/// Threads encoding columns: the one calling [`ParallelWriter::write`] and one more.
const ENCODING_THREADS: usize = 2;

/// Writes record batches to one Parquet file, columns encoded in parallel.
pub(crate) struct ParallelWriter {
    file: SerializedFileWriter<File>,
    factory: ArrowRowGroupWriterFactory,
    schema: SchemaRef,
    /// The leaf column writers of each top-level field, for the current row group.
    fields: Vec<Vec<ArrowColumnWriter>>,
    /// The leaf columns of each top-level field, as indices into the file's columns.
    leaves: Vec<Range<usize>>,
    max_row_group_rows: usize,
    rows_in_group: usize,
}

impl ParallelWriter {
    /// A writer of `schema` into `file`, with `ArrowWriter`'s metadata (the Arrow schema
    /// in the footer) and `properties`.
    pub(crate) fn try_new(
        file: File,
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
        let descriptor = file.schema_descr();
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
        let mut writer = Self {
            file,
            factory,
            schema,
            fields: Vec::new(),
            leaves,
            max_row_group_rows,
            rows_in_group: 0,
        };
        writer.start_row_group()?;
        Ok(writer)
    }

    fn start_row_group(&mut self) -> Result<()> {
        let mut columns = self
            .factory
            .create_column_writers(self.file.flushed_row_groups().len())?
            .into_iter();
        self.fields = self
            .leaves
            .iter()
            .map(|range| columns.by_ref().take(range.len()).collect())
            .collect();
        self.rows_in_group = 0;
        Ok(())
    }

    /// Appends `batch`, closing row groups at the row count the properties give.
    pub(crate) fn write(&mut self, batch: &RecordBatch) -> Result<()> {
        let mut offset = 0;
        while offset < batch.num_rows() {
            let take =
                (self.max_row_group_rows - self.rows_in_group).min(batch.num_rows() - offset);
            self.encode(&batch.slice(offset, take))?;
            self.rows_in_group += take;
            offset += take;
            if self.rows_in_group == self.max_row_group_rows {
                self.flush_row_group()?;
            }
        }
        Ok(())
    }

    /// Every column of `batch` into its writers, the columns shared out between threads.
    /// Shared per batch, not per row group: gathering rows for longer rounds was measured
    /// slower (the reader of pass 2 stalls while a round runs).
    fn encode(&mut self, batch: &RecordBatch) -> Result<()> {
        let fields = self.schema.fields();
        let columns = self
            .fields
            .iter_mut()
            .zip(fields.iter())
            .zip(batch.columns());
        share_out(columns, |((writers, field), array)| {
            for (writer, leaf) in writers.iter_mut().zip(compute_leaves(field, array)?) {
                writer.write(&leaf)?;
            }
            Ok(())
        })
    }

    /// Closes the current row group's columns (in parallel) and appends them to the file.
    fn flush_row_group(&mut self) -> Result<()> {
        if self.rows_in_group == 0 {
            return Ok(());
        }
        let columns: Vec<ArrowColumnWriter> = self.fields.drain(..).flatten().collect();
        let closed: Vec<Mutex<Option<Result<ArrowColumnChunk>>>> =
            columns.iter().map(|_| Mutex::new(None)).collect();
        share_out(columns.into_iter().zip(&closed), |(column, slot)| {
            *slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(column.close());
            Ok(())
        })?;
        let mut row_group = self.file.next_row_group()?;
        for slot in closed {
            let chunk = slot
                .into_inner()
                .unwrap_or_else(PoisonError::into_inner)
                .ok_or_else(|| ParquetError::General("a column was not closed".to_owned()))??;
            chunk.append_to_row_group(&mut row_group)?;
        }
        row_group.close()?;
        self.start_row_group()
    }

    /// Writes the last row group and the footer.
    pub(crate) fn close(mut self) -> Result<()> {
        self.flush_row_group()?;
        self.file.close()?;
        Ok(())
    }
}

/// Calls `each` on every item, the items taken in turn by whichever of this thread and
/// [`ENCODING_THREADS`]` - 1` more is free; returns the first error any of them met.
fn share_out<T: Send>(
    items: impl Iterator<Item = T> + Send,
    each: impl Fn(T) -> Result<()> + Sync,
) -> Result<()> {
    let queue = Mutex::new(items);
    let worker = || -> Result<()> {
        loop {
            // The lock is held only to take the next item.
            let next = queue.lock().unwrap_or_else(PoisonError::into_inner).next();
            let Some(item) = next else {
                return Ok(());
            };
            each(item)?;
        }
    };
    std::thread::scope(|scope| {
        let helpers: Vec<_> = (1..ENCODING_THREADS).map(|_| scope.spawn(worker)).collect();
        let mut result = worker();
        for helper in helpers {
            let joined = helper
                .join()
                .unwrap_or_else(|_| Err(ParquetError::General("encoding thread panicked".into())));
            result = result.and(joined);
        }
        result
    })
}

#[cfg(test)]
mod tests {
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

    #[test]
    fn writes_the_bytes_arrow_writer_writes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let batches: Vec<RecordBatch> = (0..40).map(|i| batch(i * 9000, 9000)).collect();
        let schema = batches[0].schema();
        let serial = dir.path().join("serial.parquet");
        let mut writer = ArrowWriter::try_new(
            File::create(&serial).expect("create"),
            Arc::clone(&schema),
            Some(writer_properties()),
        )
        .expect("writer");
        for b in &batches {
            writer.write(b).expect("write");
        }
        writer.close().expect("close");
        let parallel = dir.path().join("parallel.parquet");
        let mut writer = ParallelWriter::try_new(
            File::create(&parallel).expect("create"),
            schema,
            writer_properties(),
        )
        .expect("writer");
        for b in &batches {
            writer.write(b).expect("write");
        }
        writer.close().expect("close");
        let serial = std::fs::read(serial).expect("read");
        assert!(serial.len() > 100_000);
        assert_eq!(std::fs::read(parallel).expect("read"), serial);
    }

    #[test]
    fn an_empty_file_has_the_schema_and_no_row_group() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("empty.parquet");
        let schema = batch(0, 1).schema();
        ParallelWriter::try_new(
            File::create(&path).expect("create"),
            schema,
            writer_properties(),
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
