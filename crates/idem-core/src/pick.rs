//! `max_by(value, version)` / `min_by(value, version)` per group: the kernel behind the SQL
//! aggregates.
//!
//! A group's state is its best version so far (in [`VersionLayout`]'s byte-comparable
//! encoding) and *where* its value is — an input array and a row — not the value itself, so
//! a wide value is copied once, when the result is built, instead of on every improvement.
//! Input arrays are kept only while a winner points into them; when the kept rows outgrow
//! the groups, the winners are compacted into one array.
//!
//! Rows whose version is null are skipped (as SQL's `max` skips nulls); a group without a
//! non-null version yields null. Equal versions are broken by the value itself (the
//! greater value for `max_by`, the smaller for `min_by`, nulls lowest), so the result does
//! not depend on the order rows or partial states arrive in.

use std::cmp::Ordering;
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, BooleanArray, FixedSizeBinaryArray, make_comparator, new_null_array,
};
use arrow::buffer::NullBuffer;
use arrow::compute::{SortOptions, interleave};
use arrow::datatypes::{DataType, Field};
use arrow::error::ArrowError;

use crate::version::VersionLayout;

/// Which end of the version order a group keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pick {
    /// The row with the greatest version (`max_by`).
    Max,
    /// The row with the smallest version (`min_by`).
    Min,
}

impl Pick {
    /// Whether `ordering` (candidate compared with the current best) makes the candidate win.
    fn wins(self, ordering: Ordering) -> bool {
        match self {
            Self::Max => ordering == Ordering::Greater,
            Self::Min => ordering == Ordering::Less,
        }
    }
}

/// Where a group's current value lives: `arrays[array]`, row `row`.
#[derive(Debug, Clone, Copy)]
struct Slot {
    array: u32,
    row: u32,
}

/// Rows kept beyond the live winners before [`PickByVersion`] compacts them.
const COMPACT_SLACK: usize = 1 << 16;

/// Per-group best value by version, for any value type (see the module docs).
#[derive(Debug)]
pub struct PickByVersion {
    pick: Pick,
    layout: VersionLayout,
    value_type: DataType,
    /// `layout.width()` bytes per group; meaningless where `winners` is `None`.
    best: Vec<u8>,
    winners: Vec<Option<Slot>>,
    arrays: Vec<ArrayRef>,
    kept_rows: usize,
}

impl PickByVersion {
    /// A table for values of `value_type`, ordered by the version column `version`.
    ///
    /// # Errors
    /// A version type idem cannot order.
    pub fn try_new(pick: Pick, value_type: DataType, version: &Field) -> Result<Self, ArrowError> {
        Ok(Self {
            pick,
            layout: VersionLayout::try_new(std::slice::from_ref(version))?,
            value_type,
            best: Vec::new(),
            winners: Vec::new(),
            arrays: Vec::new(),
            kept_rows: 0,
        })
    }

    /// Bytes of one encoded version: the width of [`Self::emit`]'s version array.
    pub fn version_width(&self) -> usize {
        self.layout.width()
    }

    /// Encodes `versions` as [`Self::emit`] and [`Self::merge`] carry them: nulls where the
    /// version or `filter` is null or false.
    ///
    /// # Errors
    /// A version of the wrong type, or pg_lsn text that does not parse.
    pub fn encode_versions(
        &self,
        versions: &ArrayRef,
        filter: Option<&BooleanArray>,
    ) -> Result<FixedSizeBinaryArray, ArrowError> {
        let mut bytes = Vec::new();
        self.layout
            .encode(std::slice::from_ref(versions), versions.len(), &mut bytes)?;
        let valid: Vec<bool> = (0..versions.len())
            .map(|i| versions.is_valid(i) && filter.is_none_or(|f| f.is_valid(i) && f.value(i)))
            .collect();
        FixedSizeBinaryArray::try_new(
            self.width_i32()?,
            bytes.into(),
            Some(NullBuffer::from(valid)),
        )
    }

    fn width_i32(&self) -> Result<i32, ArrowError> {
        i32::try_from(self.layout.width())
            .map_err(|_| ArrowError::InvalidArgumentError("version too wide".into()))
    }

    /// Offers every row of `values` to its group, ranked by `versions` (raw version
    /// column). Rows where `filter` is false or null are skipped.
    ///
    /// # Errors
    /// Arrays of different lengths, a version of the wrong type or unparseable pg_lsn.
    pub fn update(
        &mut self,
        values: &ArrayRef,
        versions: &ArrayRef,
        groups: &[usize],
        filter: Option<&BooleanArray>,
        num_groups: usize,
    ) -> Result<(), ArrowError> {
        let encoded = self.encode_versions(versions, filter)?;
        self.merge(values, &encoded, groups, num_groups)
    }

