//! The state as files on any store: Parquet key files and JSON manifests.
//!
//! ```text
//!  <state>/_manifest/00000000000000000007.json   the commit point: files, watermark, runs
//!  <state>/keys/part-0003-…-v7.parquet           key hash (XXH3-128) · version · event time
//!                                                · deleted, one file per key-hash partition
//!  <state>/evicted/…-v7.bloom                    keys expired by run 7 (a Bloom filter)
//! ```
//!
//! A run loads the latest manifest's entries, runs the ordinary two-pass dedup, and passes
//! every winning row through [`StateFilter`]: a key already emitted at an equal or newer
//! version is dropped (`seen_before`); a newer version of an emitted key is emitted again
//! (downstream applies it as an update or delete); an unseen key is emitted and recorded.
//! The watermark is `max(event time ever seen) − retention − safety buffer`: rows older
//! than it are `late` (their key's entry may already be gone) and handled by `--late`;
//! entries older than it are expired at the end of the run, their keys remembered for one
//! more retention in a Bloom filter so that a key that comes back is counted as
//! `evicted_then_seen` — the sign that the retention is too short.
//!
//! Commit order: output and new state files are written under fresh names, the output is
//! committed (renamed into place), then the next manifest is created if absent. A crash
//! before the output commit leaves old state and no output; between the two commits, old
//! state and a full output, which a re-run reproduces (the decisions are deterministic)
//! before it commits the state; after, both. New state never stands without its output.
//! A batch whose inputs (fingerprint) a committed run already applied is not run again.

use std::path::Path;
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, BooleanArray, FixedSizeBinaryArray, Int64Array, RecordBatch,
};
use arrow::compute::filter_record_batch;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit, TimestampMicrosecondType};
use bytes::Bytes;
use hashbrown::HashTable;
use idem_core::DedupSpec;
use idem_core::key::{KeyClass, KeyLayout, KeyRows};
use idem_core::version::VersionLayout;
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::{ArrowReaderOptions, ParquetRecordBatchReaderBuilder};
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use serde::{Deserialize, Serialize};

use super::{LatePolicy, StateOptions, StateReport, WinnerFilter};
use crate::error::{Error, Result};
use crate::read::event_time::{check_time_column, event_times};
use crate::read::expand::expand_inputs;
use crate::read::input::{InputFile, fingerprint};
use crate::storage::{RemoteLocation, StorageOptions, managed_directory};
use crate::units::now_millis;

