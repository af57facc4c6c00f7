//! Checks an Arrow IPC schema (a flatbuffer from outside: a Parquet footer's `ARROW:schema`,
//! the schema message of an Arrow IPC file or stream) before arrow-ipc decodes it.
//!
//! arrow-ipc 59's `fb_to_schema` trusts the bytes it is given: an unknown type tag reaches an
//! `unimplemented!`, a missing type table or child list an `unwrap`, an out-of-range enum a
//! `panic!` (`arrow-ipc/src/convert.rs`, `get_data_type`). One flipped bit in a file's footer
//! would end the process with a backtrace. So every schema is first verified as a
//! flatbuffer and then walked here, field by field, against the same cases the decoder
//! handles; only a schema that passes is handed to it. The cases mirror
//! `get_data_type` of the pinned arrow-ipc version, and the corruption test
//! (`tests/corruption.rs`) flips bits in real footers to keep them honest.

use arrow::ipc::{
    DateUnit, Endianness, Field, IntervalUnit, Precision, Schema, TimeUnit, Type, UnionMode,
};

/// Nesting deeper than this is refused: decoding recurses once per level.
const MAX_DEPTH: usize = 64;

/// What is wrong with a schema, for "corrupt embedded Arrow schema: …" messages.
pub(crate) type Problem = String;

/// Verifies `bytes` as an IPC `Message` holding a schema, and checks that schema.
pub(crate) fn check_message(bytes: &[u8]) -> Result<(), Problem> {
    let message =
        arrow::ipc::root_as_message(bytes).map_err(|e| format!("not a valid flatbuffer: {e}"))?;
    let schema = message
        .header_as_schema()
        .ok_or_else(|| "the message holds no schema".to_owned())?;
    check_schema(schema)
}

/// Checks a verified schema table: every field is one that arrow-ipc decodes without
/// panicking.
pub(crate) fn check_schema(schema: Schema<'_>) -> Result<(), Problem> {
    let fields = schema
        .fields()
        .ok_or_else(|| "the schema has no field list".to_owned())?;
    for field in fields {
        if field.type_type() == Type::Decimal && schema.endianness() == Endianness::Big {
            return Err("a big-endian decimal column, which Arrow cannot read".to_owned());
        }
        check_field(field, 0)?;
    }
    Ok(())
}

fn check_field(field: Field<'_>, depth: usize) -> Result<(), Problem> {
    let name = field.name().unwrap_or_default();
    let bad = |what: &str| Err(format!("field '{name}': {what}"));
    if depth > MAX_DEPTH {
        return bad("nested too deeply");
    }
    if let Some(dictionary) = field.dictionary() {
        let Some(index) = dictionary.indexType() else {
            return bad("dictionary without an index type");
        };
        if !matches!(index.bitWidth(), 8 | 16 | 32 | 64) {
            return bad("dictionary index of an impossible width");
        }
    }
    let children = || field.children().map(|c| c.iter().collect::<Vec<_>>());
    let exactly = |n: usize| -> Result<(), Problem> {
        match children() {
            Some(c) if c.len() == n => c.into_iter().try_for_each(|c| check_field(c, depth + 1)),
            _ => Err(format!("field '{name}': its type needs {n} child field(s)")),
        }
    };
    match field.type_type() {
        Type::Null
        | Type::Bool
        | Type::Binary
        | Type::BinaryView
        | Type::LargeBinary
        | Type::Utf8
        | Type::Utf8View
        | Type::LargeUtf8 => Ok(()),
        Type::Int => match field.type_as_int() {
            Some(int) if matches!(int.bitWidth(), 8 | 16 | 32 | 64) => Ok(()),
            _ => bad("an integer type of no known width"),
        },
        Type::FixedSizeBinary => match field.type_as_fixed_size_binary() {
            Some(binary) if binary.byteWidth() >= 0 => Ok(()),
            _ => bad("a fixed-size binary type without a width"),
        },
        Type::FloatingPoint => match field.type_as_floating_point().map(|f| f.precision()) {
            Some(Precision::HALF | Precision::SINGLE | Precision::DOUBLE) => Ok(()),
            _ => bad("a float of no known precision"),
        },
        Type::Date => match field.type_as_date().map(|d| d.unit()) {
            Some(DateUnit::DAY | DateUnit::MILLISECOND) => Ok(()),
            _ => bad("a date of no known unit"),
        },
        Type::Time => match field.type_as_time().map(|t| (t.bitWidth(), t.unit())) {
            Some((32, TimeUnit::SECOND | TimeUnit::MILLISECOND))
            | Some((64, TimeUnit::MICROSECOND | TimeUnit::NANOSECOND)) => Ok(()),
            _ => bad("a time of no known width and unit"),
        },
        Type::Timestamp => match field.type_as_timestamp().map(|t| t.unit()) {
            Some(unit) if known_unit(unit) => Ok(()),
            _ => bad("a timestamp of no known unit"),
        },
        Type::Duration => match field.type_as_duration().map(|d| d.unit()) {
            Some(unit) if known_unit(unit) => Ok(()),
            _ => bad("a duration of no known unit"),
        },
        Type::Interval => match field.type_as_interval().map(|i| i.unit()) {
            Some(
                IntervalUnit::YEAR_MONTH | IntervalUnit::DAY_TIME | IntervalUnit::MONTH_DAY_NANO,
            ) => Ok(()),
            _ => bad("an interval of no known unit"),
        },
        Type::List | Type::LargeList | Type::ListView | Type::LargeListView => exactly(1),
        Type::FixedSizeList => match field.type_as_fixed_size_list() {
            Some(list) if list.listSize() >= 0 => exactly(1),
            _ => bad("a fixed-size list without a size"),
        },
        Type::Map => match field.type_as_map() {
            Some(_) => exactly(1),
            None => bad("a map type without its table"),
        },
        Type::RunEndEncoded => exactly(2),
        Type::Struct_ => children()
            .unwrap_or_default()
            .into_iter()
            .try_for_each(|c| check_field(c, depth + 1)),
        Type::Decimal => match field.type_as_decimal() {
            Some(decimal)
                if u8::try_from(decimal.precision()).is_ok()
                    && i8::try_from(decimal.scale()).is_ok()
                    && matches!(decimal.bitWidth(), 32 | 64 | 128 | 256) =>
            {
                Ok(())
            }
            _ => bad("a decimal of impossible width, precision or scale"),
        },
        Type::Union => {
            let Some(union) = field.type_as_union() else {
                return bad("a union type without its table");
            };
            if !matches!(union.mode(), UnionMode::Sparse | UnionMode::Dense) {
                return bad("a union of no known mode");
            }
            let members = children().unwrap_or_default();
            let ids_fit = match union.typeIds() {
                // Ids are read as i8: each must be one, non-negative and unique.
                Some(ids) => {
                    let mut seen = 0u128;
                    ids.len() == members.len()
                        && ids.iter().all(|id| {
                            let fits = (0..128).contains(&id) && seen & (1u128 << id) == 0;
                            if fits {
                                seen |= 1u128 << id;
                            }
                            fits
                        })
                }
                None => members.len() <= 128,
            };
            if !ids_fit {
                return bad("a union whose type ids do not match its members");
            }
            members
                .into_iter()
                .try_for_each(|c| check_field(c, depth + 1))
        }
        other => bad(&format!("unknown type tag {}", other.0)),
    }
}

