//! The keep-max table: one pass over key and version columns decides every key's winner.
//!
//! Per distinct key (a dense *slot* from the [`KeyInterner`]) the table keeps only what
//! deciding needs — never the rows themselves, and 14 bytes beside the key for a 64-bit
//! version (positions take 4 bytes while the input has fewer than 4 G rows, see
//! [`WideningVec`]):
//!
//! ```text
//!   slot │ winner position │ version bytes │ flags
//!   ─────┼─────────────────┼───────────────┼──────────────────
//!     0  │ 17              │ 01 80…05      │ tied
//!     1  │ 3               │ 01 80…09      │ tombstone
//! ```
//!
//! A row with a higher version than its slot's replaces the winner (the old winner and its
//! ties become *superseded*); a lower one is superseded at once; an equal one is a *tie*,
//! resolved by [`TiePolicy`]. Ties are rare, so they live in a log of events rather than
//! in per-key counters: each tie appends the row (and, the first time, the row it ties
//! with), and a higher version arriving at a tied key appends a reset that voids the key's
//! earlier events. Positions are the rows' ordinals across all batches, so the caller can
//! fetch the winning rows afterwards (late materialisation) and emit them in input order.

use arrow::array::{Array, ArrayRef, BooleanBufferBuilder, RecordBatch, UInt64Array};
use arrow::buffer::{BooleanBuffer, NullBuffer};
use arrow::datatypes::{Field, Schema};
use arrow::error::ArrowError;

use crate::interner::{EncodedKeys, KeyInterner, NarrowInterner, RowInterner};
use crate::key::KeyLayout;
use crate::options::{DedupSpec, TiePolicy};
use crate::prefetch::prefetch_index;
use crate::stats::DedupStats;
use crate::version::VersionLayout;
use crate::widening::WideningVec;

/// A row that ties at its key's final maximum version, to be compared by content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TieRow {
    /// The row's position in the input.
    pub position: u64,
    /// Dense number of its tie group (one per key that has ties).
    pub group: u32,
}

/// A tie that still stands at the end of the input: its slot and its row's position.
#[derive(Debug, Clone, Copy)]
struct TieEvent {
    slot: u32,
    position: u64,
}

/// The ties and resets of a table, in the order they happened. Exact duplicates make an
/// event each, millions of them in a large input, so an event is a slot and a position
/// plus one kept in a [`WideningVec`] (8 bytes while positions fit 32 bits, 12 after),
/// where 0 marks a reset: a higher version voided the slot's ties so far.
#[derive(Debug, Default)]
struct TieLog {
    slots: Vec<u32>,
    positions_plus_one: WideningVec,
}

impl TieLog {
    /// Logs a tie of `slot`'s row at `position`, or a reset of `slot` for `None`.
    fn push(&mut self, slot: u32, position: Option<u64>) {
        self.slots.push(slot);
        self.positions_plus_one
            .push(position.map_or(0, |position| position + 1));
    }

    /// Bytes allocated.
    fn size(&self) -> usize {
        self.slots.capacity() * size_of::<u32>() + self.positions_plus_one.size()
    }

    /// The events from the last to the first, as a slot and the tied row's position, or
    /// `None` for a reset.
    fn for_each_rev(&self, mut f: impl FnMut(u32, Option<u64>)) {
        for (index, &slot) in self.slots.iter().enumerate().rev() {
            let stored = self.positions_plus_one.at(index);
            f(slot, stored.checked_sub(1));
        }
    }
}

/// Rows seen before [`KeepMaxTable::expect_rows`] makes room for the rest: enough for a
/// stable share of distinct keys, few enough that little growth happens before.
const RESERVE_SAMPLE_ROWS: u64 = 1 << 18;

/// How many rows ahead a slot's state is requested while a batch is consumed.
const SLOT_LOOKAHEAD: usize = 16;
/// Slot flag: the winner is a delete.
const TOMBSTONE: u8 = 1;
/// Slot flag: the current version has ties (its events are in the log).
const TIED: u8 = 2;

/// Decides, per key, which row has the maximum version. See the module docs.
#[derive(Debug)]
pub struct KeepMaxTable {
    spec: DedupSpec,
    /// Encodes batches for this table (its key and version layouts, and interner kind).
    preparer: RowPreparer,
    interner: KeyInterner,
    /// Per slot, its winner's input position.
    winner: WideningVec,
    version: Vec<u8>,
    flags: Vec<u8>,
    tie_events: TieLog,
    rows_in: u64,
    null_keys: u64,
    /// Rows this table is told it will consume in all ([`Self::expect_rows`]), until the
    /// room for their keys has been made.
    expected_rows: Option<u64>,
    scratch: Scratch,
}

#[derive(Debug, Default)]
struct Scratch {
    slots: Vec<u32>,
    prepared: PreparedRows,
}

/// Finds a column by name, with an error naming it.
pub(crate) fn field<'a>(
    schema: &'a Schema,
    name: &str,
    role: &str,
) -> Result<&'a Field, ArrowError> {
    schema
        .field_with_name(name)
        .map_err(|_| ArrowError::SchemaError(format!("{role} column '{name}' not found")))
}

fn column<'a>(batch: &'a RecordBatch, name: &str, role: &str) -> Result<&'a ArrayRef, ArrowError> {
    batch
        .column_by_name(name)
        .ok_or_else(|| ArrowError::SchemaError(format!("{role} column '{name}' not found")))
}

