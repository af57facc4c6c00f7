//! [`LateDedupExec`]: the dedup for inputs that can be read twice (file scans), with late
//! materialisation, so that memory grows with the number of keys, not with the rows.
//!
//! ```text
//!   decide (once, shared by all output partitions)
//!     file scan, key + version + op columns only (projection pushed into the scan)
//!       │ every partition, decoded in parallel, rows stamped partition << 40 | row
//!       ▼
//!     KeepMaxTable::update_at ──▶ sorted winner positions, tie rows
//!       (if the memory pool refuses the table: the decision scan again, once per key
//!        partition, each admitting only its own keys)
//!
//!   output partition i
//!     file scan partition i, all columns ──▶ keep the rows whose position won,
//!                                            compare the tied rows (conflicts)
//! ```
//!
//! Losing rows are decoded but never held: the payload is read once, in the second scan,
//! and streamed out. Positions depend only on which files each partition reads and in what
//! order, which the scan fixes at planning, so both scans agree on them.

use std::fmt;
use std::sync::{Arc, Mutex};

use datafusion::arrow::array::{BooleanArray, RecordBatch, UInt32Array};
use datafusion::arrow::compute::{filter_record_batch, take_record_batch};
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{DataFusionError, Result, internal_err};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_optimizer::projection_pushdown::ProjectionPushdown;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::metrics::{
    Count, ExecutionPlanMetricsSet, MetricBuilder, MetricsSet,
};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, Partitioning,
    PlanProperties, ReplaceChildrenOptions,
};
use futures::{StreamExt, TryStreamExt};
use idem_core::key::KeyRouter;
use idem_core::{DedupSpec, DedupStats, KeepMaxTable, TieCheck, TieRow};
use tokio::sync::OnceCell;

use crate::exec::{
    DedupMetrics, PositionExec, ROW_BITS, in_plan_order, plan_shuffled_dedup, positions, to_df,
};
use crate::scan::is_rescannable_file_scan;

/// Key partitions are multiplied by this when a partitioned decision still does not fit.
const PARTITION_GROWTH: u32 = 4;
/// Beyond this many key partitions the decision gives up (the pool is absurdly small).
const MAX_KEY_PARTITIONS: u32 = 4096;

/// The physical plan of a dedup over `input`, whose schema it keeps.
///
/// A file scan, which can be read twice, gets [`LateDedupExec`]:
/// key and version columns first, then only the winning rows, so memory follows the
/// number of keys. Anything else gets [`PositionExec`](crate::PositionExec), a hash repartition on the key into
/// the target partitions, then [`DedupExec`](crate::DedupExec), which holds its partition's rows.
///
/// # Errors
/// A missing column, or a key / version type idem cannot use.
pub fn plan_dedup(
    input: Arc<dyn ExecutionPlan>,
    spec: DedupSpec,
    config: &ConfigOptions,
) -> Result<Arc<dyn ExecutionPlan>> {
    if is_rescannable_file_scan(&input) {
        return Ok(Arc::new(LateDedupExec::try_new(input, spec, config)?));
    }
    plan_shuffled_dedup(input, spec, config)
}

/// What the decision scan found, shared by every output partition.
struct Decided {
    keep: Vec<u64>,
    tie_rows: Vec<TieRow>,
    check: Mutex<TieCheck>,
    /// Holds the memory of `keep` and `tie_rows` until the plan is dropped.
    _reservation: MemoryReservation,
}

/// Dedup with late materialisation over a rescannable input (see the module docs). Its
/// schema and partitions are its input's; rows come out in input order.
#[derive(Debug)]
pub struct LateDedupExec {
    input: Arc<dyn ExecutionPlan>,
    decision: Arc<dyn ExecutionPlan>,
    spec: DedupSpec,
    metrics: ExecutionPlanMetricsSet,
    decided: Arc<OnceCell<std::result::Result<Arc<Decided>, Arc<DataFusionError>>>>,
    cache: Arc<PlanProperties>,
}

impl fmt::Debug for Decided {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Decided({} rows kept)", self.keep.len())
    }
}

