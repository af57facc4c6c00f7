//! Partitioned tables: Hive-style directories (`status=shipped/part-….parquet`), Delta
//! `partitionValues`, and the partition columns given back to rows read from files that do
//! not store them.
//!
//! Values are written and escaped the way deltalake-core writes them (its kernel's scalar
//! serialisation), so any Delta reader finds the same partitions. Values written by other
//! writers are parsed with the column's type and re-serialised, so that two spellings of
//! one value (`2024-01-01 00:00:00` and `2024-01-01 00:00:00.000000`) are one partition.

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, RecordBatch, StringArray, new_null_array};
use arrow::compute::{CastOptions, cast_with_options};
use arrow::datatypes::{DataType, FieldRef, SchemaRef, TimeUnit};
use arrow::row::{RowConverter, SortField};
use delta_kernel::expressions::Scalar;
use deltalake_core::NULL_PARTITION_VALUE_DATA_PATH;
use deltalake_core::kernel::scalars::ScalarExt;
use hashbrown::HashMap as FastMap;

use crate::error::{Error, Result};
use crate::read::input::ConstantColumns;

/// The partition columns of a table, with their types.
#[derive(Debug, Clone)]
pub(crate) struct Partitioning {
    fields: Vec<FieldRef>,
}

/// One partition: each partition column's value as Delta text (`None` for null), in the
/// table's partition-column order.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct PartitionValues(Vec<Option<String>>);

impl Partitioning {
    /// The partitioning of a table with `schema` by `columns`; `None` for no columns.
    ///
    /// # Errors
    /// A column the schema does not have.
    pub fn try_new(columns: &[String], schema: &SchemaRef, table: &str) -> Result<Option<Self>> {
        if columns.is_empty() {
            return Ok(None);
        }
        let fields = columns
            .iter()
            .map(|c| {
                schema
                    .field_with_name(c)
                    .map(|f| Arc::new(f.clone()))
                    .map_err(|_| Error::MissingRequiredColumn {
                        path: table.into(),
                        column: c.clone(),
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(Self { fields }))
    }

    /// Checks that idem can create a table partitioned this way: a type whose values make
    /// exact, readable directory names, and at least one column left for the files.
    ///
    /// # Errors
    /// A float, decimal, binary, nested or non-UTC timestamp column, or every column a
    /// partition column.
    pub fn check_creatable(&self, schema: &SchemaRef, table: &str) -> Result<()> {
        for field in &self.fields {
            let supported = match field.data_type() {
                DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64 => true,
                DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => true,
                DataType::Boolean | DataType::Date32 => true,
                DataType::Timestamp(TimeUnit::Microsecond, None) => true,
                DataType::Timestamp(TimeUnit::Microsecond, Some(tz)) => {
                    tz.eq_ignore_ascii_case("utc")
                }
                _ => false,
            };
            if !supported {
                return Err(Error::InvalidArgument(format!(
                    "{table}: cannot partition by '{}' of type {}: use an integer, string, \
                     boolean, date or microsecond UTC timestamp column",
                    field.name(),
                    field.data_type()
                )));
            }
        }
        if self.fields.len() >= schema.fields().len() {
            return Err(Error::InvalidArgument(format!(
                "{table}: every column is a partition column; a Delta table needs one in its \
                 files"
            )));
        }
        Ok(())
    }

    /// The partition column names, in order.
    pub fn columns(&self) -> Vec<String> {
        self.fields.iter().map(|f| f.name().clone()).collect()
    }

    /// Whether `name` is a partition column.
    pub fn contains(&self, name: &str) -> bool {
        self.fields.iter().any(|f| f.name() == name)
    }

    /// The partition of every row: the distinct partitions in order of first appearance,
    /// and for each row the index of its partition among them.
    pub fn of_rows(&self, rows: &RecordBatch) -> Result<(Vec<PartitionValues>, Vec<u32>)> {
        let columns: Vec<ArrayRef> = self
            .fields
            .iter()
            .map(|f| {
                rows.column_by_name(f.name())
                    .cloned()
                    .ok_or_else(|| Error::MissingRequiredColumn {
                        path: "batch".into(),
                        column: f.name().clone(),
                    })
            })
            .collect::<Result<_>>()?;
        let converter = RowConverter::new(
            columns
                .iter()
                .map(|c| SortField::new(c.data_type().clone()))
                .collect(),
        )
        .map_err(Error::arrow(""))?;
        let encoded = converter
            .convert_columns(&columns)
            .map_err(Error::arrow(""))?;
        let mut index: FastMap<&[u8], u32> = FastMap::new();
        let mut partitions = Vec::new();
        let mut of_row = Vec::with_capacity(rows.num_rows());
        for row in 0..rows.num_rows() {
            let next = partitions.len() as u32;
            let group = *index.entry(encoded.row(row).data()).or_insert(next);
            if group == next {
                partitions.push(PartitionValues(
                    columns
                        .iter()
                        .map(|c| text_of(c.as_ref(), row))
                        .collect::<Result<_>>()?,
                ));
            }
            of_row.push(group);
        }
        Ok((partitions, of_row))
    }

    /// A file's partition from its raw `partitionValues` (as any writer wrote them), and
    /// the columns to give back to its rows.
    ///
    /// # Errors
    /// A missing partition column or a value that does not parse as the column's type.
    pub fn of_file(
        &self,
        raw: &HashMap<String, Option<String>>,
        path: &str,
    ) -> Result<(PartitionValues, Arc<ConstantColumns>)> {
        let mut values = Vec::with_capacity(self.fields.len());
        let mut columns = Vec::with_capacity(self.fields.len());
        for field in &self.fields {
            let Some(value) = raw.get(field.name()) else {
                return Err(Error::InvalidArgument(format!(
                    "{path}: no partition value for column '{}'",
                    field.name()
                )));
            };
            let array = match value {
                None => new_null_array(field.data_type(), 1),
                Some(text) => {
                    let text: ArrayRef = Arc::new(StringArray::from(vec![text.as_str()]));
                    let strict = CastOptions {
                        safe: false,
                        ..CastOptions::default()
                    };
                    cast_with_options(&text, field.data_type(), &strict).map_err(|e| {
                        Error::InvalidArgument(format!(
                            "{path}: partition value '{text:?}' of column '{}' is not a {}: {e}",
                            field.name(),
                            field.data_type()
                        ))
                    })?
                }
            };
            values.push(text_of(array.as_ref(), 0)?);
            columns.push((Arc::clone(field), array));
        }
        Ok((
            PartitionValues(values),
            Arc::new(ConstantColumns::try_new(columns)?),
        ))
    }

    /// The Hive directory of a partition, escaped as Delta writers escape it.
    pub fn directory(&self, values: &PartitionValues) -> String {
        self.fields
            .iter()
            .zip(&values.0)
            .map(|(field, value)| {
                let encoded = match value {
                    None => NULL_PARTITION_VALUE_DATA_PATH.to_owned(),
                    Some(text) => Scalar::String(text.clone()).serialize_encoded(),
                };
                format!("{}={encoded}", field.name())
            })
            .collect::<Vec<_>>()
            .join("/")
    }

    /// A partition as Delta `partitionValues`.
    pub fn raw(&self, values: &PartitionValues) -> HashMap<String, Option<String>> {
        self.fields
            .iter()
            .map(|f| f.name().clone())
            .zip(values.0.iter().cloned())
            .collect()
    }

    /// The rows without the partition columns: what a partitioned table's files store.
    pub fn strip(&self, rows: &RecordBatch) -> Result<RecordBatch> {
        let keep: Vec<usize> = (0..rows.num_columns())
            .filter(|&i| !self.contains(rows.schema().field(i).name()))
            .collect();
        rows.project(&keep).map_err(Error::arrow(""))
    }
}

/// A value as Delta partition text (`None` for null).
fn text_of(array: &dyn Array, row: usize) -> Result<Option<String>> {
    if array.is_null(row) {
        return Ok(None);
    }
    Scalar::from_array(array, row)
        .map(|s| Some(s.serialize()))
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "values of type {} cannot be partition values",
                array.data_type()
            ))
        })
}

