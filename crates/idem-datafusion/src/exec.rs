//! The physical operators: [`PositionExec`] stamps every row with its input position, and
//! [`DedupExec`] keeps one row per key in each hash partition.
//!
//! ```text
//!   source scan (N partitions, deterministic: files → partitions)
//!        │
//!   PositionExec        __idem_position = partition << 40 | row within partition
//!        │
//!   RepartitionExec     Hash(key columns) → M partitions
//!        │
//!   DedupExec           per partition: rows put back in position order (so the order is
//!                       the same whatever the interleaving of the repartition), then
//!                       idem-core's keep-max table; spills by key hash when the memory
//!                       pool refuses to grow
//! ```
//!
//! A key lands in exactly one partition, so partitions dedup independently and every core
//! works. Because ties are broken by position, not by arrival, the output is deterministic.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, AsArray, RecordBatch, UInt32Array, UInt64Array};
use datafusion::arrow::compute::{
    concat_batches, filter_record_batch, sort_to_indices, take_record_batch,
};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef, UInt64Type};
use datafusion::arrow::ipc::reader::StreamReader;
use datafusion::arrow::ipc::writer::StreamWriter;
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{DataFusionError, Result, internal_err};
use datafusion::datasource::physical_plan::FileScanConfig;
use datafusion::datasource::source::DataSourceExec;
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::execution::{SpillFile, SpillWriter};
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::metrics::{
    Count, ExecutionPlanMetricsSet, Gauge, MetricBuilder, MetricsSet,
};
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    ChildrenPropertiesMode, DisplayAs, DisplayFormatType, Distribution, ExecutionPlan,
    ExecutionPlanProperties, Partitioning, PlanProperties, ReplaceChildrenOptions,
};
use futures::{StreamExt, TryStreamExt};
use idem_core::key::KeyLayout;
use idem_core::{DedupSpec, DedupStats, dedup_batches};

/// The column [`PositionExec`] adds and [`DedupExec`] consumes.
pub const POSITION_COLUMN: &str = "__idem_position";
/// Bits of a position that count rows within a source partition.
pub(crate) const ROW_BITS: u32 = 40;
/// Spill files per level when a partition does not fit in memory.
const SPILL_FANOUT: usize = 16;
/// Re-partitioning levels before a spill partition that still does not fit is processed
/// anyway (only a single key with an enormous number of rows can get there).
const MAX_SPILL_DEPTH: u32 = 3;

pub(crate) fn to_df(error: datafusion::arrow::error::ArrowError) -> DataFusionError {
    DataFusionError::ArrowError(Box::new(error), None)
}

/// `context` with file scans bound to the partitions the plan gave them. DataFusion lets
/// an idle scan partition steal files from its siblings at run time, which would make a
/// row's (partition, row) position — idem's input order — depend on thread timing.
pub(crate) fn in_plan_order(context: &Arc<TaskContext>) -> Arc<TaskContext> {
    if !context
        .session_config()
        .options()
        .execution
        .enable_file_stream_work_stealing
    {
        return Arc::clone(context);
    }
    let mut config = context.session_config().clone();
    config
        .options_mut()
        .execution
        .enable_file_stream_work_stealing = false;
    Arc::new(TaskContext::new(
        context.task_id(),
        context.session_id(),
        config,
        context.scalar_functions().clone(),
        context.higher_order_functions().clone(),
        context.aggregate_functions().clone(),
        context.window_functions().clone(),
        context.runtime_env(),
    ))
}

/// Adds [`POSITION_COLUMN`], `partition << 40 | row`, so that rows can be put back in a
/// deterministic order after a hash repartition has interleaved them.
///
/// `partition` is the partition of the whole scan, even where a task runs a plan restricted
/// to some of them (Ballista numbers a task's partitions from 0 again): the operator keeps
/// the identity of every partition of the file scan below as planned (its first file and
/// byte range) and looks up the one it is asked to run.
#[derive(Debug, Clone)]
pub struct PositionExec {
    input: Arc<dyn ExecutionPlan>,
    schema: SchemaRef,
    cache: Arc<PlanProperties>,
    /// The scan's partitions as planned, by [`scan_partition_ids`].
    sources: Vec<String>,
}

