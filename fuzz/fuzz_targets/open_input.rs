//! The input opening path on arbitrary bytes: open the file as `idem dedup` does (format
//! from the content), then decode every column. Any outcome but a panic is fine: the
//! contract is an error, never a crash (issue 60).
#![no_main]

use idem::read::input::{InputFile, InputSource};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let Ok(dir) = tempfile::tempdir() else {
        return;
    };
    let path = dir.path().join("input.parquet");
    if std::fs::write(&path, bytes).is_err() {
        return;
    }
    let Ok(file) = InputFile::open(&InputSource::Local(path)) else {
        return;
    };
    let names: Vec<String> = file.schema().fields().iter().map(|f| f.name().clone()).collect();
    let columns: Vec<&str> = names.iter().map(String::as_str).collect();
    if let Ok(batches) = file.read_columns(&columns) {
        for batch in batches {
            if batch.is_err() {
                break;
            }
        }
    }
});
