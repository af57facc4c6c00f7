//! A vector of `u64` values kept in 32 bits each while they fit.
//!
//! Per-key vectors are most of a dedup's memory, and two of them hold values that fit 32
//! bits in all but huge inputs: input positions (fewer than 4 G rows) and where a key's
//! bytes start in the interner's arena (less than 4 GiB of keys). Storing them in 32 bits
//! is 4 bytes a key less; the first value that needs more widens the whole vector, once.

use crate::prefetch::prefetch_index;

/// `u64` values in 32 bits each until one does not fit, then in 64 bits from there on.
#[derive(Debug)]
pub(crate) enum WideningVec {
    Narrow(Vec<u32>),
    Wide(Vec<u64>),
}

impl Default for WideningVec {
    fn default() -> Self {
        Self::Narrow(Vec::new())
    }
}

impl WideningVec {
    pub(crate) fn len(&self) -> usize {
        match self {
            Self::Narrow(narrow) => narrow.len(),
            Self::Wide(wide) => wide.len(),
        }
    }

    /// Bytes allocated.
    pub(crate) fn size(&self) -> usize {
        match self {
            Self::Narrow(narrow) => narrow.capacity() * size_of::<u32>(),
            Self::Wide(wide) => wide.capacity() * size_of::<u64>(),
        }
    }

    /// Makes room for `additional` more values without moving them again.
    pub(crate) fn reserve(&mut self, additional: usize) {
        match self {
            Self::Narrow(narrow) => narrow.reserve(additional),
            Self::Wide(wide) => wide.reserve(additional),
        }
    }

    /// The value at `index`, if there is one.
    #[inline]
    pub(crate) fn get(&self, index: usize) -> Option<u64> {
        match self {
            Self::Narrow(narrow) => narrow.get(index).map(|&v| u64::from(v)),
            Self::Wide(wide) => wide.get(index).copied(),
        }
    }

    /// The value at `index`, which must be below [`Self::len`].
    #[inline]
    pub(crate) fn at(&self, index: usize) -> u64 {
        match self {
            Self::Narrow(narrow) => u64::from(narrow[index]),
            Self::Wide(wide) => wide[index],
        }
    }

    #[inline]
    pub(crate) fn push(&mut self, value: u64) {
        match self {
            Self::Narrow(narrow) => match u32::try_from(value) {
                Ok(value) => narrow.push(value),
                Err(_) => {
                    self.widen();
                    self.push(value);
                }
            },
            Self::Wide(wide) => wide.push(value),
        }
    }

    /// Replaces the value at `index`, which must be below [`Self::len`].
    #[inline]
    pub(crate) fn set(&mut self, index: usize, value: u64) {
        match self {
            Self::Narrow(narrow) => match u32::try_from(value) {
                Ok(value) => narrow[index] = value,
                Err(_) => {
                    self.widen();
                    self.set(index, value);
                }
            },
            Self::Wide(wide) => wide[index] = value,
        }
    }

    fn widen(&mut self) {
        if let Self::Narrow(narrow) = self {
            let mut wide = Vec::with_capacity(narrow.capacity().max(narrow.len() + 1));
            wide.extend(narrow.iter().map(|&v| u64::from(v)));
            *self = Self::Wide(wide);
        }
    }

    /// Requests the cache line of the value at `index`.
    #[inline]
    pub(crate) fn prefetch(&self, index: usize) {
        match self {
            Self::Narrow(narrow) => prefetch_index(narrow, index),
            Self::Wide(wide) => prefetch_index(wide, index),
        }
    }

    /// Keeps the values whose index `keep` accepts, in order.
    pub(crate) fn retain_indices(&mut self, mut keep: impl FnMut(usize) -> bool) {
        fn retain<T>(values: &mut Vec<T>, keep: &mut impl FnMut(usize) -> bool) {
            let mut index = 0;
            values.retain(|_| {
                index += 1;
                keep(index - 1)
            });
        }
        match self {
            Self::Narrow(narrow) => retain(narrow, &mut keep),
            Self::Wide(wide) => retain(wide, &mut keep),
        }
    }

    pub(crate) fn for_each(&self, mut f: impl FnMut(u64)) {
        match self {
            Self::Narrow(narrow) => narrow.iter().for_each(|&v| f(u64::from(v))),
            Self::Wide(wide) => wide.iter().for_each(|&v| f(v)),
        }
    }

    pub(crate) fn into_wide(self) -> Vec<u64> {
        match self {
            Self::Narrow(narrow) => narrow.into_iter().map(u64::from).collect(),
            Self::Wide(wide) => wide,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_past_32_bits_widen_the_vector_and_keep_the_rest() {
        let big = u64::from(u32::MAX) + 10;
        let mut values = WideningVec::default();
        for v in [5, 1, u64::from(u32::MAX)] {
            values.push(v);
        }
        values.set(1, 2);
        assert!(matches!(values, WideningVec::Narrow(_)));
        values.set(0, big);
        assert!(matches!(values, WideningVec::Wide(_)));
        values.push(big + 1);
        let mut seen = Vec::new();
        values.for_each(|v| seen.push(v));
        assert_eq!(seen, [big, 2, u64::from(u32::MAX), big + 1]);
        assert_eq!(
            (values.get(3), values.get(4), values.at(1)),
            (Some(big + 1), None, 2)
        );
        values.retain_indices(|index| index % 2 == 1);
        assert_eq!(values.into_wide(), [2, big + 1]);

        let mut pushed = WideningVec::default();
        pushed.push(3);
        pushed.push(big);
        assert!(matches!(pushed, WideningVec::Wide(_)));
        assert_eq!((pushed.at(0), pushed.at(1), pushed.len()), (3, big, 2));
    }
}
