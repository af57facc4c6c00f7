//! What a merge target does: the one interface between the merge's semantics and the
//! systems it writes to. A target stores rows, finds the versions of keys it holds,
//! remembers deletes, recognises a batch it has applied, and commits one batch's decisions
//! atomically — or reports that another writer committed first.

use std::path::PathBuf;
use std::time::Duration;

use arrow::array::RecordBatch;

use super::tombstones::Tombstones;
use super::{Batch, MergeJob, MergeReport, Outcome};
use crate::error::Result;

/// How one attempt ended.
pub(crate) enum Attempt {
    /// Committed, or found nothing to commit.
    Done,
    /// Another writer committed since the version read; start again.
    Conflict,
}

/// The target's versions of the batch's keys, from [`Target::find`].
pub(crate) trait FoundVersions {
    /// The encoded version (`width` bytes, compared as bytes) the target holds for winner
    /// `row`'s key, if it holds the key.
    fn version(&self, row: usize, width: usize) -> Option<&[u8]>;
}

/// The decisions of one attempt, for [`Target::commit`].
pub(crate) struct Change<'a, F> {
    /// What the batch does to each winner's key.
    pub outcome: &'a [Outcome],
    /// Where the target holds the batch's keys, as its `find` left it.
    #[cfg_attr(not(feature = "delta"), allow(dead_code))]
    pub found: &'a F,
    /// Whether any row is inserted, replaced or deleted.
    pub data_change: bool,
    /// The tombstone state after the batch, where it changes (or the target is new):
    /// key and version columns and deletion times; no rows for no tombstones.
    pub tombstones: Option<RecordBatch>,
    /// The attempt's time, milliseconds since the epoch.
    pub now: i64,
}

/// A table a merge writes to. Each method sees the [`Batch`] in the types
/// [`Target::to_stored`] gave it, and each attempt reads one [`Target::Snapshot`].
pub(crate) trait Target {
    /// The target as of the version an attempt read.
    type Snapshot;
    /// Where the target holds the batch's keys.
    type Found: FoundVersions;

    /// The target's location for messages (without credentials).
    fn display(&self) -> PathBuf;

    /// The target as the report's `table` names it.
    fn report_name(&self, job: &MergeJob) -> String {
        job.table.clone()
    }

    /// The database holding the table, for targets in one (without credentials).
    fn database(&self) -> Option<String> {
        None
    }

    /// Before any batch row is read: checks the job against an existing target (options
    /// that only apply at creation) and returns the version at which the batch with
    /// `fingerprint` was applied, if it was.
    fn prepare(&mut self, job: &MergeJob, fingerprint: &str) -> Result<Option<u64>>;

    /// The batch's winners in the types the target stores: its columns' types, or the
    /// types it would create them with. Conversions keep order and are injective, so the
    /// winners stay the winners.
    fn to_stored(&self, rows: &RecordBatch) -> Result<RecordBatch>;

    /// Reads the target as of its current version.
    fn snapshot(&self, job: &MergeJob, batch: &Batch) -> Result<Self::Snapshot>;

    /// The snapshot's version; `None` where the target does not exist yet.
    fn version(&self, snapshot: &Self::Snapshot) -> Option<u64>;

    /// The snapshot's data files (or other units of storage) and rows, where known.
    fn size(&self, snapshot: &Self::Snapshot) -> (u64, Option<u64>);

    /// The version at which the batch with `fingerprint` was applied, if the snapshot
    /// records it.
    fn applied_in(&self, snapshot: &Self::Snapshot, fingerprint: &str) -> Result<Option<u64>>;

    /// The tombstones live at `now` (those older than `retention` are expired), in the
    /// batch's stored types.
    fn tombstones(
        &self,
        snapshot: &Self::Snapshot,
        batch: &Batch,
        retention: Duration,
        now: i64,
    ) -> Result<Tombstones>;

    /// The target's versions of the keys of the winners still undecided (`None` in
    /// `decided`); may count what it read or skipped in `report`.
    fn find(
        &self,
        snapshot: &Self::Snapshot,
        batch: &Batch,
        decided: &[Option<Outcome>],
        report: &mut MergeReport,
    ) -> Result<Self::Found>;

    /// Applies `change` and records the batch's fingerprint, in one atomic step against
    /// the snapshot's version; sets `report.table_version` when it commits. Nothing of a
    /// conflicting or failed attempt may stay visible to readers.
    fn commit(
        &self,
        job: &MergeJob,
        snapshot: &Self::Snapshot,
        batch: &Batch,
        change: Change<'_, Self::Found>,
        report: &mut MergeReport,
    ) -> Result<Attempt>;
}
