//! Pass 2 a column at a time, for wide schemas: the winners as a
//! [`ColumnSource`] that [`crate::write::by_field`] writes one field of one row group at a
//! time, so that only two fields' readers and writers are alive at once.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};

use arrow::array::{ArrayRef, BooleanArray, new_null_array};
use arrow::datatypes::{Schema, SchemaRef};
use idem_core::mix_value_hashes_at;

use super::decide::Selection;
use crate::error::{Error, Result};
use crate::read::input::{InputFile, RowsToRead};
use crate::read::schema::{conform, with_views};
use crate::write::by_field::ColumnSource;

/// Fields from which a dedup's pass 2 goes column by column. Below, whole rows cost little
/// memory and the row-wise pass keeps both cores busier.
pub(crate) const COLUMNWISE_FROM_FIELDS: usize = 32;

/// A dedup's winners, as a [`ColumnSource`]: output row `n` is the `n`-th kept row in
/// input order. Each file's plan is made when the output reaches the file and dropped once
/// it is past, so that only a file or two's are held.
///
/// The rows tied at a key's winning version are compared on the way, column by column:
/// each read of a field takes the tied rows with the kept ones, adds the hash of each tied
/// row's value (mixed with the field's number) to the row's sum, and once every field is
/// read, rows of one key with different sums differ in some column — what
/// [`idem_core::TieCheck`] finds from whole rows.
pub(crate) struct Winners<'a> {
    files: &'a [InputFile],
    schema: SchemaRef,
    /// Fields whose values are compared between tied rows: all but the key's.
    compared: Vec<bool>,
    selection: &'a mut Selection,
    /// The next file to plan, and the position of its first row.
    next_file: usize,
    next_position: u64,
    /// Planned files, in input order.
    planned: VecDeque<PlannedFile>,
    /// Output rows of every file planned so far.
    planned_rows: u64,
    kept_per_file: Vec<u64>,
    /// The slices of the planned files that the output rows last prepared own.
    current: Vec<FileSlice>,
    /// The tie group of every tied row planned so far, by tie number.
    tie_groups: Vec<u32>,
    /// Every tied row's sum of value hashes, by tie number.
    tie_sums: Mutex<Vec<u128>>,
}

/// One file's plan: the rows pass 2 reads, in order.
struct PlannedFile {
    file: usize,
    /// The output row of the file's first kept row.
    first_row: u64,
    rows: Vec<u64>,
    keep: Vec<bool>,
    /// The tie number of each row, [`NOT_TIED`] for none.
    tie: Vec<u32>,
    /// The index into `rows` of each kept row.
    kept_at: Vec<usize>,
}

/// No tie number.
const NOT_TIED: u32 = u32::MAX;

/// The rows of one file that a range of output rows owns: its kept rows, and the tied rows
/// among or just before them.
struct FileSlice {
    file: usize,
    rows: RowsToRead,
    /// Which of `rows` are kept; `None` when all are.
    keep: Option<BooleanArray>,
    /// (index into `rows`, tie number) of the tied rows, ascending.
    ties: Vec<(usize, u32)>,
}

impl PlannedFile {
    fn end_row(&self) -> u64 {
        self.first_row + self.kept_at.len() as u64
    }

    /// The indices into `rows` that output rows `rows` own: a row after `n` kept rows of
    /// the file belongs with output row `first_row + n`; with `last`, the rows after the
    /// last kept row belong to the range too.
    fn owned(&self, rows: &Range<u64>, last: bool) -> Range<usize> {
        // The index of the first row after `n` kept rows.
        let after = |n: u64| match usize::try_from(n).unwrap_or(usize::MAX) {
            0 => 0,
            n if n > self.kept_at.len() => self.rows.len(),
            n => self.kept_at[n - 1] + 1,
        };
        let start = after(rows.start.saturating_sub(self.first_row));
        let end = if last {
            self.rows.len()
        } else {
            after(rows.end.saturating_sub(self.first_row))
        };
        start..end.max(start)
    }
}