/// The columns `names` of `batch`, in that order (see [`column`]).
fn columns(batch: &RecordBatch, names: &[String], role: &str) -> Result<Vec<ArrayRef>, ArrowError> {
    names
        .iter()
        .map(|name| column(batch, name, role).cloned())
        .collect()
}

impl KeepMaxTable {
    /// A table for batches of `schema`, deduplicating as `spec` says.
    ///
    /// # Errors
    /// A key, version or op column missing from `schema`, or of a type that cannot serve.
    pub fn try_new(schema: &Schema, spec: &DedupSpec) -> Result<Self, ArrowError> {
        let key_fields: Vec<Field> = spec
            .keys
            .iter()
            .map(|k| field(schema, k, "key").cloned())
            .collect::<Result<_, _>>()?;
        let version_fields: Vec<Field> = spec
            .versions
            .iter()
            .map(|v| field(schema, v, "version").cloned())
            .collect::<Result<_, _>>()?;
        if let Some(deletes) = &spec.options.deletes {
            field(schema, &deletes.op_column, "op")?;
        }
        let keys = KeyLayout::try_new(&key_fields)?;
        let interner = match keys.narrow_width() {
            Some(_) => KeyInterner::Narrow(NarrowInterner::default()),
            None => KeyInterner::Rows(RowInterner::default()),
        };
        let preparer = RowPreparer {
            spec: spec.clone(),
            keys,
            versions: VersionLayout::try_new(&version_fields)?,
            narrow: interner.is_narrow(),
        };
        Ok(Self {
            spec: spec.clone(),
            preparer,
            interner,
            winner: WideningVec::default(),
            version: Vec::new(),
            flags: Vec::new(),
            tie_events: TieLog::default(),
            rows_in: 0,
            null_keys: 0,
            expected_rows: None,
            scratch: Scratch::default(),
        })
    }

    /// Uses the generic (encoded bytes) key table even where a specialised one applies;
    /// for benchmarks and tests that compare the two.
    #[must_use]
    pub fn with_generic_keys(mut self) -> Self {
        if self.interner.is_empty() {
            self.interner = KeyInterner::Rows(RowInterner::default());
            self.preparer.narrow = false;
        }
        self
    }

    /// Tells the table how many rows it will consume in all. Once it has seen a sample of
    /// them, it makes room at once for as many keys as the sample's share of distinct keys
    /// predicts, instead of doubling its way there: each doubling of a key table of
    /// millions rehashes every key into new memory, and each of a per-key vector copies it,
    /// which at 40M rows was over a third of pass 1's page faults (`benches/RESULTS.md`).
    ///
    /// The room is allocated memory, counted by [`Self::size`]; a caller that holds the
    /// table to a memory budget should let it grow as it goes instead.
    pub fn expect_rows(&mut self, rows: u64) {
        self.expected_rows = Some(rows);
    }

    /// Makes the room [`Self::expect_rows`] asks for, once enough rows have been seen to
    /// estimate how many of them will be new keys.
    fn reserve_expected_keys(&mut self) {
        let Some(expected) = self.expected_rows else {
            return;
        };
        if self.rows_in < RESERVE_SAMPLE_ROWS {
            return;
        }
        self.expected_rows = None;
        let distinct = self.interner.len() as u64;
        let remaining = expected.saturating_sub(self.rows_in);
        // The sample's share of new keys, applied to the rows still to come; an input
        // whose duplicates lie far apart is overestimated, which costs at most the room
        // of one row each, as a table sized for its rows would.
        let new_keys = (u128::from(remaining) * u128::from(distinct)
            / u128::from(self.rows_in.max(1))) as usize;
        if new_keys == 0 {
            return;
        }
        let width = self.preparer.versions.width();
        self.interner.reserve(new_keys);
        self.winner.reserve(new_keys);
        self.version.reserve(new_keys * width);
        self.flags.reserve(new_keys);
    }

    /// Rows consumed so far; the next row's position under [`Self::update`].
    pub fn rows_in(&self) -> u64 {
        self.rows_in
    }

    /// Distinct keys so far.
    pub fn distinct_keys(&self) -> usize {
        self.interner.len()
    }

    /// Bytes allocated by the table, for memory accounting.
    pub fn size(&self) -> usize {
        self.interner.size()
            + self.winner.size()
            + self.version.capacity()
            + self.flags.capacity()
            + self.tie_events.size()
    }

    /// Consumes one batch holding (at least) the key, version and op columns. Its rows
    /// take the next positions.
    ///
    /// # Errors
    /// A missing column, a column whose type changed since the first batch, or a version
    /// value that cannot be read (e.g. malformed pg_lsn text).
    pub fn update(&mut self, batch: &RecordBatch) -> Result<(), ArrowError> {
        let first = self.rows_in;
        self.consume(batch, |row| first + row as u64)
    }

    /// Consumes one batch whose rows sit at `positions` of the input: the winners and tie
    /// rows report those positions, so the rows can be fetched from the original input
    /// afterwards. Batches may come in any order (several partitions interleaved): ties go
    /// to the smallest (`first`) or greatest (`last`) position all the same.
    ///
    /// # Errors
    /// As [`Self::update`], or `positions` of another length than the batch.
    pub fn update_at(
        &mut self,
        batch: &RecordBatch,
        positions: &UInt64Array,
    ) -> Result<(), ArrowError> {
        if positions.len() != batch.num_rows() || positions.null_count() > 0 {
            return Err(ArrowError::InvalidArgumentError(format!(
                "{} positions (with {} nulls) for {} rows",
                positions.len(),
                positions.null_count(),
                batch.num_rows()
            )));
        }
        let positions = positions.values();
        self.consume(batch, |row| positions[row])
    }

