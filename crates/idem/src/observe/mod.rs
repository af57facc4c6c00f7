//! Observing finished runs: Prometheus metrics of every command (`--metrics`) and the HTML
//! report of a dedup (`--report`). It reads the jobs' reports; no job imports it.

pub mod metrics;
pub(crate) mod report;

pub use report::{ReportOptions, check_report, write_report};
