//! # idem-core: the dedup kernels
//!
//! Arrow-only building blocks of idem, with no I/O and no async: given a stream of
//! [`RecordBatch`](arrow::array::RecordBatch)es, keep for every key the row with the maximum
//! version. Every front end — the `idem` CLI, the DataFusion operator — runs these, so the
//! semantics live here once:
//!
//! * **Keys** ([`key`]): one or more columns; nulls equal nulls (SQL `GROUP BY`), and a
//!   value is the same key whether dictionary-encoded or plain, in any string layout.
//! * **Versions** ([`version`]): one or more columns compared lexicographically; integers
//!   (the full `u64` range), dates, timestamps, Decimal128 and PostgreSQL `pg_lsn` text. A
//!   null version loses to any value.
//! * **Ties** ([`TiePolicy`]): first or last in input order wins; [`TieCheck`] counts
//!   *conflicts*, ties whose rows differ outside the key, and can refuse them.
//! * **Deletes** ([`DeletePolicy`]): a winning tombstone removes its key, and a lower
//!   version arriving later cannot bring it back, since it loses like any older row.
//!
//! The flow is two-phase so that callers can read only the key and version columns first
//! and fetch whole rows for the winners only:
//!
//! ```text
//!  batches (key, version, op) ──▶ KeepMaxTable::update ─┐   (per key: winner position,
//!                                                        │    version, tie count)
//!                               KeepMaxTable::finish ◀──┘
//!                                        │
//!            Resolution { keep: positions to emit, tie_rows, stats }
//!                                        │
//!          full rows at tie_rows ──▶ TieCheck::observe ──▶ conflicts
//! ```
//!
//! [`dedup_batches`] runs the whole flow on batches already in memory. [`PickByVersion`]
//! is the same ordering per group, for the `max_by` / `min_by` aggregates.
//!
//! ```
//! use std::sync::Arc;
//!
//! use arrow::array::{Int64Array, RecordBatch, StringArray};
//! use arrow::datatypes::{DataType, Field, Schema};
//! use idem_core::{DedupSpec, DeletePolicy, dedup_batches};
//!
//! let schema = Arc::new(Schema::new(vec![
//!     Field::new("event_id", DataType::Utf8, false),
//!     Field::new("lsn", DataType::Int64, false),
//!     Field::new("op", DataType::Utf8, false),
//! ]));
//! // "a" is replayed, "b" updated then deleted, and an older update of "b" comes late.
//! let batch = RecordBatch::try_new(Arc::clone(&schema), vec![
//!     Arc::new(StringArray::from(vec!["a", "a", "b", "b", "b"])),
//!     Arc::new(Int64Array::from(vec![1, 1, 1, 3, 2])),
//!     Arc::new(StringArray::from(vec!["c", "c", "c", "d", "u"])),
//! ])?;
//! let mut spec = DedupSpec::new(["event_id"], ["lsn"]);
//! spec.options.deletes = Some(DeletePolicy::new("op"));
//! let (rows, stats) = dedup_batches(&schema, &[batch], &spec)?;
//! assert_eq!(rows.iter().map(RecordBatch::num_rows).sum::<usize>(), 1); // "a" alone
//! assert_eq!((stats.duplicates, stats.superseded, stats.deleted), (1, 2, 1));
//! # Ok::<(), arrow::error::ArrowError>(())
//! ```

pub mod interner;
pub mod key;
mod memory;
mod options;
mod pick;
mod prefetch;
pub mod rng;
mod rowhash;
mod stats;
mod table;
mod ties;
pub mod version;
mod widening;

pub use memory::dedup_batches;
pub use options::{DedupOptions, DedupSpec, DeletePolicy, TiePolicy};
pub use pick::{Pick, PickByVersion, as_encoded_versions};
pub use rowhash::{RowHasher, content_type, mix_value_hashes, mix_value_hashes_at};
pub use stats::DedupStats;
pub use table::{KeepMaxTable, PositionBits, PreparedRows, Resolution, RowPreparer, TieRow};
pub use ties::{TieCheck, TieHasher, describe_row};
pub use version::parse_pg_lsn;
