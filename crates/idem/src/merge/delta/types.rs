//! How a batch's columns are stored in a Delta table.
//!
//! Delta has fewer types than Arrow: no unsigned integers, one string and one binary type,
//! microsecond timestamps only, no time of day. Every batch column is therefore converted,
//! before anything is written, into the type that the table's Delta schema reads back as
//! (deltalake-core's Delta → Arrow conversion), so that
//!
//! * the data files hold exactly the types the log declares (every Delta reader can read
//!   them: no `long` column holding values above `i64::MAX`),
//! * rows of the batch and rows read back from the table compare as equals — key hashes,
//!   version order, the guard and the tombstones see one representation on both sides —
//! * and a later batch with the same Arrow schema as the one that created the table is
//!   converted to the same types again, so it always merges.
//!
//! ```text
//!   batch (Arrow)                          table (Delta)   read back as (Arrow)
//!   Int8 / Int16 / Int32 / Int64           byte … long     the same
//!   UInt8 / UInt16 / UInt32                short / integer / long (the next signed width)
//!   UInt64                                 decimal(20,0)   Decimal128(20, 0): the whole range
//!   Float16 / Float32 / Float64            float / double  Float32 / Float64
//!   Decimal32/64/128(p, s), 256 with p≤38  decimal(p,s)    Decimal128(p, s)
//!   Utf8 / LargeUtf8 / Utf8View / dict     string          Utf8
//!   Binary / LargeBinary / BinaryView /
//!     FixedSizeBinary / dict               binary          Binary
//!   Boolean                                boolean         Boolean
//!   Date32 / Date64 (whole days)           date            Date32
//!   Timestamp(any unit, no zone)           timestamp_ntz   Timestamp(µs)
//!   Timestamp(any unit, any zone)          timestamp       Timestamp(µs, "UTC"): the instant
//!   List / LargeList / FixedSizeList,
//!     Struct, Map                          array / struct / map, of the converted types
//! ```
//!
//! Conversions are checked, never silently lossy: a nanosecond timestamp with a
//! sub-microsecond part, a `Date64` that is not a whole day, a seconds timestamp outside
//! the microsecond range, or a decimal whose value exceeds its declared precision is an
//! error naming the column and the value. Types Delta cannot hold — `Time32` / `Time64`
//! (no time-of-day type), `Duration`, `Interval`, `Null` (no type at all), `Decimal256`
//! beyond 38 digits, negative decimal scales, unions, run-end encoded arrays, and
//! timestamps nested in lists or structs with a unit finer than microseconds — are errors
//! naming the column, raised before anything is written.
//!
//! A table that already exists is taken as it is: the batch's columns are converted to the
//! table's types. Beyond the mapping above, an integer column may be stored in any integer
//! or `decimal(p,0)` column whose range holds every value of the batch (a table made by
//! another writer with `integer` where idem would choose `long`): a value that does not
//! fit is an error naming the column and the value, and nothing is written.

use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, Field, FieldRef, Fields, Schema, SchemaRef, TimeUnit};
use deltalake_core::kernel::DataType as DeltaType;
use deltalake_core::kernel::engine::arrow_conversion::TryFromArrow;

use super::super::convert::{self, Stored};
use crate::error::{Error, Result};

/// Largest precision of a Delta decimal.
const MAX_DECIMAL_PRECISION: u8 = 38;

/// The type a table stores a batch column of `data_type` in, as deltalake-core reads it
/// back; `Err` says why Delta has none.
pub(crate) fn stored_type(data_type: &DataType) -> std::result::Result<DataType, String> {
    stored(data_type, false)
}

