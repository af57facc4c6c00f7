//! Writing a dedup's output on the executors: [`WriteParts`] (logical) and
//! [`WritePartsExec`] (physical) sit on top of the dedup, in its last stage, so each task
//! writes its key partition's winners straight to the output's staging directory — a shared
//! path or an object-store prefix — and returns one row saying what it wrote. Only those
//! rows travel back to the client, which then commits the parts (temporary name → final).
//!
//! A key partition's files are `part-PPPPP-NNNNN.parquet`; a task that Ballista retries
//! writes the same names again, so a retry replaces its earlier attempt instead of adding
//! to it.
//! Rows go to the Parquet writer in chunks of a fixed size and files roll over at a fixed
//! row count ([`PartsLayout`]), so a part's bytes depend only on its rows.

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use async_trait::async_trait;
use ballista_core::execution_plans::ShuffleReaderExec;
use datafusion::arrow::array::{ArrayRef, AsArray, RecordBatch, UInt32Array, UInt64Array};
use datafusion::arrow::compute::BatchCoalescer;
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef, UInt32Type, UInt64Type};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{DFSchema, DFSchemaRef, DataFusionError, Result, internal_err};
use datafusion::execution::object_store::ObjectStoreUrl;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::physical_planning_context::PhysicalPlanningContext;
use datafusion::logical_expr::{
    Expr, Extension, LogicalPlan, UserDefinedLogicalNode, UserDefinedLogicalNodeCore,
};
use datafusion::object_store::ObjectStore;
use datafusion::object_store::buffered::BufWriter;
use datafusion::object_store::path::Path;
use datafusion::parquet::arrow::AsyncArrowWriter;
use datafusion::parquet::basic::{Compression, Encoding, ZstdLevel};
use datafusion::parquet::file::properties::WriterProperties;
use datafusion::parquet::schema::types::ColumnPath;
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    ChildrenPropertiesMode, DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties,
    Partitioning, PlanProperties, ReplaceChildrenOptions,
};
use datafusion::physical_planner::{ExtensionPlanner, PhysicalPlanner};
use futures::StreamExt;
use serde::{Deserialize, Serialize};

/// Where and how the parts are written. The client fills it in from its own output
/// settings, so the executors write exactly what a local run would.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Serialize, Deserialize)]
pub struct PartsLayout {
    /// The staging directory, as a URL (`file:///…/`, `s3://bucket/prefix/`).
    pub directory: String,
    /// Rows per part file.
    pub max_rows_per_file: usize,
    /// Rows per call into the Parquet writer.
    pub chunk_rows: usize,
    /// Rows per row group.
    pub row_group_rows: usize,
    /// Dictionary page size at which a column falls back to its non-dictionary encoding.
    pub dictionary_page_bytes: usize,
    /// zstd level.
    pub zstd_level: i32,
    /// Columns (path parts) and the encoding (its Parquet name) each falls back to when
    /// its dictionary fills, where that is not `PLAIN`.
    #[serde(default)]
    pub fallback_encodings: Vec<(Vec<String>, String)>,
}

impl PartsLayout {
    fn writer_properties(&self) -> Result<WriterProperties> {
        let level = ZstdLevel::try_new(self.zstd_level)
            .map_err(|e| DataFusionError::Configuration(e.to_string()))?;
        let mut builder = WriterProperties::builder()
            .set_compression(Compression::ZSTD(level))
            .set_max_row_group_row_count(Some(self.row_group_rows.max(1)))
            .set_dictionary_page_size_limit(self.dictionary_page_bytes);
        for (column, encoding) in &self.fallback_encodings {
            let encoding = Encoding::from_str(encoding)
                .map_err(|e| DataFusionError::Configuration(format!("part files: {e}")))?;
            builder = builder.set_column_encoding(ColumnPath::new(column.clone()), encoding);
        }
        Ok(builder.build())
    }
}

/// The name of a partition's `index`-th file.
pub fn part_file_name(partition: u32, index: u32) -> String {
    format!("part-{partition:05}-{index:05}.parquet")
}

