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
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};

use arrow::array::{BooleanBufferBuilder, RecordBatch, UInt32Array, UInt64Array};
use arrow::compute::take_record_batch;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow::ipc::CompressionType;
use arrow::ipc::reader::StreamReader;
use arrow::ipc::writer::{IpcWriteOptions, StreamWriter};
use idem_core::key::KeyRouter;
use idem_core::{
    DedupSpec, DedupStats, KeepMaxTable, PositionBits, PreparedRows, Resolution, RowPreparer,
    TieRow,
};

use super::pipeline::pipeline;
use super::plan::{DECODE_GAPS_BELOW, FilePlan};
use crate::error::{Error, Result};
use crate::progress::Progress;
use crate::read::input::{FilePiece, InputFile};
use crate::read::schema::conform;

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

/// Batches in flight between pass 1's threads: prepared halves on their way to the other
/// worker's table, or decision columns on their way to be spilled. They are small (tens
/// of bytes a row), and a deep queue lets a thread that is briefly ahead keep going.
const DECISION_DEPTH: usize = 16;

/// Pass 1 in memory, on two workers that each own a table holding half of the keys (split
/// by hash): probing a table of millions of keys is memory-bound and was most of pass 1's
/// time on one thread.
///
/// The workers take the files' pieces (Parquet row groups) in turn from a shared counter
/// and each does everything for its piece: decode, encode and hash the keys, probe its
/// own table with its half, and queue the other half for the other worker, whose queue it
/// drains between batches. Both cores thus do the same kind of work, where a decoding
/// thread feeding two table threads left them waiting on each other.
///
/// Rows reach a table in no particular order, with their original positions; a table's
/// outcome does not depend on the order (ties are decided by position), so the winners,
/// ties and counts are exactly those of one table fed in input order.
fn decide_in_memory(
    spec: &DedupSpec,
    files: &[InputFile],
    schema: &SchemaRef,
    decision_schema: &SchemaRef,
    budget: Option<usize>,
    progress: &dyn Progress,
) -> Result<InMemory> {
    let first = first_path(files);
    let mut tables = [
        KeepMaxTable::try_new(schema, spec).map_err(Error::arrow(first))?,
        KeepMaxTable::try_new(schema, spec).map_err(Error::arrow(first))?,
    ];
    let rows: u64 = files.iter().map(InputFile::num_rows).sum();
    if budget.is_none() {
        // Each table takes half the keys (split by hash). Under a budget the tables grow
        // as they go, so that their size measures the keys seen, not the room made.
        for table in &mut tables {
            table.expect_rows(rows.div_ceil(2));
        }
    }
    let shared = Workers {
        preparer: tables[0].preparer(),
        positions: rows,
        pieces: pieces(files),
        next_piece: AtomicUsize::new(0),
        names: column_names(decision_schema),
        decision_schema,
        table_bytes: [AtomicUsize::new(0), AtomicUsize::new(0)],
        rows_read: AtomicU64::new(0),
        budget,
        stop: AtomicBool::new(false),
        overflowed: AtomicBool::new(false),
        progress,
    };
    let [own_table, other_table] = tables;
    let (own, other) = std::thread::scope(|scope| {
        let (to_own, own_inbox) = sync_channel::<Half<'_>>(DECISION_DEPTH);
        let (to_other, other_inbox) = sync_channel::<Half<'_>>(DECISION_DEPTH);
        let shared = &shared;
        let other = scope.spawn(move || shared.run(1, other_table, &other_inbox, to_own));
        let own = shared.run(0, own_table, &own_inbox, to_other);
        let other = other.join().unwrap_or_else(|_| {
            Err(Error::InvalidArgument(
                "the second key table's thread panicked".to_owned(),
            ))
        });
        (own, other)
    });
    // A worker that stopped because the other failed returns `Stopped`, not an error, so
    // the error seen here is the one that explains the stop.
    let (own, other) = (own?, other?);
    if shared.overflowed.load(Ordering::SeqCst) {
        let bytes: usize = shared
            .table_bytes
            .iter()
            .map(|b| b.load(Ordering::SeqCst))
            .sum();
        let rows = shared.rows_read.load(Ordering::SeqCst).max(1);
        return Ok(InMemory::Overflow {
            bytes_per_row: bytes as f64 / rows as f64,
        });
    }
    let (
        Finished::Decided {
            bytes: own_bytes,
            resolution: one,
            mut keep,
        },
        Finished::Decided {
            bytes: other_bytes,
            resolution: two,
            keep: other_keep,
        },
    ) = (own, other)
    else {
        return Err(Error::InvalidArgument(
            "a key table stopped before the end".to_owned(),
        ));
    };
    let table_bytes = (own_bytes + other_bytes) as u64;
    let mut stats = one.stats;
    stats += two.stats;
    let tie_groups = one.tie_groups + two.tie_groups;
    keep.union_with(&other_keep);
    // Each table numbers its tie groups from 0: the second's follow the first's.
    let mut second_ties = two.tie_rows;
    for tie in &mut second_ties {
        tie.group += one.tie_groups;
    }
    Ok(InMemory::Decided(Decision {
        selection: Selection::InMemory {
            keep,
            ties: [one.tie_rows, second_ties],
        },
        tie_groups,
        stats,
        table_bytes,
        partitions: 1,
    }))
}

