//! Each column's dictionary and zstd kept only where they pay, decided row group by row
//! group from what they did for the column before.
//!
//! An output's writer properties ask for a dictionary (falling back to a delta encoding
//! when it fills) and zstd for every column. For a column of distinct values — timestamps,
//! versions, amounts, UUIDs — each row group then builds a dictionary that fills and is
//! thrown away, and for integers zstd gets delta-packed bytes it cannot shrink: in a 10M
//! dedup's output it saved 0.0–0.4 % on the delta pages of three of its four integer
//! columns, at ~480 MB/s of one core. So each leaf column's chunk in row group `g` is
//! written with one of three settings, chosen from the chunk of the same column in group
//! `g - 2` and the setting it had:
//!
//! ```text
//!   Configured ──(its dictionary fell back)──▶ NoDictionary ──(zstd saved < 1/20)──▶ Raw
//!   (a chunk without a dictionary page goes straight to the zstd check)
//!   groups 0 and 1, and every REPROBE_GROUPS-th pair after them: Configured again
//! ```
//!
//! `g - 2`, not `g - 1`, because the writer encodes two row groups at once: when group `g`
//! starts, group `g - 1` may still be encoding, but `g - 2` has always been written. The
//! choice depends only on the rows and their order, so the same rows give the same file
//! (f(f(x)) = f(x) holds for the bytes too), whichever writer and thread wrote it. The
//! codec is recorded per column chunk in Parquet's metadata, and every reader uses the
//! chunk's own.

use std::io::Sink;
use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use parquet::arrow::arrow_writer::{
    ArrowColumnChunk, ArrowColumnWriter, ArrowRowGroupWriterFactory,
};
use parquet::basic::{Compression, Encoding, PageType};
use parquet::errors::Result;
use parquet::file::metadata::ColumnChunkMetaData;
use parquet::file::properties::WriterPropertiesPtr;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::types::{ColumnPath, TypePtr};

/// zstd is kept on a column while it shrinks the column's chunks by at least this part.
const MIN_ZSTD_SAVING: f64 = 1.0 / 20.0;

/// Every this many row groups, a pair of groups is written as configured again, so that a
/// column whose values change in kind (a few distinct values after many) gets its
/// dictionary and zstd back.
const REPROBE_GROUPS: usize = 64;

/// How one leaf column's chunk in one row group is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChunkSetting {
    /// As the writer properties say.
    Configured,
    /// Without a dictionary.
    NoDictionary,
    /// Without a dictionary, uncompressed.
    Raw,
}

/// What a written chunk shows about its column.
#[derive(Debug, Clone, Copy, PartialEq)]
struct ChunkOutcome {
    /// It had a dictionary page.
    dictionary: bool,
    /// Some of its data pages are not dictionary-encoded: the dictionary filled.
    fell_back: bool,
    /// `1 - compressed / uncompressed`, when it was compressed.
    saved: Option<f64>,
}

impl ChunkOutcome {
    fn of(metadata: &ColumnChunkMetaData) -> Self {
        let dictionary = metadata.dictionary_page_offset().is_some();
        let fell_back = dictionary
            && metadata.page_encoding_stats().is_some_and(|stats| {
                stats.iter().any(|page| {
                    matches!(page.page_type, PageType::DATA_PAGE | PageType::DATA_PAGE_V2)
                        && !matches!(
                            page.encoding,
                            Encoding::RLE_DICTIONARY | Encoding::PLAIN_DICTIONARY
                        )
                })
            });
        let saved = (metadata.compression() != Compression::UNCOMPRESSED
            && metadata.uncompressed_size() > 0)
            .then(|| 1.0 - metadata.compressed_size() as f64 / metadata.uncompressed_size() as f64);
        Self {
            dictionary,
            fell_back,
            saved,
        }
    }
}

impl ChunkSetting {
    /// The setting of the column's chunk two row groups on from one written with `self`.
    fn next(self, outcome: ChunkOutcome) -> Self {
        let zstd_pays = outcome.saved.is_none_or(|saved| saved >= MIN_ZSTD_SAVING);
        match self {
            Self::Configured if outcome.dictionary && outcome.fell_back => Self::NoDictionary,
            Self::Configured if outcome.dictionary => Self::Configured,
            Self::Configured | Self::NoDictionary if !zstd_pays => Self::Raw,
            kept => kept,
        }
    }
}

