//! The `idem` command line: argument parsing, progress and exit codes over the `idem` jobs.
//!
//! Exit codes: 0 success, 1 the job failed (bad input, conflicting tie under
//! `--on-tie error`, I/O), 2 bad usage.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use idem::idem_core::{DedupOptions, DedupSpec, DeletePolicy, TiePolicy};
use idem::storage::StorageOptions;
use idem::{DEFAULT_MAX_ROWS_PER_FILE, DedupJob, GenerateOptions, Progress, error_line, thousands};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// idem: exactly-once results from at-least-once event batches.
///
/// Keeps, for every key, the row with the highest version; drops replays, stale
/// out-of-order updates and deleted keys. Running it again on its output changes nothing.
#[derive(Debug, Parser)]
#[command(name = "idem", version, propagate_version = false)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Deduplicate Parquet / Arrow IPC files into Parquet.
    #[command(disable_version_flag = true)]
    Dedup(DedupArgs),
    /// Run one SQL statement with idem's functions (the `dedup` table function), printing
    /// the result or writing it as Parquet.
    #[cfg(feature = "sql")]
    Sql(SqlArgs),
    /// Check that a target holds exactly what a dedup of the sources gives: counts,
    /// checksums, and the first missing, extra, duplicated and differing rows. Exit code
    /// 0: it does; 1: it does not; 2: error.
    #[command(disable_version_flag = true)]
    Verify(VerifyArgs),
    /// Upsert a batch of event files into a Delta Lake table or a PostgreSQL table (created
    /// if absent): dedup the batch, then replace a table row only by a strictly newer
    /// version, honour deletes (remembered as tombstones for --tombstone-retention) and
    /// commit once. Re-running the same files is detected and does nothing.
    #[cfg(any(feature = "delta", feature = "postgres"))]
    #[command(disable_version_flag = true)]
    Merge(MergeArgs),
    /// Delete files of a Delta table that no version within the retention needs: files
    /// replaced by merges, files of merges that never committed, old tombstone state.
    #[cfg(feature = "delta")]
    Vacuum(VacuumArgs),
    /// Write seeded, realistic event data (replays, updates, deletes, late arrivals).
    Generate(GenerateArgs),
    /// Run a Ballista scheduler or executor with idem's codecs built in, for
    /// `idem dedup --cluster` and `idem sql --cluster` (see docs/distributed.md).
    #[cfg(feature = "ballista")]
    #[command(subcommand)]
    Cluster(ClusterCommand),
}

#[cfg(feature = "ballista")]
#[derive(Debug, Subcommand)]
enum ClusterCommand {
    /// Serve a scheduler; prints `listening on df://HOST:PORT` once it accepts clients.
    Scheduler(SchedulerArgs),
    /// Serve an executor for a scheduler: it runs tasks and serves its shuffle output.
    Executor(ExecutorArgs),
}

#[cfg(feature = "ballista")]
#[derive(Debug, Args)]
struct SchedulerArgs {
    /// Address to listen on; port 0 picks a free port.
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:50050")]
    bind: String,
    /// An executor silent for this long is declared lost; its tasks, and the shuffle output
    /// it held, are run again on the others. At least 10s (a busy executor reports every
    /// 5 s).
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
    executor_timeout: std::time::Duration,
    /// Attempts of one task before the job fails.
    #[arg(long, value_name = "N", default_value_t = 4)]
    task_max_failures: usize,
    /// Object store setting for planning (listing inputs), over the environment
    /// (repeatable).
    #[arg(long = "storage-option", value_name = "KEY=VALUE")]
    storage_options: Vec<String>,
}