/// The dedup counters each task reports, as [`DedupExec`](idem_datafusion::DedupExec)
/// names them.
pub const DEDUP_COUNTERS: [&str; 8] = [
    "rows_in",
    "duplicates",
    "superseded",
    "deleted",
    "conflicts",
    "null_keys",
    "distinct_keys",
    "tombstones_kept",
];

/// The schema of what [`WritePartsExec`] returns: one row per partition.
pub fn parts_schema() -> SchemaRef {
    let mut fields = vec![
        Field::new("partition", DataType::UInt32, false),
        Field::new("files", DataType::UInt32, false),
        Field::new("rows", DataType::UInt64, false),
    ];
    fields.extend(
        DEDUP_COUNTERS
            .iter()
            .map(|name| Field::new(*name, DataType::UInt64, false)),
    );
    Arc::new(Schema::new(fields))
}

/// What one partition's task wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartWritten {
    /// The key partition.
    pub partition: u32,
    /// Its files, `part_file_name(partition, 0..files)`.
    pub files: u32,
    /// Rows written.
    pub rows: u64,
    /// The dedup's counters for the partition, by [`DEDUP_COUNTERS`] name.
    pub counters: BTreeMap<String, u64>,
}

/// Reads [`WritePartsExec`]'s result rows, sorted by partition.
///
/// # Errors
/// Batches of another schema.
pub fn parts_written(batches: &[RecordBatch]) -> Result<Vec<PartWritten>> {
    let mut parts = Vec::new();
    for batch in batches {
        let u32_column = |name: &str| -> Result<&UInt32Array> {
            batch
                .column_by_name(name)
                .and_then(|c| c.as_primitive_opt::<UInt32Type>())
                .ok_or_else(|| DataFusionError::Internal(format!("parts result without {name}")))
        };
        let u64_column = |name: &str| -> Result<&UInt64Array> {
            batch
                .column_by_name(name)
                .and_then(|c| c.as_primitive_opt::<UInt64Type>())
                .ok_or_else(|| DataFusionError::Internal(format!("parts result without {name}")))
        };
        let (partition, files, rows) = (
            u32_column("partition")?,
            u32_column("files")?,
            u64_column("rows")?,
        );
        let counters = DEDUP_COUNTERS
            .iter()
            .map(|name| Ok((*name, u64_column(name)?)))
            .collect::<Result<Vec<_>>>()?;
        for row in 0..batch.num_rows() {
            parts.push(PartWritten {
                partition: partition.value(row),
                files: files.value(row),
                rows: rows.value(row),
                counters: counters
                    .iter()
                    .map(|(name, values)| ((*name).to_owned(), values.value(row)))
                    .collect(),
            });
        }
    }
    parts.sort_by_key(|p| p.partition);
    Ok(parts)
}

/// Writes its input, partition by partition, as Parquet parts ([`PartsLayout`]); its
/// output is one row per partition ([`parts_schema`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WriteParts {
    input: Arc<LogicalPlan>,
    layout: PartsLayout,
    schema: DFSchemaRef,
}

impl WriteParts {
    /// Writes `input` as `layout` says.
    ///
    /// # Errors
    /// Never in practice: the result schema is fixed.
    pub fn try_new(input: LogicalPlan, layout: PartsLayout) -> Result<Self> {
        Ok(Self {
            input: Arc::new(input),
            layout,
            schema: Arc::new(DFSchema::try_from(parts_schema())?),
        })
    }

    /// Where and how.
    pub fn layout(&self) -> &PartsLayout {
        &self.layout
    }

    /// This node as a [`LogicalPlan::Extension`].
    pub fn into_plan(self) -> LogicalPlan {
        LogicalPlan::Extension(Extension {
            node: Arc::new(self),
        })
    }
}

/// Ordered by input, then layout; `Equal` means equal.
impl PartialOrd for WriteParts {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        match self.input.partial_cmp(&other.input) {
            Some(Ordering::Equal) => self.layout.partial_cmp(&other.layout),
            ordering => ordering,
        }
    }
}

impl UserDefinedLogicalNodeCore for WriteParts {
    fn name(&self) -> &str {
        "WriteParts"
    }

    fn inputs(&self) -> Vec<&LogicalPlan> {
        vec![&self.input]
    }

