//! The policy knobs of a dedup: what happens on ties and which rows are deletes.

use std::fmt;
use std::str::FromStr;

/// What to do when several rows share a key and its maximum version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TiePolicy {
    /// The first such row in input order is kept.
    #[default]
    First,
    /// The last such row in input order is kept.
    Last,
    /// Keep the first, but fail if the tied rows differ in any non-key column: the choice
    /// between `first` and `last` would then change the output.
    Error,
}

impl FromStr for TiePolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "first" => Ok(Self::First),
            "last" => Ok(Self::Last),
            "error" => Ok(Self::Error),
            other => Err(format!(
                "unknown tie policy '{other}': expected first, last or error"
            )),
        }
    }
}

impl fmt::Display for TiePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::First => "first",
            Self::Last => "last",
            Self::Error => "error",
        })
    }
}

/// Which rows are deletes (tombstones) and whether winning tombstones are written out.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DeletePolicy {
    /// The op column (e.g. Debezium's `op`), read as text whatever its type.
    pub op_column: String,
    /// Values of the op column (compared as text) that mark a row as a tombstone.
    pub delete_values: Vec<String>,
    /// Write a key's winning tombstone instead of dropping the key.
    pub keep_tombstones: bool,
}

impl DeletePolicy {
    /// Rows whose `op_column` is `d` are tombstones, dropped when they win.
    pub fn new(op_column: impl Into<String>) -> Self {
        Self {
            op_column: op_column.into(),
            delete_values: vec!["d".to_owned()],
            keep_tombstones: false,
        }
    }

    /// Appends, for every row of `op` (the op column), whether it is a tombstone: its value,
    /// read as text whatever its type, is one of the delete values (a null op is not).
    ///
    /// # Errors
    /// An op column that cannot be read as text.
    pub fn mark_tombstones(
        &self,
        op: &arrow::array::ArrayRef,
        out: &mut Vec<bool>,
    ) -> Result<(), arrow::error::ArrowError> {
        use arrow::array::{Array, AsArray};
        let op = arrow::compute::cast(op, &arrow::datatypes::DataType::Utf8)?;
        let op = op.as_string::<i32>();
        out.extend(
            (0..op.len()).map(|row| {
                op.is_valid(row) && self.delete_values.iter().any(|d| d == op.value(row))
            }),
        );
        Ok(())
    }
}

/// The policies of a dedup: how ties resolve and which rows are deletes. Shared by every
/// front end (CLI, DataFusion operator, table function) so that they cannot disagree.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct DedupOptions {
    /// Resolution of ties at a key's maximum version.
    pub on_tie: TiePolicy,
    /// Present when the input has an op column; `None` means no row is a delete.
    pub deletes: Option<DeletePolicy>,
}

impl DedupOptions {
    /// Sets the tie policy.
    #[must_use]
    pub fn with_on_tie(mut self, on_tie: TiePolicy) -> Self {
        self.on_tie = on_tie;
        self
    }

    /// Treats rows whose op value is in the policy's delete values as tombstones.
    #[must_use]
    pub fn with_deletes(mut self, deletes: DeletePolicy) -> Self {
        self.deletes = Some(deletes);
        self
    }
}

/// What one dedup does: the key and version columns, and the policies.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DedupSpec {
    /// Key columns: rows with equal values in all of them are one key (nulls equal).
    pub keys: Vec<String>,
    /// Version columns, most significant first; the row with the greatest version wins.
    pub versions: Vec<String>,
    /// Tie and delete policies.
    pub options: DedupOptions,
}

impl Default for DedupSpec {
    /// The event-pipeline default: key `(event_id, sequence)`, version `lsn`.
    fn default() -> Self {
        Self::new(["event_id", "sequence"], ["lsn"])
    }
}

impl DedupSpec {
    /// A spec with the given key and version columns, default policies (ties to the first
    /// row in input order, no deletes).
    pub fn new<K, V>(keys: K, versions: V) -> Self
    where
        K: IntoIterator,
        K::Item: Into<String>,
        V: IntoIterator,
        V::Item: Into<String>,
    {
        Self {
            keys: keys.into_iter().map(Into::into).collect(),
            versions: versions.into_iter().map(Into::into).collect(),
            options: DedupOptions::default(),
        }
    }

    /// Every column the dedup reads to decide which row wins: keys, versions, the op
    /// column. Whatever else a query selects, these must be scanned.
    pub fn decision_columns(&self) -> impl Iterator<Item = &String> {
        self.keys
            .iter()
            .chain(&self.versions)
            .chain(self.options.deletes.iter().map(|d| &d.op_column))
    }

    /// Sets the policies.
    #[must_use]
    pub fn with_options(mut self, options: DedupOptions) -> Self {
        self.options = options;
        self
    }
}

/// `key=[a, b], version=[lsn], on_tie=first[, op=op deletes=[d] keep_tombstones]`: how
/// plans (EXPLAIN) and reports show a dedup.
impl fmt::Display for DedupSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "key=[{}], version=[{}], on_tie={}",
            self.keys.join(", "),
            self.versions.join(", "),
            self.options.on_tie
        )?;
        if let Some(deletes) = &self.options.deletes {
            write!(
                f,
                ", op={} deletes=[{}]{}",
                deletes.op_column,
                deletes.delete_values.join(", "),
                if deletes.keep_tombstones {
                    " keep_tombstones"
                } else {
                    ""
                }
            )?;
        }
        Ok(())
    }
}
