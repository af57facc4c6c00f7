//! `idem dedup --cluster` and the cluster's processes (`idem cluster scheduler|executor`).
//!
//! A cluster dedup is planned here and runs on a Ballista cluster: the scheduler splits it
//! into a map stage (each task reads its share of the input files and hashes rows by key
//! into the shuffle) and a reduce stage (each task dedups one key partition and writes its
//! winners as Parquet parts into a hidden staging directory beside the output). Only the
//! tasks' counts come back. This process then commits the parts exactly as a local run
//! commits its own: renamed into `part-NNNNN.parquet` in partition order, the directory
//! swapped into place (or, on object storage, copied under the output prefix). A job that
//! fails leaves the previous output untouched and its staging directory removed.
//!
//! The same rows as a local `idem dedup`: the key, version, tie and delete semantics are
//! the same kernels, and the position of each row in the scan (DataFusion groups files in
//! sorted path order, a local run's order for a directory) decides ties. Files differ from a local run's only in how rows are spread over
//! parts; for given inputs and `--partitions`, the parts are the same bytes every run.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use datafusion::datasource::file_format::parquet::ParquetFormat;
use datafusion::datasource::listing::{
    ListingOptions, ListingTable, ListingTableConfig, ListingTableUrl,
};
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::prelude::{SessionConfig, SessionContext};
use idem_ballista::{PartWritten, PartsLayout, WriteParts, part_file_name, parts_written};
use idem_core::DedupStats;
use idem_datafusion::Dedup;
use parquet::arrow::ArrowWriter;
use url::Url;

use crate::datafusion_runtime::storage_runtime;
use crate::dedup::{ClusterRun, DedupJob, DedupReport, DedupRun, FileRows, open_inputs};
use crate::error::{Error, Result};
use crate::storage::{Location, RemoteLocation, StorageOptions};
use crate::write::properties::{
    MAX_DICTIONARY_PAGE_BYTES, MAX_ROW_GROUP_ROWS, WRITE_CHUNK_ROWS, fallback_encodings,
    writer_properties,
};
use crate::write::publish::{hidden_sibling, publish_staged, replace_directory, staging_prefix};

pub use idem_ballista::{ExecutorOptions, SchedulerOptions};

/// Key partitions of a cluster dedup when none are asked for: Ballista's default.
pub const DEFAULT_CLUSTER_PARTITIONS: usize = 16;

/// Where the executors write, and how this process commits it.
enum Staging {
    Local {
        directory: PathBuf,
        target: PathBuf,
    },
    Remote {
        prefix: RemoteLocation,
        target: RemoteLocation,
    },
}

impl Staging {
    fn create(output: &str, storage: &StorageOptions) -> Result<Self> {
        match Location::parse(output, storage)? {
            Location::Local(path) => {
                let target = std::path::absolute(&path).map_err(Error::io(&path))?;
                if let Some(parent) = target.parent() {
                    std::fs::create_dir_all(parent).map_err(Error::io(parent))?;
                }
                let directory = hidden_sibling(&target, "tmp")?;
                std::fs::create_dir(&directory).map_err(Error::io(&directory))?;
                Ok(Self::Local { directory, target })
            }
            Location::Remote(target) => {
                if target.is_object()? {
                    return Err(Error::InvalidArgument(format!(
                        "output '{output}' is an existing object; a cluster writes a \
                         directory of parts under a prefix"
                    )));
                }
                Ok(Self::Remote {
                    prefix: staging_prefix(&target),
                    target,
                })
            }
        }
    }

    /// The staging directory as the URL executors write to.
    fn url(&self) -> Result<String> {
        match self {
            Self::Local { directory, .. } => Url::from_directory_path(directory)
                .map(String::from)
                .map_err(|()| {
                    Error::InvalidArgument(format!("'{}' is not absolute", directory.display()))
                }),
            Self::Remote { prefix, .. } => Ok(format!("{}/", prefix.url())),
        }
    }

    /// Renames the parts into `part-NNNNN.parquet` in partition order and puts them in
    /// place of the target; an empty result is one empty part, as locally.
    fn commit(
        &self,
        parts: &[PartWritten],
        schema: &arrow::datatypes::SchemaRef,
    ) -> Result<Vec<PathBuf>> {
        let staged: Vec<String> = parts
            .iter()
            .flat_map(|p| (0..p.files).map(move |i| part_file_name(p.partition, i)))
            .collect();
        let final_name = |n: usize| format!("part-{n:05}.parquet");
        match self {
            Self::Local { directory, target } => {
                if staged.is_empty() {
                    write_empty_part(&directory.join(final_name(0)), schema)?;
                }
                for (n, name) in staged.iter().enumerate() {
                    let (from, to) = (directory.join(name), directory.join(final_name(n)));
                    std::fs::rename(&from, &to).map_err(Error::io(&from))?;
                }
                replace_directory(directory, target)?;
                let count = staged.len().max(1);
                Ok((0..count).map(|n| target.join(final_name(n))).collect())
            }
            Self::Remote { prefix, target } => {
                let mut objects: Vec<(String, RemoteLocation)> = staged
                    .iter()
                    .enumerate()
                    .map(|(n, name)| (final_name(n), prefix.join(name)))
                    .collect();
                if objects.is_empty() {
                    let local = tempfile::Builder::new()
                        .suffix(".parquet")
                        .tempfile()
                        .map_err(Error::io(std::env::temp_dir()))?;
                    write_empty_part(local.path(), schema)?;
                    let object = prefix.join(&final_name(0));
                    object.upload(local.path())?;
                    objects.push((final_name(0), object));
                }
                publish_staged(target, &objects)
            }
        }
    }

