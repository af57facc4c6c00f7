//! One schema for many files: unification by column name, and conforming batches to it.
//!
//! Files of one dataset drift: columns get reordered, a nullable column is added later, a
//! writer switches a string column to dictionary encoding or an integer to a wider type.
//! Those are unified (first file's order and types win, integers widen, missing nullable
//! columns read as null). Anything else — a column that changes kind, a non-nullable
//! column that goes missing — is an error naming the file and the column.

use std::path::Path;
use std::sync::Arc;

use arrow::array::{ArrayRef, RecordBatch, RecordBatchOptions, new_null_array};
use arrow::compute::cast;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};

use crate::error::{Error, Result};

fn is_text(dt: &DataType) -> bool {
    match dt {
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => true,
        DataType::Dictionary(_, values) => is_text(values),
        _ => false,
    }
}

fn is_bytes(dt: &DataType) -> bool {
    match dt {
        DataType::Binary | DataType::LargeBinary | DataType::BinaryView => true,
        DataType::Dictionary(_, values) => is_bytes(values),
        _ => false,
    }
}

/// Whether two types hold the same values in different layouts (dictionary or plain, view
/// or offsets): no cast is needed for the kernels, which compare such values by content.
pub fn same_family(a: &DataType, b: &DataType) -> bool {
    a == b || (is_text(a) && is_text(b)) || (is_bytes(a) && is_bytes(b))
}

/// The type both `a` (so far) and `b` (a new file) can be read as, if any.
fn merge_types(a: &DataType, b: &DataType) -> Option<DataType> {
    use DataType::*;
    if same_family(a, b) {
        return Some(a.clone());
    }
    let rank = |dt: &DataType| match dt {
        Int8 => Some((true, 1)),
        Int16 => Some((true, 2)),
        Int32 => Some((true, 3)),
        Int64 => Some((true, 4)),
        UInt8 => Some((false, 1)),
        UInt16 => Some((false, 2)),
        UInt32 => Some((false, 3)),
        UInt64 => Some((false, 4)),
        _ => None,
    };
    match (a, b) {
        (Decimal128(pa, sa), Decimal128(pb, sb)) if sa == sb => {
            Some(Decimal128((*pa).max(*pb), *sa))
        }
        _ => match (rank(a), rank(b)) {
            (Some((sa, ra)), Some((sb, rb))) if sa == sb => {
                Some(if ra >= rb { a.clone() } else { b.clone() })
            }
            _ => None,
        },
    }
}

/// Unifies the schemas of `files` (path, schema) by column name.
///
/// # Errors
/// [`Error::SchemaMismatch`] for incompatible types, [`Error::MissingRequiredColumn`] for a
/// non-nullable column absent from some file.
pub fn unify<'a>(files: impl IntoIterator<Item = (&'a Path, &'a SchemaRef)>) -> Result<SchemaRef> {
    let files: Vec<(&Path, &SchemaRef)> = files.into_iter().collect();
    let Some((_, first)) = files.first() else {
        return Err(Error::NoInput("no schema to unify".to_owned()));
    };
    let mut fields: Vec<Field> = first.fields().iter().map(|f| f.as_ref().clone()).collect();
    for (path, schema) in &files[1..] {
        for field in schema.fields() {
            match fields.iter_mut().find(|f| f.name() == field.name()) {
                Some(existing) => {
                    let merged =
                        merge_types(existing.data_type(), field.data_type()).ok_or_else(|| {
                            Error::SchemaMismatch {
                                path: path.to_path_buf(),
                                column: field.name().clone(),
                                expected: existing.data_type().to_string(),
                                found: field.data_type().to_string(),
                            }
                        })?;
                    let nullable = existing.is_nullable() || field.is_nullable();
                    *existing = existing
                        .clone()
                        .with_data_type(merged)
                        .with_nullable(nullable);
                }
                // Earlier files lack it, so it reads as null there.
                None => fields.push(field.as_ref().clone().with_nullable(true)),
            }
        }
    }
    for (path, schema) in &files {
        for field in &fields {
            if schema.field_with_name(field.name()).is_err() && !field.is_nullable() {
                return Err(Error::MissingRequiredColumn {
                    path: path.to_path_buf(),
                    column: field.name().clone(),
                });
            }
        }
    }
    Ok(Arc::new(Schema::new_with_metadata(
        fields,
        first.metadata().clone(),
    )))
}

/// `schema` with its top-level text and binary columns as views (`Utf8View`, `BinaryView`).
///
/// The dedup carries rows in this layout between reading and writing: a view column
/// points into the decoded Parquet pages instead of holding a copy of its values, and
/// filtering, taking and slicing it moves 16-byte views rather than the values. The
/// Parquet writer takes views as it takes offsets, so the output's bytes and schema are
/// the same either way.
pub fn with_views(schema: &Schema) -> Schema {
    let fields: Vec<Field> = schema
        .fields()
        .iter()
        .map(|field| {
            let viewed = match field.data_type() {
                DataType::Utf8 | DataType::LargeUtf8 => DataType::Utf8View,
                DataType::Binary | DataType::LargeBinary => DataType::BinaryView,
                other => other.clone(),
            };
            field.as_ref().clone().with_data_type(viewed)
        })
        .collect();
    Schema::new_with_metadata(fields, schema.metadata().clone())
}

