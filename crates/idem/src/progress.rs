//! Progress of a long job, reported to whoever runs it (the CLI draws a bar with it).
//! Every job takes one; nothing here knows about jobs.

/// Receives progress of a long job; the CLI draws a bar with it.
pub trait Progress: Sync {
    /// A phase starts that will cover `total_rows` rows.
    fn phase(&self, _name: &str, _total_rows: u64) {}
    /// `rows` more rows of the current phase are done.
    fn advance(&self, _rows: u64) {}
}

/// Progress that goes nowhere.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;

impl Progress for NoProgress {}