/// The file scan below `plan` through filters and projections: each partition's identity,
/// its first file and where in it the partition starts. Empty without such a scan.
fn scan_partition_ids(plan: &Arc<dyn ExecutionPlan>) -> Vec<String> {
    let Some(node) = crate::scan::file_scan_below(plan) else {
        return Vec::new();
    };
    let Some(scan) = node
        .downcast_ref::<DataSourceExec>()
        .and_then(|s| s.data_source().downcast_ref::<FileScanConfig>())
    else {
        return Vec::new();
    };
    scan.file_groups
        .iter()
        .map(|group| match group.files().first() {
            Some(file) => format!(
                "{}@{}",
                file.object_meta.location,
                file.range.as_ref().map_or(0, |r| r.start)
            ),
            None => String::new(),
        })
        .collect()
}

impl PositionExec {
    /// Stamps the rows of `input`.
    ///
    /// # Errors
    /// The input already has a column named [`POSITION_COLUMN`].
    pub fn try_new(input: Arc<dyn ExecutionPlan>) -> Result<Self> {
        let sources = scan_partition_ids(&input);
        Self::with_sources(input, sources)
    }

    /// Stamps the rows of `input`, whose file scan had the partitions `sources` when
    /// planned ([`PositionExec::sources`]): for a plan decoded on a cluster's executor.
    ///
    /// # Errors
    /// The input already has a column named [`POSITION_COLUMN`].
    pub fn with_sources(input: Arc<dyn ExecutionPlan>, sources: Vec<String>) -> Result<Self> {
        let input_schema = input.schema();
        if input_schema.field_with_name(POSITION_COLUMN).is_ok() {
            return internal_err!("input already has a column named {POSITION_COLUMN}");
        }
        let mut fields: Vec<Field> = input_schema
            .fields()
            .iter()
            .map(|f| f.as_ref().clone())
            .collect();
        fields.push(Field::new(POSITION_COLUMN, DataType::UInt64, false));
        let schema = Arc::new(Schema::new_with_metadata(
            fields,
            input_schema.metadata().clone(),
        ));
        let cache = Arc::new(PlanProperties::new(
            EquivalenceProperties::new(Arc::clone(&schema)),
            input.output_partitioning().clone(),
            EmissionType::Incremental,
            input.boundedness(),
        ));
        Ok(Self {
            input,
            schema,
            cache,
            sources,
        })
    }

    /// The identities of the scan's partitions as planned.
    pub fn sources(&self) -> &[String] {
        &self.sources
    }

    /// The planned partition that `local`, a partition of the input as it is now, reads.
    fn planned_partition(&self, local: usize) -> usize {
        scan_partition_ids(&self.input)
            .get(local)
            .filter(|id| !id.is_empty())
            .and_then(|id| self.sources.iter().position(|s| s == id))
            .unwrap_or(local)
    }
}

impl DisplayAs for PositionExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "PositionExec")
    }
}

impl ExecutionPlan for PositionExec {
    fn name(&self) -> &'static str {
        "PositionExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.cache
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    /// A repartition below would make positions depend on thread timing.
    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        vec![false]
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn replace_children(
        self: Arc<Self>,
        mut children: Vec<Arc<dyn ExecutionPlan>>,
        _options: ReplaceChildrenOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if children.len() != 1 {
            return internal_err!("PositionExec takes one child");
        }
        let child = children.swap_remove(0);
        // A child restricted to some of the planned partitions keeps the plan's numbering.
        let ids = scan_partition_ids(&child);
        if !ids.is_empty() && ids.iter().all(|id| self.sources.contains(id)) {
            return Ok(Arc::new(Self::with_sources(child, self.sources.clone())?));
        }
        Ok(Arc::new(Self::try_new(child)?))
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.replace_children(
            children,
            ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute),
        )
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let schema = Arc::clone(&self.schema);
        let mut next = (self.planned_partition(partition) as u64) << ROW_BITS;
        let stream = self
            .input
            .execute(partition, in_plan_order(&context))?
            .map(move |batch| {
                let batch = batch?;
                let start = next;
                next += batch.num_rows() as u64;
                let positions: ArrayRef = Arc::new(UInt64Array::from_iter_values(start..next));
                let mut columns = batch.columns().to_vec();
                columns.push(positions);
                RecordBatch::try_new(Arc::clone(&schema), columns).map_err(to_df)
            });
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            Arc::clone(&self.schema),
            stream,
        )))
    }
}

