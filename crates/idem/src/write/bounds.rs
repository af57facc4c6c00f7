//! Column-chunk statistics of text and binary columns, computed here rather than by the
//! Parquet writer.
//!
//! The writer finds a chunk's min and max by comparing every value with the running
//! bounds, one `memcmp` call each, per page; for a 10M dedup's four text columns that was
//! 3–4 % of all its CPU (`benches/RESULTS.md`). Here a value is first compared by its
//! first 16 bytes as one big-endian integer, which settles nearly every comparison (a
//! UUID, a JSON object's first key and value) without the call; only a value whose first
//! 16 bytes equal a bound's is compared in full.
//!
//! The statistics written are the chunk-level ones the writer would have written: min, max
//! (cut to the writer's truncation length as it cuts them, the max rounded up), null count,
//! the values' byte count and the definition-level histogram. What is given up is the
//! per-page min/max of these columns (the column index), as DuckDB does for every column;
//! the other columns keep theirs.

use arrow::array::{Array, ArrayRef, AsArray};
use arrow::datatypes::{DataType, Field, Schema};
use parquet::arrow::arrow_writer::{ArrowColumnChunk, ArrowColumnWriter, compute_leaves};
use parquet::data_type::ByteArray;
use parquet::errors::Result;
use parquet::file::metadata::LevelHistogram;
use parquet::file::properties::{EnabledStatistics, WriterProperties, WriterPropertiesBuilder};
use parquet::file::statistics::{Statistics, ValueStatistics};
use parquet::schema::types::ColumnPath;

/// Whether a top-level field of this type gets its chunk statistics from [`ChunkBounds`]
/// in idem's outputs (whose writer properties switch the Parquet writer's off for it).
pub(crate) fn bounds_computed_here(data_type: &DataType) -> bool {
    is_plain_text(data_type)
        || matches!(
            data_type,
            DataType::Binary | DataType::LargeBinary | DataType::BinaryView
        )
}

/// Text not dictionary-encoded: its bounds are cut at UTF-8 character boundaries.
fn is_plain_text(data_type: &DataType) -> bool {
    matches!(
        data_type,
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
    )
}

/// `builder` with `level` statistics for the top-level fields of `schema` that
/// [`bounds_computed_here`]: `None` in idem's outputs, the Parquet writer's own otherwise.
pub(crate) fn set_text_statistics(
    mut builder: WriterPropertiesBuilder,
    schema: &Schema,
    level: EnabledStatistics,
) -> WriterPropertiesBuilder {
    for field in schema.fields() {
        if bounds_computed_here(field.data_type()) {
            builder = builder.set_column_statistics_enabled(top_level_path(field), level);
        }
    }
    builder
}

fn top_level_path(field: &Field) -> ColumnPath {
    ColumnPath::new(vec![field.name().clone()])
}

/// Which top-level fields of a file get their statistics here: those that
/// [`bounds_computed_here`] and for which the writer properties leave the Parquet writer
/// none to compute.
#[derive(Debug, Clone)]
pub(crate) struct BoundsPlan {
    fields: Vec<bool>,
    truncate: Option<usize>,
}

impl BoundsPlan {
    /// The plan for writing `schema` with `properties`.
    pub(crate) fn new(schema: &Schema, properties: &WriterProperties) -> Self {
        let fields = schema
            .fields()
            .iter()
            .map(|field| {
                bounds_computed_here(field.data_type())
                    && properties.statistics_enabled(&top_level_path(field))
                        == EnabledStatistics::None
            })
            .collect();
        Self {
            fields,
            truncate: properties.statistics_truncate_length(),
        }
    }

    /// The writers of field `index` of the schema, `field`, whose leaf writers are
    /// `leaves`.
    pub(crate) fn field_writer(
        &self,
        index: usize,
        field: &Field,
        leaves: Vec<ArrowColumnWriter>,
    ) -> FieldWriter {
        let here = self.fields.get(index).copied().unwrap_or(false);
        let bounds = here.then(|| ChunkBounds {
            truncate: self.truncate,
            utf8: is_plain_text(field.data_type()),
            nullable: field.is_nullable(),
            ..ChunkBounds::default()
        });
        FieldWriter { leaves, bounds }
    }
}

/// The column writers of one top-level field in one row group.
pub(crate) struct FieldWriter {
    leaves: Vec<ArrowColumnWriter>,
    /// For a field that [`bounds_computed_here`], its statistics so far.
    bounds: Option<ChunkBounds>,
}

