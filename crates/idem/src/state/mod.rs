//! Dedup across runs: `idem dedup --state URL`, the "dedup cache" of a pipeline whose
//! output is an append-only log rather than an upserted table.
//!
//! A run loads what earlier runs emitted, runs the ordinary two-pass dedup, and passes
//! every winning row through the state's [`WinnerFilter`]: a key already emitted at an
//! equal or newer version is dropped (`seen_before`); a newer version of an emitted key is
//! emitted again (downstream applies it as an update or delete); an unseen key is emitted
//! and recorded. The watermark is `max(event time ever seen) − retention − safety
//! buffer`: rows older than it are `late` (their key's entry may already be gone) and
//! handled by `--late`. A batch whose inputs a committed run already applied is not run
//! again.
//!
//! This module holds what every back-end shares — the options, the report, the batch's
//! facts, and the one decision ([`judge`]) each winner gets — and the back-ends, which
//! differ only in where the entries live and how a run commits: `files`, Parquet files and
//! manifests on any store, and `redis`, one Redis entry per key with an expiry, shared by
//! concurrent jobs. It may import the reading and writing layers and the store, never a job.

mod files;
#[cfg(feature = "redis")]
mod redis;

use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use arrow::array::{Array, ArrayRef, AsArray, Int64Array, RecordBatch};
use arrow::datatypes::{Field, Schema, TimeUnit, TimestampMicrosecondType};
use idem_core::DedupSpec;
use idem_core::key::{KeyClass, KeyLayout, KeyRows};
use idem_core::version::VersionLayout;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::read::event_time::{check_time_column, event_times};
use crate::read::expand::expand_inputs;
use crate::read::input::{InputFile, fingerprint};
use crate::storage::StorageOptions;

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

/// Whether `location` names a Redis server rather than a directory.
pub(crate) fn is_redis_url(location: &str) -> bool {
    let lower = location.get(..9).unwrap_or(location).to_ascii_lowercase();
    lower.starts_with("redis://") || lower.starts_with("rediss://")
}

/// Checks what a state run needs before any row is read: the batch's fingerprint (an
/// applied batch stops here), the state's compatibility with the batch's key and version,
/// the newest event time of the batch.
///
/// # Errors
/// A state of another key or version, a time column missing or not temporal (naming the
/// file), an unreadable state or an unreachable server.
pub(crate) fn prepare(
    inputs: &[String],
    storage: &StorageOptions,
    spec: &DedupSpec,
    options: &StateOptions,
) -> Result<Prepared> {
    let batch = BatchFacts::open(inputs, storage, spec)?;
    if is_redis_url(&options.location) {
        #[cfg(feature = "redis")]
        return redis::prepare(batch, spec, options);
        #[cfg(not(feature = "redis"))]
        return Err(Error::InvalidArgument(format!(
            "{}: this idem was built without Redis states (cargo feature `redis`)",
            crate::pg::redact_location(&options.location)
        )));
    }
    files::prepare(batch, storage, spec, options)
}

/// What [`prepare`] found.
pub(crate) enum Prepared {
    /// The inputs were applied by a committed run.
    AlreadyApplied(Box<StateReport>),
    /// Ready to filter the run's winners.
    Ready(StateFilter),
}

/// A state during a run: decides which winners leave it.
pub(crate) enum StateFilter {
    /// Parquet files and manifests.
    Files(Box<files::FileState>),
    /// A Redis server.
    #[cfg(feature = "redis")]
    Redis(Box<redis::RedisState>),
}

impl WinnerFilter for StateFilter {
    fn expect(&mut self, rows: u64) -> Result<()> {
        match self {
            Self::Files(state) => state.expect(rows),
            #[cfg(feature = "redis")]
            Self::Redis(state) => state.expect(rows),
        }
    }

    fn filter(&mut self, batch: RecordBatch, path: &Path) -> Result<RecordBatch> {
        match self {
            Self::Files(state) => state.filter(batch, path),
            #[cfg(feature = "redis")]
            Self::Redis(state) => state.filter(batch, path),
        }
    }
}

