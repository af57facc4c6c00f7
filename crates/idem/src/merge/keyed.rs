//! Rows indexed by key: the batch's winners and the tombstone state, probed with the rows of
//! the table's files.

use arrow::array::{ArrayRef, RecordBatch};
use arrow::error::ArrowError;
use hashbrown::HashTable;
use idem_core::key::{KeyColumns, KeyLayout, KeyRows};
use idem_core::version::VersionLayout;

/// Rows with one row per key, found by key, with their encoded versions.
pub(crate) struct KeyedRows {
    rows: RecordBatch,
    keys: KeyLayout,
    versions: VersionLayout,
    encoded_keys: KeyRows,
    hashes: Vec<u64>,
    encoded_versions: Vec<u8>,
    index: HashTable<u32>,
}

/// One probe's answer for a row of another batch.
pub(crate) struct Probe {
    /// The encoded versions of the probed rows.
    pub versions: Vec<u8>,
    /// For every probed row, the row here with the same key.
    pub found: Vec<Option<u32>>,
}

impl KeyedRows {
    /// Indexes `rows` by the named key columns. If two rows share a key, the later one is
    /// found (callers pass rows that are already unique by key).
    pub fn try_new(
        rows: RecordBatch,
        key_names: &[String],
        version_names: &[String],
    ) -> Result<Self, ArrowError> {
        let schema = rows.schema();
        let fields = |names: &[String]| {
            names
                .iter()
                .map(|n| schema.field_with_name(n).cloned())
                .collect::<Result<Vec<_>, _>>()
        };
        let keys = KeyLayout::try_new(&fields(key_names)?)?;
        let versions = VersionLayout::try_new(&fields(version_names)?)?;
        let key_columns = key_columns(&rows, &keys)?;
        let mut encoded_keys = KeyRows::default();
        key_columns.encode_rows(&mut encoded_keys);
        let mut hashes = Vec::new();
        key_columns.hash_rows(&mut hashes);
        let mut encoded_versions = Vec::new();
        versions.encode(
            &version_columns(&rows, &versions)?,
            rows.num_rows(),
            &mut encoded_versions,
        )?;
        let mut index = HashTable::with_capacity(rows.num_rows());
        for row in 0..rows.num_rows() {
            let hash = hashes[row];
            let key = encoded_keys.row(row);
            match index.find_mut(hash, |&other: &u32| encoded_keys.row(other as usize) == key) {
                Some(slot) => *slot = row as u32,
                None => {
                    index.insert_unique(hash, row as u32, |&other: &u32| hashes[other as usize]);
                }
            }
        }
        Ok(Self {
            rows,
            keys,
            versions,
            encoded_keys,
            hashes,
            encoded_versions,
            index,
        })
    }

    /// The rows.
    pub fn rows(&self) -> &RecordBatch {
        &self.rows
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.rows.num_rows()
    }

    /// The hash of row `row`'s key.
    pub fn hash(&self, row: usize) -> u64 {
        self.hashes[row]
    }

    /// The encoded key of row `row` (equal bytes, equal keys).
    pub fn key(&self, row: usize) -> &[u8] {
        self.encoded_keys.row(row)
    }

    /// The encoded version of row `row` (`memcmp` orders versions).
    pub fn version(&self, row: usize) -> &[u8] {
        let width = self.versions.width();
        &self.encoded_versions[row * width..(row + 1) * width]
    }

    /// The row with this key, if any.
    pub fn find(&self, hash: u64, key: &[u8]) -> Option<u32> {
        self.index
            .find(hash, |&row| self.encoded_keys.row(row as usize) == key)
            .copied()
    }

    /// Looks up every row of `other` (which has the same key and version columns) here.
    pub fn probe(&self, other: &RecordBatch) -> Result<Probe, ArrowError> {
        let key_columns = key_columns(other, &self.keys)?;
        let mut encoded = KeyRows::default();
        key_columns.encode_rows(&mut encoded);
        let mut hashes = Vec::new();
        key_columns.hash_rows(&mut hashes);
        let mut versions = Vec::new();
        self.versions.encode(
            &version_columns(other, &self.versions)?,
            other.num_rows(),
            &mut versions,
        )?;
        let found = (0..other.num_rows())
            .map(|row| self.find(hashes[row], encoded.row(row)))
            .collect();
        Ok(Probe { versions, found })
    }

    /// Bytes of one encoded version.
    pub fn version_width(&self) -> usize {
        self.versions.width()
    }
}

fn named(batch: &RecordBatch, name: &str) -> Result<ArrayRef, ArrowError> {
    batch
        .column_by_name(name)
        .cloned()
        .ok_or_else(|| ArrowError::SchemaError(format!("column '{name}' not found")))
}

fn key_columns(batch: &RecordBatch, keys: &KeyLayout) -> Result<KeyColumns, ArrowError> {
    let columns = keys
        .names()
        .iter()
        .map(|n| named(batch, n))
        .collect::<Result<Vec<_>, _>>()?;
    keys.canonicalise(&columns)
}

fn version_columns(
    batch: &RecordBatch,
    versions: &VersionLayout,
) -> Result<Vec<ArrayRef>, ArrowError> {
    versions.names().iter().map(|n| named(batch, n)).collect()
}

/// The hash of every row's key, by the same function as [`KeyedRows`] (stable across runs:
/// bucket numbers are derived from it and stored in tables).
#[cfg_attr(not(feature = "delta"), allow(dead_code))]
pub(crate) fn key_hashes(
    batch: &RecordBatch,
    key_names: &[String],
) -> Result<Vec<u64>, ArrowError> {
    let schema = batch.schema();
    let fields = key_names
        .iter()
        .map(|n| schema.field_with_name(n).cloned())
        .collect::<Result<Vec<_>, _>>()?;
    let layout = KeyLayout::try_new(&fields)?;
    let mut hashes = Vec::new();
    key_columns(batch, &layout)?.hash_rows(&mut hashes);
    Ok(hashes)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};

    use super::*;

    fn batch(ids: &[&str], seqs: &[i64], lsns: &[i64]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("event_id", DataType::Utf8, true),
            Field::new("sequence", DataType::Int64, true),
            Field::new("lsn", DataType::Int64, true),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(StringArray::from(ids.to_vec())),
                Arc::new(Int64Array::from(seqs.to_vec())),
                Arc::new(Int64Array::from(lsns.to_vec())),
            ],
        )
        .expect("batch")
    }

    #[test]
    fn probes_find_equal_composite_keys_and_order_versions() {
        let names = ["event_id".to_owned(), "sequence".to_owned()];
        let keyed = KeyedRows::try_new(
            batch(&["a", "a", "b"], &[1, 2, 1], &[10, 20, -5]),
            &names,
            &["lsn".to_owned()],
        )
        .expect("index");
        let probe = keyed
            .probe(&batch(
                &["a", "b", "c", "a"],
                &[2, 1, 1, 3],
                &[30, -6, 0, 1],
            ))
            .expect("probe");
        assert_eq!(probe.found, vec![Some(1), Some(2), None, None]);
        let width = keyed.version_width();
        // Probed a/2 at 30 is newer than the indexed 20; b/1 at -6 is older than -5.
        assert!(probe.versions[..width] > *keyed.version(1));
        assert!(probe.versions[width..2 * width] < *keyed.version(2));
        assert_eq!(
            key_hashes(&batch(&["b"], &[1], &[0]), &names).expect("hash")[0],
            keyed.hash(2)
        );
    }
}
