//! Finding and opening input files: Parquet and Arrow IPC, local paths, directories, globs,
//! and the same on object storage (see [`crate::storage`]).

use std::fs::File;
use std::io::{Read, Seek};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{ArrayRef, RecordBatch, UInt32Array};
use arrow::datatypes::{FieldRef, Schema, SchemaRef};
use arrow::ipc::reader::{FileReader, StreamReader};
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder, RowSelection,
    RowSelector,
};
use parquet::file::metadata::PageIndexPolicy;
use parquet::file::reader::ChunkReader;

use idem_core::DedupSpec;

use crate::error::{Error, Result};
use crate::read::decoding::{corrupt, guarded, guarded_iter, load_parquet_metadata};
use crate::read::schema::with_views;
use crate::storage::RemoteFile;

/// Rows per batch when reading.
const BATCH_SIZE: usize = 8192;
/// Most rows per batch when reading whole rows (pass 2 row by row). Filtered down to
/// their winners, such batches still hold several of the writer's 8,192-row chunks, which
/// it takes as slices; only a chunk that straddles two batches is copied together. At
/// 8,192 rows every chunk straddled two batches, and that copy was 1.5 % of a dedup's
/// instructions.
const MAX_ROW_BATCH_SIZE: usize = 4 * BATCH_SIZE;
/// Uncompressed bytes a batch of whole rows may hold: wide rows keep [`BATCH_SIZE`], as
/// several such batches are in flight between the reader and the writer.
const ROW_BATCH_BYTES: u64 = 8 << 20;

/// How a read hands out text and binary columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TextLayout {
    /// As the file's schema has them.
    AsStored,
    /// As views (`Utf8View`, `BinaryView`; see [`crate::read::schema::with_views`]) where the
    /// file is Parquet: decoding then points into the decompressed pages instead of
    /// copying every value out of them. Arrow IPC files come as stored.
    Views,
}

/// The on-disk format of an input file.
#[derive(Debug, Clone)]
enum Format {
    /// Parquet, with its metadata read once and reused by both passes; `views` reads the
    /// text and binary columns as views (`None`: the file has none).
    Parquet {
        metadata: ArrowReaderMetadata,
        views: Option<ArrowReaderMetadata>,
    },
    /// Arrow IPC, file (random access) or stream layout.
    Ipc { stream: bool },
}

/// Where an input file's bytes are.
#[derive(Debug, Clone)]
pub enum InputSource {
    /// A local file.
    Local(PathBuf),
    /// An object in a store.
    Remote(RemoteFile),
    /// A file of a partitioned table: its rows also have the columns whose values its
    /// path holds (Delta `partitionValues`), which the file itself does not store.
    Partitioned {
        /// The file.
        file: Box<InputSource>,
        /// The columns, one value each.
        columns: Arc<ConstantColumns>,
    },
}

/// Columns with one value for every row of a file, kept outside it: the partition values of
/// a file in a partitioned table.
#[derive(Debug, Clone)]
pub struct ConstantColumns {
    fields: Vec<FieldRef>,
    /// One row each.
    values: Vec<ArrayRef>,
}

impl ConstantColumns {
    /// Columns from (field, one-row array) pairs.
    ///
    /// # Errors
    /// A value that is not exactly one row of its field's type.
    pub fn try_new(columns: Vec<(FieldRef, ArrayRef)>) -> Result<Self> {
        for (field, value) in &columns {
            if value.len() != 1 || value.data_type() != field.data_type() {
                return Err(Error::InvalidArgument(format!(
                    "partition value of column '{}': expected one {} value",
                    field.name(),
                    field.data_type()
                )));
            }
        }
        let (fields, values) = columns.into_iter().unzip();
        Ok(Self { fields, values })
    }

    fn index_of(&self, name: &str) -> Option<usize> {
        self.fields.iter().position(|f| f.name() == name)
    }

    /// `batch` with the constant columns `which` appended, repeated for every row.
    fn append(&self, batch: &RecordBatch, which: &[usize], path: &Path) -> Result<RecordBatch> {
        if which.is_empty() {
            return Ok(batch.clone());
        }
        let zeros = UInt32Array::from(vec![0u32; batch.num_rows()]);
        let mut fields: Vec<FieldRef> = batch.schema().fields().iter().cloned().collect();
        let mut columns = batch.columns().to_vec();
        for &i in which {
            fields.push(Arc::clone(&self.fields[i]));
            columns.push(
                arrow::compute::take(self.values[i].as_ref(), &zeros, None)
                    .map_err(Error::arrow(path))?,
            );
        }
        let options =
            arrow::array::RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
        RecordBatch::try_new_with_options(Arc::new(Schema::new(fields)), columns, &options)
            .map_err(Error::arrow(path))
    }
}

