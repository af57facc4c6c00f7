//! The keep-max table: one pass over key and version columns decides every key's winner.
//!
//! Per distinct key (a dense *slot* from the [`KeyInterner`]) the table keeps only what
//! deciding needs — never the rows themselves:
//!
//! ```text
//!   slot │ winner position │ version bytes │ ties │ generation │ tombstone
//!   ─────┼─────────────────┼───────────────┼──────┼────────────┼──────────
//!     0  │ 17              │ 01 80…05      │ 1    │ 0          │ no
//!     1  │ 3               │ 01 80…09      │ 0    │ 2          │ yes
//! ```
//!
//! A row with a higher version than its slot's replaces the winner (the old winner and its
//! ties become *superseded*, and the generation moves on); a lower one is superseded at
//! once; an equal one is a *tie*, resolved by [`TiePolicy`]. Positions are the rows'
//! ordinals across all batches, so the caller can fetch the winning rows afterwards
//! (late materialisation) and emit them in input order.

use arrow::array::{Array, ArrayRef, RecordBatch, UInt64Array};
use arrow::datatypes::{Field, Schema};
use arrow::error::ArrowError;

use crate::interner::{KeyInterner, NarrowInterner, RowInterner};
use crate::key::KeyLayout;
use crate::options::{DedupSpec, TiePolicy};
use crate::stats::DedupStats;
use crate::version::VersionLayout;

/// A row that ties at its key's final maximum version, to be compared by content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TieRow {
    /// The row's position in the input.
    pub position: u64,
    /// Dense number of its tie group (one per key that has ties).
    pub group: u32,
}

#[derive(Debug, Clone, Copy)]
struct TieEvent {
    slot: u32,
    generation: u32,
    position: u64,
}

/// Decides, per key, which row has the maximum version. See the module docs.
#[derive(Debug)]
pub struct KeepMaxTable {
    spec: DedupSpec,
    keys: KeyLayout,
    versions: VersionLayout,
    interner: KeyInterner,
    winner: Vec<u64>,
    version: Vec<u8>,
    ties: Vec<u32>,
    generation: Vec<u32>,
    tombstone: Vec<bool>,
    tie_events: Vec<TieEvent>,
    rows_in: u64,
    superseded: u64,
    null_keys: u64,
    scratch: Scratch,
}

