//! Interning keys into dense slot numbers.
//!
//! ```text
//!   batch rows ──encode_compact_rows──▶ key bytes per row ──xxh3──▶ hash per row
//!                                               │                     │
//!   HashTable<(slot, hash32)> ◀──probe: hash32 equal AND stored key equal──▶ slot
//!        │ miss                                          │
//!        └──▶ append key to the arena, new slot = len    └──▶ slots[row]
//! ```
//!
//! Two tables share that shape: a generic one storing each distinct key's compact bytes in
//! an arena of fixed-size blocks, and one for a single fixed-width key of at most 8 bytes
//! that stores the value as a `u64` and skips the encoding.
//!
//! Memory is what limits a dedup, so every byte per key counts: a table entry is 8 bytes
//! (the slot and 32 bits of its hash, enough to grow the table without touching the keys
//! and to skip most full comparisons); the arena grows a block at a time, never doubling;
//! keys are encoded compactly (UUID text in 16 bytes, small integers in one).
//!
//! Speed is the other limit: a table of millions of keys misses the cache on every probe.
//! A batch's hashes are computed first, and while row `r` is interned the memory of later
//! rows is requested in stages (see `probe_ahead`), so that their misses overlap.

use hashbrown::HashTable;
use hashbrown::hash_table::Entry;

use crate::key::{KeyColumns, KeyRows, SHORT_KEY, append_key, hash_bytes, mix};
use crate::prefetch::{TableLayout, prefetch_index};
use crate::widening::WideningVec;

/// Maps keys to dense slot numbers `0..len()`, in order of first appearance.
#[derive(Debug)]
pub enum KeyInterner {
    /// Any key: encoded bytes compared in full.
    Rows(RowInterner),
    /// One fixed-width column of at most 8 bytes.
    Narrow(NarrowInterner),
}

impl KeyInterner {
    /// Whether the table takes [`EncodedKeys`] in their narrow (`u64`) form.
    pub fn is_narrow(&self) -> bool {
        matches!(self, Self::Narrow(_))
    }

    /// Assigns a slot to every row of already-encoded keys. Keys encoded in the other
    /// form than [`Self::is_narrow`] says are a caller's error, caught by
    /// [`crate::KeepMaxTable`] before it gets here; they would get wrong slots.
    pub fn intern_encoded(&mut self, keys: &EncodedKeys, slots: &mut Vec<u32>) {
        match (self, &keys.form) {
            (Self::Rows(table), KeyForm::Rows(rows)) => table.intern(rows, &keys.hashes, slots),
            (Self::Narrow(table), KeyForm::Narrow(values)) => {
                table.intern(values, &keys.hashes, slots);
            }
            _ => slots.clear(),
        }
    }