    /// Removes whatever the executors wrote (best effort: the staging name is hidden).
    fn abandon(&self) {
        match self {
            Self::Local { directory, .. } => {
                let _ = std::fs::remove_dir_all(directory);
            }
            Self::Remote { prefix, .. } => {
                if let Ok(objects) = prefix.objects_below() {
                    for object in objects {
                        let _ = object.delete();
                    }
                }
            }
        }
    }
}

fn write_empty_part(path: &Path, schema: &arrow::datatypes::SchemaRef) -> Result<()> {
    let file = std::fs::File::create(path).map_err(Error::io(path))?;
    writer_properties(schema)
        .and_then(|properties| ArrowWriter::try_new(file, Arc::clone(schema), Some(properties)))
        .and_then(ArrowWriter::close)
        .map(|_| ())
        .map_err(Error::parquet(path))
}

/// The URL an executor reads an input from.
fn input_url(file: &crate::read::input::InputFile) -> Result<String> {
    use crate::read::input::InputSource;
    if !file.is_parquet() {
        return Err(Error::InvalidArgument(format!(
            "{}: --cluster reads Parquet inputs only (this is Arrow IPC)",
            file.path().display()
        )));
    }
    match file.source() {
        InputSource::Local(path) => {
            let absolute = std::path::absolute(path).map_err(Error::io(path))?;
            Url::from_file_path(&absolute)
                .map(String::from)
                .map_err(|()| {
                    Error::InvalidArgument(format!("'{}' is not absolute", absolute.display()))
                })
        }
        InputSource::Remote(remote) => Ok(remote.url()),
        InputSource::Partitioned { .. } => Err(Error::InvalidArgument(format!(
            "{}: --cluster does not read partitioned tables yet; dedup the table locally",
            file.path().display()
        ))),
    }
}

/// Runs `job` on the Ballista cluster whose scheduler is at `scheduler` (`df://host:port`)
/// over `partitions` key partitions (see the module docs). The inputs and the output must
/// be reachable from the executors under the same names: object storage, or a path shared
/// by every machine.
///
/// # Errors
/// What a local run reports before reading rows (unreadable inputs, missing columns,
/// incompatible schemas), an option a cluster run does not support (`--state`,
/// `--memory-limit`, a single `.parquet` file output), a scheduler that cannot be
/// reached, or the job's failure on the cluster (e.g. a tie under `--on-tie error`).
pub fn run_dedup_on_cluster(
    job: &DedupJob,
    scheduler: &str,
    partitions: usize,
) -> Result<DedupReport> {
    let started = Instant::now();
    if job.state.is_some() {
        return Err(Error::InvalidArgument(
            "--state cannot be combined with --cluster: the state is kept by one process".into(),
        ));
    }
    if job.memory_limit.is_some() {
        return Err(Error::InvalidArgument(
            "--memory-limit applies to a local run; a cluster's executors spill under their own \
             memory pools"
                .into(),
        ));
    }
    if job.output.to_ascii_lowercase().ends_with(".parquet") {
        return Err(Error::InvalidArgument(format!(
            "output '{}': a cluster writes a directory of parts; name a directory",
            job.output
        )));
    }
    let partitions = partitions.max(1);
    let (files, schema) = open_inputs(job)?;
    let urls: Vec<String> = files.iter().map(input_url).collect::<Result<_>>()?;
    let runtime = storage_runtime(None, &job.storage)?;
    let staging = Staging::create(&job.output, &job.storage)?;
    let layout = PartsLayout {
        directory: staging.url()?,
        max_rows_per_file: job.max_rows_per_file.max(1),
        chunk_rows: WRITE_CHUNK_ROWS,
        row_group_rows: MAX_ROW_GROUP_ROWS,
        dictionary_page_bytes: MAX_DICTIONARY_PAGE_BYTES,
        zstd_level: parquet::basic::ZstdLevel::default().compression_level(),
        fallback_encodings: fallback_encodings(&schema)
            .map_err(Error::parquet(&job.output))?
            .into_iter()
            .map(|(column, encoding)| (column.parts().to_vec(), format!("{encoding:?}")))
            .collect(),
    };
    let parts = server_runtime()?.block_on(async {
        let config = SessionConfig::new().with_target_partitions(partitions);
        let ctx = idem_ballista::remote_with_runtime(scheduler, config, runtime).await?;
        let plan = write_plan(&ctx, &urls, &schema, job, layout).await?;
        let batches = ctx.execute_logical_plan(plan).await?.collect().await?;
        Ok::<_, Error>(parts_written(&batches)?)
    });
    let parts = match parts {
        Ok(parts) => parts,
        Err(e) => {
            staging.abandon();
            return Err(e);
        }
    };
    let output_files = match staging.commit(&parts, &schema) {
        Ok(files) => files,
        Err(e) => {
            staging.abandon();
            return Err(e);
        }
    };
    let counter = |name: &str| -> u64 {
        parts
            .iter()
            .map(|p| p.counters.get(name).copied().unwrap_or(0))
            .sum()
    };
    let stats = DedupStats {
        rows_in: counter("rows_in"),
        rows_out: parts.iter().map(|p| p.rows).sum(),
        duplicates: counter("duplicates"),
        superseded: counter("superseded"),
        deleted: counter("deleted"),
        conflicts: counter("conflicts"),
        null_keys: counter("null_keys"),
        distinct_keys: counter("distinct_keys"),
        tombstones_kept: counter("tombstones_kept"),
    };
    let run = DedupRun {
        files,
        schema,
        stats,
        kept_per_file: Vec::new(),
        key_partitions: u32::try_from(partitions).unwrap_or(u32::MAX),
        table_bytes: 0,
        decide_seconds: 0.0,
        fetch_started: started,
    };
    let mut report = DedupReport::new(job, &run);
    report.inputs = run.files.iter().map(|f| FileRows::new(f, None)).collect();
    report.key_partitions = run.key_partitions;
    report.output_files = output_files
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    report.cluster = Some(ClusterRun {
        scheduler: scheduler.to_owned(),
        partitions,
        parts: report.output_files.len(),
    });
    report.elapsed_seconds = started.elapsed().as_secs_f64();
    report.write_seconds = report.elapsed_seconds;
    Ok(report)
}

