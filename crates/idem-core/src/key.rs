//! Key columns: validation, vectorised hashing and a compact equality encoding.
//!
//! Every key column is first brought to a *canonical* array: dictionaries are replaced by
//! their values and booleans by `UInt8`, so that the same logical key hashes and encodes
//! identically whether a file stores it dictionary-encoded or plain, and whether strings
//! use 32-bit, 64-bit or view offsets. After that, a column is one of two shapes:
//!
//! * **fixed**: `width` bytes per row (integers, dates, timestamps, decimals, fixed-size
//!   binary such as UUIDs), read straight from the values buffer;
//! * **variable**: a byte string per row (every string and binary layout).
//!
//! Hashing walks one whole column at a time and folds it into a `Vec<u64>` of row hashes.
//! The hash is only a filter: keys are always compared in full (see [`KeyRows`]).

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch};
use arrow::buffer::{Buffer, NullBuffer};
use arrow::compute::{CastOptions, cast_with_options};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::error::ArrowError;
use twox_hash::XxHash3_64;

/// Seed mixed into every hash so that key hashes do not collide with other hashers' outputs.
const SEED: u64 = 0x5eed_1de3_0000_0001;
/// The hash of a null value: equal for every null, so nulls group together.
const NULL_HASH: u64 = 0x6e75_6c6c_6e75_6c6c;

/// Mixes 64 bits into a well-distributed hash (a folded 64×64→128 multiply).
#[inline]
pub(crate) fn mix(value: u64) -> u64 {
    let product = u128::from(value ^ SEED).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835);
    (product as u64) ^ ((product >> 64) as u64)
}

/// Folds the hash of one more column into a row's running hash.
#[inline]
fn combine(running: u64, column_hash: u64) -> u64 {
    mix(running.rotate_left(23) ^ column_hash)
}

#[inline]
pub(crate) fn hash_bytes(bytes: &[u8]) -> u64 {
    XxHash3_64::oneshot_with_seed(SEED, bytes)
}

/// The logical class of a key column. Batches of one dedup must agree on it column by
/// column; physical layouts inside a class (dictionary or plain, 32/64-bit offsets or
/// views) may differ from batch to batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyClass {
    /// Fixed-width values compared bit for bit; the data type (time zone dropped) identifies it.
    Fixed(DataType),
    /// Text of any string layout.
    Text,
    /// Bytes of any binary layout.
    Bytes,
}

impl KeyClass {
    /// The class of a key column of type `data_type`, or an error naming `column`.
    pub fn of(column: &str, data_type: &DataType) -> Result<Self, ArrowError> {
        use DataType::*;
        Ok(match data_type {
            Dictionary(_, values) => return Self::of(column, values),
            Utf8 | LargeUtf8 | Utf8View => Self::Text,
            Binary | LargeBinary | BinaryView => Self::Bytes,
            // An instant is the same whatever zone it is displayed in.
            Timestamp(unit, _) => Self::Fixed(Timestamp(*unit, None)),
            Boolean => Self::Fixed(UInt8),
            Int8
            | Int16
            | Int32
            | Int64
            | UInt8
            | UInt16
            | UInt32
            | UInt64
            | Date32
            | Date64
            | Time32(_)
            | Time64(_)
            | Decimal128(_, _)
            | FixedSizeBinary(_) => Self::Fixed(data_type.clone()),
            other => {
                return Err(ArrowError::InvalidArgumentError(format!(
                    "key column '{column}' has type {other}, which cannot be a key: use integers, \
                     strings, binary, fixed-size binary, dates, timestamps, decimals or booleans"
                )));
            }
        })
    }

    fn matches(&self, other: &Self) -> bool {
        match (self, other) {
            // Decimals of one scale denote the same numbers whatever their precision.
            (Self::Fixed(DataType::Decimal128(_, a)), Self::Fixed(DataType::Decimal128(_, b))) => {
                a == b
            }
            _ => self == other,
        }
    }
}

/// The key columns of a dedup: their names and classes, fixed by the first batch.
#[derive(Debug, Clone)]
pub struct KeyLayout {
    names: Vec<String>,
    classes: Vec<KeyClass>,
}

