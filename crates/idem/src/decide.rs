//! Pass 1 of a dedup: which row of every key wins, in memory or — under a memory limit —
//! one key partition at a time.
//!
//! ```text
//!  in memory   files (key, version, op) ──▶ KeepMaxTable ──▶ keep positions, tie rows
//!
//!  partitioned (the table would outgrow its budget)
//!    files (key, version, op) + position ──route by key hash──▶ P spill files (Arrow IPC)
//!    for each spill file: KeepMaxTable::update_at ──▶ sorted keep / tie runs on disk
//!    pass 2 merges the runs file by file, so no list of all winners is ever in memory
//! ```
//!
//! The in-memory attempt runs first; if its table outgrows the budget, the partition
//! count comes from the table's measured bytes per row, with headroom, and pass 1 starts
//! over partitioned. Both paths decide exactly the same rows (a key lives in one
//! partition, and positions are the rows' original ones), so the output is the same.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::sync_channel;

use arrow::array::{RecordBatch, UInt32Array, UInt64Array};
use arrow::compute::take_record_batch;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow::ipc::CompressionType;
use arrow::ipc::reader::StreamReader;
use arrow::ipc::writer::{IpcWriteOptions, StreamWriter};
use idem_core::key::KeyRouter;
use idem_core::{DedupSpec, DedupStats, KeepMaxTable, PreparedRows, Resolution, TieRow};

use crate::dedup::{DECODE_GAPS_BELOW, FilePlan, Progress, pipeline};
use crate::error::{Error, Result};
use crate::input::InputFile;
use crate::schema::conform;

/// Share of `--memory-limit` the keep-max table may use: the rest is for decoding,
/// encoding and the table's own growth (a vector that doubles briefly holds both copies).
const TABLE_SHARE: f64 = 0.5;
/// Partitions get this much headroom over the measured bytes per row.
const PARTITION_HEADROOM: f64 = 1.25;
/// Spill files are written through buffers of this size.
const SPILL_BUFFER: usize = 256 * 1024;
/// Name of the position column in spill files.
const POSITION: &str = "__idem_position";

/// What pass 1 decided.
pub(crate) struct Decision {
    pub selection: Selection,
    pub tie_groups: u32,
    pub stats: DedupStats,
    /// Bytes held by the largest keep-max table.
    pub table_bytes: u64,
    /// Key partitions pass 1 ran in (1: in memory).
    pub partitions: u32,
}

/// Decides every key's winner for `files`, within `memory_limit` bytes if given.
pub(crate) fn decide(
    spec: &DedupSpec,
    files: &[InputFile],
    schema: &SchemaRef,
    memory_limit: Option<u64>,
    progress: &dyn Progress,
) -> Result<Decision> {
    let budget = memory_limit.map(|limit| (limit as f64 * TABLE_SHARE) as usize);
    let decision_schema = Arc::new(
        schema
            .project(&decision_columns(spec, schema))
            .map_err(Error::arrow(first_path(files)))?,
    );
    let total_rows: u64 = files.iter().map(InputFile::num_rows).sum();
    progress.phase("deciding", total_rows);
    let bytes_per_row =
        match decide_in_memory(spec, files, schema, &decision_schema, budget, progress)? {
            InMemory::Decided(decision) => return Ok(decision),
            InMemory::Overflow { bytes_per_row } => bytes_per_row,
        };
    let budget = budget.unwrap_or(usize::MAX);
    let needed = bytes_per_row * total_rows as f64 * PARTITION_HEADROOM;
    let partitions = ((needed / budget.max(1) as f64).ceil() as u32).max(2);
    decide_partitioned(spec, files, &decision_schema, partitions, progress)
}

/// How the in-memory attempt at pass 1 ended.
enum InMemory {
    Decided(Decision),
    /// The tables outgrew the budget, at this many bytes per row read.
    Overflow {
        bytes_per_row: f64,
    },
}

/// Batches of decision columns in flight between pass 1's threads. They are small (tens
/// of bytes a row), and three threads sharing two cores stall each other less with a deep
/// queue: 16 instead of 4 cut 10M's pass 1 by 6 % (1.34 s to 1.25 s, medians of three).
const DECISION_DEPTH: usize = 16;

