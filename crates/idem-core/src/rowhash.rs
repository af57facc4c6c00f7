//! 128-bit hashes of rows by value.
//!
//! A row's hash is XXH3-128 of its bytes in Arrow's row format, after every column is cast
//! to one type per logical content (dictionary or plain, view or offset strings all hash
//! alike). The row format encodes nulls apart from every value, so a null and an empty
//! string differ; it is the same bytes for the same values whatever batch they come in.

use arrow::array::{ArrayRef, RecordBatch};
use arrow::compute::cast;
use arrow::datatypes::{DataType, Schema};
use arrow::error::ArrowError;
use arrow::row::{RowConverter, SortField};
use twox_hash::XxHash3_128;

/// Hashes the named columns of rows.
#[derive(Debug)]
pub struct RowHasher {
    columns: Vec<String>,
    converter: Option<RowConverter>,
}

impl RowHasher {
    /// A hasher of `columns` (in this order) of batches shaped like `schema`.
    ///
    /// # Errors
    /// A column missing from `schema`, or of a type the row format cannot encode.
    pub fn try_new(schema: &Schema, columns: &[String]) -> Result<Self, ArrowError> {
        let fields = columns
            .iter()
            .map(|name| {
                let field = schema.field_with_name(name)?;
                Ok(SortField::new(content_type(field.data_type())))
            })
            .collect::<Result<Vec<_>, ArrowError>>()?;
        let converter = if fields.is_empty() {
            None
        } else {
            Some(RowConverter::new(fields)?)
        };
        Ok(Self {
            columns: columns.to_vec(),
            converter,
        })
    }

    /// The hash of every row of `batch` (0 for every row when hashing no columns).
    ///
    /// # Errors
    /// A column missing from `batch`, or one that cannot be cast to its content type.
    pub fn hash(&self, batch: &RecordBatch) -> Result<Vec<u128>, ArrowError> {
        let Some(converter) = &self.converter else {
            return Ok(vec![0; batch.num_rows()]);
        };
        let columns: Vec<ArrayRef> = self
            .columns
            .iter()
            .map(|name| {
                let column = batch
                    .column_by_name(name)
                    .ok_or_else(|| ArrowError::SchemaError(format!("column '{name}' not found")))?;
                cast(column, &content_type(column.data_type()))
            })
            .collect::<Result<_, _>>()?;
        let rows = converter.convert_columns(&columns)?;
        Ok(rows
            .iter()
            .map(|row| XxHash3_128::oneshot(row.as_ref()))
            .collect())
    }
}

/// One type per logical content, so that batches whose layouts differ (dictionary or plain,
/// view or offset strings) hash and compare by value.
pub fn content_type(data_type: &DataType) -> DataType {
    match data_type {
        DataType::Dictionary(_, values) => content_type(values),
        DataType::Utf8View | DataType::LargeUtf8 => DataType::Utf8,
        DataType::BinaryView | DataType::LargeBinary => DataType::Binary,
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{DictionaryArray, Int64Array, StringArray, StringViewArray};
    use arrow::datatypes::Int32Type;
    use std::sync::Arc;

    #[test]
    fn layouts_hash_alike_and_null_differs_from_empty() {
        let plain = RecordBatch::try_from_iter([
            (
                "s",
                Arc::new(StringArray::from(vec![Some("a"), Some(""), None])) as ArrayRef,
            ),
            ("n", Arc::new(Int64Array::from(vec![1, 2, 3])) as ArrayRef),
        ])
        .expect("batch");
        let dictionary: DictionaryArray<Int32Type> =
            vec![Some("a"), Some(""), None].into_iter().collect();
        let other = RecordBatch::try_from_iter([
            ("n", Arc::new(Int64Array::from(vec![1, 2, 3])) as ArrayRef),
            ("s", Arc::new(dictionary) as ArrayRef),
        ])
        .expect("batch");
        let view = RecordBatch::try_from_iter([
            (
                "s",
                Arc::new(StringViewArray::from(vec![Some("a"), Some(""), None])) as ArrayRef,
            ),
            ("n", Arc::new(Int64Array::from(vec![1, 2, 3])) as ArrayRef),
        ])
        .expect("batch");
        let columns = ["s".to_owned(), "n".to_owned()];
        let hasher = RowHasher::try_new(&plain.schema(), &columns).expect("hasher");
        let hashes = hasher.hash(&plain).expect("hash");
        assert_eq!(hasher.hash(&other).expect("hash"), hashes);
        assert_eq!(hasher.hash(&view).expect("hash"), hashes);
        assert_ne!(hashes[1], hashes[2], "empty string and null");
        assert_ne!(hashes[0], hashes[1]);
        let none = RowHasher::try_new(&plain.schema(), &[]).expect("hasher");
        assert_eq!(none.hash(&plain).expect("hash"), [0, 0, 0]);
        assert!(RowHasher::try_new(&plain.schema(), &["x".to_owned()]).is_err());
    }
}