impl InputSource {
    /// The file's path, or the object's URL as a path, for messages and stats.
    pub fn path(&self) -> PathBuf {
        match self {
            Self::Local(path) => path.clone(),
            Self::Remote(remote) => remote.display_path(),
            Self::Partitioned { file, .. } => file.path(),
        }
    }

    /// Where the file's own bytes are.
    pub(crate) fn stored(&self) -> StoredFile<'_> {
        match self {
            Self::Local(path) => StoredFile::Local(path),
            Self::Remote(remote) => StoredFile::Remote(remote),
            Self::Partitioned { file, .. } => file.stored(),
        }
    }

    /// A sequential reader from the start.
    fn reader(&self) -> Result<Box<dyn ReadSeek>> {
        match self.stored() {
            StoredFile::Local(path) => Ok(Box::new(File::open(path).map_err(Error::io(path))?)),
            StoredFile::Remote(remote) => Ok(Box::new(remote.reader())),
        }
    }
}

/// An input's own bytes: a local file or an object.
pub(crate) enum StoredFile<'a> {
    Local(&'a Path),
    Remote(&'a RemoteFile),
}

/// What Arrow's IPC readers read from.
trait ReadSeek: Read + Seek + Send {}
impl<T: Read + Seek + Send> ReadSeek for T {}

/// One input file, opened far enough to know its schema and row count.
#[derive(Debug, Clone)]
pub struct InputFile {
    path: PathBuf,
    source: InputSource,
    format: Format,
    /// The file's columns, then the constant columns (which replace stored ones of the
    /// same name: a partition value is authoritative).
    schema: SchemaRef,
    /// Indices into the file's own schema of the columns read from it.
    stored: Vec<usize>,
    constants: Option<Arc<ConstantColumns>>,
    num_rows: u64,
}

/// A stream of batches from one file.
pub type Batches = Box<dyn Iterator<Item = Result<RecordBatch>> + Send>;

pub(crate) const PARQUET_EXTENSIONS: &[&str] = &["parquet", "parq", "pq"];
pub(crate) const IPC_EXTENSIONS: &[&str] = &["arrow", "ipc", "feather", "arrows"];

impl InputFile {
    /// Opens a file far enough to read its schema and row count. The format comes from the
    /// content (Parquet's `PAR1`, Arrow's `ARROW1`), not the name.
    ///
    /// # Errors
    /// An unreadable, corrupt or truncated file, or one in neither format.
    pub fn open(source: &InputSource) -> Result<Self> {
        if let InputSource::Partitioned { file, columns } = source {
            let mut opened = Self::open(file)?;
            opened.attach(columns);
            opened.source = source.clone();
            return Ok(opened);
        }
        let path = source.path();
        let mut magic = [0u8; 6];
        let read = read_up_to(&mut *source.reader()?, &mut magic).map_err(Error::io(&path))?;
        let magic = &magic[..read];
        if magic.starts_with(b"PAR1") {
            let options =
                ArrowReaderOptions::new().with_offset_index_policy(PageIndexPolicy::Optional);
            let metadata = match source.stored() {
                StoredFile::Local(local) => {
                    let file = File::open(local).map_err(Error::io(local))?;
                    load_parquet_metadata(&file, options.clone(), &path)
                }
                StoredFile::Remote(remote) => load_parquet_metadata(remote, options.clone(), &path),
            }?;
            let num_rows = metadata.metadata().file_metadata().num_rows().max(0) as u64;
            let schema = Arc::clone(metadata.schema());
            let views = view_metadata(&metadata, options);
            Ok(Self {
                stored: (0..schema.fields().len()).collect(),
                schema,
                constants: None,
                path,
                source: source.clone(),
                format: Format::Parquet { metadata, views },
                num_rows,
            })
        } else if magic == b"ARROW1" || magic.starts_with(&[0xff; 4]) {
            // IPC block metadata carries no row counts: count by reading, once.
            let stream = magic != b"ARROW1";
            let (schema, batches) = ipc_batches(source, stream, None)?;
            Ok(Self {
                num_rows: count_rows(batches)?,
                path,
                source: source.clone(),
                format: Format::Ipc { stream },
                stored: (0..schema.fields().len()).collect(),
                schema,
                constants: None,
            })
        } else {
            Err(Error::InvalidArgument(format!(
                "{}: not a Parquet or Arrow IPC file (unrecognised header)",
                path.display()
            )))
        }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where the file's bytes are.
    pub fn source(&self) -> &InputSource {
        &self.source
    }

    /// The file's schema: its own columns and those its path holds.
    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// Adds columns held outside the file; they replace stored columns of the same name.
    fn attach(&mut self, columns: &Arc<ConstantColumns>) {
        let own = Arc::clone(&self.schema);
        self.stored = (0..own.fields().len())
            .filter(|&i| columns.index_of(own.field(i).name()).is_none())
            .collect();
        let fields: Vec<FieldRef> = self
            .stored
            .iter()
            .map(|&i| Arc::clone(&own.fields()[i]))
            .chain(columns.fields.iter().cloned())
            .collect();
        self.schema = Arc::new(Schema::new_with_metadata(fields, own.metadata().clone()));
        self.constants = Some(Arc::clone(columns));
    }

    /// Whether the file is Parquet (rather than Arrow IPC).
    pub fn is_parquet(&self) -> bool {
        matches!(self.format, Format::Parquet { .. })
    }

    /// Rows in the file.
    pub fn num_rows(&self) -> u64 {
        self.num_rows
    }

    /// Reads only the named columns (which must exist), every row.
    pub fn read_columns(&self, columns: &[&str]) -> Result<Batches> {
        self.read_columns_as(columns, TextLayout::AsStored)
    }

    /// Reads only the named columns (which must exist), every row, with text and binary
    /// columns in `layout`.
    pub fn read_columns_as(&self, columns: &[&str], layout: TextLayout) -> Result<Batches> {
        let indices = self.column_indices(columns)?;
        self.read(&indices, Wanted::All, None, BATCH_SIZE, layout)
    }

    /// The indices of the named columns (which must exist) in schema order, as batches
    /// come: like those of a file with just these columns.
    fn column_indices(&self, columns: &[&str]) -> Result<Vec<usize>> {
        let mut indices: Vec<usize> = columns
            .iter()
            .map(|c| self.schema.index_of(c).map_err(Error::arrow(&self.path)))
            .collect::<Result<_>>()?;
        indices.sort_unstable();
        indices.dedup();
        Ok(indices)
    }

    /// The pieces the file can be decoded in, each on its own: its row groups if it is
    /// Parquet, else the whole file (IPC footers hold no row counts per batch).
    pub(crate) fn pieces(&self) -> Vec<FilePiece> {
        let Format::Parquet { metadata, .. } = &self.format else {
            return vec![FilePiece {
                row_group: None,
                first_row: 0,
                rows: self.num_rows,
            }];
        };
        let mut first_row = 0u64;
        metadata
            .metadata()
            .row_groups()
            .iter()
            .enumerate()
            .map(|(index, group)| {
                let rows = group.num_rows().max(0) as u64;
                let piece = FilePiece {
                    row_group: Some(index),
                    first_row,
                    rows,
                };
                first_row += rows;
                piece
            })
            .collect()
    }

    /// Reads only the named columns (which must exist) of every row of `piece`, text and
    /// binary columns as views (pass 1 encodes the keys from them, never keeps them).
    pub(crate) fn read_piece_columns(&self, columns: &[&str], piece: FilePiece) -> Result<Batches> {
        let indices = self.column_indices(columns)?;
        let group = piece.row_group;
        self.read(&indices, Wanted::All, group, BATCH_SIZE, TextLayout::Views)
    }

    /// Reads every column of the rows at `rows` (ascending, within the file), text and
    /// binary columns as views: pass 2 filters these batches down to their winners and
    /// hands them to the writer, and views make both steps move 16 bytes a value instead of
    /// the value (4-6 % of a 10M-row dedup's CPU, in benches/RESULTS.md).
    pub fn read_rows(&self, rows: &[u64]) -> Result<Batches> {
        self.read_rows_as(rows, TextLayout::Views)
    }

    /// Reads every column of the rows at `rows` (ascending, within the file), text and
    /// binary columns in `layout`.
    pub fn read_rows_as(&self, rows: &[u64], layout: TextLayout) -> Result<Batches> {
        let all: Vec<usize> = (0..self.schema.fields().len()).collect();
        let batch_size = self.row_batch_size();
        self.read(&all, Wanted::Rows(rows, None), None, batch_size, layout)
    }

    /// Reads every column of the rows in `ranges` (ascending and disjoint, within the
    /// file), text and binary columns in `layout`.
    pub(crate) fn read_ranges_as(
        &self,
        ranges: &[Range<u64>],
        layout: TextLayout,
    ) -> Result<Batches> {
        let all: Vec<usize> = (0..self.schema.fields().len()).collect();
        let batch_size = self.row_batch_size();
        self.read(&all, Wanted::Runs(ranges), None, batch_size, layout)
    }

    /// Rows per batch of whole rows: [`ROW_BATCH_BYTES`] of them, by the file's own
    /// uncompressed size, between [`BATCH_SIZE`] and [`MAX_ROW_BATCH_SIZE`].
    fn row_batch_size(&self) -> usize {
        let Format::Parquet { metadata, .. } = &self.format else {
            return BATCH_SIZE;
        };
        let bytes: i64 = metadata
            .metadata()
            .row_groups()
            .iter()
            .map(|group| group.total_byte_size())
            .sum();
        let bytes_per_row = (bytes.max(1) as u64).div_ceil(self.num_rows.max(1));
        usize::try_from(ROW_BATCH_BYTES / bytes_per_row)
            .unwrap_or(MAX_ROW_BATCH_SIZE)
            .clamp(BATCH_SIZE, MAX_ROW_BATCH_SIZE)
    }

    /// The rows at `rows` (ascending, within the file), to read one column after another.
    pub(crate) fn rows_to_read(&self, rows: Vec<u64>) -> RowsToRead {
        RowsToRead {
            selection: selection(&rows, self.num_rows),
            rows,
        }
    }

    /// Reads the column `name` of `rows`, text and binary as views (as [`Self::read_rows`]);
    /// `None` when the file has no such column.
    pub(crate) fn read_column(&self, name: &str, rows: &RowsToRead) -> Result<Option<Batches>> {
        match self.schema.index_of(name) {
            Ok(index) => self
                .read(
                    &[index],
                    Wanted::Rows(&rows.rows, Some(&rows.selection)),
                    None,
                    BATCH_SIZE,
                    TextLayout::Views,
                )
                .map(Some),
            Err(_) => Ok(None),
        }
    }

    /// Reads the columns at `indices` (ascending, into [`Self::schema`]), of the `wanted`
    /// rows, of one Parquet row group if `row_group` says which, in batches of
    /// `batch_size` rows from Parquet, text and binary columns in `layout`.
    fn read(
        &self,
        indices: &[usize],
        wanted: Wanted<'_>,
        row_group: Option<usize>,
        batch_size: usize,
        layout: TextLayout,
    ) -> Result<Batches> {
        let stored = self.stored.len();
        let projection: Vec<usize> = indices
            .iter()
            .filter(|&&i| i < stored)
            .map(|&i| self.stored[i])
            .collect();
        let batches = self.read_stored(projection, wanted, row_group, batch_size, layout)?;
        let Some(constants) = &self.constants else {
            return Ok(batches);
        };
        let which: Vec<usize> = indices
            .iter()
            .filter(|&&i| i >= stored)
            .map(|&i| i - stored)
            .collect();
        let constants = Arc::clone(constants);
        let path = self.path.clone();
        Ok(Box::new(batches.map(move |batch| {
            batch.and_then(|b| constants.append(&b, &which, &path))
        })))
    }

    fn read_stored(
        &self,
        projection: Vec<usize>,
        wanted: Wanted<'_>,
        row_group: Option<usize>,
        batch_size: usize,
        layout: TextLayout,
    ) -> Result<Batches> {
        match (&self.format, self.source.stored()) {
            (Format::Parquet { metadata, views }, stored) => {
                let selection = wanted.parquet_selection(self.num_rows);
                let metadata = match (layout, views) {
                    (TextLayout::Views, Some(views)) => views,
                    _ => metadata,
                };
                match stored {
                    StoredFile::Local(local) => {
                        let file = File::open(local).map_err(Error::io(local))?;
                        self.read_parquet(
                            file, metadata, projection, selection, row_group, batch_size,
                        )
                    }
                    StoredFile::Remote(remote) => self.read_parquet(
                        remote.clone(),
                        metadata,
                        projection,
                        selection,
                        row_group,
                        batch_size,
                    ),
                }
            }
            (Format::Ipc { stream }, _) => {
                let (_, batches) = ipc_batches(&self.source, *stream, Some(projection))?;
                match wanted.listed() {
                    None => Ok(batches),
                    Some(rows) => Ok(Box::new(select_rows(batches, rows, self.path.clone()))),
                }
            }
        }
    }

    fn read_parquet<R: ChunkReader + 'static>(
        &self,
        input: R,
        metadata: &ArrowReaderMetadata,
        projection: Vec<usize>,
        selection: Option<RowSelection>,
        row_group: Option<usize>,
        batch_size: usize,
    ) -> Result<Batches> {
        let mut builder =
            ParquetRecordBatchReaderBuilder::new_with_metadata(input, metadata.clone())
                .with_batch_size(batch_size);
        if projection.len() < metadata.schema().fields().len() {
            let mask = ProjectionMask::roots(builder.parquet_schema(), projection);
            builder = builder.with_projection(mask);
        }
        if let Some(group) = row_group {
            builder = builder.with_row_groups(vec![group]);
        }
        if let Some(selection) = selection {
            builder = builder.with_row_selection(selection);
        }
        let reader = guarded(&self.path, || {
            builder.build().map_err(Error::parquet(&self.path))
        })?;
        let path = self.path.clone();
        Ok(Box::new(guarded_iter(
            self.path.clone(),
            reader.map(move |b| b.map_err(Error::arrow(&path))),
        )))
    }
}

/// A part of a file that can be decoded apart from the rest (see [`InputFile::pieces`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct FilePiece {
    /// The Parquet row group; `None`: the whole file.
    pub(crate) row_group: Option<usize>,
    /// The piece's first row within the file.
    pub(crate) first_row: u64,
    /// Rows in the piece.
    pub(crate) rows: u64,
}