#[cfg(feature = "ballista")]
#[derive(Debug, Args)]
struct ExecutorArgs {
    /// The scheduler to serve.
    #[arg(long, value_name = "df://HOST:PORT")]
    scheduler: String,
    /// Address its Arrow Flight service (shuffle reads) binds to.
    #[arg(long, value_name = "HOST", default_value = "127.0.0.1")]
    bind_host: String,
    /// The host name other executors and clients reach it by (default: the bind address).
    #[arg(long, value_name = "HOST")]
    external_host: Option<String>,
    /// Port of its Arrow Flight service.
    #[arg(long, value_name = "PORT", default_value_t = 50051)]
    port: u16,
    /// Port of its gRPC service.
    #[arg(long, value_name = "PORT", default_value_t = 50052)]
    grpc_port: u16,
    /// Tasks it runs at once (default: the machine's cores).
    #[arg(long, value_name = "N")]
    concurrent_tasks: Option<usize>,
    /// Directory for its shuffle files (default: a temporary directory).
    #[arg(long, value_name = "DIR")]
    work_dir: Option<String>,
    /// Object store setting for reading inputs and writing parts, over the AWS_* /
    /// GOOGLE_* / AZURE_* environment (repeatable).
    #[arg(long = "storage-option", value_name = "KEY=VALUE")]
    storage_options: Vec<String>,
}

#[cfg(feature = "sql")]
#[derive(Debug, Args)]
struct SqlArgs {
    /// The statement, e.g. "SELECT * FROM dedup('data/events', 'event_id,sequence', 'lsn')".
    /// Files can also be named as tables: SELECT * FROM 'data/events/*.parquet'.
    query: String,
    /// Write the result here (a .parquet file, or else a directory of parts; a path or a
    /// URL such as s3://bucket/out.parquet) instead of printing it.
    #[arg(short, long, value_name = "PATH|URL")]
    output: Option<String>,
    /// Rows per part file when the output is a directory.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_ROWS_PER_FILE)]
    max_rows_per_file: usize,
    /// Memory pool for the query's operators, e.g. 2GiB; they spill to disk beyond it.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    memory_limit: Option<u64>,
    /// Object store setting, over the AWS_* / GOOGLE_* / AZURE_* environment (repeatable),
    /// e.g. --storage-option aws_region=eu-west-1.
    #[arg(long = "storage-option", value_name = "KEY=VALUE")]
    storage_options: Vec<String>,
    /// Write what the query's dedup operators counted (rows in and out, duplicates,
    /// superseded, …) in Prometheus text format to PATH (replaced atomically).
    #[arg(long, value_name = "PATH")]
    metrics: Option<PathBuf>,
    /// Run the query on an Apache DataFusion Ballista cluster, given its scheduler's URL.
    /// Its executors must run with idem's codecs (idem-ballista) and read the inputs
    /// themselves: shared paths or object storage. The rows come back here.
    #[cfg(feature = "ballista")]
    #[arg(long, value_name = "df://HOST:PORT")]
    cluster: Option<String>,
}

/// Key, version and policies, shared by the commands that dedup.
#[derive(Debug, Args)]
struct SpecArgs {
    /// Key columns.
    #[arg(
        long,
        value_name = "COL,...",
        value_delimiter = ',',
        default_value = "event_id,sequence"
    )]
    key: Vec<String>,
    /// Version columns, compared left to right; the greatest wins.
    #[arg(
        long = "version",
        value_name = "COL,...",
        value_delimiter = ',',
        default_value = "lsn"
    )]
    versions: Vec<String>,
    /// Op column: rows whose op is one of --delete-values are deletes (tombstones).
    #[arg(long, value_name = "COL")]
    op: Option<String>,
    /// Op values that mark a delete.
    #[arg(
        long,
        value_name = "V,...",
        value_delimiter = ',',
        default_value = "d",
        requires = "op"
    )]
    delete_values: Vec<String>,
    /// Write a key's winning tombstone instead of dropping the key.
    #[arg(long, requires = "op")]
    keep_tombstones: bool,
    /// Which row wins a tie at the maximum version: the first or last in input order, or
    /// fail if the tied rows differ.
    #[arg(long, value_name = "first|last|error", default_value = "first")]
    on_tie: TiePolicy,
}

