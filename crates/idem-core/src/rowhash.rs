//! 128-bit hashes of rows by value.
//!
//! A row's hash is XXH3-128 of its bytes in Arrow's row format, after every column is cast
//! to one type per logical content (dictionary or plain, view or offset strings all hash
//! alike). The row format encodes nulls apart from every value, so a null and an empty
//! string differ; it is the same bytes for the same values whatever batch they come in.
//!
//! Comparisons within one run (tied rows) need no such stable form, and take
//! [`mix_value_hashes`] instead: a hash of each value straight from its column, without
//! the copy of every value into the row format that most of a [`RowHasher`]'s time goes to.

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch};
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

/// The hash of a null: apart from every value's, as a null differs from an empty string.
const NULL_HASH: u128 = 0x6a09_e667_f3bc_c908_bb67_ae85_84ca_a73b;

/// Odd, so that mixing a value into a row's hash is a bijection of the value's hash.
const MIX: u128 = 0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835;

/// Mixes the hash of each value of `column` into `hashes`, one per row: called for the
/// columns of rows in one order, rows whose hashes end equal hold equal values (up to
/// 128-bit collisions), by value whatever the layout (see [`content_type`]).
///
/// The hashes are for comparisons within a run; they are not [`RowHasher`]'s.
///
/// # Errors
/// A column that cannot be cast to its content type, or of a type the row format cannot
/// encode (those without a direct path here go through it).
pub fn mix_value_hashes(column: &dyn Array, hashes: &mut [u128]) -> Result<(), ArrowError> {
    let column = cast(column, &content_type(column.data_type()))?;
    let nulls = column.nulls();
    if column.len() != hashes.len() {
        return Err(ArrowError::InvalidArgumentError(format!(
            "{} values to hash into {} rows",
            column.len(),
            hashes.len()
        )));
    }
    match column.data_type() {
        DataType::Null => mix_rows(hashes, nulls, |_| NULL_HASH),
        DataType::Boolean => {
            let values = column.as_boolean();
            mix_rows(hashes, nulls, |row| {
                XxHash3_128::oneshot(&[u8::from(values.value(row))])
            });
        }
        DataType::Utf8 => {
            let values = column.as_string::<i32>();
            mix_rows(hashes, nulls, |row| {
                XxHash3_128::oneshot(values.value(row).as_bytes())
            });
        }
        DataType::Binary => {
            let values = column.as_binary::<i32>();
            mix_rows(hashes, nulls, |row| XxHash3_128::oneshot(values.value(row)));
        }
        DataType::FixedSizeBinary(_) => {
            let values = column.as_fixed_size_binary();
            mix_rows(hashes, nulls, |row| XxHash3_128::oneshot(values.value(row)));
        }
        data_type => match data_type.primitive_width() {
            Some(width) => {
                let data = column.to_data();
                let values = data
                    .buffers()
                    .first()
                    .map(|b| b.as_slice())
                    .unwrap_or_default();
                let values = values.get(data.offset() * width..).unwrap_or_default();
                mix_rows(hashes, nulls, |row| {
                    XxHash3_128::oneshot(
                        values
                            .get(row * width..(row + 1) * width)
                            .unwrap_or_default(),
                    )
                });
            }
            None => {
                // Nested and other types: their values' bytes in the row format.
                let converter = RowConverter::new(vec![SortField::new(data_type.clone())])?;
                let rows = converter.convert_columns(std::slice::from_ref(&column))?;
                mix_rows(hashes, nulls, |row| {
                    XxHash3_128::oneshot(rows.row(row).as_ref())
                });
            }
        },
    }
    Ok(())
}

/// Mixes `value_hash(row)` (or [`NULL_HASH`] for a null) into each row's hash.
#[inline]
fn mix_rows(
    hashes: &mut [u128],
    nulls: Option<&arrow::buffer::NullBuffer>,
    value_hash: impl Fn(usize) -> u128,
) {
    for (row, hash) in hashes.iter_mut().enumerate() {
        let value = if nulls.is_some_and(|n| n.is_null(row)) {
            NULL_HASH
        } else {
            value_hash(row)
        };
        *hash = (*hash ^ value).wrapping_mul(MIX);
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

    fn mixed(columns: &[&dyn Array]) -> Vec<u128> {
        let mut hashes = vec![0; columns[0].len()];
        for column in columns {
            mix_value_hashes(*column, &mut hashes).expect("mix");
        }
        hashes
    }

    #[test]
    fn value_hashes_are_by_value_per_column_and_tell_null_from_empty() {
        let text: ArrayRef = Arc::new(StringArray::from(vec![
            Some("a"),
            Some(""),
            None,
            Some("a"),
            Some("ab"),
        ]));
        let dictionary: DictionaryArray<Int32Type> =
            vec![Some("a"), Some(""), None, Some("a"), Some("ab")]
                .into_iter()
                .collect();
        let view: ArrayRef = Arc::new(StringViewArray::from(vec![
            Some("a"),
            Some(""),
            None,
            Some("a"),
            Some("ab"),
        ]));
        let number: ArrayRef = Arc::new(Int64Array::from(vec![
            Some(1),
            Some(1),
            Some(1),
            Some(1),
            None,
        ]));
        let hashes = mixed(&[&*text, &*number]);
        assert_eq!(mixed(&[&dictionary, &*number]), hashes);
        assert_eq!(mixed(&[&*view, &*number]), hashes);
        assert_eq!(hashes[0], hashes[3], "equal rows");
        assert_ne!(hashes[1], hashes[2], "empty string and null");
        assert_ne!(hashes[0], hashes[4]);
        // Columns in another order make other hashes, as the same values in other
        // columns are other rows.
        assert_ne!(mixed(&[&*number, &*text]), hashes);
        // A slice hashes as the rows it holds.
        let sliced = mixed(&[&*text.slice(1, 3), &*number.slice(1, 3)]);
        assert_eq!(sliced, hashes[1..4]);
        let mut short = vec![0; 2];
        assert!(mix_value_hashes(text.as_ref(), &mut short).is_err());
    }

    #[test]
    fn value_hashes_of_nested_and_boolean_columns() {
        use arrow::array::{BooleanArray, ListArray};
        use arrow::datatypes::Int32Type as Item;
        let lists: ArrayRef = Arc::new(ListArray::from_iter_primitive::<Item, _, _>(vec![
            Some(vec![Some(1), Some(2)]),
            Some(vec![]),
            None,
            Some(vec![Some(1), Some(2)]),
            Some(vec![Some(1), None]),
        ]));
        let flags: ArrayRef = Arc::new(BooleanArray::from(vec![
            Some(true),
            Some(false),
            None,
            Some(true),
            Some(true),
        ]));
        let hashes = mixed(&[&*lists, &*flags]);
        assert_eq!(hashes[0], hashes[3]);
        for (a, b) in [(0, 1), (1, 2), (0, 4), (0, 2)] {
            assert_ne!(hashes[a], hashes[b], "rows {a} and {b}");
        }
    }
}