    /// Offers every row of `values` to its group, ranked by already-encoded `versions` (as
    /// [`Self::emit`] returns them); rows with a null version are skipped.
    ///
    /// # Errors
    /// Arrays of different lengths or widths.
    pub fn merge(
        &mut self,
        values: &ArrayRef,
        versions: &FixedSizeBinaryArray,
        groups: &[usize],
        num_groups: usize,
    ) -> Result<(), ArrowError> {
        let width = self.layout.width();
        if values.len() != groups.len() || versions.len() != groups.len() {
            return Err(ArrowError::InvalidArgumentError(format!(
                "max_by/min_by: {} values, {} versions, {} group indices",
                values.len(),
                versions.len(),
                groups.len()
            )));
        }
        if versions.value_length() as usize != width {
            return Err(ArrowError::InvalidArgumentError(format!(
                "max_by/min_by: versions of {} bytes, expected {width}",
                versions.value_length()
            )));
        }
        self.grow(num_groups);
        let array = u32::try_from(self.arrays.len())
            .map_err(|_| ArrowError::InvalidArgumentError("too many input arrays".into()))?;
        let mut used = false;
        for (row, &group) in groups.iter().enumerate() {
            if versions.is_null(row) {
                continue;
            }
            let candidate = versions.value(row);
            let best = &self.best[group * width..(group + 1) * width];
            let wins = match self.winners[group] {
                None => true,
                Some(current) => match candidate.cmp(best) {
                    Ordering::Equal => {
                        // Ties go to the greater (max_by) / smaller (min_by) value, so the
                        // result is the same whatever order the rows came in.
                        let held = &self.arrays[current.array as usize];
                        let compare = make_comparator(
                            values.as_ref(),
                            held.as_ref(),
                            SortOptions::default(),
                        )?;
                        self.pick.wins(compare(row, current.row as usize))
                    }
                    ordering => self.pick.wins(ordering),
                },
            };
            if wins {
                self.best[group * width..(group + 1) * width].copy_from_slice(candidate);
                // A value compared with itself in a tie above must see this batch kept.
                if !used {
                    used = true;
                    self.arrays.push(Arc::clone(values));
                    self.kept_rows += values.len();
                }
                self.winners[group] = Some(Slot {
                    array,
                    row: row as u32,
                });
            }
        }
        if self.kept_rows > 2 * self.winners.len() + COMPACT_SLACK {
            self.compact()?;
        }
        Ok(())
    }

    fn grow(&mut self, num_groups: usize) {
        if self.winners.len() < num_groups {
            self.winners.resize(num_groups, None);
            self.best.resize(num_groups * self.layout.width(), 0);
        }
    }

    /// Copies every winner into one array and drops the rest of the kept input.
    fn compact(&mut self) -> Result<(), ArrowError> {
        let values = self.gather(0..self.winners.len())?;
        self.arrays = vec![values];
        self.kept_rows = self.winners.len();
        for (row, winner) in self.winners.iter_mut().enumerate() {
            if winner.is_some() {
                *winner = Some(Slot {
                    array: 0,
                    row: row as u32,
                });
            }
        }
        Ok(())
    }

    /// The values of `groups`, null where a group has no winner.
    fn gather(&self, groups: std::ops::Range<usize>) -> Result<ArrayRef, ArrowError> {
        let null = new_null_array(&self.value_type, 1);
        let mut sources: Vec<&dyn Array> = self.arrays.iter().map(AsRef::as_ref).collect();
        sources.push(null.as_ref());
        let null_source = self.arrays.len();
        let indices: Vec<(usize, usize)> = self.winners[groups]
            .iter()
            .map(|w| match w {
                Some(slot) => (slot.array as usize, slot.row as usize),
                None => (null_source, 0),
            })
            .collect();
        interleave(&sources, &indices)
    }

    /// The values and encoded versions of the first `count` groups (all if `None`), which
    /// are then forgotten: the remaining groups are renumbered from 0.
    ///
    /// # Errors
    /// Arrow failing to build the arrays.
    pub fn emit(
        &mut self,
        count: Option<usize>,
    ) -> Result<(ArrayRef, FixedSizeBinaryArray), ArrowError> {
        let count = count.unwrap_or(self.winners.len()).min(self.winners.len());
        let width = self.layout.width();
        let values = self.gather(0..count)?;
        let valid: Vec<bool> = self.winners[..count].iter().map(Option::is_some).collect();
        let versions = FixedSizeBinaryArray::try_new(
            self.width_i32()?,
            self.best[..count * width].to_vec().into(),
            Some(NullBuffer::from(valid)),
        )?;
        self.winners.drain(..count);
        self.best.drain(..count * width);
        if self.winners.is_empty() {
            self.arrays.clear();
            self.kept_rows = 0;
        }
        Ok((values, versions))
    }

    /// Bytes held: per-group state plus the kept input arrays.
    pub fn size(&self) -> usize {
        self.best.capacity()
            + self.winners.capacity() * std::mem::size_of::<Option<Slot>>()
            + self
                .arrays
                .iter()
                .map(|a| a.get_array_memory_size())
                .sum::<usize>()
    }
}

/// `versions` as a [`FixedSizeBinaryArray`], the form [`PickByVersion::merge`] takes.
///
/// # Errors
/// `versions` is not fixed-size binary.
pub fn as_encoded_versions(versions: &ArrayRef) -> Result<&FixedSizeBinaryArray, ArrowError> {
    versions.as_fixed_size_binary_opt().ok_or_else(|| {
        ArrowError::InvalidArgumentError(format!(
            "max_by/min_by state: expected encoded versions, got {}",
            versions.data_type()
        ))
    })
}