/// Key-hash partitions of a new state: each is one file, rewritten only when a run adds
/// to it or expires from it.
const PARTITION_BITS: u32 = 4;
/// Applied runs remembered in the manifest, to recognise a re-run of the same inputs.
const REMEMBERED_RUNS: usize = 1000;
/// Manifests kept besides the current one (for readers that listed just before a commit).
const KEPT_MANIFESTS: usize = 10;
/// Unreferenced state files younger than this may belong to a run still writing.
const ORPHAN_AGE_MS: i64 = 3_600_000;
/// Bits per evicted key and probes of the Bloom filters: about 0.05 % false positives.
const BLOOM_BITS_PER_KEY: u64 = 16;
const BLOOM_PROBES: u64 = 11;
const BLOOM_MAGIC: &[u8; 8] = b"IDEMBLM1";
const FORMAT: &str = "idem-state/1";
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Manifest {
    format: String,
    version: u64,
    key: Vec<String>,
    key_classes: Vec<String>,
    version_columns: Vec<String>,
    version_width: usize,
    partition_bits: u32,
    max_event_time_us: Option<i64>,
    watermark_us: Option<i64>,
    files: Vec<KeyFile>,
    evicted: Vec<EvictedFilter>,
    runs: Vec<AppliedRun>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct KeyFile {
    partition: u32,
    path: String,
    keys: u64,
    bytes: u64,
    min_event_time_us: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct EvictedFilter {
    path: String,
    keys: u64,
    bytes: u64,
    watermark_us: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct AppliedRun {
    fingerprint: String,
    output: String,
    committed_at_ms: i64,
}

fn manifest_name(version: u64) -> String {
    format!("_manifest/{version:020}.json")
}

/// Checks what a state run needs before any row is read, and loads the state.
pub(crate) enum Prepared {
    /// The inputs were applied by a committed run.
    AlreadyApplied(Box<StateReport>),
    /// Ready to filter the run's winners.
    Ready(Box<StateFilter>),
}

/// Opens the state for `inputs` under `spec`: the latest manifest, the batch's fingerprint
/// (an applied batch stops here), the newest event time of the batch (a pass over the time
/// column alone) and the entries.
///
/// # Errors
/// A state of another key or version, a time column missing or not temporal (naming the
/// file), an unreadable state.
pub(crate) fn prepare(
    inputs: &[String],
    storage: &StorageOptions,
    spec: &DedupSpec,
    options: &StateOptions,
) -> Result<Prepared> {
    let dir = managed_directory(&options.location, storage)?;
    let manifest = latest_manifest(&dir)?;
    let files: Vec<InputFile> = expand_inputs(inputs, storage)?
        .iter()
        .map(InputFile::open)
        .collect::<Result<_>>()?;
    let schema = crate::read::schema::unify(files.iter().map(|f| (f.path(), f.schema())))?;
    let batch_fingerprint = fingerprint(&files, spec)?;
    let layouts = Layouts::try_new(&schema, spec, files.first().map(InputFile::path))?;
    if let Some(manifest) = &manifest {
        check_compatible(manifest, &layouts, &dir)?;
        if manifest
            .runs
            .iter()
            .any(|r| r.fingerprint == batch_fingerprint)
        {
            return Ok(Prepared::AlreadyApplied(Box::new(report_of(
                manifest, options, true,
            ))));
        }
    }
    let batch_max = newest_event_time(&files, &options.time_column)?;
    let manifest = manifest.unwrap_or_else(|| Manifest {
        format: FORMAT.to_owned(),
        version: 0,
        key: spec.keys.clone(),
        key_classes: layouts.key_classes.clone(),
        version_columns: spec.versions.clone(),
        version_width: layouts.versions.width(),
        partition_bits: PARTITION_BITS,
        ..Manifest::default()
    });
    let max_event_time_us = match (manifest.max_event_time_us, batch_max) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
    let watermark_us = max_event_time_us.map(|t| t.saturating_sub(options.horizon_us()));
    Ok(Prepared::Ready(Box::new(StateFilter {
        dir,
        options: options.clone(),
        spec: spec.clone(),
        layouts,
        fingerprint: batch_fingerprint,
        // Loaded once pass 1 is done (`expect`).
        entries: Entries {
            width: manifest.version_width,
            touched: vec![false; 1 << manifest.partition_bits],
            ..Entries::default()
        },
        manifest,
        max_event_time_us,
        watermark_us,
        filters: Vec::new(),
        report: StateReport {
            location: options.location.clone(),
            late_policy: options.late.to_string(),
            ..StateReport::default()
        },
        scratch: Scratch::default(),
    })))
}

/// The key and version layouts of the batch.
struct Layouts {
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
}

/// A state keyed by other columns would hash other values: its entries would match nothing
/// and every replay would pass.
fn check_compatible(manifest: &Manifest, layouts: &Layouts, dir: &RemoteLocation) -> Result<()> {
    let mismatch = |what: &str, state: String, run: String| {
        Err(Error::InvalidArgument(format!(
            "{}: the state was built with {what} {state}, this run has {run}; use another \
             --state location (or the state's options)",
            dir.url()
        )))
    };
    if manifest.format != FORMAT {
        return mismatch("format", manifest.format.clone(), FORMAT.to_owned());
    }
    if manifest.key != layouts.keys.names() || manifest.key_classes != layouts.key_classes {
        return mismatch(
            "key",
            format!("{:?} {:?}", manifest.key, manifest.key_classes),
            format!("{:?} {:?}", layouts.keys.names(), layouts.key_classes),
        );
    }
    if manifest.version_columns != layouts.versions.names()
        || manifest.version_width != layouts.versions.width()
    {
        return mismatch(
            "version",
            format!("{:?}", manifest.version_columns),
            format!("{:?}", layouts.versions.names()),
        );
    }
    Ok(())
}

/// The newest manifest, `None` for a new state.
fn latest_manifest(dir: &RemoteLocation) -> Result<Option<Manifest>> {
    let listed = dir.join("_manifest").list_below()?;
    // A manifest's name holding other objects is a damaged state (locally, a directory
    // in its place), not a state without that version: committing it again would fail
    // after the output is written. A local store lists an empty directory as nothing,
    // so the directory itself is looked at too.
    let manifests = dir.join("_manifest");
    if let Some(local) = url::Url::parse(&manifests.url())
        .ok()
        .filter(|u| u.scheme() == "file")
        .and_then(|u| u.to_file_path().ok())
        && let Ok(entries) = std::fs::read_dir(&local)
        && let Some(entry) = entries
            .flatten()
            .find(|e| e.file_type().is_ok_and(|t| !t.is_file()))
    {
        return Err(Error::InvalidArgument(format!(
            "{}: '{}' is not a file: the state is damaged",
            manifests.url(),
            entry.file_name().to_string_lossy()
        )));
    }
    if let Some(nested) = listed.iter().find(|o| {
        o.name
            .split_once('/')
            .is_some_and(|(first, _)| first.ends_with(".json"))
    }) {
        return Err(Error::InvalidArgument(format!(
            "{}: '_manifest/{}' is inside a manifest's name: the state is damaged",
            dir.url(),
            nested.name
        )));
    }
    let Some(latest) = listed
        .iter()
        .filter(|o| o.name.ends_with(".json") && !o.name.contains('/'))
        .max_by(|a, b| a.name.cmp(&b.name))
    else {
        return Ok(None);
    };
    let location = dir.join("_manifest").join(&latest.name);
    let bytes = location
        .read_all()?
        .ok_or_else(|| Error::InvalidArgument(format!("{}: listed but gone", location.url())))?;
    serde_json::from_slice(&bytes).map(Some).map_err(|e| {
        Error::InvalidArgument(format!("{}: not a state manifest: {e}", location.url()))
    })
}

/// The newest event time of the batch in microseconds (a read of the time column alone),
/// `None` when every value is null or there are no rows.
fn newest_event_time(files: &[InputFile], column: &str) -> Result<Option<i64>> {
    let mut newest: Option<i64> = None;
    for file in files {
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

/// The time column as microseconds since the epoch.
fn event_micros(batch: &RecordBatch, column: &str, path: &Path) -> Result<Int64Array> {
    let micros = event_times(batch, column, path, TimeUnit::Microsecond)?;
    Ok(micros
        .as_primitive::<TimestampMicrosecondType>()
        .reinterpret_cast::<arrow::datatypes::Int64Type>())
}

/// The state's entries in memory: columns, indexed by key hash.
#[derive(Default)]
struct Entries {
    hashes: Vec<u128>,
    versions: Vec<u8>,
    width: usize,
    times: Vec<i64>,
    deleted: Vec<bool>,
    index: HashTable<u32>,
    /// Partitions with an added or changed entry.
    touched: Vec<bool>,
}

impl Entries {
    /// The manifest's entries, with room for `room` more, so that a large run does not
    /// grow the table (and copy every vector) a dozen times.
    fn load(dir: &RemoteLocation, manifest: &Manifest, room: usize) -> Result<Self> {
        let keys: u64 = manifest.files.iter().map(|f| f.keys).sum();
        let capacity = usize::try_from(keys).unwrap_or(0) + room;
        let mut entries = Self {
            width: manifest.version_width,
            hashes: Vec::with_capacity(capacity),
            versions: Vec::with_capacity(capacity * manifest.version_width),
            times: Vec::with_capacity(capacity),
            deleted: Vec::with_capacity(capacity),
            index: HashTable::with_capacity(capacity),
            touched: vec![false; 1 << manifest.partition_bits],
        };
        for file in &manifest.files {
            let location = dir.join(&file.path);
            let bytes = location.read_all()?.ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{}: a state file the manifest lists is missing",
                    location.url()
                ))
            })?;
            let path = location.display_path();
            let metadata = crate::read::decoding::load_parquet_metadata(
                &bytes,
                ArrowReaderOptions::new(),
                &path,
            )?;
            let reader = crate::read::decoding::guarded(&path, || {
                ParquetRecordBatchReaderBuilder::new_with_metadata(bytes, metadata)
                    .build()
                    .map_err(Error::parquet(&path))
            })?;
            let batches = reader.map(|batch| batch.map_err(Error::arrow(&path)));
            for batch in crate::read::decoding::guarded_iter(path.clone(), batches) {
                let batch = batch?;
                entries.append_batch(&batch, &path)?;
            }
        }
        Ok(entries)
    }

    fn append_batch(&mut self, batch: &RecordBatch, path: &Path) -> Result<()> {
        let column = |name: &str| {
            batch.column_by_name(name).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{}: state file without column '{name}'",
                    path.display()
                ))
            })
        };
        let hashes = column("key_hash")?
            .as_fixed_size_binary_opt()
            .ok_or_else(|| {
                Error::InvalidArgument(format!("{}: bad key_hash column", path.display()))
            })?;
        let times = column("event_time_us")?
            .as_primitive_opt::<arrow::datatypes::Int64Type>()
            .ok_or_else(|| {
                Error::InvalidArgument(format!("{}: bad event_time_us column", path.display()))
            })?;
        let deleted = column("deleted")?.as_boolean_opt().ok_or_else(|| {
            Error::InvalidArgument(format!("{}: bad deleted column", path.display()))
        })?;
        let versions = if self.width > 0 {
            Some(
                column("version")?
                    .as_fixed_size_binary_opt()
                    .ok_or_else(|| {
                        Error::InvalidArgument(format!("{}: bad version column", path.display()))
                    })?,
            )
        } else {
            None
        };
        for row in 0..batch.num_rows() {
            let hash = u128::from_le_bytes(hashes.value(row).try_into().map_err(|_| {
                Error::InvalidArgument(format!("{}: key_hash is not 16 bytes", path.display()))
            })?);
            let version = versions.map_or(&[][..], |v| v.value(row));
            if version.len() != self.width {
                return Err(Error::InvalidArgument(format!(
                    "{}: version is not {} bytes",
                    path.display(),
                    self.width
                )));
            }
            self.insert(hash, version, times.value(row), deleted.value(row));
        }
        Ok(())
    }

    fn find(&self, hash: u128) -> Option<usize> {
        self.index
            .find(hash as u64, |&i| self.hashes[i as usize] == hash)
            .map(|&i| i as usize)
    }

    fn insert(&mut self, hash: u128, version: &[u8], time: i64, deleted: bool) {
        let at = self.hashes.len() as u32;
        self.hashes.push(hash);
        self.versions.extend_from_slice(version);
        self.times.push(time);
        self.deleted.push(deleted);
        let hashes = &self.hashes;
        self.index
            .insert_unique(hash as u64, at, |&i| hashes[i as usize] as u64);
    }

    fn version(&self, at: usize) -> &[u8] {
        &self.versions[at * self.width..(at + 1) * self.width]
    }
}