/// Rows of one file to read column after column, with their Parquet row selection made
/// once for all the columns.
pub(crate) struct RowsToRead {
    rows: Vec<u64>,
    selection: RowSelection,
}

impl RowsToRead {
    /// The number of rows.
    pub(crate) fn len(&self) -> usize {
        self.rows.len()
    }
}

/// Reads until `buffer` is full or the input ends (a short file is not an error here).
/// `metadata` again, reading the file's text and binary columns as views; `None` when it
/// has none, or when the reader cannot take the view schema (the plain read then serves:
/// views only save copies).
fn view_metadata(
    metadata: &ArrowReaderMetadata,
    options: ArrowReaderOptions,
) -> Option<ArrowReaderMetadata> {
    let schema = metadata.schema();
    let viewed = with_views(schema);
    if viewed == **schema {
        return None;
    }
    ArrowReaderMetadata::try_new(
        Arc::clone(metadata.metadata()),
        options.with_schema(Arc::new(viewed)),
    )
    .ok()
}

fn read_up_to(reader: &mut dyn Read, buffer: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buffer.len() {
        match reader.read(&mut buffer[filled..])? {
            0 => break,
            n => filled += n,
        }
    }
    Ok(filled)
}

/// Opens an Arrow IPC file (random-access layout) or stream.
fn ipc_batches(
    source: &InputSource,
    stream: bool,
    projection: Option<Vec<usize>>,
) -> Result<(SchemaRef, Batches)> {
    let path = source.path();
    let mut input = source.reader()?;
    check_ipc_schema(&mut input, stream)
        .map_err(|problem| corrupt(&path, "Arrow IPC schema", &problem))?;
    input
        .seek(std::io::SeekFrom::Start(0))
        .map_err(Error::io(&path))?;
    let owned = path.clone();
    let to_error = move |e| Error::arrow(&owned)(e);
    if stream {
        let reader = guarded(&path, || {
            StreamReader::try_new(input, projection).map_err(Error::arrow(&path))
        })?;
        Ok((
            reader.schema(),
            Box::new(guarded_iter(
                path.clone(),
                reader.map(move |b| b.map_err(&to_error)),
            )),
        ))
    } else {
        let reader = guarded(&path, || {
            FileReader::try_new(input, projection).map_err(Error::arrow(&path))
        })?;
        Ok((
            reader.schema(),
            Box::new(guarded_iter(
                path.clone(),
                reader.map(move |b| b.map_err(&to_error)),
            )),
        ))
    }
}