#[cfg(test)]
mod tests {
    use arrow::array::{Int64Array, StringArray};

    use super::*;
    use crate::rng::SplitMix64;

    fn table(pick: Pick) -> PickByVersion {
        PickByVersion::try_new(
            pick,
            DataType::Utf8,
            &Field::new("v", DataType::Int64, true),
        )
        .expect("table")
    }

    fn strings(array: &ArrayRef) -> Vec<Option<String>> {
        array
            .as_string::<i32>()
            .iter()
            .map(|s| s.map(str::to_owned))
            .collect()
    }

    #[test]
    fn keeps_the_greatest_or_smallest_version_and_skips_null_versions() {
        for (pick, expected) in [(Pick::Max, ["b", "x"]), (Pick::Min, ["a", "x"])] {
            let mut t = table(pick);
            let values: ArrayRef = Arc::new(StringArray::from(vec!["a", "b", "n", "x", "y"]));
            let versions: ArrayRef = Arc::new(Int64Array::from(vec![
                Some(1),
                Some(5),
                None,
                Some(2),
                None,
            ]));
            t.update(&values, &versions, &[0, 0, 0, 1, 2], None, 3)
                .expect("update");
            let (out, _) = t.emit(None).expect("emit");
            assert_eq!(
                strings(&out),
                vec![Some(expected[0].into()), Some(expected[1].into()), None]
            );
        }
    }

    #[test]
    fn ties_do_not_depend_on_arrival_order() {
        let values: ArrayRef = Arc::new(StringArray::from(vec![Some("p"), None, Some("q")]));
        let versions: ArrayRef = Arc::new(Int64Array::from(vec![7, 7, 7]));
        for order in [[0usize, 1, 2], [2, 1, 0], [1, 2, 0]] {
            let mut t = table(Pick::Max);
            for row in order {
                t.update(
                    &values.slice(row, 1),
                    &versions.slice(row, 1),
                    &[0],
                    None,
                    1,
                )
                .expect("update");
            }
            let (out, _) = t.emit(None).expect("emit");
            assert_eq!(strings(&out), vec![Some("q".into())], "order {order:?}");
        }
    }

    #[test]
    fn filter_emit_first_and_merge_of_partial_states() {
        let mut partial = table(Pick::Max);
        let values: ArrayRef = Arc::new(StringArray::from(vec!["a", "b", "c"]));
        let versions: ArrayRef = Arc::new(Int64Array::from(vec![1, 9, 3]));
        let filter = BooleanArray::from(vec![true, false, true]);
        partial
            .update(&values, &versions, &[0, 0, 1], Some(&filter), 2)
            .expect("update");
        let (first, first_versions) = partial.emit(Some(1)).expect("emit");
        assert_eq!(strings(&first), vec![Some("a".into())]);
        // The remaining group is renumbered to 0.
        let (rest, rest_versions) = partial.emit(None).expect("emit");
        assert_eq!(strings(&rest), vec![Some("c".into())]);

        let mut merged = table(Pick::Max);
        merged.merge(&rest, &rest_versions, &[0], 1).expect("merge");
        merged
            .merge(&first, &first_versions, &[0], 1)
            .expect("merge");
        let (out, _) = merged.emit(None).expect("emit");
        assert_eq!(strings(&out), vec![Some("c".into())]);
    }

    /// Many batches with few groups force compactions; the result must equal a direct
    /// computation.
    #[test]
    fn compaction_keeps_the_winners() {
        let mut rng = SplitMix64::new(3);
        let mut t = table(Pick::Max);
        let groups = 50;
        let mut best: Vec<Option<(i64, String)>> = vec![None; groups];
        for _ in 0..40 {
            let n = 4096;
            let vs: Vec<i64> = (0..n).map(|_| rng.below(1_000_000) as i64).collect();
            let texts: Vec<String> = (0..n)
                .map(|i| format!("v{}-{i}", rng.below(1000)))
                .collect();
            let gs: Vec<usize> = (0..n).map(|_| rng.below(groups as u64) as usize).collect();
            for ((&v, text), &g) in vs.iter().zip(&texts).zip(&gs) {
                let better = match &best[g] {
                    None => true,
                    Some((bv, bt)) => v > *bv || (v == *bv && text > bt),
                };
                if better {
                    best[g] = Some((v, text.clone()));
                }
            }
            let values: ArrayRef = Arc::new(StringArray::from(texts));
            let versions: ArrayRef = Arc::new(Int64Array::from(vs));
            t.update(&values, &versions, &gs, None, groups)
                .expect("update");
            assert!(t.kept_rows <= 2 * groups + COMPACT_SLACK + n);
        }
        let (out, _) = t.emit(None).expect("emit");
        let expected: Vec<Option<String>> = best.into_iter().map(|b| b.map(|(_, t)| t)).collect();
        assert_eq!(strings(&out), expected);
    }
}
