//! The long-running processes of a cluster with idem's codecs built in: a scheduler
//! ([`run_scheduler`]) and an executor ([`run_executor`]). Ballista's own
//! `ballista-scheduler` / `ballista-executor` binaries cannot decode idem's nodes; these
//! are the same services, with idem's codecs, planner and object stores.

use std::sync::Arc;
use std::time::Duration;

use ballista_executor::executor_process::{ExecutorProcessConfig, start_executor_process};
use ballista_scheduler::cluster::BallistaCluster;
use ballista_scheduler::config::SchedulerConfig;
use ballista_scheduler::scheduler_process::{create_scheduler, start_grpc_service_with_listener};
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::prelude::SessionConfig;
use datafusion_proto::protobuf::{LogicalPlanNode, PhysicalPlanNode};

use crate::{IdemLogicalCodec, IdemPhysicalCodec, ballista_config, session_state_with_runtime};

fn failed(what: &'static str) -> impl Fn(ballista_core::error::BallistaError) -> DataFusionError {
    move |e| DataFusionError::Execution(format!("{what}: {e}"))
}

/// The shortest executor timeout: an executor whose task slots are all busy polls the
/// scheduler (its heartbeat) only every 5 s.
pub const MIN_EXECUTOR_TIMEOUT_SECONDS: u64 = 10;

/// How often an executor tells the scheduler it is alive, well inside
/// [`MIN_EXECUTOR_TIMEOUT_SECONDS`].
const HEARTBEAT_INTERVAL_SECONDS: u64 = 3;

/// How a scheduler treats its executors.
#[derive(Debug, Clone)]
pub struct SchedulerOptions {
    /// An executor silent (no poll) for this long is declared lost, and its tasks and
    /// shuffle outputs are scheduled again elsewhere. At least
    /// `MIN_EXECUTOR_TIMEOUT_SECONDS`.
    pub executor_timeout: Duration,
    /// Attempts of one task before its job fails.
    pub task_max_failures: usize,
}

impl Default for SchedulerOptions {
    fn default() -> Self {
        Self {
            executor_timeout: Duration::from_secs(60),
            task_max_failures: 4,
        }
    }
}

/// Serves a scheduler on `listener` until the process ends. Sessions get `runtime` (its
/// object stores), idem's planner and codecs; each job's settings (e.g. its partitions)
/// come from the client.
///
/// # Errors
/// The service cannot start.
pub async fn run_scheduler(
    listener: tokio::net::TcpListener,
    runtime: Arc<RuntimeEnv>,
    options: SchedulerOptions,
) -> Result<()> {
    let address = listener.local_addr()?;
    let timeout = options.executor_timeout.as_secs();
    if timeout < MIN_EXECUTOR_TIMEOUT_SECONDS {
        return Err(DataFusionError::Configuration(format!(
            "executor timeout {timeout}s: a busy executor reports only every 5 s, so the \
             timeout must be at least {MIN_EXECUTOR_TIMEOUT_SECONDS}s"
        )));
    }
    let mut config = SchedulerConfig {
        bind_host: address.ip().to_string(),
        external_host: address.ip().to_string(),
        bind_port: address.port(),
        executor_timeout_seconds: timeout,
        expire_dead_executor_interval_seconds: timeout.min(15),
        no_executors_grace_period_seconds: timeout,
        task_max_failures: options.task_max_failures.max(1),
        ..SchedulerConfig::default()
    };
    config.override_session_builder = Some(Arc::new(move |session: SessionConfig| {
        session_state_with_runtime(session, Arc::clone(&runtime))
    }));
    config.override_config_producer = Some(Arc::new(|| ballista_config(&SessionConfig::new())));
    config.override_logical_codec = Some(Arc::new(IdemLogicalCodec::default()));
    config.override_physical_codec = Some(Arc::new(IdemPhysicalCodec::default()));
    let cluster = BallistaCluster::new_from_config(&config)
        .await
        .map_err(failed("scheduler"))?;
    let scheduler =
        create_scheduler::<LogicalPlanNode, PhysicalPlanNode>(cluster, Arc::new(config))
            .await
            .map_err(failed("scheduler"))?;
    start_grpc_service_with_listener(listener, scheduler)
        .await
        .map_err(failed("scheduler"))
}

/// Where an executor listens and whom it serves.
#[derive(Debug, Clone)]
pub struct ExecutorOptions {
    /// The scheduler's host.
    pub scheduler_host: String,
    /// The scheduler's port.
    pub scheduler_port: u16,
    /// The address this executor's Arrow Flight service (shuffle reads) binds to.
    pub bind_host: String,
    /// The host other executors and clients reach it by.
    pub external_host: Option<String>,
    /// The Flight service's port.
    pub port: u16,
    /// The port of its gRPC service (used under push scheduling).
    pub grpc_port: u16,
    /// Tasks it runs at once (its "vcores").
    pub concurrent_tasks: usize,
    /// Where its shuffle files go (a temporary directory when `None`).
    pub work_dir: Option<String>,
}

/// Runs an executor until it is stopped (SIGTERM, Ctrl-C or the scheduler), with idem's
/// codecs, and `runtime` (its object stores) for every task.
///
/// # Errors
/// The executor cannot start or reach the scheduler.
pub async fn run_executor(options: ExecutorOptions, runtime: Arc<RuntimeEnv>) -> Result<()> {
    let config = ExecutorProcessConfig {
        scheduler_host: options.scheduler_host,
        scheduler_port: options.scheduler_port,
        bind_host: options.bind_host,
        external_host: options.external_host,
        port: options.port,
        grpc_port: options.grpc_port,
        vcores: options.concurrent_tasks.max(1),
        work_dir: options.work_dir,
        // Startup is not instant when several processes start together.
        scheduler_connect_timeout_seconds: 30,
        // The scheduler declares an executor lost when its last heartbeat is older than
        // its timeout (at least MIN_EXECUTOR_TIMEOUT_SECONDS); Ballista's default of 60 s
        // would lose idle executors under any shorter timeout.
        executor_heartbeat_interval_seconds: HEARTBEAT_INTERVAL_SECONDS,
        override_logical_codec: Some(Arc::new(IdemLogicalCodec::default())),
        override_physical_codec: Some(Arc::new(IdemPhysicalCodec::default())),
        override_config_producer: Some(Arc::new(|| ballista_config(&SessionConfig::new()))),
        override_runtime_producer: Some(Arc::new(move |_: &SessionConfig| {
            Ok(Arc::clone(&runtime))
        })),
        ..ExecutorProcessConfig::default()
    };
    start_executor_process(Arc::new(config))
        .await
        .map_err(failed("executor"))
}
