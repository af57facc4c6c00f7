//! End-to-end tests of the `idem` binary: every option of `idem dedup` and every bad-input
//! case, with the stats invariant checked on each successful run.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, DictionaryArray, Float64Array, Int64Array, RecordBatch, StringArray,
    UInt64Array,
};
use arrow::datatypes::{DataType, Int32Type, Int64Type};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::Compression;
use serde_json::Value;
use tempfile::TempDir;

mod common;
#[cfg(feature = "cloud")]
use common::{SECRET, s3_prefix};
use common::{idem, p, read_parquet};

fn write_parquet(path: &Path, batch: &RecordBatch) {
    let file = std::fs::File::create(path).expect("create");
    let mut writer = ArrowWriter::try_new(file, batch.schema(), None).expect("writer");
    writer.write(batch).expect("write");
    writer.close().expect("close");
}

fn batch(columns: Vec<(&str, ArrayRef)>) -> RecordBatch {
    RecordBatch::try_from_iter(columns).expect("batch")
}

fn strs(values: &[&str]) -> ArrayRef {
    Arc::new(StringArray::from(values.to_vec()))
}

fn ints(values: &[i64]) -> ArrayRef {
    Arc::new(Int64Array::from(values.to_vec()))
}

/// Every row of a Parquet output (file or directory of parts), in order.
fn read_output(path: &Path) -> RecordBatch {
    let files: Vec<PathBuf> = if path.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(path)
            .expect("read_dir")
            .map(|e| e.expect("entry").path())
            .collect();
        files.sort();
        files
    } else {
        vec![path.to_path_buf()]
    };
    read_parquet(&files)
}

fn column_strings(batch: &RecordBatch, name: &str) -> Vec<String> {
    let column = batch.column_by_name(name).expect("column");
    let formatter = arrow::util::display::ArrayFormatter::try_new(
        column.as_ref(),
        &arrow::util::display::FormatOptions::default().with_null("∅"),
    )
    .expect("formatter");
    (0..column.len())
        .map(|i| formatter.value(i).to_string())
        .collect()
}