/// The physical plan of a dedup over `input` as [`PositionExec`], a hash repartition on the
/// key into the target partitions, and [`DedupExec`], whatever the input.
///
/// # Errors
/// A missing column, or a key / version type idem cannot use.
pub fn plan_shuffled_dedup(
    input: Arc<dyn ExecutionPlan>,
    spec: DedupSpec,
    config: &ConfigOptions,
) -> Result<Arc<dyn ExecutionPlan>> {
    let positioned: Arc<dyn ExecutionPlan> = Arc::new(PositionExec::try_new(input)?);
    let keys = key_columns(&spec, &positioned.schema())?;
    let repartitioned = Arc::new(RepartitionExec::try_new(
        positioned,
        Partitioning::Hash(keys, config.execution.target_partitions.max(1)),
    )?);
    Ok(Arc::new(DedupExec::try_new(repartitioned, spec)?))
}

/// The spec's key columns as physical expressions over `schema`.
fn key_columns(spec: &DedupSpec, schema: &Schema) -> Result<Vec<Arc<dyn PhysicalExpr>>> {
    spec.keys
        .iter()
        .map(|k| Ok(Arc::new(Column::new_with_schema(k, schema)?) as Arc<dyn PhysicalExpr>))
        .collect()
}

/// Keeps, per key, the row with the maximum version (idem's semantics: nulls, ties,
/// deletes, conflicts), over an input hash-partitioned on the key and carrying
/// [`POSITION_COLUMN`]. Its output drops that column.
#[derive(Debug, Clone)]
pub struct DedupExec {
    input: Arc<dyn ExecutionPlan>,
    spec: DedupSpec,
    keys: Vec<Arc<dyn PhysicalExpr>>,
    schema: SchemaRef,
    metrics: ExecutionPlanMetricsSet,
    cache: Arc<PlanProperties>,
}

impl DedupExec {
    /// Dedups `input` (which must have the spec's columns and [`POSITION_COLUMN`]).
    ///
    /// # Errors
    /// A missing column, or a key / version type idem cannot use.
    pub fn try_new(input: Arc<dyn ExecutionPlan>, spec: DedupSpec) -> Result<Self> {
        let input_schema = input.schema();
        let position = input_schema.index_of(POSITION_COLUMN)?;
        let fields: Vec<Field> = input_schema
            .fields()
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != position)
            .map(|(_, f)| f.as_ref().clone())
            .collect();
        let schema = Arc::new(Schema::new_with_metadata(
            fields,
            input_schema.metadata().clone(),
        ));
        // Validates key and version columns up front, so errors surface at planning.
        idem_core::KeepMaxTable::try_new(&schema, &spec).map_err(to_df)?;
        let keys = key_columns(&spec, &input_schema)?;
        let cache = Arc::new(PlanProperties::new(
            EquivalenceProperties::new(Arc::clone(&schema)),
            // Same hash partitioning of the key columns, minus the position column: the
            // key expressions keep their names, so re-express them on the output schema.
            match input.output_partitioning() {
                Partitioning::Hash(_, n) => Partitioning::Hash(key_columns(&spec, &schema)?, *n),
                other => Partitioning::UnknownPartitioning(other.partition_count()),
            },
            EmissionType::Final,
            Boundedness::Bounded,
        ));
        Ok(Self {
            input,
            spec,
            keys,
            schema,
            metrics: ExecutionPlanMetricsSet::new(),
            cache,
        })
    }

    /// The dedup's key, version and policies.
    pub fn spec(&self) -> &DedupSpec {
        &self.spec
    }

    /// The input plan.
    pub fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.input
    }
}

impl DisplayAs for DedupExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "DedupExec: {}", self.spec)
    }
}

