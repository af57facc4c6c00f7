//! # idem-ballista: idem's dedup on an Apache DataFusion Ballista cluster
//!
//! Ballista ships plans as protobuf: the client sends the logical plan to the scheduler,
//! the scheduler splits the physical plan into stages at its shuffles and sends each task's
//! plan to an executor. DataFusion's own nodes have protobuf forms; idem's travel through
//! the extension codecs here, which every process of a cluster must use:
//!
//! * [`IdemLogicalCodec`]: the [`Dedup`] node, and `max_by` / `min_by` by name;
//! * [`IdemPhysicalCodec`]: [`DedupExec`], [`PositionExec`] and [`LateDedupExec`], and the
//!   aggregates.
//!
//! Both fall back to Ballista's own codecs (shuffle readers and writers, file formats) for
//! everything else. A node's payload is `IDEMPLAN1` and a JSON object (`"node"`, `"spec"`):
//! small, and readable in a captured plan.
//!
//! On a cluster a dedup is planned as a hash shuffle on the key ([`DedupPlanner::shuffled`]):
//! scan → [`PositionExec`] → shuffle by key hash → [`DedupExec`] per partition, so each
//! task reads its share of the input once. A job that writes its result puts
//! [`WriteParts`] on top: each dedup task writes its partition's Parquet parts itself
//! and returns only counts ([`parts_written`]), for the client to commit.
//!
//! [`session_state`] builds the scheduler's state (the shuffled planner, the codecs, the
//! functions), [`standalone`] and [`start_cluster`] start an in-process cluster on
//! loopback around it, [`remote`] connects to a running scheduler, and [`run_scheduler`] /
//! [`run_executor`] are the long-running processes of a real cluster.
//!
//! ```
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> datafusion::error::Result<()> {
//! use datafusion::prelude::{ParquetReadOptions, SessionConfig};
//!
//! // A scheduler and an executor in this process, on loopback.
//! let cluster = idem_ballista::standalone(SessionConfig::new().with_target_partitions(2)).await?;
//! // The sample events committed with idem (6,000 rows; executors read the files themselves).
//! let events = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/events");
//! cluster.register_parquet("events", events, ParquetReadOptions::default()).await?;
//! let kept = cluster
//!     .sql("SELECT count(*) FROM dedup('events', 'event_id,sequence', 'lsn')")
//!     .await?
//!     .collect()
//!     .await?;
//! assert_eq!(kept.len(), 1);
//! # Ok(())
//! # }
//! ```
//!
//! [`DedupPlanner::shuffled`]: idem_datafusion::DedupPlanner::shuffled

use std::sync::Arc;

use ballista::prelude::SessionContextExt;
use ballista_core::extension::SessionConfigExt;
use ballista_core::serde::protobuf::scheduler_grpc_client::SchedulerGrpcClient;
use ballista_core::serde::{BallistaLogicalExtensionCodec, BallistaPhysicalExtensionCodec};
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::execution::registry::FunctionRegistry;
use datafusion::execution::runtime_env::RuntimeEnv;
use datafusion::execution::session_state::{SessionState, SessionStateBuilder};
use datafusion::logical_expr::{AggregateUDF, Extension, LogicalPlan, UserDefinedLogicalNode};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::{SessionConfig, SessionContext};
use datafusion_proto::logical_plan::LogicalExtensionCodec;
use datafusion_proto::physical_plan::{PhysicalExtensionCodec, PhysicalProtoConverterExtension};
use idem_datafusion::{
    Dedup, DedupExec, DedupPlanner, DedupQueryPlanner, DedupSpec, DedupTableFunc, DeletePolicy,
    LateDedupExec, PositionExec, TiePolicy, max_by_udaf, min_by_udaf,
};
use serde_json::{Value, json};

mod parts;
mod serve;

pub use parts::{
    DEDUP_COUNTERS, PartWritten, PartsLayout, WriteParts, WritePartsExec, WritePartsPlanner,
    part_file_name, parts_schema, parts_written,
};
pub use serve::{ExecutorOptions, SchedulerOptions, run_executor, run_scheduler};

/// The first bytes of every payload idem encodes; anything else belongs to the fallback.
const MAGIC: &[u8] = b"IDEMPLAN1";

fn codec_error(message: impl Into<String>) -> DataFusionError {
    DataFusionError::Internal(format!("idem codec: {}", message.into()))
}

/// A dedup spec as JSON: keys, versions, tie policy, deletes.
fn spec_to_json(spec: &DedupSpec) -> Value {
    json!({
        "keys": spec.keys,
        "versions": spec.versions,
        "on_tie": spec.options.on_tie.to_string(),
        "deletes": spec.options.deletes.as_ref().map(|d| json!({
            "op_column": d.op_column,
            "delete_values": d.delete_values,
            "keep_tombstones": d.keep_tombstones,
        })),
    })
}

fn strings(value: &Value, field: &str) -> Result<Vec<String>> {
    value[field]
        .as_array()
        .ok_or_else(|| codec_error(format!("spec without '{field}'")))?
        .iter()
        .map(|v| {
            v.as_str()
                .map(str::to_owned)
                .ok_or_else(|| codec_error(format!("'{field}' holds a non-string")))
        })
        .collect()
}

fn spec_from_json(value: &Value) -> Result<DedupSpec> {
    let on_tie: TiePolicy = value["on_tie"]
        .as_str()
        .ok_or_else(|| codec_error("spec without 'on_tie'"))?
        .parse()
        .map_err(codec_error)?;
    let mut options = idem_datafusion::DedupOptions::default().with_on_tie(on_tie);
    if let Some(deletes) = value.get("deletes").filter(|d| !d.is_null()) {
        let mut policy = DeletePolicy::new(
            deletes["op_column"]
                .as_str()
                .ok_or_else(|| codec_error("deletes without 'op_column'"))?,
        );
        policy.delete_values = strings(deletes, "delete_values")?;
        policy.keep_tombstones = deletes["keep_tombstones"].as_bool().unwrap_or(false);
        options = options.with_deletes(policy);
    }
    Ok(DedupSpec::new(strings(value, "keys")?, strings(value, "versions")?).with_options(options))
}

/// What an idem payload holds: the node's name and, by node, its dedup spec or its
/// output layout.
#[derive(Debug, Clone, PartialEq)]
struct Payload {
    node: String,
    spec: Option<DedupSpec>,
    layout: Option<PartsLayout>,
    /// A [`PositionExec`]'s scan partitions as planned.
    sources: Option<Vec<String>>,
}

fn encode(node: &str, spec: Option<&DedupSpec>, buf: &mut Vec<u8>) -> Result<()> {
    let mut payload = json!({ "node": node });
    if let Some(spec) = spec {
        payload["spec"] = spec_to_json(spec);
    }
    write_payload(&payload, buf)
}

fn encode_layout(node: &str, layout: &PartsLayout, buf: &mut Vec<u8>) -> Result<()> {
    let layout = serde_json::to_value(layout).map_err(|e| codec_error(e.to_string()))?;
    write_payload(&json!({ "node": node, "layout": layout }), buf)
}

fn encode_sources(node: &str, sources: &[String], buf: &mut Vec<u8>) -> Result<()> {
    write_payload(&json!({ "node": node, "sources": sources }), buf)
}

fn write_payload(payload: &Value, buf: &mut Vec<u8>) -> Result<()> {
    buf.extend_from_slice(MAGIC);
    serde_json::to_writer(buf, payload).map_err(|e| codec_error(e.to_string()))
}

/// The payload of an idem node, `None` for another codec's bytes.
fn decode(buf: &[u8]) -> Result<Option<Payload>> {
    let Some(body) = buf.strip_prefix(MAGIC) else {
        return Ok(None);
    };
    let payload: Value = serde_json::from_slice(body).map_err(|e| codec_error(e.to_string()))?;
    let node = payload["node"]
        .as_str()
        .ok_or_else(|| codec_error("payload without 'node'"))?
        .to_owned();
    let spec = match payload.get("spec") {
        Some(spec) => Some(spec_from_json(spec)?),
        None => None,
    };
    let layout = match payload.get("layout") {
        Some(layout) => {
            Some(serde_json::from_value(layout.clone()).map_err(|e| codec_error(e.to_string()))?)
        }
        None => None,
    };
    let sources = match payload.get("sources") {
        Some(_) => Some(strings(&payload, "sources")?),
        None => None,
    };
    Ok(Some(Payload {
        node,
        spec,
        layout,
        sources,
    }))
}

fn required<T>(field: Option<T>, node: &str, what: &str) -> Result<T> {
    field.ok_or_else(|| codec_error(format!("{node} without its {what}")))
}

fn only_input<T: Clone>(inputs: &[T], node: &str) -> Result<T> {
    match inputs {
        [input] => Ok(input.clone()),
        _ => Err(codec_error(format!(
            "{node} has one input, got {}",
            inputs.len()
        ))),
    }
}

/// idem's aggregates by name: executors need no registry entry for them.
fn idem_udaf(name: &str) -> Option<Arc<AggregateUDF>> {
    match name {
        "max_by" => Some(Arc::new(max_by_udaf())),
        "min_by" => Some(Arc::new(min_by_udaf())),
        _ => None,
    }
}

/// Encodes the [`Dedup`] logical node; everything else goes to `fallback` (by default
/// Ballista's codec).
#[derive(Debug)]
pub struct IdemLogicalCodec {
    fallback: Arc<dyn LogicalExtensionCodec>,
}

impl Default for IdemLogicalCodec {
    fn default() -> Self {
        Self::new(Arc::new(BallistaLogicalExtensionCodec::default()))
    }
}

impl IdemLogicalCodec {
    /// idem's nodes, then `fallback`'s.
    pub fn new(fallback: Arc<dyn LogicalExtensionCodec>) -> Self {
        Self { fallback }
    }
}

impl LogicalExtensionCodec for IdemLogicalCodec {
    fn try_decode(
        &self,
        buf: &[u8],
        inputs: &[LogicalPlan],
        ctx: &TaskContext,
    ) -> Result<Extension> {
        let Some(payload) = decode(buf)? else {
            return self.fallback.try_decode(buf, inputs, ctx);
        };
        let input = only_input(inputs, &payload.node)?;
        let node: Arc<dyn UserDefinedLogicalNode> = match payload.node.as_str() {
            "dedup" => Arc::new(Dedup::try_new(
                input,
                required(payload.spec, "Dedup", "spec")?,
            )?),
            "write_parts" => Arc::new(WriteParts::try_new(
                input,
                required(payload.layout, "WriteParts", "layout")?,
            )?),
            other => return Err(codec_error(format!("unknown logical node '{other}'"))),
        };
        Ok(Extension { node })
    }

    fn try_encode(&self, node: &Extension, buf: &mut Vec<u8>) -> Result<()> {
        let any = node.node.as_any();
        if let Some(dedup) = any.downcast_ref::<Dedup>() {
            return encode("dedup", Some(dedup.spec()), buf);
        }
        if let Some(write) = any.downcast_ref::<WriteParts>() {
            return encode_layout("write_parts", write.layout(), buf);
        }
        self.fallback.try_encode(node, buf)
    }

    fn try_decode_table_provider(
        &self,
        buf: &[u8],
        table_ref: &datafusion::common::TableReference,
        schema: datafusion::arrow::datatypes::SchemaRef,
        ctx: &TaskContext,
    ) -> Result<Arc<dyn datafusion::catalog::TableProvider>> {
        self.fallback
            .try_decode_table_provider(buf, table_ref, schema, ctx)
    }

    fn try_encode_table_provider(
        &self,
        table_ref: &datafusion::common::TableReference,
        node: Arc<dyn datafusion::catalog::TableProvider>,
        buf: &mut Vec<u8>,
    ) -> Result<()> {
        self.fallback
            .try_encode_table_provider(table_ref, node, buf)
    }

    fn try_decode_file_format(
        &self,
        buf: &[u8],
        ctx: &TaskContext,
    ) -> Result<Arc<dyn datafusion::datasource::file_format::FileFormatFactory>> {
        self.fallback.try_decode_file_format(buf, ctx)
    }

    fn try_encode_file_format(
        &self,
        buf: &mut Vec<u8>,
        node: Arc<dyn datafusion::datasource::file_format::FileFormatFactory>,
    ) -> Result<()> {
        self.fallback.try_encode_file_format(buf, node)
    }

    fn try_decode_udaf(&self, name: &str, buf: &[u8]) -> Result<Arc<AggregateUDF>> {
        match idem_udaf(name) {
            Some(udaf) => Ok(udaf),
            None => self.fallback.try_decode_udaf(name, buf),
        }
    }

    fn try_encode_udaf(&self, node: &AggregateUDF, buf: &mut Vec<u8>) -> Result<()> {
        if idem_udaf(node.name()).is_some() {
            return Ok(());
        }
        self.fallback.try_encode_udaf(node, buf)
    }
}

/// Encodes [`DedupExec`], [`PositionExec`] and [`LateDedupExec`]; everything else goes to
/// `fallback` (by default Ballista's codec: shuffle readers and writers, …).
#[derive(Debug)]
pub struct IdemPhysicalCodec {
    fallback: Arc<dyn PhysicalExtensionCodec>,
}

impl Default for IdemPhysicalCodec {
    fn default() -> Self {
        Self::new(Arc::new(BallistaPhysicalExtensionCodec::default()))
    }
}

impl IdemPhysicalCodec {
    /// idem's operators, then `fallback`'s.
    pub fn new(fallback: Arc<dyn PhysicalExtensionCodec>) -> Self {
        Self { fallback }
    }
}

impl PhysicalExtensionCodec for IdemPhysicalCodec {
    fn try_decode(
        &self,
        buf: &[u8],
        inputs: &[Arc<dyn ExecutionPlan>],
        ctx: &TaskContext,
        proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let Some(Payload {
            node,
            spec,
            layout,
            sources,
        }) = decode(buf)?
        else {
            return self.fallback.try_decode(buf, inputs, ctx, proto_converter);
        };
        let input = only_input(inputs, &node)?;
        Ok(match node.as_str() {
            "dedup_exec" => Arc::new(DedupExec::try_new(input, required(spec, &node, "spec")?)?),
            "position_exec" => Arc::new(PositionExec::with_sources(
                input,
                sources.unwrap_or_default(),
            )?),
            "late_dedup_exec" => Arc::new(LateDedupExec::try_new(
                input,
                required(spec, &node, "spec")?,
                ctx.session_config().options(),
            )?),
            "write_parts_exec" => Arc::new(WritePartsExec::new(
                input,
                required(layout, &node, "layout")?,
            )),
            other => return Err(codec_error(format!("unknown physical node '{other}'"))),
        })
    }

    fn try_encode(
        &self,
        node: Arc<dyn ExecutionPlan>,
        buf: &mut Vec<u8>,
        proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<()> {
        if let Some(dedup) = node.downcast_ref::<DedupExec>() {
            return encode("dedup_exec", Some(dedup.spec()), buf);
        }
        if let Some(position) = node.downcast_ref::<PositionExec>() {
            return encode_sources("position_exec", position.sources(), buf);
        }
        if let Some(late) = node.downcast_ref::<LateDedupExec>() {
            return encode("late_dedup_exec", Some(late.spec()), buf);
        }
        if let Some(write) = node.downcast_ref::<WritePartsExec>() {
            return encode_layout("write_parts_exec", write.layout(), buf);
        }
        self.fallback.try_encode(node, buf, proto_converter)
    }

    fn try_decode_udaf(&self, name: &str, buf: &[u8]) -> Result<Arc<AggregateUDF>> {
        match idem_udaf(name) {
            Some(udaf) => Ok(udaf),
            None => self.fallback.try_decode_udaf(name, buf),
        }
    }

    fn try_encode_udaf(&self, node: &AggregateUDF, buf: &mut Vec<u8>) -> Result<()> {
        if idem_udaf(node.name()).is_some() {
            return Ok(());
        }
        self.fallback.try_encode_udaf(node, buf)
    }
}

/// A Ballista session configuration with idem's codecs, and `config`'s partition count
/// (the shuffle width of a dedup) and batch size.
pub fn ballista_config(config: &SessionConfig) -> SessionConfig {
    SessionConfig::new_with_ballista()
        .with_target_partitions(config.target_partitions())
        .with_batch_size(config.batch_size())
        .with_ballista_logical_extension_codec(Arc::new(IdemLogicalCodec::default()))
        .with_ballista_physical_extension_codec(Arc::new(IdemPhysicalCodec::default()))
}

/// The session state a cluster's scheduler and executors run with: `config` with idem's
/// codecs, dedups planned as hash shuffles, parts written by the executors
/// ([`WriteParts`]), the `dedup` table function and the aggregates.
///
/// # Errors
/// A function cannot be registered.
pub fn session_state(config: SessionConfig) -> Result<SessionState> {
    session_state_with_runtime(config, Arc::new(RuntimeEnv::default()))
}

/// [`session_state`] with `runtime`: its object stores (e.g. one that builds `s3://`
/// stores from the environment) and memory pool.
///
/// # Errors
/// A function cannot be registered.
pub fn session_state_with_runtime(
    config: SessionConfig,
    runtime: Arc<RuntimeEnv>,
) -> Result<SessionState> {
    let state = SessionStateBuilder::new()
        .with_config(ballista_config(&config))
        .with_runtime_env(runtime)
        .with_default_features()
        .build();
    let session_id = state.session_id().to_owned();
    let planner = DedupQueryPlanner::with_planner(
        Arc::clone(state.query_planner()),
        DedupPlanner::shuffled(),
    )
    .with_extension_planner(Arc::new(WritePartsPlanner));
    let mut state = SessionStateBuilder::new_from_existing(state)
        .with_session_id(session_id)
        .with_query_planner(Arc::new(planner))
        .build();
    state.register_udtf("dedup", Arc::new(DedupTableFunc));
    state.register_udaf(Arc::new(max_by_udaf()))?;
    state.register_udaf(Arc::new(min_by_udaf()))?;
    Ok(state)
}

/// The client's side: Ballista drops the functions of the state it upgrades, so they are
/// registered again on the context it returns (planning of the table function happens on
/// the client; the dedup itself on the cluster).
fn client_context(ctx: SessionContext) -> SessionContext {
    ctx.register_udtf("dedup", Arc::new(DedupTableFunc));
    ctx.register_udaf(max_by_udaf());
    ctx.register_udaf(min_by_udaf());
    ctx
}

/// A Ballista cluster in this process — a scheduler and an executor on loopback, with
/// idem's codecs and planner — and a client context for it.
///
/// # Errors
/// The scheduler or executor cannot start.
pub async fn standalone(config: SessionConfig) -> Result<SessionContext> {
    let ctx = SessionContext::standalone_with_state(session_state(config)?).await?;
    Ok(client_context(ctx))
}

/// A client context for the scheduler at `url` (`df://host:port`), whose executors must
/// have been started with idem's codecs.
///
/// # Errors
/// The scheduler cannot be reached.
pub async fn remote(url: &str, config: SessionConfig) -> Result<SessionContext> {
    remote_with_runtime(url, config, Arc::new(RuntimeEnv::default())).await
}

/// [`remote`], planning with `runtime`'s object stores on the client (e.g. to read the
/// schema of an `s3://` table).
///
/// # Errors
/// The scheduler cannot be reached.
pub async fn remote_with_runtime(
    url: &str,
    config: SessionConfig,
    runtime: Arc<RuntimeEnv>,
) -> Result<SessionContext> {
    let state = session_state_with_runtime(config, runtime)?;
    let ctx = SessionContext::remote_with_state(url, state).await?;
    Ok(client_context(ctx))
}

/// Starts a Ballista scheduler and `executors` executors in this process, on loopback
/// ports chosen by the system, all with idem's session; returns the scheduler's URL
/// (`df://localhost:PORT`) for [`remote`] clients, in this process or others (`idem sql
/// --cluster`). They run until the process ends, on the calling Tokio runtime.
///
/// # Errors
/// The scheduler or an executor cannot start.
pub async fn start_cluster(config: SessionConfig, executors: usize) -> Result<String> {
    let failed = |e: ballista_core::error::BallistaError| {
        DataFusionError::Configuration(format!("starting the cluster: {e}"))
    };
    let state = session_state(config)?;
    let address = ballista_scheduler::standalone::new_standalone_scheduler_from_state(&state)
        .await
        .map_err(failed)?;
    let grpc = format!("http://localhost:{}", address.port());
    let scheduler = loop {
        match SchedulerGrpcClient::connect(grpc.clone()).await {
            Ok(client) => break client,
            // The server task starts listening a moment after the address is known.
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
        }
    };
    let vcores = state.config().target_partitions().max(1);
    for _ in 0..executors.max(1) {
        ballista_executor::new_standalone_executor_from_state(scheduler.clone(), vcores, &state)
            .await
            .map_err(failed)?;
    }
    Ok(format!("df://localhost:{}", address.port()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_round_trip_through_json() {
        let mut deletes = DeletePolicy::new("op");
        deletes.delete_values = vec!["d".into(), "D".into()];
        deletes.keep_tombstones = true;
        let spec = DedupSpec::new(["event_id", "sequence"], ["lsn", "serial"]).with_options(
            idem_datafusion::DedupOptions::default()
                .with_on_tie(TiePolicy::Last)
                .with_deletes(deletes),
        );
        let mut buf = Vec::new();
        encode("dedup_exec", Some(&spec), &mut buf).expect("encode");
        let decoded = decode(&buf).expect("decode");
        assert_eq!(
            decoded,
            Some(Payload {
                node: "dedup_exec".to_owned(),
                spec: Some(spec),
                layout: None,
                sources: None,
            })
        );
        let layout = PartsLayout {
            directory: "s3://bucket/out/_idem-staging-1/".to_owned(),
            max_rows_per_file: 1_000_000,
            chunk_rows: 8192,
            row_group_rows: 131_072,
            dictionary_page_bytes: 65_536,
            zstd_level: 1,
            fallback_encodings: vec![(
                vec!["nested".to_owned(), "lsn".to_owned()],
                "DELTA_BINARY_PACKED".to_owned(),
            )],
        };
        let mut buf = Vec::new();
        encode_layout("write_parts_exec", &layout, &mut buf).expect("encode");
        let decoded = decode(&buf).expect("decode").expect("an idem payload");
        assert_eq!(decoded.layout, Some(layout));
        assert_eq!(decode(b"\x0a\x02hi").expect("foreign bytes"), None);
        assert!(decode(b"IDEMPLAN1{").is_err());
    }
}