impl FieldWriter {
    /// Encodes `array`, the field's next values.
    pub(crate) fn write(&mut self, field: &Field, array: &ArrayRef) -> Result<()> {
        if let Some(bounds) = &mut self.bounds {
            bounds.observe(array.as_ref());
        }
        let leaves = compute_leaves(field, array)?;
        for (writer, leaf) in self.leaves.iter_mut().zip(leaves) {
            writer.write(&leaf)?;
        }
        Ok(())
    }

    /// Closes the row group's column chunks of the field.
    pub(crate) fn close(self) -> Result<Vec<ArrowColumnChunk>> {
        let mut chunks = self
            .leaves
            .into_iter()
            .map(ArrowColumnWriter::close)
            .collect::<Result<Vec<_>>>()?;
        if let (Some(bounds), [chunk]) = (self.bounds, chunks.as_mut_slice()) {
            bounds.apply(chunk)?;
        }
        Ok(chunks)
    }
}

/// Min, max, nulls and value bytes of one column chunk of text or binary values.
#[derive(Debug, Default)]
pub(crate) struct ChunkBounds {
    min: Option<Vec<u8>>,
    max: Option<Vec<u8>>,
    rows: u64,
    nulls: u64,
    value_bytes: i64,
    truncate: Option<usize>,
    utf8: bool,
    nullable: bool,
}

impl ChunkBounds {
    /// Adds `array`'s values; an array of another type than the field's adds nothing
    /// (the writer rejects it).
    fn observe(&mut self, array: &dyn Array) {
        self.rows += array.len() as u64;
        self.nulls += array.null_count() as u64;
        match array.data_type() {
            DataType::Utf8 => self.observe_values(array.as_string::<i32>().iter().flatten()),
            DataType::LargeUtf8 => self.observe_values(array.as_string::<i64>().iter().flatten()),
            DataType::Utf8View => self.observe_values(array.as_string_view().iter().flatten()),
            DataType::Binary => self.observe_values(array.as_binary::<i32>().iter().flatten()),
            DataType::LargeBinary => {
                self.observe_values(array.as_binary::<i64>().iter().flatten());
            }
            DataType::BinaryView => self.observe_values(array.as_binary_view().iter().flatten()),
            _ => {}
        }
    }

