//! PostgreSQL's binary `COPY` format, written from and read into Arrow arrays: the fastest
//! way rows enter and leave a server, with no text round trip of numbers, timestamps or
//! bytes.
//!
//! ```text
//!  stream   "PGCOPY\n\xff\r\n\0", flags (i32), header extension length (i32) + extension
//!  tuple    field count (i16), then per field: length (i32, -1 for NULL) + value
//!  end      -1 (i16)
//! ```
//!
//! Values are in each type's binary send format, big-endian: integers and floats as
//! themselves; `date` as days and timestamps as microseconds since 2000-01-01; `uuid` as
//! its 16 bytes; `pg_lsn` as a 64-bit integer; `numeric` as base-10000 digits with a weight,
//! a sign and a display scale.

use arrow::array::{
    Array, ArrayRef, AsArray, BinaryBuilder, BooleanBuilder, Decimal128Builder,
    FixedSizeBinaryBuilder, PrimitiveBuilder, StringBuilder,
};
use arrow::datatypes::{
    DataType, Date32Type, Decimal128Type, Float32Type, Float64Type, Int16Type, Int32Type,
    Int64Type, TimeUnit, TimestampMicrosecondType,
};
use bytes::{Buf, BufMut, BytesMut};
use idem_core::version::parse_pg_lsn;
use std::sync::Arc;

use super::types::PgType;

/// The stream's opening: signature, no flags, no header extension.
pub(crate) const HEADER: &[u8] = b"PGCOPY\n\xff\r\n\0\0\0\0\0\0\0\0\0";

/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01).
const EPOCH_MICROS: i64 = 946_684_800_000_000;
/// Days from the Unix epoch to PostgreSQL's.
const EPOCH_DAYS: i32 = 10_957;

/// Writes rows of Arrow columns in their stored types, one [`PgType`] per column.
pub(crate) struct RowEncoder<'a> {
    columns: Vec<(&'a dyn Array, PgType)>,
}