impl LateDedupExec {
    /// Dedups `input`, which must be rescannable (see [`is_rescannable_file_scan`]).
    ///
    /// # Errors
    /// A missing column or unusable type, or an input that cannot be read twice.
    pub fn try_new(
        input: Arc<dyn ExecutionPlan>,
        spec: DedupSpec,
        config: &ConfigOptions,
    ) -> Result<Self> {
        if !is_rescannable_file_scan(&input) {
            return internal_err!("LateDedupExec needs a file scan it can read twice");
        }
        let schema = input.schema();
        idem_core::KeepMaxTable::try_new(&schema, &spec).map_err(to_df)?;
        let mut names: Vec<&String> = spec.decision_columns().collect();
        names.sort_by_key(|n| schema.index_of(n).unwrap_or(usize::MAX));
        names.dedup();
        let exprs = names
            .into_iter()
            .map(|name| {
                Ok((
                    Arc::new(Column::new_with_schema(name, &schema)?) as Arc<dyn PhysicalExpr>,
                    name.clone(),
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let projected: Arc<dyn ExecutionPlan> =
            Arc::new(ProjectionExec::try_new(exprs, Arc::clone(&input))?);
        // Into the scan, so that the decision decodes only these columns.
        let decision = ProjectionPushdown::new().optimize(projected, config)?;
        let cache = Arc::new(PlanProperties::new(
            EquivalenceProperties::new(Arc::clone(&schema)),
            Partitioning::UnknownPartitioning(input.output_partitioning().partition_count()),
            EmissionType::Final,
            Boundedness::Bounded,
        ));
        Ok(Self {
            input,
            decision,
            spec,
            metrics: ExecutionPlanMetricsSet::new(),
            decided: Arc::new(OnceCell::new()),
            cache,
        })
    }

    /// The dedup's key, version and policies.
    pub fn spec(&self) -> &DedupSpec {
        &self.spec
    }
}

impl DisplayAs for LateDedupExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "LateDedupExec: {}, decide over [{}]",
            self.spec,
            self.decision
                .schema()
                .fields()
                .iter()
                .map(|f| f.name().as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )
    }
}

impl ExecutionPlan for LateDedupExec {
    fn name(&self) -> &'static str {
        "LateDedupExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.cache
    }

    /// None, for the optimizer: a repartition inserted into either scan would make
    /// positions depend on thread timing. The scans are planned, once, by the constructor.
    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        Vec::new()
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn replace_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
        _options: ReplaceChildrenOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if !children.is_empty() {
            return internal_err!("LateDedupExec has no children");
        }
        Ok(self)
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.replace_children(
            children,
            ReplaceChildrenOptions::new(
                datafusion::physical_plan::ChildrenPropertiesMode::Recompute,
            ),
        )
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let decided = Arc::clone(&self.decided);
        let decision = Arc::clone(&self.decision);
        let input = Arc::clone(&self.input);
        let spec = self.spec.clone();
        let metrics = self.metrics.clone();
        let schema = self.input.schema();
        let conflicts = MetricBuilder::new(&self.metrics).counter("conflicts", partition);
        let output = futures::stream::once(async move {
            let decided = decided
                .get_or_init(|| async {
                    decide(decision, &spec, &input.schema(), &context, &metrics)
                        .await
                        .map(Arc::new)
                        .map_err(Arc::new)
                })
                .await
                .clone()
                .map_err(DataFusionError::Shared)?;
            let stream = input.execute(partition, in_plan_order(&context))?;
            Ok::<_, DataFusionError>(select_winners(stream, partition, decided, conflicts))
        })
        .try_flatten();
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, output)))
    }
}

/// The rows of one input partition whose positions won; tied rows go to the shared check.
fn select_winners(
    stream: SendableRecordBatchStream,
    partition: usize,
    decided: Arc<Decided>,
    conflicts: Count,
) -> impl futures::Stream<Item = Result<RecordBatch>> + Send {
    let first = (partition as u64) << ROW_BITS;
    let end = ((partition as u64) + 1) << ROW_BITS;
    let mut keep_at = decided.keep.partition_point(|&p| p < first);
    let keep_end = decided.keep.partition_point(|&p| p < end);
    let mut tie_at = decided.tie_rows.partition_point(|t| t.position < first);
    let tie_end = decided.tie_rows.partition_point(|t| t.position < end);
    let mut next = first;
    stream.map(move |batch| {
        let batch = batch?;
        let start = next;
        let stop = start + batch.num_rows() as u64;
        next = stop;
        let mut mask = vec![false; batch.num_rows()];
        while keep_at < keep_end && decided.keep[keep_at] < stop {
            mask[(decided.keep[keep_at] - start) as usize] = true;
            keep_at += 1;
        }
        let (mut tie_rows, mut groups) = (Vec::new(), Vec::new());
        while tie_at < tie_end && decided.tie_rows[tie_at].position < stop {
            let tie = decided.tie_rows[tie_at];
            tie_rows.push((tie.position - start) as u32);
            groups.push(tie.group);
            tie_at += 1;
        }
        if !tie_rows.is_empty() {
            let tied = take_record_batch(&batch, &UInt32Array::from(tie_rows)).map_err(to_df)?;
            let mut check = decided
                .check
                .lock()
                .map_err(|_| DataFusionError::Internal("tie check poisoned".into()))?;
            let before = check.conflicts();
            let observed = check.observe(&tied, &groups);
            conflicts.add((check.conflicts() - before) as usize);
            observed.map_err(to_df)?;
        }
        filter_record_batch(&batch, &BooleanArray::from(mask)).map_err(to_df)
    })
}

