//! Object storage: inputs and outputs named by URL (`s3://`, `gs://`, `az://`, `memory://`,
//! `file://`) through the `object_store` crate, configured the standard way — `AWS_*`,
//! `GOOGLE_*` and `AZURE_*` environment variables, overridden by `--storage-option KEY=VALUE`.
//!
//! The jobs read with Parquet's synchronous reader on their own threads, so remote objects
//! are adapted to it: [`RemoteFile`] answers Parquet's byte-range requests with ranged GETs
//! (one per page when the file has an offset index), and reads sequential streams (page
//! headers, Arrow IPC) in blocks. Calls block on a small runtime owned by this module.
//!
//! Option values are never printed: they may be credentials.

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::path::{Path as ObjectPath, PathPart};
use object_store::{ObjectStore, ObjectStoreExt, WriteMultipart};
use parquet::errors::ParquetError;
use parquet::file::reader::{ChunkReader, Length};
use url::Url;

use crate::error::{Error, Result};

/// URL schemes read through `object_store` (`file://` is turned into a local path).
const REMOTE_SCHEMES: &[&str] = &[
    "s3", "s3a", "gs", "az", "abfs", "abfss", "azure", "adl", "memory",
];
/// Bytes fetched at a time for sequential reads (page headers, Arrow IPC).
const READ_BLOCK: usize = 1 << 20;
/// Part size of multipart uploads.
const UPLOAD_PART: usize = 8 << 20;

/// `--storage-option KEY=VALUE` pairs, applied over the environment's configuration.
#[derive(Clone, Default)]
pub struct StorageOptions {
    pairs: Vec<(String, String)>,
}

impl std::fmt::Debug for StorageOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Keys only: values may be secrets.
        f.debug_list()
            .entries(self.pairs.iter().map(|(k, _)| k))
            .finish()
    }
}

impl StorageOptions {
    /// Parses `KEY=VALUE` strings.
    ///
    /// # Errors
    /// A string without `=`.
    pub fn parse<S: AsRef<str>>(pairs: &[S]) -> Result<Self> {
        let pairs = pairs
            .iter()
            .map(|pair| {
                let pair = pair.as_ref();
                pair.split_once('=')
                    .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.to_owned()))
                    .ok_or_else(|| {
                        let key = pair.chars().take(40).collect::<String>();
                        Error::InvalidArgument(format!(
                            "--storage-option wants KEY=VALUE, got '{key}…'"
                        ))
                    })
            })
            .collect::<Result<_>>()?;
        Ok(Self { pairs })
    }
}

/// Where an input or output lives.
#[derive(Debug, Clone)]
pub enum Location {
    /// A local path (also what a `file://` URL names).
    Local(PathBuf),
    /// An object, or a prefix of objects, in a store.
    Remote(RemoteLocation),
}

/// A URL resolved to its store and the path inside it.
#[derive(Clone)]
pub struct RemoteLocation {
    store: Arc<dyn ObjectStore>,
    /// `scheme://authority`, to rebuild URLs of objects found by listing.
    root: String,
    path: ObjectPath,
}

impl std::fmt::Debug for RemoteLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.url())
    }
}

impl RemoteLocation {
    /// The location as a URL.
    pub fn url(&self) -> String {
        format!("{}/{}", self.root, self.path)
    }

    /// The URL as a path-like name, the form errors and stats name files in.
    pub fn display_path(&self) -> PathBuf {
        PathBuf::from(self.url())
    }

    fn child(&self, path: ObjectPath) -> Self {
        Self {
            store: Arc::clone(&self.store),
            root: self.root.clone(),
            path,
        }
    }

    fn error(&self, source: object_store::Error) -> Error {
        Error::Storage {
            url: self.url(),
            source,
        }
    }
}