fn partition_of(hash: u128, bits: u32) -> usize {
    if bits == 0 {
        0
    } else {
        (hash >> (128 - bits)) as usize
    }
}

/// Per-batch buffers, reused.
#[derive(Default)]
struct Scratch {
    rows: KeyRows,
    versions: Vec<u8>,
    tombstones: Vec<bool>,
}

/// Decides which of a run's winning rows leave the run, and records them; then writes the
/// next state.
pub(crate) struct StateFilter {
    dir: RemoteLocation,
    options: StateOptions,
    spec: DedupSpec,
    layouts: Layouts,
    fingerprint: String,
    manifest: Manifest,
    entries: Entries,
    max_event_time_us: Option<i64>,
    watermark_us: Option<i64>,
    /// Bloom filters of earlier evictions, loaded on the first unseen key.
    filters: Vec<Bloom>,
    report: StateReport,
    scratch: Scratch,
}

impl WinnerFilter for StateFilter {
    /// Loads the entries now rather than before pass 1, so that they and pass 1's key
    /// table are never in memory together.
    fn expect(&mut self, rows: u64) -> Result<()> {
        let room = usize::try_from(rows).unwrap_or(0);
        self.entries = Entries::load(&self.dir, &self.manifest, room)?;
        Ok(())
    }