    /// Makes room for `additional` more distinct keys, so that the table and its per-key
    /// records reach that size without growing (and copying themselves) on the way.
    pub fn reserve(&mut self, additional: usize) {
        match self {
            Self::Rows(table) => {
                table.table.reserve(additional, |&(_, h)| table_hash(h));
                table.arena.locations.reserve(additional);
            }
            Self::Narrow(table) => {
                table.table.reserve(additional, |&(_, h)| table_hash(h));
                table.values.0.reserve(additional);
            }
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

/// One batch's keys as the tables compare them, with each row's 64-bit hash.
///
/// Encoding and hashing need no table, so they can run on another thread than the probing,
/// and a batch split between several tables by hash (see [`Self::route`]) is encoded and
/// hashed once, not once to route it and again in its table.
#[derive(Debug, Default)]
pub struct EncodedKeys {
    form: KeyForm,
    hashes: Vec<u64>,
}

#[derive(Debug)]
enum KeyForm {
    /// Compact byte strings ([`KeyColumns::encode_compact_rows`]).
    Rows(KeyRows),
    /// One fixed-width column's bits; `None` for a null.
    Narrow(Vec<Option<u64>>),
}

impl Default for KeyForm {
    fn default() -> Self {
        Self::Rows(KeyRows::default())
    }
}

impl EncodedKeys {
    /// Replaces the contents with `keys`, in the narrow form if `narrow` (which needs a
    /// single fixed-width key column of at most 8 bytes).
    pub fn encode(&mut self, keys: &KeyColumns, narrow: bool) {
        self.hashes.clear();
        if narrow {
            let mut values = match std::mem::take(&mut self.form) {
                KeyForm::Narrow(values) => values,
                KeyForm::Rows(_) => Vec::new(),
            };
            keys.narrow_values(&mut values);
            // A null's hash only steers a prefetch: nulls never enter the table.
            self.hashes
                .extend(values.iter().map(|v| mix(v.unwrap_or(0))));
            self.form = KeyForm::Narrow(values);
        } else {
            let mut rows = match std::mem::take(&mut self.form) {
                KeyForm::Rows(rows) => rows,
                KeyForm::Narrow(_) => KeyRows::default(),
            };
            keys.encode_compact_rows(&mut rows);
            self.hashes
                .extend((0..keys.num_rows()).map(|row| hash_bytes(rows.row(row))));
            self.form = KeyForm::Rows(rows);
        }
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        self.hashes.len()
    }

    /// Whether no row is held.
    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }

    /// Whether the keys are in the narrow form.
    pub fn is_narrow(&self) -> bool {
        matches!(self.form, KeyForm::Narrow(_))
    }

    /// The part (`0..parts`) of `row`'s key. It comes from the hash's low 32 bits, which
    /// the tables never use (they keep and probe with the high 32), so the keys of one
    /// part still spread over all of a table's buckets and tags.
    #[inline]
    pub fn route(&self, row: usize, parts: u32) -> u32 {
        (self.hashes[row] as u32) % parts.max(1)
    }

    /// Row `row`'s key (its encoded bytes, or its narrow value) and hash.
    #[cfg(test)]
    pub(crate) fn key_at(&self, row: usize) -> (Option<&[u8]>, Option<u64>, u64) {
        match &self.form {
            KeyForm::Rows(rows) => (Some(rows.row(row)), None, self.hashes[row]),
            KeyForm::Narrow(values) => (None, values[row], self.hashes[row]),
        }
    }

    /// The keys and hashes of `rows` (indices into these), in that order.
    pub(crate) fn gather(&self, rows: &[u32]) -> Self {
        let form = match &self.form {
            KeyForm::Rows(keys) => KeyForm::Rows(keys.gather(rows)),
            KeyForm::Narrow(values) => {
                KeyForm::Narrow(rows.iter().map(|&row| values[row as usize]).collect())
            }
        };
        Self {
            form,
            hashes: rows.iter().map(|&row| self.hashes[row as usize]).collect(),
        }
    }
}

/// The 64-bit hash the table probes with, rebuilt from the 32 bits an entry keeps: the
/// multiplication spreads them over the high bits hashbrown takes its tags from, while the
/// low bits (bucket index) stay a bijection of the hash's.
#[inline]
fn table_hash(hash32: u32) -> u64 {
    u64::from(hash32).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// The 32 bits of a 64-bit key hash that a table entry keeps.
#[inline]
fn short_hash(hash: u64) -> u32 {
    (hash >> 32) as u32
}

/// Whether two encoded keys are equal. Slice equality calls `bcmp` for each comparison,
/// a call that costs more than the comparison for keys this short (a packed UUID and a
/// small integer are 19 bytes); from 8 to 32 bytes two overlapping fixed-size chunks,
/// which compile to a few loads, cover the whole key.
#[inline]
fn same_key(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    match a.len() {
        16..=32 => {
            a.first_chunk::<16>() == b.first_chunk::<16>()
                && a.last_chunk::<16>() == b.last_chunk::<16>()
        }
        8..16 => {
            a.first_chunk::<8>() == b.first_chunk::<8>()
                && a.last_chunk::<8>() == b.last_chunk::<8>()
        }
        _ => a == b,
    }
}

/// How many rows ahead of the one being interned the table is requested; a candidate
/// entry's stored key is requested half as far ahead, the key's bytes a quarter. On
/// `keep_max_update` with 700,000 distinct keys, 8, 16, 24 and 32 measured the same within
/// the machine's noise.
const LOOKAHEAD: usize = 16;

/// Where the tables keep each slot's key, seen by [`probe_ahead`].
trait StoredKeys {
    /// Requests the record of `slot`'s key (its location or its value).
    fn prefetch_record(&self, slot: u32);
    /// Requests `slot`'s key bytes, once its record is likely in cache.
    fn prefetch_bytes(&self, slot: u32);
}

/// Interns the rows of a batch in order — `intern(table, keys, row)` for each row of
/// `hashes` — while requesting the memory later rows will need, in three stages: the
/// table group where row `r + LOOKAHEAD`'s probe starts; for row `r + LOOKAHEAD / 2`, a
/// read-only probe by hash alone (its group is in cache by now) finds the candidate slot
/// and requests its stored key's record; for row `r + LOOKAHEAD / 4`, that record is read
/// to request the key's bytes. Rows whose key is new find no candidate and need nothing
/// more than the table group.
///
/// The table is first made room for the whole batch, so that its layout holds throughout.
fn probe_ahead<K: StoredKeys>(
    table: &mut HashTable<(u32, u32)>,
    keys: &mut K,
    hashes: &[u32],
    candidates: &mut Vec<u32>,
    slots: &mut Vec<u32>,
    mut intern: impl FnMut(&mut HashTable<(u32, u32)>, &mut K, usize) -> u32,
) {
    let rows = hashes.len();
    table.reserve(rows, |&(_, h)| table_hash(h));
    let layout = TableLayout::of(table);
    candidates.clear();
    candidates.resize(rows, NO_CANDIDATE);
    slots.clear();
    slots.reserve(rows);
    for row in 0..rows {
        if let (Some(layout), Some(&hash32)) = (&layout, hashes.get(row + LOOKAHEAD)) {
            layout.prefetch(table_hash(hash32));
        }
        let ahead = row + LOOKAHEAD / 2;
        if let Some(&hash32) = hashes.get(ahead)
            && let Some(&(slot, _)) = table.find(table_hash(hash32), |&(_, h)| h == hash32)
        {
            candidates[ahead] = slot;
            keys.prefetch_record(slot);
        }
        if let Some(&slot) = candidates.get(row + LOOKAHEAD / 4)
            && slot != NO_CANDIDATE
        {
            keys.prefetch_bytes(slot);
        }
        slots.push(intern(table, keys, row));
    }
}

/// A row with no candidate slot in [`probe_ahead`].
const NO_CANDIDATE: u32 = u32::MAX;

/// Largest size of an arena block (the first blocks are smaller, so that a small table
/// stays small). Keys never straddle blocks; a key longer than a block gets a block of its
/// own.
const BLOCK_BITS: u32 = 20;
const BLOCK: usize = 1 << BLOCK_BITS;
const FIRST_BLOCK: usize = 4096;

/// Distinct keys' bytes, packed into blocks that are allocated once at their full size:
/// the arena grows by at most one block at a time, never by copying itself.
///
/// Keys are stored one after another in slot order, so a key ends where the next slot's
/// begins, or at the end of its block when the next slot's is in another: a slot's
/// location needs no length, and fits 32 bits while there are fewer than 4,096 blocks.
#[derive(Debug, Default)]
struct KeyArena {
    blocks: Vec<Vec<u8>>,
    /// Bytes allocated by the blocks.
    allocated: usize,
    /// Per slot: where its key starts, the block index above [`BLOCK_BITS`] bits of
    /// offset in the block.
    locations: WideningVec,
}

impl KeyArena {
    /// Stores a key as the next slot's: the first `len` bytes of `key_and_tail`, a key and
    /// whatever follows it in its batch (which [`append_key`] may copy and cut off).
    fn push(&mut self, key_and_tail: &[u8], len: usize) {
        let key = &key_and_tail[..len];
        let fits = self
            .blocks
            .last()
            .is_some_and(|b| b.len() < BLOCK && b.capacity() - b.len() >= key.len());
        if !fits {
            // Doubling the arena's size up to a full block: few blocks for a small table,
            // little unused room at any size. A key longer than a block fills its own, so
            // the next key starts a fresh one.
            self.add_block(self.allocated.clamp(FIRST_BLOCK, BLOCK).max(key.len()));
        }
        let index = self.blocks.len() - 1;
        let block = &mut self.blocks[index];
        // Below BLOCK: a key is only added to a block holding fewer bytes.
        let offset = block.len();
        // Blocks never reallocate: keys' locations point into them. A key is copied as a
        // fixed-size chunk only where the block has room for the whole chunk.
        if block.capacity() - offset >= SHORT_KEY {
            append_key(block, key_and_tail, len);
        } else {
            block.extend_from_slice(key);
        }
        self.locations
            .push(((index as u64) << BLOCK_BITS) | offset as u64);
    }

    fn add_block(&mut self, capacity: usize) {
        self.blocks.push(Vec::with_capacity(capacity));
        self.allocated += capacity;
    }

    #[inline]
    fn get(&self, slot: u32) -> &[u8] {
        let slot = slot as usize;
        let Some(location) = self.locations.get(slot) else {
            return &[];
        };
        let index = location >> BLOCK_BITS;
        let block = &self.blocks[index as usize];
        let start = (location as usize) & (BLOCK - 1);
        let end = match self.locations.get(slot + 1) {
            Some(next) if next >> BLOCK_BITS == index => (next as usize) & (BLOCK - 1),
            _ => block.len(),
        };
        &block[start..end]
    }

    fn len(&self) -> usize {
        self.locations.len()
    }

    fn size(&self) -> usize {
        self.allocated + self.blocks.capacity() * size_of::<Vec<u8>>() + self.locations.size()
    }
}

impl StoredKeys for KeyArena {
    fn prefetch_record(&self, slot: u32) {
        self.locations.prefetch(slot as usize);
    }

    fn prefetch_bytes(&self, slot: u32) {
        if (slot as usize) < self.len() {
            prefetch_index(self.get(slot), 0);
        }
    }
}

/// The generic table: distinct keys' compact encodings in a block arena.
#[derive(Debug, Default)]
pub struct RowInterner {
    table: HashTable<(u32, u32)>,
    arena: KeyArena,
    hashes: Vec<u32>,
    candidates: Vec<u32>,
}

impl RowInterner {
    fn intern(&mut self, rows: &KeyRows, full_hashes: &[u64], slots: &mut Vec<u32>) {
        let Self {
            table,
            arena,
            hashes,
            candidates,
        } = self;
        hashes.clear();
        hashes.extend(full_hashes.iter().map(|&h| short_hash(h)));
        probe_ahead(
            table,
            arena,
            hashes,
            candidates,
            slots,
            |table, arena, row| {
                let (key_and_tail, len) = rows.row_and_tail(row);
                let key = &key_and_tail[..len];
                let hash32 = hashes[row];
                let entry = table.entry(
                    table_hash(hash32),
                    |&(slot, h)| h == hash32 && same_key(arena.get(slot), key),
                    |&(_, h)| table_hash(h),
                );
                match entry {
                    Entry::Occupied(found) => found.get().0,
                    Entry::Vacant(vacant) => {
                        let slot = arena.len() as u32;
                        arena.push(key_and_tail, len);
                        vacant.insert((slot, hash32));
                        slot
                    }
                }
            },
        );
    }

    fn len(&self) -> usize {
        self.arena.len()
    }

    fn size(&self) -> usize {
        self.table.allocation_size() + self.arena.size()
    }
}

/// The table for one fixed-width key of at most 8 bytes, stored as `u64` bits.
#[derive(Debug, Default)]
pub struct NarrowInterner {
    table: HashTable<(u32, u32)>,
    /// Each slot's key bits; the null key's slot (not in `table`) holds 0.
    values: NarrowValues,
    null_slot: Option<u32>,
    hashes: Vec<u32>,
    candidates: Vec<u32>,
}

/// The narrow table's keys, by slot.
#[derive(Debug, Default)]
struct NarrowValues(Vec<u64>);

impl StoredKeys for NarrowValues {
    fn prefetch_record(&self, slot: u32) {
        prefetch_index(&self.0, slot as usize);
    }

    /// The record is the key.
    fn prefetch_bytes(&self, _slot: u32) {}
}

impl NarrowInterner {
    fn intern(&mut self, scratch: &[Option<u64>], full_hashes: &[u64], slots: &mut Vec<u32>) {
        let Self {
            table,
            values,
            null_slot,
            hashes,
            candidates,
        } = self;
        hashes.clear();
        hashes.extend(full_hashes.iter().map(|&h| short_hash(h)));
        probe_ahead(
            table,
            values,
            hashes,
            candidates,
            slots,
            |table, values, row| {
                let next = values.0.len() as u32;
                let Some(bits) = scratch[row] else {
                    return *null_slot.get_or_insert_with(|| {
                        values.0.push(0);
                        next
                    });
                };
                let hash32 = hashes[row];
                match table.entry(
                    table_hash(hash32),
                    |&(slot, h)| h == hash32 && values.0[slot as usize] == bits,
                    |&(_, h)| table_hash(h),
                ) {
                    Entry::Occupied(found) => found.get().0,
                    Entry::Vacant(vacant) => {
                        values.0.push(bits);
                        vacant.insert((next, hash32));
                        next
                    }
                }
            },
        );
    }

    fn len(&self) -> usize {
        self.values.0.len()
    }

    fn size(&self) -> usize {
        self.table.allocation_size() + self.values.0.capacity() * size_of::<u64>()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{ArrayRef, Int64Array, StringArray};
    use arrow::datatypes::Field;

    use super::*;
    use crate::key::KeyLayout;

    fn slots_of(interner: &mut RowInterner, columns: Vec<ArrayRef>) -> Vec<u32> {
        let fields: Vec<Field> = columns
            .iter()
            .enumerate()
            .map(|(i, c)| Field::new(format!("k{i}"), c.data_type().clone(), true))
            .collect();
        let keys = KeyLayout::try_new(&fields)
            .and_then(|layout| layout.canonicalise(&columns))
            .expect("key columns");
        let mut slots = Vec::new();
        let mut encoded = EncodedKeys::default();
        encoded.encode(&keys, false);
        interner.intern(
            match &encoded.form {
                KeyForm::Rows(rows) => rows,
                KeyForm::Narrow(_) => unreachable!("encoded as rows"),
            },
            &encoded.hashes,
            &mut slots,
        );
        slots
    }

    #[test]
    fn uuid_text_packs_but_stays_distinct_from_other_spellings() {
        let lower = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
        let upper = "0F1E2D3C-4B5A-6978-8796-A5B4C3D2E1F0";
        let mixed = "0f1e2d3c-4b5a-6978-8796-A5B4C3D2E1F0";
        let digits = "01234567-8901-2345-6789-012345678901";
        let values = [
            Some(lower),
            Some(upper),
            Some(mixed),
            Some(digits),
            None,
            Some(""),
        ]
        .repeat(2);
        let mut interner = RowInterner::default();
        let slots = slots_of(
            &mut interner,
            vec![Arc::new(StringArray::from(values)) as ArrayRef],
        );
        assert_eq!(slots, vec![0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]);
        // The canonical spellings take a tag and 16 bytes.
        assert_eq!(interner.arena.get(0).len(), 17);
        assert_eq!(interner.arena.get(2).len(), 1 + 1 + 36);
    }

    #[test]
    fn integers_of_every_size_and_sign_are_distinct_keys() {
        let values: Vec<Option<i64>> = [0, 1, -1, 63, 64, -64, -65, 127, 128, i64::MAX, i64::MIN]
            .into_iter()
            .map(Some)
            .chain([None])
            .collect();
        let mut interner = RowInterner::default();
        let text: ArrayRef = Arc::new(StringArray::from(vec!["a"; values.len()]));
        let ints: ArrayRef = Arc::new(Int64Array::from(values.clone()));
        let first = slots_of(&mut interner, vec![Arc::clone(&text), Arc::clone(&ints)]);
        assert_eq!(first, (0..values.len() as u32).collect::<Vec<_>>());
        let again = slots_of(&mut interner, vec![text, ints]);
        assert_eq!(again, first);
        assert_eq!(
            interner.arena.get(0).len(),
            (1 + 1 + 1) + (1 + 1),
            "a one-letter string and a zero take five bytes"
        );
    }

    #[test]
    fn same_key_agrees_with_slice_equality_at_every_length_and_byte() {
        for len in 0..40usize {
            let key: Vec<u8> = (0..len).map(|i| (i * 37 + len) as u8).collect();
            assert!(same_key(&key, &key.clone()), "length {len}");
            for at in 0..len {
                let mut other = key.clone();
                other[at] ^= 0x40;
                assert!(!same_key(&key, &other), "length {len}, byte {at}");
            }
            let longer = [key.as_slice(), &[0]].concat();
            assert!(!same_key(&key, &longer) && !same_key(&longer, &key));
        }
    }

    #[test]
    fn keys_fill_blocks_and_huge_keys_get_their_own() {
        let mut arena = KeyArena::default();
        let small = vec![7u8; 1000];
        let huge = vec![9u8; BLOCK + 5];
        let edge = vec![3u8; BLOCK - 1];
        for _ in 0..2000 {
            arena.push(&small, small.len());
        }
        arena.push(&huge, huge.len());
        arena.push(&edge, edge.len());
        arena.push(&small, small.len());
        assert_eq!(arena.len(), 2003);
        assert!((0..2000).all(|slot| arena.get(slot) == small.as_slice()));
        assert_eq!(arena.get(2000), huge.as_slice());
        assert_eq!(arena.get(2001), edge.as_slice());
        assert_eq!(arena.get(2002), small.as_slice());
        // Blocks double up to their largest size: little room is left unused, at most in
        // the block the huge keys interrupted and in the last one.
        let stored = 2001 * small.len() + huge.len() + edge.len();
        assert!(
            arena.allocated < stored + 2 * BLOCK,
            "{} for {stored}",
            arena.allocated
        );
        let mut tiny = KeyArena::default();
        tiny.push(b"k", 1);
        assert_eq!(tiny.allocated, FIRST_BLOCK);
    }

    #[test]
    fn keys_copied_with_their_tails_stay_whole_and_blocks_never_move() {
        // Each key is handed over with the rest of a large buffer behind it, so that short
        // keys take the fixed-size copy; enough of them to fill many blocks to the brim.
        let buffer: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut arena = KeyArena::default();
        let mut expected = Vec::new();
        for i in 0..120_000usize {
            let (start, len) = (i * 13 % 4000, i % 41);
            arena.push(&buffer[start..], len);
            expected.push((start, len));
            let capacities: usize = arena.blocks.iter().map(Vec::capacity).sum();
            assert_eq!(capacities, arena.allocated, "a block grew after key {i}");
        }
        assert!(arena.blocks.len() > 2);
        for (slot, &(start, len)) in expected.iter().enumerate() {
            assert_eq!(
                arena.get(slot as u32),
                &buffer[start..start + len],
                "slot {slot}"
            );
        }
    }

    #[test]
    fn keys_of_every_length_come_back_whole_across_blocks() {
        let mut arena = KeyArena::default();
        let key = |i: usize| -> Vec<u8> { vec![(i % 251) as u8; 1 + (i * 7919) % 3000] };
        let n = 3000;
        for i in 0..n {
            arena.push(&key(i), key(i).len());
        }
        assert!(arena.blocks.len() > 3, "the keys span several blocks");
        for i in 0..n {
            assert_eq!(arena.get(i as u32), key(i).as_slice(), "slot {i}");
        }
    }

    #[test]
    fn many_keys_survive_the_table_growing() {
        let n = 300_000;
        let mut interner = RowInterner::default();
        let ids: ArrayRef = Arc::new(StringArray::from_iter_values(
            (0..n).map(|i| format!("key-{i}")),
        ));
        let first = slots_of(&mut interner, vec![Arc::clone(&ids)]);
        assert_eq!(first, (0..n).collect::<Vec<u32>>());
        let reversed: ArrayRef = Arc::new(StringArray::from_iter_values(
            (0..n).rev().map(|i| format!("key-{i}")),
        ));
        let again = slots_of(&mut interner, vec![reversed]);
        assert_eq!(again, (0..n).rev().collect::<Vec<u32>>());
        assert_eq!(interner.len(), n as usize);
    }
}
