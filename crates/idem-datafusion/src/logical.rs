//! The logical side: [`Dedup`], a user-defined logical plan node, and the planners that
//! turn it into [`DedupExec`](crate::DedupExec).
//!
//! Keeping the dedup visible in the logical plan lets DataFusion's own optimizer rules work
//! around it: projection push-down reads only the columns the query uses plus the key,
//! version and op columns; filter push-down moves predicates on key columns below it and
//! keeps every other predicate above (filtering a payload column first could let an older
//! version win).

use std::any::Any;
use std::cmp::Ordering;
use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::catalog::Session;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{DFSchemaRef, DataFusionError, Result, internal_err};
use datafusion::execution::SessionState;
use datafusion::execution::context::QueryPlanner;
use datafusion::execution::session_state::SessionStateBuilder;
use datafusion::logical_expr::physical_planning_context::PhysicalPlanningContext;
use datafusion::logical_expr::{
    Expr, Extension, LogicalPlan, UserDefinedLogicalNode, UserDefinedLogicalNodeCore,
};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_planner::{DefaultPhysicalPlanner, ExtensionPlanner, PhysicalPlanner};
use idem_core::DedupSpec;

use crate::exec::plan_shuffled_dedup;
use crate::late::plan_dedup;

/// One row per key of `input`: the row with the maximum version, with idem's semantics.
/// Its output schema is its input's.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Dedup {
    input: Arc<LogicalPlan>,
    spec: DedupSpec,
}

impl Dedup {
    /// Deduplicates `input` as `spec` says.
    ///
    /// # Errors
    /// A key, version or op column missing from `input`, or of a type idem cannot use.
    pub fn try_new(input: LogicalPlan, spec: DedupSpec) -> Result<Self> {
        idem_core::KeepMaxTable::try_new(input.schema().as_arrow(), &spec)
            .map_err(|e| DataFusionError::Plan(e.to_string()))?;
        Ok(Self {
            input: Arc::new(input),
            spec,
        })
    }

    /// The key, version and policies.
    pub fn spec(&self) -> &DedupSpec {
        &self.spec
    }

    /// This node as a [`LogicalPlan::Extension`].
    pub fn into_plan(self) -> LogicalPlan {
        LogicalPlan::Extension(Extension {
            node: Arc::new(self),
        })
    }
}

/// Plans are ordered by their input only; two nodes over the same input with different
/// specs are unordered, so `Equal` means equal.
impl PartialOrd for Dedup {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        match self.input.partial_cmp(&other.input) {
            Some(Ordering::Equal) => (self.spec == other.spec).then_some(Ordering::Equal),
            ordering => ordering,
        }
    }
}

impl UserDefinedLogicalNodeCore for Dedup {
    fn name(&self) -> &str {
        "Dedup"
    }

    fn inputs(&self) -> Vec<&LogicalPlan> {
        vec![&self.input]
    }

    fn schema(&self) -> &DFSchemaRef {
        self.input.schema()
    }

    fn expressions(&self) -> Vec<Expr> {
        Vec::new()
    }

    /// A predicate on key columns keeps or drops whole keys, so it gives the same rows
    /// above or below the dedup; any other column may differ between versions of a key.
    fn prevent_predicate_push_down_columns(&self) -> HashSet<String> {
        self.input
            .schema()
            .fields()
            .iter()
            .map(|f| f.name())
            .filter(|name| !self.spec.keys.contains(name))
            .cloned()
            .collect()
    }

    fn fmt_for_explain(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "Dedup: {}", self.spec)
    }

    fn with_exprs_and_inputs(&self, exprs: Vec<Expr>, inputs: Vec<LogicalPlan>) -> Result<Self> {
        if !exprs.is_empty() {
            return internal_err!("Dedup has no expressions, got {}", exprs.len());
        }
        let Ok([input]) = <[LogicalPlan; 1]>::try_from(inputs) else {
            return internal_err!("Dedup has exactly one input");
        };
        Self::try_new(input, self.spec.clone())
    }

    fn necessary_children_exprs(&self, output_columns: &[usize]) -> Option<Vec<Vec<usize>>> {
        let schema = self.input.schema();
        let mut needed = output_columns.to_vec();
        for name in self.spec.decision_columns() {
            needed.push(schema.index_of_column_by_name(None, name)?);
        }
        needed.sort_unstable();
        needed.dedup();
        Some(vec![needed])
    }
}

/// Plans [`Dedup`] nodes with [`plan_dedup`]: [`LateDedupExec`](crate::LateDedupExec) over
/// file scans, [`DedupExec`](crate::DedupExec) over anything else.
#[derive(Debug, Default, Clone, Copy)]
pub struct DedupPlanner {
    shuffled: bool,
}

impl DedupPlanner {
    /// A planner that plans every dedup as a hash shuffle on the key followed by
    /// [`DedupExec`](crate::DedupExec), never [`LateDedupExec`](crate::LateDedupExec):
    /// the plan a cluster (Ballista) splits into a map stage and a reduce stage whose
    /// tasks each read their share once, where a late dedup would make every task
    /// rescan the whole source.
    pub fn shuffled() -> Self {
        Self { shuffled: true }
    }
}