impl SpecArgs {
    fn into_spec(self) -> DedupSpec {
        let mut options = DedupOptions::default().with_on_tie(self.on_tie);
        if let Some(op) = self.op {
            options = options.with_deletes(DeletePolicy {
                op_column: op,
                delete_values: self.delete_values,
                keep_tombstones: self.keep_tombstones,
            });
        }
        DedupSpec::new(self.key, self.versions).with_options(options)
    }
}

#[derive(Debug, Args)]
struct VerifyArgs {
    /// The sources: files, directories, globs or URLs, as given to `idem dedup`.
    #[arg(long, required = true, num_args = 1.., value_name = "INPUT")]
    source: Vec<String>,
    /// The target to check: files, directories, globs or URLs; or a PostgreSQL database
    /// (postgres://…) with --table.
    #[arg(long, required = true, num_args = 1.., value_name = "PATH|URL")]
    target: Vec<String>,
    /// The table of a PostgreSQL target, [SCHEMA.]NAME.
    #[arg(long, value_name = "[SCHEMA.]NAME")]
    table: Option<String>,
    #[command(flatten)]
    spec: SpecArgs,
    /// Rows of each kind of difference to describe.
    #[arg(long, value_name = "N", default_value_t = 10)]
    max_report: usize,
    /// Memory for the sources' dedup, as for `idem dedup --memory-limit`.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    memory_limit: Option<u64>,
    /// Object store setting, over the AWS_* / GOOGLE_* / AZURE_* environment (repeatable).
    #[arg(long = "storage-option", value_name = "KEY=VALUE")]
    storage_options: Vec<String>,
    /// Print the report as one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Write the outcome in Prometheus text format to PATH (replaced atomically), for
    /// alerting on `idem_verify_matches == 0`.
    #[arg(long, value_name = "PATH")]
    metrics: Option<PathBuf>,
    /// No progress bar.
    #[arg(short, long)]
    quiet: bool,
}