/// Pass 1 in memory, the keys split by hash between two tables on two threads: probing a
/// table of millions of keys is memory-bound and was most of pass 1's time on one thread.
/// Each table sees its rows in input order with their original positions, so the winners,
/// ties and counts are exactly those of one table.
fn decide_in_memory(
    spec: &DedupSpec,
    files: &[InputFile],
    schema: &SchemaRef,
    decision_schema: &SchemaRef,
    budget: Option<usize>,
    progress: &dyn Progress,
) -> Result<InMemory> {
    let first = first_path(files);
    let mut table = KeepMaxTable::try_new(schema, spec).map_err(Error::arrow(first))?;
    let helper_table = KeepMaxTable::try_new(schema, spec).map_err(Error::arrow(first))?;
    let preparer = table.preparer();
    let helper_bytes = AtomicUsize::new(0);
    let overflowed = AtomicBool::new(false);
    let (outcome, own, helper) = std::thread::scope(|scope| {
        let (send, receive) = sync_channel::<(PreparedRows, PathBuf)>(DECISION_DEPTH);
        let helper_bytes = &helper_bytes;
        let overflowed = &overflowed;
        let helper = scope.spawn(move || -> Result<Option<(usize, Resolution)>> {
            let mut table = helper_table;
            for (rows, path) in receive {
                table.update_prepared(&rows).map_err(Error::arrow(&path))?;
                helper_bytes.store(table.size(), Ordering::Relaxed);
            }
            // Each thread resolves (and sorts) its own table's winners, at the same time.
            if overflowed.load(Ordering::SeqCst) {
                return Ok(None);
            }
            Ok(Some((table.size(), table.finish())))
        });
        // Encoding, hashing and splitting run on the decoding thread, once per row, so
        // that this thread and the helper only probe their tables.
        let mut next_position = 0u64;
        let mut prepared = PreparedRows::default();
        let split = move |path: &Path, batch: RecordBatch| {
            let first = next_position;
            preparer
                .prepare_into(&batch, |row| first + row as u64, &mut prepared)
                .map_err(Error::arrow(path))?;
            next_position += batch.num_rows() as u64;
            let [mine, theirs]: [PreparedRows; 2] = prepared.split(2).try_into().map_err(|_| {
                Error::InvalidArgument("a batch split into other than two parts".to_owned())
            })?;
            send.send((theirs, path.to_path_buf()))
                .map_err(|_| Error::InvalidArgument("the second key table stopped".to_owned()))?;
            Ok((mine, batch.num_rows() as u64))
        };
        let mut rows_read = 0u64;
        let mut overflow = None;
        let outcome = read_decision_columns(files, decision_schema, split, |path, (mine, rows)| {
            table.update_prepared(&mine).map_err(Error::arrow(path))?;
            rows_read += rows;
            progress.advance(rows);
            let size = table.size() + helper_bytes.load(Ordering::Relaxed);
            if budget.is_some_and(|b| size > b) {
                overflow = Some(size as f64 / rows_read.max(1) as f64);
                overflowed.store(true, Ordering::SeqCst);
                return Ok(ControlFlow::Break(()));
            }
            Ok(ControlFlow::Continue(()))
        });
        let own = match (&outcome, overflow) {
            (Ok(()), None) => Some((table.size(), table.finish())),
            _ => None,
        };
        let helper = helper.join().unwrap_or_else(|_| {
            Err(Error::InvalidArgument(
                "the second key table's thread panicked".to_owned(),
            ))
        });
        (outcome.map(|()| overflow), own, helper)
    });
    // The helper's own error explains a stop better than the main thread's view of it.
    let helper = helper?;
    let overflow = outcome?;
    if let Some(bytes_per_row) = overflow {
        return Ok(InMemory::Overflow { bytes_per_row });
    }
    let stopped = || Error::InvalidArgument("a key table stopped before the end".to_owned());
    let ((own_bytes, one), (helper_bytes, two)) =
        (own.ok_or_else(stopped)?, helper.ok_or_else(stopped)?);
    let table_bytes = (own_bytes + helper_bytes) as u64;
    let mut stats = one.stats;
    stats += two.stats;
    let tie_groups = one.tie_groups + two.tie_groups;
    let keep = merge_sorted(one.keep, two.keep, |&p| p);
    let offset = one.tie_groups;
    let ties = merge_sorted(
        one.tie_rows,
        two.tie_rows
            .into_iter()
            .map(|t| TieRow {
                position: t.position,
                group: t.group + offset,
            })
            .collect(),
        |t| t.position,
    );
    Ok(InMemory::Decided(Decision {
        selection: Selection::InMemory { keep, ties },
        tie_groups,
        stats,
        table_bytes,
        partitions: 1,
    }))
}

