//! Conflict detection among tied rows.
//!
//! Ties are the normal face of at-least-once delivery: the same event, replayed, carries the
//! same key and version. They are harmless when the tied rows are identical; when they
//! differ in some non-key column the producer sent two different facts under one version,
//! and which one survives depends only on input order. A [`TieCheck`] counts such keys
//! (`conflicts`) from a 128-bit hash of each tied row's non-key values
//! ([`crate::mix_value_hashes`]), and fails at the first one under [`TiePolicy::Error`].

use arrow::array::RecordBatch;
use arrow::datatypes::Schema;
use arrow::error::ArrowError;
use arrow::row::{RowConverter, SortField};
use arrow::util::display::{ArrayFormatter, FormatOptions};

use crate::options::{DedupSpec, TiePolicy};
use crate::rowhash::{content_type, mix_value_hashes_at};
use crate::table::PositionBits;

/// Compares the tie rows of a [`crate::Resolution`] group by group.
#[derive(Debug)]
pub struct TieCheck {
    spec: DedupSpec,
    hasher: TieHasher,
    /// Per group, the hash of its first row, where `seen` is set. A group's state costs
    /// 16 bytes and two bits rather than the 33 of an `Option<u128>` and a `bool`: at 40M
    /// events there are millions of groups, first touched in pass 2, where each new page
    /// of this vector is a page fault.
    first_hash: Vec<u128>,
    seen: PositionBits,
    conflicted: PositionBits,
    conflicts: u64,
}

impl TieCheck {
    /// A check for `groups` tie groups of rows of `schema`.
    ///
    /// # Errors
    /// A non-key column of a type Arrow's row format cannot encode.
    pub fn try_new(schema: &Schema, spec: &DedupSpec, groups: u32) -> Result<Self, ArrowError> {
        let content: Vec<String> = schema
            .fields()
            .iter()
            .filter(|f| !spec.keys.contains(f.name()))
            .map(|f| f.name().clone())
            .collect();
        for name in &content {
            let data_type = content_type(schema.field_with_name(name)?.data_type());
            if !RowConverter::supports_fields(&[SortField::new(data_type.clone())]) {
                return Err(ArrowError::NotYetImplemented(format!(
                    "column '{name}' of type {data_type} cannot be compared between tied rows"
                )));
            }
        }
        Ok(Self {
            spec: spec.clone(),
            hasher: TieHasher { content },
            first_hash: vec![0; groups as usize],
            seen: PositionBits::with_capacity(u64::from(groups)),
            conflicted: PositionBits::with_capacity(u64::from(groups)),
            conflicts: 0,
        })
    }

    /// Keys whose tied rows differ, so far.
    pub fn conflicts(&self) -> u64 {
        self.conflicts
    }

    /// The hasher of this check's rows, for a thread that reads them: comparing hashes
    /// (with [`TieCheck::observe_hashed`]) needs no copy of the rows.
    pub fn hasher(&self) -> TieHasher {
        self.hasher.clone()
    }

    /// Compares a batch of tie rows (full rows, any order) whose groups are `groups`.
    ///
    /// # Errors
    /// Under [`TiePolicy::Error`], the first conflicting key, named with its key and version.
    pub fn observe(&mut self, batch: &RecordBatch, groups: &[u32]) -> Result<(), ArrowError> {
        let rows: Vec<u32> = (0..batch.num_rows() as u32).collect();
        let hashes = self.hasher.hash_rows(batch, &rows)?;
        let spec = self.spec.clone();
        self.observe_hashed(groups, &hashes, |row| describe_row(batch, &spec, row))
    }