/// Checks the schema of an Arrow IPC file (in its footer) or stream (its first message)
/// before arrow-ipc decodes it; leaves `input` anywhere.
fn check_ipc_schema(input: &mut dyn ReadSeek, stream: bool) -> std::result::Result<(), String> {
    use std::io::SeekFrom;
    let io = |e: std::io::Error| format!("cannot read it: {e}");
    let length = |bytes: [u8; 4]| -> std::result::Result<usize, String> {
        usize::try_from(i32::from_le_bytes(bytes)).map_err(|_| "a negative length".to_owned())
    };
    let mut word = [0u8; 4];
    let (start, size) = if stream {
        input.read_exact(&mut word).map_err(io)?;
        if word == [0xff; 4] {
            input.read_exact(&mut word).map_err(io)?;
        }
        (input.stream_position().map_err(io)?, length(word)?)
    } else {
        // File layout: ... footer, its i32 length, "ARROW1".
        let end = input.seek(SeekFrom::End(0)).map_err(io)?;
        if end < 10 + 8 {
            return Err("too short for an Arrow IPC file".to_owned());
        }
        input.seek(SeekFrom::Start(end - 10)).map_err(io)?;
        input.read_exact(&mut word).map_err(io)?;
        let size = length(word)?;
        let start = (end - 10)
            .checked_sub(size as u64)
            .ok_or_else(|| "a footer longer than the file".to_owned())?;
        (start, size)
    };
    let end = input.seek(SeekFrom::End(0)).map_err(io)?;
    if start + size as u64 > end {
        return Err("a schema longer than the file".to_owned());
    }
    input.seek(SeekFrom::Start(start)).map_err(io)?;
    let mut bytes = vec![0u8; size];
    input.read_exact(&mut bytes).map_err(io)?;
    if stream {
        return crate::read::ipc_schema::check_message(&bytes);
    }
    let footer =
        arrow::ipc::root_as_footer(&bytes).map_err(|e| format!("a corrupt footer: {e}"))?;
    let schema = footer
        .schema()
        .ok_or_else(|| "a footer without a schema".to_owned())?;
    crate::read::ipc_schema::check_schema(schema)
}