    /// The rows of `batch` (winners of the run, tombstones included) that leave the run.
    /// Errors: a late row under `--late error`, a null event time, columns that do not fit
    /// the layouts.
    fn filter(&mut self, batch: RecordBatch, path: &Path) -> Result<RecordBatch> {
        let mut scratch = std::mem::take(&mut self.scratch);
        let kept = self.decide(&batch, path, &mut scratch);
        self.scratch = scratch;
        filter_record_batch(&batch, &BooleanArray::from(kept?)).map_err(Error::arrow(path))
    }
}

impl StateFilter {
    /// Whether each row of `batch` leaves the run.
    fn decide(
        &mut self,
        batch: &RecordBatch,
        path: &Path,
        scratch: &mut Scratch,
    ) -> Result<Vec<bool>> {
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
        let key_columns: Vec<ArrayRef> = self.spec.keys.iter().map(named).collect::<Result<_>>()?;
        let keys = self
            .layouts
            .keys
            .canonicalise(&key_columns)
            .map_err(Error::arrow(path))?;
        keys.encode_rows(&mut scratch.rows);
        let version_columns: Vec<ArrayRef> = self
            .spec
            .versions
            .iter()
            .map(named)
            .collect::<Result<_>>()?;
        self.layouts
            .versions
            .encode(&version_columns, n, &mut scratch.versions)
            .map_err(Error::arrow(path))?;
        scratch.tombstones.clear();
        match &self.spec.options.deletes {
            Some(deletes) => deletes
                .mark_tombstones(&named(&deletes.op_column)?, &mut scratch.tombstones)
                .map_err(Error::arrow(path))?,
            None => scratch.tombstones.resize(n, false),
        }
        let times = event_micros(batch, &self.options.time_column, path)?;
        if times.null_count() > 0 {
            return Err(Error::InvalidArgument(format!(
                "{}: --time-column '{}' is null in {} winning rows; the state cannot expire \
                 keys without an event time",
                path.display(),
                self.options.time_column,
                times.null_count()
            )));
        }
        let width = self.layouts.versions.width();
        let bits = self.manifest.partition_bits;
        let mut emit = Vec::with_capacity(n);
        for row in 0..n {
            let hash = twox_hash::XxHash3_128::oneshot(scratch.rows.row(row));
            let version = &scratch.versions[row * width..(row + 1) * width];
            let time = times.value(row);
            let is_delete = scratch.tombstones[row];
            let emitted = match self.entries.find(hash) {
                Some(at) if version > self.entries.version(at) => {
                    let was_live = !self.entries.deleted[at];
                    let start = at * width;
                    self.entries.versions[start..start + width].copy_from_slice(version);
                    self.entries.times[at] = self.entries.times[at].max(time);
                    self.entries.deleted[at] = is_delete;
                    self.entries.touched[partition_of(hash, bits)] = true;
                    // A delete of a key that is already deleted downstream has nothing to do.
                    if is_delete && !was_live {
                        self.report.deletes_recorded += 1;
                        false
                    } else {
                        self.report.updated += 1;
                        self.report.deletes_emitted += u64::from(is_delete);
                        true
                    }
                }
                Some(_) => {
                    self.report.seen_before += 1;
                    false
                }
                None => self.unseen(hash, version, time, is_delete, path)?,
            };
            emit.push(emitted);
        }
        Ok(emit)
    }