#[async_trait]
impl ExtensionPlanner for DedupPlanner {
    async fn plan_extension(
        &self,
        _planner: &dyn PhysicalPlanner,
        node: &dyn UserDefinedLogicalNode,
        _logical_inputs: &[&LogicalPlan],
        physical_inputs: &[Arc<dyn ExecutionPlan>],
        session: &dyn Session,
        _planning_ctx: &PhysicalPlanningContext,
    ) -> Result<Option<Arc<dyn ExecutionPlan>>> {
        let Some(dedup) = node.as_any().downcast_ref::<Dedup>() else {
            return Ok(None);
        };
        let [input] = physical_inputs else {
            return internal_err!("Dedup has exactly one input");
        };
        if self.shuffled {
            return plan_shuffled_dedup(
                Arc::clone(input),
                dedup.spec.clone(),
                session.config_options(),
            )
            .map(Some);
        }
        plan_dedup(
            Arc::clone(input),
            dedup.spec.clone(),
            session.config_options(),
        )
        .map(Some)
    }
}

/// A [`QueryPlanner`] that plans [`Dedup`] nodes and hands every other query to the
/// planner the session had before, so a custom planner keeps working for its queries.
pub struct DedupQueryPlanner {
    fallback: Arc<dyn QueryPlanner + Send + Sync>,
    planner: DedupPlanner,
    /// Planners of other extension nodes that only appear above a dedup (e.g. a cluster's
    /// part writer).
    others: Vec<Arc<dyn ExtensionPlanner + Send + Sync>>,
}

impl std::fmt::Debug for DedupQueryPlanner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DedupQueryPlanner")
            .field("fallback", &self.fallback)
            .field("planner", &self.planner)
            .field("other_planners", &self.others.len())
            .finish()
    }
}

impl DedupQueryPlanner {
    /// Plans dedups, and everything else with `fallback`.
    pub fn new(fallback: Arc<dyn QueryPlanner + Send + Sync>) -> Self {
        Self::with_planner(fallback, DedupPlanner::default())
    }

    /// Plans dedups with `planner` (e.g. [`DedupPlanner::shuffled`]), everything else with
    /// `fallback`.
    pub fn with_planner(
        fallback: Arc<dyn QueryPlanner + Send + Sync>,
        planner: DedupPlanner,
    ) -> Self {
        Self {
            fallback,
            planner,
            others: Vec::new(),
        }
    }

    /// Also plans the extension nodes `planner` knows, in plans that hold a dedup.
    pub fn with_extension_planner(
        mut self,
        planner: Arc<dyn ExtensionPlanner + Send + Sync>,
    ) -> Self {
        self.others.push(planner);
        self
    }
}

fn contains_dedup(plan: &LogicalPlan) -> Result<bool> {
    let mut found = false;
    plan.apply_with_subqueries(|node| {
        found = matches!(node, LogicalPlan::Extension(e) if e.node.as_any().is::<Dedup>());
        Ok(if found {
            TreeNodeRecursion::Stop
        } else {
            TreeNodeRecursion::Continue
        })
    })?;
    Ok(found)
}

#[async_trait]
impl QueryPlanner for DedupQueryPlanner {
    async fn create_physical_plan(
        &self,
        logical_plan: &LogicalPlan,
        session: &dyn Session,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if !contains_dedup(logical_plan)? {
            return self
                .fallback
                .create_physical_plan(logical_plan, session)
                .await;
        }
        let mut planners: Vec<Arc<dyn ExtensionPlanner + Send + Sync>> =
            vec![Arc::new(self.planner)];
        planners.extend(self.others.iter().cloned());
        DefaultPhysicalPlanner::with_extension_planners(planners)
            .create_physical_plan(logical_plan, session)
            .await
    }
}

/// `state` with a query planner that can plan [`Dedup`] nodes (unchanged if it has one).
pub fn with_dedup_planner(state: SessionState) -> SessionState {
    install_planner(state, DedupPlanner::default())
}

/// `state` with a query planner that plans [`Dedup`] nodes as hash shuffles
/// ([`DedupPlanner::shuffled`]): for the session of a cluster's scheduler.
pub fn with_shuffled_dedup_planner(state: SessionState) -> SessionState {
    install_planner(state, DedupPlanner::shuffled())
}

fn install_planner(state: SessionState, dedup_planner: DedupPlanner) -> SessionState {
    let planner: &dyn Any = state.query_planner().as_ref();
    if planner.is::<DedupQueryPlanner>() {
        return state;
    }
    let fallback = Arc::clone(state.query_planner());
    let session_id = state.session_id().to_owned();
    SessionStateBuilder::new_from_existing(state)
        .with_session_id(session_id)
        .with_query_planner(Arc::new(DedupQueryPlanner::with_planner(
            fallback,
            dedup_planner,
        )))
        .build()
}