impl<'a> RowEncoder<'a> {
    /// An encoder for `columns`, each already in the Arrow type its PostgreSQL type is read
    /// back as ([`PgType::arrow`]).
    ///
    /// # Errors
    /// A column in another Arrow type, named by its position.
    pub(crate) fn try_new(columns: &[(&'a ArrayRef, PgType)]) -> Result<Self, String> {
        for (i, (array, pg)) in columns.iter().enumerate() {
            let ok = match pg {
                PgType::Bool => matches!(array.data_type(), DataType::Boolean),
                PgType::Int2 => matches!(array.data_type(), DataType::Int16),
                PgType::Int4 => matches!(array.data_type(), DataType::Int32),
                PgType::Int8 => matches!(array.data_type(), DataType::Int64),
                PgType::Float4 => matches!(array.data_type(), DataType::Float32),
                PgType::Float8 => matches!(array.data_type(), DataType::Float64),
                PgType::Numeric(_) => {
                    matches!(array.data_type(), DataType::Decimal128(_, s) if *s >= 0)
                }
                PgType::Text | PgType::Varchar | PgType::PgLsn => {
                    matches!(array.data_type(), DataType::Utf8)
                }
                PgType::Bytea => matches!(array.data_type(), DataType::Binary),
                PgType::Uuid => matches!(array.data_type(), DataType::FixedSizeBinary(16)),
                PgType::Date => matches!(array.data_type(), DataType::Date32),
                PgType::Timestamp | PgType::Timestamptz => matches!(
                    array.data_type(),
                    DataType::Timestamp(TimeUnit::Microsecond, _)
                ),
            };
            if !ok {
                return Err(format!(
                    "column {i} is {} where {} needs its stored form",
                    array.data_type(),
                    pg.sql()
                ));
            }
        }
        Ok(Self {
            columns: columns
                .iter()
                .map(|&(a, t)| (a.as_ref() as &'a dyn Array, t))
                .collect(),
        })
    }

    /// Appends row `row` as one tuple.
    ///
    /// # Errors
    /// A `pg_lsn` value that is not `X/Y`, naming the column by position.
    pub(crate) fn put_row(&self, row: usize, out: &mut BytesMut) -> Result<(), String> {
        out.put_i16(self.columns.len() as i16);
        for (i, (array, pg)) in self.columns.iter().enumerate() {
            if array.is_null(row) {
                out.put_i32(-1);
                continue;
            }
            match pg {
                PgType::Bool => {
                    out.put_i32(1);
                    out.put_u8(u8::from(array.as_boolean().value(row)));
                }
                PgType::Int2 => {
                    out.put_i32(2);
                    out.put_i16(array.as_primitive::<Int16Type>().value(row));
                }
                PgType::Int4 => {
                    out.put_i32(4);
                    out.put_i32(array.as_primitive::<Int32Type>().value(row));
                }
                PgType::Int8 => {
                    out.put_i32(8);
                    out.put_i64(array.as_primitive::<Int64Type>().value(row));
                }
                PgType::Float4 => {
                    out.put_i32(4);
                    out.put_f32(array.as_primitive::<Float32Type>().value(row));
                }
                PgType::Float8 => {
                    out.put_i32(8);
                    out.put_f64(array.as_primitive::<Float64Type>().value(row));
                }
                PgType::Numeric(_) => {
                    let scale = match array.data_type() {
                        DataType::Decimal128(_, s) => *s,
                        _ => 0,
                    };
                    put_numeric(
                        out,
                        array.as_primitive::<Decimal128Type>().value(row),
                        scale,
                    );
                }
                PgType::Text | PgType::Varchar => {
                    let text = array.as_string::<i32>().value(row);
                    out.put_i32(text.len() as i32);
                    out.put_slice(text.as_bytes());
                }
                PgType::PgLsn => {
                    let text = array.as_string::<i32>().value(row);
                    let lsn = parse_pg_lsn(text)
                        .ok_or_else(|| format!("column {i}: '{text}' is not a pg_lsn (X/Y)"))?;
                    out.put_i32(8);
                    out.put_u64(lsn);
                }
                PgType::Bytea => {
                    let bytes = array.as_binary::<i32>().value(row);
                    out.put_i32(bytes.len() as i32);
                    out.put_slice(bytes);
                }
                PgType::Uuid => {
                    out.put_i32(16);
                    out.put_slice(array.as_fixed_size_binary().value(row));
                }
                PgType::Date => {
                    out.put_i32(4);
                    out.put_i32(array.as_primitive::<Date32Type>().value(row) - EPOCH_DAYS);
                }
                PgType::Timestamp | PgType::Timestamptz => {
                    let micros = array.as_primitive::<TimestampMicrosecondType>().value(row);
                    out.put_i32(8);
                    out.put_i64(micros - EPOCH_MICROS);
                }
            }
        }
        Ok(())
    }
}

/// Writes a `numeric` of `unscaled × 10^-scale`.
fn put_numeric(out: &mut BytesMut, unscaled: i128, scale: i8) {
    let scale = scale.max(0) as usize;
    let digits = unscaled.unsigned_abs().to_string();
    let (whole, fraction) = if digits.len() > scale {
        digits.split_at(digits.len() - scale)
    } else {
        ("", digits.as_str())
    };
    let fraction = format!("{fraction:0>scale$}");
    // Base-10000 groups: the whole part padded on the left, the fraction on the right.
    let whole_padded = format!("{whole:0>width$}", width = whole.len().div_ceil(4) * 4);
    let fraction_padded = format!(
        "{fraction:0<width$}",
        width = fraction.len().div_ceil(4) * 4
    );
    let group = |s: &str| -> Vec<i16> {
        s.as_bytes()
            .chunks(4)
            .map(|c| c.iter().fold(0i16, |acc, d| acc * 10 + i16::from(d - b'0')))
            .collect()
    };
    let mut groups = group(&whole_padded);
    let mut weight = groups.len() as i16 - 1;
    groups.extend(group(&fraction_padded));
    let leading = groups.iter().take_while(|g| **g == 0).count();
    groups.drain(..leading);
    weight -= leading as i16;
    while groups.last() == Some(&0) {
        groups.pop();
    }
    if groups.is_empty() {
        weight = 0;
    }
    out.put_i32(8 + 2 * groups.len() as i32);
    out.put_i16(groups.len() as i16);
    out.put_i16(weight);
    out.put_u16(if unscaled < 0 && !groups.is_empty() {
        0x4000
    } else {
        0
    });
    out.put_u16(scale as u16);
    for g in groups {
        out.put_i16(g);
    }
}

/// Reads a `numeric` as an unscaled value at `scale`.
fn read_numeric(mut value: &[u8], scale: i8) -> Result<i128, String> {
    if value.len() < 8 {
        return Err("a numeric value is truncated".to_owned());
    }
    let count = value.get_i16();
    let weight = i32::from(value.get_i16());
    let sign = value.get_u16();
    let _display_scale = value.get_u16();
    if sign == 0xC000 {
        return Err("NaN has no decimal value".to_owned());
    }
    if sign > 0x4000 {
        return Err("an infinite numeric has no decimal value".to_owned());
    }
    if value.len() < 2 * count.max(0) as usize {
        return Err("a numeric value is truncated".to_owned());
    }
    let overflow = || format!("a numeric value does not fit {} digits", 38);
    let mut total: i128 = 0;
    for i in 0..i32::from(count) {
        let digit = i128::from(value.get_i16());
        let exponent = 4 * (weight - i) + i32::from(scale);
        if exponent >= 0 {
            let power = 10i128.checked_pow(exponent as u32).ok_or_else(overflow)?;
            total = digit
                .checked_mul(power)
                .and_then(|d| total.checked_add(d))
                .ok_or_else(overflow)?;
        } else {
            let divisor = 10i128.checked_pow((-exponent) as u32).unwrap_or(i128::MAX);
            if digit % divisor != 0 {
                return Err(format!(
                    "a numeric value has more than {scale} decimal places"
                ));
            }
            total += digit / divisor;
        }
    }
    Ok(if sign == 0x4000 { -total } else { total })
}

/// One column being read.
enum Column {
    Bool(BooleanBuilder),
    Int16(PrimitiveBuilder<Int16Type>),
    Int32(PrimitiveBuilder<Int32Type>),
    Int64(PrimitiveBuilder<Int64Type>),
    Float32(PrimitiveBuilder<Float32Type>),
    Float64(PrimitiveBuilder<Float64Type>),
    Decimal(Decimal128Builder, u8, i8),
    Text(StringBuilder),
    Lsn(StringBuilder),
    Binary(BinaryBuilder),
    Uuid(FixedSizeBinaryBuilder),
    Date(PrimitiveBuilder<Date32Type>),
    Timestamp(PrimitiveBuilder<TimestampMicrosecondType>, Option<Arc<str>>),
}

/// Reads a binary `COPY … TO STDOUT` stream into Arrow columns, fed in pieces of any size.
pub(crate) struct RowDecoder {
    columns: Vec<Column>,
    pending: BytesMut,
    header_read: bool,
    rows: usize,
    finished: bool,
}

impl RowDecoder {
    /// A decoder of tuples with `columns`: each PostgreSQL type with the Arrow type to
    /// read it as ([`PgType::arrow`]).
    pub(crate) fn new(columns: &[(PgType, DataType)]) -> Self {
        let columns = columns
            .iter()
            .map(|(pg, arrow)| match (pg, arrow) {
                (PgType::Bool, _) => Column::Bool(BooleanBuilder::new()),
                (PgType::Int2, _) => Column::Int16(PrimitiveBuilder::new()),
                (PgType::Int4, _) => Column::Int32(PrimitiveBuilder::new()),
                (PgType::Int8, _) => Column::Int64(PrimitiveBuilder::new()),
                (PgType::Float4, _) => Column::Float32(PrimitiveBuilder::new()),
                (PgType::Float8, _) => Column::Float64(PrimitiveBuilder::new()),
                (PgType::Numeric(_), DataType::Decimal128(p, s)) => {
                    Column::Decimal(Decimal128Builder::new(), *p, *s)
                }
                (PgType::Numeric(_), _) => Column::Decimal(Decimal128Builder::new(), 38, 0),
                (PgType::Text | PgType::Varchar, _) => Column::Text(StringBuilder::new()),
                (PgType::PgLsn, _) => Column::Lsn(StringBuilder::new()),
                (PgType::Bytea, _) => Column::Binary(BinaryBuilder::new()),
                (PgType::Uuid, _) => Column::Uuid(FixedSizeBinaryBuilder::new(16)),
                (PgType::Date, _) => Column::Date(PrimitiveBuilder::new()),
                (PgType::Timestamp, _) => Column::Timestamp(PrimitiveBuilder::new(), None),
                (PgType::Timestamptz, _) => {
                    Column::Timestamp(PrimitiveBuilder::new(), Some(Arc::from("UTC")))
                }
            })
            .collect();
        Self {
            columns,
            pending: BytesMut::new(),
            header_read: false,
            rows: 0,
            finished: false,
        }
    }

    /// Rows decoded since the last [`RowDecoder::take`].
    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    /// Decodes every whole tuple of what arrived so far.
    ///
    /// # Errors
    /// A malformed stream, or a value with no Arrow form (NaN, infinity, invalid UTF-8),
    /// naming the column by position.
    pub(crate) fn push(&mut self, data: &[u8]) -> Result<(), String> {
        self.pending.extend_from_slice(data);
        if !self.header_read {
            if self.pending.len() < HEADER.len() {
                return Ok(());
            }
            if &self.pending[..11] != b"PGCOPY\n\xff\r\n\0" {
                return Err("not a binary COPY stream".to_owned());
            }
            let extension = u32::from_be_bytes([
                self.pending[15],
                self.pending[16],
                self.pending[17],
                self.pending[18],
            ]) as usize;
            if self.pending.len() < HEADER.len() + extension {
                return Ok(());
            }
            self.pending.advance(HEADER.len() + extension);
            self.header_read = true;
        }
        loop {
            let Some(length) = whole_tuple(&self.pending) else {
                return Ok(());
            };
            let mut tuple = self.pending.split_to(length).freeze();
            let count = tuple.get_i16();
            if count == -1 {
                self.finished = true;
                return Ok(());
            }
            if count as usize != self.columns.len() {
                return Err(format!(
                    "a row has {count} fields where {} were asked for",
                    self.columns.len()
                ));
            }
            for (i, column) in self.columns.iter_mut().enumerate() {
                let size = tuple.get_i32();
                let value = if size < 0 {
                    None
                } else {
                    Some(tuple.split_to(size as usize))
                };
                append(column, value.as_deref()).map_err(|e| format!("column {i}: {e}"))?;
            }
            self.rows += 1;
        }
    }

    /// Whether the end-of-data marker arrived.
    pub(crate) fn finished(&self) -> bool {
        self.finished
    }

    /// The columns decoded so far; the decoder continues with empty ones.
    ///
    /// # Errors
    /// A decimal precision Arrow does not have.
    pub(crate) fn take(&mut self) -> Result<Vec<ArrayRef>, String> {
        self.rows = 0;
        self.columns
            .iter_mut()
            .map(|c| -> Result<ArrayRef, String> {
                Ok(match c {
                    Column::Bool(b) => Arc::new(b.finish()),
                    Column::Int16(b) => Arc::new(b.finish()),
                    Column::Int32(b) => Arc::new(b.finish()),
                    Column::Int64(b) => Arc::new(b.finish()),
                    Column::Float32(b) => Arc::new(b.finish()),
                    Column::Float64(b) => Arc::new(b.finish()),
                    Column::Decimal(b, p, s) => Arc::new(
                        b.finish()
                            .with_precision_and_scale(*p, *s)
                            .map_err(|e| e.to_string())?,
                    ),
                    Column::Text(b) | Column::Lsn(b) => Arc::new(b.finish()),
                    Column::Binary(b) => Arc::new(b.finish()),
                    Column::Uuid(b) => Arc::new(b.finish()),
                    Column::Date(b) => Arc::new(b.finish()),
                    Column::Timestamp(b, zone) => {
                        Arc::new(b.finish().with_timezone_opt(zone.clone()))
                    }
                })
            })
            .collect()
    }
}

/// The length of the whole tuple (or end marker) at the start of `data`, if it is there.
fn whole_tuple(data: &[u8]) -> Option<usize> {
    let count = i16::from_be_bytes(data.get(..2)?.try_into().ok()?);
    if count == -1 {
        return Some(2);
    }
    let mut at = 2usize;
    for _ in 0..count.max(0) {
        let size = i32::from_be_bytes(data.get(at..at + 4)?.try_into().ok()?);
        at += 4 + size.max(0) as usize;
        if at > data.len() {
            return None;
        }
    }
    Some(at)
}

fn fixed<const N: usize>(value: &[u8]) -> Result<[u8; N], String> {
    value
        .try_into()
        .map_err(|_| format!("a value of {} bytes where {N} were expected", value.len()))
}

fn append(column: &mut Column, value: Option<&[u8]>) -> Result<(), String> {
    let Some(value) = value else {
        match column {
            Column::Bool(b) => b.append_null(),
            Column::Int16(b) => b.append_null(),
            Column::Int32(b) => b.append_null(),
            Column::Int64(b) => b.append_null(),
            Column::Float32(b) => b.append_null(),
            Column::Float64(b) => b.append_null(),
            Column::Decimal(b, _, _) => b.append_null(),
            Column::Text(b) | Column::Lsn(b) => b.append_null(),
            Column::Binary(b) => b.append_null(),
            Column::Uuid(b) => b.append_null(),
            Column::Date(b) => b.append_null(),
            Column::Timestamp(b, _) => b.append_null(),
        }
        return Ok(());
    };
    match column {
        Column::Bool(b) => b.append_value(fixed::<1>(value)?[0] != 0),
        Column::Int16(b) => b.append_value(i16::from_be_bytes(fixed(value)?)),
        Column::Int32(b) => b.append_value(i32::from_be_bytes(fixed(value)?)),
        Column::Int64(b) => b.append_value(i64::from_be_bytes(fixed(value)?)),
        Column::Float32(b) => b.append_value(f32::from_be_bytes(fixed(value)?)),
        Column::Float64(b) => b.append_value(f64::from_be_bytes(fixed(value)?)),
        Column::Decimal(b, _, scale) => b.append_value(read_numeric(value, *scale)?),
        Column::Text(b) => b.append_value(
            std::str::from_utf8(value).map_err(|_| "text that is not UTF-8".to_owned())?,
        ),
        Column::Lsn(b) => {
            let lsn = u64::from_be_bytes(fixed(value)?);
            b.append_value(format_pg_lsn(lsn));
        }
        Column::Binary(b) => b.append_value(value),
        Column::Uuid(b) => b
            .append_value(value)
            .map_err(|e| format!("a uuid of {} bytes: {e}", value.len()))?,
        Column::Date(b) => {
            let days = i32::from_be_bytes(fixed(value)?);
            if days == i32::MAX || days == i32::MIN {
                return Err("an infinite date has no Arrow value".to_owned());
            }
            b.append_value(days + EPOCH_DAYS);
        }
        Column::Timestamp(b, _) => {
            let micros = i64::from_be_bytes(fixed(value)?);
            if micros == i64::MAX || micros == i64::MIN {
                return Err("an infinite timestamp has no Arrow value".to_owned());
            }
            b.append_value(micros + EPOCH_MICROS);
        }
    }
    Ok(())
}

/// `X/Y`, as PostgreSQL prints a `pg_lsn`.
pub(crate) fn format_pg_lsn(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xffff_ffff)
}

#[cfg(test)]
mod tests {
    use arrow::array::{
        BinaryArray, BooleanArray, Date32Array, Decimal128Array, FixedSizeBinaryArray,
        Float64Array, Int16Array, Int32Array, Int64Array, StringArray, TimestampMicrosecondArray,
    };

    use super::*;

    fn round_trip(columns: Vec<(ArrayRef, PgType)>) -> Vec<ArrayRef> {
        let refs: Vec<(&ArrayRef, PgType)> = columns.iter().map(|(a, t)| (a, *t)).collect();
        let encoder = RowEncoder::try_new(&refs).expect("encoder");
        let mut out = BytesMut::from(HEADER);
        for row in 0..columns[0].0.len() {
            encoder.put_row(row, &mut out).expect("row");
        }
        out.put_i16(-1);
        let wanted: Vec<(PgType, DataType)> = columns
            .iter()
            .map(|(a, t)| (*t, a.data_type().clone()))
            .collect();
        let mut decoder = RowDecoder::new(&wanted);
        // Fed in awkward pieces, as a network delivers it.
        for piece in out.chunks(7) {
            decoder.push(piece).expect("decode");
        }
        assert!(decoder.finished());
        decoder.take().expect("columns")
    }

    #[test]
    fn every_mapped_type_survives_a_round_trip() {
        let decimals = Decimal128Array::from(vec![
            Some(0),
            Some(12_345_678),
            Some(-1),
            None,
            Some(100_000_000),
            Some(i128::from(u64::MAX) * 1000 + 999),
        ])
        .with_precision_and_scale(38, 3)
        .expect("decimal");
        let u64s = Decimal128Array::from(vec![
            Some(i128::from(u64::MAX)),
            Some(1 << 63),
            Some(10_000),
            None,
            Some(0),
            Some(9_999),
        ])
        .with_precision_and_scale(20, 0)
        .expect("decimal");
        let columns: Vec<(ArrayRef, PgType)> = vec![
            (
                Arc::new(BooleanArray::from(vec![
                    Some(true),
                    Some(false),
                    None,
                    Some(true),
                    None,
                    Some(false),
                ])),
                PgType::Bool,
            ),
            (
                Arc::new(Int16Array::from(vec![
                    Some(i16::MIN),
                    Some(-1),
                    None,
                    Some(0),
                    Some(1),
                    Some(i16::MAX),
                ])),
                PgType::Int2,
            ),
            (
                Arc::new(Int32Array::from(vec![
                    Some(i32::MIN),
                    None,
                    Some(0),
                    Some(1),
                    Some(7),
                    Some(i32::MAX),
                ])),
                PgType::Int4,
            ),
            (
                Arc::new(Int64Array::from(vec![
                    Some(i64::MIN),
                    Some(-1),
                    Some(0),
                    None,
                    Some(1),
                    Some(i64::MAX),
                ])),
                PgType::Int8,
            ),
            (
                Arc::new(Float64Array::from(vec![
                    Some(-0.5),
                    Some(f64::MAX),
                    None,
                    Some(0.0),
                    Some(1e-300),
                    Some(3.25),
                ])),
                PgType::Float8,
            ),
            (Arc::new(decimals), PgType::Numeric(Some((38, 3)))),
            (Arc::new(u64s), PgType::Numeric(Some((20, 0)))),
            (
                Arc::new(StringArray::from(vec![
                    Some(""),
                    Some("é ü"),
                    None,
                    Some("a b"),
                    Some("x"),
                    Some("long text"),
                ])) as ArrayRef,
                PgType::Text,
            ),
            (
                Arc::new(StringArray::from(vec![
                    Some("0/0"),
                    Some("16/B374D848"),
                    None,
                    Some("FFFFFFFF/FFFFFFFF"),
                    Some("0/FF"),
                    Some("1/0"),
                ])),
                PgType::PgLsn,
            ),
            (
                Arc::new(BinaryArray::from(vec![
                    Some(&b""[..]),
                    Some(&b"\x00\xff"[..]),
                    None,
                    Some(&b"abc"[..]),
                    Some(&b"d"[..]),
                    Some(&b"e"[..]),
                ])),
                PgType::Bytea,
            ),
            (
                Arc::new(
                    FixedSizeBinaryArray::try_from_sparse_iter_with_size(
                        vec![
                            Some([1u8; 16]),
                            None,
                            Some([0u8; 16]),
                            Some([255u8; 16]),
                            Some([7u8; 16]),
                            Some([9u8; 16]),
                        ]
                        .into_iter(),
                        16,
                    )
                    .expect("uuid"),
                ),
                PgType::Uuid,
            ),
            (
                Arc::new(Date32Array::from(vec![
                    Some(0),
                    Some(-719_162),
                    None,
                    Some(19_000),
                    Some(10_957),
                    Some(2_932_896),
                ])),
                PgType::Date,
            ),
            (
                Arc::new(
                    TimestampMicrosecondArray::from(vec![
                        Some(0),
                        Some(-1),
                        None,
                        Some(1_700_000_000_123_456),
                        Some(EPOCH_MICROS),
                        Some(-62_135_596_800_000_000),
                    ])
                    .with_timezone("UTC"),
                ),
                PgType::Timestamptz,
            ),
        ];
        let back = round_trip(columns.clone());
        for ((original, pg), decoded) in columns.iter().zip(&back) {
            assert_eq!(original.as_ref(), decoded.as_ref(), "{}", pg.sql());
        }
    }

    #[test]
    fn numerics_are_written_as_postgres_writes_them() {
        let mut out = BytesMut::new();
        // 12345.678 at scale 3: groups 1 2345 6780, weight 1, display scale 3.
        put_numeric(&mut out, 12_345_678, 3);
        assert_eq!(
            &out[..],
            &[
                0, 0, 0, 14, 0, 3, 0, 1, 0, 0, 0, 3, 0, 1, 0x09, 0x29, 0x1a, 0x7c
            ]
        );
        assert_eq!(read_numeric(&out[4..], 3), Ok(12_345_678));
        assert_eq!(read_numeric(&out[4..], 5), Ok(1_234_567_800));
        assert!(read_numeric(&out[4..], 2).is_err(), "would lose a digit");
        let nan = [0u8, 0, 0, 0, 0xC0, 0, 0, 0];
        assert!(read_numeric(&nan, 0).is_err());
        assert_eq!(format_pg_lsn(0x16_B374_D848), "16/B374D848");
    }
}