impl ExecutionPlan for DedupExec {
    fn name(&self) -> &'static str {
        "DedupExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.cache
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn required_input_distribution(&self) -> Vec<Distribution> {
        vec![Distribution::KeyPartitioned(self.keys.clone())]
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![false]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        for key in &self.keys {
            if f(key)? == TreeNodeRecursion::Stop {
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        Ok(TreeNodeRecursion::Continue)
    }

    fn replace_children(
        self: Arc<Self>,
        mut children: Vec<Arc<dyn ExecutionPlan>>,
        _options: ReplaceChildrenOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if children.len() != 1 {
            return internal_err!("DedupExec takes one child");
        }
        Ok(Arc::new(Self::try_new(
            children.swap_remove(0),
            self.spec.clone(),
        )?))
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        self.replace_children(
            children,
            ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute),
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
        let input = self.input.execute(partition, Arc::clone(&context))?;
        let reservation = MemoryConsumer::new(format!("DedupExec[{partition}]"))
            .with_can_spill(true)
            .register(context.memory_pool());
        let state = PartitionState {
            spec: self.spec.clone(),
            input_schema: self.input.schema(),
            output_schema: Arc::clone(&self.schema),
            metrics: DedupMetrics::new(&self.metrics, partition),
            context,
            reservation,
        };
        let output = futures::stream::once(state.ingest(input))
            .map_ok(|drain| {
                futures::stream::iter(drain)
                    .map_ok(|batches| futures::stream::iter(batches.into_iter().map(Ok)))
                    .try_flatten()
            })
            .try_flatten();
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            Arc::clone(&self.schema),
            output,
        )))
    }
}

/// DataFusion metrics of one partition: the dedup counters and spilling.
pub(crate) struct DedupMetrics {
    rows_in: Count,
    rows_out: Count,
    duplicates: Count,
    superseded: Count,
    deleted: Count,
    conflicts: Count,
    null_keys: Count,
    distinct_keys: Count,
    tombstones_kept: Count,
    spill_files: Count,
    spilled_rows: Count,
    spilled_bytes: Count,
    /// The most memory the operator held from the pool at once.
    peak_mem_used: Gauge,
}

impl DedupMetrics {
    pub(crate) fn new(metrics: &ExecutionPlanMetricsSet, partition: usize) -> Self {
        let counter = |name: &'static str| MetricBuilder::new(metrics).counter(name, partition);
        Self {
            rows_in: counter("rows_in"),
            rows_out: MetricBuilder::new(metrics).output_rows(partition),
            duplicates: counter("duplicates"),
            superseded: counter("superseded"),
            deleted: counter("deleted"),
            conflicts: counter("conflicts"),
            null_keys: counter("null_keys"),
            distinct_keys: counter("distinct_keys"),
            tombstones_kept: counter("tombstones_kept"),
            spill_files: counter("spill_files"),
            spilled_rows: counter("spilled_rows"),
            spilled_bytes: counter("spilled_bytes"),
            peak_mem_used: MetricBuilder::new(metrics)
                .peak_memory_usage("peak_mem_used", partition),
        }
    }

    /// Records what `reservation` holds now, if that is a new peak.
    pub(crate) fn note_memory(&self, reservation: &MemoryReservation) {
        self.peak_mem_used.set_max(reservation.size());
    }

    pub(crate) fn add(&self, stats: &DedupStats) {
        self.rows_in.add(stats.rows_in as usize);
        self.rows_out.add(stats.rows_out as usize);
        self.duplicates.add(stats.duplicates as usize);
        self.superseded.add(stats.superseded as usize);
        self.deleted.add(stats.deleted as usize);
        self.conflicts.add(stats.conflicts as usize);
        self.null_keys.add(stats.null_keys as usize);
        self.distinct_keys.add(stats.distinct_keys as usize);
        self.tombstones_kept.add(stats.tombstones_kept as usize);
    }
}

/// Rows of one partition grouped by the source partition they came from.
///
/// Arrival order is not source order: under memory pressure DataFusion's hash repartition
/// sends the batches it spilled through one channel shared by all its inputs, so a source's
/// batches can come out of order. Rows are put back in position order before the keep-max
/// table sees them, because ties are decided by that order.
#[derive(Default)]
struct Grouped {
    by_source: BTreeMap<u64, Vec<RecordBatch>>,
}

impl Grouped {
    fn push(&mut self, batch: RecordBatch) -> Result<()> {
        for (source, part) in split_by_source(batch)? {
            self.by_source.entry(source).or_default().push(part);
        }
        Ok(())
    }

