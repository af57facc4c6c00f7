//! The Parquet settings of every file idem writes: row groups, dictionaries, encodings,
//! compression. Chosen by the schema alone, never by the data, so the same rows give the
//! same bytes.

use arrow::datatypes::Schema;
use parquet::arrow::ArrowSchemaConverter;
use parquet::basic::{Compression, Encoding, Type as PhysicalType, ZstdLevel};
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::schema::types::ColumnPath;

use super::bounds::set_text_statistics;

/// Rows per row group (DuckDB writes 122,880).
pub(crate) const MAX_ROW_GROUP_ROWS: usize = 128 * 1024;
/// Dictionary size at which a column chunk falls back to its non-dictionary encoding.
pub(crate) const MAX_DICTIONARY_PAGE_BYTES: usize = 64 * 1024;
/// Rows per call into the Parquet writer. Its page and dictionary decisions are taken per
/// call, so calls of a fixed size make the bytes depend only on the rows, not on how the
/// input happened to be batched: that is what makes f(f(x)) = f(x) hold byte for byte.
pub(crate) const WRITE_CHUNK_ROWS: usize = 8192;

/// The writer settings of every idem output of `schema`.
///
/// # Errors
/// A schema Parquet cannot hold.
pub(crate) fn writer_properties(schema: &Schema) -> parquet::errors::Result<WriterProperties> {
    let mut builder = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::default()))
        // A row group is buffered whole until it is written: a million rows (the default)
        // of wide rows is hundreds of megabytes. Bounded by rows, not bytes, so that row
        // groups fall at the same rows whatever the input's batches (f(f(x)) = f(x)).
        .set_max_row_group_row_count(Some(MAX_ROW_GROUP_ROWS))
        // Small row groups restart every column's dictionary; a small dictionary limit
        // makes high-cardinality columns (UUID keys, free text) fall back to the encodings
        // below at once instead of re-interning each row group, while low-cardinality
        // columns keep their dictionaries. Measured faster and smaller on every shape in
        // benches/RESULTS.md.
        .set_dictionary_page_size_limit(MAX_DICTIONARY_PAGE_BYTES);
    for (column, encoding) in fallback_encodings(schema)? {
        builder = builder.set_column_encoding(column, encoding);
    }
    // Computed while the columns are written instead, more cheaply (see `bounds`).
    builder = set_text_statistics(builder, schema, EnabledStatistics::None);
    Ok(builder.build())
}

/// What each column of `schema` falls back to when its dictionary fills, where that is not
/// `PLAIN`. zstd is most of the cost of writing, and these hand it fewer bytes: integers
/// (versions, timestamps, ids) as bit-packed deltas, text with its lengths apart from its
/// bytes. Chosen by physical type alone, never by the data, so the same rows give the same
/// bytes. Both are in every Parquet reader (parquet-mr, so Spark; DuckDB, Polars and pyarrow
/// were checked to read them back in version-1 pages; DataFusion reads with this crate).
///
/// # Errors
/// A schema Parquet cannot hold.
pub(crate) fn fallback_encodings(
    schema: &Schema,
) -> parquet::errors::Result<Vec<(ColumnPath, Encoding)>> {
    let columns = ArrowSchemaConverter::new().convert(schema)?;
    Ok(columns
        .columns()
        .iter()
        .filter_map(|column| {
            let encoding = match column.physical_type() {
                PhysicalType::INT32 | PhysicalType::INT64 => Encoding::DELTA_BINARY_PACKED,
                PhysicalType::BYTE_ARRAY => Encoding::DELTA_LENGTH_BYTE_ARRAY,
                _ => return None,
            };
            Some((column.path().clone(), encoding))
        })
        .collect())
}