    fn schema(&self) -> &DFSchemaRef {
        &self.schema
    }

    fn expressions(&self) -> Vec<Expr> {
        Vec::new()
    }

    fn fmt_for_explain(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "WriteParts: {}", self.layout.directory)
    }

    fn with_exprs_and_inputs(&self, exprs: Vec<Expr>, inputs: Vec<LogicalPlan>) -> Result<Self> {
        if !exprs.is_empty() {
            return internal_err!("WriteParts has no expressions, got {}", exprs.len());
        }
        let Ok([input]) = <[LogicalPlan; 1]>::try_from(inputs) else {
            return internal_err!("WriteParts has exactly one input");
        };
        Self::try_new(input, self.layout.clone())
    }
}

/// Plans [`WriteParts`] as [`WritePartsExec`].
#[derive(Debug, Default, Clone, Copy)]
pub struct WritePartsPlanner;

#[async_trait]
impl ExtensionPlanner for WritePartsPlanner {
    async fn plan_extension(
        &self,
        _planner: &dyn PhysicalPlanner,
        node: &dyn UserDefinedLogicalNode,
        _logical_inputs: &[&LogicalPlan],
        physical_inputs: &[Arc<dyn ExecutionPlan>],
        _session: &dyn datafusion::catalog::Session,
        _planning_ctx: &PhysicalPlanningContext,
    ) -> Result<Option<Arc<dyn ExecutionPlan>>> {
        let Some(write) = node.as_any().downcast_ref::<WriteParts>() else {
            return Ok(None);
        };
        let [input] = physical_inputs else {
            return internal_err!("WriteParts has exactly one input");
        };
        Ok(Some(Arc::new(WritePartsExec::new(
            Arc::clone(input),
            write.layout.clone(),
        ))))
    }
}

/// The physical side of [`WriteParts`]: each partition of its input becomes that
/// partition's files, and one result row.
#[derive(Debug, Clone)]
pub struct WritePartsExec {
    input: Arc<dyn ExecutionPlan>,
    layout: PartsLayout,
    cache: Arc<PlanProperties>,
}

impl WritePartsExec {
    /// Writes each partition of `input` as `layout` says.
    pub fn new(input: Arc<dyn ExecutionPlan>, layout: PartsLayout) -> Self {
        let cache = Arc::new(PlanProperties::new(
            EquivalenceProperties::new(parts_schema()),
            Partitioning::UnknownPartitioning(input.output_partitioning().partition_count()),
            EmissionType::Final,
            Boundedness::Bounded,
        ));
        Self {
            input,
            layout,
            cache,
        }
    }

    /// Where and how.
    pub fn layout(&self) -> &PartsLayout {
        &self.layout
    }
}

impl DisplayAs for WritePartsExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "WritePartsExec: {}", self.layout.directory)
    }
}

impl ExecutionPlan for WritePartsExec {
    fn name(&self) -> &'static str {
        "WritePartsExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.cache
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![false]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    /// Each partition is one writer's work: repartitioning would mix keys of partitions.
    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        vec![false]
    }

    fn replace_children(
        self: Arc<Self>,
        mut children: Vec<Arc<dyn ExecutionPlan>>,
        _options: ReplaceChildrenOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if children.len() != 1 {
            return internal_err!("WritePartsExec takes one child");
        }
        Ok(Arc::new(Self::new(
            children.swap_remove(0),
            self.layout.clone(),
        )))
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
        let input = self.input.execute(partition, Arc::clone(&context))?;
        let plan = Arc::clone(&self.input);
        let layout = self.layout.clone();
        let key_partition = global_partition(&self.input, partition).unwrap_or(partition);
        let key_partition = u32::try_from(key_partition)
            .map_err(|_| DataFusionError::Internal(format!("partition {key_partition}")))?;
        let result = async move {
            let (files, rows) = write_partition(input, &layout, key_partition, &context).await?;
            // Metrics are kept per partition: a plan shared by several tasks still gives
            // this task's figures.
            let (mut counters, _) = idem_datafusion::dedup_counters(&plan, Some(partition));
            counters.retain(|name, _| DEDUP_COUNTERS.contains(&name.as_str()));
            let mut columns: Vec<ArrayRef> = vec![
                Arc::new(UInt32Array::from(vec![key_partition])),
                Arc::new(UInt32Array::from(vec![files])),
                Arc::new(UInt64Array::from(vec![rows])),
            ];
            columns.extend(DEDUP_COUNTERS.iter().map(|name| {
                Arc::new(UInt64Array::from(vec![
                    counters.get(*name).copied().unwrap_or(0),
                ])) as ArrayRef
            }));
            Ok(RecordBatch::try_new(parts_schema(), columns)?)
        };
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            parts_schema(),
            futures::stream::once(result),
        )))
    }
}