/// Reshapes `batch` (read from `path`) to `target`: columns by name in the target's order,
/// cast to the target's types, absent columns as nulls. With `keep_layouts`, a column whose
/// type is only another layout of the target's (dictionary or plain) is left as it is.
pub fn conform(
    batch: &RecordBatch,
    target: &SchemaRef,
    keep_layouts: bool,
    path: &Path,
) -> Result<RecordBatch> {
    if batch.schema_ref() == target {
        return Ok(batch.clone());
    }
    let mut fields = Vec::with_capacity(target.fields().len());
    let mut columns: Vec<ArrayRef> = Vec::with_capacity(target.fields().len());
    for field in target.fields() {
        let column = match batch.column_by_name(field.name()) {
            None => new_null_array(field.data_type(), batch.num_rows()),
            Some(c) if c.data_type() == field.data_type() => Arc::clone(c),
            Some(c) if keep_layouts && same_family(c.data_type(), field.data_type()) => {
                Arc::clone(c)
            }
            Some(c) => cast(c, field.data_type()).map_err(Error::arrow(path))?,
        };
        fields.push(
            field
                .as_ref()
                .clone()
                .with_data_type(column.data_type().clone()),
        );
        columns.push(column);
    }
    let schema = Arc::new(Schema::new_with_metadata(fields, target.metadata().clone()));
    let options = RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
    RecordBatch::try_new_with_options(schema, columns, &options).map_err(Error::arrow(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema(fields: Vec<Field>) -> SchemaRef {
        Arc::new(Schema::new(fields))
    }

    #[test]
    fn unifies_order_layouts_widths_and_missing_nullable_columns() {
        let a = schema(vec![
            Field::new("id", DataType::Utf8, false),
            Field::new("n", DataType::Int32, false),
        ]);
        let b = schema(vec![
            Field::new("note", DataType::Utf8, true),
            Field::new("n", DataType::Int64, false),
            Field::new(
                "id",
                DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8)),
                false,
            ),
        ]);
        let unified = unify([(Path::new("a"), &a), (Path::new("b"), &b)]).expect("unify");
        let names: Vec<_> = unified
            .fields()
            .iter()
            .map(|f| (f.name().as_str(), f.data_type().clone()))
            .collect();
        assert_eq!(
            names,
            vec![
                ("id", DataType::Utf8),
                ("n", DataType::Int64),
                ("note", DataType::Utf8)
            ]
        );
        assert!(unified.field(2).is_nullable());
    }

    #[test]
    fn views_replace_top_level_text_and_binary_only() {
        let dictionary = DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8));
        let list = DataType::new_list(DataType::Utf8, true);
        let stored = Schema::new_with_metadata(
            vec![
                Field::new("a", DataType::Utf8, false),
                Field::new("b", DataType::LargeUtf8, true),
                Field::new("c", DataType::Binary, true),
                Field::new("d", DataType::LargeBinary, false),
                Field::new("e", dictionary.clone(), false),
                Field::new("f", list.clone(), true),
                Field::new("g", DataType::Int64, false),
                Field::new("h", DataType::Utf8View, true),
            ],
            [("origin".to_owned(), "test".to_owned())].into(),
        );
        let viewed = with_views(&stored);
        let types: Vec<(&str, DataType, bool)> = viewed
            .fields()
            .iter()
            .map(|f| (f.name().as_str(), f.data_type().clone(), f.is_nullable()))
            .collect();
        assert_eq!(
            types,
            vec![
                ("a", DataType::Utf8View, false),
                ("b", DataType::Utf8View, true),
                ("c", DataType::BinaryView, true),
                ("d", DataType::BinaryView, false),
                ("e", dictionary, false),
                ("f", list, true),
                ("g", DataType::Int64, false),
                ("h", DataType::Utf8View, true),
            ]
        );
        assert_eq!(viewed.metadata(), stored.metadata());
    }

    #[test]
    fn rejects_kind_changes_and_missing_required_columns() {
        let a = schema(vec![Field::new("id", DataType::Utf8, false)]);
        let b = schema(vec![Field::new("id", DataType::Int64, false)]);
        let err = unify([(Path::new("a.parquet"), &a), (Path::new("b.parquet"), &b)])
            .expect_err("mismatch");
        assert!(
            err.to_string().contains("b.parquet") && err.to_string().contains("'id'"),
            "{err}"
        );
        let c = schema(vec![Field::new("other", DataType::Utf8, true)]);
        let err = unify([(Path::new("a.parquet"), &a), (Path::new("c.parquet"), &c)])
            .expect_err("missing");
        assert!(
            err.to_string().contains("c.parquet") && err.to_string().contains("'id'"),
            "{err}"
        );
    }
}
