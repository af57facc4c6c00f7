//! Checked conversion of a batch's columns into the types a target stores them in: never
//! silently lossy, so that the winners of the dedup stay the winners in the target's types.

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch, RecordBatchOptions};
use arrow::compute::{CastOptions, cast_with_options};
use arrow::datatypes::{
    DataType, Date64Type, Decimal128Type, DecimalType, SchemaRef, TimeUnit, TimestampNanosecondType,
};
use arrow::util::display::array_value_to_string;

use crate::error::{Error, Result};

/// Largest precision of a decimal a target stores (Arrow's `Decimal128`).
const MAX_DECIMAL_PRECISION: u8 = 38;

/// Milliseconds in a day, for `Date64` values.
const MILLIS_PER_DAY: i64 = 86_400_000;

/// How messages name the target system and its types.
pub(crate) struct Stored {
    /// The system, as in "Delta's microsecond timestamps".
    pub system: &'static str,
    /// A column type as the system names it.
    pub type_name: fn(&DataType) -> String,
}

/// The rows with every column converted to its type in `target` (same names, same order).
///
/// # Errors
/// [`Error::TargetType`] naming the column and the first value that would change: one
/// outside the target type's range or precision, a sub-microsecond timestamp, a `Date64`
/// that is not a whole day.
pub(crate) fn to_stored(
    rows: &RecordBatch,
    target: &SchemaRef,
    table: &str,
    stored: &Stored,
) -> Result<RecordBatch> {
    let columns = rows
        .columns()
        .iter()
        .zip(target.fields())
        .map(|(column, field)| {
            convert(column, field.data_type(), stored).map_err(|reason| Error::TargetType {
                target: table.to_owned(),
                column: field.name().clone(),
                reason,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let options = RecordBatchOptions::new().with_row_count(Some(rows.num_rows()));
    RecordBatch::try_new_with_options(Arc::clone(target), columns, &options)
        .map_err(Error::arrow(table))
}

fn convert(
    column: &ArrayRef,
    target: &DataType,
    stored: &Stored,
) -> std::result::Result<ArrayRef, String> {
    let source = column.data_type();
    let values = match source {
        DataType::Dictionary(_, values) => values.as_ref(),
        other => other,
    };
    if matches!(
        (values, target),
        (
            DataType::Timestamp(TimeUnit::Nanosecond, _),
            DataType::Timestamp(TimeUnit::Microsecond, _)
        )
    ) {
        let plain = cast_checked(column, values, stored)?;
        let nanos = plain.as_primitive::<TimestampNanosecondType>();
        if let Some(row) =
            (0..nanos.len()).find(|&r| nanos.is_valid(r) && nanos.value(r) % 1000 != 0)
        {
            return Err(format!(
                "value {} has a sub-microsecond part, which {}'s microsecond timestamps \
                 cannot hold",
                show(&plain, row),
                stored.system
            ));
        }
    }
    if matches!((values, target), (DataType::Date64, DataType::Date32)) {
        let plain = cast_checked(column, values, stored)?;
        let millis = plain.as_primitive::<Date64Type>();
        if let Some(row) =
            (0..millis.len()).find(|&r| millis.is_valid(r) && millis.value(r) % MILLIS_PER_DAY != 0)
        {
            return Err(format!(
                "value {} is not a whole day, which a {} date cannot hold",
                show(&plain, row),
                stored.system
            ));
        }
    }
    let converted = if source == target {
        Arc::clone(column)
    } else {
        cast_checked(column, target, stored)?
    };
    if let DataType::Decimal128(precision, scale) = target {
        let decimals = converted.as_primitive::<Decimal128Type>();
        if let Some(row) = (0..decimals.len()).find(|&r| {
            decimals.is_valid(r)
                && !Decimal128Type::is_valid_decimal_precision(decimals.value(r), *precision)
        }) {
            return Err(format!(
                "value {} has more digits than the column's precision {precision}",
                // Arrow's display cuts a value to the declared precision: show it whole.
                Decimal128Type::format_decimal(decimals.value(row), MAX_DECIMAL_PRECISION, *scale)
            ));
        }
    }
    if is_nested(target) && source != target {
        // Casts inside lists and structs are not checked value by value: converting back
        // must give the original values.
        let back = cast_checked(&converted, source, stored)?;
        if back.to_data() != column.to_data() {
            return Err(format!(
                "its values change when converted from {source} to {target}"
            ));
        }
    }
    Ok(converted)
}

fn is_nested(data_type: &DataType) -> bool {
    matches!(
        data_type,
        DataType::List(_) | DataType::Struct(_) | DataType::Map(_, _)
    )
}

/// A cast that turns a value it cannot represent into an error naming the value, instead
/// of a null.
fn cast_checked(
    column: &ArrayRef,
    target: &DataType,
    stored: &Stored,
) -> std::result::Result<ArrayRef, String> {
    let options = CastOptions {
        safe: true,
        ..CastOptions::default()
    };
    let cast = cast_with_options(column, target, &options)
        .map_err(|e| format!("cannot convert {} to {target}: {e}", column.data_type()))?;
    if cast.null_count() != column.null_count()
        && let Some(row) = (0..column.len()).find(|&r| column.is_valid(r) && cast.is_null(r))
    {
        return Err(format!(
            "value {} does not fit the table's type {}",
            show(column, row),
            (stored.type_name)(target)
        ));
    }
    Ok(cast)
}

fn show(column: &ArrayRef, row: usize) -> String {
    array_value_to_string(column, row).unwrap_or_else(|_| format!("at row {row}"))
}