#[derive(Debug, Args)]
struct DedupArgs {
    /// Parquet or Arrow IPC files, directories (every such file below, in sorted path
    /// order) or globs, in input order; local paths or URLs (s3://, gs://, az://, file://).
    #[arg(required = true, value_name = "INPUT")]
    inputs: Vec<String>,
    /// Output: a path or URL ending in .parquet is one file; anything else a directory of
    /// parts.
    #[arg(short, long, value_name = "PATH|URL")]
    output: String,
    #[command(flatten)]
    spec: SpecArgs,
    /// Write the run's statistics as one JSON object to PATH, or to stdout with '-'.
    #[arg(long, value_name = "PATH|-")]
    stats: Option<String>,
    /// Rows per part file when the output is a directory.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_ROWS_PER_FILE)]
    max_rows_per_file: usize,
    /// Memory the dedup's state may use, e.g. 2GiB, 512MiB, 1G, 100000000. Beyond it
    /// the decision pass runs one key partition at a time through temporary spill files
    /// ($TMPDIR); the output is the same. Decode and encode buffers come on top.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    memory_limit: Option<u64>,
    /// Object store setting, over the AWS_* / GOOGLE_* / AZURE_* environment (repeatable),
    /// e.g. --storage-option aws_region=eu-west-1.
    #[arg(long = "storage-option", value_name = "KEY=VALUE")]
    storage_options: Vec<String>,
    /// Write the run's statistics in Prometheus text format to PATH (replaced atomically;
    /// for node_exporter's textfile collector).
    #[arg(long, value_name = "PATH")]
    metrics: Option<PathBuf>,
    /// Exit with code 3 (after writing the output) when (duplicates + superseded) / rows in
    /// exceeds FRACTION, so that a scheduler can alert on a producer gone wrong.
    #[arg(long, value_name = "FRACTION", value_parser = parse_fraction)]
    max_duplicate_rate: Option<f64>,
    /// Write a self-contained HTML page about the run to PATH: counts, the duplicate rate
    /// over event time (with --time-column), each input's dropped share, the keys
    /// delivered most often. Costs one more read of the key (and time) columns.
    #[arg(long, value_name = "PATH.html")]
    report: Option<PathBuf>,
    /// The event-time column (timestamp or date): what --state expires keys by, and what
    /// --report charts the duplicate rate over, per second, minute, hour or day (the
    /// finest that fits the span in 240 bars).
    #[arg(long, value_name = "COLUMN")]
    time_column: Option<String>,
    /// Dedup across runs: a directory or URL prefix holding the keys earlier runs emitted
    /// (key hash, version, event time; Parquet, committed after the output). Rows whose key
    /// was emitted before at an equal or newer version are dropped. Needs --time-column and
    /// --retention.
    #[arg(long, value_name = "DIR|URL", requires_all = ["time_column", "retention"])]
    state: Option<String>,
    /// How long (in event time, behind the newest event seen) the state remembers a key,
    /// e.g. 7d, 36h: at least the longest delay after which a replay still arrives.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, requires = "state")]
    retention: Option<std::time::Duration>,
    /// Extra time on top of --retention before keys expire and rows count as late.
    #[arg(long, value_name = "DURATION", default_value = "0s", value_parser = parse_duration, requires = "state")]
    safety_buffer: std::time::Duration,
    /// Rows older than the state's watermark (newest event time − retention − safety
    /// buffer), whose key may have expired: drop them, emit them, or fail the run.
    #[arg(
        long,
        value_name = "drop|emit|error",
        default_value = "drop",
        requires = "state"
    )]
    late: idem::LatePolicy,
    /// How many of the most-delivered keys the report lists.
    #[arg(long, value_name = "N", default_value_t = 20, requires = "report")]
    report_top_keys: usize,
    /// Run the dedup on an Apache DataFusion Ballista cluster, given its scheduler's URL
    /// (executors started with `idem cluster executor`). Executors read the inputs and
    /// write the parts themselves, so inputs and output must be object storage or paths
    /// every machine shares; this process commits the output. The output must be a
    /// directory.
    #[cfg(feature = "ballista")]
    #[arg(long, value_name = "df://HOST:PORT", conflicts_with_all = ["state", "memory_limit", "report"])]
    cluster: Option<String>,
    /// Key partitions of a cluster run: tasks of the dedup stage, and at least that many
    /// part files.
    #[cfg(feature = "ballista")]
    #[arg(long, value_name = "N", default_value_t = idem::cluster::DEFAULT_CLUSTER_PARTITIONS, requires = "cluster")]
    partitions: usize,
    /// No progress bar and no summary line.
    #[arg(short, long)]
    quiet: bool,
}

#[cfg(any(feature = "delta", feature = "postgres"))]
#[derive(Debug, Args)]
struct MergeArgs {
    /// The batch: Parquet or Arrow IPC files, directories or globs; paths or URLs.
    #[arg(required = true, value_name = "INPUT")]
    inputs: Vec<String>,
    /// The target: a Delta table's directory or URL (s3://bucket/table, file://, …), or a
    /// PostgreSQL database, postgres://[USER[:PASSWORD]@]HOST[:PORT]/DATABASE (PGHOST,
    /// PGUSER, PGPASSWORD, … fill what it leaves out), with --table.
    #[arg(long, value_name = "TABLE_URL|postgres://…")]
    into: String,
    /// The table in a PostgreSQL target, [SCHEMA.]NAME (created if absent).
    #[arg(long, value_name = "[SCHEMA.]NAME")]
    table: Option<String>,
    #[command(flatten)]
    spec: SpecArgs,
    /// When the table is created: cluster rows into N files by key hash, so that a batch
    /// rewrites only the files of the buckets its keys fall in.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=65_536))]
    buckets: Option<u32>,
    /// When the table is created: partition it by these columns (Hive-style directories,
    /// Delta partition values). Partitioning by key columns lets a merge skip the
    /// partitions its keys are not in.
    #[arg(long, value_name = "COL,...", value_delimiter = ',')]
    partition_by: Vec<String>,
    /// How long a delete blocks older updates of its key (e.g. 7d, 36h, 0s). Later, an
    /// update older than the delete could bring the key back.
    #[arg(long, value_name = "DURATION", default_value = "7d", value_parser = parse_duration)]
    tombstone_retention: std::time::Duration,
    /// Rows per new data file (tables without buckets).
    #[arg(long, value_name = "N", default_value_t = idem::DEFAULT_ROWS_PER_TABLE_FILE)]
    max_rows_per_file: usize,
    /// Write the run's statistics as one JSON object to PATH, or to stdout with '-'.
    #[arg(long, value_name = "PATH|-")]
    stats: Option<String>,
    /// Write the run's statistics in Prometheus text format to PATH (replaced atomically).
    #[arg(long, value_name = "PATH")]
    metrics: Option<PathBuf>,
    /// Object store setting, over the AWS_* / GOOGLE_* / AZURE_* environment (repeatable).
    #[arg(long = "storage-option", value_name = "KEY=VALUE")]
    storage_options: Vec<String>,
    /// No progress bar and no summary line.
    #[arg(short, long)]
    quiet: bool,
}