impl StateFilter {
    /// Prepares the commit, once every winner is decided (the output is not committed yet).
    ///
    /// # Errors
    /// A state file that cannot be written.
    pub(crate) fn stage(self) -> Result<StagedState> {
        match self {
            Self::Files(state) => state.stage().map(|s| StagedState::Files(Box::new(s))),
            #[cfg(feature = "redis")]
            Self::Redis(state) => Ok(StagedState::Redis(state.stage())),
        }
    }

    /// The run failed: takes back what it recorded before its output was committed (a
    /// state that records only at its commit has nothing to take back).
    pub(crate) fn abandon(self) {
        match self {
            Self::Files(_) => {}
            #[cfg(feature = "redis")]
            Self::Redis(state) => state.abandon(),
        }
    }
}

/// A state ready to commit after the output.
pub(crate) enum StagedState {
    /// Parquet files written, the manifest not yet.
    Files(Box<files::StagedFiles>),
    /// Entries written, the run not yet marked applied.
    #[cfg(feature = "redis")]
    Redis(redis::StagedRedis),
}

impl StagedState {
    /// Commits the state after the output at `output`.
    ///
    /// # Errors
    /// A concurrent run committed first (file state), or the store fails.
    pub(crate) fn commit(self, output: &str) -> Result<StateReport> {
        match self {
            Self::Files(state) => state.commit(output),
            #[cfg(feature = "redis")]
            Self::Redis(state) => state.commit(output),
        }
    }

    /// The output's commit failed: as [`StateFilter::abandon`].
    pub(crate) fn abandon(self) {
        match self {
            Self::Files(_) => {}
            #[cfg(feature = "redis")]
            Self::Redis(state) => state.abandon(),
        }
    }
}

/// The batch a state run is about: its files, fingerprint and key and version layouts.
pub(super) struct BatchFacts {
    files: Vec<InputFile>,
    fingerprint: String,
    layouts: Layouts,
}

impl BatchFacts {
    fn open(inputs: &[String], storage: &StorageOptions, spec: &DedupSpec) -> Result<Self> {
        let files: Vec<InputFile> = expand_inputs(inputs, storage)?
            .iter()
            .map(InputFile::open)
            .collect::<Result<_>>()?;
        let schema = crate::read::schema::unify(files.iter().map(|f| (f.path(), f.schema())))?;
        let fingerprint = fingerprint(&files, spec)?;
        let layouts = Layouts::try_new(&schema, spec, files.first().map(InputFile::path))?;
        Ok(Self {
            files,
            fingerprint,
            layouts,
        })
    }

    /// The run's newest event time and watermark (µs), given the committed runs' newest
    /// event time: the newest of both, and that less the horizon.
    ///
    /// # Errors
    /// The time column is missing or not temporal.
    fn clock(
        &self,
        committed_max: Option<i64>,
        options: &StateOptions,
    ) -> Result<(Option<i64>, Option<i64>)> {
        let batch_max = self.newest_event_time(&options.time_column)?;
        let newest = match (committed_max, batch_max) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        Ok((
            newest,
            newest.map(|t| t.saturating_sub(options.horizon_us())),
        ))
    }

    /// The newest event time of the batch in microseconds (a read of the time column
    /// alone), `None` when every value is null or there are no rows.
    fn newest_event_time(&self, column: &str) -> Result<Option<i64>> {
        let mut newest: Option<i64> = None;
        for file in &self.files {
            check_time_column(file, column)?;
            for batch in file.read_columns(&[column])? {
                let batch = batch?;
                let times = event_micros(&batch, column, file.path())?;
                if let Some(max) = arrow::compute::max(&times) {
                    newest = Some(newest.map_or(max, |n| n.max(max)));
                }
            }
        }
        Ok(newest)
    }
}

/// The key and version layouts of the batch, and the names a state records them by.
pub(super) struct Layouts {
    keys: KeyLayout,
    key_classes: Vec<String>,
    versions: VersionLayout,
}

