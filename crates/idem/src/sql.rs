//! `idem sql`: one SQL statement in a DataFusion session with idem's functions registered.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use arrow::array::RecordBatch;
use datafusion::physical_plan::{collect, execute_stream};
use datafusion::prelude::{SessionConfig, SessionContext};
use futures::StreamExt;

use crate::datafusion_runtime::storage_runtime;
use crate::error::{Error, Result};
use crate::storage::StorageOptions;
use crate::write::output::OutputWriter;

/// What a statement produced.
#[derive(Debug)]
pub enum SqlOutput {
    /// The result rows, to show.
    Rows(Vec<RecordBatch>),
    /// The result was written to these Parquet files.
    Written {
        /// Files written.
        files: Vec<PathBuf>,
        /// Rows written.
        rows: u64,
    },
}

/// A session like `datafusion-cli`'s: idem registered, file paths usable as table
/// names (`SELECT * FROM 'data/events/*.parquet'`, also `s3://…` URLs, configured from
/// the environment and `storage`), and settings taken from `DATAFUSION_*`
/// environment variables (`DATAFUSION_EXECUTION_TARGET_PARTITIONS=4`). With `memory_limit`, operators share
/// a pool of that many bytes and spill (sorts, aggregates, `DedupExec`) when it is full.
///
/// # Errors
/// The runtime cannot be built, or a `DATAFUSION_*` variable does not parse.
pub fn session(memory_limit: Option<u64>, storage: &StorageOptions) -> Result<SessionContext> {
    let ctx = SessionContext::new_with_config_rt(
        SessionConfig::from_env()?.with_information_schema(true),
        storage_runtime(memory_limit, storage)?,
    )
    .enable_url_table();
    idem_datafusion::register(&ctx);
    Ok(ctx)
}

#[cfg(feature = "ballista")]
async fn cluster_session(url: &str, storage: &StorageOptions) -> Result<SessionContext> {
    Ok(idem_ballista::remote_with_runtime(
        url,
        SessionConfig::from_env()?,
        storage_runtime(None, storage)?,
    )
    .await?)
}

#[cfg(not(feature = "ballista"))]
async fn cluster_session(url: &str, _storage: &StorageOptions) -> Result<SessionContext> {
    Err(Error::InvalidArgument(format!(
        "--cluster {url}: this idem was built without the `ballista` feature"
    )))
}

/// A statement's result and what its dedup operators counted.
#[derive(Debug)]
pub struct SqlRun {
    /// The rows, or where they were written.
    pub output: SqlOutput,
    /// Counters of the plan's dedup operators (`DedupExec`, `LateDedupExec`), summed over
    /// operators and partitions: `rows_in`, `rows_out`, `duplicates`, `superseded`,
    /// `deleted`, `conflicts`, `null_keys`, spills, `key_partitions`. Empty when the query
    /// deduplicates nothing.
    pub dedup: BTreeMap<String, u64>,
    /// Dedup operators in the plan.
    pub dedup_operators: usize,
    /// Wall time of planning and execution.
    pub elapsed_seconds: f64,
}

/// Runs `query`; with `output` (a path or URL), streams its result into Parquet there
/// (atomically, as `idem dedup` writes), otherwise returns the rows.
///
/// # Errors
/// Planning or execution errors, or a failure to write the output.
pub fn run_sql(
    query: &str,
    output: Option<&str>,
    max_rows_per_file: usize,
    memory_limit: Option<u64>,
    storage: &StorageOptions,
) -> Result<SqlRun> {
    run_sql_on(
        query,
        output,
        max_rows_per_file,
        memory_limit,
        storage,
        None,
    )
}

/// [`run_sql`], on the Ballista cluster whose scheduler is at `cluster` (`df://host:port`)
/// when given: the query is planned there and runs on its executors, and the rows come
/// back here to be printed or written. The executors read the inputs themselves, so paths
/// must be valid on them (a shared path or object storage).
///
/// # Errors
/// As [`run_sql`], or a scheduler that cannot be reached.
pub fn run_sql_on(
    query: &str,
    output: Option<&str>,
    max_rows_per_file: usize,
    memory_limit: Option<u64>,
    storage: &StorageOptions,
    cluster: Option<&str>,
) -> Result<SqlRun> {
    let started = std::time::Instant::now();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(Error::io("tokio runtime"))?;
    let (output, plan) = runtime.block_on(async {
        let ctx = match cluster {
            None => session(memory_limit, storage)?,
            Some(url) => cluster_session(url, storage).await?,
        };
        let plan = ctx.sql(query).await?.create_physical_plan().await?;
        let task = ctx.task_ctx();
        let output = match output {
            None => SqlOutput::Rows(collect(Arc::clone(&plan), task).await?),
            Some(path) => {
                let mut stream = execute_stream(Arc::clone(&plan), task)?;
                let schema = Arc::clone(&stream.schema());
                let mut writer = OutputWriter::create(path, schema, max_rows_per_file, storage)?;
                let mut rows = 0u64;
                while let Some(batch) = stream.next().await {
                    let batch = batch?;
                    rows += batch.num_rows() as u64;
                    writer.write(&batch)?;
                }
                SqlOutput::Written {
                    files: writer.commit()?,
                    rows,
                }
            }
        };
        Ok::<_, Error>((output, plan))
    })?;
    let (dedup, dedup_operators) = idem_datafusion::dedup_counters(&plan, None);
    Ok(SqlRun {
        output,
        dedup,
        dedup_operators,
        elapsed_seconds: started.elapsed().as_secs_f64(),
    })
}

/// Rows as a text table, as `datafusion-cli` prints them.
///
/// # Errors
/// A value that cannot be displayed.
pub fn format_table(batches: &[RecordBatch]) -> Result<String> {
    datafusion::arrow::util::pretty::pretty_format_batches(batches)
        .map(|table| table.to_string())
        .map_err(|e| Error::DataFusion(e.into()))
}