impl KeyLayout {
    /// Validates the key fields and records their classes.
    pub fn try_new(fields: &[Field]) -> Result<Self, ArrowError> {
        if fields.is_empty() {
            return Err(ArrowError::InvalidArgumentError(
                "a dedup needs at least one key column".to_owned(),
            ));
        }
        let classes = fields
            .iter()
            .map(|f| KeyClass::of(f.name(), f.data_type()))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            names: fields.iter().map(|f| f.name().clone()).collect(),
            classes,
        })
    }

    /// Names of the key columns, in key order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Whether the key is one fixed-width column of at most 8 bytes: the case served by a
    /// specialised table that stores keys as `u64`.
    pub(crate) fn narrow_width(&self) -> Option<usize> {
        match self.classes.as_slice() {
            [KeyClass::Fixed(dt)] => fixed_width(dt).filter(|w| *w <= 8),
            _ => None,
        }
    }

    /// Brings a batch's key columns to their canonical arrays, checking them against the layout.
    pub fn canonicalise(&self, columns: &[ArrayRef]) -> Result<KeyColumns, ArrowError> {
        if columns.len() != self.classes.len() {
            return Err(ArrowError::InvalidArgumentError(format!(
                "expected {} key columns, got {}",
                self.classes.len(),
                columns.len()
            )));
        }
        let num_rows = columns.first().map_or(0, |c| c.len());
        let mut canonical = Vec::with_capacity(columns.len());
        for ((column, class), name) in columns.iter().zip(&self.classes).zip(&self.names) {
            let found = KeyClass::of(name, column.data_type())?;
            if !class.matches(&found) {
                return Err(ArrowError::InvalidArgumentError(format!(
                    "key column '{name}' changed type between batches: {class:?} then {}",
                    column.data_type()
                )));
            }
            if column.len() != num_rows {
                return Err(ArrowError::InvalidArgumentError(format!(
                    "key column '{name}' has {} rows, expected {num_rows}",
                    column.len()
                )));
            }
            canonical.push(canonical_array(column)?);
        }
        Ok(KeyColumns {
            columns: canonical,
            num_rows,
        })
    }
}

/// Bytes per value of a fixed-width canonical type.
fn fixed_width(data_type: &DataType) -> Option<usize> {
    match data_type {
        DataType::FixedSizeBinary(w) => usize::try_from(*w).ok(),
        other => other.primitive_width(),
    }
}

fn canonical_array(column: &ArrayRef) -> Result<ArrayRef, ArrowError> {
    let target = match column.data_type() {
        DataType::Dictionary(_, values) => values.as_ref().clone(),
        DataType::Boolean => DataType::UInt8,
        // Timestamps are read as raw instants whatever their zone, so they need no cast (a
        // cast to no zone would shift them to local wall-clock time).
        _ => return Ok(Arc::clone(column)),
    };
    let array = cast_with_options(column, &target, &CastOptions::default())?;
    // A dictionary of booleans still needs its second step.
    if array.data_type() == &DataType::Boolean {
        canonical_array(&array)
    } else {
        Ok(array)
    }
}

/// One batch's key columns in canonical form, ready to hash and encode.
#[derive(Debug)]
pub struct KeyColumns {
    columns: Vec<ArrayRef>,
    num_rows: usize,
}

/// A view of one canonical column: fixed-width values share the array's buffer.
enum ColumnView<'a> {
    Fixed {
        bytes: Buffer,
        width: usize,
        nulls: Option<&'a NullBuffer>,
    },
    Var(&'a dyn Array),
}

impl<'a> ColumnView<'a> {
    fn of(array: &'a ArrayRef) -> Self {
        match fixed_width(array.data_type()) {
            Some(width) => {
                let data = array.to_data();
                let bytes =
                    data.buffers()[0].slice_with_length(data.offset() * width, data.len() * width);
                Self::Fixed {
                    bytes,
                    width,
                    nulls: array.nulls(),
                }
            }
            None => Self::Var(array.as_ref()),
        }
    }
}

/// Calls `f(row, value)` for every row of a canonical variable-width column, with `None`
/// for nulls. The layout is matched once per column, not per row.
fn for_each_bytes(array: &dyn Array, mut f: impl FnMut(usize, Option<&[u8]>)) {
    macro_rules! walk {
        ($array:expr) => {{
            let array = $array;
            for row in 0..array.len() {
                f(
                    row,
                    array
                        .is_valid(row)
                        .then(|| -> &[u8] { array.value(row).as_ref() }),
                );
            }
        }};
    }
    match array.data_type() {
        DataType::Utf8 => walk!(array.as_string::<i32>()),
        DataType::LargeUtf8 => walk!(array.as_string::<i64>()),
        DataType::Utf8View => walk!(array.as_string_view()),
        DataType::Binary => walk!(array.as_binary::<i32>()),
        DataType::LargeBinary => walk!(array.as_binary::<i64>()),
        DataType::BinaryView => walk!(array.as_binary_view()),
        // `KeyLayout::canonicalise` admits no other variable-width type.
        _ => {}
    }
}

impl KeyColumns {
    /// Rows in the batch.
    pub fn num_rows(&self) -> usize {
        self.num_rows
    }

    /// The canonical arrays.
    pub fn arrays(&self) -> &[ArrayRef] {
        &self.columns
    }