    /// A winner whose key the state does not hold.
    fn unseen(
        &mut self,
        hash: u128,
        version: &[u8],
        time: i64,
        is_delete: bool,
        path: &Path,
    ) -> Result<bool> {
        if self.watermark_us.is_some_and(|w| time < w) {
            self.report.late += 1;
            return match self.options.late {
                LatePolicy::Drop => Ok(false),
                LatePolicy::Emit => {
                    self.report.deletes_emitted += u64::from(is_delete);
                    Ok(true)
                }
                LatePolicy::Error => Err(Error::InvalidArgument(format!(
                    "{}: a row of event time {} is older than the state's watermark {} \
                     (--late error); nothing was written",
                    path.display(),
                    rfc3339(time),
                    self.watermark_us.map(rfc3339).unwrap_or_default()
                ))),
            };
        }
        // Only rows of recent event time: a late row is a replay of an old event, counted
        // above; a key that comes back with a new time was re-sent by its producer.
        if self.filters.is_empty() && !self.manifest.evicted.is_empty() {
            self.filters = load_filters(&self.dir, &self.manifest)?;
        }
        if self.filters.iter().any(|f| f.contains(hash)) {
            self.report.evicted_then_seen += 1;
        }
        let bits = self.manifest.partition_bits;
        self.entries.insert(hash, version, time, is_delete);
        self.entries.touched[partition_of(hash, bits)] = true;
        if is_delete {
            self.report.deletes_recorded += 1;
            Ok(false)
        } else {
            self.report.new_keys += 1;
            Ok(true)
        }
    }

