//! Reading: everything between the names a user gives and decoded Arrow batches.
//!
//! * [`expand`]: files, directories, globs, prefixes and Delta tables into input files;
//! * [`input`]: opening an input file on any store (Parquet and Arrow IPC), and reading
//!   its rows — some columns, or some rows by position.
//! * [`schema`]: unifying the inputs' schemas and conforming batches to the unified one.
//! * `decoding`, `ipc_schema`: the checks and guards that turn a corrupt file into an error
//!   naming it instead of a panic.
//! * `event_time`: the event-time column of `--state` and `--report`.
//! * `delta`: a Delta Lake table's log, read for the files of its latest version.
//!
//! It may import `storage`, `error` and idem-core, nothing above.

pub(crate) mod decoding;
#[cfg(feature = "delta")]
pub(crate) mod delta;
pub(crate) mod event_time;
pub mod expand;
pub mod input;
pub(crate) mod ipc_schema;
pub mod schema;

pub use decoding::quiet_decoder_panics;
