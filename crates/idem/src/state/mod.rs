//! Dedup across runs: `idem dedup --state URL`, the "dedup cache" of a pipeline whose
//! output is an append-only log rather than an upserted table.
//!
//! A run loads what earlier runs emitted, runs the ordinary two-pass dedup, and passes
//! every winning row through the state's [`WinnerFilter`]: a key already emitted at an
//! equal or newer version is dropped (`seen_before`); a newer version of an emitted key is
//! emitted again (downstream applies it as an update or delete); an unseen key is emitted
//! and recorded. The watermark is `max(event time ever seen) − retention − safety
//! buffer`: rows older than it are `late` (their key's entry may already be gone) and
//! handled by `--late`. The state is recorded only after the output is committed, and a
//! batch whose inputs a committed run already applied is not run again.
//!
//! This module holds what every back-end shares — the options, the report, the filter a
//! dedup calls — and `files`, the state as Parquet files and manifests on any store.
//! It may import the reading and writing layers and the store, never a job.

mod files;

pub(crate) use files::{Prepared, StateFilter, prepare};

use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use arrow::array::RecordBatch;
use serde::Serialize;

use crate::error::Result;

/// The last say over a dedup's winners which a state across runs has: the
/// dedup hands every batch of winners to one before they go on.
pub(crate) trait WinnerFilter {
    /// Pass 1 is done (its key table freed) and about `rows` winners will come: the time
    /// to load what the filter needs and make room for them.
    fn expect(&mut self, _rows: u64) -> Result<()> {
        Ok(())
    }
    /// The rows of `batch`, winners read from the file at `path`, that go on.
    fn filter(&mut self, batch: RecordBatch, path: &Path) -> Result<RecordBatch>;
}

/// What a run does with rows older than the watermark, whose key's entry may have expired.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LatePolicy {
    /// Drop them (counted as `late`): no duplicate can slip through, a late original is lost.
    #[default]
    Drop,
    /// Emit them unless their key is still in the state: nothing is lost, a late replay
    /// may be a duplicate.
    Emit,
    /// Fail the run, writing nothing.
    Error,
}

impl FromStr for LatePolicy {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "drop" => Ok(Self::Drop),
            "emit" => Ok(Self::Emit),
            "error" => Ok(Self::Error),
            other => Err(format!(
                "unknown late policy '{other}': expected drop, emit or error"
            )),
        }
    }
}

impl fmt::Display for LatePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Drop => "drop",
            Self::Emit => "emit",
            Self::Error => "error",
        })
    }
}

/// `--state` and its companions.
#[derive(Debug, Clone)]
pub struct StateOptions {
    /// Directory or URL prefix of the state.
    pub location: String,
    /// Event-time column (timestamp or date) that entries expire by.
    pub time_column: String,
    /// How long after the newest event time a key is remembered.
    pub retention: Duration,
    /// Extra time on top of the retention, for producers whose clocks lag.
    pub safety_buffer: Duration,
    /// What to do with rows older than the watermark.
    pub late: LatePolicy,
}

impl StateOptions {
    /// State at `location`, expiring by `time_column` after `retention`; no safety buffer,
    /// late rows dropped.
    pub fn new(
        location: impl Into<String>,
        time_column: impl Into<String>,
        retention: Duration,
    ) -> Self {
        Self {
            location: location.into(),
            time_column: time_column.into(),
            retention,
            safety_buffer: Duration::ZERO,
            late: LatePolicy::Drop,
        }
    }

    pub(crate) fn horizon_us(&self) -> i64 {
        i64::try_from((self.retention + self.safety_buffer).as_micros()).unwrap_or(i64::MAX)
    }
}

/// What the state did in a run; `state` in the stats.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StateReport {
    /// The state's location.
    pub location: String,
    /// Manifest version after the run.
    pub version: u64,
    /// The same inputs were already applied by a committed run: nothing was read or written.
    pub already_applied: bool,
    /// Rows emitted whose key the state did not hold.
    pub new_keys: u64,
    /// Rows emitted because they are a newer version (or delete) of a key emitted before.
    pub updated: u64,
    /// Rows dropped because their key was emitted before at an equal or newer version.
    pub seen_before: u64,
    /// Deletes emitted (of keys emitted before; among `updated`).
    pub deletes_emitted: u64,
    /// Winning deletes of keys not live downstream: recorded, not written (counted as
    /// `deleted` in the run's stats).
    pub deletes_recorded: u64,
    /// Rows older than the watermark whose key the state did not hold.
    pub late: u64,
    /// What happened to them (`drop` or `emit`).
    pub late_policy: String,
    /// Rows whose key had expired from the state and came back (estimated by Bloom filters,
    /// ≈ 0.05 % false positives): the retention or safety buffer is too short.
    pub evicted_then_seen: u64,
    /// Entries expired by this run's watermark.
    pub expired: u64,
    /// Keys in the state after the run.
    pub keys: u64,
    /// Bytes of the state's key files after the run.
    pub bytes: u64,
    /// Bytes of the evicted-key filters after the run.
    pub evicted_filter_bytes: u64,
    /// `bytes / keys`.
    pub bytes_per_key: f64,
    /// Key files written by this run (partitions with changes); the rest were kept.
    pub files_written: usize,
    /// Newest event time seen by any run, as RFC 3339.
    pub max_event_time: Option<String>,
    /// Entries and rows older than this (RFC 3339) are expired and late.
    pub watermark: Option<String>,
}

impl StateReport {
    /// Winners the state held back: `seen_before`, and late rows under `--late drop`. With
    /// the run's counts: `rows_in = rows_out + duplicates + superseded + deleted + dropped()`.
    pub fn dropped(&self) -> u64 {
        self.seen_before
            + if self.late_policy == "drop" {
                self.late
            } else {
                0
            }
    }
}
