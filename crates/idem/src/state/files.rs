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
//! every winning row through [`FileState`]: a key already emitted at an equal or newer
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
    ArrayRef, AsArray, BooleanArray, FixedSizeBinaryArray, Int64Array, RecordBatch,
};
use arrow::compute::filter_record_batch;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use bytes::Bytes;
use hashbrown::HashTable;
use idem_core::DedupSpec;
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::{ArrowReaderOptions, ParquetRecordBatchReaderBuilder};
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use serde::{Deserialize, Serialize};

use super::{
    BatchFacts, Known, Layout, Layouts, Prepared, StateFilter, StateOptions, StateReport, Verdict,
    WinnerFilter, Winners, judge, late_error, rfc3339,
};
use crate::error::{Error, Result};
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

/// Opens the state at `options.location` for `batch`: the latest manifest (an applied
/// batch stops here), the newest event time of the batch; the entries are loaded later
/// ([`WinnerFilter::expect`]).
///
/// # Errors
/// A state of another key or version, a time column missing or not temporal (naming the
/// file), an unreadable state.
pub(super) fn prepare(
    batch: BatchFacts,
    storage: &StorageOptions,
    spec: &DedupSpec,
    options: &StateOptions,
) -> Result<Prepared> {
    let dir = managed_directory(&options.location, storage)?;
    let manifest = latest_manifest(&dir)?;
    if let Some(manifest) = &manifest {
        check_compatible(manifest, &batch.layouts, &dir)?;
        if manifest
            .runs
            .iter()
            .any(|r| r.fingerprint == batch.fingerprint)
        {
            return Ok(Prepared::AlreadyApplied(Box::new(report_of(
                manifest, options, true,
            ))));
        }
    }
    let (max_event_time_us, watermark_us) =
        batch.clock(manifest.as_ref().and_then(|m| m.max_event_time_us), options)?;
    let layout = batch.layouts.layout();
    let manifest = manifest.unwrap_or_else(|| Manifest {
        format: FORMAT.to_owned(),
        version: 0,
        key: layout.key,
        key_classes: layout.key_classes,
        version_columns: layout.version_columns,
        version_width: layout.version_width,
        partition_bits: PARTITION_BITS,
        ..Manifest::default()
    });
    Ok(Prepared::Ready(StateFilter::Files(Box::new(FileState {
        dir,
        options: options.clone(),
        spec: spec.clone(),
        layouts: batch.layouts,
        fingerprint: batch.fingerprint,
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
        winners: Winners::default(),
    }))))
}

/// A state keyed by other columns would hash other values: its entries would match nothing
/// and every replay would pass.
fn check_compatible(manifest: &Manifest, layouts: &Layouts, dir: &RemoteLocation) -> Result<()> {
    if manifest.format != FORMAT {
        return Err(Error::InvalidArgument(format!(
            "{}: the state was built with format {}, this run has {FORMAT}; use another \
             --state location (or the state's options)",
            dir.url(),
            manifest.format
        )));
    }
    layouts.check(
        &dir.url(),
        &Layout {
            key: manifest.key.clone(),
            key_classes: manifest.key_classes.clone(),
            version_columns: manifest.version_columns.clone(),
            version_width: manifest.version_width,
        },
    )
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

/// Decides which of a run's winning rows leave the run, and records them; then writes the
/// next state.
pub(crate) struct FileState {
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
    winners: Winners,
}

impl WinnerFilter for FileState {
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
        let mut winners = std::mem::take(&mut self.winners);
        let kept = self.decide(&batch, path, &mut winners);
        self.winners = winners;
        filter_record_batch(&batch, &BooleanArray::from(kept?)).map_err(Error::arrow(path))
    }
}

impl FileState {
    /// Whether each row of `batch` leaves the run.
    fn decide(
        &mut self,
        batch: &RecordBatch,
        path: &Path,
        winners: &mut Winners,
    ) -> Result<Vec<bool>> {
        winners.read(
            batch,
            path,
            &self.spec,
            &self.layouts,
            &self.options.time_column,
        )?;
        let width = self.layouts.versions.width();
        let bits = self.manifest.partition_bits;
        let watermark = self.watermark_us;
        let mut emit = Vec::with_capacity(winners.len());
        for row in 0..winners.len() {
            let hash = winners.hashes[row];
            let version = winners.version(row);
            let time = winners.times[row];
            let is_delete = winners.tombstones[row];
            let at = self.entries.find(hash);
            let known = at.map(|at| Known {
                version: self.entries.version(at),
                deleted: self.entries.deleted[at],
                time: self.entries.times[at],
            });
            let verdict = judge(known, version, is_delete, time, watermark);
            if known.is_none() && matches!(verdict, Verdict::New | Verdict::DeleteRecorded) {
                // Only rows of recent event time: a late row is a replay of an old event,
                // counted as late; a key that comes back with a new time was re-sent by
                // its producer.
                if self.filters.is_empty() && !self.manifest.evicted.is_empty() {
                    self.filters = load_filters(&self.dir, &self.manifest)?;
                }
                if self.filters.iter().any(|f| f.contains(hash)) {
                    self.report.evicted_then_seen += 1;
                }
            }
            if verdict.records() {
                let time = Verdict::event_time(known, time);
                match at {
                    Some(at) => {
                        let start = at * width;
                        self.entries.versions[start..start + width].copy_from_slice(version);
                        self.entries.times[at] = time;
                        self.entries.deleted[at] = is_delete;
                    }
                    None => self.entries.insert(hash, version, time, is_delete),
                }
                self.entries.touched[partition_of(hash, bits)] = true;
            }
            emit.push(self.report.count(verdict, self.options.late, || {
                late_error(path, time, watermark)
            })?);
        }
        Ok(emit)
    }

    /// Writes the next state's files (the output is not committed yet): partitions that
    /// changed or lose expired entries get a new file, the others keep theirs.
    ///
    /// # Errors
    /// A state file that cannot be written.
    pub(crate) fn stage(mut self) -> Result<StagedFiles> {
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
        Ok(StagedFiles {
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
pub(crate) struct StagedFiles {
    dir: RemoteLocation,
    previous: Manifest,
    next: Manifest,
    fingerprint: String,
    written: Vec<String>,
    report: StateReport,
    options: StateOptions,
}

impl StagedFiles {
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
}