#[cfg(test)]
mod tests {
    use arrow::array::{Date32Array, Int64Array};
    use arrow::datatypes::{Field, Schema};

    use super::*;

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("country", DataType::Utf8, true),
            Field::new("day", DataType::Date32, true),
            Field::new("n", DataType::Int64, true),
        ]))
    }

    fn partitioning() -> Partitioning {
        Partitioning::try_new(&["country".into(), "day".into()], &schema(), "t")
            .expect("columns exist")
            .expect("partitioned")
    }

    #[test]
    fn rows_group_by_partition_and_directories_escape_like_delta() {
        let rows = RecordBatch::try_new(
            schema(),
            vec![
                Arc::new(StringArray::from(vec![
                    Some("DE"),
                    Some("a/b c"),
                    None,
                    Some("DE"),
                ])),
                Arc::new(Date32Array::from(vec![19_000, 19_000, 0, 19_000])),
                Arc::new(Int64Array::from(vec![1, 2, 3, 4])),
            ],
        )
        .expect("rows");
        let p = partitioning();
        let (partitions, of_row) = p.of_rows(&rows).expect("partitions");
        assert_eq!(of_row, vec![0, 1, 2, 0]);
        assert_eq!(p.directory(&partitions[0]), "country=DE/day=2022-01-08");
        assert_eq!(
            p.directory(&partitions[1]),
            "country=a%2Fb%20c/day=2022-01-08"
        );
        assert_eq!(
            p.directory(&partitions[2]),
            "country=__HIVE_DEFAULT_PARTITION__/day=1970-01-01"
        );
        assert_eq!(p.raw(&partitions[2])["country"], None);
        assert_eq!(p.strip(&rows).expect("strip").num_columns(), 1);
    }

    #[test]
    fn file_partitions_parse_to_the_same_values_and_refuse_bad_text() {
        let p = partitioning();
        let raw: HashMap<String, Option<String>> = [
            ("country".to_owned(), Some("DE".to_owned())),
            ("day".to_owned(), Some("2022-01-08".to_owned())),
        ]
        .into();
        let (values, _) = p.of_file(&raw, "f").expect("parses");
        assert_eq!(p.raw(&values), raw);
        let bad: HashMap<String, Option<String>> = [
            ("country".to_owned(), None),
            ("day".to_owned(), Some("yesterday".to_owned())),
        ]
        .into();
        let error = p.of_file(&bad, "f").expect_err("not a date").to_string();
        assert!(
            error.contains("day") && error.contains("yesterday"),
            "{error}"
        );
        let missing: HashMap<String, Option<String>> = HashMap::new();
        assert!(p.of_file(&missing, "f").is_err());
    }

    #[test]
    fn creation_refuses_types_without_exact_directory_names() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("x", DataType::Float64, true),
            Field::new("n", DataType::Int64, true),
        ]));
        let by_x = Partitioning::try_new(&["x".into()], &schema, "t")
            .expect("exists")
            .expect("some");
        assert!(by_x.check_creatable(&schema, "t").is_err());
        let by_all = Partitioning::try_new(&["n".into(), "x".into()], &schema, "t")
            .expect("exists")
            .expect("some");
        assert!(by_all.check_creatable(&schema, "t").is_err());
        assert!(Partitioning::try_new(&["nope".into()], &schema, "t").is_err());
    }
}
