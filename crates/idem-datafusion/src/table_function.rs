//! The SQL table function `dedup(source, keys, versions [, options])`.
//!
//! * `source`: a registered table (`'events'`, `'schema.events'`) or a path, directory,
//!   URL or glob of Parquet or Arrow IPC files (`'data/events/*.parquet'`).
//! * `keys`, `versions`: comma-separated column names (`'event_id,sequence'`, `'lsn'`).
//! * `options`: comma-separated `name=value` pairs: `on_tie=first|last|error`,
//!   `op=COLUMN`, `delete_values=d|DELETE` (values separated by `|`),
//!   `keep_tombstones=true|false`.
//!
//! ```sql
//! SELECT * FROM dedup('events', 'event_id,sequence', 'lsn', 'op=op') WHERE status = 'paid'
//! ```

use std::sync::Arc;

use datafusion::catalog::{Session, TableFunctionArgs, TableFunctionImpl, TableProvider};
use datafusion::common::{Result, ScalarValue, TableReference, plan_datafusion_err, plan_err};
use datafusion::datasource::file_format::FileFormat;
use datafusion::datasource::file_format::arrow::ArrowFormat;
use datafusion::datasource::file_format::parquet::ParquetFormat;
use datafusion::datasource::listing::{
    ListingOptions, ListingTable, ListingTableConfig, ListingTableUrl,
};
use datafusion::logical_expr::Expr;
use idem_core::{DedupOptions, DedupSpec, DeletePolicy, TiePolicy};

use crate::provider::DedupTable;

/// Implements `dedup(...)`; registered by [`crate::register`].
#[derive(Debug, Default)]
pub struct DedupTableFunc;

fn text_arg(args: &[Expr], index: usize, what: &str) -> Result<Option<String>> {
    match args.get(index) {
        None => Ok(None),
        Some(Expr::Literal(
            ScalarValue::Utf8(Some(s))
            | ScalarValue::LargeUtf8(Some(s))
            | ScalarValue::Utf8View(Some(s)),
            _,
        )) => Ok(Some(s.clone())),
        Some(other) => plan_err!("dedup(): {what} must be a text literal, got {other}"),
    }
}

fn columns(list: &str) -> Vec<String> {
    list.split(',')
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Parses `name=value, …` options.
pub fn parse_options(text: &str) -> Result<DedupOptions> {
    let mut options = DedupOptions::default();
    let mut op = None;
    let mut delete_values = None;
    let mut keep_tombstones = false;
    for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, value) = pair
            .split_once('=')
            .ok_or_else(|| plan_datafusion_err!("dedup(): option '{pair}' is not name=value"))?;
        let value = value.trim();
        match name.trim() {
            "on_tie" => {
                options.on_tie = value
                    .parse::<TiePolicy>()
                    .map_err(|e| plan_datafusion_err!("dedup(): {e}"))?
            }
            "op" => op = Some(value.to_owned()),
            "delete_values" => delete_values = Some(value.split('|').map(str::to_owned).collect()),
            "keep_tombstones" => {
                keep_tombstones = value.parse().map_err(|_| {
                    plan_datafusion_err!("dedup(): keep_tombstones must be true or false")
                })?;
            }
            other => {
                return plan_err!(
                    "dedup(): unknown option '{other}' (on_tie, op, delete_values, keep_tombstones)"
                );
            }
        }
    }
    match op {
        Some(op) => {
            let mut deletes = DeletePolicy::new(op);
            if let Some(values) = delete_values {
                deletes.delete_values = values;
            }
            deletes.keep_tombstones = keep_tombstones;
            options.deletes = Some(deletes);
        }
        None if delete_values.is_some() || keep_tombstones => {
            return plan_err!("dedup(): delete_values and keep_tombstones need op=COLUMN");
        }
        None => {}
    }
    Ok(options)
}

fn looks_like_path(source: &str) -> bool {
    source.contains(['/', '*', '?', '\\'])
        || source.contains("://")
        || [".parquet", ".arrow", ".ipc", ".feather"]
            .iter()
            .any(|e| source.ends_with(e))
}

/// Runs a future to completion from synchronous planning code. Table lookups and schema
/// inference of local or in-memory sources finish without the calling thread's help.
fn block_on<F: std::future::Future>(future: F) -> F::Output {
    futures::executor::block_on(future)
}

/// The table or files named by `source`.
pub fn resolve_source(session: &dyn Session, source: &str) -> Result<Arc<dyn TableProvider>> {
    if !looks_like_path(source) {
        let reference = TableReference::from(source);
        let options = &session.config_options().catalog;
        let catalog_name = reference
            .catalog()
            .unwrap_or(&options.default_catalog)
            .to_owned();
        let schema_name = reference
            .schema()
            .unwrap_or(&options.default_schema)
            .to_owned();
        if let Some(schema) = session
            .catalog_list()
            .catalog(&catalog_name)
            .and_then(|c| c.schema(&schema_name))
            && let Some(table) = block_on(schema.table(reference.table()))?
        {
            return Ok(table);
        }
        return plan_err!(
            "dedup(): no table named '{source}' (name a registered table, or a path to Parquet / IPC files)"
        );
    }
    let url = ListingTableUrl::parse(source)?;
    let ipc = [".arrow", ".ipc", ".feather"]
        .iter()
        .any(|e| source.ends_with(e));
    let (format, extension): (Arc<dyn FileFormat>, &str) = if ipc {
        let extension = source.rsplit_once('.').map_or(".arrow", |(_, e)| {
            if e == "ipc" {
                ".ipc"
            } else if e == "feather" {
                ".feather"
            } else {
                ".arrow"
            }
        });
        (Arc::new(ArrowFormat), extension)
    } else {
        (Arc::new(ParquetFormat::default()), ".parquet")
    };
    let options = ListingOptions::new(format).with_file_extension(extension);
    let config = block_on(
        ListingTableConfig::new(url)
            .with_listing_options(options)
            .infer_schema(session),
    )?;
    Ok(Arc::new(ListingTable::try_new(config)?))
}

impl TableFunctionImpl for DedupTableFunc {
    fn call_with_args(&self, args: TableFunctionArgs) -> Result<Arc<dyn TableProvider>> {
        let exprs = args.exprs();
        if !(3..=4).contains(&exprs.len()) {
            return plan_err!(
                "dedup(source, keys, versions [, options]) takes 3 or 4 arguments, got {}",
                exprs.len()
            );
        }
        let source = text_arg(exprs, 0, "source")?.unwrap_or_default();
        let keys = columns(&text_arg(exprs, 1, "keys")?.unwrap_or_default());
        let versions = columns(&text_arg(exprs, 2, "versions")?.unwrap_or_default());
        if keys.is_empty() {
            return plan_err!("dedup(): give at least one key column");
        }
        let options = parse_options(&text_arg(exprs, 3, "options")?.unwrap_or_default())?;
        let table = resolve_source(args.session(), &source)?;
        Ok(Arc::new(DedupTable::try_new(
            table,
            DedupSpec::new(keys, versions).with_options(options),
        )?))
    }
}
