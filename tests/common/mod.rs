//! Helpers shared by the end-to-end test binaries.
// Each test binary uses its own subset of these.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use arrow::array::{RecordBatch, RecordBatchReader};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use std::process::Command;

/// The `idem` binary under test.
pub fn idem() -> Command {
    Command::new(env!("CARGO_BIN_EXE_idem"))
}

/// A path as the `&str` argument the binary takes.
pub fn p(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

#[cfg(feature = "cloud")]
/// A fresh prefix in the bucket of the local S3 server that `scripts/test.sh` starts, or
/// `None` when run outside it (CI always runs these tests: there, a missing server fails).
pub fn s3_prefix(test: &str) -> Option<String> {
    match std::env::var("IDEM_TEST_S3_BUCKET") {
        Ok(bucket) => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            Some(format!(
                "s3://{bucket}/{test}-{}-{nanos}",
                std::process::id()
            ))
        }
        Err(_) if std::env::var_os("CI").is_some() => {
            panic!("IDEM_TEST_S3_BUCKET is not set: run the tests through scripts/test.sh")
        }
        Err(_) => {
            eprintln!("{test}: skipped, no S3 server (scripts/test.sh starts one)");
            None
        }
    }
}

#[cfg(feature = "cloud")]
/// A secret that must never be printed; the test server accepts any credentials.
pub const SECRET: &str = "idem-test-secret-never-printed";

/// Every row of some Parquet files of one schema, in order, as one batch.
pub fn read_parquet(files: &[PathBuf]) -> RecordBatch {
    let mut batches = Vec::new();
    let mut schema = None;
    for file in files {
        let reader =
            ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(file).expect("open"))
                .expect("parquet")
                .build()
                .expect("reader");
        schema.get_or_insert(reader.schema());
        batches.extend(reader.map(|b| b.expect("batch")));
    }
    arrow::compute::concat_batches(&schema.expect("a file"), &batches).expect("concat")
}