/// Merges two lists ascending by `position` into one.
fn merge_sorted<T>(one: Vec<T>, two: Vec<T>, position: impl Fn(&T) -> u64) -> Vec<T> {
    let mut merged = Vec::with_capacity(one.len() + two.len());
    let mut two = two.into_iter().peekable();
    for item in one {
        while let Some(next) = two.next_if(|t| position(t) < position(&item)) {
            merged.push(next);
        }
        merged.push(item);
    }
    merged.extend(two);
    merged
}

fn first_path(files: &[InputFile]) -> &Path {
    files.first().map_or(Path::new(""), InputFile::path)
}

/// The columns pass 1 reads, each once, in schema order.
fn decision_columns(spec: &DedupSpec, schema: &SchemaRef) -> Vec<usize> {
    let mut indices: Vec<usize> = spec
        .decision_columns()
        .filter_map(|c| schema.index_of(c).ok())
        .collect();
    indices.sort_unstable();
    indices.dedup();
    indices
}

/// Streams the decision columns of every file, in input order, through `prepare` on a
/// second thread (with the decoding) into `consume` on this one.
fn read_decision_columns<T: Send>(
    files: &[InputFile],
    decision_schema: &SchemaRef,
    mut prepare: impl FnMut(&Path, RecordBatch) -> Result<T> + Send,
    mut consume: impl FnMut(&Path, T) -> Result<ControlFlow<()>>,
) -> Result<()> {
    let names: Vec<&str> = decision_schema
        .fields()
        .iter()
        .map(|f| f.name().as_str())
        .collect();
    pipeline(
        DECISION_DEPTH,
        |send| {
            for file in files {
                let batches = match file.read_columns(&names) {
                    Ok(batches) => batches,
                    Err(e) => {
                        send(Err(e));
                        return;
                    }
                };
                for batch in batches {
                    let item = batch
                        .and_then(|b| conform(&b, decision_schema, true, file.path()))
                        .and_then(|b| prepare(file.path(), b));
                    if !send(item.map(|b| (file.path(), b))) {
                        return;
                    }
                }
            }
        },
        |(path, batch)| consume(path, batch),
    )
}