impl<'a> Winners<'a> {
    /// The winners of `files` (whose unified schema is `schema`) that `selection` keeps,
    /// `keys` the dedup's key columns.
    pub(crate) fn new(
        files: &'a [InputFile],
        schema: SchemaRef,
        keys: &[String],
        selection: &'a mut Selection,
    ) -> Self {
        Self {
            compared: schema
                .fields()
                .iter()
                .map(|f| !keys.contains(f.name()))
                .collect(),
            files,
            schema,
            selection,
            next_file: 0,
            next_position: 0,
            planned: VecDeque::new(),
            planned_rows: 0,
            kept_per_file: vec![0; files.len()],
            current: Vec::new(),
            tie_groups: Vec::new(),
            tie_sums: Mutex::new(Vec::new()),
        }
    }

    /// Plans the files not yet planned; returns the kept rows of each file and the number
    /// of tie groups whose rows differ (each tied row must have been read by then).
    pub(crate) fn finish(mut self) -> Result<(Vec<u64>, u64)> {
        while self.plan_next()? {}
        let sums = self
            .tie_sums
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        let groups = self.tie_groups.iter().max().map_or(0, |&g| g as usize + 1);
        let mut first: Vec<Option<u128>> = vec![None; groups];
        let mut conflicted = vec![false; groups];
        for (&group, &sum) in self.tie_groups.iter().zip(&sums) {
            let g = group as usize;
            match first[g] {
                None => first[g] = Some(sum),
                Some(seen) if seen != sum => conflicted[g] = true,
                Some(_) => {}
            }
        }
        let conflicts = conflicted.iter().filter(|&&c| c).count() as u64;
        Ok((self.kept_per_file, conflicts))
    }

    /// Plans the next file; false when every file is planned.
    fn plan_next(&mut self) -> Result<bool> {
        let Some(file) = self.files.get(self.next_file) else {
            return Ok(false);
        };
        let end = self.next_position + file.num_rows();
        let (rows, keep, groups) = self.selection.plan(self.next_position, end)?.into_parts();
        let kept_at: Vec<usize> = (0..rows.len()).filter(|&i| keep[i]).collect();
        self.kept_per_file[self.next_file] = kept_at.len() as u64;
        let tie = groups
            .iter()
            .map(|&group| {
                if group == u32::MAX {
                    return NOT_TIED;
                }
                self.tie_groups.push(group);
                (self.tie_groups.len() - 1) as u32
            })
            .collect();
        let tied = self.tie_groups.len();
        self.tie_sums
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .resize(tied, 0);
        if !rows.is_empty() {
            let first_row = self.planned_rows;
            self.planned_rows += kept_at.len() as u64;
            self.planned.push_back(PlannedFile {
                file: self.next_file,
                first_row,
                rows,
                keep,
                tie,
                kept_at,
            });
        }
        self.next_file += 1;
        self.next_position = end;
        Ok(true)
    }