    fn consume(
        &mut self,
        batch: &RecordBatch,
        position_of: impl Fn(usize) -> u64,
    ) -> Result<(), ArrowError> {
        let mut prepared = std::mem::take(&mut self.scratch.prepared);
        let outcome = self
            .preparer
            .prepare_into(batch, position_of, &mut prepared)
            .and_then(|()| self.update_prepared(&prepared));
        self.scratch.prepared = prepared;
        outcome
    }

    /// The encoder of batches for this table, to run where the table is not (on a
    /// decoding thread, say); see [`PreparedRows`].
    pub fn preparer(&self) -> RowPreparer {
        self.preparer.clone()
    }

    /// Consumes rows prepared by this table's [`Self::preparer`] (or a table's of the same
    /// spec and key kind), at the positions they were prepared with.
    ///
    /// # Errors
    /// Rows prepared for another key table (narrow against generic) or version width.
    pub fn update_prepared(&mut self, rows: &PreparedRows) -> Result<(), ArrowError> {
        let width = self.preparer.versions.width();
        if rows.keys.is_narrow() != self.interner.is_narrow() || rows.width != width {
            return Err(ArrowError::InvalidArgumentError(
                "rows prepared for another key table".to_owned(),
            ));
        }
        self.reserve_expected_keys();
        let scratch = &mut self.scratch;
        self.interner.intern_encoded(&rows.keys, &mut scratch.slots);
        self.null_keys += rows.null_keys;
        let last_wins = self.spec.options.on_tie == TiePolicy::Last;
        for (row, &slot) in scratch.slots.iter().enumerate() {
            // A key seen before has its winner, version and flags far apart in memory:
            // requested a few rows ahead, their misses overlap (see `prefetch`).
            if let Some(&ahead) = scratch.slots.get(row + SLOT_LOOKAHEAD) {
                let ahead = ahead as usize;
                self.winner.prefetch(ahead);
                prefetch_index(&self.version, ahead * width);
                prefetch_index(&self.flags, ahead);
            }
            let position = rows.positions[row];
            let incoming = &rows.versions[row * width..(row + 1) * width];
            let tombstone = if rows.tombstones[row] { TOMBSTONE } else { 0 };
            let s = slot as usize;
            if s == self.winner.len() {
                self.winner.push(position);
                append_version(&mut self.version, incoming);
                self.flags.push(tombstone);
                continue;
            }
            let current = &mut self.version[s * width..(s + 1) * width];
            match compare_versions(incoming, current) {
                // Superseded rows are counted at the end: every row not a winner or a tie.
                std::cmp::Ordering::Less => {}
                std::cmp::Ordering::Greater => {
                    copy_version(current, incoming);
                    if self.flags[s] & TIED != 0 {
                        self.tie_events.push(slot, None);
                    }
                    self.flags[s] = tombstone;
                    self.winner.set(s, position);
                }
                std::cmp::Ordering::Equal => {
                    if self.flags[s] & TIED == 0 {
                        // The row that set this version joins the tie group too.
                        self.tie_events.push(slot, Some(self.winner.at(s)));
                        self.flags[s] |= TIED;
                    }
                    self.tie_events.push(slot, Some(position));
                    // By position, not arrival: rows of several partitions may arrive
                    // interleaved, and the first (last) in input order must still win.
                    let replaces = if last_wins {
                        position > self.winner.at(s)
                    } else {
                        position < self.winner.at(s)
                    };
                    if replaces {
                        self.winner.set(s, position);
                        self.flags[s] = TIED | tombstone;
                    }
                }
            }
        }
        self.rows_in += rows.len() as u64;
        Ok(())
    }

    /// Decides the winners: the positions to emit, the tie rows to compare, and the counts.
    pub fn finish(self) -> Resolution {
        let (keep, resolution) = self.resolve();
        let mut keep = keep.into_wide();
        sort_distinct_positions(&mut keep);
        resolution.with_keep(keep)
    }

    /// [`Self::finish`] with the positions to emit added to `keep` instead of listed: for
    /// a caller that holds the winners of several tables, in one set over the input, and
    /// would otherwise sort each table's list and merge them, between the two passes with
    /// nothing else to overlap.
    pub fn finish_marking(self, keep: &mut PositionBits) -> Resolution<()> {
        let (winners, resolution) = self.resolve();
        winners.for_each(|position| keep.insert(position));
        resolution
    }