/// The key partition (of the whole job) that the task's partition `local` reads. Ballista
/// hands each task a plan restricted to its slice of the partitions, numbered from 0 again,
/// so the shuffle reader below is what still knows which key partition it holds (the
/// smallest one, should it read several). `None` outside a cluster, where the local number
/// is the partition.
fn global_partition(plan: &Arc<dyn ExecutionPlan>, local: usize) -> Option<usize> {
    let mut pending = vec![Arc::clone(plan)];
    while let Some(node) = pending.pop() {
        if let Some(reader) = node.downcast_ref::<ShuffleReaderExec>() {
            return reader
                .partition
                .get(local)?
                .iter()
                .map(|location| location.partition_id.partition_id)
                .min();
        }
        pending.extend(node.children().into_iter().cloned());
    }
    None
}

/// The store and the directory a layout's URL names, from the task's runtime.
fn staging_directory(
    layout: &PartsLayout,
    context: &TaskContext,
) -> Result<(Arc<dyn ObjectStore>, Path)> {
    let url = url::Url::parse(&layout.directory).map_err(|e| {
        DataFusionError::Configuration(format!("output URL '{}': {e}", layout.directory))
    })?;
    let store_url = ObjectStoreUrl::parse(&url[..url::Position::BeforePath])?;
    let store = context.runtime_env().object_store(&store_url)?;
    let directory =
        Path::from_url_path(url.path()).map_err(|e| DataFusionError::External(Box::new(e)))?;
    Ok((store, directory))
}

/// One partition's rows as its part files; returns (files, rows).
async fn write_partition(
    mut input: SendableRecordBatchStream,
    layout: &PartsLayout,
    partition: u32,
    context: &TaskContext,
) -> Result<(u32, u64)> {
    let (store, directory) = staging_directory(layout, context)?;
    let properties = layout.writer_properties()?;
    let schema = input.schema();
    let max_rows = layout.max_rows_per_file.max(1);
    let mut chunks = BatchCoalescer::new(Arc::clone(&schema), layout.chunk_rows.max(1));
    let mut writer: Option<AsyncArrowWriter<BufWriter>> = None;
    let (mut files, mut rows, mut rows_in_part) = (0u32, 0u64, 0usize);
    let mut finished = false;
    while !finished {
        match input.next().await {
            Some(batch) => chunks.push_batch(batch?)?,
            None => {
                chunks.finish_buffered_batch()?;
                finished = true;
            }
        }
        while let Some(chunk) = chunks.next_completed_batch() {
            let mut offset = 0;
            while offset < chunk.num_rows() {
                if writer.is_none() || rows_in_part >= max_rows {
                    if let Some(full) = writer.take() {
                        full.close().await?;
                    }
                    let path = directory.clone().join(part_file_name(partition, files));
                    writer = Some(AsyncArrowWriter::try_new(
                        BufWriter::new(Arc::clone(&store), path),
                        Arc::clone(&schema),
                        Some(properties.clone()),
                    )?);
                    files += 1;
                    rows_in_part = 0;
                }
                let take = (max_rows - rows_in_part).min(chunk.num_rows() - offset);
                if let Some(open) = writer.as_mut() {
                    open.write(&chunk.slice(offset, take)).await?;
                }
                rows_in_part += take;
                rows += take as u64;
                offset += take;
            }
        }
    }
    if let Some(last) = writer.take() {
        last.close().await?;
    }
    Ok((files, rows))
}
