//! Counters of a dedup run.

/// What a dedup did with its input rows.
///
/// Invariant: `rows_in == rows_out + duplicates + superseded + deleted`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct DedupStats {
    /// Rows read.
    pub rows_in: u64,
    /// Rows written: one per distinct key, less the keys removed by a winning tombstone.
    pub rows_out: u64,
    /// Rows dropped because another row with the same key and the same (maximum) version was kept.
    pub duplicates: u64,
    /// Rows dropped because their key has a higher version.
    pub superseded: u64,
    /// Keys removed because their winning row is a tombstone (0 with `keep_tombstones`).
    pub deleted: u64,
    /// Keys whose tied rows at the maximum version differ in some non-key column.
    pub conflicts: u64,
    /// Rows with a null in any key column (they are deduplicated like any other key).
    pub null_keys: u64,
    /// Distinct keys seen.
    pub distinct_keys: u64,
    /// Winning tombstones written out because tombstones are kept.
    pub tombstones_kept: u64,
}

impl DedupStats {
    /// `(duplicates + superseded) / rows_in`, 0 for an empty input.
    pub fn duplicate_rate(&self) -> f64 {
        if self.rows_in == 0 {
            0.0
        } else {
            (self.duplicates + self.superseded) as f64 / self.rows_in as f64
        }
    }

    /// Whether the counters add up; every code path that builds stats is tested against this.
    pub fn is_consistent(&self) -> bool {
        self.rows_in == self.rows_out + self.duplicates + self.superseded + self.deleted
    }
}

/// Adds the counts of a disjoint part of the input (another key partition).
impl std::ops::AddAssign for DedupStats {
    fn add_assign(&mut self, other: Self) {
        self.rows_in += other.rows_in;
        self.rows_out += other.rows_out;
        self.duplicates += other.duplicates;
        self.superseded += other.superseded;
        self.deleted += other.deleted;
        self.conflicts += other.conflicts;
        self.null_keys += other.null_keys;
        self.distinct_keys += other.distinct_keys;
        self.tombstones_kept += other.tombstones_kept;
    }
}