    /// Adds the hashes of field `field`'s values at the tied rows of `slice` among its rows
    /// `read` (whose values are `values`) to the tied rows' sums.
    fn add_tie_hashes(
        &self,
        field: usize,
        slice: &FileSlice,
        read: Range<usize>,
        values: &ArrayRef,
    ) -> Result<()> {
        if !self.compared[field] {
            return Ok(());
        }
        let from = slice.ties.partition_point(|&(at, _)| at < read.start);
        let to = slice.ties.partition_point(|&(at, _)| at < read.end);
        if from == to {
            return Ok(());
        }
        let path = self.files[slice.file].path();
        let (at, ties): (Vec<u32>, Vec<u32>) = slice.ties[from..to]
            .iter()
            .map(|&(at, tie)| ((at - read.start) as u32, tie))
            .unzip();
        let mut hashes = vec![0u128; at.len()];
        mix_value_hashes_at(values.as_ref(), &at, &mut hashes).map_err(Error::arrow(path))?;
        // An odd multiplier per field: a bijection, so a field's differing values never
        // sum the same, and equal values in two fields do not cancel out.
        let weight = (u128::from(field as u64) << 1 | 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut sums = self.tie_sums.lock().unwrap_or_else(PoisonError::into_inner);
        for (tie, hash) in ties.into_iter().zip(hashes) {
            if let Some(sum) = sums.get_mut(tie as usize) {
                *sum = sum.wrapping_add(hash.wrapping_mul(weight));
            }
        }
        Ok(())
    }
}

impl ColumnSource for Winners<'_> {
    fn prepare(&mut self, rows: Range<u64>) -> Result<u64> {
        while self
            .planned
            .front()
            .is_some_and(|p| p.end_row() < rows.start)
        {
            self.planned.pop_front();
        }
        // Files whose first output row is the range's end are planned too: files of tied
        // rows only, right at the end, then belong to this range as its last.
        while self.planned_rows <= rows.end && self.plan_next()? {}
        let last = self.next_file == self.files.len() && self.planned_rows <= rows.end;
        let end = rows.end.min(self.planned_rows).max(rows.start);
        let owned = rows.start..end;
        self.current = if end == rows.start {
            Vec::new()
        } else {
            self.planned
                .iter()
                .filter_map(|p| {
                    let owned = p.owned(&owned, last);
                    let keep = &p.keep[owned.clone()];
                    (!owned.is_empty()).then(|| FileSlice {
                        file: p.file,
                        rows: self.files[p.file].rows_to_read(p.rows[owned.clone()].to_vec()),
                        keep: (!keep.iter().all(|&k| k)).then(|| BooleanArray::from(keep.to_vec())),
                        ties: owned
                            .clone()
                            .enumerate()
                            .filter(|&(_, i)| p.tie[i] != NOT_TIED)
                            .map(|(at, i)| (at, p.tie[i]))
                            .collect(),
                    })
                })
                .collect()
        };
        Ok(end)
    }

    fn fetch(&self, field: usize, rows: Range<u64>) -> Result<Vec<ArrayRef>> {
        let definition = self.schema.field(field);
        // Text as views, as row by row (see `with_views`).
        let target: SchemaRef = Arc::new(with_views(&Schema::new(vec![definition.clone()])));
        let mut arrays = Vec::new();
        for slice in &self.current {
            let file = &self.files[slice.file];
            let mut read = 0;
            let mut kept = |values: ArrayRef| -> Result<()> {
                let len = values.len();
                self.add_tie_hashes(field, slice, read..read + len, &values)?;
                arrays.push(match &slice.keep {
                    None => values,
                    Some(keep) => arrow::compute::filter(&values, &keep.slice(read, len))
                        .map_err(Error::arrow(file.path()))?,
                });
                read += len;
                Ok(())
            };
            match file.read_column(definition.name(), &slice.rows)? {
                Some(batches) => {
                    for batch in batches {
                        let batch = conform(&batch?, &target, false, file.path())?;
                        kept(Arc::clone(batch.column(0)))?;
                    }
                }
                None => kept(new_null_array(
                    target.field(0).data_type(),
                    slice.rows.len(),
                ))?,
            }
            if read != slice.rows.len() {
                return Err(Error::InvalidArgument(format!(
                    "{}: expected {} rows of column '{}', read {read}; was the file changed \
                     during the run?",
                    file.path().display(),
                    slice.rows.len(),
                    definition.name(),
                )));
            }
        }
        let fetched: usize = arrays.iter().map(|a| a.len()).sum();
        if fetched as u64 != rows.end - rows.start {
            return Err(Error::InvalidArgument(format!(
                "column '{}': {fetched} values for output rows {rows:?}",
                definition.name()
            )));
        }
        Ok(arrays)
    }
}
