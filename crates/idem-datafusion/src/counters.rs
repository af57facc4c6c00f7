//! Reading a dedup's counts back from an executed plan's metrics.

use std::collections::BTreeMap;
use std::sync::Arc;

use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::metrics::MetricValue;

/// The counters that idem's dedup operators ([`crate::DedupExec`], [`crate::LateDedupExec`])
/// under `plan` reported, summed by name (`output_rows` as `rows_out`), over all their
/// partitions or only `partition`; and how many such operators the plan holds.
pub fn dedup_counters(
    plan: &Arc<dyn ExecutionPlan>,
    partition: Option<usize>,
) -> (BTreeMap<String, u64>, usize) {
    let mut counters = BTreeMap::new();
    let mut operators = 0;
    let mut pending = vec![Arc::clone(plan)];
    while let Some(node) = pending.pop() {
        if matches!(node.name(), "DedupExec" | "LateDedupExec") {
            operators += 1;
            for metric in node.metrics().unwrap_or_default().iter() {
                let value = metric.value();
                let counted = matches!(
                    value,
                    MetricValue::Count { .. } | MetricValue::OutputRows(_)
                );
                if counted && partition.is_none_or(|p| metric.partition() == Some(p)) {
                    let name = match value.name() {
                        "output_rows" => "rows_out",
                        other => other,
                    };
                    *counters.entry(name.to_owned()).or_insert(0) += value.as_usize() as u64;
                }
            }
        }
        pending.extend(node.children().into_iter().cloned());
    }
    (counters, operators)
}