#[derive(Debug, Default)]
struct Scratch {
    hashes: Vec<u64>,
    slots: Vec<u32>,
    versions: Vec<u8>,
    tombstones: Vec<bool>,
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
        Ok(Self {
            spec: spec.clone(),
            keys,
            versions: VersionLayout::try_new(&version_fields)?,
            interner,
            winner: Vec::new(),
            version: Vec::new(),
            ties: Vec::new(),
            generation: Vec::new(),
            tombstone: Vec::new(),
            tie_events: Vec::new(),
            rows_in: 0,
            superseded: 0,
            null_keys: 0,
            scratch: Scratch::default(),
        })
    }

    /// Uses the generic (encoded bytes) key table even where a specialised one applies;
    /// for benchmarks and tests that compare the two.
    #[must_use]
    pub fn with_generic_keys(mut self) -> Self {
        if self.interner.is_empty() {
            self.interner = KeyInterner::Rows(RowInterner::default());
        }
        self
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
            + self.winner.capacity() * 8
            + self.version.capacity()
            + self.ties.capacity() * 4
            + self.generation.capacity() * 4
            + self.tombstone.capacity()
            + self.tie_events.capacity() * size_of::<TieEvent>()
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
        let num_rows = batch.num_rows();
        let key_columns: Vec<ArrayRef> = self
            .spec
            .keys
            .iter()
            .map(|k| column(batch, k, "key").cloned())
            .collect::<Result<_, _>>()?;
        let version_columns: Vec<ArrayRef> = self
            .spec
            .versions
            .iter()
            .map(|v| column(batch, v, "version").cloned())
            .collect::<Result<_, _>>()?;
        let keys = self.keys.canonicalise(&key_columns)?;
        let scratch = &mut self.scratch;
        self.versions
            .encode(&version_columns, num_rows, &mut scratch.versions)?;
        scratch.tombstones.clear();
        if let Some(deletes) = &self.spec.options.deletes {
            deletes.mark_tombstones(
                column(batch, &deletes.op_column, "op")?,
                &mut scratch.tombstones,
            )?;
        } else {
            scratch.tombstones.resize(num_rows, false);
        }
        keys.hash_rows(&mut scratch.hashes);
        self.interner
            .intern(&keys, &scratch.hashes, &mut scratch.slots);
        self.null_keys += keys.rows_with_null() as u64;

        let width = self.versions.width();
        let last_wins = self.spec.options.on_tie == TiePolicy::Last;
        for (row, &slot) in scratch.slots.iter().enumerate() {
            let position = position_of(row);
            let incoming = &scratch.versions[row * width..(row + 1) * width];
            let tombstone = scratch.tombstones[row];
            let s = slot as usize;
            if s == self.winner.len() {
                self.winner.push(position);
                self.version.extend_from_slice(incoming);
                self.ties.push(0);
                self.generation.push(0);
                self.tombstone.push(tombstone);
                continue;
            }
            let current = &mut self.version[s * width..(s + 1) * width];
            match incoming.cmp(current) {
                std::cmp::Ordering::Less => self.superseded += 1,
                std::cmp::Ordering::Greater => {
                    current.copy_from_slice(incoming);
                    self.superseded += 1 + u64::from(self.ties[s]);
                    self.ties[s] = 0;
                    self.generation[s] += 1;
                    self.winner[s] = position;
                    self.tombstone[s] = tombstone;
                }
                std::cmp::Ordering::Equal => {
                    let generation = self.generation[s];
                    if self.ties[s] == 0 {
                        // The row that set this version joins the tie group too.
                        self.tie_events.push(TieEvent {
                            slot,
                            generation,
                            position: self.winner[s],
                        });
                    }
                    self.tie_events.push(TieEvent {
                        slot,
                        generation,
                        position,
                    });
                    self.ties[s] += 1;
                    // By position, not arrival: rows of several partitions may arrive
                    // interleaved, and the first (last) in input order must still win.
                    let replaces = if last_wins {
                        position > self.winner[s]
                    } else {
                        position < self.winner[s]
                    };
                    if replaces {
                        self.winner[s] = position;
                        self.tombstone[s] = tombstone;
                    }
                }
            }
        }
        self.rows_in += num_rows as u64;
        Ok(())
    }

    /// Decides the winners: the positions to emit, the tie rows to compare, and the counts.
    pub fn finish(self) -> Resolution {
        let keep_tombstones = self
            .spec
            .options
            .deletes
            .as_ref()
            .is_some_and(|d| d.keep_tombstones);
        let mut keep = Vec::with_capacity(self.winner.len());
        let mut deleted = 0;
        let mut tombstones_kept = 0;
        for (&position, &tombstone) in self.winner.iter().zip(&self.tombstone) {
            if !tombstone {
                keep.push(position);
            } else if keep_tombstones {
                keep.push(position);
                tombstones_kept += 1;
            } else {
                deleted += 1;
            }
        }
        keep.sort_unstable();

        let mut group_of_slot = vec![
            u32::MAX;
            if self.tie_events.is_empty() {
                0
            } else {
                self.winner.len()
            }
        ];
        let mut groups = 0u32;
        let mut tie_rows: Vec<TieRow> = self
            .tie_events
            .iter()
            .filter(|e| self.generation[e.slot as usize] == e.generation)
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

        let duplicates: u64 = self.ties.iter().map(|&t| u64::from(t)).sum();
        let distinct_keys = self.winner.len() as u64;
        Resolution {
            keep,
            tie_rows,
            tie_groups: groups,
            stats: DedupStats {
                rows_in: self.rows_in,
                rows_out: distinct_keys - deleted,
                duplicates,
                superseded: self.superseded,
                deleted,
                conflicts: 0,
                null_keys: self.null_keys,
                distinct_keys,
                tombstones_kept,
            },
        }
    }
}

/// The outcome of a [`KeepMaxTable`].
#[derive(Debug, Clone)]
pub struct Resolution {
    /// Positions of the rows to emit, ascending (so in input order).
    pub keep: Vec<u64>,
    /// Every row tied at its key's final version, ascending by position; reading them and
    /// feeding a [`crate::TieCheck`] counts conflicts.
    pub tie_rows: Vec<TieRow>,
    /// Number of tie groups in `tie_rows`.
    pub tie_groups: u32,
    /// Counts; `conflicts` stays 0 until the tie rows have been compared.
    pub stats: DedupStats,
}
