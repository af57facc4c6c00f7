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

use arrow::array::{Array, ArrayRef, AsArray, GenericByteArray, GenericByteViewArray, RecordBatch};
use arrow::compute::cast;
use arrow::datatypes::{ArrowNativeType, ByteArrayType, ByteViewType, DataType, Schema};
use arrow::error::ArrowError;
use arrow::row::{RowConverter, SortField};
use twox_hash::XxHash3_128;

use crate::prefetch::prefetch_index;

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
    if column.len() != hashes.len() {
        return Err(ArrowError::InvalidArgumentError(format!(
            "{} values to hash into {} rows",
            column.len(),
            hashes.len()
        )));
    }
    mix_hashes_by(column, hashes, |i| i)
}

/// [`mix_value_hashes`] of the values at `rows` of `column` (`hashes[i]` for `rows[i]`),
/// without taking them out of the column first.
///
/// # Errors
/// A row beyond the column, or as [`mix_value_hashes`].
pub fn mix_value_hashes_at(
    column: &dyn Array,
    rows: &[u32],
    hashes: &mut [u128],
) -> Result<(), ArrowError> {
    if rows.len() != hashes.len() {
        return Err(ArrowError::InvalidArgumentError(format!(
            "{} rows to hash into {} hashes",
            rows.len(),
            hashes.len()
        )));
    }
    if let Some(&beyond) = rows.iter().find(|&&row| row as usize >= column.len()) {
        return Err(ArrowError::InvalidArgumentError(format!(
            "row {beyond} of a column of {} values",
            column.len()
        )));
    }
    mix_hashes_by(column, hashes, |i| rows[i] as usize)
}

/// Mixes into `hashes[i]` the hash of `column`'s value at `row(i)`, every `row(i)` within
/// the column. Text and binary of every layout hash their bytes where they lie; other
/// types that are not plain values are cast to their content type first.
fn mix_hashes_by(
    column: &dyn Array,
    hashes: &mut [u128],
    row: impl Fn(usize) -> usize,
) -> Result<(), ArrowError> {
    let nulls = column.logical_nulls();
    let nulls = nulls.as_ref();
    let bytes = |value: &[u8]| XxHash3_128::oneshot(value);
    match column.data_type() {
        DataType::Null => mix_rows(hashes, None, &row, |_| NULL_HASH, |_| ()),
        DataType::Boolean => {
            let values = column.as_boolean();
            mix_rows(
                hashes,
                nulls,
                &row,
                |row| bytes(&[u8::from(values.value(row))]),
                |_| (),
            );
        }
        DataType::Utf8 => {
            let values = column.as_string::<i32>();
            let value = |row| bytes(values.value(row).as_bytes());
            mix_rows(hashes, nulls, &row, value, |r| {
                request_offset_value(values, r)
            });
        }
        DataType::LargeUtf8 => {
            let values = column.as_string::<i64>();
            let value = |row| bytes(values.value(row).as_bytes());
            mix_rows(hashes, nulls, &row, value, |r| {
                request_offset_value(values, r)
            });
        }
        DataType::Utf8View => {
            let values = column.as_string_view();
            let value = |row| bytes(values.value(row).as_bytes());
            mix_rows(hashes, nulls, &row, value, |r| {
                request_view_value(values, r)
            });
        }
        DataType::Binary => {
            let values = column.as_binary::<i32>();
            let value = |row| bytes(values.value(row));
            mix_rows(hashes, nulls, &row, value, |r| {
                request_offset_value(values, r)
            });
        }
        DataType::LargeBinary => {
            let values = column.as_binary::<i64>();
            let value = |row| bytes(values.value(row));
            mix_rows(hashes, nulls, &row, value, |r| {
                request_offset_value(values, r)
            });
        }
        DataType::BinaryView => {
            let values = column.as_binary_view();
            let value = |row| bytes(values.value(row));
            mix_rows(hashes, nulls, &row, value, |r| {
                request_view_value(values, r)
            });
        }
        DataType::FixedSizeBinary(_) => {
            let values = column.as_fixed_size_binary();
            mix_rows(hashes, nulls, &row, |row| bytes(values.value(row)), |_| ());
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
                mix_rows(
                    hashes,
                    nulls,
                    &row,
                    |row| {
                        bytes(
                            values
                                .get(row * width..(row + 1) * width)
                                .unwrap_or_default(),
                        )
                    },
                    |_| (),
                );
            }
            None => {
                let content = content_type(data_type);
                if &content != data_type {
                    // A dictionary: its values, in their own layout.
                    let plain = cast(column, &content)?;
                    return mix_hashes_by(plain.as_ref(), hashes, row);
                }
                // Nested and other types: their values' bytes in the row format.
                let converter = RowConverter::new(vec![SortField::new(data_type.clone())])?;
                let encoded =
                    converter.convert_columns(&[arrow::array::make_array(column.to_data())])?;
                mix_rows(
                    hashes,
                    nulls,
                    &row,
                    |row| bytes(encoded.row(row).as_ref()),
                    |_| (),
                );
            }
        },
    }
    Ok(())
}