    /// The positions to emit, in slot order, and the rest of the outcome.
    fn resolve(self) -> (WideningVec, Resolution<()>) {
        let keep_tombstones = self
            .spec
            .options
            .deletes
            .as_ref()
            .is_some_and(|d| d.keep_tombstones);
        let Self {
            interner,
            mut winner,
            version,
            flags,
            tie_events,
            rows_in,
            null_keys,
            ..
        } = self;
        drop((interner, version));
        let distinct_keys = winner.len() as u64;

        // Walking the log backwards, a reset voids every earlier event of its slot.
        let mut voided = Vec::new();
        let mut current: Vec<TieEvent> = Vec::new();
        tie_events.for_each_rev(|slot, position| {
            let index = slot as usize;
            match position {
                None => {
                    if voided.is_empty() {
                        voided = vec![false; winner.len()];
                    }
                    voided[index] = true;
                }
                Some(position) if !voided.get(index).copied().unwrap_or(false) => {
                    current.push(TieEvent { slot, position });
                }
                Some(_) => {}
            }
        });
        drop(tie_events);
        current.reverse();
        let mut group_of_slot = vec![u32::MAX; if current.is_empty() { 0 } else { winner.len() }];
        let mut groups = 0u32;
        let mut tie_rows: Vec<TieRow> = current
            .iter()
            .map(|e| {
                let group = &mut group_of_slot[e.slot as usize];
                if *group == u32::MAX {
                    *group = groups;
                    groups += 1;
                }
                TieRow {
                    position: e.position,
                    group: *group,
                }
            })
            .collect();
        tie_rows.sort_unstable_by_key(|t| t.position);
        // Each group holds the winner and its duplicates.
        let duplicates = (current.len() - groups as usize) as u64;

        // The winners' vector becomes the list of positions to keep, in place.
        let (mut deleted, mut tombstones_kept) = (0, 0);
        winner.retain_indices(|slot| {
            if flags[slot] & TOMBSTONE == 0 {
                return true;
            }
            if keep_tombstones {
                tombstones_kept += 1;
            } else {
                deleted += 1;
            }
            keep_tombstones
        });
        let resolution = Resolution {
            keep: (),
            tie_rows,
            tie_groups: groups,
            stats: DedupStats {
                rows_in,
                rows_out: distinct_keys - deleted,
                duplicates,
                superseded: rows_in - distinct_keys - duplicates,
                deleted,
                conflicts: 0,
                null_keys,
                distinct_keys,
                tombstones_kept,
            },
        };
        (winner, resolution)
    }
}

/// A set of input positions, a bit each: the winners of a dedup fill a good part of the
/// input's range, so a bit per position is smaller than a list of them (one eighth of a
/// byte against eight) and yields them in order without a sort.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PositionBits {
    words: Vec<u64>,
}

impl PositionBits {
    /// An empty set, with room for positions `0..positions` (it grows beyond).
    pub fn with_capacity(positions: u64) -> Self {
        Self {
            words: vec![0; positions.div_ceil(64) as usize],
        }
    }

    /// Adds `position`.
    #[inline]
    pub fn insert(&mut self, position: u64) {
        let word = (position / 64) as usize;
        if word >= self.words.len() {
            self.words.resize(word + 1, 0);
        }
        self.words[word] |= 1 << (position % 64);
    }

    /// Whether `position` is in the set.
    pub fn contains(&self, position: u64) -> bool {
        self.words
            .get((position / 64) as usize)
            .is_some_and(|word| word & (1 << (position % 64)) != 0)
    }

    /// Adds every position of `other`.
    pub fn union_with(&mut self, other: &Self) {
        if other.words.len() > self.words.len() {
            self.words.resize(other.words.len(), 0);
        }
        for (mine, theirs) in self.words.iter_mut().zip(&other.words) {
            *mine |= theirs;
        }
    }

    /// The words covering `start..end`, each masked to the positions within it, with the
    /// position of its bit 0.
    fn words_in(&self, start: u64, end: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        let end = end.min(self.words.len() as u64 * 64);
        let (first, last) = (start / 64, end.div_ceil(64));
        (first..last.max(first)).map(move |index| {
            let base = index * 64;
            let mut word = self.words[index as usize];
            if start > base {
                word &= u64::MAX << (start - base);
            }
            if end < base + 64 {
                word &= (1u64 << (end - base)) - 1;
            }
            (base, word)
        })
    }

    /// Positions `start..end` as bits, bit `i` for position `start + i`.
    pub fn range_bits(&self, start: u64, end: u64) -> BooleanBuffer {
        let len = end.saturating_sub(start) as usize;
        let first = (start / 64) as usize;
        let words = self.words.get(first..).unwrap_or_default();
        let bytes: Vec<u8> = words
            .iter()
            .take((len + (start % 64) as usize).div_ceil(64))
            .flat_map(|word| word.to_le_bytes())
            .collect();
        let offset = (start % 64) as usize;
        let mut bits = BooleanBufferBuilder::new(len);
        // Positions past the last word were never inserted.
        let stored = (bytes.len() * 8).saturating_sub(offset).min(len);
        bits.append_packed_range(offset..offset + stored, &bytes);
        bits.append_n(len - stored, false);
        bits.finish()
    }

    /// How many positions of `start..end` are in the set.
    pub fn count_in(&self, start: u64, end: u64) -> u64 {
        self.words_in(start, end)
            .map(|(_, word)| u64::from(word.count_ones()))
            .sum()
    }

    /// The positions of `start..end` in the set, ascending.
    pub fn iter_in(&self, start: u64, end: u64) -> impl Iterator<Item = u64> + '_ {
        self.words_in(start, end).flat_map(|(base, word)| {
            let mut word = word;
            std::iter::from_fn(move || {
                (word != 0).then(|| {
                    let bit = word.trailing_zeros();
                    word &= word - 1;
                    base + u64::from(bit)
                })
            })
        })
    }
}

/// The width of the most common encoded version, one 64-bit column: its presence byte
/// and 8 bytes. The per-row helpers below handle it with fixed-size loads and stores;
/// with the width known only at run time, each comparison and copy was a call to `memcmp`
/// or `memcpy` for nine bytes.
const ONE_WORD_VERSION: usize = 9;