fn count_rows(batches: impl Iterator<Item = Result<RecordBatch>>) -> Result<u64> {
    batches.map(|b| b.map(|b| b.num_rows() as u64)).sum()
}

/// The rows a read takes.
#[derive(Clone, Copy)]
enum Wanted<'a> {
    /// Every row (of the row group read, if one is).
    All,
    /// The rows at these numbers, ascending, with their Parquet selection if it was made
    /// already.
    Rows(&'a [u64], Option<&'a RowSelection>),
    /// The rows of these runs, ascending and disjoint.
    Runs(&'a [Range<u64>]),
}

impl Wanted<'_> {
    /// The Parquet reader's selection of these rows in a file of `num_rows` rows; `None`
    /// for every row.
    fn parquet_selection(self, num_rows: u64) -> Option<RowSelection> {
        match self {
            Self::All => None,
            Self::Rows(_, Some(prepared)) => Some(prepared.clone()),
            Self::Rows(rows, None) => Some(selection(rows, num_rows)),
            Self::Runs(runs) => Some(ranges_selection(runs, num_rows)),
        }
    }

    /// The row numbers, for formats without a selection of their own; `None` for every
    /// row.
    fn listed(self) -> Option<Vec<u64>> {
        match self {
            Self::All => None,
            Self::Rows(rows, _) => Some(rows.to_vec()),
            Self::Runs(runs) => Some(runs.iter().flat_map(Range::clone).collect()),
        }
    }
}