/// How many rows ahead of the one being hashed its value's bytes are requested. Tied rows
/// are hashed well after their batch was decoded, and their text is mostly out of cache
/// by then: three quarters of the hashing's time on the sample events was its first read.
const VALUES_AHEAD: usize = 8;

/// Mixes `value_hash(row(i))` (or [`NULL_HASH`] for a null) into each `hashes[i]`, while
/// `request(row(i + VALUES_AHEAD))` asks for the memory of a value hashed later.
#[inline]
fn mix_rows(
    hashes: &mut [u128],
    nulls: Option<&arrow::buffer::NullBuffer>,
    row: &impl Fn(usize) -> usize,
    value_hash: impl Fn(usize) -> u128,
    request: impl Fn(usize),
) {
    let rows = hashes.len();
    for i in 0..rows.min(VALUES_AHEAD) {
        request(row(i));
    }
    for (i, hash) in hashes.iter_mut().enumerate() {
        if i + VALUES_AHEAD < rows {
            request(row(i + VALUES_AHEAD));
        }
        let at = row(i);
        let value = if nulls.is_some_and(|n| n.is_null(at)) {
            NULL_HASH
        } else {
            value_hash(at)
        };
        *hash = (*hash ^ value).wrapping_mul(MIX);
    }
}

/// Requests the bytes of the value at `row` of an offsets-and-bytes array.
#[inline]
fn request_offset_value<T: ByteArrayType>(values: &GenericByteArray<T>, row: usize) {
    let offsets = values.value_offsets();
    let (start, end) = (offsets[row].as_usize(), offsets[row + 1].as_usize());
    request_range(values.value_data(), start, end);
}

/// Requests the bytes of the value at `row` of a view array, unless they are inline.
#[inline]
fn request_view_value<T: ByteViewType + ?Sized>(values: &GenericByteViewArray<T>, row: usize) {
    let view = values.views()[row];
    let len = view as u32 as usize;
    if len > INLINE_VIEW_BYTES {
        let buffer = (view >> 64) as u32 as usize;
        let offset = (view >> 96) as u32 as usize;
        if let Some(data) = values.data_buffers().get(buffer) {
            request_range(data.as_slice(), offset, offset + len);
        }
    }
}

/// Values of at most this many bytes sit in their view.
const INLINE_VIEW_BYTES: usize = 12;