/// A one-word version as (presence, value), ordered as its bytes are.
#[inline]
fn one_word(version: &[u8; ONE_WORD_VERSION]) -> (u8, u64) {
    let [present, value @ ..] = *version;
    (present, u64::from_be_bytes(value))
}

/// Orders two encoded versions of the same width, as their bytes compare.
#[inline]
fn compare_versions(a: &[u8], b: &[u8]) -> std::cmp::Ordering {
    match (
        <&[u8; ONE_WORD_VERSION]>::try_from(a),
        <&[u8; ONE_WORD_VERSION]>::try_from(b),
    ) {
        (Ok(a), Ok(b)) => one_word(a).cmp(&one_word(b)),
        _ => a.cmp(b),
    }
}

/// Overwrites `current` with `incoming`, of the same width.
#[inline]
fn copy_version(current: &mut [u8], incoming: &[u8]) {
    match (
        <&mut [u8; ONE_WORD_VERSION]>::try_from(&mut *current),
        <&[u8; ONE_WORD_VERSION]>::try_from(incoming),
    ) {
        (Ok(current), Ok(incoming)) => *current = *incoming,
        _ => current.copy_from_slice(incoming),
    }
}

/// Appends an encoded version to `versions`.
#[inline]
fn append_version(versions: &mut Vec<u8>, version: &[u8]) {
    match <[u8; ONE_WORD_VERSION]>::try_from(version) {
        Ok(word) => versions.extend_from_slice(&word),
        Err(_) => versions.extend_from_slice(version),
    }
}

/// Sorts `positions`, which are distinct, ascending.
///
/// The kept positions of a dedup fill a good part of their range, so setting a bit per
/// position and reading the bits back in order is linear, where a comparison sort takes
/// ~n log n steps; this runs between the two passes, with nothing else to overlap it.
/// Positions spread too thin for a bitmap of at most 64 bits each are sorted.
fn sort_distinct_positions(positions: &mut Vec<u64>) {
    let (Some(&low), Some(&high)) = (positions.iter().min(), positions.iter().max()) else {
        return;
    };
    let span = high - low + 1;
    if span / 64 > positions.len() as u64 {
        positions.sort_unstable();
        return;
    }
    let mut bits = vec![0u64; span.div_ceil(64) as usize];
    for &position in positions.iter() {
        let offset = position - low;
        bits[(offset / 64) as usize] |= 1 << (offset % 64);
    }
    let set: u64 = bits.iter().map(|word| u64::from(word.count_ones())).sum();
    if set != positions.len() as u64 {
        // Not distinct after all: a bitmap would drop the repeats.
        positions.sort_unstable();
        return;
    }
    positions.clear();
    for (index, &word) in bits.iter().enumerate() {
        // At most `high`: a word's base never passes the last position.
        let base = low + index as u64 * 64;
        let mut word = word;
        while word != 0 {
            positions.push(base + u64::from(word.trailing_zeros()));
            word &= word - 1;
        }
    }
}

/// The outcome of a [`KeepMaxTable`]: with the positions to emit listed
/// ([`KeepMaxTable::finish`]), or without them when they went into a [`PositionBits`]
/// ([`KeepMaxTable::finish_marking`]).
#[derive(Debug, Clone)]
pub struct Resolution<Keep = Vec<u64>> {
    /// Positions of the rows to emit, ascending (so in input order).
    pub keep: Keep,
    /// Every row tied at its key's final version, ascending by position; reading them and
    /// feeding a [`crate::TieCheck`] counts conflicts.
    pub tie_rows: Vec<TieRow>,
    /// Number of tie groups in `tie_rows`.
    pub tie_groups: u32,
    /// Counts; `conflicts` stays 0 until the tie rows have been compared.
    pub stats: DedupStats,
}

impl<Keep> Resolution<Keep> {
    /// The same outcome with `keep` as its positions to emit.
    pub fn with_keep<Other>(self, keep: Other) -> Resolution<Other> {
        Resolution {
            keep,
            tie_rows: self.tie_rows,
            tie_groups: self.tie_groups,
            stats: self.stats,
        }
    }
}

/// Encodes batches for a [`KeepMaxTable`] without the table: the key, version and op
/// columns become a [`PreparedRows`].
#[derive(Debug, Clone)]
pub struct RowPreparer {
    spec: DedupSpec,
    keys: KeyLayout,
    versions: VersionLayout,
    narrow: bool,
}

impl RowPreparer {
    /// Encodes `batch`, whose rows sit at `positions` of the input, into `out` (its
    /// buffers are reused).
    ///
    /// # Errors
    /// As [`KeepMaxTable::update`].
    pub fn prepare_into(
        &self,
        batch: &RecordBatch,
        positions: impl Fn(usize) -> u64,
        out: &mut PreparedRows,
    ) -> Result<(), ArrowError> {
        let num_rows = batch.num_rows();
        let keys = self
            .keys
            .canonicalise(&columns(batch, &self.spec.keys, "key")?)?;
        let version_columns = columns(batch, &self.spec.versions, "version")?;
        self.versions
            .encode(&version_columns, num_rows, &mut out.versions)?;
        out.width = self.versions.width();
        out.tombstones.clear();
        if let Some(deletes) = &self.spec.options.deletes {
            deletes.mark_tombstones(
                column(batch, &deletes.op_column, "op")?,
                &mut out.tombstones,
            )?;
        } else {
            out.tombstones.resize(num_rows, false);
        }
        out.keys.encode(&keys, self.narrow);
        out.positions.clear();
        out.positions.extend((0..num_rows).map(positions));
        out.key_nulls = keys.null_rows();
        out.null_keys = out.key_nulls.as_ref().map_or(0, |n| n.null_count() as u64);
        Ok(())
    }
}