impl Location {
    /// A local path or a URL with a known scheme. Windows drive letters (`C:\…`) are paths.
    ///
    /// # Errors
    /// A URL that does not parse, or a store that cannot be configured from the environment
    /// and `options` (an unknown option key, a missing region, …).
    pub fn parse(location: &str, options: &StorageOptions) -> Result<Self> {
        let Some((scheme, _)) = location.split_once("://") else {
            return Ok(Self::Local(PathBuf::from(location)));
        };
        let scheme = scheme.to_ascii_lowercase();
        if scheme == "file" {
            let url = parse_url(location)?;
            let path = url.to_file_path().map_err(|()| {
                Error::InvalidArgument(format!("'{location}' is not a local file URL"))
            })?;
            return Ok(Self::Local(path));
        }
        if !REMOTE_SCHEMES.contains(&scheme.as_str()) {
            return Err(Error::InvalidArgument(format!(
                "'{location}': unsupported URL scheme '{scheme}' (use s3://, gs://, az://, \
                 file://, memory:// or a local path)"
            )));
        }
        let url = parse_url(location)?;
        let root = format!("{}://{}", url.scheme(), url.authority());
        let store = store_for(&url, &root, options)?;
        // Keep glob characters literal: Url would percent-encode them in the path.
        let raw_path = location
            .split_once("://")
            .and_then(|(_, rest)| rest.split_once('/'))
            .map_or("", |(_, path)| path);
        let path = ObjectPath::parse(raw_path.trim_end_matches('/'))
            .map_err(|e| Error::InvalidArgument(format!("'{location}': bad object path: {e}")))?;
        Ok(Self::Remote(RemoteLocation { store, root, path }))
    }

    /// The location as given, for messages.
    pub fn display_path(&self) -> PathBuf {
        match self {
            Self::Local(path) => path.clone(),
            Self::Remote(remote) => remote.display_path(),
        }
    }
}

/// The store for a URL's `scheme://authority`, configured from the environment and
/// `options` (what a DataFusion session needs to read `s3://…` tables).
///
/// # Errors
/// An unsupported scheme or a store that cannot be configured.
pub fn object_store_for(url: &Url, options: &StorageOptions) -> Result<Arc<dyn ObjectStore>> {
    if !REMOTE_SCHEMES.contains(&url.scheme()) {
        return Err(Error::InvalidArgument(format!(
            "'{url}': unsupported URL scheme '{}'",
            url.scheme()
        )));
    }
    store_for(
        url,
        &format!("{}://{}", url.scheme(), url.authority()),
        options,
    )
}

fn parse_url(location: &str) -> Result<Url> {
    Url::parse(location).map_err(|e| Error::InvalidArgument(format!("'{location}': {e}")))
}

/// One store per `scheme://authority` per process, so `memory://` keeps what was written
/// to it and connections are reused.
fn store_for(url: &Url, root: &str, options: &StorageOptions) -> Result<Arc<dyn ObjectStore>> {
    static STORES: OnceLock<Mutex<HashMap<String, Arc<dyn ObjectStore>>>> = OnceLock::new();
    let mut stores = STORES
        .get_or_init(Mutex::default)
        .lock()
        .map_err(|_| Error::InvalidArgument("object store registry poisoned".to_owned()))?;
    if let Some(store) = stores.get(root) {
        return Ok(Arc::clone(store));
    }
    let configure_error = |source: object_store::Error| Error::Storage {
        url: root.to_owned(),
        source,
    };
    let unknown = |key: &str| {
        Error::InvalidArgument(format!(
            "{root}: unknown storage option '{key}' for this kind of store"
        ))
    };
    // The three builders share no trait; each takes the environment, the URL, then options.
    #[cfg(feature = "cloud")]
    macro_rules! configured {
        ($builder:ty) => {{
            let mut builder = <$builder>::from_env().with_url(url.as_str());
            for (key, value) in &options.pairs {
                let key = key.parse().map_err(|_| unknown(key))?;
                builder = builder.with_config(key, value);
            }
            Arc::new(builder.build().map_err(configure_error)?)
        }};
    }
    let store: Arc<dyn ObjectStore> = match url.scheme() {
        "memory" => Arc::new(object_store::memory::InMemory::new()),
        #[cfg(feature = "cloud")]
        "s3" | "s3a" => configured!(object_store::aws::AmazonS3Builder),
        #[cfg(feature = "cloud")]
        "gs" => configured!(object_store::gcp::GoogleCloudStorageBuilder),
        #[cfg(feature = "cloud")]
        _ => configured!(object_store::azure::MicrosoftAzureBuilder),
        #[cfg(not(feature = "cloud"))]
        scheme => {
            let _ = (configure_error, unknown, options);
            return Err(Error::InvalidArgument(format!(
                "{root}: this idem was built without the `cloud` feature, which {scheme}:// \
                 needs"
            )));
        }
    };
    stores.insert(root.to_owned(), Arc::clone(&store));
    Ok(store)
}

