//! The file scans a dedup can read twice: the late-materialising operator needs one, and
//! the position operator names a scan's partitions by them.

use std::sync::Arc;

use datafusion::datasource::physical_plan::FileScanConfig;
use datafusion::datasource::source::DataSourceExec;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::projection::ProjectionExec;

/// Whether `plan` reads the same rows, in the same partitions and order, every time it
/// runs: a file scan, under nothing but filters and projections.
pub fn is_rescannable_file_scan(plan: &Arc<dyn ExecutionPlan>) -> bool {
    file_scan_below(plan).is_some()
}

/// The file scan that `plan` is, or reads through filters and projections.
pub(crate) fn file_scan_below(plan: &Arc<dyn ExecutionPlan>) -> Option<Arc<dyn ExecutionPlan>> {
    let mut node = Arc::clone(plan);
    loop {
        if node
            .downcast_ref::<DataSourceExec>()
            .is_some_and(|source| source.data_source().is::<FileScanConfig>())
        {
            return Some(node);
        }
        let child = match node.children().as_slice() {
            [child] if node.is::<FilterExec>() || node.is::<ProjectionExec>() => Arc::clone(child),
            _ => return None,
        };
        node = child;
    }
}