/// One file's piece with the input position of its first row.
struct Piece<'a> {
    file: &'a InputFile,
    piece: FilePiece,
    first_position: u64,
}

/// Every file's pieces, largest first: the workers take them in this order, and small
/// pieces at the end even out when the two finish.
fn pieces(files: &[InputFile]) -> Vec<Piece<'_>> {
    let mut start = 0u64;
    let mut pieces = Vec::new();
    for file in files {
        pieces.extend(file.pieces().into_iter().map(|piece| Piece {
            file,
            piece,
            first_position: start + piece.first_row,
        }));
        start += file.num_rows();
    }
    pieces.sort_by_key(|p| std::cmp::Reverse(p.piece.rows));
    pieces
}

/// The rows of a batch that belong to the other worker's table, with their file.
type Half<'a> = (PreparedRows, &'a Path);

/// How a worker of [`decide_in_memory`] ended without an error.
enum Finished {
    /// Its table's outcome, the bytes the table held, and the positions its table keeps.
    Decided {
        bytes: usize,
        resolution: Resolution<()>,
        keep: PositionBits,
    },
    /// It stopped early: the tables outgrew the budget, or the other worker failed.
    Stopped,
}

/// What the two workers of [`decide_in_memory`] share.
struct Workers<'a> {
    preparer: RowPreparer,
    /// Rows in all files: the range of the positions.
    positions: u64,
    pieces: Vec<Piece<'a>>,
    next_piece: AtomicUsize,
    names: Vec<&'a str>,
    decision_schema: &'a SchemaRef,
    /// Each worker's table's latest size.
    table_bytes: [AtomicUsize; 2],
    rows_read: AtomicU64,
    budget: Option<usize>,
    /// Set by a worker that stops early, for any reason.
    stop: AtomicBool,
    /// Set when the tables outgrew the budget.
    overflowed: AtomicBool,
    progress: &'a dyn Progress,
}

impl<'a> Workers<'a> {
    /// Worker `index`: its own pieces, then the other's halves until the other is done.
    /// The queues belong to the caller so that `stop` is set before they close: the other
    /// worker, finding a queue closed, then knows that it was stopped, not failed.
    fn run(
        &self,
        index: usize,
        mut table: KeepMaxTable,
        inbox: &Receiver<Half<'a>>,
        outbox: SyncSender<Half<'a>>,
    ) -> Result<Finished> {
        let read_all = self.read_pieces(index, &mut table, inbox, &outbox);
        if !matches!(read_all, Ok(true)) {
            self.stop.store(true, Ordering::SeqCst);
        }
        // Closing this side lets the other worker finish once it has drained its queue.
        drop(outbox);
        let outcome = match read_all {
            Ok(true) => self.finish(index, table, inbox),
            Ok(false) => Ok(Finished::Stopped),
            Err(e) => Err(e),
        };
        if !matches!(outcome, Ok(Finished::Decided { .. })) {
            self.stop.store(true, Ordering::SeqCst);
        }
        outcome
    }