impl Layouts {
    fn try_new(schema: &Schema, spec: &DedupSpec, first: Option<&Path>) -> Result<Self> {
        let path = first.unwrap_or(Path::new(""));
        let fields = |names: &[String], role: &'static str| -> Result<Vec<Field>> {
            names
                .iter()
                .map(|n| {
                    schema
                        .field_with_name(n)
                        .cloned()
                        .map_err(|_| Error::MissingColumn {
                            path: path.to_path_buf(),
                            column: n.clone(),
                            role,
                            available: schema
                                .fields()
                                .iter()
                                .map(|f| f.name().as_str())
                                .collect::<Vec<_>>()
                                .join(", "),
                        })
                })
                .collect()
        };
        let key_fields = fields(&spec.keys, "key")?;
        let key_classes = key_fields
            .iter()
            .map(|f| {
                KeyClass::of(f.name(), f.data_type())
                    .map(|c| format!("{c:?}"))
                    .map_err(Error::arrow(path))
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            keys: KeyLayout::try_new(&key_fields).map_err(Error::arrow(path))?,
            key_classes,
            versions: VersionLayout::try_new(&fields(&spec.versions, "version")?)
                .map_err(Error::arrow(path))?,
        })
    }

    /// A state keyed by other columns would hash other values: its entries would match
    /// nothing and every replay would pass. `state` is what the state at `url` records.
    fn check(&self, url: &str, state: &Layout) -> Result<()> {
        let mismatch = |what: &str, state: String, run: String| {
            Err(Error::InvalidArgument(format!(
                "{url}: the state was built with {what} {state}, this run has {run}; use \
                 another --state location (or the state's options)"
            )))
        };
        if state.key != self.keys.names() || state.key_classes != self.key_classes {
            return mismatch(
                "key",
                format!("{:?} {:?}", state.key, state.key_classes),
                format!("{:?} {:?}", self.keys.names(), self.key_classes),
            );
        }
        if state.version_columns != self.versions.names()
            || state.version_width != self.versions.width()
        {
            return mismatch(
                "version",
                format!("{:?}", state.version_columns),
                format!("{:?}", self.versions.names()),
            );
        }
        Ok(())
    }

    /// What a new state records of these layouts.
    fn layout(&self) -> Layout {
        Layout {
            key: self.keys.names().to_vec(),
            key_classes: self.key_classes.clone(),
            version_columns: self.versions.names().to_vec(),
            version_width: self.versions.width(),
        }
    }
}

/// The key and version a state was built with, as it records them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, serde::Deserialize)]
pub(super) struct Layout {
    key: Vec<String>,
    key_classes: Vec<String>,
    version_columns: Vec<String>,
    version_width: usize,
}

/// The time column as microseconds since the epoch.
fn event_micros(batch: &RecordBatch, column: &str, path: &Path) -> Result<Int64Array> {
    let micros = event_times(batch, column, path, TimeUnit::Microsecond)?;
    Ok(micros
        .as_primitive::<TimestampMicrosecondType>()
        .reinterpret_cast::<arrow::datatypes::Int64Type>())
}

/// One batch of winners as a state sees them: each row's 128-bit key hash, encoded
/// version, whether it is a delete, and its event time. Buffers are reused across batches.
#[derive(Default)]
pub(super) struct Winners {
    rows: KeyRows,
    hashes: Vec<u128>,
    versions: Vec<u8>,
    width: usize,
    tombstones: Vec<bool>,
    times: Vec<i64>,
}

impl Winners {
    /// Reads `batch`, winners from the file at `path`.
    ///
    /// # Errors
    /// Columns that do not fit the layouts, a null event time.
    fn read(
        &mut self,
        batch: &RecordBatch,
        path: &Path,
        spec: &DedupSpec,
        layouts: &Layouts,
        time_column: &str,
    ) -> Result<()> {
        let n = batch.num_rows();
        let named = |name: &String| {
            batch
                .column_by_name(name)
                .cloned()
                .ok_or_else(|| Error::MissingRequiredColumn {
                    path: path.to_path_buf(),
                    column: name.clone(),
                })
        };
        let key_columns: Vec<ArrayRef> = spec.keys.iter().map(named).collect::<Result<_>>()?;
        let keys = layouts
            .keys
            .canonicalise(&key_columns)
            .map_err(Error::arrow(path))?;
        keys.encode_rows(&mut self.rows);
        self.hashes.clear();
        self.hashes
            .extend((0..n).map(|row| twox_hash::XxHash3_128::oneshot(self.rows.row(row))));
        let version_columns: Vec<ArrayRef> =
            spec.versions.iter().map(named).collect::<Result<_>>()?;
        layouts
            .versions
            .encode(&version_columns, n, &mut self.versions)
            .map_err(Error::arrow(path))?;
        self.width = layouts.versions.width();
        self.tombstones.clear();
        match &spec.options.deletes {
            Some(deletes) => deletes
                .mark_tombstones(&named(&deletes.op_column)?, &mut self.tombstones)
                .map_err(Error::arrow(path))?,
            None => self.tombstones.resize(n, false),
        }
        let times = event_micros(batch, time_column, path)?;
        if times.null_count() > 0 {
            return Err(Error::InvalidArgument(format!(
                "{}: --time-column '{time_column}' is null in {} winning rows; the state \
                 cannot expire keys without an event time",
                path.display(),
                times.null_count()
            )));
        }
        self.times.clear();
        self.times.extend_from_slice(times.values());
        Ok(())
    }