    /// Computes one hash per row over all key columns, a whole column at a time.
    pub fn hash_rows(&self, hashes: &mut Vec<u64>) {
        hashes.clear();
        hashes.resize(self.num_rows, 0);
        for (index, column) in self.columns.iter().enumerate() {
            let first = index == 0;
            let fold = |running: &mut u64, h: u64| {
                *running = if first { h } else { combine(*running, h) };
            };
            match ColumnView::of(column) {
                ColumnView::Fixed {
                    bytes,
                    width,
                    nulls,
                } => {
                    let bytes = bytes.as_slice();
                    match width {
                        1 | 2 | 4 | 8 => {
                            for (row, (h, chunk)) in
                                hashes.iter_mut().zip(bytes.chunks_exact(width)).enumerate()
                            {
                                let value = if nulls.is_some_and(|n| n.is_null(row)) {
                                    NULL_HASH
                                } else {
                                    mix(narrow_bits(chunk))
                                };
                                fold(h, value);
                            }
                        }
                        _ => {
                            for (row, (h, chunk)) in
                                hashes.iter_mut().zip(bytes.chunks_exact(width)).enumerate()
                            {
                                let value = if nulls.is_some_and(|n| n.is_null(row)) {
                                    NULL_HASH
                                } else {
                                    hash_bytes(chunk)
                                };
                                fold(h, value);
                            }
                        }
                    }
                }
                ColumnView::Var(array) => for_each_bytes(array, |row, value| {
                    fold(&mut hashes[row], value.map_or(NULL_HASH, hash_bytes));
                }),
            }
        }
    }

    /// Encodes every row's key as a byte string whose equality is key equality
    /// (nulls equal to nulls): per column, a validity byte, then the fixed-width value, or a
    /// 4-byte length and the bytes.
    pub fn encode_rows(&self, rows: &mut KeyRows) {
        let n = self.num_rows;
        rows.offsets.clear();
        rows.offsets.resize(n + 1, 0);
        let views: Vec<ColumnView<'_>> = self.columns.iter().map(ColumnView::of).collect();
        // Pass 1: the length of every row, then offsets by prefix sum.
        let lengths = &mut rows.offsets[1..];
        for view in &views {
            match view {
                ColumnView::Fixed { width, nulls, .. } => {
                    for (row, len) in lengths.iter_mut().enumerate() {
                        *len += 1 + if nulls.is_some_and(|n| n.is_null(row)) {
                            0
                        } else {
                            *width
                        };
                    }
                }
                ColumnView::Var(array) => for_each_bytes(*array, |row, value| {
                    lengths[row] += 1 + value.map_or(0, |v| 4 + v.len());
                }),
            }
        }
        for row in 0..n {
            rows.offsets[row + 1] += rows.offsets[row];
        }
        // Pass 2: each column writes its part of every row.
        rows.data.clear();
        rows.data.resize(rows.offsets[n], 0);
        let mut cursor: Vec<usize> = rows.offsets[..n].to_vec();
        let data = &mut rows.data;
        for view in &views {
            match view {
                ColumnView::Fixed {
                    bytes,
                    width,
                    nulls,
                } => {
                    for (row, chunk) in bytes.as_slice().chunks_exact(*width).enumerate() {
                        let at = cursor[row];
                        if nulls.is_some_and(|n| n.is_null(row)) {
                            cursor[row] = at + 1;
                        } else {
                            data[at] = 1;
                            data[at + 1..at + 1 + width].copy_from_slice(chunk);
                            cursor[row] = at + 1 + width;
                        }
                    }
                }
                ColumnView::Var(array) => for_each_bytes(*array, |row, value| {
                    let at = cursor[row];
                    match value {
                        None => cursor[row] = at + 1,
                        Some(v) => {
                            data[at] = 1;
                            // Key values over 4 GiB cannot occur in Arrow arrays with 32-bit
                            // offsets and are absurd with 64-bit ones; saturating keeps the
                            // encoding total (the bytes still follow in full).
                            let len = u32::try_from(v.len()).unwrap_or(u32::MAX);
                            data[at + 1..at + 5].copy_from_slice(&len.to_le_bytes());
                            data[at + 5..at + 5 + v.len()].copy_from_slice(v);
                            cursor[row] = at + 5 + v.len();
                        }
                    }
                }),
            }
        }
    }

    /// Encodes every row's key as short byte strings whose equality is key equality, for
    /// keys held in memory by the thousands of millions (never written anywhere: the
    /// encoding may change between versions, unlike [`Self::encode_rows`]'s).
    ///
    /// Per column, a tag byte, then: for 4- and 8-byte values, the zig-zag varint of the
    /// value (small integers take one byte); for other fixed widths, the bytes; for byte
    /// strings in the canonical text form of a UUID (36 characters, one letter case),
    /// the 16 bytes it spells; for other byte strings, a varint length and the bytes. Every
    /// column's code is prefix-free and the tag tells the forms apart, so distinct keys
    /// never share an encoding.
    pub fn encode_compact_rows(&self, rows: &mut KeyRows) {
        let columns: Vec<CompactColumn<'_>> = self.columns.iter().map(CompactColumn::of).collect();
        rows.data.clear();
        rows.offsets.clear();
        rows.offsets.reserve(self.num_rows + 1);
        rows.offsets.push(0);
        for row in 0..self.num_rows {
            for column in &columns {
                column.encode(row, &mut rows.data);
            }
            rows.offsets.push(rows.data.len());
        }
    }