    /// The rows held, in position order.
    fn into_ordered(self) -> Result<Vec<RecordBatch>> {
        let mut ordered = Vec::new();
        for mut parts in self.by_source.into_values() {
            // Each part is one repartitioned batch's rows of the source: ascending and not
            // overlapping another part, so ordering the parts by their first row orders
            // the rows. That is checked, and the rows sorted one by one where it fails.
            parts.sort_by_cached_key(|part| first_position(part).unwrap_or(0));
            if in_position_order(&parts)? {
                ordered.extend(parts);
            } else {
                ordered.push(sorted_by_position(&parts)?);
            }
        }
        Ok(ordered)
    }
}

fn first_position(batch: &RecordBatch) -> Result<u64> {
    Ok(positions(batch)?.values().first().copied().unwrap_or(0))
}

/// Whether the positions of `parts`, read one part after another, strictly ascend.
fn in_position_order(parts: &[RecordBatch]) -> Result<bool> {
    let mut last: Option<u64> = None;
    for part in parts {
        for &position in positions(part)?.values() {
            if last.is_some_and(|last| position <= last) {
                return Ok(false);
            }
            last = Some(position);
        }
    }
    Ok(true)
}

/// The rows of `parts` in one batch, sorted by position.
fn sorted_by_position(parts: &[RecordBatch]) -> Result<RecordBatch> {
    let Some(first) = parts.first() else {
        return internal_err!("no rows to sort");
    };
    let rows = concat_batches(&first.schema(), parts).map_err(to_df)?;
    let order = sort_to_indices(positions(&rows)?, None, None).map_err(to_df)?;
    take_record_batch(&rows, &order).map_err(to_df)
}

pub(crate) fn positions(batch: &RecordBatch) -> Result<&UInt64Array> {
    batch
        .column_by_name(POSITION_COLUMN)
        .and_then(|c| c.as_primitive_opt::<UInt64Type>())
        .ok_or_else(|| DataFusionError::Internal(format!("{POSITION_COLUMN} missing")))
}

/// Splits a batch by source partition (usually it has one, and is returned as it is).
fn split_by_source(batch: RecordBatch) -> Result<Vec<(u64, RecordBatch)>> {
    let sources: Vec<u64> = positions(&batch)?
        .values()
        .iter()
        .map(|p| p >> ROW_BITS)
        .collect();
    let Some(&first) = sources.first() else {
        return Ok(Vec::new());
    };
    if sources.iter().all(|&s| s == first) {
        return Ok(vec![(first, batch)]);
    }
    let mut distinct = sources.clone();
    distinct.sort_unstable();
    distinct.dedup();
    distinct
        .into_iter()
        .map(|source| {
            let mask: datafusion::arrow::array::BooleanArray =
                sources.iter().map(|&s| Some(s == source)).collect();
            Ok((source, filter_record_batch(&batch, &mask).map_err(to_df)?))
        })
        .collect()
}

/// Per-partition execution state.
struct PartitionState {
    spec: DedupSpec,
    input_schema: SchemaRef,
    output_schema: SchemaRef,
    metrics: DedupMetrics,
    context: Arc<TaskContext>,
    reservation: MemoryReservation,
}

/// Hash-partitioned spill files of one level, being written.
struct Spill {
    files: Vec<(SpillPath, StreamWriter<Box<dyn SpillWriter>>)>,
}

/// A finished spill file.
type SpillPath = Arc<dyn SpillFile>;

impl Spill {
    fn finish(self) -> Result<Vec<SpillPath>> {
        self.files
            .into_iter()
            .map(|(file, mut writer)| {
                writer.finish().map_err(to_df)?;
                writer.into_inner().map_err(to_df)?.finish()?;
                Ok(file)
            })
            .collect()
    }
}

/// Bytes to reserve for holding a batch and its share of the keep-max table (the table
/// keeps well under 100 bytes per row for common keys).
fn reservation_for(batch: &RecordBatch) -> usize {
    batch.get_array_memory_size() + batch.num_rows() * 96
}

/// What a partition's input became: rows in memory, or spill files to work through.
enum Ingested {
    InMemory(Grouped),
    Spilled(Vec<SpillPath>),
}