fn stored(data_type: &DataType, nested: bool) -> std::result::Result<DataType, String> {
    use DataType::*;
    Ok(match data_type {
        Boolean | Int8 | Int16 | Int32 | Int64 | Float32 | Float64 | Utf8 | Binary | Date32 => {
            data_type.clone()
        }
        UInt8 => Int16,
        UInt16 => Int32,
        UInt32 => Int64,
        UInt64 => Decimal128(20, 0),
        Float16 => Float32,
        LargeUtf8 | Utf8View => Utf8,
        LargeBinary | BinaryView | FixedSizeBinary(_) => Binary,
        Dictionary(_, values) => stored(values, nested)?,
        Date64 => Date32,
        Timestamp(unit, zone) => {
            if nested && *unit == TimeUnit::Nanosecond {
                return Err(
                    "a nanosecond timestamp inside a list, struct or map cannot be \
                            checked for sub-microsecond parts; Delta timestamps are \
                            microseconds: cast it to microseconds first"
                        .to_owned(),
                );
            }
            Timestamp(
                TimeUnit::Microsecond,
                zone.as_ref().map(|_| Arc::from("UTC")),
            )
        }
        Decimal32(p, s) | Decimal64(p, s) | Decimal128(p, s) | Decimal256(p, s) => {
            if *s < 0 {
                return Err(format!(
                    "decimal scale {s} is negative, which Delta does not allow"
                ));
            }
            if *p > MAX_DECIMAL_PRECISION {
                return Err(format!(
                    "{data_type} has more than Delta's {MAX_DECIMAL_PRECISION} digits"
                ));
            }
            Decimal128(*p, *s)
        }
        List(item) | LargeList(item) | ListView(item) | LargeListView(item) => {
            List(stored_field(item)?)
        }
        FixedSizeList(item, _) => List(stored_field(item)?),
        Struct(fields) => Struct(
            fields
                .iter()
                .map(stored_field)
                .collect::<std::result::Result<Fields, _>>()?,
        ),
        Map(entries, sorted) => Map(stored_field(entries)?, *sorted),
        Time32(_) | Time64(_) => {
            return Err(format!(
                "{data_type} is a time of day, which Delta has no type for: store it as a \
                 string, or as an integer count since midnight"
            ));
        }
        Duration(_) | Interval(_) => {
            return Err(format!(
                "{data_type} has no Delta type: store it as an integer count"
            ));
        }
        Null => {
            return Err(
                "type Null (a column with no values and no type) has no Delta type: \
                        give it a type"
                    .to_owned(),
            );
        }
        other => return Err(format!("{other} has no Delta type")),
    })
}

fn stored_field(field: &FieldRef) -> std::result::Result<FieldRef, String> {
    Ok(Arc::new(
        field
            .as_ref()
            .clone()
            .with_data_type(stored(field.data_type(), true)?),
    ))
}

