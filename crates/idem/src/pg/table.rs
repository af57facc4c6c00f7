//! A table as the catalog describes it, and its rows read into Arrow by binary COPY.

use std::sync::Arc;

use arrow::array::{ArrayRef, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use futures::StreamExt;

use super::copy::RowDecoder;
use super::types::PgType;
use super::{Database, TableName, quote};
use crate::error::{Error, Result};

/// Rows per batch read from a table.
pub(crate) const READ_ROWS: usize = 1 << 16;

/// One column of a table, as the catalog lists it.
#[derive(Clone, Debug)]
pub(crate) struct CatalogColumn {
    /// Its name.
    pub name: String,
    /// Its type, where idem has it.
    pub pg: Option<PgType>,
    /// Its type as PostgreSQL spells it.
    pub shown: String,
}

/// A table's columns and unique constraints.
#[derive(Clone, Debug)]
pub(crate) struct TableColumns {
    /// The columns in table order.
    pub columns: Vec<CatalogColumn>,
    /// The column sets of its primary key and unique indexes (without predicates or
    /// expressions), each sorted by name.
    pub unique: Vec<Vec<String>>,
}

impl TableColumns {
    /// The column named `name`.
    pub(crate) fn get(&self, name: &str) -> Option<&CatalogColumn> {
        self.columns.iter().find(|c| c.name == name)
    }

    /// The column names, comma-separated, for messages.
    pub(crate) fn names(&self) -> String {
        self.columns
            .iter()
            .map(|c| c.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Whether a primary key or unique index covers exactly `keys`.
    pub(crate) fn is_unique_on(&self, keys: &[String]) -> bool {
        let mut wanted = keys.to_vec();
        wanted.sort();
        self.unique.contains(&wanted)
    }
}

impl Database {
    /// The schema unqualified names resolve to, if the search path names one.
    pub(crate) fn current_schema(&self) -> Result<Option<String>> {
        Ok(self
            .run(|c| c.query_one("SELECT current_schema()::text", &[]))?
            .get(0))
    }

    /// Connects to the database at `location` (a `postgres://` URL, the libpq environment
    /// filling the rest) for `table` (`[SCHEMA.]NAME`), returned quoted as
    /// `"schema"."name"` and as `schema.name`.
    pub(crate) fn open_table(location: &str, table: &str) -> Result<(Self, String, String)> {
        let settings = super::Settings::parse(location, |name| std::env::var(name).ok())?;
        let table = TableName::parse(table)?;
        let db = Database::connect(&settings)?;
        let (qualified, name) = db.resolve(&table)?;
        Ok((db, qualified, name))
    }

    /// `table` with its schema resolved, quoted as `"schema"."name"`, and `schema.name`.
    pub(crate) fn resolve(&self, table: &TableName) -> Result<(String, String)> {
        let schema = match &table.schema {
            Some(schema) => schema.clone(),
            None => self.current_schema()?.ok_or_else(|| Error::Postgres {
                target: self.display().to_owned(),
                message: format!(
                    "table {}: the search_path names no schema: give SCHEMA.NAME",
                    table.name
                ),
            })?,
        };
        Ok((table.qualified(&schema), format!("{schema}.{}", table.name)))
    }

    /// The columns and unique constraints of the table `qualified` (quoted), if it exists.
    pub(crate) fn table_columns(&self, qualified: &str) -> Result<Option<TableColumns>> {
        let qualified = qualified.to_owned();
        self.run(|c| async move {
            let oid: Option<u32> = c
                .query_one("SELECT to_regclass($1)::oid", &[&qualified])
                .await?
                .get(0);
            let Some(oid) = oid else {
                return Ok(None);
            };
            let columns = c
                .query(
                    "SELECT attname::text, atttypid, atttypmod, format_type(atttypid, atttypmod) \
                     FROM pg_attribute WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped \
                     ORDER BY attnum",
                    &[&oid],
                )
                .await?;
            let unique = c
                .query(
                    "SELECT array_agg(a.attname::text ORDER BY a.attname::text) \
                     FROM pg_index i JOIN pg_attribute a \
                       ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) \
                     WHERE i.indrelid = $1 AND i.indisunique AND i.indpred IS NULL \
                       AND i.indexprs IS NULL \
                     GROUP BY i.indexrelid",
                    &[&oid],
                )
                .await?;
            Ok(Some(TableColumns {
                columns: columns
                    .iter()
                    .map(|r| CatalogColumn {
                        name: r.get(0),
                        pg: PgType::from_catalog(r.get(1), r.get(2)),
                        shown: r.get(3),
                    })
                    .collect(),
                unique: unique.iter().map(|r| r.get(0)).collect(),
            }))
        })
    }

    /// Streams the rows of the query `sql` by binary COPY, in batches of up to
    /// [`READ_ROWS`] with `schema`, each column decoded from its PostgreSQL type in `types`.
    pub(crate) fn read_rows(
        &self,
        sql: &str,
        types: &[PgType],
        schema: &SchemaRef,
        mut on_batch: impl FnMut(RecordBatch) -> Result<()>,
    ) -> Result<()> {
        let columns: Vec<(PgType, DataType)> = types
            .iter()
            .zip(schema.fields())
            .map(|(t, f)| (*t, f.data_type().clone()))
            .collect();
        let mut decoder = RowDecoder::new(&columns);
        let fail = |message: String| Error::Postgres {
            target: self.display().to_owned(),
            message,
        };
        let batch = |arrays: Vec<ArrayRef>| {
            RecordBatch::try_new(Arc::clone(schema), arrays).map_err(|e| fail(e.to_string()))
        };
        let copy = format!("COPY ({sql}) TO STDOUT (FORMAT binary)");
        self.block_on(async {
            let stream = self
                .client()
                .copy_out(copy.as_str())
                .await
                .map_err(|e| self.error(&e))?;
            futures::pin_mut!(stream);
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(|e| self.error(&e))?;
                decoder.push(&chunk).map_err(fail)?;
                if decoder.rows() >= READ_ROWS {
                    on_batch(batch(decoder.take().map_err(fail)?)?)?;
                }
            }
            Ok::<_, Error>(())
        })?;
        if !decoder.finished() {
            return Err(fail("the server's COPY stream ended early".to_owned()));
        }
        on_batch(batch(decoder.take().map_err(fail)?)?)
    }

    /// All rows of [`Database::read_rows`] in one batch.
    pub(crate) fn read_all(
        &self,
        sql: &str,
        types: &[PgType],
        schema: &SchemaRef,
    ) -> Result<RecordBatch> {
        let mut parts = Vec::new();
        self.read_rows(sql, types, schema, |b| {
            parts.push(b);
            Ok(())
        })?;
        arrow::compute::concat_batches(schema, &parts).map_err(|e| Error::Postgres {
            target: self.display().to_owned(),
            message: e.to_string(),
        })
    }
}

/// A table opened for reading, as `idem verify` reads a target.
pub(crate) struct TableReader {
    db: Database,
    qualified: String,
    /// `schema.name`.
    pub name: String,
    columns: TableColumns,
}

impl TableReader {
    /// Connects and reads the catalog of `table` in the database at `location`.
    ///
    /// # Errors
    /// An unreachable database, or no such table.
    pub(crate) fn open(location: &str, table: &str) -> Result<Self> {
        let (db, qualified, name) = Database::open_table(location, table)?;
        let columns = db
            .table_columns(&qualified)?
            .ok_or_else(|| Error::Postgres {
                target: db.display().to_owned(),
                message: format!("table {name} does not exist"),
            })?;
        Ok(Self {
            db,
            qualified,
            name,
            columns,
        })
    }

    /// The server, database and table, without the password.
    pub(crate) fn display(&self) -> String {
        format!("{} table {}", self.db.display(), self.name)
    }

    /// The table's columns, in Arrow types that compare with `like`'s same-named columns.
    ///
    /// # Errors
    /// A column of `like` whose type idem cannot read.
    pub(crate) fn schema(&self, like: &Schema) -> Result<SchemaRef> {
        let mut fields = Vec::new();
        for column in &self.columns.columns {
            let wanted = like
                .field_with_name(&column.name)
                .map(|f| f.data_type().clone());
            match (&column.pg, wanted) {
                (Some(pg), wanted) => fields.push(Field::new(
                    &column.name,
                    pg.arrow(wanted.as_ref().unwrap_or(&DataType::Null)),
                    true,
                )),
                (None, Ok(_)) => {
                    return Err(Error::TargetType {
                        target: self.display(),
                        column: column.name.clone(),
                        reason: format!("idem cannot read PostgreSQL's {}", column.shown),
                    });
                }
                // A column idem cannot read and the sources lack is only named as extra.
                (None, Err(_)) => fields.push(Field::new(&column.name, DataType::Null, true)),
            }
        }
        Ok(Arc::new(Schema::new(fields)))
    }

    /// Streams the columns of `schema` (a projection of [`TableReader::schema`]).
    pub(crate) fn read(
        &self,
        schema: &SchemaRef,
        on_batch: impl FnMut(RecordBatch) -> Result<()>,
    ) -> Result<()> {
        let mut types = Vec::new();
        for field in schema.fields() {
            let pg = self
                .columns
                .get(field.name())
                .and_then(|c| c.pg)
                .ok_or_else(|| Error::TargetType {
                    target: self.display(),
                    column: field.name().clone(),
                    reason: "not a readable column of the table".to_owned(),
                })?;
            types.push(pg);
        }
        let list = schema
            .fields()
            .iter()
            .map(|f| quote(f.name()))
            .collect::<Vec<_>>()
            .join(", ");
        self.db.read_rows(
            &format!("SELECT {list} FROM {}", self.qualified),
            &types,
            schema,
            on_batch,
        )
    }
}