/// A Parquet row selection of the ascending row numbers `rows`, in runs.
fn selection(rows: &[u64], num_rows: u64) -> RowSelection {
    let mut runs: Vec<Range<u64>> = Vec::new();
    for &row in rows {
        match runs.last_mut() {
            Some(run) if run.end == row => run.end += 1,
            _ => runs.push(row..row + 1),
        }
    }
    ranges_selection(&runs, num_rows)
}

/// The Parquet selection of the rows in `ranges` (ascending and disjoint) of a file of
/// `num_rows` rows.
fn ranges_selection(ranges: &[Range<u64>], num_rows: u64) -> RowSelection {
    let mut selectors = Vec::with_capacity(ranges.len() * 2 + 1);
    let mut next = 0u64;
    for range in ranges {
        if range.start > next {
            selectors.push(RowSelector::skip((range.start - next) as usize));
        }
        selectors.push(RowSelector::select((range.end - range.start) as usize));
        next = range.end;
    }
    if num_rows > next {
        selectors.push(RowSelector::skip((num_rows - next) as usize));
    }
    RowSelection::from(selectors)
}

/// Filters an IPC stream down to the rows at `rows` (ascending), for formats without a
/// row selection of their own.
fn select_rows(
    batches: Batches,
    rows: Vec<u64>,
    path: PathBuf,
) -> impl Iterator<Item = Result<RecordBatch>> + Send {
    let mut offset = 0u64;
    let mut cursor = 0usize;
    batches.filter_map(move |batch| {
        let batch = match batch {
            Ok(b) => b,
            Err(e) => return Some(Err(e)),
        };
        let end = offset + batch.num_rows() as u64;
        let start_cursor = cursor;
        while cursor < rows.len() && rows[cursor] < end {
            cursor += 1;
        }
        let local: Vec<u64> = rows[start_cursor..cursor]
            .iter()
            .map(|r| r - offset)
            .collect();
        offset = end;
        if local.is_empty() {
            return None;
        }
        let indices = arrow::array::UInt64Array::from(local);
        Some(arrow::compute::take_record_batch(&batch, &indices).map_err(Error::arrow(&path)))
    })
}