impl PartitionState {
    /// Reads the whole input, holding it while the pool allows and spilling by key hash
    /// from the first refusal on.
    async fn ingest(mut self, mut input: SendableRecordBatchStream) -> Result<Drain> {
        let mut grouped = Grouped::default();
        let mut spill: Option<Spill> = None;
        while let Some(batch) = input.next().await {
            let batch = batch?;
            if batch.num_rows() == 0 {
                continue;
            }
            match spill.as_mut() {
                Some(spill) => self.spill_batch(spill, &batch, 0)?,
                None if self.try_hold(&batch) => grouped.push(batch)?,
                None => spill = Some(self.start_spill(std::mem::take(&mut grouped), &batch, 0)?),
            }
        }
        let work = match spill {
            None => Ingested::InMemory(grouped),
            Some(spill) => Ingested::Spilled(spill.finish()?),
        };
        Ok(Drain {
            state: self,
            work: vec![(work, 1)],
        })
    }

    /// Reserves memory to hold `batch`, if the pool allows.
    fn try_hold(&mut self, batch: &RecordBatch) -> bool {
        let held = self.reservation.try_grow(reservation_for(batch)).is_ok();
        self.metrics.note_memory(&self.reservation);
        held
    }

    /// Moves what is held, and `batch`, into new spill files.
    fn start_spill(&mut self, held: Grouped, batch: &RecordBatch, depth: u32) -> Result<Spill> {
        let mut spill = self.new_spill()?;
        for held in held.into_ordered()? {
            self.spill_batch(&mut spill, &held, depth)?;
        }
        self.reservation.free();
        self.spill_batch(&mut spill, batch, depth)?;
        Ok(spill)
    }

    /// Dedups rows held in memory, in position order, and releases their reservation.
    fn dedup(&mut self, grouped: Grouped) -> Result<Vec<RecordBatch>> {
        let batches: Vec<RecordBatch> = grouped
            .into_ordered()?
            .into_iter()
            .map(|b| self.without_position(&b))
            .collect::<Result<_>>()?;
        let (output, stats) =
            dedup_batches(&self.output_schema, &batches, &self.spec).map_err(to_df)?;
        drop(batches);
        self.reservation.free();
        self.metrics.add(&stats);
        Ok(output)
    }

    fn without_position(&self, batch: &RecordBatch) -> Result<RecordBatch> {
        let position = self.input_schema.index_of(POSITION_COLUMN)?;
        let columns: Vec<ArrayRef> = batch
            .columns()
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != position)
            .map(|(_, c)| Arc::clone(c))
            .collect();
        RecordBatch::try_new(Arc::clone(&self.output_schema), columns).map_err(to_df)
    }

    fn new_spill(&self) -> Result<Spill> {
        let files = (0..SPILL_FANOUT)
            .map(|_| {
                let file = self
                    .context
                    .runtime_env()
                    .disk_manager
                    .create_tmp_file("DedupExec spill")?;
                let writer = StreamWriter::try_new(file.open_writer()?, &self.input_schema)
                    .map_err(to_df)?;
                Ok((file, writer))
            })
            .collect::<Result<_>>()?;
        self.metrics.spill_files.add(SPILL_FANOUT);
        Ok(Spill { files })
    }

    /// Routes a batch's rows to spill files by key hash; `depth` picks other hash bits at
    /// each level so that a re-spilled partition actually splits.
    fn spill_batch(&self, spill: &mut Spill, batch: &RecordBatch, depth: u32) -> Result<()> {
        let key_fields = self
            .spec
            .keys
            .iter()
            .map(|k| self.input_schema.field_with_name(k).cloned())
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let layout = KeyLayout::try_new(&key_fields).map_err(to_df)?;
        let key_columns: Vec<ArrayRef> = self
            .spec
            .keys
            .iter()
            .map(|k| {
                batch
                    .column_by_name(k)
                    .cloned()
                    .ok_or_else(|| DataFusionError::Internal(format!("key column {k} missing")))
            })
            .collect::<Result<_>>()?;
        let mut hashes = Vec::new();
        layout
            .canonicalise(&key_columns)
            .map_err(to_df)?
            .hash_rows(&mut hashes);
        let shift = 60 - 4 * depth;
        let mut rows: Vec<Vec<u32>> = vec![Vec::new(); SPILL_FANOUT];
        for (row, hash) in hashes.iter().enumerate() {
            rows[((hash >> shift) as usize) % SPILL_FANOUT].push(row as u32);
        }
        for ((_, writer), rows) in spill.files.iter_mut().zip(rows) {
            if rows.is_empty() {
                continue;
            }
            let part = take_record_batch(batch, &UInt32Array::from(rows)).map_err(to_df)?;
            writer.write(&part).map_err(to_df)?;
            self.metrics.spilled_rows.add(part.num_rows());
            self.metrics.spilled_bytes.add(part.get_array_memory_size());
        }
        Ok(())
    }

    /// Loads one spill file, or spills it one level further if it still does not fit.
    fn load(&mut self, file: &SpillPath, depth: u32) -> Result<Ingested> {
        // Spill partitions are read back synchronously, one at a time, from local disk.
        let path = file.path().ok_or_else(|| {
            DataFusionError::NotImplemented("DedupExec spills to local disk only".to_owned())
        })?;
        let reader = StreamReader::try_new(std::io::BufReader::new(File::open(path)?), None)
            .map_err(to_df)?;
        let mut grouped = Grouped::default();
        let mut respill: Option<Spill> = None;
        for batch in reader {
            let batch = batch.map_err(to_df)?;
            match respill.as_mut() {
                Some(respill) => self.spill_batch(respill, &batch, depth)?,
                None if self.try_hold(&batch) => grouped.push(batch)?,
                // Past the last level only one enormous key can remain: process it anyway.
                None if depth >= MAX_SPILL_DEPTH => {
                    self.reservation.grow(reservation_for(&batch));
                    self.metrics.note_memory(&self.reservation);
                    grouped.push(batch)?;
                }
                None => {
                    respill = Some(self.start_spill(std::mem::take(&mut grouped), &batch, depth)?)
                }
            }
        }
        Ok(match respill {
            None => Ingested::InMemory(grouped),
            Some(spill) => Ingested::Spilled(spill.finish()?),
        })
    }
}