/// The decision scan: every key's winner, in memory if the pool allows, else one key
/// partition at a time.
async fn decide(
    decision: Arc<dyn ExecutionPlan>,
    spec: &DedupSpec,
    full_schema: &SchemaRef,
    context: &Arc<TaskContext>,
    metrics: &ExecutionPlanMetricsSet,
) -> Result<Decided> {
    let dedup_metrics = DedupMetrics::new(metrics, 0);
    let key_partitions = MetricBuilder::new(metrics).counter("key_partitions", 0);
    let mut reservation = MemoryConsumer::new("LateDedupExec")
        .with_can_spill(true)
        .register(context.memory_pool());
    let mut partitions = 1u32;
    let (keep, tie_rows, tie_groups, stats) = loop {
        let attempt = decide_partitions(
            &decision,
            spec,
            context,
            &mut reservation,
            &dedup_metrics,
            partitions,
        );
        match attempt.await? {
            Some(decided) => break decided,
            None if partitions < MAX_KEY_PARTITIONS => {
                partitions = (partitions * PARTITION_GROWTH).min(MAX_KEY_PARTITIONS);
            }
            None => {
                return Err(DataFusionError::ResourcesExhausted(format!(
                    "LateDedupExec: the key table does not fit the memory pool even in \
                     {MAX_KEY_PARTITIONS} key partitions"
                )));
            }
        }
    };
    key_partitions.add(partitions as usize);
    dedup_metrics.add(&stats);
    // The winners list is needed whatever the pool says: account for it honestly.
    reservation
        .resize(keep.capacity() * size_of::<u64>() + tie_rows.capacity() * size_of::<TieRow>());
    dedup_metrics.note_memory(&reservation);
    Ok(Decided {
        keep,
        tie_rows,
        check: Mutex::new(TieCheck::try_new(full_schema, spec, tie_groups).map_err(to_df)?),
        _reservation: reservation,
    })
}

type Decision = (Vec<u64>, Vec<TieRow>, u32, DedupStats);

/// One decision in `partitions` key partitions (one scan of the decision columns each), or
/// `None` if a partition's table did not fit the pool.
async fn decide_partitions(
    decision: &Arc<dyn ExecutionPlan>,
    spec: &DedupSpec,
    context: &Arc<TaskContext>,
    reservation: &mut MemoryReservation,
    metrics: &DedupMetrics,
    partitions: u32,
) -> Result<Option<Decision>> {
    let positioned: Arc<dyn ExecutionPlan> = Arc::new(PositionExec::try_new(Arc::clone(decision))?);
    let merged: Arc<dyn ExecutionPlan> = if positioned.output_partitioning().partition_count() > 1 {
        Arc::new(CoalescePartitionsExec::new(Arc::clone(&positioned)))
    } else {
        Arc::clone(&positioned)
    };
    let mut router = KeyRouter::try_new(&positioned.schema(), &spec.keys).map_err(to_df)?;
    let mut routes = Vec::new();
    let (mut keep, mut tie_rows, mut tie_groups) = (Vec::new(), Vec::new(), 0u32);
    let mut stats = DedupStats::default();
    for partition in 0..partitions {
        let mut table = KeepMaxTable::try_new(&positioned.schema(), spec).map_err(to_df)?;
        let mut stream = merged.execute(0, in_plan_order(context))?;
        while let Some(batch) = stream.next().await {
            let mut batch = batch?;
            if partitions > 1 {
                router
                    .route(&batch, partitions, &mut routes)
                    .map_err(to_df)?;
                let mine: BooleanArray = routes.iter().map(|&r| Some(r == partition)).collect();
                batch = filter_record_batch(&batch, &mine).map_err(to_df)?;
            }
            table.update_at(&batch, positions(&batch)?).map_err(to_df)?;
            if reservation.try_resize(table.size()).is_err() {
                reservation.resize(0);
                return Ok(None);
            }
            metrics.note_memory(reservation);
        }
        let resolution = table.finish();
        keep.extend(resolution.keep);
        tie_rows.extend(resolution.tie_rows.into_iter().map(|t| TieRow {
            position: t.position,
            group: t.group + tie_groups,
        }));
        tie_groups += resolution.tie_groups;
        stats += resolution.stats;
    }
    reservation.resize(0);
    if partitions > 1 {
        keep.sort_unstable();
        tie_rows.sort_unstable_by_key(|t| t.position);
    }
    Ok(Some((keep, tie_rows, tie_groups, stats)))
}