/// Runs `idem dedup ARGS --stats -`, expects success, checks the invariant, returns stats.
fn dedup_ok(args: &[&str]) -> Value {
    let output = idem()
        .arg("dedup")
        .args(args)
        .args(["--stats", "-"])
        .output()
        .expect("run");
    assert!(
        output.status.success(),
        "idem {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stats: Value = serde_json::from_slice(&output.stdout).expect("stats JSON on stdout");
    let n = |k: &str| {
        stats[k]
            .as_u64()
            .unwrap_or_else(|| panic!("stat {k} in {stats}"))
    };
    assert_eq!(
        n("rows_in"),
        n("rows_out") + n("duplicates") + n("superseded") + n("deleted"),
        "{stats}"
    );
    stats
}

/// Runs `idem dedup ARGS`, expects failure, returns stderr.
fn dedup_err(args: &[&str]) -> (Output, String) {
    let output = idem().arg("dedup").args(args).output().expect("run");
    assert!(!output.status.success(), "idem {args:?} should have failed");
    let stderr = String::from_utf8_lossy(&output.stderr).to_string();
    (output, stderr)
}

/// Runs `idem generate` into `dir/in` with `args`; returns the directory.
fn generate(dir: &Path, args: &[&str]) -> PathBuf {
    let input = dir.join("in");
    let generated = idem()
        .args(["generate", "-o", p(&input)])
        .args(args)
        .output()
        .expect("generate");
    assert!(generated.status.success(), "{generated:?}");
    input
}

fn sample() -> String {
    // Read at run time: a test binary built from another checkout may be reused.
    let manifest_dir =
        std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").into());
    format!("{manifest_dir}/data/events")
}

#[test]
fn sample_data_dedups_with_consistent_stats_and_input_schema() {
    let dir = TempDir::new().expect("tmp");
    let out = dir.path().join("out.parquet");
    let stats = dedup_ok(&[&sample(), "-o", p(&out), "--op", "op"]);
    assert_eq!(stats["input_files"], 3);
    assert!(stats["duplicates"].as_u64() > Some(0));
    assert!(stats["superseded"].as_u64() > Some(0));
    assert!(stats["deleted"].as_u64() > Some(0));
    let output = read_output(&out);
    assert_eq!(
        output.num_rows() as u64,
        stats["rows_out"].as_u64().expect("rows_out")
    );
    let input = ParquetRecordBatchReaderBuilder::try_new(
        std::fs::File::open(format!("{}/events-00000.parquet", sample())).expect("open"),
    )
    .expect("parquet");
    assert_eq!(output.schema().fields(), input.schema().fields());
    assert!(!column_strings(&output, "op").contains(&"d".to_owned()));
}

#[test]
fn running_twice_changes_nothing_and_output_is_deterministic() {
    let dir = TempDir::new().expect("tmp");
    let once = dir.path().join("once.parquet");
    let again = dir.path().join("again.parquet");
    let twice = dir.path().join("twice.parquet");
    dedup_ok(&[&sample(), "-o", p(&once), "--op", "op"]);
    dedup_ok(&[&sample(), "-o", p(&again), "--op", "op"]);
    assert_eq!(
        std::fs::read(&once).expect("once"),
        std::fs::read(&again).expect("again")
    );
    let stats = dedup_ok(&[p(&once), "-o", p(&twice), "--op", "op"]);
    assert_eq!(stats["rows_in"], stats["rows_out"]);
    assert_eq!(
        std::fs::read(&once).expect("once"),
        std::fs::read(&twice).expect("twice")
    );
}

/// f(f(x)) = f(x) byte for byte on an input large enough that Parquet dictionaries
/// overflow and pages fill, where the input's batching could otherwise leak into the bytes,
/// and with enough row groups that the writer has changed its mind about some column
/// chunks' dictionary and codec (it decides from the chunks two row groups before).
#[test]
fn running_twice_is_byte_identical_on_generated_data() {
    let dir = TempDir::new().expect("tmp");
    let input = generate(dir.path(), &["--rows", "1000000", "--files", "4"]);
    let once = dir.path().join("once.parquet");
    let again = dir.path().join("again.parquet");
    let twice = dir.path().join("twice.parquet");
    dedup_ok(&[p(&input), "-o", p(&once), "--op", "op"]);
    dedup_ok(&[p(&input), "-o", p(&again), "--op", "op"]);
    let stats = dedup_ok(&[p(&once), "-o", p(&twice), "--op", "op"]);
    assert_eq!(stats["rows_in"], stats["rows_out"]);
    let bytes = std::fs::read(&once).expect("once");
    assert!(bytes == std::fs::read(&again).expect("again"));
    assert!(bytes == std::fs::read(&twice).expect("twice"));

    // Without a chunk that left the first row group's settings, the test above would not
    // cover the adapted writer.
    let file = std::fs::File::open(&once).expect("open");
    let reader = ParquetRecordBatchReaderBuilder::try_new(file).expect("parquet");
    let groups = reader.metadata().row_groups();
    assert!(groups.len() >= 5, "{} row groups", groups.len());
    let settings = |group: usize| {
        groups[group]
            .columns()
            .iter()
            .map(|c| (c.compression(), c.dictionary_page_offset().is_some()))
            .collect::<Vec<_>>()
    };
    let first = settings(0);
    assert!(
        first
            .iter()
            .all(|&(codec, _)| codec != Compression::UNCOMPRESSED)
    );
    let (mut dictionary_dropped, mut codec_dropped) = (false, false);
    for group in 1..groups.len() {
        for (&(codec, dictionary), &(_, first_dictionary)) in settings(group).iter().zip(&first) {
            dictionary_dropped |= first_dictionary && !dictionary;
            codec_dropped |= codec == Compression::UNCOMPRESSED;
        }
    }
    assert!(dictionary_dropped && codec_dropped);
}

/// A memory limit far below what the keep-max table needs makes pass 1 run in key
/// partitions through spill files; the output is byte-identical and the counts equal.
#[test]
fn a_memory_limit_spills_by_key_partition_with_identical_output() {
    let dir = TempDir::new().expect("tmp");
    let input = generate(
        dir.path(),
        &[
            "--rows",
            "120000",
            "--files",
            "3",
            "--seed",
            "11",
            "--duplicate-rate",
            "0.3",
        ],
    );
    for on_tie in ["first", "last"] {
        let free = dir.path().join(format!("free-{on_tie}.parquet"));
        let limited = dir.path().join(format!("limited-{on_tie}.parquet"));
        let common = ["--op", "op", "--on-tie", on_tie];
        let free_stats = dedup_ok(&[&[p(&input), "-o", p(&free)][..], &common].concat());
        let limited_stats = dedup_ok(
            &[
                &[p(&input), "-o", p(&limited), "--memory-limit", "1MiB"][..],
                &common,
            ]
            .concat(),
        );
        assert_eq!(free_stats["key_partitions"], 1);
        assert!(
            limited_stats["key_partitions"].as_u64() > Some(1),
            "{limited_stats}"
        );
        assert!(limited_stats["table_bytes"].as_u64() < Some(1 << 20));
        assert_eq!(limited_stats["memory_limit"], 1 << 20);
        for counter in [
            "rows_in",
            "rows_out",
            "duplicates",
            "superseded",
            "deleted",
            "conflicts",
        ] {
            assert_eq!(free_stats[counter], limited_stats[counter], "{counter}");
        }
        assert_eq!(
            std::fs::read(&free).expect("free"),
            std::fs::read(&limited).expect("limited"),
            "on_tie {on_tie}"
        );
    }
    // Spill files live in a temporary directory under $TMPDIR that is gone after the run.
    let spill = dir.path().join("spill");
    std::fs::create_dir(&spill).expect("mkdir");
    let run = idem()
        .args(["dedup", p(&input), "-o", p(&dir.path().join("s.parquet"))])
        .args(["--memory-limit", "1MiB", "-q"])
        .env("TMPDIR", &spill)
        .output()
        .expect("run");
    assert!(run.status.success());
    assert_eq!(std::fs::read_dir(&spill).expect("spill dir").count(), 0);
    let (_, stderr) = dedup_err(&[p(&input), "-o", "x.parquet", "--memory-limit", "lots"]);
    assert!(stderr.contains("is not a size"), "{stderr}");
}

/// A wide schema's pass 2 goes column by column: run twice it changes nothing, byte for
/// byte; under a memory limit (winners planned from spill files) and into parts it writes
/// the same rows, counts and bytes.
#[test]
fn wide_inputs_written_column_by_column_are_idempotent_and_spill_alike() {
    let dir = TempDir::new().expect("tmp");
    let input = generate(
        dir.path(),
        &[
            "--rows",
            "60000",
            "--files",
            "3",
            "--extra-columns",
            "40",
            "--payload-bytes",
            "20",
            "--duplicate-rate",
            "0.3",
        ],
    );
    let once = dir.path().join("once.parquet");
    let twice = dir.path().join("twice.parquet");
    let limited = dir.path().join("limited.parquet");
    let once_stats = dedup_ok(&[p(&input), "-o", p(&once), "--op", "op"]);
    let twice_stats = dedup_ok(&[p(&once), "-o", p(&twice), "--op", "op"]);
    assert_eq!(twice_stats["rows_in"], twice_stats["rows_out"]);
    assert!(std::fs::read(&once).expect("once") == std::fs::read(&twice).expect("twice"));
    let limited_stats = dedup_ok(&[
        p(&input),
        "-o",
        p(&limited),
        "--op",
        "op",
        "--memory-limit",
        "1MiB",
    ]);
    assert!(limited_stats["key_partitions"].as_u64() > Some(1));
    for counter in ["rows_in", "rows_out", "duplicates", "superseded", "deleted"] {
        assert_eq!(once_stats[counter], limited_stats[counter], "{counter}");
    }
    assert!(std::fs::read(&once).expect("once") == std::fs::read(&limited).expect("limited"));

    let parts = dir.path().join("parts");
    let stats = dedup_ok(&[
        p(&input),
        "-o",
        p(&parts),
        "--op",
        "op",
        "--max-rows-per-file",
        "10000",
    ]);
    let rows = stats["rows_out"].as_u64().expect("rows");
    assert_eq!(
        std::fs::read_dir(&parts).expect("dir").count() as u64,
        rows.div_ceil(10_000)
    );
    let whole = read_output(&once);
    let split = read_output(&parts);
    assert_eq!(split.num_rows() as u64, rows);
    assert_eq!(whole.num_columns(), 49);
    for column in ["event_id", "lsn", "attr_000", "attr_039"] {
        assert_eq!(
            column_strings(&whole, column),
            column_strings(&split, column),
            "{column}"
        );
    }
}

#[test]
fn directory_output_has_parts_and_is_replaced_whole() {
    let dir = TempDir::new().expect("tmp");
    let out = dir.path().join("out");
    let stats = dedup_ok(&[&sample(), "-o", p(&out), "--max-rows-per-file", "1000"]);
    let parts = std::fs::read_dir(&out).expect("dir").count();
    let rows = stats["rows_out"].as_u64().expect("rows");
    assert_eq!(parts as u64, rows.div_ceil(1000));
    assert_eq!(read_output(&out).num_rows() as u64, rows);
    // A rerun with bigger parts replaces the directory: no stale part survives.
    dedup_ok(&[&sample(), "-o", p(&out)]);
    assert_eq!(std::fs::read_dir(&out).expect("dir").count(), 1);
    assert_eq!(read_output(&out).num_rows() as u64, rows);
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .expect("dir")
        .map(|e| e.expect("entry").file_name())
        .filter(|n| n.to_string_lossy().starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// Two files; key k1 ties at lsn 5 with different statuses across them.
fn tie_files(dir: &Path) -> (PathBuf, PathBuf) {
    let a = dir.join("a.parquet");
    let b = dir.join("b.parquet");
    write_parquet(
        &a,
        &batch(vec![
            ("event_id", strs(&["k1", "k2", "k3"])),
            ("sequence", ints(&[0, 0, 0])),
            ("lsn", ints(&[5, 1, 1])),
            ("status", strs(&["first", "x", "same"])),
        ]),
    );
    write_parquet(
        &b,
        &batch(vec![
            ("event_id", strs(&["k3", "k1", "k2"])),
            ("sequence", ints(&[0, 0, 0])),
            ("lsn", ints(&[1, 5, 0])),
            ("status", strs(&["same", "last", "older"])),
        ]),
    );
    (a, b)
}

#[test]
fn ties_first_last_and_error() {
    let dir = TempDir::new().expect("tmp");
    let (a, b) = tie_files(dir.path());
    let out = dir.path().join("out.parquet");

    let stats = dedup_ok(&[p(&a), p(&b), "-o", p(&out)]);
    assert_eq!(
        column_strings(&read_output(&out), "status"),
        ["first", "x", "same"]
    );
    assert_eq!(
        (stats["duplicates"].as_u64(), stats["superseded"].as_u64()),
        (Some(2), Some(1))
    );
    assert_eq!(
        stats["conflicts"], 1,
        "k1 ties with different rows; k3's tie is identical"
    );

    dedup_ok(&[p(&a), p(&b), "-o", p(&out), "--on-tie", "last"]);
    // Kept rows stay in input order: k2 and k3 from a.parquet... k1 now from b.parquet.
    let output = read_output(&out);
    assert_eq!(column_strings(&output, "event_id"), ["k2", "k3", "k1"]);
    assert_eq!(column_strings(&output, "status"), ["x", "same", "last"]);

    // Input order is the order given.
    dedup_ok(&[p(&b), p(&a), "-o", p(&out)]);
    assert!(column_strings(&read_output(&out), "status").contains(&"last".to_owned()));

    std::fs::remove_file(&out).expect("rm");
    let (output, stderr) = dedup_err(&[p(&a), p(&b), "-o", p(&out), "--on-tie", "error"]);
    assert_eq!(output.status.code(), Some(1));
    assert!(
        stderr.contains("event_id=k1") && stderr.contains("lsn=5"),
        "{stderr}"
    );
    assert!(!out.exists(), "no output after an error");
}

#[test]
fn identical_replays_are_not_conflicts_even_under_on_tie_error() {
    let dir = TempDir::new().expect("tmp");
    let a = dir.path().join("a.parquet");
    write_parquet(
        &a,
        &batch(vec![
            ("event_id", strs(&["k", "k", "k"])),
            ("sequence", ints(&[1, 1, 1])),
            ("lsn", ints(&[3, 3, 3])),
            ("status", strs(&["same", "same", "same"])),
        ]),
    );
    let stats = dedup_ok(&[
        p(&a),
        "-o",
        p(&dir.path().join("o.parquet")),
        "--on-tie",
        "error",
    ]);
    assert_eq!(
        (
            stats["rows_out"].as_u64(),
            stats["duplicates"].as_u64(),
            stats["conflicts"].as_u64()
        ),
        (Some(1), Some(2), Some(0))
    );
}

#[test]
fn deletes_drop_keys_and_late_older_updates_do_not_resurrect_them() {
    let dir = TempDir::new().expect("tmp");
    let a = dir.path().join("a.parquet");
    write_parquet(
        &a,
        &batch(vec![
            ("event_id", strs(&["k1", "k1", "k2", "k1", "k3", "k3"])),
            ("sequence", ints(&[0, 0, 0, 0, 0, 0])),
            ("lsn", ints(&[1, 3, 1, 2, 1, 2])),
            ("op", strs(&["c", "DELETE", "c", "u", "c", "x"])),
        ]),
    );
    let out = dir.path().join("out.parquet");
    let stats = dedup_ok(&[
        p(&a),
        "-o",
        p(&out),
        "--op",
        "op",
        "--delete-values",
        "DELETE,x",
    ]);
    assert_eq!(column_strings(&read_output(&out), "event_id"), ["k2"]);
    assert_eq!(
        (stats["deleted"].as_u64(), stats["superseded"].as_u64()),
        (Some(2), Some(3))
    );

    let stats = dedup_ok(&[
        p(&a),
        "-o",
        p(&out),
        "--op",
        "op",
        "--delete-values",
        "DELETE,x",
        "--keep-tombstones",
    ]);
    let output = read_output(&out);
    assert_eq!(column_strings(&output, "event_id"), ["k1", "k2", "k3"]);
    assert_eq!(column_strings(&output, "op"), ["DELETE", "c", "x"]);
    assert_eq!(
        (stats["deleted"].as_u64(), stats["tombstones_kept"].as_u64()),
        (Some(0), Some(2))
    );

    // Without --op nothing is a delete.
    let stats = dedup_ok(&[p(&a), "-o", p(&out)]);
    assert_eq!(stats["rows_out"], 3);
}

#[test]
fn null_keys_group_together_and_null_versions_lose() {
    let dir = TempDir::new().expect("tmp");
    let a = dir.path().join("a.parquet");
    write_parquet(
        &a,
        &batch(vec![
            (
                "event_id",
                Arc::new(StringArray::from(vec![None, None, Some("k"), Some("k")])) as ArrayRef,
            ),
            (
                "sequence",
                Arc::new(Int64Array::from(vec![Some(1), Some(1), None, None])) as ArrayRef,
            ),
            (
                "lsn",
                Arc::new(Int64Array::from(vec![Some(2), None, None, Some(-7)])) as ArrayRef,
            ),
            ("tag", strs(&["a", "b", "c", "d"])),
        ]),
    );
    let out = dir.path().join("out.parquet");
    let stats = dedup_ok(&[p(&a), "-o", p(&out)]);
    assert_eq!(column_strings(&read_output(&out), "tag"), ["a", "d"]);
    assert_eq!(
        (stats["null_keys"].as_u64(), stats["superseded"].as_u64()),
        (Some(4), Some(2))
    );
}

#[test]
fn version_types_unsigned_pg_lsn_and_composite() {
    let dir = TempDir::new().expect("tmp");
    let a = dir.path().join("a.parquet");
    write_parquet(
        &a,
        &batch(vec![
            ("id", strs(&["u", "u", "l", "l", "l", "c", "c", "c"])),
            (
                "big",
                Arc::new(UInt64Array::from(vec![
                    u64::MAX,
                    i64::MAX as u64,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                ])) as ArrayRef,
            ),
            (
                "pg",
                strs(&["0/0", "0/0", "0/FF", "1/0", "0/100", "0/0", "0/0", "0/0"]),
            ),
            ("serial", ints(&[0, 0, 0, 0, 0, 2, 9, 5])),
            (
                "tag",
                strs(&["u-max", "u-mid", "l-ff", "l-1/0", "l-100", "c2", "c9", "c5"]),
            ),
        ]),
    );
    let out = dir.path().join("out.parquet");
    dedup_ok(&[p(&a), "-o", p(&out), "--key", "id", "--version", "big"]);
    assert_eq!(
        column_strings(&read_output(&out), "tag"),
        ["u-max", "l-ff", "c2"]
    );
    dedup_ok(&[
        p(&a),
        "-o",
        p(&out),
        "--key",
        "id",
        "--version",
        "pg,serial",
    ]);
    assert_eq!(
        column_strings(&read_output(&out), "tag"),
        ["u-max", "l-1/0", "c9"]
    );
}

#[test]
fn dictionary_and_plain_keys_match_and_schemas_unify_by_name() {
    let dir = TempDir::new().expect("tmp");
    let a = dir.path().join("a.parquet");
    let b = dir.path().join("b.parquet");
    let dict: DictionaryArray<Int32Type> = vec!["k1", "k2"].into_iter().collect();
    write_parquet(
        &a,
        &batch(vec![
            ("event_id", Arc::new(dict) as ArrayRef),
            ("sequence", ints(&[0, 0])),
            ("lsn", ints(&[1, 1])),
        ]),
    );
    // Other column order, plain strings, an extra nullable column.
    write_parquet(
        &b,
        &batch(vec![
            ("lsn", ints(&[2, 0])),
            (
                "note",
                Arc::new(StringArray::from(vec![Some("new"), None])) as ArrayRef,
            ),
            ("sequence", ints(&[0, 0])),
            ("event_id", strs(&["k2", "k1"])),
        ]),
    );
    let out = dir.path().join("out.parquet");
    let stats = dedup_ok(&[p(&a), p(&b), "-o", p(&out)]);
    assert_eq!(stats["distinct_keys"], 2);
    let output = read_output(&out);
    let names: Vec<_> = output
        .schema()
        .fields()
        .iter()
        .map(|f| f.name().clone())
        .collect();
    assert_eq!(names, ["event_id", "sequence", "lsn", "note"]);
    assert_eq!(column_strings(&output, "event_id"), ["k1", "k2"]);
    assert_eq!(column_strings(&output, "note"), ["∅", "new"]);
    assert!(matches!(
        output.schema().field(0).data_type(),
        DataType::Dictionary(_, _)
    ));
}

#[test]
fn arrow_ipc_files_streams_and_globs_are_inputs() {
    let dir = TempDir::new().expect("tmp");
    let rows = batch(vec![
        ("event_id", strs(&["a", "b", "a"])),
        ("sequence", ints(&[1, 1, 1])),
        ("lsn", ints(&[1, 1, 2])),
    ]);
    let file = std::fs::File::create(dir.path().join("x.arrow")).expect("create");
    let mut writer = arrow::ipc::writer::FileWriter::try_new(file, &rows.schema()).expect("ipc");
    writer.write(&rows).expect("write");
    writer.finish().expect("finish");
    let file = std::fs::File::create(dir.path().join("y.arrows")).expect("create");
    let mut writer = arrow::ipc::writer::StreamWriter::try_new(file, &rows.schema()).expect("ipc");
    writer.write(&rows).expect("write");
    writer.finish().expect("finish");
    let out = dir.path().join("out.parquet");
    let stats = dedup_ok(&[&format!("{}/*.arrow*", p(dir.path())), "-o", p(&out)]);
    assert_eq!(
        (
            stats["input_files"].as_u64(),
            stats["rows_in"].as_u64(),
            stats["rows_out"].as_u64()
        ),
        (Some(2), Some(6), Some(2))
    );
    assert_eq!(column_strings(&read_output(&out), "lsn"), ["1", "2"]);
}

#[test]
fn zero_row_files_are_fine() {
    let dir = TempDir::new().expect("tmp");
    let a = dir.path().join("a.parquet");
    write_parquet(
        &a,
        &batch(vec![
            ("event_id", strs(&[])),
            ("sequence", ints(&[])),
            ("lsn", ints(&[])),
        ]),
    );
    let out = dir.path().join("out.parquet");
    let stats = dedup_ok(&[p(&a), "-o", p(&out)]);
    assert_eq!(stats["rows_out"], 0);
    assert_eq!(read_output(&out).num_columns(), 3);
}

#[test]
fn stats_file_and_summary_line() {
    let dir = TempDir::new().expect("tmp");
    let stats_path = dir.path().join("stats.json");
    let output = idem()
        .args([
            "dedup",
            &sample(),
            "-o",
            p(&dir.path().join("o.parquet")),
            "--stats",
            p(&stats_path),
        ])
        .output()
        .expect("run");
    assert!(output.status.success());
    let stats: Value =
        serde_json::from_slice(&std::fs::read(&stats_path).expect("stats")).expect("json");
    for key in [
        "rows_in",
        "rows_out",
        "duplicates",
        "superseded",
        "deleted",
        "conflicts",
        "null_keys",
        "input_files",
    ] {
        assert!(stats[key].is_u64(), "{key} in {stats}");
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        stderr.lines().count(),
        1,
        "one summary line, no progress bar off a terminal: {stderr}"
    );
    assert!(stderr.contains("rows in"), "{stderr}");
}

/// Bad inputs: exit 1, the file and column named, nothing left at the output path.
#[test]
fn bad_inputs_fail_cleanly() {
    let dir = TempDir::new().expect("tmp");
    let good = dir.path().join("good.parquet");
    write_parquet(
        &good,
        &batch(vec![
            ("event_id", strs(&["a"])),
            ("sequence", ints(&[1])),
            ("lsn", ints(&[1])),
        ]),
    );
    let out = dir.path().join("out.parquet");
    let out_dir = dir.path().join("outdir");

    let truncated = dir.path().join("truncated.parquet");
    let bytes = std::fs::read(&good).expect("read");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).expect("write");
    let garbage = dir.path().join("garbage.parquet");
    std::fs::write(&garbage, b"this is not parquet at all").expect("write");
    let no_version = dir.path().join("no_version.parquet");
    write_parquet(
        &no_version,
        &batch(vec![("event_id", strs(&["a"])), ("sequence", ints(&[1]))]),
    );
    let float_version = dir.path().join("float.parquet");
    write_parquet(
        &float_version,
        &batch(vec![
            ("event_id", strs(&["a"])),
            ("sequence", ints(&[1])),
            ("lsn", Arc::new(Float64Array::from(vec![1.0])) as ArrayRef),
        ]),
    );
    let drifted = dir.path().join("drifted.parquet");
    write_parquet(
        &drifted,
        &batch(vec![
            ("event_id", ints(&[7])),
            ("sequence", ints(&[1])),
            ("lsn", ints(&[1])),
        ]),
    );
    let bad_lsn = dir.path().join("bad_lsn.parquet");
    write_parquet(
        &bad_lsn,
        &batch(vec![
            ("event_id", strs(&["a"])),
            ("sequence", ints(&[1])),
            ("lsn", strs(&["zz/1"])),
        ]),
    );
    let empty_dir = dir.path().join("empty");
    std::fs::create_dir(&empty_dir).expect("mkdir");

    let cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (vec![p(&good), p(&truncated)], vec!["truncated.parquet"]),
        (vec![p(&garbage)], vec!["garbage.parquet"]),
        (
            vec![p(&good), p(&no_version)],
            vec!["no_version.parquet", "'lsn'"],
        ),
        (
            vec![p(&good), "--key", "event_id,missing"],
            vec!["good.parquet", "'missing'"],
        ),
        (
            vec![p(&float_version)],
            vec!["float.parquet", "'lsn'", "Float64"],
        ),
        (
            vec![p(&good), p(&drifted)],
            vec!["drifted.parquet", "'event_id'"],
        ),
        (vec![p(&bad_lsn)], vec!["bad_lsn.parquet", "zz/1"]),
        (vec![p(&empty_dir)], vec!["empty"]),
        (vec!["/no/such/file.parquet"], vec!["/no/such/file.parquet"]),
        (vec![p(&good), "--op", "nope"], vec!["'nope'"]),
    ];
    for (args, expected) in cases {
        for target in [&out, &out_dir] {
            let mut all = args.clone();
            all.extend(["-o", p(target)]);
            let (output, stderr) = dedup_err(&all);
            assert_eq!(output.status.code(), Some(1), "{args:?}: {stderr}");
            assert_eq!(stderr.trim().lines().count(), 1, "one-line error: {stderr}");
            for needle in &expected {
                assert!(
                    stderr.contains(needle),
                    "{args:?}: '{needle}' not in {stderr}"
                );
            }
            assert!(!target.exists(), "{args:?} left {}", target.display());
        }
    }
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .expect("dir")
        .map(|e| e.expect("entry").file_name())
        .filter(|n| n.to_string_lossy().starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");

    // No input at all is a usage error.
    let output = idem().args(["dedup", "-o", p(&out)]).output().expect("run");
    assert_eq!(output.status.code(), Some(2));
}

#[test]
fn a_failed_run_leaves_the_previous_output_untouched() {
    let dir = TempDir::new().expect("tmp");
    let out = dir.path().join("out.parquet");
    dedup_ok(&[&sample(), "-o", p(&out)]);
    let before = std::fs::read(&out).expect("read");
    let bad = dir.path().join("bad.parquet");
    std::fs::write(&bad, b"PAR1 broken").expect("write");
    dedup_err(&[&sample(), p(&bad), "-o", p(&out)]);
    assert_eq!(std::fs::read(&out).expect("read"), before);
}

#[test]
fn generator_output_round_trips() {
    let dir = TempDir::new().expect("tmp");
    let status = idem()
        .args([
            "generate",
            "-o",
            p(&dir.path().join("gen")),
            "--rows",
            "20000",
            "--files",
            "2",
            "--seed",
            "3",
        ])
        .status()
        .expect("run");
    assert!(status.success());
    let stats = dedup_ok(&[
        p(&dir.path().join("gen")),
        "-o",
        p(&dir.path().join("o")),
        "--op",
        "op",
    ]);
    assert_eq!(stats["rows_in"], 20000);
    let output = read_output(&dir.path().join("o"));
    let lsn = output
        .column_by_name("lsn")
        .expect("lsn")
        .as_primitive::<Int64Type>();
    assert_eq!(lsn.null_count(), 0);
}

#[cfg(feature = "sql")]
#[test]
fn sql_runs_the_dedup_table_function_and_agrees_with_dedup() {
    let dir = TempDir::new().expect("tmp");
    let dedup_out = dir.path().join("dedup.parquet");
    let stats = dedup_ok(&[&sample(), "-o", p(&dedup_out), "--op", "op"]);
    let rows_out = stats["rows_out"].as_u64().expect("rows_out");

    let query = format!(
        "SELECT count(*) AS n FROM dedup('{}', 'event_id,sequence', 'lsn', 'op=op')",
        sample()
    );
    let output = idem().args(["sql", &query]).output().expect("run");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let table = String::from_utf8_lossy(&output.stdout);
    assert!(table.contains(&format!("| {rows_out} |")), "{table}");

    // Written to Parquet, the same rows as `idem dedup` (in another order: by partition).
    let sql_out = dir.path().join("sql.parquet");
    let query = format!(
        "SELECT * FROM dedup('{}', 'event_id,sequence', 'lsn', 'op=op')",
        sample()
    );
    let prom = dir.path().join("sql.prom");
    let output = idem()
        .args(["sql", &query, "-o", p(&sql_out), "--metrics", p(&prom)])
        .output()
        .expect("run");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // The dedup operator's counters, as metrics, are the dedup's stats.
    let metrics = std::fs::read_to_string(&prom).expect("metrics");
    let metric = |name: &str| -> u64 {
        let prefix = format!(r#"idem_{name}{{command="sql",output="{}"}} "#, p(&sql_out));
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("{prefix} in {metrics}"))
            .parse()
            .expect("a count")
    };
    for name in ["rows_in", "rows_out", "duplicates", "superseded", "deleted"] {
        assert_eq!(metric(name), stats[name].as_u64().expect("n"), "{name}");
    }
    assert!(metric("dedup_operators") >= 1);
    let sorted_rows = |batch: &RecordBatch| {
        let columns: Vec<Vec<String>> = batch
            .schema()
            .fields()
            .iter()
            .map(|f| column_strings(batch, f.name()))
            .collect();
        let mut rows: Vec<String> = (0..batch.num_rows())
            .map(|i| {
                columns
                    .iter()
                    .map(|c| c[i].as_str())
                    .collect::<Vec<_>>()
                    .join("|")
            })
            .collect();
        rows.sort();
        rows
    };
    assert_eq!(
        sorted_rows(&read_output(&sql_out)),
        sorted_rows(&read_output(&dedup_out))
    );

    let output = idem()
        .args(["sql", "SELECT * FROM dedup('no_such_table', 'id', 'lsn')"])
        .output()
        .expect("run");
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("no_such_table") && stderr.trim().lines().count() == 1,
        "{stderr}"
    );
}

#[cfg(feature = "sql")]
#[test]
fn sql_takes_session_settings_from_datafusion_environment_variables() {
    let query = "SELECT value FROM information_schema.df_settings \
                 WHERE name = 'datafusion.execution.target_partitions'";
    let output = idem()
        .args(["sql", query])
        .env("DATAFUSION_EXECUTION_TARGET_PARTITIONS", "3")
        .output()
        .expect("run");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let table = String::from_utf8_lossy(&output.stdout);
    assert!(table.contains("| 3 "), "{table}");

    let output = idem()
        .args(["sql", "SELECT 1"])
        .env("DATAFUSION_EXECUTION_TARGET_PARTITIONS", "many")
        .output()
        .expect("run");
    assert_ne!(output.status.code(), Some(0));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("target_partitions"), "{stderr}");
}