/// A batch's identity: its files (name, size, ETag or modification time, rows) and the
/// policy that decides its rows. The same files merged again have the same fingerprint.
pub(crate) fn fingerprint(files: &[InputFile], spec: &DedupSpec) -> Result<String> {
    let mut parts: Vec<String> = Vec::with_capacity(files.len() + 1);
    for file in files {
        let identity = match file.source().stored() {
            StoredFile::Local(path) => {
                let meta = std::fs::metadata(path).map_err(Error::io(path))?;
                let modified = meta
                    .modified()
                    .ok()
                    .and_then(|m| m.duration_since(std::time::UNIX_EPOCH).ok())
                    .map_or(0, |d| d.as_nanos());
                let path = std::path::absolute(path).map_err(Error::io(path))?;
                format!("{}\u{1f}{}\u{1f}{modified}", path.display(), meta.len())
            }
            StoredFile::Remote(remote) => format!(
                "{}\u{1f}{}\u{1f}{}",
                remote.display_path().display(),
                remote.size(),
                remote.version()
            ),
        };
        parts.push(format!("{identity}\u{1f}{}", file.num_rows()));
    }
    parts.sort();
    let deletes = spec.options.deletes.as_ref().map_or(String::new(), |d| {
        format!("{}={}", d.op_column, d.delete_values.join(","))
    });
    parts.push(format!(
        "key={}\u{1f}version={}\u{1f}on_tie={}\u{1f}deletes={deletes}",
        spec.keys.join(","),
        spec.versions.join(","),
        spec.options.on_tie
    ));
    let digest = twox_hash::XxHash3_128::oneshot(parts.join("\u{1e}").as_bytes());
    Ok(format!("{digest:032x}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::read::expand::expand_inputs;
    use crate::storage::StorageOptions;

    /// A Parquet file of `rows` rows of an integer and a text of `text_bytes` bytes.
    fn file_of(dir: &Path, name: &str, rows: usize, text_bytes: usize) -> InputFile {
        use arrow::array::{Int64Array, StringArray};
        let path = dir.join(name);
        // Distinct texts, so that the column is not one dictionary entry.
        let texts: Vec<String> = (0..rows)
            .map(|i| format!("{i:08}{}", "x".repeat(text_bytes.saturating_sub(8))))
            .collect();
        let batch = RecordBatch::try_from_iter([
            (
                "id",
                Arc::new(Int64Array::from_iter_values(0..rows as i64)) as ArrayRef,
            ),
            ("text", Arc::new(StringArray::from_iter_values(&texts))),
        ])
        .expect("batch");
        let mut writer = parquet::arrow::ArrowWriter::try_new(
            File::create(&path).expect("create"),
            batch.schema(),
            None,
        )
        .expect("writer");
        writer.write(&batch).expect("write");
        writer.close().expect("close");
        let sources = expand_inputs(&[path.display().to_string()], &StorageOptions::default())
            .expect("expand");
        InputFile::open(&sources[0]).expect("open")
    }

    #[test]
    fn whole_rows_come_in_batches_of_a_few_megabytes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let narrow = file_of(dir.path(), "narrow.parquet", 50_000, 8);
        assert_eq!(narrow.row_batch_size(), MAX_ROW_BATCH_SIZE);
        let wide = file_of(dir.path(), "wide.parquet", 2_000, 4_000);
        assert_eq!(wide.row_batch_size(), BATCH_SIZE);
        // The batches of a read are that size.
        let rows: Vec<u64> = (0..50_000).collect();
        let sizes: Vec<usize> = narrow
            .read_rows(&rows)
            .expect("read")
            .map(|b| b.expect("batch").num_rows())
            .collect();
        assert_eq!(sizes[0], MAX_ROW_BATCH_SIZE);
        assert_eq!(sizes.iter().sum::<usize>(), 50_000);
    }

    /// Every value of column `name` in `batches`, as text.
    fn texts(batches: Batches, name: &str) -> Vec<String> {
        use arrow::array::{Array, AsArray};
        let mut values = Vec::new();
        for batch in batches {
            let batch = batch.expect("batch");
            let column = batch.column_by_name(name).expect("column");
            let column =
                arrow::compute::cast(column, &arrow::datatypes::DataType::Utf8).expect("cast");
            let column = column.as_string::<i32>();
            values.extend((0..column.len()).map(|i| column.value(i).to_owned()));
        }
        values
    }

    #[test]
    fn passes_read_parquet_text_as_views_of_the_same_values() {
        use arrow::datatypes::DataType;
        let dir = tempfile::tempdir().expect("tempdir");
        let file = file_of(dir.path(), "f.parquet", 3_000, 40);
        let text_type = |batches: Batches| {
            let first = batches.into_iter().next().expect("a batch").expect("read");
            first
                .schema()
                .field_with_name("text")
                .expect("text")
                .data_type()
                .clone()
        };
        let stored = || file.read_columns(&["text"]).expect("read");
        assert_eq!(text_type(stored()), DataType::Utf8);
        let all: Vec<u64> = (0..3_000).collect();
        assert_eq!(
            text_type(file.read_rows(&all).expect("rows")),
            DataType::Utf8View
        );
        let piece = file.pieces()[0];
        let piece_read = || {
            file.read_piece_columns(&["id", "text"], piece)
                .expect("piece")
        };
        assert_eq!(text_type(piece_read()), DataType::Utf8View);
        let viewed = || {
            file.read_columns_as(&["text"], TextLayout::Views)
                .expect("views")
        };
        assert_eq!(text_type(viewed()), DataType::Utf8View);

        assert_eq!(
            texts(file.read_rows(&all).expect("rows"), "text"),
            texts(stored(), "text")
        );
        assert_eq!(texts(piece_read(), "text"), texts(stored(), "text"));
        let some = [5u64, 6, 2_999];
        assert_eq!(
            texts(file.read_rows(&some).expect("some rows"), "text"),
            ["00000005", "00000006", "00002999"]
                .map(|prefix| format!("{prefix}{}", "x".repeat(32)))
        );
        // The schema the job sees is the file's own.
        assert_eq!(file.schema().field(1).data_type(), &DataType::Utf8);
    }

    #[test]
    fn arrow_ipc_text_is_read_as_stored() {
        use arrow::array::StringArray;
        use arrow::datatypes::DataType;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f.arrow");
        let batch = RecordBatch::try_from_iter([(
            "text",
            Arc::new(StringArray::from(vec!["a", "b"])) as ArrayRef,
        )])
        .expect("batch");
        let mut writer = arrow::ipc::writer::FileWriter::try_new(
            File::create(&path).expect("create"),
            &batch.schema(),
        )
        .expect("writer");
        writer.write(&batch).expect("write");
        writer.finish().expect("finish");
        let sources = expand_inputs(&[path.display().to_string()], &StorageOptions::default())
            .expect("expand");
        let file = InputFile::open(&sources[0]).expect("open");
        let read = file
            .read_rows(&[0, 1])
            .expect("rows")
            .next()
            .expect("a batch")
            .expect("read");
        assert_eq!(read.schema().field(0).data_type(), &DataType::Utf8);
        assert_eq!(texts(file.read_rows(&[1]).expect("rows"), "text"), ["b"]);
    }

    #[test]
    fn selection_of_ranges_is_that_of_their_rows() {
        let ranges = [0..3, 5..6, 9..10];
        let rows: Vec<u64> = ranges.iter().flat_map(Range::clone).collect();
        for num_rows in [10, 12] {
            let of_ranges = Vec::<RowSelector>::from(ranges_selection(&ranges, num_rows));
            let of_rows = Vec::<RowSelector>::from(selection(&rows, num_rows));
            assert_eq!(of_ranges, of_rows, "{num_rows} rows");
        }
        assert_eq!(
            Vec::<RowSelector>::from(ranges_selection(&[], 4)),
            vec![RowSelector::skip(4)]
        );
    }

    #[test]
    fn selection_runs() {
        let sel = selection(&[0, 1, 2, 5, 9], 12);
        let runs: Vec<(bool, usize)> = Vec::<RowSelector>::from(sel)
            .into_iter()
            .map(|s| (s.skip, s.row_count))
            .collect();
        assert_eq!(
            runs,
            vec![
                (false, 3),
                (true, 2),
                (false, 1),
                (true, 3),
                (false, 1),
                (true, 2)
            ]
        );
    }
}