/// Runs `future` to completion from synchronous code, also from inside another runtime
/// (`idem sql` writes its output from one).
pub(crate) fn block_on<F: Future>(future: F) -> std::io::Result<F::Output> {
    static RUNTIME: OnceLock<Option<tokio::runtime::Runtime>> = OnceLock::new();
    let runtime = RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("idem-storage")
            .enable_all()
            .build()
            .ok()
    });
    let runtime = runtime
        .as_ref()
        .ok_or_else(|| std::io::Error::other("cannot start the object storage runtime"))?;
    if tokio::runtime::Handle::try_current().is_ok() {
        Ok(tokio::task::block_in_place(|| runtime.block_on(future)))
    } else {
        Ok(runtime.block_on(future))
    }
}

/// [`block_on`] for store calls, with errors naming `url`.
fn run<T>(
    url: impl FnOnce() -> String,
    future: impl Future<Output = object_store::Result<T>>,
) -> Result<T> {
    match block_on(future) {
        Ok(result) => result.map_err(|source| Error::Storage { url: url(), source }),
        Err(e) => Err(Error::io(url())(e)),
    }
}

/// Hidden and marker objects (`_SUCCESS`, `_delta_log/…`, `.tmp`) are not data.
fn is_hidden_part(part: &str) -> bool {
    part.starts_with('.') || part.starts_with('_')
}

impl RemoteLocation {
    /// The objects this location names, in sorted order: itself if it is an object, every
    /// data object below it if it is a prefix, the matches if it is a glob.
    ///
    /// # Errors
    /// The store cannot be listed.
    pub fn expand(&self, is_data_file: impl Fn(&Path) -> bool) -> Result<Vec<RemoteFile>> {
        let text = self.path.as_ref();
        if let Some(glob_at) = text.find(['*', '?', '[']) {
            let prefix = text[..glob_at].rsplit_once('/').map_or("", |(dir, _)| dir);
            let pattern = glob::Pattern::new(text)
                .map_err(|e| Error::InvalidArgument(format!("bad glob '{}': {e}", self.url())))?;
            let options = glob::MatchOptions {
                require_literal_separator: true,
                ..glob::MatchOptions::new()
            };
            let listed = self.list(&ObjectPath::from(prefix))?;
            return Ok(listed
                .into_iter()
                .filter(|meta| {
                    let name = meta.location.as_ref();
                    // A match, or a data object inside a matching directory.
                    pattern.matches_with(name, options)
                        || name
                            .char_indices()
                            .filter(|&(_, c)| c == '/')
                            .any(|(i, _)| {
                                pattern.matches_with(&name[..i], options)
                                    && is_data_file(Path::new(name))
                            })
                })
                .filter(|meta| self.visible_data(meta, prefix, &is_data_file))
                .map(|meta| self.file(meta))
                .collect());
        }
        match run(|| self.url(), self.store.head(&self.path)) {
            Ok(meta) => return Ok(vec![self.file(meta)]),
            Err(Error::Storage {
                source: object_store::Error::NotFound { .. },
                ..
            }) => {}
            Err(e) => return Err(e),
        }
        let prefix = self.path.as_ref();
        Ok(self
            .list(&self.path)?
            .into_iter()
            .filter(|meta| {
                self.visible_data(meta, prefix, &is_data_file)
                    && is_data_file(Path::new(meta.location.as_ref()))
            })
            .map(|meta| self.file(meta))
            .collect())
    }

    /// Whether a listed object is data: no hidden component below the listed prefix.
    fn visible_data(
        &self,
        meta: &object_store::ObjectMeta,
        prefix: &str,
        is_data_file: &impl Fn(&Path) -> bool,
    ) -> bool {
        let name = meta.location.as_ref();
        let below = name
            .strip_prefix(prefix)
            .unwrap_or(name)
            .trim_start_matches('/');
        is_data_file(Path::new(name)) && !below.split('/').any(is_hidden_part)
    }