/// Pass 1 in `partitions` key partitions through spill files in a temporary directory.
fn decide_partitioned(
    spec: &DedupSpec,
    files: &[InputFile],
    decision_schema: &SchemaRef,
    partitions: u32,
    progress: &dyn Progress,
) -> Result<Decision> {
    let dir = tempfile::Builder::new()
        .prefix("idem-spill-")
        .tempdir()
        .map_err(Error::io(std::env::temp_dir()))?;
    let spill_schema = {
        let mut fields: Vec<Field> = decision_schema
            .fields()
            .iter()
            .map(|f| f.as_ref().clone())
            .collect();
        fields.push(Field::new(POSITION, DataType::UInt64, false));
        Arc::new(Schema::new(fields))
    };
    let spill_paths: Vec<PathBuf> = (0..partitions)
        .map(|p| dir.path().join(format!("keys-{p:04}.arrow")))
        .collect();

    // Route every row's decision columns and position to its key partition.
    let total_rows: u64 = files.iter().map(InputFile::num_rows).sum();
    progress.phase("spilling", total_rows);
    let options = IpcWriteOptions::default()
        .try_with_compression(Some(CompressionType::LZ4_FRAME))
        .map_err(Error::arrow(dir.path()))?;
    let mut writers = spill_paths
        .iter()
        .map(|path| {
            let file = File::create(path).map_err(Error::io(path))?;
            StreamWriter::try_new_with_options(
                BufWriter::with_capacity(SPILL_BUFFER, file),
                &spill_schema,
                options.clone(),
            )
            .map_err(Error::arrow(path))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut router =
        KeyRouter::try_new(decision_schema, &spec.keys).map_err(Error::arrow(first_path(files)))?;
    let mut routes = Vec::new();
    let mut next_position = 0u64;
    read_decision_columns(
        files,
        decision_schema,
        |_, batch| Ok(batch),
        |path, batch| {
            router
                .route(&batch, partitions, &mut routes)
                .map_err(Error::arrow(path))?;
            let mut columns = batch.columns().to_vec();
            let n = batch.num_rows() as u64;
            columns.push(Arc::new(UInt64Array::from_iter_values(
                next_position..next_position + n,
            )));
            next_position += n;
            let positioned = RecordBatch::try_new(Arc::clone(&spill_schema), columns)
                .map_err(Error::arrow(path))?;
            let mut rows_of: Vec<Vec<u32>> = vec![Vec::new(); partitions as usize];
            for (row, &p) in routes.iter().enumerate() {
                rows_of[p as usize].push(row as u32);
            }
            for ((rows, writer), spill) in rows_of.into_iter().zip(&mut writers).zip(&spill_paths) {
                if !rows.is_empty() {
                    let part = take_record_batch(&positioned, &UInt32Array::from(rows))
                        .map_err(Error::arrow(spill))?;
                    writer.write(&part).map_err(Error::arrow(spill))?;
                }
            }
            progress.advance(n);
            Ok(ControlFlow::Continue(()))
        },
    )?;
    for (mut writer, path) in writers.into_iter().zip(&spill_paths) {
        writer.finish().map_err(Error::arrow(path))?;
        writer
            .into_inner()
            .and_then(|mut w| w.flush().map_err(Into::into))
            .map_err(Error::arrow(path))?;
    }

    // Decide each partition on its own; keep its sorted winners and tie rows on disk.
    progress.phase("deciding", total_rows);
    let full_schema = Arc::clone(decision_schema);
    let mut stats = DedupStats::default();
    let mut tie_groups = 0u32;
    let mut table_bytes = 0u64;
    let mut keep_runs = Vec::new();
    let mut tie_runs = Vec::new();
    for (p, spill) in spill_paths.iter().enumerate() {
        let mut table = KeepMaxTable::try_new(&full_schema, spec).map_err(Error::arrow(spill))?;
        let file = File::open(spill).map_err(Error::io(spill))?;
        let reader = StreamReader::try_new(BufReader::with_capacity(SPILL_BUFFER, file), None)
            .map_err(Error::arrow(spill))?;
        for batch in reader {
            let batch = batch.map_err(Error::arrow(spill))?;
            let positions = batch
                .column_by_name(POSITION)
                .and_then(|c| c.as_any().downcast_ref::<UInt64Array>())
                .ok_or_else(|| {
                    Error::InvalidArgument(format!("{}: no position column", spill.display()))
                })?;
            table
                .update_at(&batch, positions)
                .map_err(Error::arrow(spill))?;
            progress.advance(batch.num_rows() as u64);
        }
        table_bytes = table_bytes.max(table.size() as u64);
        let resolution = table.finish();
        std::fs::remove_file(spill).map_err(Error::io(spill))?;
        let keep_path = dir.path().join(format!("keep-{p:04}.bin"));
        write_run(&keep_path, resolution.keep.iter().map(|&k| (k, 0)))?;
        keep_runs.push(keep_path);
        let tie_path = dir.path().join(format!("ties-{p:04}.bin"));
        write_run(
            &tie_path,
            resolution
                .tie_rows
                .iter()
                .map(|t| (t.position, t.group + tie_groups)),
        )?;
        tie_runs.push(tie_path);
        tie_groups += resolution.tie_groups;
        stats += resolution.stats;
    }
    Ok(Decision {
        selection: Selection::Spilled {
            keep: keep_runs
                .iter()
                .map(|p| Run::open(p))
                .collect::<Result<_>>()?,
            ties: tie_runs
                .iter()
                .map(|p| Run::open(p))
                .collect::<Result<_>>()?,
            _dir: dir,
        },
        tie_groups,
        stats,
        table_bytes,
        partitions,
    })
}

/// Writes ascending `(position, group)` records, 12 bytes each.
fn write_run(path: &Path, records: impl Iterator<Item = (u64, u32)>) -> Result<()> {
    let file = File::create(path).map_err(Error::io(path))?;
    let mut out = BufWriter::with_capacity(SPILL_BUFFER, file);
    for (position, group) in records {
        out.write_all(&position.to_le_bytes())
            .and_then(|()| out.write_all(&group.to_le_bytes()))
            .map_err(Error::io(path))?;
    }
    out.flush().map_err(Error::io(path))
}

/// A sorted run of `(position, group)` records on disk, read front to back.
pub(crate) struct Run {
    path: PathBuf,
    reader: BufReader<File>,
    head: Option<(u64, u32)>,
}

impl Run {
    fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(Error::io(path))?;
        let mut run = Self {
            path: path.to_path_buf(),
            reader: BufReader::with_capacity(SPILL_BUFFER, file),
            head: None,
        };
        run.advance()?;
        Ok(run)
    }

    fn advance(&mut self) -> Result<()> {
        let mut record = [0u8; 12];
        self.head = match self.reader.read_exact(&mut record) {
            Ok(()) => {
                let (position, group) = record.split_at(8);
                let position = u64::from_le_bytes(position.try_into().unwrap_or_default());
                let group = u32::from_le_bytes(group.try_into().unwrap_or_default());
                Some((position, group))
            }
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => None,
            Err(e) => return Err(Error::io(&self.path)(e)),
        };
        Ok(())
    }

    /// Appends every record with a position below `end` to `out`.
    fn take_below(&mut self, end: u64, out: &mut Vec<(u64, u32)>) -> Result<()> {
        while let Some(record) = self.head.filter(|(position, _)| *position < end) {
            out.push(record);
            self.advance()?;
        }
        Ok(())
    }
}

/// The rows pass 2 fetches: winners and tie rows, by position.
pub(crate) enum Selection {
    /// Sorted lists.
    InMemory { keep: Vec<u64>, ties: Vec<TieRow> },
    /// One sorted run per key partition, merged as pass 2 moves through the files.
    Spilled {
        keep: Vec<Run>,
        ties: Vec<Run>,
        /// Removes the runs when the job ends, whatever way it ends.
        _dir: tempfile::TempDir,
    },
}

impl Selection {
    /// The plan for the file holding positions `start..end`; files must be asked for in
    /// input order.
    pub(crate) fn plan(&mut self, start: u64, end: u64) -> Result<FilePlan> {
        // Both of pass 2's readers want the short gaps read (see `DECODE_GAPS_BELOW`).
        self.exact_plan(start, end)
            .map(|plan| plan.with_short_gaps_read(DECODE_GAPS_BELOW))
    }

    /// The winners and tied rows at positions `start..end`, and nothing else.
    fn exact_plan(&mut self, start: u64, end: u64) -> Result<FilePlan> {
        match self {
            Self::InMemory { keep, ties } => {
                let keep = {
                    let lo = keep.partition_point(|&p| p < start);
                    let hi = keep.partition_point(|&p| p < end);
                    &keep[lo..hi]
                };
                let ties = {
                    let lo = ties.partition_point(|t| t.position < start);
                    let hi = ties.partition_point(|t| t.position < end);
                    &ties[lo..hi]
                };
                Ok(FilePlan::from_sorted(keep, ties, start))
            }
            Self::Spilled { keep, ties, .. } => {
                let mut kept = Vec::new();
                for run in keep.iter_mut() {
                    run.take_below(end, &mut kept)?;
                }
                let mut tied = Vec::new();
                for run in ties.iter_mut() {
                    run.take_below(end, &mut tied)?;
                }
                let mut kept: Vec<u64> = kept.into_iter().map(|(p, _)| p).collect();
                kept.sort_unstable();
                let mut tied: Vec<TieRow> = tied
                    .into_iter()
                    .map(|(position, group)| TieRow { position, group })
                    .collect();
                tied.sort_unstable_by_key(|t| t.position);
                Ok(FilePlan::from_sorted(&kept, &tied, start))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_sorted_lists_merge_by_position() {
        let merged = merge_sorted(vec![1u64, 4, 5, 9], vec![0, 2, 3, 10, 11], |&p| p);
        assert_eq!(merged, vec![0, 1, 2, 3, 4, 5, 9, 10, 11]);
        assert_eq!(merge_sorted(Vec::new(), vec![7u64], |&p| p), vec![7]);
        assert_eq!(merge_sorted(vec![7u64], Vec::new(), |&p| p), vec![7]);
    }
}