    /// Writes the next state's files (the output is not committed yet): partitions that
    /// changed or lose expired entries get a new file, the others keep theirs.
    ///
    /// # Errors
    /// A state file that cannot be written.
    pub(crate) fn stage(mut self) -> Result<StagedState> {
        let version = self.manifest.version + 1;
        let run_id = run_id(&self.fingerprint, version);
        let bits = self.manifest.partition_bits;
        let watermark = self.watermark_us.unwrap_or(i64::MIN);
        let mut expired_hashes = Vec::new();
        let partitions = 1usize << bits;
        let mut members: Vec<Vec<u32>> = vec![Vec::new(); partitions];
        for at in 0..self.entries.hashes.len() {
            let hash = self.entries.hashes[at];
            if self.entries.times[at] < watermark {
                expired_hashes.push(hash);
                self.entries.touched[partition_of(hash, bits)] = true;
            } else {
                members[partition_of(hash, bits)].push(at as u32);
            }
        }
        self.report.expired = expired_hashes.len() as u64;
        let mut files: Vec<KeyFile> = Vec::with_capacity(partitions);
        let mut written = Vec::new();
        for (partition, rows) in members.iter().enumerate() {
            if !self.entries.touched[partition] {
                files.extend(
                    self.manifest
                        .files
                        .iter()
                        .filter(|f| f.partition as usize == partition)
                        .cloned(),
                );
                continue;
            }
            if rows.is_empty() {
                continue;
            }
            let name = format!("keys/part-{partition:04}-{run_id}.parquet");
            let bytes = self.entries.encode(rows)?;
            let size = bytes.len() as u64;
            self.dir.join(&name).write_all(bytes)?;
            written.push(name.clone());
            files.push(KeyFile {
                partition: partition as u32,
                path: name,
                keys: rows.len() as u64,
                bytes: size,
                min_event_time_us: rows
                    .iter()
                    .map(|&at| self.entries.times[at as usize])
                    .min()
                    .unwrap_or(0),
            });
        }
        let mut evicted: Vec<EvictedFilter> = self
            .manifest
            .evicted
            .iter()
            .filter(|f| f.watermark_us >= watermark.saturating_sub(self.options.horizon_us()))
            .cloned()
            .collect();
        if !expired_hashes.is_empty() {
            let name = format!("evicted/{run_id}.bloom");
            let bytes = Bloom::of(&expired_hashes).encode();
            let size = bytes.len() as u64;
            self.dir.join(&name).write_all(bytes)?;
            written.push(name.clone());
            evicted.push(EvictedFilter {
                path: name,
                keys: expired_hashes.len() as u64,
                bytes: size,
                watermark_us: watermark,
            });
        }
        let mut next = self.manifest.clone();
        next.version = version;
        next.max_event_time_us = self.max_event_time_us;
        next.watermark_us = self.watermark_us;
        next.files = files;
        next.evicted = evicted;
        self.report.files_written = written.len();
        Ok(StagedState {
            dir: self.dir,
            previous: self.manifest,
            next,
            fingerprint: self.fingerprint,
            written,
            report: self.report,
            options: self.options,
        })
    }
}

impl Entries {
    fn encode(&self, rows: &[u32]) -> Result<Bytes> {
        let mut fields = vec![Field::new("key_hash", DataType::FixedSizeBinary(16), false)];
        if self.width > 0 {
            fields.push(Field::new(
                "version",
                DataType::FixedSizeBinary(self.width as i32),
                false,
            ));
        }
        fields.push(Field::new("event_time_us", DataType::Int64, false));
        fields.push(Field::new("deleted", DataType::Boolean, false));
        let schema: SchemaRef = Arc::new(Schema::new(fields));
        let to_arrow = |e: arrow::error::ArrowError| Error::InvalidArgument(e.to_string());
        let hashes = FixedSizeBinaryArray::try_from_iter(
            rows.iter()
                .map(|&at| self.hashes[at as usize].to_le_bytes()),
        )
        .map_err(to_arrow)?;
        let mut columns: Vec<ArrayRef> = vec![Arc::new(hashes)];
        if self.width > 0 {
            let versions = FixedSizeBinaryArray::try_from_iter(
                rows.iter().map(|&at| self.version(at as usize)),
            )
            .map_err(to_arrow)?;
            columns.push(Arc::new(versions));
        }
        columns.push(Arc::new(Int64Array::from_iter_values(
            rows.iter().map(|&at| self.times[at as usize]),
        )));
        columns.push(Arc::new(BooleanArray::from_iter(
            rows.iter().map(|&at| Some(self.deleted[at as usize])),
        )));
        let batch = RecordBatch::try_new(Arc::clone(&schema), columns).map_err(to_arrow)?;
        // Key hashes are random: compressing them costs time and saves nothing. Times and
        // versions compress a little.
        let properties = WriterProperties::builder()
            .set_compression(Compression::ZSTD(ZstdLevel::default()))
            .set_column_compression("key_hash".into(), Compression::UNCOMPRESSED)
            .set_dictionary_enabled(false)
            .build();
        let mut out = Vec::new();
        let mut writer = ArrowWriter::try_new(&mut out, schema, Some(properties))
            .map_err(|e| Error::InvalidArgument(format!("state file: {e}")))?;
        writer
            .write(&batch)
            .and_then(|()| writer.close().map(|_| ()))
            .map_err(|e| Error::InvalidArgument(format!("state file: {e}")))?;
        Ok(Bytes::from(out))
    }
}