    fn list(&self, prefix: &ObjectPath) -> Result<Vec<object_store::ObjectMeta>> {
        let prefix = (!prefix.as_ref().is_empty()).then_some(prefix);
        let mut listed = run(
            || self.url(),
            self.store.list(prefix).try_collect::<Vec<_>>(),
        )?;
        listed.sort_by(|a, b| a.location.cmp(&b.location));
        Ok(listed)
    }

    fn file(&self, meta: object_store::ObjectMeta) -> RemoteFile {
        RemoteFile {
            location: self.child(meta.location),
            size: meta.size,
            version: meta
                .e_tag
                .unwrap_or_else(|| meta.last_modified.timestamp_millis().to_string()),
            block: Arc::default(),
        }
    }

    /// This object, whose size is known (from a table's log), without asking the store.
    pub fn file_of_size(&self, size: u64) -> RemoteFile {
        RemoteFile {
            location: self.clone(),
            size,
            version: String::new(),
            block: Arc::default(),
        }
    }

    /// Uploads a local file to this location as one object. Object stores make an upload
    /// visible only when it completes, so readers see the old object or the new one.
    ///
    /// # Errors
    /// The local file cannot be read or the upload fails (it is then aborted).
    pub fn upload(&self, local: &Path) -> Result<()> {
        let mut file = std::fs::File::open(local).map_err(Error::io(local))?;
        let uploaded = block_on(async {
            let upload = self
                .store
                .put_multipart(&self.path)
                .await
                .map_err(|e| self.error(e))?;
            let mut writer = WriteMultipart::new_with_chunk_size(upload, UPLOAD_PART);
            let mut buffer = vec![0u8; UPLOAD_PART];
            loop {
                let read = match file.read(&mut buffer) {
                    Ok(0) => break,
                    Ok(read) => read,
                    Err(e) => {
                        let _ = writer.abort().await;
                        return Err(Error::io(local)(e));
                    }
                };
                if let Err(e) = writer.wait_for_capacity(4).await {
                    let _ = writer.abort().await;
                    return Err(self.error(e));
                }
                writer.write(&buffer[..read]);
            }
            writer.finish().await.map_err(|e| self.error(e))?;
            Ok(())
        });
        uploaded.map_err(Error::io(local))?
    }

    /// The objects directly named `prefix/NAME` and below, for replacing an output
    /// directory.
    ///
    /// # Errors
    /// The store cannot be listed.
    pub fn objects_below(&self) -> Result<Vec<RemoteLocation>> {
        Ok(self
            .list(&self.path)?
            .into_iter()
            .map(|meta| self.child(meta.location))
            .collect())
    }

    /// Whether any object lies below this prefix (one LIST page, not a full listing).
    ///
    /// # Errors
    /// The store cannot be listed.
    pub fn has_objects_below(&self) -> Result<bool> {
        let mut listing = self.store.list(Some(&self.path));
        let first = run(|| self.url(), async { listing.next().await.transpose() })?;
        Ok(first.is_some())
    }

    /// The object at `relative` below this location: `/` separates levels, and each level
    /// is kept as written (a Delta partition directory such as `c=a%2Fb` is the object key
    /// readers look for, not a name to escape again).
    pub fn join(&self, relative: &str) -> RemoteLocation {
        let mut path = self.path.clone();
        for level in relative.split('/').filter(|l| !l.is_empty()) {
            // Only `.`, `..` and control characters are not valid as they are.
            path = path.join(PathPart::parse(level).unwrap_or_else(|_| PathPart::from(level)));
        }
        self.child(path)
    }