/// Produces a partition's output one piece of work at a time: the rows held in memory, or
/// one spill file after another, so that only one spill partition is in memory at once.
struct Drain {
    state: PartitionState,
    /// Work left, last first, with the spill depth of files it holds.
    work: Vec<(Ingested, u32)>,
}

impl Iterator for Drain {
    type Item = Result<Vec<RecordBatch>>;

    fn next(&mut self) -> Option<Self::Item> {
        let (work, depth) = self.work.pop()?;
        Some(match work {
            Ingested::InMemory(grouped) => self.state.dedup(grouped),
            Ingested::Spilled(mut files) => {
                let Some(file) = (!files.is_empty()).then(|| files.remove(0)) else {
                    return Some(Ok(Vec::new()));
                };
                if !files.is_empty() {
                    self.work.push((Ingested::Spilled(files), depth));
                }
                match self.state.load(&file, depth) {
                    Ok(loaded) => {
                        self.work.push((loaded, depth + 1));
                        Ok(Vec::new())
                    }
                    Err(e) => Err(e),
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(positions: &[u64]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![Field::new(
            POSITION_COLUMN,
            DataType::UInt64,
            false,
        )]));
        let column: ArrayRef = Arc::new(UInt64Array::from(positions.to_vec()));
        RecordBatch::try_new(schema, vec![column]).expect("batch")
    }

    fn ordered(parts: &[&[u64]]) -> Vec<Vec<u64>> {
        let mut grouped = Grouped::default();
        for positions in parts {
            grouped.push(part(positions)).expect("push");
        }
        grouped
            .into_ordered()
            .expect("order")
            .iter()
            .map(|b| positions(b).expect("positions").values().to_vec())
            .collect()
    }

    #[test]
    fn parts_arriving_out_of_order_are_put_back_whole() {
        let source_1 = 1 << ROW_BITS;
        assert_eq!(
            ordered(&[&[7, 9], &[source_1 + 4, 2], &[source_1 + 1], &[3]]),
            [
                vec![2],
                vec![3],
                vec![7, 9],
                vec![source_1 + 1],
                vec![source_1 + 4]
            ]
        );
    }

    #[test]
    fn interleaved_parts_are_sorted_row_by_row() {
        assert_eq!(ordered(&[&[4, 8], &[2, 6], &[9]]), [vec![2, 4, 6, 8, 9]]);
    }
}