    fn observe_values<'a, V: AsRef<[u8]> + ?Sized + 'a>(
        &mut self,
        values: impl Iterator<Item = &'a V>,
    ) {
        let mut low = self.min.as_deref();
        let mut high = self.max.as_deref();
        let mut low_key = low.map_or(u128::MAX, sort_key);
        let mut high_key = high.map_or(0, sort_key);
        let (mut low_moved, mut high_moved) = (false, false);
        let mut bytes = 0;
        for value in values {
            let value = value.as_ref();
            bytes += value.len();
            let key = sort_key(value);
            // Strictly between the bounds' keys: strictly between the bounds.
            if key > low_key && key < high_key {
                continue;
            }
            if low.is_none_or(|low| key < low_key || (key == low_key && value < low)) {
                (low, low_key, low_moved) = (Some(value), key, true);
            }
            if high.is_none_or(|high| key > high_key || (key == high_key && value > high)) {
                (high, high_key, high_moved) = (Some(value), key, true);
            }
        }
        let (low, high) = (
            low.filter(|_| low_moved).map(<[u8]>::to_vec),
            high.filter(|_| high_moved).map(<[u8]>::to_vec),
        );
        if low.is_some() {
            self.min = low;
        }
        if high.is_some() {
            self.max = high;
        }
        self.value_bytes = self
            .value_bytes
            .saturating_add(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// Sets the statistics in `chunk`'s metadata.
    fn apply(self, chunk: &mut ArrowColumnChunk) -> Result<()> {
        let (min, min_exact) = match self.min {
            Some(min) => {
                let (min, exact) = lower_bound(min, self.truncate, self.utf8);
                (Some(ByteArray::from(min)), exact)
            }
            None => (None, true),
        };
        let (max, max_exact) = match self.max {
            Some(max) => {
                let (max, exact) = upper_bound(max, self.truncate, self.utf8);
                (Some(ByteArray::from(max)), exact)
            }
            None => (None, true),
        };
        let statistics = Statistics::ByteArray(
            ValueStatistics::new(min, max, None, Some(self.nulls), false)
                .with_min_is_exact(min_exact)
                .with_max_is_exact(max_exact),
        );
        let definition_levels = self.nullable.then(|| {
            let nulls = i64::try_from(self.nulls).unwrap_or(i64::MAX);
            let rows = i64::try_from(self.rows).unwrap_or(i64::MAX);
            LevelHistogram::from(vec![nulls, rows - nulls])
        });
        let close = chunk.close_mut();
        close.metadata = close
            .metadata
            .clone()
            .into_builder()
            .set_statistics(statistics)
            .set_unencoded_byte_array_data_bytes(Some(self.value_bytes))
            .set_definition_level_histogram(definition_levels)
            .build()?;
        Ok(())
    }
}

/// The first 16 bytes of `value` as a big-endian integer, zero-padded. Keys order as the
/// values do wherever they differ: a smaller key is a smaller value (at the first
/// differing byte the value's is smaller, or the value ends there and is a prefix of the
/// other). Equal keys say nothing.
///
/// Built from whole-word loads: copying a value's head into a zeroed buffer compiled to a
/// `memcpy` call per value and a stalled reload of the buffer, most of this module's cost.
#[inline]
fn sort_key(value: &[u8]) -> u128 {
    if let Some(head) = value.first_chunk::<16>() {
        return u128::from_be_bytes(*head);
    }
    let len = value.len();
    // Two overlapping loads, the second shifted so that each byte lands at its own
    // position: where they overlap they hold the same bytes, and the shift pushes the
    // second load's leading bytes out of the word.
    let (high, low) = match (value.first_chunk::<8>(), value.last_chunk::<8>()) {
        (Some(first), Some(last)) => {
            let low = u64::from_be_bytes(*last)
                .checked_shl(8 * (16 - len) as u32)
                .unwrap_or(0);
            (u64::from_be_bytes(*first), low)
        }
        _ => match (value.first_chunk::<4>(), value.last_chunk::<4>()) {
            (Some(first), Some(last)) => {
                let first = u64::from(u32::from_be_bytes(*first)) << 32;
                let last = u64::from(u32::from_be_bytes(*last)) << (8 * (8 - len));
                (first | last, 0)
            }
            _ => {
                let high = value.iter().enumerate().fold(0, |word, (at, byte)| {
                    word | u64::from(*byte) << (56 - 8 * at)
                });
                (high, 0)
            }
        },
    };
    u128::from(high) << 64 | u128::from(low)
}

/// `value`, or a prefix of it no longer than `truncate` (never cutting a UTF-8 character
/// when `utf8`), and whether it is the value itself.
fn lower_bound(value: Vec<u8>, truncate: Option<usize>, utf8: bool) -> (Vec<u8>, bool) {
    match truncate {
        Some(limit) if value.len() > limit => {
            let cut = if utf8 {
                char_boundary_at_most(&value, limit)
            } else {
                limit
            };
            if cut == 0 {
                (value, true)
            } else {
                (value[..cut].to_vec(), false)
            }
        }
        _ => (value, true),
    }
}

/// `value`, or a value no longer than `truncate` that sorts after every value starting
/// with `value`'s first `truncate` bytes (its prefix with the last byte, or UTF-8
/// character, that can be raised raised by one), and whether it is the value itself.
fn upper_bound(value: Vec<u8>, truncate: Option<usize>, utf8: bool) -> (Vec<u8>, bool) {
    let Some(limit) = truncate.filter(|&limit| value.len() > limit) else {
        return (value, true);
    };
    let raised = if utf8 {
        let cut = char_boundary_at_most(&value, limit);
        std::str::from_utf8(&value[..cut])
            .ok()
            .and_then(raise_last_char)
    } else {
        raise_last_byte(&value[..limit])
    };
    match raised {
        Some(raised) => (raised, false),
        None => (value, true),
    }
}

/// The largest character boundary of UTF-8 `bytes` that is at most `limit`; 0 when there
/// is none (or `bytes` is not UTF-8).
fn char_boundary_at_most(bytes: &[u8], limit: usize) -> usize {
    std::str::from_utf8(bytes).map_or(0, |text| {
        (0..=limit.min(text.len()))
            .rev()
            .find(|&at| text.is_char_boundary(at))
            .unwrap_or(0)
    })
}

/// `text` up to its last character that has a successor of the same UTF-8 length, with
/// that character replaced by its successor.
fn raise_last_char(text: &str) -> Option<Vec<u8>> {
    text.char_indices().rev().find_map(|(at, c)| {
        let next = char::from_u32(u32::from(c) + 1).filter(|n| n.len_utf8() == c.len_utf8())?;
        let mut raised = text.as_bytes()[..at].to_vec();
        raised.extend_from_slice(next.encode_utf8(&mut [0; 4]).as_bytes());
        Some(raised)
    })
}

/// `bytes` plus one, as a big-endian number of the same length: its last byte below 255
/// raised by one, the 255s after it wrapped to 0 (as the Parquet writer rounds up).
fn raise_last_byte(bytes: &[u8]) -> Option<Vec<u8>> {
    let last = bytes.iter().rposition(|&b| b < u8::MAX)?;
    let mut raised = bytes.to_vec();
    raised[last] += 1;
    raised[last + 1..].fill(0);
    Some(raised)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{
        BinaryArray, BinaryViewArray, Int64Array, LargeBinaryArray, LargeStringArray, RecordBatch,
        StringArray, StringViewArray,
    };
    use parquet::file::properties::WriterProperties;

    use super::*;
    use crate::write::columns::tests::{chunk_statistics_by_writer, written};
    use crate::write::properties::writer_properties;
    use idem_core::rng::SplitMix64 as Rng;

    /// Text whose min and max are long enough to be cut, cut inside multi-byte
    /// characters, or share a first 16 bytes; binary ending in 255s; runs of nulls long
    /// enough to fill whole row groups.
    fn tricky(start: usize, rows: usize) -> RecordBatch {
        let text = |i: usize| -> Option<String> {
            match i % 11 {
                0 => None,
                1 => Some(String::new()),
                2 => Some(format!("{}{}", "é".repeat(40), i % 97)),
                3 => Some(format!(
                    "{{\"session\":\"{:08x}\",\"n\":{i}}}",
                    i * 7919 % 5000
                )),
                4 => Some(format!("{}{}", "\u{10FFFF}".repeat(20), i % 5)),
                5 => Some(format!("{}-{i}", "z".repeat(70))),
                _ => Some(format!("{:x}", i * 2_654_435_761 % 1_000_003)),
            }
        };
        let mostly_null = |i: usize| (i / 3000 % 2 == 1).then(|| format!("v{}", i % 13));
        let range = start..start + rows;
        let ids = Int64Array::from_iter_values(range.clone().map(|i| i as i64));
        let strings = StringArray::from_iter(range.clone().map(text));
        let large = LargeStringArray::from_iter(range.clone().map(text));
        let views = StringViewArray::from_iter(range.clone().map(text));
        let sparse = StringArray::from_iter(range.clone().map(mostly_null));
        let bytes: Vec<Option<Vec<u8>>> = range
            .clone()
            .map(|i| match i % 5 {
                0 => None,
                1 => Some(vec![0xFF; 80]),
                2 => Some([vec![0x7F; 63], vec![0xFF; 20]].concat()),
                _ => Some((i as u64 * 0x9E37_79B9).to_be_bytes().repeat(1 + i % 12)),
            })
            .collect();
        let binary = BinaryArray::from_iter(bytes);
        RecordBatch::try_from_iter([
            ("id", Arc::new(ids) as ArrayRef),
            ("text", Arc::new(strings)),
            ("large", Arc::new(large)),
            ("views", Arc::new(views)),
            ("sparse", Arc::new(sparse)),
            ("binary", Arc::new(binary)),
        ])
        .expect("batch")
    }

    #[test]
    fn statistics_are_the_parquet_writers_own_byte_for_byte() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("out.parquet");
        let batches: Vec<RecordBatch> = (0..12).map(|i| tricky(i * 1000, 1000)).collect();
        let schema = batches[0].schema();
        for properties in [
            writer_properties(&schema).expect("properties"),
            // Small row groups, so that some are all nulls in `sparse`; and no truncation.
            writer_properties(&schema)
                .expect("properties")
                .into_builder()
                .set_max_row_group_row_count(Some(1500))
                .set_statistics_truncate_length(None)
                .build(),
        ] {
            let by_writer = chunk_statistics_by_writer(&properties, &schema);
            let expected = written(&path, &batches, by_writer, false);
            assert_eq!(written(&path, &batches, properties, true), expected);
        }
    }

    #[test]
    fn a_column_the_writer_computes_statistics_for_is_left_to_it() {
        let schema = tricky(0, 1).schema();
        let plan = BoundsPlan::new(&schema, &WriterProperties::new());
        assert!(plan.fields.iter().all(|here| !here));
        let plan = BoundsPlan::new(&schema, &writer_properties(&schema).expect("properties"));
        assert_eq!(plan.fields, [false, true, true, true, true, true]);
    }

    #[test]
    fn bounds_are_the_least_and_greatest_values_whatever_their_prefixes() {
        let mut rng = Rng::new(7);
        // Few distinct bytes and long shared prefixes, so that keys tie often.
        let alphabet = [0u8, 1, b'a', b'b', 0xFF];
        for round in 0..300 {
            let prefix: Vec<u8> = (0..rng.below(24)).map(|_| b'p').collect();
            let batches: Vec<Vec<Vec<u8>>> = (0..1 + rng.below(4))
                .map(|_| {
                    (0..rng.below(40))
                        .map(|_| {
                            let mut value =
                                prefix[..rng.below(prefix.len() as u64 + 1) as usize].to_vec();
                            value.extend(
                                (0..rng.below(20)).map(|_| alphabet[rng.below(5) as usize]),
                            );
                            value
                        })
                        .collect()
                })
                .collect();
            let mut bounds = ChunkBounds::default();
            let mut nulls = 0;
            for batch in &batches {
                // Every layout (offsets of both widths, views), with nulls among the values.
                let with_nulls: Vec<Option<&[u8]>> = batch
                    .iter()
                    .enumerate()
                    .flat_map(|(i, value)| {
                        let null = (i % 3 == round % 3).then_some(None);
                        null.into_iter().chain([Some(value.as_slice())])
                    })
                    .collect();
                nulls += with_nulls.iter().filter(|v| v.is_none()).count();
                let array: ArrayRef = match round % 3 {
                    0 => Arc::new(BinaryArray::from(with_nulls)),
                    1 => Arc::new(LargeBinaryArray::from(with_nulls)),
                    _ => Arc::new(BinaryViewArray::from(with_nulls)),
                };
                bounds.observe(array.as_ref());
            }
            let all = batches.iter().flatten();
            assert_eq!(bounds.min.as_ref(), all.clone().min(), "round {round}");
            assert_eq!(bounds.max.as_ref(), all.clone().max(), "round {round}");
            assert_eq!(bounds.nulls, nulls as u64, "round {round}");
            let bytes: usize = all.map(Vec::len).sum();
            assert_eq!(bounds.value_bytes, bytes as i64, "round {round}");
        }
    }

    #[test]
    fn the_key_is_the_zero_padded_head_at_every_length() {
        let value: Vec<u8> = (1..=20u8).map(|byte| byte.wrapping_mul(37)).collect();
        for len in 0..=value.len() {
            let mut head = [0u8; 16];
            let kept = len.min(16);
            head[..kept].copy_from_slice(&value[..kept]);
            assert_eq!(sort_key(&value[..len]), u128::from_be_bytes(head), "{len}");
        }
    }

    #[test]
    fn a_smaller_key_is_a_smaller_value() {
        let values: [&[u8]; 8] = [
            b"",
            b"\0",
            b"a",
            b"a\0",
            b"abcdefghijklmnop",
            b"abcdefghijklmnopq",
            b"abcdefghijklmnoq",
            &[0xFF; 17],
        ];
        for a in values {
            for b in values {
                if sort_key(a) < sort_key(b) {
                    assert!(a < b, "{a:?} {b:?}");
                }
            }
        }
    }

    #[test]
    fn cut_bounds_still_bound_the_value() {
        let text = "ab€".repeat(30).into_bytes();
        let (low, exact) = lower_bound(text.clone(), Some(64), true);
        assert!(!exact && low.len() <= 64 && text.starts_with(&low));
        assert!(std::str::from_utf8(&low).is_ok());
        let (high, exact) = upper_bound(text.clone(), Some(64), true);
        assert!(!exact && high.len() <= 64 && high > text);
        assert!(std::str::from_utf8(&high).is_ok());
        // Nothing follows U+10FFFF at its width: a raised earlier character, or the value.
        let top = "\u{10FFFF}".repeat(20).into_bytes();
        assert_eq!(upper_bound(top.clone(), Some(64), true), (top, true));
        assert_eq!(
            upper_bound([vec![1], vec![0xFF; 70]].concat(), Some(64), false),
            ([vec![2], vec![0; 63]].concat(), false)
        );
        assert_eq!(
            upper_bound(vec![0xFF; 70], Some(64), false),
            (vec![0xFF; 70], true)
        );
        assert_eq!(
            lower_bound(b"short".to_vec(), Some(64), true),
            (b"short".to_vec(), true)
        );
    }
}