    fn len(&self) -> usize {
        self.hashes.len()
    }

    fn version(&self, row: usize) -> &[u8] {
        &self.versions[row * self.width..(row + 1) * self.width]
    }
}

/// What a state holds of a key from earlier runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Known<'a> {
    version: &'a [u8],
    deleted: bool,
    time: i64,
}

/// What a state does with one winning row: the one decision every back-end makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    /// A key the state does not hold: emitted and recorded.
    New,
    /// A delete of a key not live downstream (never emitted, or deleted already): recorded,
    /// so that it blocks older replays, and not written.
    DeleteRecorded,
    /// A newer version (or a delete) of a live emitted key: emitted and recorded.
    Updated {
        /// The row is a delete.
        delete: bool,
    },
    /// A key emitted at an equal or newer version: dropped.
    SeenBefore,
    /// Older than the watermark and not held: as `--late` says, never recorded.
    Late {
        /// The row is a delete.
        delete: bool,
    },
}

impl Verdict {
    /// Whether the state records the row (its version, deletion and event time).
    fn records(self) -> bool {
        matches!(
            self,
            Self::New | Self::DeleteRecorded | Self::Updated { .. }
        )
    }

    /// The entry a recorded row leaves: the row's version and deletion, the newest event
    /// time of the key.
    fn event_time(known: Option<Known<'_>>, time: i64) -> i64 {
        known.map_or(time, |k| k.time.max(time))
    }
}

/// The decision for a winning row of `version` (a delete when `is_delete`) and event time
/// `time`, given what the state holds of its key and the run's watermark.
pub(super) fn judge(
    known: Option<Known<'_>>,
    version: &[u8],
    is_delete: bool,
    time: i64,
    watermark: Option<i64>,
) -> Verdict {
    match known {
        Some(known) if version > known.version => {
            // A delete of a key that is already deleted downstream has nothing to do.
            if is_delete && known.deleted {
                Verdict::DeleteRecorded
            } else {
                Verdict::Updated { delete: is_delete }
            }
        }
        Some(_) => Verdict::SeenBefore,
        None if watermark.is_some_and(|w| time < w) => Verdict::Late { delete: is_delete },
        None if is_delete => Verdict::DeleteRecorded,
        None => Verdict::New,
    }
}

impl StateReport {
    /// Counts `verdict`, and says whether its row leaves the run.
    ///
    /// # Errors
    /// A late row under `--late error`.
    fn count(
        &mut self,
        verdict: Verdict,
        late: LatePolicy,
        context: impl FnOnce() -> Error,
    ) -> Result<bool> {
        Ok(match verdict {
            Verdict::New => {
                self.new_keys += 1;
                true
            }
            Verdict::DeleteRecorded => {
                self.deletes_recorded += 1;
                false
            }
            Verdict::Updated { delete } => {
                self.updated += 1;
                self.deletes_emitted += u64::from(delete);
                true
            }
            Verdict::SeenBefore => {
                self.seen_before += 1;
                false
            }
            Verdict::Late { delete } => {
                self.late += 1;
                match late {
                    LatePolicy::Drop => false,
                    LatePolicy::Emit => {
                        self.deletes_emitted += u64::from(delete);
                        true
                    }
                    LatePolicy::Error => return Err(context()),
                }
            }
        })
    }
}