/// One batch's rows encoded for a [`KeepMaxTable`] (keys with their hashes, versions,
/// delete marks, positions), by a [`RowPreparer`].
///
/// Split by key hash ([`Self::split`]), the parts go to tables that each own a share of
/// the keys: every key is encoded and hashed once, and the parts copy encoded bytes, not
/// the batch's columns.
#[derive(Debug, Default)]
pub struct PreparedRows {
    keys: EncodedKeys,
    versions: Vec<u8>,
    width: usize,
    tombstones: Vec<bool>,
    positions: Vec<u64>,
    /// Rows with a null in any key column, if any (only to split `null_keys`).
    key_nulls: Option<NullBuffer>,
    null_keys: u64,
}

impl PreparedRows {
    /// Rows held.
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    /// Whether no row is held.
    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// Splits the rows into `parts` by key hash, each part in the rows' order; all rows of
    /// a key land in the same part, whatever batch they come in.
    ///
    /// Column by column: each part's rows are listed first, then every column gathered
    /// for them. Pushed row by row into one of several parts, every column's copy was a
    /// store and reload of that part's length through memory, a chain that made the split
    /// a tenth of pass 1 at 40M rows (`benches/RESULTS.md`).
    pub fn split(&self, parts: u32) -> Vec<PreparedRows> {
        let parts = parts.max(1);
        let mut rows_of: Vec<Vec<u32>> = (0..parts)
            .map(|_| Vec::with_capacity(self.len() / parts as usize + 64))
            .collect();
        for row in 0..self.len() {
            rows_of[self.keys.route(row, parts) as usize].push(row as u32);
        }
        rows_of.iter().map(|rows| self.gather(rows)).collect()
    }

    /// The rows at `rows` (indices into these rows), in that order.
    fn gather(&self, rows: &[u32]) -> PreparedRows {
        let null_keys = self.key_nulls.as_ref().map_or(0, |nulls| {
            rows.iter()
                .filter(|&&row| nulls.is_null(row as usize))
                .count() as u64
        });
        PreparedRows {
            keys: self.keys.gather(rows),
            versions: gather_versions(&self.versions, self.width, rows),
            width: self.width,
            tombstones: rows
                .iter()
                .map(|&row| self.tombstones[row as usize])
                .collect(),
            positions: rows
                .iter()
                .map(|&row| self.positions[row as usize])
                .collect(),
            key_nulls: None,
            null_keys,
        }
    }
}

