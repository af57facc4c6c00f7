//! The event-time column that `--state` and `--report` read: checked to be a timestamp or
//! a date, and read as zone-less timestamps.

use std::path::Path;

use arrow::array::{ArrayRef, RecordBatch};
use arrow::compute::cast;
use arrow::datatypes::{DataType, TimeUnit};

use super::input::InputFile;
use crate::error::{Error, Result};

/// Checks that `file` has the event-time column `column`, as a timestamp or date.
///
/// # Errors
/// The column is missing or of another type, named with the file.
pub(crate) fn check_time_column(file: &InputFile, column: &str) -> Result<()> {
    let field =
        file.schema()
            .field_with_name(column)
            .map_err(|_| Error::MissingRequiredColumn {
                path: file.path().to_path_buf(),
                column: column.to_owned(),
            })?;
    if is_temporal(field.data_type()) {
        Ok(())
    } else {
        Err(time_type_error(file.path(), column, field.data_type()))
    }
}

fn is_temporal(data_type: &DataType) -> bool {
    matches!(
        data_type,
        DataType::Timestamp(_, _) | DataType::Date32 | DataType::Date64
    )
}

fn time_type_error(path: &Path, column: &str, found: &DataType) -> Error {
    Error::SchemaMismatch {
        path: path.to_path_buf(),
        column: column.to_owned(),
        expected: "a timestamp or date (--time-column)".to_owned(),
        found: found.to_string(),
    }
}

/// The time column of `batch` as a zone-less timestamp in `unit`; a missing or
/// non-temporal column is an error naming the file and column.
pub(crate) fn event_times(
    batch: &RecordBatch,
    column: &str,
    path: &Path,
    unit: TimeUnit,
) -> Result<ArrayRef> {
    let values = batch
        .column_by_name(column)
        .ok_or_else(|| Error::MissingRequiredColumn {
            path: path.to_path_buf(),
            column: column.to_owned(),
        })?;
    if !is_temporal(values.data_type()) {
        return Err(time_type_error(path, column, values.data_type()));
    }
    cast(values, &DataType::Timestamp(unit, None)).map_err(Error::arrow(path))
}