#[cfg(feature = "delta")]
#[derive(Debug, Args)]
struct VacuumArgs {
    /// The Delta table: a directory or a URL.
    #[arg(long, value_name = "TABLE_URL")]
    into: String,
    /// Keep files younger than this (readers of older versions may fail afterwards).
    #[arg(long, value_name = "DURATION", default_value = "7d", value_parser = parse_duration)]
    retention: std::time::Duration,
    /// List what would be deleted, delete nothing.
    #[arg(long)]
    dry_run: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Object store setting, over the AWS_* / GOOGLE_* / AZURE_* environment (repeatable).
    #[arg(long = "storage-option", value_name = "KEY=VALUE")]
    storage_options: Vec<String>,
}

fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    idem::parse_duration(text).map_err(|e| e.to_string())
}

fn parse_size(text: &str) -> Result<u64, String> {
    idem::parse_size(text).map_err(|e| e.to_string())
}

#[derive(Debug, Args)]
struct GenerateArgs {
    /// Directory or object-store prefix (s3://bucket/events) to write events-NNNNN.parquet
    /// files into.
    #[arg(short, long, value_name = "DIR|URL")]
    output: String,
    /// Rows in total, replays included.
    #[arg(long, default_value_t = 1_000_000)]
    rows: u64,
    /// Number of files.
    #[arg(long, default_value_t = 4)]
    files: usize,
    /// Seed: the same options and seed give byte-identical files.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Probability that an event is delivered twice.
    #[arg(long, default_value_t = 0.15)]
    duplicate_rate: f64,
    /// Probability that an event updates an existing key.
    #[arg(long, default_value_t = 0.15)]
    update_rate: f64,
    /// Probability that an event deletes an existing key.
    #[arg(long, default_value_t = 0.01)]
    delete_rate: f64,
    /// Probability that a delivery is delayed past newer events.
    #[arg(long, default_value_t = 0.05)]
    reorder_rate: f64,
    /// Approximate size of the payload column, in bytes.
    #[arg(long, default_value_t = 100)]
    payload_bytes: usize,
    /// Extra attribute columns (alternately integer and text), for wide tables.
    #[arg(long, default_value_t = 0)]
    extra_columns: usize,
    /// Object store setting, over the AWS_* / GOOGLE_* / AZURE_* environment (repeatable).
    #[arg(long = "storage-option", value_name = "KEY=VALUE")]
    storage_options: Vec<String>,
}

/// A progress bar on stderr, drawn only when stderr is a terminal.
struct Bar(ProgressBar);