/// The schema a new table gets from a batch's schema: every column converted, nullable.
///
/// # Errors
/// [`Error::TargetType`] for the first column Delta cannot store.
pub(crate) fn stored_schema(batch: &Schema, table: &str) -> Result<SchemaRef> {
    let fields = batch
        .fields()
        .iter()
        .map(|f| {
            let data_type = stored_type(f.data_type()).map_err(|reason| Error::TargetType {
                target: table.to_owned(),
                column: f.name().clone(),
                reason,
            })?;
            Ok(Field::new(f.name(), data_type, true))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Arc::new(Schema::new(fields)))
}

/// The types the batch's columns take in an existing table with `table_schema`: the table's
/// own type for every column it has and the batch can be stored in, the mapping for the
/// others (which the schema check then reports as columns the table lacks).
///
/// # Errors
/// [`Error::TargetType`] for a column whose type cannot be stored in the table's column.
pub(crate) fn schema_in_table(
    batch: &Schema,
    table_schema: &Schema,
    table: &str,
) -> Result<SchemaRef> {
    let fields = batch
        .fields()
        .iter()
        .map(|f| {
            let error = |reason: String| Error::TargetType {
                target: table.to_owned(),
                column: f.name().clone(),
                reason,
            };
            let own = stored_type(f.data_type()).map_err(error)?;
            let Ok(column) = table_schema.field_with_name(f.name()) else {
                return Ok(Field::new(f.name(), own, true));
            };
            let wanted = column.data_type();
            if !storable_in(&own, wanted) {
                return Err(error(format!(
                    "the batch's {} (stored as {}) does not fit the table's {}",
                    f.data_type(),
                    delta_name(&own),
                    delta_name(wanted)
                )));
            }
            Ok(Field::new(f.name(), wanted.clone(), true))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Arc::new(Schema::new(fields)))
}

/// Whether a column stored as `own` can be written into a table column read as `wanted`:
/// the same Delta type, or integers that fit (checked value by value on conversion).
fn storable_in(own: &DataType, wanted: &DataType) -> bool {
    let integral = |t: &DataType| {
        t.is_integer() || matches!(t, DataType::Decimal128(_, 0) | DataType::Decimal256(_, 0))
    };
    own == wanted || same_delta_type(own, wanted) || (integral(own) && integral(wanted))
}

/// Equal as Delta types (which ignores Arrow's names for list items and map entries).
fn same_delta_type(a: &DataType, b: &DataType) -> bool {
    match (DeltaType::try_from_arrow(a), DeltaType::try_from_arrow(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// The Delta name of a column type, for messages (Arrow's where there is none).
fn delta_name(data_type: &DataType) -> String {
    DeltaType::try_from_arrow(data_type).map_or_else(|_| data_type.to_string(), |t| t.to_string())
}

/// Checks, before a data file is written, that its columns have types a Delta table
/// declares and reads back as themselves: the last line of defence against a file whose
/// values its readers would reject.
///
/// # Errors
/// [`Error::TargetType`] for the first column that is not in its stored form.
pub(crate) fn check_stored(schema: &Schema, table: &str) -> Result<()> {
    for field in schema.fields() {
        match stored_type(field.data_type()) {
            Ok(stored) if stored == *field.data_type() => {}
            Ok(stored) => {
                return Err(Error::TargetType {
                    target: table.to_owned(),
                    column: field.name().clone(),
                    reason: format!(
                        "a data file would hold {} where the table stores {}",
                        field.data_type(),
                        stored
                    ),
                });
            }
            Err(reason) => {
                return Err(Error::TargetType {
                    target: table.to_owned(),
                    column: field.name().clone(),
                    reason,
                });
            }
        }
    }
    Ok(())
}

/// The rows with every column converted to its type in `target` (same names, same order).
///
/// # Errors
/// As [`convert::to_stored`], naming Delta's types.
pub(crate) fn to_stored(
    rows: &RecordBatch,
    target: &SchemaRef,
    table: &str,
) -> Result<RecordBatch> {
    convert::to_stored(
        rows,
        target,
        table,
        &Stored {
            system: "Delta",
            type_name: delta_name,
        },
    )
}

#[cfg(test)]
mod tests {
    use arrow::array::{ArrayRef, AsArray};
    use arrow::array::{
        Date64Array, Decimal128Array, DictionaryArray, FixedSizeBinaryArray, ListArray,
        StringViewArray, Time32SecondArray, TimestampNanosecondArray, TimestampSecondArray,
        UInt8Array, UInt64Array,
    };
    use arrow::datatypes::{Decimal128Type, Int32Type, Int64Type};

    use super::*;

    /// Milliseconds in a day, for `Date64` values.
    const MILLIS_PER_DAY: i64 = 86_400_000;

    fn one(name: &str, column: ArrayRef) -> RecordBatch {
        RecordBatch::try_from_iter([(name, column)]).expect("batch")
    }

    fn stored_rows(rows: &RecordBatch) -> Result<RecordBatch> {
        let schema = stored_schema(&rows.schema(), "t")?;
        to_stored(rows, &schema, "t")
    }

    #[test]
    fn unsigned_integers_keep_their_whole_range_and_order() {
        let values = [0, (1 << 63) - 1, 1 << 63, (1 << 63) + 5, u64::MAX];
        let rows =
            stored_rows(&one("lsn", Arc::new(UInt64Array::from(values.to_vec())))).expect("stored");
        assert_eq!(
            rows.schema().field(0).data_type(),
            &DataType::Decimal128(20, 0)
        );
        let stored = rows.column(0).as_primitive::<Decimal128Type>();
        let back: Vec<u128> = stored.values().iter().map(|v| *v as u128).collect();
        assert_eq!(back, values.map(u128::from).to_vec());
        let small =
            stored_rows(&one("n", Arc::new(UInt8Array::from(vec![255u8])))).expect("stored");
        assert_eq!(small.column(0).data_type(), &DataType::Int16);
        assert_eq!(
            small
                .column(0)
                .as_primitive::<arrow::datatypes::Int16Type>()
                .value(0),
            255
        );
    }

    #[test]
    fn text_binary_and_dictionaries_become_delta_strings_and_binary() {
        let dict: DictionaryArray<Int32Type> = vec!["a", "b", "a"].into_iter().collect();
        let rows = stored_rows(
            &RecordBatch::try_from_iter([
                ("d", Arc::new(dict) as ArrayRef),
                ("v", Arc::new(StringViewArray::from(vec!["x", "y", "z"]))),
                (
                    "u",
                    Arc::new(
                        FixedSizeBinaryArray::try_from_iter(
                            [[1u8; 16], [2; 16], [3; 16]].into_iter(),
                        )
                        .expect("uuids"),
                    ),
                ),
            ])
            .expect("batch"),
        )
        .expect("stored");
        let types: Vec<DataType> = rows
            .schema()
            .fields()
            .iter()
            .map(|f| f.data_type().clone())
            .collect();
        assert_eq!(types, [DataType::Utf8, DataType::Utf8, DataType::Binary]);
        assert_eq!(rows.column(0).as_string::<i32>().value(2), "a");
        assert_eq!(rows.column(2).as_binary::<i32>().value(1), [2u8; 16]);
    }

    #[test]
    fn timestamps_become_microseconds_only_when_nothing_is_lost() {
        let zoned = TimestampNanosecondArray::from(vec![1_000, 2_000]).with_timezone("+02:00");
        let rows = stored_rows(&one("t", Arc::new(zoned))).expect("stored");
        assert_eq!(
            rows.column(0).data_type(),
            &DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()))
        );
        let fine = TimestampNanosecondArray::from(vec![Some(1_000), None, Some(1_001)]);
        let error = stored_rows(&one("t", Arc::new(fine))).expect_err("lossy");
        assert!(
            error.to_string().contains("column 't'")
                && error.to_string().contains("sub-microsecond"),
            "{error}"
        );
        let far = TimestampSecondArray::from(vec![i64::MAX / 10]);
        let error = stored_rows(&one("t", Arc::new(far))).expect_err("overflow");
        assert!(error.to_string().contains("does not fit"), "{error}");
        let dates = Date64Array::from(vec![MILLIS_PER_DAY * 3, MILLIS_PER_DAY + 1]);
        let error = stored_rows(&one("day", Arc::new(dates))).expect_err("not a day");
        assert!(error.to_string().contains("whole day"), "{error}");
    }

    #[test]
    fn types_delta_lacks_are_refused_naming_the_column() {
        let time = Time32SecondArray::from(vec![1]);
        let error = stored_rows(&one("at", Arc::new(time))).expect_err("time");
        let message = error.to_string();
        assert!(
            message.contains("column 'at'") && message.contains("time of day"),
            "{message}"
        );
        let nulls = arrow::array::NullArray::new(2);
        assert!(stored_rows(&one("nothing", Arc::new(nulls))).is_err());
    }

    #[test]
    fn decimals_beyond_their_precision_are_refused() {
        let decimals = Decimal128Array::from(vec![99_999i128, 100_000])
            .with_precision_and_scale(5, 0)
            .expect("decimal");
        let error = stored_rows(&one("x", Arc::new(decimals))).expect_err("precision");
        assert!(error.to_string().contains("100000"), "{error}");
    }

    #[test]
    fn existing_tables_take_integers_that_fit_their_columns() {
        let table = Schema::new(vec![Field::new("lsn", DataType::Int32, true)]);
        let fits = one(
            "lsn",
            Arc::new(arrow::array::UInt32Array::from(vec![1u32, 7])),
        );
        let schema = schema_in_table(&fits.schema(), &table, "t").expect("integers");
        let rows = to_stored(&fits, &schema, "t").expect("fits");
        assert_eq!(rows.column(0).as_primitive::<Int32Type>().values(), &[1, 7]);
        let big = one(
            "lsn",
            Arc::new(arrow::array::UInt32Array::from(vec![u32::MAX])),
        );
        let error = to_stored(&big, &schema, "t").expect_err("does not fit");
        assert!(error.to_string().contains("4294967295"), "{error}");
        let text = Schema::new(vec![Field::new("lsn", DataType::Utf8, true)]);
        assert!(schema_in_table(&fits.schema(), &text, "t").is_err());
    }

    #[test]
    fn lists_convert_their_items() {
        let list = ListArray::from_iter_primitive::<Int64Type, _, _>(vec![
            Some(vec![Some(1), None]),
            None,
        ]);
        let unsigned = arrow::compute::cast(
            &(Arc::new(list) as ArrayRef),
            &DataType::List(Arc::new(Field::new("item", DataType::UInt32, true))),
        )
        .expect("cast");
        let rows = stored_rows(&one("l", unsigned)).expect("stored");
        assert_eq!(
            rows.column(0).data_type(),
            &DataType::List(Arc::new(Field::new("item", DataType::Int64, true)))
        );
    }
}
