//! [`DedupTable`]: any table (or DataFrame), deduplicated — the provider behind the `dedup`
//! table function and [`DataFrameDedupExt::dedup`].

use std::borrow::Cow;
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::catalog::{Session, TableProvider};
use datafusion::common::{DFSchema, Result};
use datafusion::dataframe::DataFrame;
use datafusion::datasource::{TableType, provider_as_source};
use datafusion::logical_expr::utils::conjunction;
use datafusion::logical_expr::{
    Expr, LogicalPlan, LogicalPlanBuilder, TableProviderFilterPushDown,
};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::projection::ProjectionExec;
use idem_core::{DedupOptions, DedupSpec};

use crate::late::plan_dedup;
use crate::logical::{Dedup, with_dedup_planner};

/// A table whose rows are `source`'s, one per key (see [`DedupSpec`]).
///
/// Filters that only read key columns are pushed below the dedup (they keep or drop whole
/// keys, so the result is the same); filters on any other column stay above it, since
/// filtering before the dedup could let an older version win.
#[derive(Debug)]
pub struct DedupTable {
    source: Arc<dyn TableProvider>,
    spec: DedupSpec,
    /// `Dedup` over a scan of `source`: SQL inlines it, so the plan shows the node.
    plan: LogicalPlan,
}

impl DedupTable {
    /// Deduplicates `source` as `spec` says.
    ///
    /// # Errors
    /// A key, version or op column missing from the source, or of an unusable type.
    pub fn try_new(source: Arc<dyn TableProvider>, spec: DedupSpec) -> Result<Self> {
        let scan =
            LogicalPlanBuilder::scan("source", provider_as_source(Arc::clone(&source)), None)?
                .build()?;
        let plan = Dedup::try_new(scan, spec.clone())?.into_plan();
        Ok(Self { source, spec, plan })
    }

    /// Whether `expr` reads only key columns.
    fn on_keys_only(&self, expr: &Expr) -> bool {
        expr.column_refs()
            .iter()
            .all(|c| self.spec.keys.contains(&c.name))
    }
}

#[async_trait]
impl TableProvider for DedupTable {
    fn schema(&self) -> SchemaRef {
        self.source.schema()
    }

    fn table_type(&self) -> TableType {
        TableType::View
    }

    fn get_logical_plan(&self) -> Option<Cow<'_, LogicalPlan>> {
        Some(Cow::Borrowed(&self.plan))
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> Result<Vec<TableProviderFilterPushDown>> {
        Ok(filters
            .iter()
            .map(|f| {
                if self.on_keys_only(f) {
                    TableProviderFilterPushDown::Exact
                } else {
                    TableProviderFilterPushDown::Unsupported
                }
            })
            .collect())
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        _limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let schema = self.source.schema();
        // Read the projected columns plus those the dedup needs, in source order.
        let mut read: Vec<usize> = match projection {
            Some(p) => p.clone(),
            None => (0..schema.fields().len()).collect(),
        };
        for name in self.spec.decision_columns() {
            let index = schema.index_of(name)?;
            if !read.contains(&index) {
                read.push(index);
            }
        }
        for filter in filters {
            for column in filter.column_refs() {
                let index = schema.index_of(&column.name)?;
                if !read.contains(&index) {
                    read.push(index);
                }
            }
        }
        read.sort_unstable();
        let mut input = self.source.scan(state, Some(&read), filters, None).await?;
        // The source may treat pushed filters as hints: apply them exactly here.
        if let Some(predicate) = conjunction(filters.iter().cloned()) {
            let df_schema = DFSchema::try_from(input.schema().as_ref().clone())?;
            let predicate = state.create_physical_expr(predicate, &df_schema)?;
            input = Arc::new(FilterExec::try_new(predicate, input)?);
        }
        let dedup = plan_dedup(input, self.spec.clone(), state.config_options())?;
        // Back to exactly the requested columns, in the requested order.
        let wanted: Vec<usize> = match projection {
            Some(p) => p.clone(),
            None => (0..schema.fields().len()).collect(),
        };
        let dedup_schema = dedup.schema();
        let exprs = wanted
            .iter()
            .map(|&i| {
                let name = schema.field(i).name();
                Ok((
                    Arc::new(Column::new_with_schema(name, &dedup_schema)?)
                        as Arc<dyn PhysicalExpr>,
                    name.clone(),
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(ProjectionExec::try_new(exprs, dedup)?))
    }
}

/// `df.dedup(keys, versions, options)` on a DataFusion [`DataFrame`].
pub trait DataFrameDedupExt {
    /// One row per key: the one with the maximum version, as `idem dedup` keeps it.
    ///
    /// # Errors
    /// A key, version or op column missing from the DataFrame, or of an unusable type.
    fn dedup<K, V>(self, keys: K, versions: V, options: DedupOptions) -> Result<DataFrame>
    where
        K: IntoIterator,
        K::Item: Into<String>,
        V: IntoIterator,
        V::Item: Into<String>;
}

impl DataFrameDedupExt for DataFrame {
    fn dedup<K, V>(self, keys: K, versions: V, options: DedupOptions) -> Result<DataFrame>
    where
        K: IntoIterator,
        K::Item: Into<String>,
        V: IntoIterator,
        V::Item: Into<String>,
    {
        let (state, plan) = self.into_parts();
        let spec = DedupSpec::new(keys, versions).with_options(options);
        let node = Dedup::try_new(plan, spec)?;
        Ok(DataFrame::new(with_dedup_planner(state), node.into_plan()))
    }
}
