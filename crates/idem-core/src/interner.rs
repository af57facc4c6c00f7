//! Interning keys into dense slot numbers.
//!
//! ```text
//!   batch rows ──hash_rows──▶ [h0 h1 h2 …]          (one u64 per row, column at a time)
//!        │                        │
//!        └──encode_rows──▶ key bytes per row        (generic table only)
//!                                 │
//!   HashTable<(hash, slot)> ◀──probe: hash equal AND stored key equal──▶ slot
//!        │ miss                                          │
//!        └──▶ append key to the arena, new slot = len    └──▶ slots[row]
//! ```
//!
//! Two tables share that shape: a generic one storing each distinct key's encoded bytes in
//! one arena, and one for a single fixed-width key of at most 8 bytes that stores the value
//! as a `u64` and skips the encoding.

use hashbrown::HashTable;

use crate::key::{KeyColumns, KeyRows};

/// Maps keys to dense slot numbers `0..len()`, in order of first appearance.
#[derive(Debug)]
pub enum KeyInterner {
    /// Any key: encoded bytes compared in full.
    Rows(RowInterner),
    /// One fixed-width column of at most 8 bytes.
    Narrow(NarrowInterner),
}

impl KeyInterner {
    /// Assigns a slot to every row of `keys` (hashes from [`KeyColumns::hash_rows`]).
    pub fn intern(&mut self, keys: &KeyColumns, hashes: &[u64], slots: &mut Vec<u32>) {
        match self {
            Self::Rows(table) => table.intern(keys, hashes, slots),
            Self::Narrow(table) => table.intern(keys, hashes, slots),
        }
    }

    /// Distinct keys interned so far.
    pub fn len(&self) -> usize {
        match self {
            Self::Rows(table) => table.len(),
            Self::Narrow(table) => table.len(),
        }
    }

    /// Whether no key has been interned.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes allocated.
    pub fn size(&self) -> usize {
        match self {
            Self::Rows(table) => table.size(),
            Self::Narrow(table) => table.size(),
        }
    }
}

/// The generic table: distinct keys' encoded bytes in one arena.
#[derive(Debug, Default)]
pub struct RowInterner {
    table: HashTable<(u64, u32)>,
    arena: Vec<u8>,
    /// `arena[ends[slot - 1]..ends[slot]]` is a slot's key.
    ends: Vec<usize>,
    rows: KeyRows,
}

impl RowInterner {
    fn key(&self, slot: u32) -> &[u8] {
        let slot = slot as usize;
        let start = if slot == 0 { 0 } else { self.ends[slot - 1] };
        &self.arena[start..self.ends[slot]]
    }

    fn intern(&mut self, keys: &KeyColumns, hashes: &[u64], slots: &mut Vec<u32>) {
        keys.encode_rows(&mut self.rows);
        slots.clear();
        slots.reserve(hashes.len());
        for (row, &hash) in hashes.iter().enumerate() {
            let key = self.rows.row(row);
            let found = self
                .table
                .find(hash, |&(h, slot)| h == hash && self.key(slot) == key)
                .map(|&(_, slot)| slot);
            let slot = match found {
                Some(slot) => slot,
                None => {
                    let slot = self.ends.len() as u32;
                    self.arena.extend_from_slice(key);
                    self.ends.push(self.arena.len());
                    self.table.insert_unique(hash, (hash, slot), |&(h, _)| h);
                    slot
                }
            };
            slots.push(slot);
        }
    }

    fn len(&self) -> usize {
        self.ends.len()
    }

    fn size(&self) -> usize {
        self.table.allocation_size()
            + self.arena.capacity()
            + self.ends.capacity() * size_of::<usize>()
    }
}

/// The table for one fixed-width key of at most 8 bytes, stored as `u64` bits.
#[derive(Debug, Default)]
pub struct NarrowInterner {
    table: HashTable<(u64, u32)>,
    /// Each slot's key bits; the null key's slot (not in `table`) holds 0.
    values: Vec<u64>,
    null_slot: Option<u32>,
    scratch: Vec<Option<u64>>,
}

impl NarrowInterner {
    fn intern(&mut self, keys: &KeyColumns, hashes: &[u64], slots: &mut Vec<u32>) {
        keys.narrow_values(&mut self.scratch);
        slots.clear();
        slots.reserve(hashes.len());
        for (&value, &hash) in self.scratch.iter().zip(hashes) {
            let next = self.values.len() as u32;
            let slot = match value {
                None => *self.null_slot.get_or_insert_with(|| {
                    self.values.push(0);
                    next
                }),
                Some(bits) => {
                    let values = &self.values;
                    match self.table.find(hash, |&(h, slot)| {
                        h == hash && values[slot as usize] == bits
                    }) {
                        Some(&(_, slot)) => slot,
                        None => {
                            self.values.push(bits);
                            self.table.insert_unique(hash, (hash, next), |&(h, _)| h);
                            next
                        }
                    }
                }
            };
            slots.push(slot);
        }
    }

    fn len(&self) -> usize {
        self.values.len()
    }

    fn size(&self) -> usize {
        self.table.allocation_size() + self.values.capacity() * size_of::<u64>()
    }
}