/// A state whose files are written, waiting for the output to commit first.
pub(crate) struct StagedState {
    dir: RemoteLocation,
    previous: Manifest,
    next: Manifest,
    fingerprint: String,
    written: Vec<String>,
    report: StateReport,
    options: StateOptions,
}

impl StagedState {
    /// Commits the state after the output: creates the next manifest, unless another run
    /// committed that version first. Then removes what no manifest needs any more.
    ///
    /// # Errors
    /// A concurrent run committed first (this run's output stands; re-run the batch to
    /// record it), or the store fails.
    pub(crate) fn commit(mut self, output: &str) -> Result<StateReport> {
        let now = now_millis();
        self.next.runs.push(AppliedRun {
            fingerprint: self.fingerprint.clone(),
            output: output.to_owned(),
            committed_at_ms: now,
        });
        let excess = self.next.runs.len().saturating_sub(REMEMBERED_RUNS);
        self.next.runs.drain(..excess);
        let json = serde_json::to_vec_pretty(&self.next)
            .map_err(|e| Error::InvalidArgument(format!("state manifest: {e}")))?;
        let name = manifest_name(self.next.version);
        if !self.dir.join(&name).create_new(Bytes::from(json))? {
            for written in &self.written {
                let _ = self.dir.join(written).delete();
            }
            return Err(Error::InvalidArgument(format!(
                "{}: another run committed state version {} first; this run's output was \
                 written but its keys were not recorded — re-run the batch",
                self.dir.url(),
                self.next.version
            )));
        }
        self.clean_up(now);
        let mut report = report_of(&self.next, &self.options, false);
        report.new_keys = self.report.new_keys;
        report.updated = self.report.updated;
        report.seen_before = self.report.seen_before;
        report.deletes_recorded = self.report.deletes_recorded;
        report.deletes_emitted = self.report.deletes_emitted;
        report.late = self.report.late;
        report.evicted_then_seen = self.report.evicted_then_seen;
        report.expired = self.report.expired;
        report.files_written = self.report.files_written;
        Ok(report)
    }

    /// Best effort: files the previous manifest had and the new one has not, old manifests,
    /// and orphans of crashed runs (unreferenced and older than an hour). A failure here
    /// leaves garbage, never a wrong state.
    fn clean_up(&self, now: i64) {
        let referenced: std::collections::HashSet<&str> = self
            .next
            .files
            .iter()
            .map(|f| f.path.as_str())
            .chain(self.next.evicted.iter().map(|f| f.path.as_str()))
            .collect();
        for old in self
            .previous
            .files
            .iter()
            .map(|f| &f.path)
            .chain(self.previous.evicted.iter().map(|f| &f.path))
        {
            if !referenced.contains(old.as_str()) {
                let _ = self.dir.join(old).delete();
            }
        }
        for sub in ["keys", "evicted"] {
            if let Ok(listed) = self.dir.join(sub).list_below() {
                for object in listed {
                    let name = format!("{sub}/{}", object.name);
                    if !referenced.contains(name.as_str())
                        && now - object.modified_ms > ORPHAN_AGE_MS
                    {
                        let _ = self.dir.join(&name).delete();
                    }
                }
            }
        }
        let oldest_kept = self.next.version.saturating_sub(KEPT_MANIFESTS as u64);
        for version in self.previous.version.saturating_sub(KEPT_MANIFESTS as u64)..oldest_kept {
            let _ = self.dir.join(&manifest_name(version)).delete();
        }
    }
}

fn report_of(manifest: &Manifest, options: &StateOptions, already_applied: bool) -> StateReport {
    let keys: u64 = manifest.files.iter().map(|f| f.keys).sum();
    let bytes: u64 = manifest.files.iter().map(|f| f.bytes).sum();
    StateReport {
        location: options.location.clone(),
        version: manifest.version,
        already_applied,
        late_policy: options.late.to_string(),
        keys,
        bytes,
        evicted_filter_bytes: manifest.evicted.iter().map(|f| f.bytes).sum(),
        bytes_per_key: if keys == 0 {
            0.0
        } else {
            bytes as f64 / keys as f64
        },
        max_event_time: manifest.max_event_time_us.map(rfc3339),
        watermark: manifest.watermark_us.map(rfc3339),
        ..StateReport::default()
    }
}