    /// Deletes the object; a missing one is fine.
    ///
    /// # Errors
    /// The store refuses.
    pub fn delete(&self) -> Result<()> {
        match run(|| self.url(), self.store.delete(&self.path)) {
            Ok(())
            | Err(Error::Storage {
                source: object_store::Error::NotFound { .. },
                ..
            }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Whether an object exists here.
    ///
    /// # Errors
    /// The store cannot be asked.
    pub fn is_object(&self) -> Result<bool> {
        match run(|| self.url(), self.store.head(&self.path)) {
            Ok(_) => Ok(true),
            Err(Error::Storage {
                source: object_store::Error::NotFound { .. },
                ..
            }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Server-side copy of this object to `to`.
    ///
    /// # Errors
    /// The store refuses.
    pub fn copy_to(&self, to: &RemoteLocation) -> Result<()> {
        run(|| self.url(), self.store.copy(&self.path, &to.path))
    }

    /// The last component of the path.
    pub fn file_name(&self) -> Option<&str> {
        self.path.filename()
    }
}

/// A directory that idem keeps its own objects in (the dedup state), local or remote,
/// behind one object-store interface: a local path becomes a `LocalFileSystem` store, whose
/// writes are also atomic renames and whose create-if-absent is a hard link.
///
/// # Errors
/// A URL that does not parse, a store that cannot be configured, or a local directory that
/// cannot be created.
pub(crate) fn managed_directory(
    location: &str,
    options: &StorageOptions,
) -> Result<RemoteLocation> {
    match Location::parse(location, options)? {
        Location::Remote(remote) => Ok(remote),
        Location::Local(dir) => {
            std::fs::create_dir_all(&dir).map_err(Error::io(&dir))?;
            let absolute = std::fs::canonicalize(&dir).map_err(Error::io(&dir))?;
            let path = ObjectPath::from_absolute_path(&absolute)
                .map_err(|e| Error::InvalidArgument(format!("{}: {e}", absolute.display())))?;
            Ok(RemoteLocation {
                store: Arc::new(object_store::local::LocalFileSystem::new()),
                root: "file://".to_owned(),
                path,
            })
        }
    }
}

/// An object found by listing: its name below the listed prefix and its age.
#[derive(Debug, Clone)]
pub(crate) struct ListedObject {
    /// `/`-separated path below the listed location.
    pub name: String,
    /// Milliseconds since the epoch of its last modification.
    pub modified_ms: i64,
}

impl RemoteLocation {
    /// The object's bytes, `None` if there is no such object.
    ///
    /// # Errors
    /// The store fails otherwise.
    pub(crate) fn read_all(&self) -> Result<Option<Bytes>> {
        let got = run(|| self.url(), async {
            match self.store.get(&self.path).await {
                Ok(result) => result.bytes().await.map(Some),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(e),
            }
        })?;
        Ok(got)
    }

    /// Writes the object whole (readers see the old bytes or the new ones).
    ///
    /// # Errors
    /// The store refuses.
    pub(crate) fn write_all(&self, bytes: Bytes) -> Result<()> {
        run(|| self.url(), self.store.put(&self.path, bytes.into())).map(|_| ())
    }

    /// Writes the object only if none exists: the commit point of a protocol. False when
    /// another writer was first.
    ///
    /// # Errors
    /// The store refuses for another reason.
    pub(crate) fn create_new(&self, bytes: Bytes) -> Result<bool> {
        let options = object_store::PutOptions::from(object_store::PutMode::Create);
        match run(
            || self.url(),
            self.store.put_opts(&self.path, bytes.into(), options),
        ) {
            Ok(_) => Ok(true),
            Err(Error::Storage {
                source: object_store::Error::AlreadyExists { .. },
                ..
            }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Every object below this prefix, sorted by name.
    ///
    /// # Errors
    /// The store cannot be listed.
    pub(crate) fn list_below(&self) -> Result<Vec<ListedObject>> {
        let prefix = self.path.as_ref().to_owned();
        Ok(self
            .list(&self.path)?
            .into_iter()
            .map(|meta| ListedObject {
                name: meta
                    .location
                    .as_ref()
                    .strip_prefix(&prefix)
                    .unwrap_or(meta.location.as_ref())
                    .trim_start_matches('/')
                    .to_owned(),
                modified_ms: meta.last_modified.timestamp_millis(),
            })
            .collect())
    }
}

/// A remote object, read by Parquet's synchronous reader through ranged GETs.
#[derive(Clone, Debug)]
pub struct RemoteFile {
    location: RemoteLocation,
    size: u64,
    /// The object's ETag (or, where the store gives none, its modification time): what
    /// tells one upload of a name from another.
    version: String,
    /// The last block fetched for a sequential read: Parquet reads a page header through
    /// [`ChunkReader::get_read`] and then its body through `get_bytes`, usually inside it.
    block: Arc<Mutex<(u64, Bytes)>>,
}

impl RemoteFile {
    /// The object's URL as a path-like name.
    pub fn display_path(&self) -> PathBuf {
        self.location.display_path()
    }

    /// The object's URL.
    pub fn url(&self) -> String {
        self.location.url()
    }

    fn fetch(&self, start: u64, length: u64) -> std::io::Result<Bytes> {
        let end = (start + length).min(self.size);
        if start >= end {
            return Ok(Bytes::new());
        }
        if let Ok(block) = self.block.lock()
            && start >= block.0
            && end <= block.0 + block.1.len() as u64
        {
            let from = (start - block.0) as usize;
            return Ok(block.1.slice(from..from + (end - start) as usize));
        }
        block_on(
            self.location
                .store
                .get_range(&self.location.path, start..end),
        )?
        .map_err(std::io::Error::other)
    }

    fn fetch_block(&self, start: u64) -> std::io::Result<Bytes> {
        let bytes = self.fetch(start, READ_BLOCK as u64)?;
        if let Ok(mut block) = self.block.lock() {
            *block = (start, bytes.clone());
        }
        Ok(bytes)
    }

    /// The object's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The object's ETag or modification time, as listed (empty if it was not listed).
    pub fn version(&self) -> &str {
        &self.version
    }

    /// A `Read + Seek` view from the start, for Arrow IPC readers.
    pub fn reader(&self) -> RemoteReader {
        RemoteReader {
            file: self.clone(),
            position: 0,
            buffer: Bytes::new(),
            buffer_start: 0,
        }
    }
}

impl Length for RemoteFile {
    fn len(&self) -> u64 {
        self.size
    }
}

impl ChunkReader for RemoteFile {
    type T = RemoteReader;

    fn get_read(&self, start: u64) -> parquet::errors::Result<RemoteReader> {
        let mut reader = self.reader();
        reader.position = start;
        Ok(reader)
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        let bytes = self
            .fetch(start, length as u64)
            .map_err(|e| ParquetError::External(Box::new(e)))?;
        if bytes.len() < length {
            return Err(ParquetError::EOF(format!(
                "{}: wanted {length} bytes at {start}, the object has {}",
                self.location.url(),
                self.size
            )));
        }
        Ok(bytes)
    }
}

/// Sequential reads of a [`RemoteFile`], a block at a time.
pub struct RemoteReader {
    file: RemoteFile,
    position: u64,
    buffer: Bytes,
    buffer_start: u64,
}

impl Read for RemoteReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if self.position >= self.file.size || out.is_empty() {
            return Ok(0);
        }
        let buffered_end = self.buffer_start + self.buffer.len() as u64;
        if self.position < self.buffer_start || self.position >= buffered_end {
            self.buffer = self.file.fetch_block(self.position)?;
            self.buffer_start = self.position;
        }
        let from = (self.position - self.buffer_start) as usize;
        let n = out.len().min(self.buffer.len() - from);
        out[..n].copy_from_slice(&self.buffer[from..from + n]);
        self.position += n as u64;
        Ok(n)
    }
}

impl Seek for RemoteReader {
    fn seek(&mut self, to: SeekFrom) -> std::io::Result<u64> {
        let position = match to {
            SeekFrom::Start(p) => Some(p),
            SeekFrom::End(d) => self.file.size.checked_add_signed(d),
            SeekFrom::Current(d) => self.position.checked_add_signed(d),
        };
        self.position = position.ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "seek before the start")
        })?;
        Ok(self.position)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::read::expand::expand_inputs;
    use crate::read::input::InputFile;
    use crate::write::output::OutputWriter;
    use arrow::array::{ArrayRef, Int64Array, RecordBatch, StringArray};

    fn batch(from: i64, rows: i64) -> RecordBatch {
        let ids: Vec<String> = (from..from + rows).map(|i| format!("e{i}")).collect();
        RecordBatch::try_from_iter([
            ("event_id", Arc::new(StringArray::from(ids)) as ArrayRef),
            (
                "lsn",
                Arc::new(Int64Array::from_iter_values(from..from + rows)) as ArrayRef,
            ),
        ])
        .expect("batch")
    }

    /// Writes Parquet locally and uploads it, so the test reads what a store really holds.
    fn put_parquet(url: &str, batch: &RecordBatch) {
        let dir = tempfile::tempdir().expect("tmp");
        let local = dir.path().join("f.parquet");
        let file = std::fs::File::create(&local).expect("create");
        let mut writer =
            parquet::arrow::ArrowWriter::try_new(file, batch.schema(), None).expect("writer");
        writer.write(batch).expect("write");
        writer.close().expect("close");
        let Location::Remote(remote) =
            Location::parse(url, &StorageOptions::default()).expect("parse")
        else {
            panic!("{url} is not remote");
        };
        remote.upload(&local).expect("upload");
    }

    fn rows(sources: &[crate::read::input::InputSource]) -> u64 {
        sources
            .iter()
            .map(|s| InputFile::open(s).expect("open").num_rows())
            .sum()
    }

    #[test]
    fn options_parse_and_never_show_values() {
        let options =
            StorageOptions::parse(&["AWS_REGION=eu-west-1", "secret=s3cr3t"]).expect("parse");
        let shown = format!("{options:?}");
        assert!(
            shown.contains("aws_region") && !shown.contains("s3cr3t"),
            "{shown}"
        );
        let refused = StorageOptions::parse(&["novalue"]).expect_err("no =");
        assert!(refused.to_string().contains("KEY=VALUE"));
        let unknown = Location::parse(
            "s3://bucket-for-options-test/x",
            &StorageOptions::parse(&["no_such_key=hunter2"]).expect("parse"),
        )
        .expect_err("unknown key");
        let text = unknown.to_string();
        assert!(!text.contains("hunter2"), "{text}");
        #[cfg(feature = "cloud")]
        assert!(text.contains("no_such_key"), "{text}");
    }

    #[test]
    fn locations_local_file_urls_and_remote() {
        let options = StorageOptions::default();
        assert!(matches!(
            Location::parse("data/events", &options),
            Ok(Location::Local(p)) if p == Path::new("data/events")
        ));
        assert!(matches!(
            Location::parse("file:///tmp/x.parquet", &options),
            Ok(Location::Local(p)) if p == Path::new("/tmp/x.parquet")
        ));
        let Ok(Location::Remote(remote)) = Location::parse("memory://m0/a/b/*.parquet", &options)
        else {
            panic!("memory URL");
        };
        assert_eq!(remote.url(), "memory://m0/a/b/*.parquet");
        let refused = Location::parse("ftp://host/x", &options).expect_err("ftp");
        assert!(refused.to_string().contains("unsupported URL scheme"));
    }

    #[test]
    fn prefixes_globs_and_objects_expand_in_sorted_order_without_hidden_ones() {
        put_parquet("memory://m1/events/b.parquet", &batch(0, 10));
        put_parquet("memory://m1/events/a.parquet", &batch(10, 5));
        put_parquet("memory://m1/events/day=2/c.parquet", &batch(15, 3));
        put_parquet("memory://m1/events/_tmp/x.parquet", &batch(0, 100));
        put_parquet("memory://m1/events/.hidden.parquet", &batch(0, 100));
        put_parquet("memory://m1/other/d.parquet", &batch(0, 7));
        let options = StorageOptions::default();
        let expand = |input: &str| -> Vec<String> {
            expand_inputs(&[input.to_owned()], &options)
                .expect(input)
                .iter()
                .map(|s| s.path().display().to_string())
                .collect()
        };
        assert_eq!(
            expand("memory://m1/events"),
            [
                "memory://m1/events/a.parquet",
                "memory://m1/events/b.parquet",
                "memory://m1/events/day=2/c.parquet"
            ]
        );
        assert_eq!(
            expand("memory://m1/events/*.parquet"),
            [
                "memory://m1/events/a.parquet",
                "memory://m1/events/b.parquet"
            ]
        );
        assert_eq!(
            expand("memory://m1/*/d.parquet"),
            ["memory://m1/other/d.parquet"]
        );
        assert_eq!(
            expand("memory://m1/other/d.parquet"),
            ["memory://m1/other/d.parquet"]
        );
        let sources = expand_inputs(&["memory://m1/events".to_owned()], &options).expect("x");
        assert_eq!(rows(&sources), 18);
        let empty =
            expand_inputs(&["memory://m1/nothing".to_owned()], &options).expect_err("empty prefix");
        assert!(empty.to_string().contains("memory://m1/nothing"), "{empty}");
    }

    #[test]
    fn remote_parquet_reads_projections_and_row_selections() {
        put_parquet("memory://m2/f.parquet", &batch(0, 5000));
        let sources = expand_inputs(
            &["memory://m2/f.parquet".to_owned()],
            &StorageOptions::default(),
        )
        .expect("expand");
        let file = InputFile::open(&sources[0]).expect("open");
        let ids: usize = file
            .read_columns(&["lsn"])
            .expect("read")
            .map(|b| b.expect("batch").num_rows())
            .sum();
        assert_eq!(ids, 5000);
        let picked: Vec<i64> = file
            .read_rows(&[0, 1, 4000, 4999])
            .expect("rows")
            .flat_map(|b| {
                let b = b.expect("batch");
                let lsn = b
                    .column_by_name("lsn")
                    .and_then(|c| c.as_any().downcast_ref::<Int64Array>().cloned())
                    .expect("lsn");
                lsn.values().to_vec()
            })
            .collect();
        assert_eq!(picked, [0, 1, 4000, 4999]);
    }

    #[test]
    fn joined_levels_are_kept_as_written() {
        let options = StorageOptions::default();
        let Ok(Location::Remote(table)) = Location::parse("memory://m4/table", &options) else {
            panic!("a remote location");
        };
        let file = table.join("status=a%2Fb/part-1.parquet");
        assert_eq!(file.path.as_ref(), "table/status=a%2Fb/part-1.parquet");
        assert_eq!(file.path.parts().count(), 3);
        // What is not valid as written is escaped rather than refused.
        assert_eq!(table.join("..").path.as_ref(), "table/%2E%2E");
    }

    #[test]
    fn outputs_upload_as_one_object_or_replace_a_prefix_whole() {
        let options = StorageOptions::default();
        let data = batch(0, 100);
        let mut writer =
            OutputWriter::create("memory://m3/out.parquet", data.schema(), 1000, &options)
                .expect("writer");
        writer.write(&data).expect("write");
        let files = writer.commit().expect("commit");
        assert_eq!(files, [PathBuf::from("memory://m3/out.parquet")]);
        let read = expand_inputs(&["memory://m3/out.parquet".to_owned()], &options).expect("x");
        assert_eq!(rows(&read), 100);
        // The suffix is matched without regard to case, as for a local output.
        let mut writer =
            OutputWriter::create("memory://m3/UP.PARQUET", data.schema(), 1000, &options)
                .expect("writer");
        writer.write(&data).expect("write");
        assert_eq!(
            writer.commit().expect("commit"),
            [PathBuf::from("memory://m3/UP.PARQUET")]
        );

        // A directory: parts replace whatever was under the prefix, staging leaves nothing.
        put_parquet("memory://m3/dir/stale.parquet", &batch(0, 3));
        let mut writer =
            OutputWriter::create("memory://m3/dir", data.schema(), 40, &options).expect("dir");
        writer.write(&data).expect("write");
        let files = writer.commit().expect("commit");
        assert_eq!(files.len(), 3);
        let Ok(Location::Remote(prefix)) = Location::parse("memory://m3/dir", &options) else {
            panic!("remote");
        };
        let names: Vec<String> = prefix
            .objects_below()
            .expect("list")
            .iter()
            .map(RemoteLocation::url)
            .collect();
        assert_eq!(
            names,
            [
                "memory://m3/dir/part-00000.parquet",
                "memory://m3/dir/part-00001.parquet",
                "memory://m3/dir/part-00002.parquet"
            ]
        );

        // Abandoned before commit: nothing is uploaded.
        let mut writer =
            OutputWriter::create("memory://m3/never.parquet", data.schema(), 1000, &options)
                .expect("writer");
        writer.write(&data).expect("write");
        drop(writer);
        let never = expand_inputs(&["memory://m3/never.parquet".to_owned()], &options);
        assert!(never.is_err());
    }
}