    /// Takes pieces until none is left (true) or the workers stop (false).
    fn read_pieces(
        &self,
        index: usize,
        table: &mut KeepMaxTable,
        inbox: &Receiver<Half<'a>>,
        outbox: &SyncSender<Half<'a>>,
    ) -> Result<bool> {
        let mut prepared = PreparedRows::default();
        while let Some(piece) = self
            .pieces
            .get(self.next_piece.fetch_add(1, Ordering::SeqCst))
        {
            let path = piece.file.path();
            let mut position = piece.first_position;
            for batch in piece.file.read_piece_columns(&self.names, piece.piece)? {
                if self.stop.load(Ordering::Relaxed) {
                    return Ok(false);
                }
                let batch = conform(&batch?, self.decision_schema, true, path)?;
                let first = position;
                self.preparer
                    .prepare_into(&batch, |row| first + row as u64, &mut prepared)
                    .map_err(Error::arrow(path))?;
                let rows = batch.num_rows() as u64;
                position += rows;
                let [first_half, second_half]: [PreparedRows; 2] =
                    prepared.split(2).try_into().map_err(|_| {
                        Error::InvalidArgument("a batch split into other than two parts".to_owned())
                    })?;
                // Worker `index` owns the keys of part `index`.
                let (mine, theirs) = if index == 0 {
                    (first_half, second_half)
                } else {
                    (second_half, first_half)
                };
                table.update_prepared(&mine).map_err(Error::arrow(path))?;
                if !self.hand_over(table, inbox, outbox, (theirs, path))? {
                    return Ok(false);
                }
                while let Ok((rows, path)) = inbox.try_recv() {
                    table.update_prepared(&rows).map_err(Error::arrow(path))?;
                }
                self.progress.advance(rows);
                if self.outgrown(index, table, rows) {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// Takes the other worker's halves until it is done, then resolves the table.
    fn finish(
        &self,
        index: usize,
        mut table: KeepMaxTable,
        inbox: &Receiver<Half<'a>>,
    ) -> Result<Finished> {
        for (rows, path) in inbox {
            table.update_prepared(&rows).map_err(Error::arrow(path))?;
        }
        if self.stop.load(Ordering::SeqCst) || self.outgrown(index, &table, 0) {
            return Ok(Finished::Stopped);
        }
        let bytes = table.size();
        let mut keep = PositionBits::with_capacity(self.positions);
        let resolution = table.finish_marking(&mut keep);
        Ok(Finished::Decided {
            bytes,
            resolution,
            keep,
        })
    }

    /// Queues `half` for the other worker without ever blocking on it: while its queue is
    /// full, this worker takes from its own, so that two workers waiting on each other's
    /// full queues cannot stall. False when the other worker has stopped.
    fn hand_over(
        &self,
        table: &mut KeepMaxTable,
        inbox: &Receiver<Half<'a>>,
        outbox: &SyncSender<Half<'a>>,
        half: Half<'a>,
    ) -> Result<bool> {
        let mut half = half;
        loop {
            match outbox.try_send(half) {
                Ok(()) => return Ok(true),
                Err(TrySendError::Disconnected(_)) => {
                    if self.stop.load(Ordering::SeqCst) {
                        return Ok(false);
                    }
                    return Err(Error::InvalidArgument(
                        "the second key table stopped".to_owned(),
                    ));
                }
                Err(TrySendError::Full(_)) if self.stop.load(Ordering::SeqCst) => {
                    return Ok(false);
                }
                Err(TrySendError::Full(back)) => {
                    half = back;
                    match inbox.try_recv() {
                        Ok((rows, path)) => {
                            table.update_prepared(&rows).map_err(Error::arrow(path))?;
                        }
                        Err(_) => std::thread::yield_now(),
                    }
                }
            }
        }
    }

    /// Records this worker's table size and `rows` more read; true (and both workers
    /// told to stop) once the two tables together outgrow the budget.
    fn outgrown(&self, index: usize, table: &KeepMaxTable, rows: u64) -> bool {
        self.table_bytes[index].store(table.size(), Ordering::SeqCst);
        self.rows_read.fetch_add(rows, Ordering::SeqCst);
        let Some(budget) = self.budget else {
            return false;
        };
        let size: usize = self
            .table_bytes
            .iter()
            .map(|b| b.load(Ordering::SeqCst))
            .sum();
        if size > budget {
            self.overflowed.store(true, Ordering::SeqCst);
            self.stop.store(true, Ordering::SeqCst);
            return true;
        }
        false
    }
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

/// Streams the decision columns of every file, in input order, decoded on a second
/// thread, into `consume` on this one.
fn read_decision_columns(
    files: &[InputFile],
    decision_schema: &SchemaRef,
    mut consume: impl FnMut(&Path, RecordBatch) -> Result<ControlFlow<()>>,
) -> Result<()> {
    let names = column_names(decision_schema);
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
                    let item = batch.and_then(|b| conform(&b, decision_schema, true, file.path()));
                    if !send(item.map(|b| (file.path(), b))) {
                        return;
                    }
                }
            }
        },
        |(path, batch)| consume(path, batch),
    )
}

fn column_names(schema: &SchemaRef) -> Vec<&str> {
    schema.fields().iter().map(|f| f.name().as_str()).collect()
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
    read_decision_columns(files, decision_schema, |path, batch| {
        router
            .route(&batch, partitions, &mut routes)
            .map_err(Error::arrow(path))?;
        let mut columns = batch.columns().to_vec();
        let n = batch.num_rows() as u64;
        columns.push(Arc::new(UInt64Array::from_iter_values(
            next_position..next_position + n,
        )));
        next_position += n;
        let positioned =
            RecordBatch::try_new(Arc::clone(&spill_schema), columns).map_err(Error::arrow(path))?;
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
    })?;
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

/// The tie rows of an ascending list at positions `start..end`.
fn within(ties: &[TieRow], start: u64, end: u64) -> &[TieRow] {
    let lo = ties.partition_point(|t| t.position < start);
    let hi = ties.partition_point(|t| t.position < end);
    &ties[lo..hi]
}

/// Two lists of tie rows ascending by position, merged into one.
fn merge_by_position(
    one: impl Iterator<Item = TieRow>,
    two: impl Iterator<Item = TieRow>,
) -> impl Iterator<Item = TieRow> {
    let (mut one, mut two) = (one.peekable(), two.peekable());
    std::iter::from_fn(move || match (one.peek(), two.peek()) {
        (Some(a), Some(b)) if b.position < a.position => two.next(),
        (Some(_), _) => one.next(),
        (None, _) => two.next(),
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
    /// The winners as a set, and each worker's tie rows, in sorted lists (their groups
    /// numbered apart).
    InMemory {
        keep: PositionBits,
        ties: [Vec<TieRow>; 2],
    },
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
        let gaps_below = DECODE_GAPS_BELOW;
        match self {
            Self::InMemory {
                keep,
                ties: [one, two],
            } => {
                let (one, two) = (within(one, start, end), within(two, start, end));
                let ties = merge_by_position(one.iter().copied(), two.iter().copied());
                Ok(FilePlan::new(
                    &keep.range_bits(start, end),
                    ties,
                    start,
                    gaps_below,
                ))
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
                let mut bits = BooleanBufferBuilder::new((end - start) as usize);
                bits.append_n((end - start) as usize, false);
                for (position, _) in kept {
                    bits.set_bit((position - start) as usize, true);
                }
                let mut tied: Vec<TieRow> = tied
                    .into_iter()
                    .map(|(position, group)| TieRow { position, group })
                    .collect();
                tied.sort_unstable_by_key(|t| t.position);
                Ok(FilePlan::new(
                    &bits.finish(),
                    tied.into_iter(),
                    start,
                    gaps_below,
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::progress::NoProgress;
    use arrow::array::{Int64Array, StringArray};
    use idem_core::rng::SplitMix64;
    use idem_core::{DedupOptions, DeletePolicy, TiePolicy};
    use parquet::arrow::ArrowWriter;
    use parquet::file::properties::WriterProperties;
    use std::collections::BTreeMap;

    /// Files of many small row groups whose keys repeat within and across files, with
    /// ties at the maximum version, deletes and null keys.
    fn write_inputs(dir: &Path, seed: u64) -> Vec<InputFile> {
        let schema = Arc::new(Schema::new(vec![
            Field::new("event_id", DataType::Utf8, true),
            Field::new("sequence", DataType::Int64, false),
            Field::new("lsn", DataType::Int64, false),
            Field::new("op", DataType::Utf8, false),
        ]));
        let mut rng = SplitMix64::new(seed);
        (0..3)
            .map(|f| {
                let rows = 700 + rng.below(600) as usize;
                let ids: StringArray = (0..rows)
                    .map(|_| (!rng.chance(2)).then(|| format!("id-{}", rng.below(400))))
                    .collect();
                let sequences: Int64Array = (0..rows).map(|_| rng.below(2) as i64).collect();
                let lsns: Int64Array = (0..rows).map(|_| rng.below(4) as i64).collect();
                let ops: StringArray = (0..rows)
                    .map(|_| Some(if rng.chance(10) { "d" } else { "u" }))
                    .collect();
                let batch = RecordBatch::try_new(
                    Arc::clone(&schema),
                    vec![
                        Arc::new(ids),
                        Arc::new(sequences),
                        Arc::new(lsns),
                        Arc::new(ops),
                    ],
                )
                .expect("batch");
                let path = dir.join(format!("in-{f}.parquet"));
                let properties = WriterProperties::builder()
                    .set_max_row_group_row_count(Some(64 + 32 * f))
                    .build();
                let mut writer = ArrowWriter::try_new(
                    File::create(&path).expect("create"),
                    Arc::clone(&schema),
                    Some(properties),
                )
                .expect("writer");
                writer.write(&batch).expect("write");
                writer.close().expect("close");
                InputFile::open(&crate::read::input::InputSource::Local(path)).expect("open")
            })
            .collect()
    }

    /// Tie groups as sets of positions, whatever their numbers.
    fn groups_of(ties: &[TieRow]) -> Vec<Vec<u64>> {
        let mut groups: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
        for tie in ties {
            groups.entry(tie.group).or_default().push(tie.position);
        }
        let mut groups: Vec<Vec<u64>> = groups.into_values().collect();
        groups.sort();
        groups
    }

    #[test]
    fn two_workers_decide_what_one_table_in_input_order_does() {
        let dir = tempfile::tempdir().expect("tempdir");
        for seed in 0..6 {
            let files = write_inputs(dir.path(), seed);
            let schema = Arc::clone(files[0].schema());
            for on_tie in [TiePolicy::First, TiePolicy::Last] {
                let spec = DedupSpec::new(["event_id", "sequence"], ["lsn"]).with_options(
                    DedupOptions::default()
                        .with_on_tie(on_tie)
                        .with_deletes(DeletePolicy::new("op")),
                );
                let mut reference = KeepMaxTable::try_new(&schema, &spec).expect("table");
                for file in &files {
                    assert!(file.pieces().len() > 5, "several row groups");
                    for batch in file
                        .read_columns(&["event_id", "sequence", "lsn", "op"])
                        .expect("read")
                    {
                        reference.update(&batch.expect("batch")).expect("update");
                    }
                }
                let expected = reference.finish();
                let decision = decide(&spec, &files, &schema, None, &NoProgress).expect("decide");
                assert_eq!(decision.partitions, 1);
                assert_eq!(decision.stats, expected.stats, "seed {seed}");
                assert_eq!(decision.tie_groups, expected.tie_groups);
                let Selection::InMemory {
                    keep,
                    ties: [one, two],
                } = decision.selection
                else {
                    panic!("decided in memory");
                };
                let kept: Vec<u64> = keep.iter_in(0, u64::MAX).collect();
                assert_eq!(kept, expected.keep, "seed {seed}, {on_tie:?}");
                assert!(one.is_sorted_by_key(|t| t.position));
                assert!(two.is_sorted_by_key(|t| t.position));
                let ties: Vec<TieRow> =
                    merge_by_position(one.iter().copied(), two.iter().copied()).collect();
                assert!(ties.is_sorted_by_key(|t| t.position));
                assert_eq!(groups_of(&ties), groups_of(&expected.tie_rows));
            }
        }
    }
}
