//! The plan of the rows pass 2 reads from one file: which runs of rows, which of them are
//! kept, which are tied. Pass 1's selection makes it; both of pass 2's readers follow it.

use std::ops::Range;

use arrow::array::{BooleanArray, BooleanBufferBuilder};
use arrow::buffer::BooleanBuffer;
use idem_core::TieRow;

/// Gaps between selected rows shorter than this are read and dropped by pass 2's own
/// filter (row by row, or field by field for a wide schema) instead of being skipped by
/// the Parquet reader. A selection fragmented into
/// short runs makes the reader decode every row anyway and filter its batch with a mask
/// (its `RowSelectionPolicy::Auto`, at about the same run length), and pass 2 then
/// filtered that batch a second time by its keep mask: one copy of every kept value too
/// many. Reading the short gaps leaves the reader long runs, which it decodes straight
/// into its batch, and the keep mask drops the gaps with the losers in one filter.
pub(crate) const DECODE_GAPS_BELOW: u64 = 32;

/// The rows pass 2 reads from one file, as runs: which of them it keeps, which are tied.
///
/// Built a 64-row word at a time from the winners' bits: nearly every row of a file is
/// read (short gaps are), so a list of row numbers and a flag per row cost a pass over the
/// rows and 13 bytes each, where runs, a bit per row and the tied rows alone do not.
pub(crate) struct FilePlan {
    /// Runs of the file's rows to read, ascending, apart by at least the plan's gap.
    ranges: Vec<Range<u64>>,
    /// A bit per row read, in order: whether the row is kept.
    keep: BooleanBuffer,
    /// The tied rows among those read: their index among them and their tie group,
    /// ascending.
    ties: Vec<(u64, u32)>,
}

impl FilePlan {
    /// The plan of a file whose first row is at position `start`: `keep` has a bit per
    /// row of the file, set for its kept rows, and `ties` are its tied rows, ascending.
    /// Every gap of fewer than `gaps_below` rows between two rows kept or tied is read too,
    /// as rows neither kept nor tied (see [`DECODE_GAPS_BELOW`]).
    pub(crate) fn new(
        keep: &BooleanBuffer,
        ties: impl Iterator<Item = TieRow>,
        start: u64,
        gaps_below: u64,
    ) -> Self {
        let ties: Vec<(u64, u32)> = ties.map(|t| (t.position - start, t.group)).collect();
        let mut wanted = BooleanBufferBuilder::new(keep.len());
        wanted.append_buffer(keep);
        for &(row, _) in &ties {
            wanted.set_bit(row as usize, true);
        }
        let mut ranges: Vec<Range<u64>> = Vec::new();
        for (from, to) in wanted.finish().set_slices() {
            let (from, to) = (from as u64, to as u64);
            match ranges.last_mut() {
                Some(last) if from - last.end < gaps_below => last.end = to,
                _ => ranges.push(from..to),
            }
        }
        let read: u64 = ranges.iter().map(|r| r.end - r.start).sum();
        let mut kept = BooleanBufferBuilder::new(read as usize);
        for range in &ranges {
            kept.append_buffer(
                &keep.slice(range.start as usize, (range.end - range.start) as usize),
            );
        }
        // Each tied row's index among the rows read: the rows of the runs before its own,
        // and its place in its run.
        let mut runs = ranges.iter().peekable();
        let mut read_before = 0;
        let ties = ties
            .into_iter()
            .map(|(row, group)| {
                while let Some(run) = runs.next_if(|run| run.end <= row) {
                    read_before += run.end - run.start;
                }
                let run_start = runs.peek().map_or(row, |run| run.start);
                (read_before + row - run_start, group)
            })
            .collect();
        Self {
            ranges,
            keep: kept.finish(),
            ties,
        }
    }

    /// The runs of rows to read.
    pub(crate) fn ranges(&self) -> &[Range<u64>] {
        &self.ranges
    }

    /// How many rows are read.
    pub(crate) fn rows_read(&self) -> usize {
        self.keep.len()
    }

    /// The rows, whether each is kept, and the tie group of each (`u32::MAX` for none).
    pub(crate) fn into_parts(self) -> (Vec<u64>, Vec<bool>, Vec<u32>) {
        let rows: Vec<u64> = self.ranges.iter().flat_map(Range::clone).collect();
        let keep = self.keep.iter().collect();
        let mut group = vec![u32::MAX; rows.len()];
        for (at, tie) in self.ties {
            group[at as usize] = tie;
        }
        (rows, keep, group)
    }