/// The settings one row group's chunks were written with and, once it is written, what
/// came of them.
#[derive(Debug)]
struct GroupRecord {
    number: usize,
    settings: Vec<ChunkSetting>,
    outcomes: Vec<Option<ChunkOutcome>>,
}

/// Whether a writer adapts its chunks' settings (see the module docs) or writes every
/// chunk as its properties say, as `ArrowWriter` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChunkTuning {
    /// Dictionary and zstd per column chunk, by what they did before.
    Adaptive,
    /// Every chunk as the writer properties say.
    AsConfigured,
}

/// Chooses each row group's column settings, from what each column's chunks earned.
pub(crate) struct ChunkSettings {
    tuning: ChunkTuning,
    properties: WriterPropertiesPtr,
    root: TypePtr,
    arrow_schema: SchemaRef,
    leaf_paths: Vec<ColumnPath>,
    /// The last two row groups started, at `number % 2`.
    recent: [Option<GroupRecord>; 2],
}

impl ChunkSettings {
    /// Settings for the row groups of `file` (whose Parquet schema and writer properties
    /// they take), written from batches of `arrow_schema`.
    pub(crate) fn new<W: std::io::Write + Send>(
        tuning: ChunkTuning,
        file: &SerializedFileWriter<W>,
        arrow_schema: SchemaRef,
    ) -> Self {
        let descriptor = file.schema_descr();
        Self {
            tuning,
            properties: Arc::clone(file.properties()),
            root: descriptor.root_schema_ptr(),
            arrow_schema,
            leaf_paths: descriptor
                .columns()
                .iter()
                .map(|column| column.path().clone())
                .collect(),
            recent: [None, None],
        }
    }

    /// The settings of row group `number`'s chunks, from those of group `number - 2`.
    fn settings_for(&self, number: usize) -> Vec<ChunkSetting> {
        let configured = vec![ChunkSetting::Configured; self.leaf_paths.len()];
        if self.tuning == ChunkTuning::AsConfigured || number % REPROBE_GROUPS < 2 {
            return configured;
        }
        match &self.recent[number % 2] {
            Some(record) if record.number + 2 == number => record
                .settings
                .iter()
                .zip(&record.outcomes)
                .map(|(setting, outcome)| match outcome {
                    Some(outcome) => setting.next(*outcome),
                    // A writer observes every chunk of a group before it starts the
                    // group two on; an unobserved one would leave the choice to timing.
                    None => ChunkSetting::Configured,
                })
                .collect(),
            _ => configured,
        }
    }

    /// Starts row group `number`: chooses and records its columns' settings. Cheap, so
    /// that a writer can call it under its lock and make the writers after.
    pub(crate) fn start_group(&mut self, number: usize) -> GroupWriters {
        let settings = self.settings_for(number);
        let properties = if settings.iter().all(|s| *s == ChunkSetting::Configured) {
            Arc::clone(&self.properties)
        } else {
            let mut builder = (*self.properties).clone().into_builder();
            for (path, setting) in self.leaf_paths.iter().zip(&settings) {
                if *setting != ChunkSetting::Configured {
                    builder = builder.set_column_dictionary_enabled(path.clone(), false);
                }
                if *setting == ChunkSetting::Raw {
                    builder =
                        builder.set_column_compression(path.clone(), Compression::UNCOMPRESSED);
                }
            }
            Arc::new(builder.build())
        };
        let leaves = settings.len();
        self.recent[number % 2] = Some(GroupRecord {
            number,
            settings,
            outcomes: vec![None; leaves],
        });
        GroupWriters {
            number,
            properties,
            root: Arc::clone(&self.root),
            arrow_schema: Arc::clone(&self.arrow_schema),
        }
    }

    /// Records the written chunk of leaf column `leaf` in row group `number`.
    pub(crate) fn observe(&mut self, number: usize, leaf: usize, chunk: &ArrowColumnChunk) {
        if let Some(record) = &mut self.recent[number % 2]
            && record.number == number
            && let Some(outcome) = record.outcomes.get_mut(leaf)
        {
            *outcome = Some(ChunkOutcome::of(&chunk.close().metadata));
        }
    }
}