impl Bar {
    fn new(quiet: bool) -> Self {
        let target = if quiet || !std::io::stderr().is_terminal() {
            ProgressDrawTarget::hidden()
        } else {
            ProgressDrawTarget::stderr()
        };
        let bar = ProgressBar::with_draw_target(Some(0), target);
        if let Ok(style) = ProgressStyle::with_template(
            "{msg:>9} [{bar:40}] {human_pos}/{human_len} rows ({per_sec}, {eta})",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        Self(bar)
    }
}

impl Progress for Bar {
    fn phase(&self, name: &str, total_rows: u64) {
        self.0.set_message(name.to_owned());
        self.0.set_length(total_rows);
        self.0.set_position(0);
    }

    fn advance(&self, rows: u64) {
        self.0.inc(rows);
    }
}

/// Writes to stdout; a closed pipe (`idem … --stats - | head`) is not an error.
fn print_stdout(text: &str) -> Result<(), String> {
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{text}").and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(format!("stdout: {e}")),
        _ => Ok(()),
    }
}

/// Exit code of a run whose duplicate rate exceeded `--max-duplicate-rate`.
const DUPLICATE_RATE_EXCEEDED: u8 = 3;

fn parse_fraction(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(format!("'{text}' is not a fraction between 0 and 1")),
    }
}

fn dedup(args: DedupArgs) -> Result<ExitCode, String> {
    let job = DedupJob {
        inputs: args.inputs,
        output: args.output,
        spec: args.spec.into_spec(),
        max_rows_per_file: args.max_rows_per_file,
        memory_limit: args.memory_limit,
        storage: StorageOptions::parse(&args.storage_options).map_err(|e| error_line(&e))?,
        state: match (&args.state, &args.time_column, args.retention) {
            (Some(location), Some(time_column), Some(retention)) => Some(idem::StateOptions {
                location: location.clone(),
                time_column: time_column.clone(),
                retention,
                safety_buffer: args.safety_buffer,
                late: args.late,
            }),
            _ => None,
        },
    };
    let report_options = idem::ReportOptions {
        time_column: args.time_column.clone(),
        top_keys: args.report_top_keys,
    };
    if args.report.is_some() {
        idem::check_report(&job, &report_options).map_err(|e| error_line(&e))?;
    } else if args.time_column.is_some() && job.state.is_none() {
        return Err("--time-column is for --report or --state".to_owned());
    }
    let bar = Bar::new(args.quiet);
    #[cfg(feature = "ballista")]
    let result = match &args.cluster {
        Some(scheduler) => idem::cluster::run_dedup_on_cluster(&job, scheduler, args.partitions),
        None => idem::run_dedup(&job, &bar),
    };
    #[cfg(not(feature = "ballista"))]
    let result = idem::run_dedup(&job, &bar);
    bar.0.finish_and_clear();
    let report = result.map_err(|e| error_line(&e))?;
    if let Some(stats) = &args.stats {
        write_json(stats, &report)?;
    }
    if let Some(path) = &args.metrics {
        idem::metrics::write_metrics(path, &idem::metrics::dedup_metrics(&report))
            .map_err(|e| error_line(&e))?;
    }
    if let Some(path) = &args.report {
        idem::write_report(path, &job, &report, &report_options).map_err(|e| error_line(&e))?;
    }
    if !args.quiet {
        eprintln!("{}", report.summary());
    }
    let rate = report.stats.duplicate_rate();
    match args.max_duplicate_rate {
        Some(limit) if rate > limit => {
            eprintln!(
                "idem: duplicate rate {rate:.4} exceeds --max-duplicate-rate {limit} (output written)"
            );
            Ok(ExitCode::from(DUPLICATE_RATE_EXCEEDED))
        }
        _ => Ok(ExitCode::SUCCESS),
    }
}

/// Writes a report as pretty JSON to PATH, or to stdout with '-'.
fn write_json(target: &str, report: &impl serde::Serialize) -> Result<(), String> {
    let json = serde_json::to_string_pretty(report).map_err(|e| e.to_string())?;
    if target == "-" {
        print_stdout(&json)
    } else {
        std::fs::write(target, json + "\n").map_err(|e| format!("{target}: {e}"))
    }
}