    /// Compares tie rows by their [`TieHasher::hash_rows`]: `hashes[i]` of a row of group
    /// `groups[i]`, which `describe(i)` names in an error.
    ///
    /// # Errors
    /// Under [`TiePolicy::Error`], the first conflicting key, named by `describe`.
    pub fn observe_hashed(
        &mut self,
        groups: &[u32],
        hashes: &[u128],
        describe: impl Fn(usize) -> String,
    ) -> Result<(), ArrowError> {
        if groups.len() != hashes.len() {
            return Err(ArrowError::InvalidArgumentError(format!(
                "{} tie groups for {} row hashes",
                groups.len(),
                hashes.len()
            )));
        }
        for (row, (&group, &hash)) in groups.iter().zip(hashes).enumerate() {
            let g = group as usize;
            let Some(first) = self.first_hash.get_mut(g) else {
                return Err(ArrowError::InvalidArgumentError(format!(
                    "tie group {g} of {}",
                    self.first_hash.len()
                )));
            };
            let group = u64::from(group);
            if !self.seen.contains(group) {
                self.seen.insert(group);
                *first = hash;
            } else if *first != hash && !self.conflicted.contains(group) {
                self.conflicted.insert(group);
                self.conflicts += 1;
                if self.spec.options.on_tie == TiePolicy::Error {
                    return Err(ArrowError::ComputeError(format!(
                        "conflicting rows for key {}: they tie at the maximum version but \
                         differ in other columns (--on-tie error)",
                        describe(row)
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Hashes tie rows by their non-key values, on whichever thread holds them.
#[derive(Debug, Clone)]
pub struct TieHasher {
    /// The non-key columns, whose values tied rows must share.
    content: Vec<String>,
}

impl TieHasher {
    /// One hash per row of `batch` at `rows`, equal for rows whose non-key values are.
    ///
    /// # Errors
    /// A non-key column missing from `batch`, or a row beyond it.
    pub fn hash_rows(&self, batch: &RecordBatch, rows: &[u32]) -> Result<Vec<u128>, ArrowError> {
        let mut hashes = vec![0u128; rows.len()];
        for name in &self.content {
            let column = batch
                .column_by_name(name)
                .ok_or_else(|| ArrowError::SchemaError(format!("column '{name}' not found")))?;
            mix_value_hashes_at(column.as_ref(), rows, &mut hashes)?;
        }
        Ok(hashes)
    }
}

/// `k1=v1, k2=v2 at v=7`, for messages about one row's key.
pub fn describe_row(batch: &RecordBatch, spec: &DedupSpec, row: usize) -> String {
    let show = |names: &[String]| {
        names
            .iter()
            .map(|name| {
                let value = batch
                    .column_by_name(name)
                    .and_then(|c| {
                        let options = FormatOptions::default().with_null("null");
                        ArrayFormatter::try_new(c.as_ref(), &options)
                            .ok()
                            .map(|f| f.value(row).to_string())
                    })
                    .unwrap_or_else(|| "?".to_owned());
                format!("{name}={value}")
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    if spec.versions.is_empty() {
        format!("({})", show(&spec.keys))
    } else {
        format!("({}) at {}", show(&spec.keys), show(&spec.versions))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::DedupOptions;
    use arrow::array::{ArrayRef, Int64Array, StringArray, StringViewArray};
    use std::sync::Arc;

    /// Rows of key `id` and version `v`: groups 0 and 1 tie, and group 1's rows differ
    /// in `note` (one of them a null).
    fn tied_rows(note: ArrayRef) -> RecordBatch {
        RecordBatch::try_from_iter([
            (
                "id",
                Arc::new(Int64Array::from(vec![1, 2, 1, 2])) as ArrayRef,
            ),
            (
                "v",
                Arc::new(Int64Array::from(vec![5, 6, 5, 6])) as ArrayRef,
            ),
            ("note", note),
        ])
        .expect("batch")
    }

    fn check(batch: &RecordBatch, on_tie: TiePolicy) -> TieCheck {
        let spec =
            DedupSpec::new(["id"], ["v"]).with_options(DedupOptions::default().with_on_tie(on_tie));
        TieCheck::try_new(&batch.schema(), &spec, 2).expect("check")
    }

    #[test]
    fn hashed_rows_conflict_where_their_non_key_values_differ() {
        let groups = [0, 1, 0, 1];
        for note in [
            Arc::new(StringArray::from(vec![
                Some("a"),
                Some("b"),
                Some("a"),
                None,
            ])) as ArrayRef,
            Arc::new(StringViewArray::from(vec![
                Some("a"),
                Some("b"),
                Some("a"),
                None,
            ])),
        ] {
            let batch = tied_rows(note);
            let mut whole = check(&batch, TiePolicy::First);
            whole.observe(&batch, &groups).expect("observe");
            assert_eq!(whole.conflicts(), 1);

            // The same rows hashed a few at a time, out of order, as pass 2 reads them.
            let mut hashed = check(&batch, TiePolicy::First);
            let hasher = hashed.hasher();
            for rows in [[3u32, 0], [2, 1]] {
                let hashes = hasher.hash_rows(&batch, &rows).expect("hash");
                let groups: Vec<u32> = rows.iter().map(|&r| groups[r as usize]).collect();
                hashed
                    .observe_hashed(&groups, &hashes, |i| format!("row {}", rows[i]))
                    .expect("observe");
            }
            assert_eq!(hashed.conflicts(), 1);
        }
    }

    #[test]
    fn an_error_names_the_conflicting_row_and_bad_input_is_refused() {
        let batch = tied_rows(Arc::new(StringArray::from(vec!["a", "b", "a", "c"])));
        let mut strict = check(&batch, TiePolicy::Error);
        let err = strict
            .observe(&batch, &[0, 1, 0, 1])
            .expect_err("conflict")
            .to_string();
        assert!(err.contains("id=2") && err.contains("v=6"), "{err}");

        let mut lenient = check(&batch, TiePolicy::First);
        let hasher = lenient.hasher();
        let hashes = hasher.hash_rows(&batch, &[0, 1]).expect("hash");
        let describe = |i: usize| format!("row {i}");
        assert!(lenient.observe_hashed(&[0], &hashes, describe).is_err());
        assert!(lenient.observe_hashed(&[0, 2], &hashes, describe).is_err());
        assert!(hasher.hash_rows(&batch, &[4]).is_err());
        assert_eq!(lenient.conflicts(), 0);
    }

    #[test]
    fn a_group_conflicts_once_whatever_its_first_hash_and_its_neighbours() {
        let batch = tied_rows(Arc::new(StringArray::from(vec!["a", "b", "a", "b"])));
        let spec = DedupSpec::new(["id"], ["v"]);
        let groups = 200u32;
        let mut check = TieCheck::try_new(&batch.schema(), &spec, groups).expect("check");
        let describe = |i: usize| format!("row {i}");
        // Every group's first hash is its number, group 0's a zero; every third group gets
        // two more rows, alike but unlike its first, and every fifth one that repeats it.
        for g in 0..groups {
            check
                .observe_hashed(&[g], &[u128::from(g)], describe)
                .expect("observe");
        }
        for g in 0..groups {
            let (rows, hashes): (Vec<u32>, Vec<u128>) = match (g % 3, g % 5) {
                (0, _) => (vec![g, g], vec![u128::MAX, u128::MAX]),
                (_, 0) => (vec![g], vec![u128::from(g)]),
                _ => continue,
            };
            check
                .observe_hashed(&rows, &hashes, describe)
                .expect("observe");
        }
        assert_eq!(check.conflicts(), u64::from(groups.div_ceil(3)));
    }
}