/// Requests the cache lines of `data[start..end]`, the first two at most: longer values
/// are read in order, which the hardware prefetcher follows.
#[inline]
fn request_range(data: &[u8], start: usize, end: usize) {
    prefetch_index(data, start);
    if end > start + 64 {
        prefetch_index(data, start + 64);
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
    fn value_hashes_at_rows_equal_those_of_the_rows_taken_out() {
        use arrow::array::{BinaryViewArray, LargeBinaryArray, LargeStringArray};
        let values = [
            Some("a"),
            None,
            Some(""),
            Some("a longer value than twelve"),
            None,
        ];
        let bytes: Vec<Option<&[u8]>> = values.iter().map(|v| v.map(str::as_bytes)).collect();
        let columns: Vec<ArrayRef> = vec![
            Arc::new(StringArray::from(values.to_vec())),
            Arc::new(LargeStringArray::from(values.to_vec())),
            Arc::new(StringViewArray::from(values.to_vec())),
            Arc::new(BinaryViewArray::from(bytes.clone())),
            Arc::new(LargeBinaryArray::from(bytes)),
            Arc::new(Int64Array::from(vec![
                Some(7),
                None,
                Some(0),
                Some(-1),
                Some(7),
            ])),
        ];
        let rows = [3u32, 0, 4, 0, 1, 2];
        let indices = arrow::array::UInt32Array::from(rows.to_vec());
        for column in &columns {
            let taken = arrow::compute::take(column, &indices, None).expect("take");
            let mut at = vec![0; rows.len()];
            mix_value_hashes_at(column.as_ref(), &rows, &mut at).expect("mix at");
            assert_eq!(at, mixed(&[&*taken]), "{}", column.data_type());
            // A slice's rows count from its start.
            let mut in_slice = vec![0; 2];
            mix_value_hashes_at(column.slice(1, 4).as_ref(), &[2, 0], &mut in_slice)
                .expect("mix at");
            let mut whole = vec![0; 2];
            mix_value_hashes_at(column.as_ref(), &[3, 1], &mut whole).expect("mix at");
            assert_eq!(in_slice, whole, "{}", column.data_type());
        }
        // Text hashes alike in every layout, binary alike in every layout.
        let text_hashes: Vec<Vec<u128>> = columns[..3].iter().map(|c| mixed(&[&**c])).collect();
        assert!(text_hashes.iter().all(|h| *h == text_hashes[0]));
        assert_eq!(mixed(&[&*columns[3]]), mixed(&[&*columns[4]]));
        let mut at = vec![0; 1];
        assert!(mix_value_hashes_at(columns[0].as_ref(), &[5], &mut at).is_err());
        assert!(mix_value_hashes_at(columns[0].as_ref(), &[0, 1], &mut at).is_err());
    }

    /// More rows than the hashing requests ahead, long values spread over several of a view
    /// array's buffers, nulls, and rows asked for out of order up to the last.
    #[test]
    fn value_hashes_at_many_rows_of_long_text_equal_those_of_the_rows_taken_out() {
        use arrow::array::{LargeStringArray, StringViewBuilder};
        let values: Vec<Option<String>> = (0..300)
            .map(|i| (i % 7 != 3).then(|| format!("{i:0>width$}", width = i % 150)))
            .collect();
        let mut views = StringViewBuilder::new().with_fixed_block_size(1024);
        for value in &values {
            views.append_option(value.as_deref());
        }
        let views = views.finish();
        assert!(views.data_buffers().len() > 5, "values in several buffers");
        let columns: Vec<ArrayRef> = vec![
            Arc::new(views),
            Arc::new(StringArray::from(values.clone())),
            Arc::new(LargeStringArray::from(values)),
        ];
        let rows: Vec<u32> = (0..300u32).rev().step_by(3).chain([299, 0, 150]).collect();
        let indices = arrow::array::UInt32Array::from(rows.clone());
        for column in &columns {
            let taken = arrow::compute::take(column, &indices, None).expect("take");
            let mut at = vec![0; rows.len()];
            mix_value_hashes_at(column.as_ref(), &rows, &mut at).expect("mix at");
            assert_eq!(at, mixed(&[&*taken]), "{}", column.data_type());
            let sliced = column.slice(100, 200);
            let in_slice: Vec<u32> = rows
                .iter()
                .filter(|&&r| r >= 100)
                .map(|r| r - 100)
                .collect();
            let mut from_slice = vec![0; in_slice.len()];
            mix_value_hashes_at(sliced.as_ref(), &in_slice, &mut from_slice).expect("mix at");
            let expected: Vec<u128> = rows
                .iter()
                .zip(&at)
                .filter(|(r, _)| **r >= 100)
                .map(|(_, h)| *h)
                .collect();
            assert_eq!(from_slice, expected, "{}", column.data_type());
        }
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