/// The plan the executors run: a scan of the inputs (with the unified schema) → dedup →
/// parts.
async fn write_plan(
    ctx: &SessionContext,
    urls: &[String],
    schema: &arrow::datatypes::SchemaRef,
    job: &DedupJob,
    layout: PartsLayout,
) -> Result<datafusion::logical_expr::LogicalPlan> {
    let paths = urls
        .iter()
        .map(ListingTableUrl::parse)
        .collect::<datafusion::common::Result<Vec<_>>>()?;
    // Inputs are named one by one, whatever their extension.
    let options = ListingOptions::new(Arc::new(ParquetFormat::default())).with_file_extension("");
    let config = ListingTableConfig::new_with_multi_paths(paths)
        .with_listing_options(options)
        .with_schema(Arc::clone(schema));
    let table = ListingTable::try_new(config)?;
    let scan = ctx.read_table(Arc::new(table))?.into_unoptimized_plan();
    let dedup = Dedup::try_new(scan, job.spec.clone())?.into_plan();
    Ok(WriteParts::try_new(dedup, layout)?.into_plan())
}

/// Serves a scheduler with idem's codecs on `bind` (`host:port`; port 0 picks a free
/// one) until the process ends; `listening` is told the address once it accepts
/// connections.
///
/// # Errors
/// The address cannot be bound, or the service fails.
pub fn run_scheduler(
    bind: &str,
    options: SchedulerOptions,
    storage: &StorageOptions,
    listening: impl FnOnce(std::net::SocketAddr),
) -> Result<()> {
    let runtime = storage_runtime(None, storage)?;
    let tokio = server_runtime()?;
    tokio.block_on(async {
        let listener = tokio::net::TcpListener::bind(bind)
            .await
            .map_err(Error::io(bind))?;
        listening(listener.local_addr().map_err(Error::io(bind))?);
        Ok(idem_ballista::run_scheduler(listener, runtime, options).await?)
    })
}

/// Runs an executor with idem's codecs until it is stopped.
///
/// # Errors
/// It cannot start or reach its scheduler.
pub fn run_executor(options: ExecutorOptions, storage: &StorageOptions) -> Result<()> {
    let runtime: Arc<RuntimeEnv> = storage_runtime(None, storage)?;
    Ok(server_runtime()?.block_on(idem_ballista::run_executor(options, runtime))?)
}

/// A runtime on every core: the client waits, the servers serve.
fn server_runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(Error::io("tokio runtime"))
}

/// `df://host:port` (or `host:port`) as host and port.
///
/// # Errors
/// An address without a port, or with a bad one.
pub fn scheduler_address(url: &str) -> Result<(String, u16)> {
    let address = url
        .strip_prefix("df://")
        .unwrap_or(url)
        .trim_end_matches('/');
    let (host, port) = address.rsplit_once(':').ok_or_else(|| {
        Error::InvalidArgument(format!("--scheduler '{url}': expected df://HOST:PORT"))
    })?;
    let port = port
        .parse()
        .map_err(|_| Error::InvalidArgument(format!("--scheduler '{url}': bad port '{port}'")))?;
    Ok((host.to_owned(), port))
}
