//! # idem-datafusion: idem inside Apache DataFusion
//!
//! Deduplication by key and version as a first-class part of a DataFusion query, with the
//! semantics of `idem dedup` (the kernels are `idem-core`'s, shared):
//!
//! * [`LateDedupExec`]: the physical operator over file scans. It reads the key and
//!   version columns first, then only the winning rows of every column, so its memory
//!   follows the number of keys, not the size of the rows; when the pool refuses its key
//!   table it decides one key partition at a time.
//! * [`DedupExec`]: the physical operator over any other input. Its input is
//!   hash-partitioned on the key, so partitions dedup independently on every core; it
//!   registers with the memory pool and spills hash-partitioned files through the disk
//!   manager when the pool says no.
//! * [`Dedup`]: the logical plan node, planned by [`DedupPlanner`]; DataFusion's optimizer
//!   pushes projections through it, and filters on key columns below it.
//! * [`DedupTable`]: any table, deduplicated (a view whose plan is a [`Dedup`] node).
//! * [`DataFrameDedupExt::dedup`]: `df.dedup(["event_id", "sequence"], ["lsn"], options)`.
//! * [`DedupTableFunc`]: the SQL table function `dedup(source, keys, versions [, options])`.
//! * [`max_by_udaf`] / [`min_by_udaf`]: `max_by(value, version)` and `min_by`, vectorised
//!   aggregates for "latest value per group" without a dedup.
//!
//! [`register`] installs all of it in a [`SessionContext`].
//!
//! ```
//! # #[tokio::main(flavor = "multi_thread")]
//! # async fn main() -> datafusion::error::Result<()> {
//! use datafusion::prelude::*;
//! use idem_datafusion::{DataFrameDedupExt, DedupOptions};
//!
//! let ctx = SessionContext::new();
//! idem_datafusion::register(&ctx);
//! ctx.sql("CREATE TABLE events (event_id TEXT, sequence BIGINT, lsn BIGINT, status TEXT) AS VALUES
//!          ('a', 0, 1, 'new'), ('a', 0, 2, 'paid'), ('b', 0, 1, 'new'), ('a', 0, 2, 'paid')")
//!     .await?;
//!
//! // SQL: the table function.
//! let paid = ctx
//!     .sql("SELECT event_id, status FROM dedup('events', 'event_id,sequence', 'lsn') WHERE status = 'paid'")
//!     .await?
//!     .collect()
//!     .await?;
//! assert_eq!(paid.iter().map(|b| b.num_rows()).sum::<usize>(), 1);
//!
//! // DataFrame API.
//! let latest = ctx
//!     .table("events")
//!     .await?
//!     .dedup(["event_id", "sequence"], ["lsn"], DedupOptions::default())?
//!     .count()
//!     .await?;
//! assert_eq!(latest, 2);
//!
//! // The latest value per group, as an aggregate.
//! let statuses = ctx
//!     .sql("SELECT event_id, max_by(status, lsn) AS status FROM events GROUP BY event_id")
//!     .await?
//!     .collect()
//!     .await?;
//! assert_eq!(statuses.iter().map(|b| b.num_rows()).sum::<usize>(), 2);
//! # Ok(())
//! # }
//! ```

mod counters;
mod exec;
mod late;
mod logical;
mod provider;
mod scan;
mod table_function;
mod udaf;

use std::sync::Arc;

use datafusion::prelude::SessionContext;

pub use counters::dedup_counters;
pub use exec::{DedupExec, POSITION_COLUMN, PositionExec, plan_shuffled_dedup};
pub use idem_core::{DedupOptions, DedupSpec, DeletePolicy, TiePolicy};
pub use late::{LateDedupExec, plan_dedup};
pub use logical::{
    Dedup, DedupPlanner, DedupQueryPlanner, with_dedup_planner, with_shuffled_dedup_planner,
};
pub use provider::{DataFrameDedupExt, DedupTable};
pub use scan::is_rescannable_file_scan;
pub use table_function::{DedupTableFunc, parse_options, resolve_source};
pub use udaf::{PickBy, max_by_udaf, min_by_udaf};

/// Registers idem in `ctx`: the query planner that plans [`Dedup`] nodes (other queries
/// still go to the planner `ctx` had), the `dedup` table function and the `max_by` /
/// `min_by` aggregates.
///
/// A program that builds its own `SessionState` can instead add [`DedupPlanner`] to its
/// extension planners, or pass the state through [`with_dedup_planner`].
pub fn register(ctx: &SessionContext) {
    {
        let state = ctx.state_ref();
        let mut state = state.write();
        *state = with_dedup_planner(state.clone());
    }
    ctx.register_udtf("dedup", Arc::new(DedupTableFunc));
    ctx.register_udaf(max_by_udaf());
    ctx.register_udaf(min_by_udaf());
}