fn known_unit(unit: TimeUnit) -> bool {
    matches!(
        unit,
        TimeUnit::SECOND | TimeUnit::MILLISECOND | TimeUnit::MICROSECOND | TimeUnit::NANOSECOND
    )
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::datatypes::{DataType, Field as ArrowField, Fields, Schema as ArrowSchema};
    use arrow::ipc::writer::IpcWriteOptions;

    use super::*;

    fn encoded(schema: &ArrowSchema) -> Vec<u8> {
        let data = arrow::ipc::writer::IpcDataGenerator::default()
            .schema_to_bytes_with_dictionary_tracker(
                schema,
                &mut arrow::ipc::writer::DictionaryTracker::new(true),
                &IpcWriteOptions::default(),
            );
        data.ipc_message
    }

    fn sample() -> ArrowSchema {
        ArrowSchema::new(vec![
            ArrowField::new("id", DataType::Utf8, true),
            ArrowField::new("n", DataType::UInt64, false),
            ArrowField::new_list(
                "tags",
                ArrowField::new("item", DataType::Utf8View, true),
                true,
            ),
            ArrowField::new(
                "s",
                DataType::Struct(Fields::from(vec![ArrowField::new(
                    "d",
                    DataType::Decimal128(20, 2),
                    true,
                )])),
                true,
            ),
            ArrowField::new_dictionary("status", DataType::Int32, DataType::Utf8, true),
            ArrowField::new(
                "t",
                DataType::Timestamp(
                    arrow::datatypes::TimeUnit::Microsecond,
                    Some(Arc::from("UTC")),
                ),
                true,
            ),
        ])
    }

    #[test]
    fn schemas_arrow_writes_pass() {
        check_message(&encoded(&sample())).expect("a sound schema");
    }

    /// Every single-bit flip of a real schema message either fails the check or decodes
    /// without a panic: the check admits nothing the decoder cannot take.
    #[test]
    fn no_bit_flip_that_passes_the_check_makes_the_decoder_panic() {
        let bytes = encoded(&sample());
        let mut refused = 0;
        for bit in 0..bytes.len() * 8 {
            let mut flipped = bytes.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            if check_message(&flipped).is_err() {
                refused += 1;
                continue;
            }
            let decoded = std::panic::catch_unwind(|| {
                arrow::ipc::convert::try_schema_from_flatbuffer_bytes(&flipped)
            });
            assert!(
                decoded.is_ok(),
                "bit {bit}: passed the check, and the decoder panicked"
            );
        }
        assert!(refused > 0, "no flip was refused: the check checks nothing");
    }
}