    /// For a single fixed-width key of at most 8 bytes: each row's value as `u64` bits, or
    /// `None` for a null.
    pub(crate) fn narrow_values(&self, out: &mut Vec<Option<u64>>) {
        out.clear();
        if let Some(column) = self.columns.first()
            && let ColumnView::Fixed {
                bytes,
                width,
                nulls,
            } = ColumnView::of(column)
        {
            out.extend(
                bytes
                    .as_slice()
                    .chunks_exact(width)
                    .enumerate()
                    .map(|(row, chunk)| {
                        (!nulls.is_some_and(|n| n.is_null(row))).then(|| narrow_bits(chunk))
                    }),
            );
        }
    }

    /// The number of rows with a null in any key column.
    pub fn rows_with_null(&self) -> usize {
        self.null_rows().map_or(0, |nulls| nulls.null_count())
    }

    /// The rows with a null in any key column, as nulls of a buffer (`None`: no nulls).
    pub fn null_rows(&self) -> Option<NullBuffer> {
        self.columns
            .iter()
            .fold(None::<NullBuffer>, |acc, c| {
                NullBuffer::union(acc.as_ref(), c.logical_nulls().as_ref())
            })
            .filter(|nulls| nulls.null_count() > 0)
    }
}

/// Tags of [`KeyColumns::encode_compact_rows`].
const TAG_NULL: u8 = 0;
const TAG_VALUE: u8 = 1;
const TAG_UUID_LOWER: u8 = 2;
const TAG_UUID_UPPER: u8 = 3;

