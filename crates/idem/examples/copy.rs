//! The I/O floor of a dedup, for `benches/peers.py`: every row of the inputs read with
//! idem's reader and written with its writer (zstd Parquet, the settings of every idem
//! output), decoding on a second thread as in a dedup's second pass — everything a dedup
//! does except deciding, and for every row rather than only the winners (text read as
//! views, as the dedup reads it).
//!
//! `cargo run --release -p idem --example copy -- INPUT... OUTPUT`

use std::sync::Arc;
use std::sync::mpsc::sync_channel;

use idem::read::expand::expand_inputs;
use idem::read::input::{InputFile, TextLayout};
use idem::read::schema::{conform, unify, with_views};
use idem::storage::StorageOptions;
use idem::{DEFAULT_MAX_ROWS_PER_FILE, OutputWriter, Result};

fn main() -> std::process::ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let Some(output) = args.pop().filter(|_| !args.is_empty()) else {
        eprintln!("usage: copy INPUT... OUTPUT");
        return std::process::ExitCode::from(2);
    };
    match copy(&args, &output) {
        Ok(rows) => {
            println!("{rows} rows copied to {output}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("copy: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn copy(inputs: &[String], output: &str) -> Result<u64> {
    let storage = StorageOptions::default();
    let files: Vec<InputFile> = expand_inputs(inputs, &storage)?
        .iter()
        .map(InputFile::open)
        .collect::<Result<_>>()?;
    let schema = unify(files.iter().map(|f| (f.path(), f.schema())))?;
    let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
    let rows_schema = Arc::new(with_views(&schema));
    let mut writer = OutputWriter::create(
        output,
        Arc::clone(&schema),
        DEFAULT_MAX_ROWS_PER_FILE,
        &storage,
    )?;
    let mut rows = 0;
    std::thread::scope(|scope| {
        let (send, receive) = sync_channel(4);
        let (files, rows_schema, names) = (&files, &rows_schema, &names);
        scope.spawn(move || {
            for file in files {
                let batches = match file.read_columns_as(names, TextLayout::Views) {
                    Ok(batches) => batches,
                    Err(e) => {
                        let _ = send.send(Err(e));
                        return;
                    }
                };
                for batch in batches {
                    let batch = batch.and_then(|b| conform(&b, rows_schema, false, file.path()));
                    if send.send(batch).is_err() {
                        return;
                    }
                }
            }
        });
        for batch in receive {
            let batch = batch?;
            rows += batch.num_rows() as u64;
            writer.write(&batch)?;
        }
        Ok::<_, idem::Error>(())
    })?;
    writer.commit()?;
    Ok(rows)
}