#[cfg(feature = "cloud")]
fn upload(local: &Path, url: &str) {
    let options = idem::storage::StorageOptions::default();
    match idem::storage::Location::parse(url, &options).expect("url") {
        idem::storage::Location::Remote(remote) => remote.upload(local).expect("upload"),
        idem::storage::Location::Local(_) => panic!("{url} is not remote"),
    }
}

#[cfg(feature = "cloud")]
fn object_exists(url: &str) -> bool {
    let options = idem::storage::StorageOptions::default();
    match idem::storage::Location::parse(url, &options).expect("url") {
        idem::storage::Location::Remote(remote) => remote.is_object().expect("head"),
        idem::storage::Location::Local(_) => panic!("{url} is not remote"),
    }
}

#[cfg(feature = "cloud")]
#[test]
fn dedup_reads_and_writes_s3_with_the_bytes_of_a_local_run() {
    let Some(prefix) = s3_prefix("dedup") else {
        return;
    };
    let dir = TempDir::new().expect("tmp");
    let mut sample_files: Vec<PathBuf> = std::fs::read_dir(sample())
        .expect("sample")
        .map(|e| e.expect("entry").path())
        .collect();
    sample_files.sort();
    for file in &sample_files {
        let name = file.file_name().and_then(|n| n.to_str()).expect("name");
        upload(file, &format!("{prefix}/events/{name}"));
    }
    let local = dir.path().join("local.parquet");
    let local_stats = dedup_ok(&[&sample(), "--op", "op", "-o", p(&local)]);
    let local_bytes = std::fs::read(&local).expect("local output");

    let run = |args: &[&str]| -> Output {
        idem()
            .arg("dedup")
            .args(args)
            .env("AWS_SECRET_ACCESS_KEY", SECRET)
            .output()
            .expect("run")
    };
    let stats_of = |output: &Output| -> Value {
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let text = String::from_utf8_lossy(&output.stdout);
        assert!(!text.contains(SECRET));
        serde_json::from_str(&text).expect("stats")
    };

    // Prefix in, one object out; read back, it dedups to the local run's bytes.
    let out = format!("{prefix}/out.parquet");
    let events = format!("{prefix}/events");
    let stats = stats_of(&run(&[&events, "--op", "op", "-o", &out, "--stats", "-"]));
    assert_eq!(stats["rows_out"], local_stats["rows_out"]);
    assert_eq!(stats["output"], out.as_str());
    assert!(
        stats["inputs"][0]["path"]
            .as_str()
            .is_some_and(|p| p.starts_with(&events)),
        "{stats}"
    );
    let back = dir.path().join("back.parquet");
    stats_of(&run(&[&out, "--op", "op", "-o", p(&back), "--stats", "-"]));
    assert!(std::fs::read(&back).expect("back") == local_bytes);

    // A glob in, a directory of parts out (replacing what was there); read back the same.
    let parts = format!("{prefix}/parts");
    upload(&local, &format!("{parts}/stale.parquet"));
    let glob = format!("{prefix}/events/*.parquet");
    let stats = stats_of(&run(&[
        &glob,
        "--op",
        "op",
        "-o",
        &parts,
        "--max-rows-per-file",
        "1000",
        "--stats",
        "-",
    ]));
    let written = stats["output_files"].as_array().expect("files").len();
    assert!(written > 1, "{stats}");
    assert!(!object_exists(&format!("{parts}/stale.parquet")));
    let back = dir.path().join("back-parts.parquet");
    stats_of(&run(&[
        &parts,
        "--op",
        "op",
        "-o",
        p(&back),
        "--stats",
        "-",
    ]));
    assert!(std::fs::read(&back).expect("back") == local_bytes);

    // Errors name the URL, never the secret, and leave no output behind.
    let failed_out = format!("{prefix}/failed.parquet");
    for (args, expected) in [
        (
            vec![events.as_str(), "--key", "nope", "-o", failed_out.as_str()],
            "key column 'nope' not found",
        ),
        (
            vec![&format!("{prefix}/missing"), "-o", failed_out.as_str()],
            "missing",
        ),
    ] {
        let output = run(&args);
        assert!(!output.status.success());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(expected), "{stderr}");
        assert!(stderr.contains(&prefix), "{stderr}");
        assert!(!stderr.contains(SECRET), "{stderr}");
        assert!(!object_exists(&failed_out));
    }

    #[cfg(feature = "sql")]
    {
        let query = format!(
            "SELECT count(*) AS n FROM dedup('{events}', 'event_id,sequence', 'lsn', 'op=op')"
        );
        let output = idem()
            .args(["sql", &query])
            .env("AWS_SECRET_ACCESS_KEY", SECRET)
            .output()
            .expect("sql");
        let table = String::from_utf8_lossy(&output.stdout);
        let rows_out = local_stats["rows_out"].as_u64().expect("rows_out");
        assert!(
            table.contains(&format!("| {rows_out} |")),
            "{table}{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

/// Runs `idem verify`, returns its exit code and JSON report.
fn verify(source: &Path, target: &Path) -> (Option<i32>, Value) {
    let output = idem()
        .args(["verify", "--source", p(source), "--target", p(target)])
        .args(["--op", "op", "--json", "-q"])
        .output()
        .expect("verify");
    let report = serde_json::from_slice(&output.stdout).unwrap_or_else(|_| {
        panic!(
            "no JSON report: {}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (output.status.code(), report)
}

/// Writes `batches` (of `schema`) to `path` as one Parquet file.
fn write_batches(path: &Path, batches: &[RecordBatch]) {
    let file = std::fs::File::create(path).expect("create");
    let mut writer = ArrowWriter::try_new(file, batches[0].schema(), None).expect("writer");
    for batch in batches {
        writer.write(batch).expect("write");
    }
    writer.close().expect("close");
}

/// `batch` with `column` replaced by `values`.
fn with_column(batch: &RecordBatch, column: &str, values: ArrayRef) -> RecordBatch {
    let index = batch.schema().index_of(column).expect("column");
    let mut columns = batch.columns().to_vec();
    columns[index] = values;
    RecordBatch::try_new(batch.schema(), columns).expect("batch")
}

#[test]
fn verify_finds_each_kind_of_difference_on_a_million_rows() {
    let dir = TempDir::new().expect("tmp");
    // An empty payload everywhere, so that one null among them is the difference to find.
    let input = generate(
        dir.path(),
        &["--rows", "1000000", "--files", "4", "--payload-bytes", "0"],
    );
    let good = dir.path().join("good.parquet");
    dedup_ok(&[p(&input), "--op", "op", "-o", p(&good)]);
    let (code, report) = verify(&input, &good);
    assert_eq!(code, Some(0), "{report}");
    assert_eq!(report["matches"], true);
    assert_eq!(report["expected_checksum"], report["target_checksum"]);
    let rows = report["expected_rows"].as_u64().expect("rows");
    assert_eq!(report["matching_rows"].as_u64(), Some(rows));

    let all = read_output(&good);
    let middle = all.num_rows() / 2;
    let (head, one, tail) = (
        all.slice(0, middle),
        all.slice(middle, 1),
        all.slice(middle + 1, all.num_rows() - middle - 1),
    );
    let strings = |values: Vec<Option<&str>>| Arc::new(StringArray::from(values)) as ArrayRef;
    let status = column_strings(&one, "status")[0].clone();
    let flipped = with_column(
        &one,
        "status",
        strings(vec![Some(if status == "paid" {
            "refunded"
        } else {
            "paid"
        })]),
    );
    let nulled = with_column(&one, "payload", strings(vec![None]));
    let mut stranger = with_column(&one, "event_id", strings(vec![Some("not-an-event")]));
    stranger = with_column(&stranger, "status", strings(vec![Some("paid")]));
    let cases: Vec<(&str, Vec<RecordBatch>, &str, Option<&str>)> = vec![
        (
            "flipped",
            vec![head.clone(), flipped, tail.clone()],
            "differing_rows",
            Some("status"),
        ),
        (
            "null",
            vec![head.clone(), nulled, tail.clone()],
            "differing_rows",
            Some("payload"),
        ),
        (
            "missing",
            vec![head.clone(), tail.clone()],
            "missing_rows",
            None,
        ),
        ("extra", vec![all.clone(), stranger], "extra_rows", None),
        (
            "duplicated",
            vec![all.clone(), one.clone()],
            "duplicate_rows",
            None,
        ),
    ];
    let targets: Vec<PathBuf> = cases
        .iter()
        .map(|(name, batches, _, _)| {
            let target = dir.path().join(format!("{name}.parquet"));
            write_batches(&target, batches);
            target
        })
        .collect();
    // The runs are independent: all at once, they share both cores.
    let reports: Vec<(Option<i32>, Value)> = std::thread::scope(|scope| {
        let running: Vec<_> = targets
            .iter()
            .map(|target| scope.spawn(|| verify(&input, target)))
            .collect();
        running
            .into_iter()
            .map(|run| run.join().expect("verify thread"))
            .collect()
    });
    for ((name, _, counter, column), (code, report)) in cases.into_iter().zip(reports) {
        assert_eq!(code, Some(1), "{name}: {report}");
        assert_eq!(report["matches"], false, "{name}");
        assert_eq!(report[counter], 1, "{name}: {report}");
        let differences: u64 = [
            "missing_rows",
            "extra_rows",
            "differing_rows",
            "duplicate_rows",
        ]
        .iter()
        .map(|k| report[*k].as_u64().expect("count"))
        .sum();
        assert_eq!(differences, 1, "{name}: {report}");
        let listed = match counter {
            "missing_rows" => &report["missing"],
            "extra_rows" => &report["extra"],
            "duplicate_rows" => &report["duplicates"],
            _ => &report["differing"],
        };
        assert_eq!(listed.as_array().map(Vec::len), Some(1), "{name}: {report}");
        if let Some(column) = column {
            assert_eq!(
                report["differing"][0]["columns"],
                serde_json::json!([column])
            );
        }
        if name != "duplicated" && name != "extra" {
            assert_ne!(report["expected_checksum"], report["target_checksum"]);
        }
    }

    // An unreadable target is an error (2), not a mismatch.
    let output = idem()
        .args(["verify", "--source", p(&input), "--target"])
        .arg(dir.path().join("absent.parquet"))
        .output()
        .expect("verify");
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("absent.parquet"));
}

#[test]
fn stats_say_which_input_file_the_duplicates_came_from() {
    let dir = TempDir::new().expect("tmp");
    let original = dir.path().join("a.parquet");
    let replay = dir.path().join("b.parquet");
    let first = format!("{}/events-00000.parquet", sample());
    std::fs::copy(&first, &original).expect("copy");
    std::fs::copy(&first, &replay).expect("copy");
    let out = dir.path().join("out.parquet");
    let output = idem()
        .args([
            "dedup",
            p(&original),
            p(&replay),
            "--op",
            "op",
            "-o",
            p(&out),
        ])
        .args(["--stats", "-", "-q"])
        .output()
        .expect("run");
    assert!(output.status.success(), "{output:?}");
    let stats: Value = serde_json::from_slice(&output.stdout).expect("stats");
    let n = |v: &Value| v.as_u64().unwrap_or_else(|| panic!("a count in {stats}"));
    let (a, b) = (&stats["inputs"][0], &stats["inputs"][1]);
    // Ties go to the first input: the replay contributes nothing and is all dropped.
    assert_eq!(n(&a["kept"]), n(&stats["rows_out"]), "{stats}");
    assert_eq!(n(&a["kept"]) + n(&a["dropped"]), n(&a["rows"]));
    assert_eq!(
        (n(&b["kept"]), n(&b["dropped"])),
        (0, n(&b["rows"])),
        "{stats}"
    );
}

#[test]
fn metrics_file_and_the_duplicate_rate_alert() {
    let dir = TempDir::new().expect("tmp");
    let out = dir.path().join("out.parquet");
    let prom = dir.path().join("idem.prom");
    let run = |limit: &str| {
        idem()
            .args([
                "dedup",
                &sample(),
                "--op",
                "op",
                "-o",
                p(&out),
                "--stats",
                "-",
            ])
            .args(["--metrics", p(&prom), "--max-duplicate-rate", limit])
            .output()
            .expect("run")
    };
    // Above the limit: the output is written, and the exit code says so.
    let output = run("0.01");
    assert_eq!(output.status.code(), Some(3), "{output:?}");
    assert!(out.is_file());
    let stats: Value = serde_json::from_slice(&output.stdout).expect("stats");
    let rate = stats["duplicate_rate"].as_f64().expect("rate");
    assert!(rate > 0.01, "{stats}");
    assert!(String::from_utf8_lossy(&output.stderr).contains("exceeds --max-duplicate-rate"));

    let text = std::fs::read_to_string(&prom).expect("metrics");
    let mut values = std::collections::HashMap::new();
    let (mut input_rows, mut input_dropped) = (0, 0);
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let (series, value) = line.rsplit_once(' ').expect("series value");
        let value: f64 = value.parse().expect("a number");
        let (name, labels) = series.split_once('{').expect("labels");
        assert!(labels.contains(r#"command="dedup""#), "{line}");
        assert!(
            labels.contains(&format!(r#"output="{}""#, p(&out))),
            "{line}"
        );
        if name == "idem_input_rows" {
            input_rows += value as u64;
        } else if name == "idem_input_dropped_rows" {
            input_dropped += value as u64;
        } else {
            values.insert(name.to_owned(), value);
        }
    }
    assert_eq!(
        values["idem_rows_in"] as u64,
        stats["rows_in"].as_u64().expect("n")
    );
    assert_eq!(
        values["idem_rows_out"] as u64,
        stats["rows_out"].as_u64().expect("n")
    );
    assert!((values["idem_duplicate_rate"] - rate).abs() < 1e-12);
    assert_eq!(input_rows, stats["rows_in"].as_u64().expect("n"));
    assert_eq!(
        input_dropped,
        input_rows - stats["rows_out"].as_u64().expect("n")
    );
    assert!(text.contains("# TYPE idem_rows_in gauge"));
    assert!(values["idem_last_run_timestamp_seconds"] > 1.7e9);

    // At or under the limit: success.
    assert_eq!(run("1").status.code(), Some(0));
    // Not a fraction: bad usage.
    assert_eq!(run("1.5").status.code(), Some(2));
}

/// `--report`: the page's figures agree with the stats, and it renders in headless Chromium
/// (when the test command installed it) without console messages, with the chart drawn.
#[test]
fn html_report_shows_the_run_and_renders_in_a_browser() {
    let dir = TempDir::new().expect("tmp");
    let out = dir.path().join("out.parquet");
    let page = dir.path().join("report.html");
    let stats = dedup_ok(&[
        &sample(),
        "--op",
        "op",
        "-o",
        p(&out),
        "--report",
        p(&page),
        "--time-column",
        "event_time",
    ]);
    let html = std::fs::read_to_string(&page).expect("report written");
    assert!(html.contains(r#"<svg id="duplicate-rate-chart""#));
    let bars = html.matches(r#"<rect class="bar""#).count();
    assert!(bars > 1, "{bars} bars");
    // Copies over all buckets are the run's duplicates + superseded (no null keys here).
    let copies: u64 = html
        .split("<title>")
        .skip(1)
        .filter_map(|t| {
            t.split(": ")
                .nth(1)?
                .split(" of ")
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum();
    let n = |k: &str| {
        stats[k]
            .as_u64()
            .unwrap_or_else(|| panic!("{k} in {stats}"))
    };
    assert_eq!(copies, n("duplicates") + n("superseded"));
    for input in stats["inputs"].as_array().expect("inputs") {
        let name = input["path"].as_str().expect("path");
        assert!(html.contains(name), "{name} listed");
    }
    assert!(html.contains(r#"<table id="top-keys">"#) && html.contains("event_id="));
    assert!(!html.contains("<script"), "self-contained and static");

    // A missing time column, or one that is not a time, is named before anything runs.
    let never = dir.path().join("never.parquet");
    for (column, named) in [("nope", "nope"), ("lsn", "Int64")] {
        let bad = idem()
            .args(["dedup", &sample(), "-o", p(&never), "-q"])
            .args(["--report", p(&page), "--time-column", column])
            .output()
            .expect("run");
        assert_eq!(bad.status.code(), Some(1));
        let stderr = String::from_utf8_lossy(&bad.stderr);
        assert!(
            stderr.contains(column) && stderr.contains(named),
            "{stderr}"
        );
        assert!(!never.exists());
    }

    let Some(chromium) = std::env::var_os("IDEM_TEST_CHROMIUM") else {
        assert!(
            std::env::var_os("CI").is_none(),
            "IDEM_TEST_CHROMIUM is not set: run through scripts/test.sh"
        );
        return;
    };
    let browse = |extra: &[&str]| {
        let profile = TempDir::new().expect("profile");
        std::process::Command::new(&chromium)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--enable-logging=stderr",
                "--v=0",
                "--window-size=1100,1600",
            ])
            .arg(format!("--user-data-dir={}", p(profile.path())))
            .args(extra)
            .arg(format!("file://{}", p(&page)))
            .output()
            .expect("chromium runs")
    };
    let dom = browse(&["--dump-dom"]);
    assert!(dom.status.success(), "{dom:?}");
    let rendered = String::from_utf8_lossy(&dom.stdout);
    assert!(
        rendered.contains(r#"id="duplicate-rate-chart""#),
        "{rendered}"
    );
    assert_eq!(rendered.matches(r#"class="bar""#).count(), bars);
    let log = String::from_utf8_lossy(&dom.stderr);
    assert!(
        !log.lines().any(|l| l.contains("CONSOLE")),
        "console messages: {log}"
    );
    // The screenshot shows the chart: pixels in the bars' colour.
    let shot = dir.path().join("report.png");
    let taken = browse(&[&format!("--screenshot={}", p(&shot))]);
    assert!(taken.status.success(), "{taken:?}");
    let decoder = png::Decoder::new(std::io::BufReader::new(
        std::fs::File::open(&shot).expect("screenshot"),
    ));
    let mut reader = decoder.read_info().expect("png");
    let mut pixels = vec![0; reader.output_buffer_size().expect("size")];
    let info = reader.next_frame(&mut pixels).expect("frame");
    let channels = info.color_type.samples();
    let bar_pixels = pixels[..info.buffer_size()]
        .chunks(channels)
        .filter(|px| px[0] == 0xc0 && px[1] == 0x39 && px[2] == 0x2b)
        .count();
    assert!(bar_pixels > 100, "{bar_pixels} pixels of bar colour");
}

#[test]
fn verify_writes_its_outcome_as_metrics() {
    let dir = TempDir::new().expect("tmp");
    let out = dir.path().join("out.parquet");
    dedup_ok(&[&sample(), "-o", p(&out), "--op", "op"]);
    let prom = dir.path().join("verify.prom");
    let run = |target: &str| {
        let status = idem()
            .args([
                "verify",
                "--source",
                &sample(),
                "--target",
                target,
                "--op",
                "op",
            ])
            .args(["--metrics", p(&prom), "-q"])
            .output()
            .expect("verify")
            .status
            .code();
        let text = std::fs::read_to_string(&prom).expect("metrics");
        let value = |name: &str| -> f64 {
            let prefix = format!(r#"{name}{{command="verify",target="{target}"}} "#);
            text.lines()
                .find_map(|l| l.strip_prefix(&prefix))
                .unwrap_or_else(|| panic!("{prefix} in {text}"))
                .parse()
                .expect("a number")
        };
        (
            status,
            value("idem_verify_matches"),
            value("idem_missing_rows"),
        )
    };
    assert_eq!(run(p(&out)), (Some(0), 1.0, 0.0));
    // A target holding only the first input's winners lacks the others.
    let first = format!("{}/events-00000.parquet", sample());
    let (status, matches, missing) = run(&first);
    assert_eq!((status, matches), (Some(1), 0.0));
    assert!(missing > 0.0);
}

#[cfg(feature = "ballista")]
#[test]
fn sql_runs_on_a_ballista_cluster_with_the_rows_of_a_local_run() {
    // A scheduler and two executors in this process, on loopback; the binary is their
    // client, in another process.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let url = runtime
        .block_on(idem_ballista::start_cluster(
            datafusion::prelude::SessionConfig::new().with_target_partitions(2),
            2,
        ))
        .expect("cluster");
    let dir = TempDir::new().expect("tmp");
    let query = format!(
        "SELECT * FROM dedup('{}', 'event_id,sequence', 'lsn', 'op=op') ORDER BY event_id, sequence",
        sample()
    );
    let run = |output: &Path, cluster: Option<&str>| {
        let mut command = idem();
        command.args(["sql", &query, "-o", p(output)]);
        if let Some(url) = cluster {
            command.args(["--cluster", url]);
        }
        let done = command.output().expect("run");
        assert!(
            done.status.success(),
            "{cluster:?}: {}",
            String::from_utf8_lossy(&done.stderr)
        );
        read_output(output)
    };
    let local = run(&dir.path().join("local.parquet"), None);
    let clustered = run(&dir.path().join("cluster.parquet"), Some(&url));
    let stats = dedup_ok(&[
        &sample(),
        "--op",
        "op",
        "-o",
        p(&dir.path().join("dedup.parquet")),
    ]);
    assert_eq!(
        local.num_rows() as u64,
        stats["rows_out"].as_u64().expect("rows_out")
    );
    assert_eq!(clustered, local);
    drop(runtime);
}