/// What makes one row group's column writers, with the settings chosen for it.
pub(crate) struct GroupWriters {
    number: usize,
    properties: WriterPropertiesPtr,
    root: TypePtr,
    arrow_schema: SchemaRef,
}

impl GroupWriters {
    /// The row group's column writers, in file column order.
    ///
    /// # Errors
    /// As the Parquet writer's, for a schema or properties it cannot write.
    pub(crate) fn column_writers(self) -> Result<Vec<ArrowColumnWriter>> {
        // The factory takes its properties from a file writer; the chunks it makes are
        // appended to the real file, which records each chunk's own codec and encodings.
        let template =
            SerializedFileWriter::<Sink>::new(std::io::sink(), self.root, self.properties)?;
        ArrowRowGroupWriterFactory::new(&template, self.arrow_schema)
            .create_column_writers(self.number)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(dictionary: bool, fell_back: bool, saved: Option<f64>) -> ChunkOutcome {
        ChunkOutcome {
            dictionary,
            fell_back,
            saved,
        }
    }

    #[test]
    fn every_reprobe_pair_starts_as_configured_again() {
        let schema = Arc::new(arrow::datatypes::Schema::new(vec![
            arrow::datatypes::Field::new("v", arrow::datatypes::DataType::Int64, false),
        ]));
        let properties = crate::write::properties::writer_properties(&schema).expect("properties");
        let file = parquet::arrow::ArrowWriter::try_new(
            std::io::sink(),
            Arc::clone(&schema),
            Some(properties),
        )
        .and_then(parquet::arrow::ArrowWriter::into_serialized_writer)
        .expect("writer")
        .0;
        let mut settings = ChunkSettings::new(ChunkTuning::Adaptive, &file, schema);
        let raw = outcome(false, false, Some(0.0));
        let mut seen = Vec::new();
        for number in 0..REPROBE_GROUPS + 4 {
            settings
                .start_group(number)
                .column_writers()
                .expect("writers");
            let record = settings.recent[number % 2].as_mut().expect("record");
            seen.push(record.settings[0]);
            record.outcomes[0] = Some(match record.settings[0] {
                ChunkSetting::Configured => outcome(true, true, Some(0.5)),
                _ => raw,
            });
        }
        use ChunkSetting::{Configured, NoDictionary, Raw};
        assert_eq!(
            seen[..6],
            [Configured, Configured, NoDictionary, NoDictionary, Raw, Raw]
        );
        assert_eq!(
            seen[REPROBE_GROUPS - 2..],
            [Raw, Raw, Configured, Configured, NoDictionary, NoDictionary]
        );
    }

    #[test]
    fn a_dictionary_that_holds_is_kept_with_zstd() {
        let kept = outcome(true, false, Some(0.01));
        assert_eq!(
            ChunkSetting::Configured.next(kept),
            ChunkSetting::Configured
        );
    }

    #[test]
    fn a_dictionary_that_fills_goes_and_then_zstd_if_it_saves_little() {
        let filled = outcome(true, true, Some(0.5));
        assert_eq!(
            ChunkSetting::Configured.next(filled),
            ChunkSetting::NoDictionary
        );
        let little = outcome(false, false, Some(MIN_ZSTD_SAVING / 2.0));
        assert_eq!(ChunkSetting::NoDictionary.next(little), ChunkSetting::Raw);
        let enough = outcome(false, false, Some(MIN_ZSTD_SAVING));
        assert_eq!(
            ChunkSetting::NoDictionary.next(enough),
            ChunkSetting::NoDictionary
        );
        assert_eq!(
            ChunkSetting::Raw.next(outcome(false, false, None)),
            ChunkSetting::Raw
        );
    }

    #[test]
    fn a_column_without_a_dictionary_is_judged_on_zstd_alone() {
        let little = outcome(false, false, Some(0.0));
        assert_eq!(ChunkSetting::Configured.next(little), ChunkSetting::Raw);
        let enough = outcome(false, false, Some(0.3));
        assert_eq!(
            ChunkSetting::Configured.next(enough),
            ChunkSetting::Configured
        );
        // Written uncompressed by the properties: nothing to judge zstd by.
        let uncompressed = outcome(false, false, None);
        assert_eq!(
            ChunkSetting::Configured.next(uncompressed),
            ChunkSetting::Configured
        );
    }
}
