//! Asking for memory before it is needed.
//!
//! A key table much larger than the CPU caches costs a cache miss per row, and several for
//! a key seen before (its table entry, where its bytes are, the bytes, its winner and
//! version). One row's misses depend on each other, but different rows' do not: requesting
//! the lines a row a few places ahead will touch keeps several misses in flight instead of
//! one, which halves the time of a large table's update (`benches/RESULTS.md`).
//!
//! Prefetches are hints: a wrong or stale address costs a wasted request, never a wrong
//! result.

use hashbrown::HashTable;

/// Requests the cache line holding `slice[index]`; nothing when `index` is out of range.
#[inline]
pub(crate) fn prefetch_index<T>(slice: &[T], index: usize) {
    if index < slice.len() {
        prefetch_address(slice.as_ptr().wrapping_add(index) as usize);
    }
}

/// Requests the cache line holding `address`.
#[inline]
#[allow(unsafe_code)]
fn prefetch_address(address: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch only hints the cache; it reads nothing the program can observe
    // and does not fault, whatever the address.
    unsafe {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        _mm_prefetch::<_MM_HINT_T0>(address as *const i8);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = address;
}

/// Where a probe of a hashbrown table starts, so that it can be requested ahead.
///
/// hashbrown keeps its entries in one allocation, entry `i` at `data_end - (i + 1)` entries
/// and the control bytes from `data_end` on, and starts a probe at entry and control byte
/// `hash & (buckets - 1)`. The layout is hashbrown's, not a documented contract: the tests
/// check it against the crate in use, and were it to change, prefetches would only miss.
#[derive(Debug)]
pub(crate) struct TableLayout {
    data_end: usize,
    mask: u64,
    entry_size: usize,
}

impl TableLayout {
    /// The layout of `table` as it is now (valid until it grows); `None` when it is empty.
    pub(crate) fn of<T>(table: &HashTable<T>) -> Option<Self> {
        let index = table.iter_buckets().next()?;
        let entry = std::ptr::from_ref(table.get_bucket(index)?) as usize;
        let entry_size = size_of::<T>();
        Some(Self {
            data_end: entry + (index + 1) * entry_size,
            mask: table.num_buckets() as u64 - 1,
            entry_size,
        })
    }

    /// Requests the control bytes and the first entry a probe for `hash` reads.
    #[inline]
    pub(crate) fn prefetch(&self, hash: u64) {
        let start = (hash & self.mask) as usize;
        prefetch_address(self.data_end + start);
        prefetch_address(self.data_end - (start + 1) * self.entry_size);
    }

    /// Where entry `index` lies, by the layout.
    #[cfg(test)]
    fn entry_address(&self, index: usize) -> usize {
        self.data_end - (index + 1) * self.entry_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layout_matches_the_hashbrown_in_use() {
        let hash = |v: &(u32, u32)| u64::from(v.0).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let mut table = HashTable::new();
        assert!(TableLayout::of(&table).is_none());
        for grown in [10u32, 1_000, 100_000] {
            for v in table.len() as u32..grown {
                table.insert_unique(hash(&(v, v)), (v, v), hash);
            }
            let layout = TableLayout::of(&table).expect("a full table");
            let mut checked = 0;
            for index in table.iter_buckets() {
                let entry = table.get_bucket(index).expect("a full bucket");
                assert_eq!(
                    layout.entry_address(index),
                    std::ptr::from_ref(entry) as usize
                );
                checked += 1;
            }
            assert_eq!(checked, table.len());
            // Each value's probe starts at its hash's bucket: nearly all values sit in the
            // group of 16 that starts there.
            let near_start = table
                .iter_buckets()
                .filter(|&index| {
                    let entry = table.get_bucket(index).expect("a full bucket");
                    let start = (hash(entry) & layout.mask) as usize;
                    (index.wrapping_sub(start) & layout.mask as usize) < 16
                })
                .count();
            assert!(
                near_start * 10 > table.len() * 9,
                "{near_start} of {}",
                table.len()
            );
        }
    }
}