    /// The keep mask and the (row, group) tie list of rows read `cursor..cursor + n`.
    pub(crate) fn slice(&self, cursor: usize, n: usize) -> (BooleanArray, (Vec<u32>, Vec<u32>)) {
        let end = (cursor + n).min(self.keep.len());
        let cursor = cursor.min(end);
        let keep = BooleanArray::new(self.keep.slice(cursor, end - cursor), None);
        let (from, to) = (cursor as u64, end as u64);
        let first = self.ties.partition_point(|&(at, _)| at < from);
        let ties = self.ties[first..]
            .iter()
            .take_while(|&&(at, _)| at < to)
            .map(|&(at, group)| ((at - from) as u32, group))
            .unzip();
        (keep, ties)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file's keep bits: `rows` bits, set at `kept`.
    fn bits(rows: usize, kept: &[usize]) -> BooleanBuffer {
        let mut bits = BooleanBufferBuilder::new(rows);
        bits.append_n(rows, false);
        for &row in kept {
            bits.set_bit(row, true);
        }
        bits.finish()
    }

    fn tie(position: u64, group: u32) -> TieRow {
        TieRow { position, group }
    }

    #[test]
    fn short_gaps_are_read_and_neither_kept_nor_tied() {
        // Positions start at 100: rows 0, 1, 3, 40 and 100 of the file are wanted.
        let keep = bits(120, &[0, 1, 40, 100]);
        let plan = FilePlan::new(&keep, [tie(103, 0), tie(200, 1)].into_iter(), 100, 4);
        // The gap of one row (2) is read; those of 36 and 59 rows are skipped.
        assert_eq!(plan.ranges(), [0..4, 40..41, 100..101]);
        let (rows, kept, groups) =
            FilePlan::new(&keep, [tie(103, 0), tie(200, 1)].into_iter(), 100, 4).into_parts();
        assert_eq!(rows, [0, 1, 2, 3, 40, 100]);
        assert_eq!(kept, [true, true, false, false, true, true]);
        assert_eq!(groups, [u32::MAX, u32::MAX, u32::MAX, 0, u32::MAX, 1]);

        let (keep, (tie_rows, groups)) = plan.slice(1, 3);
        assert_eq!(keep, BooleanArray::from(vec![true, false, false]));
        assert_eq!((tie_rows, groups), (vec![2], vec![0]));
        let (keep, (tie_rows, groups)) = plan.slice(4, 10);
        assert_eq!(keep, BooleanArray::from(vec![true, true]));
        assert_eq!((tie_rows, groups), (vec![1], vec![1]));

        let dense = FilePlan::new(&bits(3, &[0, 1, 2]), std::iter::empty(), 0, 32);
        assert_eq!(dense.ranges(), std::slice::from_ref(&(0..3)));
        let none = FilePlan::new(&bits(5, &[]), std::iter::empty(), 10, 32);
        assert_eq!(none.rows_read(), 0);
        assert!(none.ranges().is_empty());
    }

    /// Against the row-by-row rule, on random plans: a row is read when it is kept, tied,
    /// or in a gap shorter than the limit between two such rows.
    #[test]
    fn plans_read_what_the_row_by_row_rule_reads() {
        let mut rng = idem_core::rng::SplitMix64::new(7);
        for round in 0..200 {
            let rows = (rng.next_u64() % 300) as usize;
            let start = rng.next_u64() % 1000;
            let gaps_below = rng.next_u64() % 40;
            let density = rng.next_u64() % 100;
            let kept: Vec<usize> = (0..rows)
                .filter(|_| rng.next_u64() % 100 < density)
                .collect();
            let ties: Vec<TieRow> = (0..rows)
                .filter(|_| rng.next_u64() % 100 < density / 3)
                .map(|row| tie(start + row as u64, row as u32 * 7))
                .collect();
            let wanted: Vec<u64> = (0..rows as u64)
                .filter(|row| {
                    kept.contains(&(*row as usize))
                        || ties.iter().any(|t| t.position == start + row)
                })
                .collect();
            let mut expected = Vec::new();
            for (i, &row) in wanted.iter().enumerate() {
                if let Some(&previous) = i.checked_sub(1).map(|p| &wanted[p])
                    && row - previous - 1 < gaps_below
                {
                    expected.extend(previous + 1..row);
                }
                expected.push(row);
            }
            let plan = FilePlan::new(
                &bits(rows, &kept),
                ties.clone().into_iter(),
                start,
                gaps_below,
            );
            let (read, keep, groups) = plan.into_parts();
            assert_eq!(read, expected, "round {round}");
            for (i, &row) in read.iter().enumerate() {
                assert_eq!(
                    keep[i],
                    kept.contains(&(row as usize)),
                    "round {round} row {row}"
                );
                let group = ties
                    .iter()
                    .find(|t| t.position == start + row)
                    .map_or(u32::MAX, |t| t.group);
                assert_eq!(groups[i], group, "round {round} row {row}");
            }
        }
    }
}