/// One canonical column, read a row at a time by [`KeyColumns::encode_compact_rows`].
enum CompactColumn<'a> {
    Fixed {
        bytes: Buffer,
        width: usize,
        nulls: Option<&'a NullBuffer>,
    },
    Utf8(&'a arrow::array::StringArray),
    LargeUtf8(&'a arrow::array::LargeStringArray),
    Utf8View(&'a arrow::array::StringViewArray),
    Binary(&'a arrow::array::BinaryArray),
    LargeBinary(&'a arrow::array::LargeBinaryArray),
    BinaryView(&'a arrow::array::BinaryViewArray),
}

impl<'a> CompactColumn<'a> {
    fn of(array: &'a ArrayRef) -> Self {
        match ColumnView::of(array) {
            ColumnView::Fixed {
                bytes,
                width,
                nulls,
            } => Self::Fixed {
                bytes,
                width,
                nulls,
            },
            ColumnView::Var(array) => match array.data_type() {
                DataType::LargeUtf8 => Self::LargeUtf8(array.as_string::<i64>()),
                DataType::Utf8View => Self::Utf8View(array.as_string_view()),
                DataType::Binary => Self::Binary(array.as_binary::<i32>()),
                DataType::LargeBinary => Self::LargeBinary(array.as_binary::<i64>()),
                DataType::BinaryView => Self::BinaryView(array.as_binary_view()),
                // `KeyLayout::canonicalise` admits no other variable-width type.
                _ => Self::Utf8(array.as_string::<i32>()),
            },
        }
    }

    #[inline]
    fn encode(&self, row: usize, out: &mut Vec<u8>) {
        macro_rules! bytes {
            ($array:expr) => {{
                let array = $array;
                array
                    .is_valid(row)
                    .then(|| -> &[u8] { array.value(row).as_ref() })
            }};
        }
        let value = match self {
            Self::Fixed {
                bytes,
                width,
                nulls,
            } => {
                if nulls.is_some_and(|n| n.is_null(row)) {
                    out.push(TAG_NULL);
                    return;
                }
                out.push(TAG_VALUE);
                let value = &bytes.as_slice()[row * width..(row + 1) * width];
                match *width {
                    4 => {
                        let v =
                            i64::from(i32::from_le_bytes([value[0], value[1], value[2], value[3]]));
                        push_varint(((v << 1) ^ (v >> 63)) as u64, out);
                    }
                    8 => {
                        let v = narrow_bits(value) as i64;
                        push_varint(((v << 1) ^ (v >> 63)) as u64, out);
                    }
                    _ => out.extend_from_slice(value),
                }
                return;
            }
            Self::Utf8(a) => bytes!(a),
            Self::LargeUtf8(a) => bytes!(a),
            Self::Utf8View(a) => bytes!(a),
            Self::Binary(a) => bytes!(a),
            Self::LargeBinary(a) => bytes!(a),
            Self::BinaryView(a) => bytes!(a),
        };
        match value {
            None => out.push(TAG_NULL),
            Some(text) => match pack_uuid(text) {
                Some((tag, packed)) => {
                    out.push(tag);
                    out.extend_from_slice(&packed);
                }
                None => {
                    out.push(TAG_VALUE);
                    push_varint(text.len() as u64, out);
                    out.extend_from_slice(text);
                }
            },
        }
    }
}

/// LEB128: seven bits a byte, low first, the high bit set on all but the last byte.
#[inline]
fn push_varint(mut value: u64, out: &mut Vec<u8>) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// `0x01` in every byte of a word.
const BYTES_ONE: u64 = 0x0101_0101_0101_0101;
/// The high bit of every byte of a word.
const BYTES_HIGH: u64 = 0x8080_8080_8080_8080;

/// The high bit of each byte of `word` (all of whose bytes are below 0x80) that lies in
/// `low..=high`: adding `0x80 - low` sets a byte's high bit from `low` up, adding
/// `0x7f - high` from `high + 1` up, and neither sum carries into the next byte.
#[inline]
fn bytes_in(word: u64, low: u8, high: u8) -> u64 {
    let from_low = word.wrapping_add(BYTES_ONE * u64::from(0x80 - low));
    let above_high = word.wrapping_add(BYTES_ONE * u64::from(0x7f - high));
    from_low & !above_high & BYTES_HIGH
}

/// Eight hex digits (the first in the lowest byte) as the four bytes they spell, first
/// pair first, and which kinds of digit were there; `None` if one is no hex digit.
#[inline]
fn pack_hex8(word: u64) -> Option<(u32, HexCase)> {
    let digits = bytes_in(word, b'0', b'9');
    let upper = bytes_in(word, b'A', b'F');
    let lower = bytes_in(word, b'a', b'f');
    if word & BYTES_HIGH != 0 || digits | upper | lower != BYTES_HIGH {
        return None;
    }
    // A digit's low nibble is its value; a letter's is 1..=6, its value less 9.
    let nibbles = (word & (BYTES_ONE * 0x0f)) + ((upper | lower) >> 7) * 9;
    // Byte 2k becomes digit 2k's nibble over digit 2k + 1's; the odd bytes are dropped.
    let pairs = ((nibbles << 4) | (nibbles >> 8)) & 0x00ff_00ff_00ff_00ff;
    let pairs = (pairs | (pairs >> 8)) & 0x0000_ffff_0000_ffff;
    let packed = (pairs | (pairs >> 16)) as u32;
    Some((
        packed,
        HexCase {
            lower: lower != 0,
            upper: upper != 0,
        },
    ))
}

/// The letter cases seen among hex digits.
#[derive(Clone, Copy)]
struct HexCase {
    lower: bool,
    upper: bool,
}

/// Little-endian word of `text[at..at + 4]` followed by `text[then..then + 4]`.
#[inline]
fn two_halves(text: &[u8; 36], at: usize, then: usize) -> u64 {
    let first = u32::from_le_bytes([text[at], text[at + 1], text[at + 2], text[at + 3]]);
    let second = u32::from_le_bytes([text[then], text[then + 1], text[then + 2], text[then + 3]]);
    u64::from(first) | (u64::from(second) << 32)
}

/// The 16 bytes spelt by `text` if it is a UUID in canonical text form
/// (`8-4-4-4-12` hex digits) with letters of one case, and the tag of that case; digits
/// alone count as lower case, so every text has exactly one encoding. Eight digits at a
/// time, in a word: a table look-up per digit was a third of a dedup's key encoding.
#[inline]
fn pack_uuid(text: &[u8]) -> Option<(u8, [u8; 16])> {
    let text: &[u8; 36] = text.try_into().ok()?;
    if [text[8], text[13], text[18], text[23]] != [b'-'; 4] {
        return None;
    }
    let words = [
        two_halves(text, 0, 4),
        two_halves(text, 9, 14),
        two_halves(text, 19, 24),
        two_halves(text, 28, 32),
    ];
    let mut packed = [0u8; 16];
    let mut case = HexCase {
        lower: false,
        upper: false,
    };
    for (bytes, word) in packed.chunks_exact_mut(4).zip(words) {
        let (four, seen) = pack_hex8(word)?;
        bytes.copy_from_slice(&four.to_le_bytes());
        case.lower |= seen.lower;
        case.upper |= seen.upper;
    }
    match (case.lower, case.upper) {
        (_, false) => Some((TAG_UUID_LOWER, packed)),
        (false, true) => Some((TAG_UUID_UPPER, packed)),
        (true, true) => None,
    }
}

/// Little-endian bits of a 1-, 2-, 4- or 8-byte value.
#[inline]
fn narrow_bits(chunk: &[u8]) -> u64 {
    let mut bits = [0u8; 8];
    bits[..chunk.len()].copy_from_slice(chunk);
    u64::from_le_bytes(bits)
}

/// Encoded keys of one batch (see [`KeyColumns::encode_rows`]).
#[derive(Debug, Default)]
pub struct KeyRows {
    data: Vec<u8>,
    offsets: Vec<usize>,
}

impl KeyRows {
    /// The keys of `rows` (indices into these), in that order.
    ///
    /// Written at a running offset into a buffer sized up front, a short key as one
    /// fixed-size copy (see [`append_key`]): appended to a `Vec<u8>` instead, every row
    /// stores the vector's length and loads it back, since a byte store may alias it.
    pub(crate) fn gather(&self, rows: &[u32]) -> Self {
        let bytes: usize = rows
            .iter()
            .map(|&row| self.row_and_tail(row as usize).1)
            .sum();
        let mut data = vec![0u8; bytes + SHORT_KEY];
        let mut offsets = vec![0usize; rows.len() + 1];
        let mut at = 0;
        for (end, &row) in offsets[1..].iter_mut().zip(rows) {
            let (key_and_tail, len) = self.row_and_tail(row as usize);
            match key_and_tail.first_chunk::<SHORT_KEY>() {
                Some(chunk) if len <= SHORT_KEY => {
                    data[at..at + SHORT_KEY].copy_from_slice(chunk);
                }
                _ => data[at..at + len].copy_from_slice(&key_and_tail[..len]),
            }
            at += len;
            *end = at;
        }
        data.truncate(at);
        Self { data, offsets }
    }

    /// The encoded key of `row`, and the bytes that follow it in the buffer: what a
    /// fixed-size copy of a short key may read past its end (see [`append_key`]).
    #[inline]
    pub(crate) fn row_and_tail(&self, row: usize) -> (&[u8], usize) {
        let (start, end) = (self.offsets[row], self.offsets[row + 1]);
        (&self.data[start..], end - start)
    }

    /// The encoded key of `row`.
    #[inline]
    pub fn row(&self, row: usize) -> &[u8] {
        &self.data[self.offsets[row]..self.offsets[row + 1]]
    }
}

/// Keys up to this many bytes are appended by [`append_key`] as a fixed-size copy.
pub(crate) const SHORT_KEY: usize = 32;

/// Appends the first `len` bytes of `key_and_tail` (a key and whatever follows it) to
/// `out`. A copy of a length known only at run time is a call to `memcpy`, which costs
/// more than the copy for a key of a few tens of bytes; a key of at most [`SHORT_KEY`]
/// bytes with that many bytes behind it is copied as a fixed [`SHORT_KEY`] bytes, a few
/// vector moves, and the bytes past the key are cut off again. `out` may grow past its
/// capacity by up to [`SHORT_KEY`] bytes doing so; a caller that must not reallocate
/// checks its room first.
#[inline]
pub(crate) fn append_key(out: &mut Vec<u8>, key_and_tail: &[u8], len: usize) {
    let at = out.len();
    match key_and_tail.first_chunk::<SHORT_KEY>() {
        Some(chunk) if len <= SHORT_KEY => {
            out.extend_from_slice(chunk);
            out.truncate(at + len);
        }
        _ => out.extend_from_slice(&key_and_tail[..len]),
    }
}

/// Sends every row to one of N partitions by the hash of its key, so that a dedup too big
/// for memory can run one partition at a time (a key lives in exactly one partition).
#[derive(Debug)]
pub struct KeyRouter {
    layout: KeyLayout,
    hashes: Vec<u64>,
}

impl KeyRouter {
    /// A router for the key columns `keys` of `schema`.
    ///
    /// # Errors
    /// A key column missing or of a type that cannot be a key.
    pub fn try_new(schema: &Schema, keys: &[String]) -> Result<Self, ArrowError> {
        let fields: Vec<Field> = keys
            .iter()
            .map(|k| {
                schema
                    .field_with_name(k)
                    .cloned()
                    .map_err(|_| ArrowError::SchemaError(format!("key column '{k}' not found")))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            layout: KeyLayout::try_new(&fields)?,
            hashes: Vec::new(),
        })
    }

    /// The partition (`0..partitions`) of every row of `batch`, into `out`.
    ///
    /// The partition comes from hash bits 24..56: the key tables index buckets with the low
    /// bits and tag them with the top 7, which must both stay well spread inside a
    /// partition.
    ///
    /// # Errors
    /// A key column missing from `batch` or of another type than the schema's.
    pub fn route(
        &mut self,
        batch: &RecordBatch,
        partitions: u32,
        out: &mut Vec<u32>,
    ) -> Result<(), ArrowError> {
        let columns: Vec<ArrayRef> =
            self.layout
                .names()
                .iter()
                .map(|k| {
                    batch.column_by_name(k).cloned().ok_or_else(|| {
                        ArrowError::SchemaError(format!("key column '{k}' not found"))
                    })
                })
                .collect::<Result<_, _>>()?;
        let keys = self.layout.canonicalise(&columns)?;
        keys.hash_rows(&mut self.hashes);
        let partitions = u64::from(partitions.max(1));
        out.clear();
        out.extend(
            self.hashes
                .iter()
                .map(|h| (((h >> 24) & 0xffff_ffff) % partitions) as u32),
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use arrow::array::{
        BooleanArray, DictionaryArray, Int64Array, LargeStringArray, StringArray, StringViewArray,
        TimestampMillisecondArray,
    };
    use arrow::datatypes::Int8Type;

    use super::*;

    /// Hashes and encodings of one-column keys, row by row.
    fn fingerprint(column: ArrayRef) -> Vec<(u64, Vec<u8>)> {
        let field = Field::new("k", column.data_type().clone(), true);
        let layout = KeyLayout::try_new(&[field]).expect("layout");
        let keys = layout.canonicalise(&[column]).expect("canonical");
        let mut hashes = Vec::new();
        keys.hash_rows(&mut hashes);
        let mut rows = KeyRows::default();
        keys.encode_rows(&mut rows);
        hashes
            .into_iter()
            .enumerate()
            .map(|(i, h)| (h, rows.row(i).to_vec()))
            .collect()
    }

    #[test]
    fn string_layouts_and_dictionaries_are_one_key() {
        let values = vec![Some("a"), None, Some("bb"), Some("")];
        let plain = fingerprint(Arc::new(StringArray::from(values.clone())));
        let large = fingerprint(Arc::new(LargeStringArray::from(values.clone())));
        let view = fingerprint(Arc::new(StringViewArray::from(values.clone())));
        let dict: DictionaryArray<Int8Type> = values.into_iter().collect();
        let dict = fingerprint(Arc::new(dict));
        assert_eq!(plain, large);
        assert_eq!(plain, view);
        assert_eq!(plain, dict);
        // Null and the empty string are different keys.
        assert_ne!(plain[1], plain[3]);
    }

    #[test]
    fn timestamps_compare_as_instants_whatever_the_zone() {
        let utc = TimestampMillisecondArray::from(vec![1_000, 2_000]).with_timezone("UTC");
        let paris = TimestampMillisecondArray::from(vec![1_000, 2_000]).with_timezone("+01:00");
        assert_eq!(fingerprint(Arc::new(utc)), fingerprint(Arc::new(paris)));
    }

    #[test]
    fn booleans_and_sliced_arrays() {
        let bools = fingerprint(Arc::new(BooleanArray::from(vec![
            Some(true),
            None,
            Some(false),
        ])));
        assert_ne!(bools[0], bools[2]);
        let strings: ArrayRef = Arc::new(StringArray::from(vec!["x", "y", "z"]));
        let sliced = fingerprint(strings.slice(1, 2));
        assert_eq!(
            sliced,
            fingerprint(Arc::new(StringArray::from(vec!["y", "z"])))
        );
        let ints: ArrayRef = Arc::new(arrow::array::Int64Array::from(vec![1, 2, 3]));
        assert_eq!(
            fingerprint(ints.slice(2, 1)),
            fingerprint(Arc::new(arrow::array::Int64Array::from(vec![3])))
        );
    }

    /// A digit at a time: the definition [`pack_uuid`] must agree with.
    fn pack_uuid_reference(text: &[u8]) -> Option<(u8, [u8; 16])> {
        if text.len() != 36 || [text[8], text[13], text[18], text[23]] != [b'-'; 4] {
            return None;
        }
        let digits: Vec<u8> = (0..36)
            .filter(|i| ![8, 13, 18, 23].contains(i))
            .map(|i| text[i])
            .collect();
        let value = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        };
        let mut packed = [0u8; 16];
        for (byte, pair) in packed.iter_mut().zip(digits.chunks_exact(2)) {
            *byte = (value(pair[0])? << 4) | value(pair[1])?;
        }
        let lower = digits.iter().any(u8::is_ascii_lowercase);
        let upper = digits.iter().any(u8::is_ascii_uppercase);
        match (lower, upper) {
            (_, false) => Some((TAG_UUID_LOWER, packed)),
            (false, true) => Some((TAG_UUID_UPPER, packed)),
            (true, true) => None,
        }
    }

    #[test]
    fn uuids_pack_as_the_reference_packs_them() {
        let mut rng = crate::rng::SplitMix64::new(11);
        let hex = b"0123456789abcdefABCDEF";
        for case in 0..20_000 {
            let mut text: Vec<u8> = (0..36)
                .map(|i| {
                    if [8, 13, 18, 23].contains(&i) {
                        b'-'
                    } else if case % 3 == 0 {
                        // One case only, so that most texts pack.
                        hex[rng.below(16) as usize]
                    } else {
                        hex[rng.below(hex.len() as u64) as usize]
                    }
                })
                .collect();
            // Now and then one byte of any value, anywhere (the dashes included).
            if case % 2 == 1 {
                let at = rng.below(36) as usize;
                text[at] = rng.below(256) as u8;
            }
            assert_eq!(
                pack_uuid(&text),
                pack_uuid_reference(&text),
                "{}",
                String::from_utf8_lossy(&text)
            );
        }
        // Every byte value at every digit position of a valid UUID.
        let base = b"0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0".to_vec();
        for at in 0..36 {
            for byte in 0..=255u8 {
                let mut text = base.clone();
                text[at] = byte;
                assert_eq!(pack_uuid(&text), pack_uuid_reference(&text), "{at} {byte}");
            }
        }
        assert_eq!(pack_uuid(&base[..35]), None);
        assert_eq!(
            pack_uuid(b"00000000-0000-0000-0000-000000000000").map(|(tag, _)| tag),
            Some(TAG_UUID_LOWER)
        );
    }

    #[test]
    fn gathered_keys_come_out_whole_at_every_length() {
        // Lengths around the fixed-size copy's, and the last keys of the buffer, where
        // fewer than that many bytes follow a key's start.
        let lengths: Vec<usize> = (0..70).chain((0..70).rev()).collect();
        let mut source = KeyRows {
            data: Vec::new(),
            offsets: vec![0],
        };
        for (i, &len) in lengths.iter().enumerate() {
            source.data.extend((0..len).map(|b| (i * 31 + b) as u8));
            source.offsets.push(source.data.len());
        }
        let picked: Vec<usize> = (0..lengths.len()).rev().step_by(3).chain([0, 1]).collect();
        let indices: Vec<u32> = picked.iter().map(|&row| row as u32).collect();
        let copy = source.gather(&indices);
        assert_eq!(copy.offsets.len(), picked.len() + 1);
        for (at, &row) in picked.iter().enumerate() {
            assert_eq!(copy.row(at), source.row(row), "row {row}");
            assert_eq!(copy.row(at).len(), lengths[row]);
        }
    }

    /// Compact encodings of `columns`' rows.
    fn compact(columns: Vec<ArrayRef>, rows: &mut KeyRows) -> Vec<Vec<u8>> {
        let fields: Vec<Field> = columns
            .iter()
            .enumerate()
            .map(|(i, c)| Field::new(format!("k{i}"), c.data_type().clone(), true))
            .collect();
        let layout = KeyLayout::try_new(&fields).expect("layout");
        let keys = layout.canonicalise(&columns).expect("canonical");
        keys.encode_compact_rows(rows);
        (0..keys.num_rows()).map(|i| rows.row(i).to_vec()).collect()
    }

    #[test]
    fn compact_keys_are_the_same_in_a_reused_buffer_and_tell_keys_apart() {
        let long = "x".repeat(300);
        let text: ArrayRef = Arc::new(StringViewArray::from(vec![
            Some(long.as_str()),
            None,
            Some(""),
            Some("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"),
            Some("0F1E2D3C-4B5A-6978-8796-A5B4C3D2E1F0"),
            Some("0f1e2d3c-4b5a-6978-8796-A5B4C3D2E1F0"),
        ]));
        let number: ArrayRef = Arc::new(Int64Array::from(vec![
            Some(i64::MIN),
            Some(-1),
            Some(0),
            Some(127),
            None,
            Some(i64::MAX),
        ]));
        let mut reused = KeyRows::default();
        let first = compact(vec![Arc::clone(&text), Arc::clone(&number)], &mut reused);
        // A second, shorter batch over the first one's bytes encodes as into a new buffer.
        let sliced = vec![text.slice(2, 3), number.slice(2, 3)];
        let again = compact(sliced.clone(), &mut reused);
        assert_eq!(again, compact(sliced, &mut KeyRows::default()));
        assert_eq!(again, first[2..5]);
        // Every row differs from every other, the three UUID spellings included.
        for (i, a) in first.iter().enumerate() {
            for b in &first[i + 1..] {
                assert_ne!(a, b);
            }
        }
        // The lowercase UUID packs to a tag and 16 bytes (127 zig-zags to two varint
        // bytes); the mixed-case one does not.
        assert_eq!(first[3].len(), 1 + 16 + 1 + 2);
        assert!(first[5].len() > 36);
    }

    #[test]
    fn unsupported_key_types_name_the_column() {
        let err = KeyClass::of("score", &DataType::Float64).expect_err("float key");
        assert!(err.to_string().contains("'score'") && err.to_string().contains("Float64"));
    }
}