#[cfg(any(feature = "delta", feature = "postgres"))]
fn merge(args: MergeArgs) -> Result<ExitCode, String> {
    let job = idem::MergeJob {
        inputs: args.inputs,
        table: args.into,
        target_table: args.table,
        spec: args.spec.into_spec(),
        buckets: args.buckets,
        partition_by: args.partition_by,
        tombstone_retention: args.tombstone_retention,
        max_rows_per_file: args.max_rows_per_file,
        storage: StorageOptions::parse(&args.storage_options).map_err(|e| error_line(&e))?,
        max_attempts: 10,
    };
    let bar = Bar::new(args.quiet);
    let result = idem::run_merge(&job, &bar);
    bar.0.finish_and_clear();
    let report = result.map_err(|e| error_line(&e))?;
    if let Some(stats) = &args.stats {
        write_json(stats, &report)?;
    }
    if let Some(path) = &args.metrics {
        idem::metrics::write_metrics(path, &idem::metrics::merge_metrics(&report))
            .map_err(|e| error_line(&e))?;
    }
    if !args.quiet {
        eprintln!("{}", report.summary());
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(feature = "delta")]
fn vacuum(args: VacuumArgs) -> Result<ExitCode, String> {
    let storage = StorageOptions::parse(&args.storage_options).map_err(|e| error_line(&e))?;
    let report = idem::run_vacuum(&args.into, args.retention, args.dry_run, &storage)
        .map_err(|e| error_line(&e))?;
    if args.json {
        write_json("-", &report)?;
    } else {
        let verb = if report.dry_run {
            "would delete"
        } else {
            "deleted"
        };
        for file in report
            .files_deleted
            .iter()
            .chain(&report.state_files_deleted)
        {
            print_stdout(&format!("{verb} {file}"))?;
        }
        eprintln!(
            "idem: {verb} {} data files and {} state files of {}",
            report.files_deleted.len(),
            report.state_files_deleted.len(),
            report.table
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(feature = "sql")]
fn sql(args: SqlArgs) -> Result<(), String> {
    let storage = StorageOptions::parse(&args.storage_options).map_err(|e| error_line(&e))?;
    #[cfg(feature = "ballista")]
    let cluster = args.cluster.as_deref();
    #[cfg(not(feature = "ballista"))]
    let cluster = None;
    let run = idem::run_sql_on(
        &args.query,
        args.output.as_deref(),
        args.max_rows_per_file,
        args.memory_limit,
        &storage,
        cluster,
    )
    .map_err(|e| error_line(&e))?;
    if let Some(path) = &args.metrics {
        let text = idem::metrics::sql_metrics(&run, args.output.as_deref().unwrap_or_default());
        idem::metrics::write_metrics(path, &text).map_err(|e| error_line(&e))?;
    }
    match run.output {
        idem::SqlOutput::Rows(batches) => {
            print_stdout(&idem::format_table(&batches).map_err(|e| error_line(&e))?)
        }
        idem::SqlOutput::Written { files, rows } => {
            eprintln!(
                "idem: wrote {} rows to {} file(s) under {}",
                thousands(rows),
                files.len(),
                args.output.unwrap_or_default()
            );
            Ok(())
        }
    }
}

fn generate(args: GenerateArgs) -> Result<(), String> {
    let options = GenerateOptions {
        rows: args.rows,
        files: args.files,
        seed: args.seed,
        duplicate_rate: args.duplicate_rate,
        update_rate: args.update_rate,
        delete_rate: args.delete_rate,
        reorder_rate: args.reorder_rate,
        payload_bytes: args.payload_bytes,
        extra_columns: args.extra_columns,
    };
    let storage = StorageOptions::parse(&args.storage_options).map_err(|e| error_line(&e))?;
    let generated =
        idem::generate_to(&options, &args.output, &storage).map_err(|e| error_line(&e))?;
    eprintln!(
        "idem: wrote {} rows in {} files to {}",
        thousands(generated.rows),
        generated.files.len(),
        args.output
    );
    Ok(())
}

/// Exit code of `idem verify` for a target that differs.
const MISMATCH: u8 = 1;
/// Exit code of `idem verify` for an error.
const VERIFY_ERROR: u8 = 2;

fn verify(args: VerifyArgs) -> Result<ExitCode, String> {
    let job = idem::VerifyJob {
        sources: args.source,
        target: args.target,
        target_table: args.table,
        spec: args.spec.into_spec(),
        memory_limit: args.memory_limit,
        max_report: args.max_report,
        storage: StorageOptions::parse(&args.storage_options).map_err(|e| error_line(&e))?,
    };
    let bar = Bar::new(args.quiet);
    let result = idem::run_verify(&job, &bar);
    bar.0.finish_and_clear();
    let report = result.map_err(|e| error_line(&e))?;
    if let Some(path) = &args.metrics {
        let label: Vec<String> = job
            .target
            .iter()
            .map(|t| idem::redact_location(t))
            .collect();
        let text = idem::metrics::verify_metrics(&report, &label.join(","));
        idem::metrics::write_metrics(path, &text).map_err(|e| error_line(&e))?;
    }
    if args.json {
        print_stdout(&serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?)?;
    } else {
        print_stdout(&report.to_text())?;
    }
    Ok(if report.matches {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(MISMATCH)
    })
}

#[cfg(feature = "ballista")]
fn cluster(command: ClusterCommand) -> Result<(), String> {
    match command {
        ClusterCommand::Scheduler(args) => {
            let storage =
                StorageOptions::parse(&args.storage_options).map_err(|e| error_line(&e))?;
            let options = idem::cluster::SchedulerOptions {
                executor_timeout: args.executor_timeout,
                task_max_failures: args.task_max_failures,
            };
            idem::cluster::run_scheduler(&args.bind, options, &storage, |address| {
                // Scripts (and tests) wait for this line to learn the port.
                println!("listening on df://{address}");
                let _ = std::io::Write::flush(&mut std::io::stdout());
            })
            .map_err(|e| error_line(&e))
        }
        ClusterCommand::Executor(args) => {
            let storage =
                StorageOptions::parse(&args.storage_options).map_err(|e| error_line(&e))?;
            let (scheduler_host, scheduler_port) =
                idem::cluster::scheduler_address(&args.scheduler).map_err(|e| error_line(&e))?;
            let options = idem::cluster::ExecutorOptions {
                scheduler_host,
                scheduler_port,
                external_host: args.external_host.or_else(|| Some(args.bind_host.clone())),
                bind_host: args.bind_host,
                port: args.port,
                grpc_port: args.grpc_port,
                concurrent_tasks: args.concurrent_tasks.unwrap_or_else(|| {
                    std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
                }),
                work_dir: args.work_dir,
            };
            idem::cluster::run_executor(options, &storage).map_err(|e| error_line(&e))
        }
    }
}

fn main() -> ExitCode {
    idem::quiet_decoder_panics();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Verify(args) => {
            return verify(args).unwrap_or_else(|message| {
                eprintln!("idem: error: {message}");
                ExitCode::from(VERIFY_ERROR)
            });
        }
        Command::Dedup(args) => dedup(args),
        #[cfg(feature = "sql")]
        Command::Sql(args) => sql(args).map(|()| ExitCode::SUCCESS),
        Command::Generate(args) => generate(args).map(|()| ExitCode::SUCCESS),
        #[cfg(any(feature = "delta", feature = "postgres"))]
        Command::Merge(args) => merge(args),
        #[cfg(feature = "delta")]
        Command::Vacuum(args) => vacuum(args),
        #[cfg(feature = "ballista")]
        Command::Cluster(command) => cluster(command).map(|()| ExitCode::SUCCESS),
    };
    match result {
        Ok(code) => code,
        Err(message) => {
            eprintln!("idem: error: {message}");
            ExitCode::FAILURE
        }
    }
}