/// The error of a late row under `--late error`.
fn late_error(path: &Path, time: i64, watermark: Option<i64>) -> Error {
    Error::InvalidArgument(format!(
        "{}: a row of event time {} is older than the state's watermark {} (--late error); \
         nothing was written",
        path.display(),
        rfc3339(time),
        watermark.map(rfc3339).unwrap_or_default()
    ))
}

/// Microseconds since the epoch as RFC 3339.
fn rfc3339(micros: i64) -> String {
    arrow::temporal_conversions::timestamp_us_to_datetime(micros)
        .map_or_else(|| micros.to_string(), |t| t.and_utc().to_rfc3339())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn known(version: u8, deleted: bool) -> Option<Known<'static>> {
        let versions: &'static [u8; 4] = &[0, 1, 2, 3];
        Some(Known {
            version: &versions[version as usize..=version as usize],
            deleted,
            time: 10,
        })
    }

    #[test]
    fn verdicts_follow_the_version_the_deletion_and_the_watermark() {
        let w = Some(100);
        assert_eq!(judge(None, &[1], false, 200, w), Verdict::New);
        assert_eq!(judge(None, &[1], true, 200, w), Verdict::DeleteRecorded);
        assert_eq!(
            judge(None, &[1], true, 50, w),
            Verdict::Late { delete: true }
        );
        assert_eq!(judge(None, &[1], false, 50, None), Verdict::New);
        // A held key is judged by its version, however old the row.
        assert_eq!(
            judge(known(1, false), &[1], false, 50, w),
            Verdict::SeenBefore
        );
        assert_eq!(
            judge(known(2, false), &[1], false, 200, w),
            Verdict::SeenBefore
        );
        assert_eq!(
            judge(known(1, false), &[2], false, 50, w),
            Verdict::Updated { delete: false }
        );
        assert_eq!(
            judge(known(1, false), &[2], true, 200, w),
            Verdict::Updated { delete: true }
        );
        assert_eq!(
            judge(known(1, true), &[2], true, 200, w),
            Verdict::DeleteRecorded
        );
        assert_eq!(
            judge(known(1, true), &[2], false, 200, w),
            Verdict::Updated { delete: false }
        );
        assert_eq!(Verdict::event_time(known(1, false), 5), 10);
        assert_eq!(Verdict::event_time(None, 5), 5);
    }

    #[test]
    fn counts_add_up_and_late_rows_follow_the_policy() {
        let mut report = StateReport::default();
        let fail = || Error::InvalidArgument("late".into());
        let verdicts = [
            Verdict::New,
            Verdict::DeleteRecorded,
            Verdict::Updated { delete: true },
            Verdict::SeenBefore,
            Verdict::Late { delete: true },
        ];
        let emitted: Vec<bool> = verdicts
            .iter()
            .map(|&v| report.count(v, LatePolicy::Emit, fail).unwrap_or(false))
            .collect();
        assert_eq!(emitted, [true, false, true, false, true]);
        assert_eq!(
            (
                report.new_keys,
                report.deletes_recorded,
                report.updated,
                report.seen_before,
                report.late,
                report.deletes_emitted
            ),
            (1, 1, 1, 1, 1, 2)
        );
        let late = Verdict::Late { delete: false };
        assert_eq!(report.count(late, LatePolicy::Drop, fail).ok(), Some(false));
        assert!(report.count(late, LatePolicy::Error, fail).is_err());
        assert!(Verdict::New.records() && !Verdict::SeenBefore.records());
        assert!(!late.records() && Verdict::DeleteRecorded.records());
    }

    #[test]
    fn late_policies_parse_and_print() {
        for policy in ["drop", "emit", "error"] {
            assert_eq!(
                policy.parse::<LatePolicy>().map(|p| p.to_string()),
                Ok(policy.to_owned())
            );
        }
        assert!("keep".parse::<LatePolicy>().is_err());
    }

    #[test]
    fn redis_urls_are_told_from_directories() {
        assert!(is_redis_url("redis://localhost:6379/0"));
        assert!(is_redis_url("REDISS://h"));
        assert!(!is_redis_url("s3://bucket/redis://"));
        assert!(!is_redis_url("/tmp/state"));
    }
}
