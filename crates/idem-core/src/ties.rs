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
use crate::rowhash::{content_type, mix_value_hashes};

/// Compares the tie rows of a [`crate::Resolution`] group by group.
#[derive(Debug)]
pub struct TieCheck {
    spec: DedupSpec,
    /// The non-key columns, whose values tied rows must share.
    content: Vec<String>,
    first_hash: Vec<Option<u128>>,
    conflicted: Vec<bool>,
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
            content,
            first_hash: vec![None; groups as usize],
            conflicted: vec![false; groups as usize],
            conflicts: 0,
        })
    }

    /// Keys whose tied rows differ, so far.
    pub fn conflicts(&self) -> u64 {
        self.conflicts
    }

    /// Compares a batch of tie rows (full rows, any order) whose groups are `groups`.
    ///
    /// # Errors
    /// Under [`TiePolicy::Error`], the first conflicting key, named with its key and version.
    pub fn observe(&mut self, batch: &RecordBatch, groups: &[u32]) -> Result<(), ArrowError> {
        let mut hashes = vec![0u128; batch.num_rows()];
        for name in &self.content {
            let column = batch
                .column_by_name(name)
                .ok_or_else(|| ArrowError::SchemaError(format!("column '{name}' not found")))?;
            mix_value_hashes(column.as_ref(), &mut hashes)?;
        }
        for (row, (&group, hash)) in groups.iter().zip(hashes).enumerate() {
            let g = group as usize;
            match self.first_hash[g] {
                None => self.first_hash[g] = Some(hash),
                Some(first) if first != hash && !self.conflicted[g] => {
                    self.conflicted[g] = true;
                    self.conflicts += 1;
                    if self.spec.options.on_tie == TiePolicy::Error {
                        return Err(ArrowError::ComputeError(format!(
                            "conflicting rows for key {}: they tie at the maximum version but \
                             differ in other columns (--on-tie error)",
                            describe_row(batch, &self.spec, row)
                        )));
                    }
                }
                Some(_) => {}
            }
        }
        Ok(())
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