/// The encoded versions, `width` bytes each, of `rows`, in that order; the common
/// [`ONE_WORD_VERSION`] width copied as fixed-size values rather than by `memcpy` calls.
fn gather_versions(versions: &[u8], width: usize, rows: &[u32]) -> Vec<u8> {
    let mut out = vec![0u8; rows.len() * width];
    if width == ONE_WORD_VERSION {
        let (source, _) = versions.as_chunks::<ONE_WORD_VERSION>();
        let (target, _) = out.as_chunks_mut::<ONE_WORD_VERSION>();
        for (version, &row) in target.iter_mut().zip(rows) {
            *version = source[row as usize];
        }
    } else if width > 0 {
        for (version, &row) in out.chunks_exact_mut(width).zip(rows) {
            let at = row as usize * width;
            version.copy_from_slice(&versions[at..at + width]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{
        KeepMaxTable, PositionBits, RESERVE_SAMPLE_ROWS, TieLog, WideningVec, append_version,
        compare_versions, copy_version, sort_distinct_positions,
    };
    use crate::options::DedupSpec;
    use crate::rng::SplitMix64;
    use arrow::array::{Int64Array, RecordBatch, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;

    /// A table fed `rows` rows of `distinct` keys (each key's rows spread over the whole
    /// input, versions rising and falling), told the row count in advance or not; with
    /// the capacity of its winners when the sample was taken.
    fn fed_table(rows: u64, distinct: u64, text: bool, expect: bool) -> (KeepMaxTable, usize) {
        let schema = Arc::new(Schema::new(vec![
            Field::new(
                "k",
                if text {
                    DataType::Utf8
                } else {
                    DataType::Int64
                },
                false,
            ),
            Field::new("v", DataType::Int64, false),
        ]));
        let mut table = KeepMaxTable::try_new(&schema, &DedupSpec::new(["k"], ["v"]))
            .expect("a table of an integer or text key");
        if expect {
            table.expect_rows(rows);
        }
        let mut sampled = 0;
        for start in (0..rows).step_by(10_000) {
            let ids: Vec<u64> = (start..(start + 10_000).min(rows))
                .map(|r| r * 1_000_003 % distinct)
                .collect();
            let keys: Arc<dyn arrow::array::Array> = if text {
                Arc::new(StringArray::from_iter_values(
                    ids.iter().map(|i| format!("key-{i}")),
                ))
            } else {
                Arc::new(Int64Array::from_iter_values(ids.iter().map(|&i| i as i64)))
            };
            let versions = Int64Array::from_iter_values(
                (start..start + ids.len() as u64).map(|r| ((r * 7919) % 1000) as i64),
            );
            let batch = RecordBatch::try_new(Arc::clone(&schema), vec![keys, Arc::new(versions)])
                .expect("columns of the schema");
            table.update(&batch).expect("a batch of the table's schema");
            // The room is made as the first batch past the sample begins.
            if table.rows_in() > RESERVE_SAMPLE_ROWS + 10_000 && sampled == 0 {
                sampled = table.winner.size();
            }
        }
        (table, sampled)
    }

    #[test]
    fn room_made_for_expected_rows_changes_no_outcome_and_stops_growth() {
        for text in [false, true] {
            let (rows, distinct) = (1_200_000, 900_000);
            let (hinted, sampled) = fed_table(rows, distinct, text, true);
            let (plain, plain_sampled) = fed_table(rows, distinct, text, false);
            assert_eq!(hinted.distinct_keys(), distinct as usize);
            // Room for every key was made after the sample: the winners never grew again,
            // where without the hint they did.
            assert_eq!(hinted.winner.size(), sampled, "text keys: {text}");
            assert!(hinted.winner.size() >= distinct as usize * 4);
            assert!(plain.winner.size() > plain_sampled);
            let (hinted, plain) = (hinted.finish(), plain.finish());
            assert_eq!(hinted.keep, plain.keep);
            assert_eq!(hinted.stats, plain.stats);
            assert_eq!(hinted.tie_groups, plain.tie_groups);
        }
    }

    /// Distinct positions drawn from `0..range` at a density of `keep` in 1,000, shuffled.
    fn shuffled(range: u64, keep: u64, offset: u64, seed: u64) -> Vec<u64> {
        let mut state = seed;
        let mut next = move || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            state >> 33
        };
        let mut positions: Vec<u64> = (0..range)
            .filter(|_| next() % 1000 < keep)
            .map(|p| p + offset)
            .collect();
        for i in (1..positions.len()).rev() {
            positions.swap(i, (next() % (i as u64 + 1)) as usize);
        }
        positions
    }

    #[test]
    fn the_tie_log_widens_for_a_position_it_cannot_hold_and_keeps_its_events() {
        let mut log = TieLog::default();
        log.push(1, Some(10));
        log.push(1, None);
        log.push(2, Some(u64::from(u32::MAX) - 1));
        assert!(matches!(log.positions_plus_one, WideningVec::Narrow(_)));
        // Positions are kept plus one (0 is a reset), so a row at u32::MAX widens the log.
        log.push(3, Some(u64::from(u32::MAX)));
        assert!(matches!(log.positions_plus_one, WideningVec::Wide(_)));
        log.push(4, None);
        let mut back = Vec::new();
        log.for_each_rev(|slot, position| back.push((slot, position)));
        back.reverse();
        assert_eq!(
            back,
            [
                (1, Some(10)),
                (1, None),
                (2, Some(u64::from(u32::MAX) - 1)),
                (3, Some(u64::from(u32::MAX))),
                (4, None)
            ]
        );
    }

    #[test]
    fn positions_sort_as_a_comparison_sort_does() {
        for (seed, (range, keep, offset)) in [
            (0, 0, 0),
            (1, 1000, 0),
            (100, 1000, 7),
            (10_000, 730, 1 << 40),
            (10_000, 10, 3),
            (100_000, 1, 64),
            (65, 500, u64::MAX - 65),
        ]
        .into_iter()
        .enumerate()
        {
            let mut positions = shuffled(range, keep, offset, seed as u64);
            let mut expected = positions.clone();
            expected.sort_unstable();
            sort_distinct_positions(&mut positions);
            assert_eq!(positions, expected, "range {range}, density {keep}/1000");
        }
        // Repeats (never made by a table) still sort, without losing any.
        let mut repeated = vec![5, 3, 5, 4, 3];
        sort_distinct_positions(&mut repeated);
        assert_eq!(repeated, [3, 3, 4, 5, 5]);
    }

    #[test]
    fn position_bits_hold_and_yield_what_a_sorted_list_does() {
        for (seed, (range, keep, offset)) in [
            (1, 1000, 0),
            (100, 1000, 7),
            (10_000, 730, 64),
            (10_000, 10, 3),
            (3000, 500, 129),
        ]
        .into_iter()
        .enumerate()
        {
            let positions = shuffled(range, keep, offset, seed as u64);
            let (low, high) = positions.split_at(positions.len() / 2);
            // Two halves in two sets, one too small for its positions, then joined.
            let mut bits = PositionBits::with_capacity(range / 3);
            let mut other = PositionBits::with_capacity(range + offset);
            low.iter().for_each(|&p| bits.insert(p));
            high.iter().for_each(|&p| other.insert(p));
            bits.union_with(&other);
            let mut sorted = positions.clone();
            sorted.sort_unstable();
            let end = range + offset + 70;
            for (start, stop) in [
                (0, end),
                (5, 64),
                (64, 128),
                (63, 65),
                (offset + 1, end.saturating_sub(100)),
            ] {
                let expected: Vec<u64> = sorted
                    .iter()
                    .copied()
                    .filter(|p| (start..stop).contains(p))
                    .collect();
                assert_eq!(bits.iter_in(start, stop).collect::<Vec<_>>(), expected);
                assert_eq!(bits.count_in(start, stop), expected.len() as u64);
                let range = bits.range_bits(start, stop);
                assert_eq!(range.len() as u64, stop.saturating_sub(start));
                let set: Vec<u64> = range.set_indices().map(|i| start + i as u64).collect();
                assert_eq!(set, expected, "range_bits({start}, {stop})");
            }
            assert!(sorted.iter().all(|&p| bits.contains(p)));
            assert_eq!(bits.count_in(0, end), sorted.len() as u64);
            assert!(!bits.contains(end + 1_000_000));
            assert_eq!(bits.iter_in(50, 10).count(), 0, "an empty range");
            let past = bits.range_bits(end + 1000, end + 1100);
            assert_eq!(
                (past.len(), past.count_set_bits()),
                (100, 0),
                "past the words"
            );
            let straddling = bits.range_bits(end - 70, end + 130);
            assert_eq!(straddling.len(), 200);
        }
    }

    #[test]
    fn a_split_keeps_every_row_whole_in_its_keys_part_and_order() {
        use super::PreparedRows;
        use crate::options::{DedupOptions, DeletePolicy};
        use arrow::array::{ArrayRef, UInt32Array};

        let rows = 3_000usize;
        let mut rng = SplitMix64::new(7);
        let text: ArrayRef = Arc::new(StringArray::from_iter((0..rows).map(|i| {
            // Nulls, empty keys, UUIDs packed short, and keys longer than a short copy.
            match i % 13 {
                0 => None,
                1 => Some(String::new()),
                2 => Some(format!("{}-{}", "k".repeat(40), rng.next_u64() % 500)),
                _ => Some(format!(
                    "{:08x}-0000-4000-8000-{:012x}",
                    rng.next_u64() % 700,
                    i % 3
                )),
            }
        })));
        let number: ArrayRef = Arc::new(UInt32Array::from_iter_values(
            (0..rows).map(|i| (i * 7 % 300) as u32),
        ));
        let version: ArrayRef = Arc::new(Int64Array::from_iter(
            (0..rows).map(|i| (i % 17 != 0).then_some((i * 31 % 1000) as i64)),
        ));
        let op: ArrayRef = Arc::new(StringArray::from_iter_values(
            (0..rows).map(|i| if i % 5 == 0 { "d" } else { "u" }),
        ));
        let schema = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Utf8, true),
            Field::new("n", DataType::UInt32, false),
            Field::new("v", DataType::Int64, true),
            Field::new("op", DataType::Utf8, false),
        ]));
        let batch = RecordBatch::try_new(Arc::clone(&schema), vec![text, number, version, op])
            .expect("batch");
        let deletes = DedupOptions::default().with_deletes(DeletePolicy::new("op"));
        for keys in [vec!["k", "n"], vec!["n"]] {
            let spec = DedupSpec::new(keys.clone(), ["v"]).with_options(deletes.clone());
            let table = KeepMaxTable::try_new(&schema, &spec).expect("table");
            let mut whole = PreparedRows::default();
            table
                .preparer()
                .prepare_into(&batch, |row| 1_000 + row as u64, &mut whole)
                .expect("prepare");
            for parts in [1, 2, 3] {
                let split = whole.split(parts);
                assert_eq!(split.len(), parts as usize);
                assert_eq!(split.iter().map(PreparedRows::len).sum::<usize>(), rows);
                let width = whole.width;
                for (part, rows_of_part) in split.iter().enumerate() {
                    let expected: Vec<usize> = (0..rows)
                        .filter(|&row| whole.keys.route(row, parts) as usize == part)
                        .collect();
                    assert_eq!(rows_of_part.len(), expected.len(), "{keys:?} {parts}");
                    assert_eq!(rows_of_part.width, width);
                    for (at, &row) in expected.iter().enumerate() {
                        assert_eq!(rows_of_part.keys.key_at(at), whole.keys.key_at(row));
                        assert_eq!(rows_of_part.positions[at], whole.positions[row]);
                        assert_eq!(rows_of_part.tombstones[at], whole.tombstones[row]);
                        assert_eq!(
                            rows_of_part.versions[at * width..(at + 1) * width],
                            whole.versions[row * width..(row + 1) * width]
                        );
                    }
                    let null_keys = whole.key_nulls.as_ref().map_or(0, |nulls| {
                        expected.iter().filter(|&&row| nulls.is_null(row)).count() as u64
                    });
                    assert_eq!(rows_of_part.null_keys, null_keys);
                }
                assert_eq!(
                    split.iter().map(|p| p.null_keys).sum::<u64>(),
                    whole.null_keys
                );
            }
        }
    }

    #[test]
    fn version_helpers_order_and_copy_as_the_bytes_do() {
        let mut rng = SplitMix64::new(9);
        for width in [1, 8, 9, 10, 17, 18] {
            for _ in 0..2000 {
                // Few distinct bytes, so that equal prefixes and equal versions are common.
                let mut draw = || (0..width).map(|_| rng.below(3) as u8).collect::<Vec<u8>>();
                let (a, b) = (draw(), draw());
                assert_eq!(compare_versions(&a, &b), a.cmp(&b), "{a:?} {b:?}");
                let mut current = a.clone();
                copy_version(&mut current, &b);
                assert_eq!(current, b);
                let mut appended = vec![7u8];
                append_version(&mut appended, &a);
                assert_eq!(appended, [&[7u8][..], &a].concat());
            }
        }
    }
}