fn rfc3339(micros: i64) -> String {
    arrow::temporal_conversions::timestamp_us_to_datetime(micros)
        .map_or_else(|| micros.to_string(), |t| t.and_utc().to_rfc3339())
}

/// A name no other run uses: the state version, and a hash of the batch, the process and
/// the clock.
fn run_id(fingerprint: &str, version: u64) -> String {
    let nonce = format!(
        "{fingerprint}\u{1f}{}\u{1f}{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    );
    let digest = twox_hash::XxHash3_64::oneshot(nonce.as_bytes());
    format!("v{version:020}-{digest:016x}")
}

fn load_filters(dir: &RemoteLocation, manifest: &Manifest) -> Result<Vec<Bloom>> {
    manifest
        .evicted
        .iter()
        .map(|f| {
            let location = dir.join(&f.path);
            let bytes = location.read_all()?.ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{}: an evicted-key filter the manifest lists is missing",
                    location.url()
                ))
            })?;
            Bloom::decode(&bytes).ok_or_else(|| {
                Error::InvalidArgument(format!("{}: not an evicted-key filter", location.url()))
            })
        })
        .collect()
}

/// A Bloom filter over 128-bit key hashes (already uniform: the probes are derived from
/// its two halves).
#[derive(Debug, Clone, PartialEq)]
struct Bloom {
    words: Vec<u64>,
}

impl Bloom {
    fn of(hashes: &[u128]) -> Self {
        let bits = (hashes.len() as u64 * BLOOM_BITS_PER_KEY)
            .max(64)
            .div_ceil(64)
            * 64;
        let mut bloom = Self {
            words: vec![0; (bits / 64) as usize],
        };
        for &hash in hashes {
            for bit in probes(hash, bits) {
                bloom.words[(bit / 64) as usize] |= 1 << (bit % 64);
            }
        }
        bloom
    }

    fn contains(&self, hash: u128) -> bool {
        let bits = self.words.len() as u64 * 64;
        bits > 0
            && probes(hash, bits)
                .all(|bit| self.words[(bit / 64) as usize] & (1 << (bit % 64)) != 0)
    }

    fn encode(&self) -> Bytes {
        let mut out = Vec::with_capacity(16 + self.words.len() * 8);
        out.extend_from_slice(BLOOM_MAGIC);
        out.extend_from_slice(&(self.words.len() as u64).to_le_bytes());
        for word in &self.words {
            out.extend_from_slice(&word.to_le_bytes());
        }
        Bytes::from(out)
    }

    fn decode(bytes: &[u8]) -> Option<Self> {
        let body = bytes.strip_prefix(BLOOM_MAGIC.as_slice())?;
        let (count, words) = body.split_at_checked(8)?;
        let count = usize::try_from(u64::from_le_bytes(count.try_into().ok()?)).ok()?;
        if words.len() != count * 8 {
            return None;
        }
        Some(Self {
            words: words
                .chunks_exact(8)
                .map(|w| u64::from_le_bytes(w.try_into().unwrap_or_default()))
                .collect(),
        })
    }
}

/// The bits a hash sets in a filter of `bits` bits: double hashing over its two halves.
fn probes(hash: u128, bits: u64) -> impl Iterator<Item = u64> {
    let (low, high) = (hash as u64, ((hash >> 64) as u64) | 1);
    (0..BLOOM_PROBES).map(move |i| low.wrapping_add(i.wrapping_mul(high)) % bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bloom_filters_find_every_member_and_few_others() {
        let members: Vec<u128> = (0..10_000u64)
            .map(|i| twox_hash::XxHash3_128::oneshot(&i.to_le_bytes()))
            .collect();
        let bloom = Bloom::of(&members);
        assert!(members.iter().all(|&h| bloom.contains(h)));
        let false_positives = (10_000..110_000u64)
            .map(|i| twox_hash::XxHash3_128::oneshot(&i.to_le_bytes()))
            .filter(|&h| bloom.contains(h))
            .count();
        assert!(false_positives < 200, "{false_positives} of 100,000");
        let decoded = Bloom::decode(&bloom.encode());
        assert_eq!(decoded.as_ref(), Some(&bloom));
        assert_eq!(Bloom::decode(b"IDEMBLM1\x05"), None);
        assert!(!Bloom { words: Vec::new() }.contains(1));
    }

    #[test]
    fn partitions_come_from_the_top_bits() {
        assert_eq!(partition_of(u128::MAX, 4), 15);
        assert_eq!(partition_of(1, 4), 0);
        assert_eq!(partition_of(u128::MAX, 0), 0);
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
}
