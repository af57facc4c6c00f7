//! The error type of idem's jobs: every variant says which file or column it is about.

use std::path::PathBuf;

use arrow::error::ArrowError;
use parquet::errors::ParquetError;

/// `Result` with idem's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything a job can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No input was given, or the inputs named no data file.
    #[error("no input files: {0}")]
    NoInput(String),
    /// A file system operation failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A Parquet file could not be read or written (corrupt, truncated, not Parquet).
    #[error("{}: {source}", path.display())]
    Parquet {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: ParquetError,
    },
    /// An Arrow operation on a file's data failed: an unreadable IPC file, a bad value.
    #[error("{}: {source}", path.display())]
    Arrow {
        /// The file whose data was being processed.
        path: PathBuf,
        /// The cause.
        source: ArrowError,
    },
    /// A key, version or op column is missing from a file.
    #[error("{}: {role} column '{column}' not found (columns: {available})", path.display())]
    MissingColumn {
        /// The file.
        path: PathBuf,
        /// The column.
        column: String,
        /// key, version or op.
        role: &'static str,
        /// The file's columns, for the message.
        available: String,
    },
    /// Two files disagree on a column in a way that cannot be unified.
    #[error("{}: column '{column}' has type {found}, but earlier files have {expected}", path.display())]
    SchemaMismatch {
        /// The file that disagrees with those before it.
        path: PathBuf,
        /// The column.
        column: String,
        /// The type so far.
        expected: String,
        /// The file's type.
        found: String,
    },
    /// A non-nullable column is missing from some file, so it cannot be filled with nulls.
    #[error("{}: column '{column}' is missing here and is not nullable in other files", path.display())]
    MissingRequiredColumn {
        /// The file without the column.
        path: PathBuf,
        /// The column.
        column: String,
    },
    /// An object store refused or failed a request (credentials are never part of it).
    #[error("{url}: {source}")]
    Storage {
        /// The object or prefix.
        url: String,
        /// The cause.
        source: object_store::Error,
    },
    /// A SQL statement failed to plan or run.
    #[cfg(feature = "sql")]
    #[error("{0}")]
    DataFusion(#[from] datafusion::error::DataFusionError),
    /// A Delta Lake table could not be read or committed to.
    #[cfg(feature = "delta")]
    #[error("{table}: {source}")]
    Delta {
        /// The table.
        table: String,
        /// The cause.
        source: Box<deltalake_core::DeltaTableError>,
    },
    /// A batch column cannot be stored in the target's column type (a type the target has
    /// no equivalent for, or a value that would change).
    #[error("{target}: column '{column}': {reason}")]
    TargetType {
        /// The table.
        target: String,
        /// The column.
        column: String,
        /// What does not fit, naming the type or the value.
        reason: String,
    },
    /// A PostgreSQL server refused a connection or a statement, or its data does not
    /// fit (the server is named without its password).
    #[error("{target}: {message}")]
    Postgres {
        /// The server and database, as `postgres://user@host:port/database`, and the
        /// table where there is one.
        target: String,
        /// What went wrong, in one line.
        message: String,
    },
    /// A Redis server holding a dedup state refused a connection or a command (the
    /// server is named without its password).
    #[error("{target}: {message}")]
    Redis {
        /// The server and prefix, as `redis://user@host:port/db?prefix=NAME`.
        target: String,
        /// What went wrong, in one line.
        message: String,
    },
    /// The options contradict each other or the input.
    #[error("{0}")]
    InvalidArgument(String),
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { path, source }
    }

    pub(crate) fn parquet(path: impl Into<PathBuf>) -> impl FnOnce(ParquetError) -> Self {
        let path = path.into();
        move |source| Self::Parquet { path, source }
    }

    pub(crate) fn arrow(path: impl Into<PathBuf>) -> impl FnOnce(ArrowError) -> Self {
        let path = path.into();
        move |source| Self::Arrow { path, source }
    }
}

/// An error and its causes as the one line that schedulers and log scrapers expect: each
/// cause not already in the message is appended after a colon, and dependencies' messages
/// that span lines (flatbuffers' verifier lists where it looked) or carry a backtrace
/// (delta-kernel appends one under `RUST_BACKTRACE`) are joined and cut before the
/// backtrace's first frame.
pub fn error_line(error: &dyn std::error::Error) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = cause.source();
    }
    one_line(&message)
}

/// `message` on one line, without a trailing backtrace.
fn one_line(message: &str) -> String {
    let is_frame = |line: &str| {
        let line = line.trim_start();
        line.split_once(':')
            .is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    message
        .lines()
        .take_while(|line| !is_frame(line))
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::one_line;

    #[test]
    fn errors_print_as_one_line_without_backtraces() {
        assert_eq!(
            one_line("t: Json error: bad ':'\n   0: with_backtrace\n             at x.rs:1:2"),
            "t: Json error: bad ':'"
        );
        assert_eq!(
            one_line("f: a corrupt footer: out of bounds.\n\twhile verifying `schema`\n\n"),
            "f: a corrupt footer: out of bounds. while verifying `schema`"
        );
        assert_eq!(one_line("plain"), "plain");
    }
}
