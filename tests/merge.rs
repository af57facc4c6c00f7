//! End-to-end tests of `idem merge` and `idem vacuum`: a series of batches (inserts,
//! updates, replays, late older updates, deletes, re-runs) against a reference model; the
//! table read back by an independent replay of its Delta log; failures that leave the table
//! as it was; concurrent writers; and SIGKILL at random points.
#![cfg(feature = "delta")]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::Arc;

use arrow::array::{ArrayRef, AsArray, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::Int64Type;
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use serde_json::Value;
use tempfile::TempDir;

mod common;
use common::{idem, p};

/// One event: key (event_id, sequence), lsn, op, amount.
type Event = (&'static str, i64, i64, &'static str, i64);
type Key = (String, i64);
/// What the table holds for a key: (lsn, op, amount as text).
type Row = (i64, String, String);

fn write_events(path: &Path, events: &[Event]) {
    let batch = RecordBatch::try_from_iter([
        (
            "event_id",
            Arc::new(StringArray::from_iter_values(events.iter().map(|e| e.0))) as ArrayRef,
        ),
        (
            "sequence",
            Arc::new(Int64Array::from_iter_values(events.iter().map(|e| e.1))),
        ),
        (
            "lsn",
            Arc::new(Int64Array::from_iter_values(events.iter().map(|e| e.2))),
        ),
        (
            "op",
            Arc::new(StringArray::from_iter_values(events.iter().map(|e| e.3))),
        ),
        (
            "amount",
            Arc::new(Int64Array::from_iter_values(events.iter().map(|e| e.4))),
        ),
    ])
    .expect("batch");
    write_batch(path, &batch);
}

fn write_batch(path: &Path, batch: &RecordBatch) {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).expect("dir");
    }
    let file = std::fs::File::create(path).expect("create");
    let mut writer = ArrowWriter::try_new(file, batch.schema(), None).expect("writer");
    writer.write(batch).expect("write");
    writer.close().expect("close");
}

/// The reference: the batch deduplicated (greatest lsn per key), then applied with the
/// monotonic guard and remembered deletes.
#[derive(Default, Clone)]
struct Model {
    rows: BTreeMap<Key, Row>,
    tombstones: BTreeMap<Key, i64>,
}

impl Model {
    fn apply(&mut self, events: &[Event]) {
        let mut winners: BTreeMap<Key, &Event> = BTreeMap::new();
        for e in events {
            let key = (e.0.to_owned(), e.1);
            if winners.get(&key).is_none_or(|w| e.2 > w.2) {
                winners.insert(key, e);
            }
        }
        for (key, e) in winners {
            let delete = e.3 == "d";
            if self.tombstones.get(&key).is_some_and(|t| *t >= e.2) {
                continue;
            }
            if self.rows.get(&key).is_some_and(|r| r.0 >= e.2) {
                continue;
            }
            if delete {
                self.rows.remove(&key);
                self.tombstones.insert(key, e.2);
            } else {
                self.tombstones.remove(&key);
                self.rows
                    .insert(key, (e.2, e.3.to_owned(), e.4.to_string()));
            }
        }
    }
}

/// The batches of each active file (`_delta_log/*.json` replayed).
fn active_batches(table: &Path) -> Vec<(String, Vec<RecordBatch>)> {
    read_log_files(table)
        .into_iter()
        .map(|file| {
            let batches = ParquetRecordBatchReaderBuilder::try_new(
                std::fs::File::open(table.join(&file)).expect("active file exists"),
            )
            .expect("parquet")
            .build()
            .expect("reader")
            .map(|batch| batch.expect("batch"))
            .collect();
            (file, batches)
        })
        .collect()
}

/// The table's rows, read the way any Delta reader does: replay `_delta_log/*.json` for
/// the active files, read them. Panics on a duplicated key or a missing file.
fn read_table(table: &Path) -> BTreeMap<Key, Row> {
    let mut rows = BTreeMap::new();
    for (file, batches) in active_batches(table) {
        for batch in batches {
            let ids = batch
                .column_by_name("event_id")
                .expect("event_id")
                .as_string::<i32>()
                .clone();
            let int = |name: &str| {
                batch
                    .column_by_name(name)
                    .expect(name)
                    .as_primitive::<Int64Type>()
                    .clone()
            };
            let (seq, lsn) = (int("sequence"), int("lsn"));
            let ops = batch
                .column_by_name("op")
                .expect("op")
                .as_string::<i32>()
                .clone();
            let amount = batch.column_by_name("amount").expect("amount");
            let amount = arrow::util::display::ArrayFormatter::try_new(
                amount.as_ref(),
                &arrow::util::display::FormatOptions::default(),
            )
            .expect("formatter");
            for i in 0..batch.num_rows() {
                let key = (ids.value(i).to_owned(), seq.value(i));
                let row = (
                    lsn.value(i),
                    ops.value(i).to_owned(),
                    amount.value(i).to_string(),
                );
                assert!(
                    rows.insert(key.clone(), row).is_none(),
                    "key {key:?} twice in {file}"
                );
            }
        }
    }
    rows
}

fn table_version(table: &Path) -> usize {
    std::fs::read_dir(table.join("_delta_log"))
        .map(|d| {
            d.filter(|e| {
                e.as_ref()
                    .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "json"))
            })
            .count()
        })
        .unwrap_or(0)
}

fn merge(inputs: &[&Path], table: &str, extra: &[&str]) -> Output {
    idem()
        .arg("merge")
        .args(inputs.iter().map(|i| p(i)))
        .args(["--into", table, "--op", "op", "--stats", "-", "-q"])
        .args(extra)
        .output()
        .expect("run")
}

/// Runs a merge that must fail; returns its stderr.
fn merge_err(inputs: &[&Path], table: &str, extra: &[&str]) -> String {
    let output = merge(inputs, table, extra);
    assert!(
        !output.status.success(),
        "merge {inputs:?} should have failed"
    );
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Runs a merge that must succeed; checks that every batch key is counted exactly once.
fn merge_ok(inputs: &[&Path], table: &str, extra: &[&str]) -> Value {
    let output = merge(inputs, table, extra);
    assert!(
        output.status.success(),
        "merge {inputs:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stats: Value = serde_json::from_slice(&output.stdout).expect("stats JSON");
    if !stats["already_applied"].as_bool().unwrap_or(false) {
        let n = |k: &str| {
            stats[k]
                .as_u64()
                .unwrap_or_else(|| panic!("{k} in {stats}"))
        };
        assert_eq!(
            n("distinct_keys"),
            n("inserted")
                + n("updated")
                + n("deleted")
                + n("deletes_without_row")
                + n("stale")
                + n("resurrections_blocked"),
            "{stats}"
        );
    }
    stats
}

fn counts(stats: &Value) -> [u64; 5] {
    [
        "inserted",
        "updated",
        "deleted",
        "stale",
        "resurrections_blocked",
    ]
    .map(|k| stats[k].as_u64().unwrap_or(u64::MAX))
}

#[test]
fn a_series_of_batches_matches_the_reference_and_a_dedup_of_everything() {
    let dir = TempDir::new().expect("tmp");
    let table = dir.path().join("table");
    let t = p(&table);
    let b1 = dir.path().join("b1/events.parquet");
    let b2 = dir.path().join("b2/events.parquet");
    let b3 = dir.path().join("b3/events.parquet");
    let e1: Vec<Event> = vec![
        ("a", 0, 10, "c", 1),
        ("b", 0, 10, "c", 2),
        ("c", 0, 10, "c", 3),
        ("d", 0, 10, "c", 4),
        ("e", 0, 10, "c", 5),
        ("e", 1, 10, "c", 6),
        ("a", 0, 10, "c", 1), // an exact replay inside the batch
    ];
    // An update, a replay of the table's row, an older update, a delete, a new key, and a
    // delete of a key the table never had.
    let e2: Vec<Event> = vec![
        ("b", 0, 20, "u", 22),
        ("c", 0, 10, "c", 3),
        ("d", 0, 5, "u", 44),
        ("e", 0, 20, "d", 0),
        ("f", 0, 20, "c", 7),
        ("g", 0, 20, "d", 0),
    ];
    // A late update older than the delete (blocked), a newer one elsewhere, and an update of
    // the deleted-then-never-present key at a newer version (allowed: it is newer).
    let e3: Vec<Event> = vec![
        ("e", 0, 15, "u", 55),
        ("a", 0, 30, "u", 11),
        ("g", 0, 25, "c", 8),
        ("e", 1, 9, "u", 66),
    ];
    write_events(&b1, &e1);
    write_events(&b2, &e2);
    write_events(&b3, &e3);
    let mut model = Model::default();

    let stats = merge_ok(&[&b1], t, &[]);
    model.apply(&e1);
    assert_eq!(counts(&stats), [6, 0, 0, 0, 0], "{stats}");
    assert_eq!(
        (stats["created"].as_bool(), stats["committed"].as_bool()),
        (Some(true), Some(true))
    );
    assert_eq!(stats["duplicates"], 1);
    assert_eq!(read_table(&table), model.rows);

    let stats = merge_ok(&[&b2], t, &[]);
    model.apply(&e2);
    assert_eq!(counts(&stats), [1, 1, 1, 2, 0], "{stats}");
    assert_eq!(stats["deletes_without_row"], 1);
    assert_eq!(stats["tombstones"], 2);
    assert_eq!(read_table(&table), model.rows);

    let metrics = dir.path().join("merge.prom");
    let stats = merge_ok(&[&b3], t, &["--metrics", p(&metrics)]);
    model.apply(&e3);
    let text = std::fs::read_to_string(&metrics).expect("metrics");
    for (name, key) in [
        ("idem_resurrections_blocked", "resurrections_blocked"),
        ("idem_stale", "stale"),
        ("idem_inserted", "inserted"),
    ] {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("{name}{{command=\"merge\"")))
            .unwrap_or_else(|| panic!("{name} in {text}"));
        let value: f64 = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .expect("value");
        assert_eq!(value as u64, stats[key].as_u64().expect("stat"), "{line}");
    }
    assert_eq!(counts(&stats), [1, 1, 0, 1, 1], "{stats}");
    assert_eq!(
        stats["tombstones"], 1,
        "g's tombstone ends with its newer insert"
    );
    assert_eq!(read_table(&table), model.rows);
    let version = table_version(&table);

    // The same files again: recognised, nothing committed.
    let stats = merge_ok(&[&b2], t, &[]);
    assert_eq!(stats["already_applied"], true, "{stats}");
    assert_eq!(stats["committed"], false);
    assert_eq!(table_version(&table), version);
    // Touched files (new mtime) are a new batch, but the guard makes it a no-op.
    write_events(&b2, &e2);
    let stats = merge_ok(&[&b2], t, &[]);
    assert_eq!(
        (
            stats["already_applied"].as_bool(),
            stats["committed"].as_bool()
        ),
        (Some(false), Some(false))
    );
    assert_eq!(counts(&stats), [0, 0, 0, 6, 0], "{stats}");
    assert_eq!(table_version(&table), version);
    assert_eq!(read_table(&table), model.rows);

    // Every command reads the table as its latest version; it equals a dedup of all the
    // batches with deletes applied, column for column.
    let verify = idem()
        .args([
            "verify",
            "--source",
            p(&b1),
            p(&b2),
            p(&b3),
            "--target",
            t,
            "--op",
            "op",
            "--json",
        ])
        .output()
        .expect("verify");
    assert!(
        verify.status.success(),
        "{}{}",
        String::from_utf8_lossy(&verify.stdout),
        String::from_utf8_lossy(&verify.stderr)
    );
}

#[test]
fn deletes_expire_after_the_retention_and_then_older_updates_return() {
    let dir = TempDir::new().expect("tmp");
    let table = dir.path().join("table");
    let t = p(&table);
    let files: Vec<PathBuf> = (0..3)
        .map(|i| dir.path().join(format!("b{i}.parquet")))
        .collect();
    write_events(&files[0], &[("k", 0, 10, "c", 1)]);
    write_events(&files[1], &[("k", 0, 20, "d", 0)]);
    write_events(&files[2], &[("k", 0, 15, "u", 2)]);
    merge_ok(&[&files[0]], t, &[]);
    merge_ok(&[&files[1]], t, &[]);
    let blocked = merge_ok(&[&files[2]], t, &[]);
    assert_eq!(blocked["resurrections_blocked"], 1);
    assert!(read_table(&table).is_empty());
    // Past the horizon the tombstone is forgotten (the documented trade-off).
    write_events(&files[2], &[("k", 0, 15, "u", 2)]);
    let returned = merge_ok(&[&files[2]], t, &["--tombstone-retention", "0s"]);
    assert_eq!(
        (
            returned["tombstones_expired"].as_u64(),
            returned["inserted"].as_u64()
        ),
        (Some(1), Some(1))
    );
    assert_eq!(read_table(&table).len(), 1);
}

/// Generated events (the project's generator) split into batches.
fn generated_batches(dir: &Path, rows: &str, files: &str) -> Vec<PathBuf> {
    let out = dir.join("generated");
    let status = idem()
        .args([
            "generate",
            "-o",
            p(&out),
            "--rows",
            rows,
            "--files",
            files,
            "--seed",
            "7",
        ])
        .status()
        .expect("generate");
    assert!(status.success());
    let mut batches: Vec<PathBuf> = std::fs::read_dir(&out)
        .expect("dir")
        .map(|e| e.expect("entry").path())
        .collect();
    batches.sort();
    batches
}

#[test]
fn generated_batches_merged_one_by_one_equal_one_dedup_with_and_without_buckets() {
    let dir = TempDir::new().expect("tmp");
    let batches = generated_batches(dir.path(), "60000", "6");
    for buckets in [None, Some("8")] {
        let table = dir
            .path()
            .join(format!("table-{}", buckets.unwrap_or("none")));
        let t = p(&table);
        let extra: Vec<&str> = buckets.map(|b| vec!["--buckets", b]).unwrap_or_default();
        for (i, batch) in batches.iter().enumerate() {
            let stats = merge_ok(&[batch], t, if i == 0 { &extra } else { &[] });
            if let Some(b) = buckets {
                let files = read_log_files(&table);
                assert!(files.len() <= b.parse::<usize>().expect("n"), "{files:?}");
                assert!(stats["files_added"].as_u64() <= b.parse().ok());
            }
        }
        assert_table_is_dedup_of(&batches, t);
    }
}

/// One `idem merge` process per batch into the same table, all started at once; each must
/// succeed.
fn merge_all_at_once(batches: &[PathBuf], table: &str) {
    let children: Vec<std::process::Child> = batches
        .iter()
        .map(|batch| {
            idem()
                .args(["merge", p(batch), "--into", table, "--op", "op", "-q"])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("spawn")
        })
        .collect();
    for child in children {
        let output = child.wait_with_output().expect("wait");
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

/// `idem verify` of the table against a dedup of all the batches, deletes applied.
fn assert_table_is_dedup_of(batches: &[PathBuf], table: &str) {
    let verify = idem()
        .arg("verify")
        .arg("--source")
        .args(batches)
        .args(["--target", table, "--op", "op"])
        .output()
        .expect("verify");
    assert!(
        verify.status.success(),
        "{table}: {}",
        String::from_utf8_lossy(&verify.stdout)
    );
}

/// The files of the table's latest version: `_delta_log/*.json` replayed (the tests never
/// reach a checkpoint).
fn read_log_files(table: &Path) -> BTreeSet<String> {
    active_adds(table).into_keys().collect()
}

/// The `add` actions of the table's latest version, by path.
fn active_adds(table: &Path) -> BTreeMap<String, Value> {
    let mut active = BTreeMap::new();
    let mut commits: Vec<PathBuf> = std::fs::read_dir(table.join("_delta_log"))
        .expect("log")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    commits.sort();
    for commit in commits {
        for line in std::fs::read_to_string(&commit).expect("commit").lines() {
            let action: Value = serde_json::from_str(line).expect("action");
            if let Some(path) = action["add"]["path"].as_str() {
                active.insert(path.to_owned(), action["add"].clone());
            }
            if let Some(path) = action["remove"]["path"].as_str() {
                active.remove(path);
            }
        }
    }
    active
}

/// The column names stored in a Parquet file.
fn stored_columns(path: &Path) -> Vec<String> {
    let file = std::fs::File::open(path).expect("file");
    let reader = ParquetRecordBatchReaderBuilder::try_new(file).expect("parquet");
    reader
        .schema()
        .fields()
        .iter()
        .map(|f| f.name().clone())
        .collect()
}

#[test]
fn partitioned_tables_keep_partition_values_in_paths_and_equal_one_dedup() {
    let dir = TempDir::new().expect("tmp");
    let batches = generated_batches(dir.path(), "60000", "6");
    // A column that changes on update (rows move between partitions), a key column (with
    // buckets in each partition), and both.
    for (by, buckets) in [
        ("status", None),
        ("sequence", Some("4")),
        ("status,sequence", None),
    ] {
        let table = dir.path().join(format!(
            "table-{}-{}",
            by.replace(',', "+"),
            buckets.unwrap_or("none")
        ));
        let t = p(&table);
        let mut first = vec!["--partition-by", by];
        first.extend(buckets.iter().flat_map(|b| ["--buckets", b]));
        for (i, batch) in batches.iter().enumerate() {
            merge_ok(&[batch], t, if i == 0 { &first } else { &[] });
        }
        let columns: Vec<&str> = by.split(',').collect();
        let adds = active_adds(&table);
        let partitions: BTreeSet<String> = adds
            .values()
            .map(|a| a["partitionValues"].to_string())
            .collect();
        assert!(partitions.len() > 1, "{by}: {partitions:?}");
        for (path, add) in &adds {
            let values = &add["partitionValues"];
            let directory: String = columns
                .iter()
                .map(|c| format!("{c}={}/", values[c].as_str().expect("a value")))
                .collect();
            assert!(path.starts_with(&directory), "{path} in {values}");
            let stored = stored_columns(&table.join(path));
            assert!(
                columns.iter().all(|c| !stored.iter().any(|s| s == c)),
                "{path} stores {stored:?}"
            );
        }
        if let Some(b) = buckets {
            let per_partition = adds.len() / partitions.len().max(1);
            assert!(per_partition <= b.parse().expect("n"), "{adds:?}");
        }
        // Read back as a table (partition columns restored), it is the dedup of the batches.
        assert_table_is_dedup_of(&batches, t);
        let other = if by == "status" { "sequence" } else { "status" };
        let err = merge_err(&[&batches[0]], t, &["--partition-by", other]);
        assert!(err.contains(&format!("partitioned by {by}")), "{err}");
    }
}

/// A batch of 4000 keys spread over the four event ids of [`KEYS`].
fn four_thousand_keys(dir: &Path) -> PathBuf {
    let events: Vec<Event> = (0..4000)
        .map(|i| (KEYS[i % KEYS.len()], i as i64, 1, "c", i as i64))
        .collect();
    let path = dir.join("first.parquet");
    write_events(&path, &events);
    path
}

#[test]
fn partitioned_by_a_key_column_a_batch_reads_only_its_keys_partitions() {
    let dir = TempDir::new().expect("tmp");
    let table = dir.path().join("table");
    let t = p(&table);
    let first = four_thousand_keys(dir.path());
    let err = merge_err(&[&first], t, &["--partition-by", "nope"]);
    assert!(err.contains("nope"), "{err}");
    merge_ok(
        &[&first],
        t,
        &["--partition-by", "event_id", "--max-rows-per-file", "100"],
    );
    assert_eq!(read_log_files(&table).len(), 40);
    let small = dir.path().join("small.parquet");
    write_events(
        &small,
        &[
            (KEYS[0], 0, 2, "u", -1),
            (KEYS[0], 4, 2, "d", 0),
            ("echo", 1, 1, "c", 7),
        ],
    );
    let stats = merge_ok(&[&small], t, &[]);
    assert_eq!(counts(&stats), [1, 1, 1, 0, 0], "{stats}");
    // alpha's 10 files are read; bravo's, charlie's and delta's are not.
    assert_eq!(stats["files_scanned"], 10, "{stats}");
    assert_eq!(stats["files_pruned"], 30, "{stats}");
    assert_eq!(stats["files_removed"], 1, "{stats}");
    assert!(
        read_log_files(&table)
            .iter()
            .any(|f| f.starts_with("event_id=echo/")),
        "a new partition"
    );
    assert_table_is_dedup_of(&[first, small], t);
}

#[test]
fn a_small_batch_rewrites_only_the_files_holding_its_keys() {
    let dir = TempDir::new().expect("tmp");
    let table = dir.path().join("table");
    let t = p(&table);
    // 40 files' worth of keys, clustered by key when written.
    let first = four_thousand_keys(dir.path());
    merge_ok(&[&first], t, &["--max-rows-per-file", "100"]);
    assert_eq!(read_log_files(&table).len(), 40);
    let small = dir.path().join("small.parquet");
    write_events(&small, &[(KEYS[0], 0, 2, "u", -1), (KEYS[0], 8, 2, "d", 0)]);
    let stats = merge_ok(&[&small], t, &[]);
    assert_eq!(
        (stats["updated"].as_u64(), stats["deleted"].as_u64()),
        (Some(1), Some(1))
    );
    assert_eq!(stats["files_removed"], 1, "{stats}");
    assert!(stats["files_pruned"].as_u64() >= Some(30), "{stats}");
    assert_eq!(read_table(&table).len(), 3999);
}

const KEYS: [&str; 4] = ["alpha", "bravo", "charlie", "delta"];

#[test]
fn bad_batches_fail_naming_the_problem_and_leave_the_table_as_it_was() {
    let dir = TempDir::new().expect("tmp");
    let table = dir.path().join("table");
    let t = p(&table);
    let good = dir.path().join("good.parquet");
    write_events(&good, &[("a", 0, 1, "c", 1)]);
    merge_ok(&[&good], t, &[]);
    let before = read_table(&table);
    let files_before = std::fs::read_dir(&table).expect("dir").count();

    // A missing key column.
    let no_key = dir.path().join("no_key.parquet");
    let batch = RecordBatch::try_from_iter([
        (
            "event_id",
            Arc::new(StringArray::from(vec!["x"])) as ArrayRef,
        ),
        ("lsn", Arc::new(Int64Array::from(vec![5]))),
        ("op", Arc::new(StringArray::from(vec!["c"]))),
        ("amount", Arc::new(Int64Array::from(vec![5]))),
    ])
    .expect("batch");
    write_batch(&no_key, &batch);
    let err = merge_err(&[&no_key], t, &[]);
    assert!(
        err.contains("no_key.parquet") && err.contains("sequence"),
        "{err}"
    );

    // Schema drift: an extra column; and a different type.
    let drift = dir.path().join("drift.parquet");
    let batch = RecordBatch::try_from_iter([
        (
            "event_id",
            Arc::new(StringArray::from(vec!["x"])) as ArrayRef,
        ),
        ("sequence", Arc::new(Int64Array::from(vec![0]))),
        ("lsn", Arc::new(Int64Array::from(vec![5]))),
        ("op", Arc::new(StringArray::from(vec!["c"]))),
        ("amount", Arc::new(StringArray::from(vec!["5"]))),
        ("surprise", Arc::new(Int64Array::from(vec![1]))),
    ])
    .expect("batch");
    write_batch(&drift, &batch);
    let err = merge_err(&[&drift], t, &[]);
    assert!(err.contains("amount"), "{err}");

    // A key the table was not created with.
    let err = merge_err(&[&good], t, &["--key", "event_id"]);
    assert!(err.contains("event_id,sequence"), "{err}");

    // A corrupt file.
    let corrupt = dir.path().join("corrupt.parquet");
    std::fs::write(&corrupt, b"PAR1 not really").expect("write");
    assert!(merge_err(&[&corrupt], t, &[]).contains("corrupt.parquet"));

    assert_eq!(read_table(&table), before);
    assert_eq!(table_version(&table), 1);
    assert_eq!(
        std::fs::read_dir(&table).expect("dir").count(),
        files_before
    );
}

#[test]
fn concurrent_merges_serialise_without_losing_or_duplicating_keys() {
    let dir = TempDir::new().expect("tmp");
    let table = dir.path().join("table");
    let t = p(&table);
    let seed = dir.path().join("seed.parquet");
    write_events(&seed, &[("k0", 0, 1, "c", 0)]);
    merge_ok(&[&seed], t, &[]);
    // Each writer updates the shared keys at its own versions and inserts its own keys.
    let mut model = Model::default();
    model.apply(&[("k0", 0, 1, "c", 0)]);
    let writers: Vec<(PathBuf, Vec<Event>)> = (0..4)
        .map(|w| {
            let events: Vec<Event> = vec![
                ("k0", 0, 10 + w, "u", w),
                ("shared", 0, 10 + w, "u", w),
                (["w0", "w1", "w2", "w3"][w as usize], 0, 1, "c", w),
            ];
            (dir.path().join(format!("w{w}.parquet")), events)
        })
        .collect();
    for (path, events) in &writers {
        write_events(path, events);
        model.apply(events);
    }
    let paths: Vec<PathBuf> = writers.iter().map(|(path, _)| path.clone()).collect();
    merge_all_at_once(&paths, t);
    assert_eq!(read_table(&table), model.rows);
    assert_eq!(table_version(&table), 5);
}

#[test]
fn writers_racing_to_create_the_table_make_one_table() {
    let dir = TempDir::new().expect("tmp");
    let table = dir.path().join("table");
    let mut model = Model::default();
    let batches: Vec<PathBuf> = (0..3)
        .map(|w| {
            let path = dir.path().join(format!("w{w}.parquet"));
            let events: Vec<Event> = vec![
                ("shared", 0, 10 + w, "u", w),
                (["a", "b", "c"][w as usize], 0, 1, "c", w),
            ];
            write_events(&path, &events);
            model.apply(&events);
            path
        })
        .collect();
    merge_all_at_once(&batches, p(&table));
    assert_eq!(read_table(&table), model.rows);
    assert_eq!(table_version(&table), 3);
}

#[test]
fn merges_killed_at_random_points_leave_a_readable_table_and_reruns_complete_it() {
    let dir = TempDir::new().expect("tmp");
    let table = dir.path().join("table");
    let t = p(&table);
    let batches = generated_batches(dir.path(), "40000", "20");
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    // The states a clean run passes through.
    let clean = dir.path().join("clean");
    let mut states: Vec<BTreeMap<Key, Row>> = vec![BTreeMap::new()];
    let mut durations = Vec::new();
    for batch in &batches {
        let started = std::time::Instant::now();
        merge_ok(&[batch], p(&clean), &[]);
        durations.push(started.elapsed().as_millis() as u64);
        states.push(read_table(&clean));
    }
    let mut kills_before_commit = 0;
    for (i, batch) in batches.iter().enumerate() {
        let mut child = idem()
            .args(["merge", p(batch), "--into", t, "--op", "op", "-q"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn");
        // Anywhere from process start to about when a clean run of this batch ends.
        std::thread::sleep(std::time::Duration::from_millis(
            next() % durations[i].max(1),
        ));
        let _ = child.kill();
        let _ = child.wait();
        // Whatever the kill interrupted, the table is at a committed version: the one
        // before this batch or the one after it.
        if table.join("_delta_log").exists() {
            let rows = read_table(&table);
            assert!(
                rows == states[i] || rows == states[i + 1],
                "batch {i}: after a kill the table is neither before nor after the batch"
            );
            kills_before_commit += usize::from(rows == states[i] && states[i] != states[i + 1]);
        }
        // The re-run completes it, or finds it applied.
        merge_ok(&[batch], t, &[]);
        assert_eq!(
            read_table(&table),
            states[i + 1],
            "batch {i} after its re-run"
        );
    }
    eprintln!(
        "{kills_before_commit} of {} kills landed before the commit",
        batches.len()
    );
    assert!(
        kills_before_commit >= 3,
        "too few kills landed before a commit to prove anything"
    );
    assert_table_is_dedup_of(&batches, t);
    // Files of killed merges are invisible, and vacuum removes them.
    let vacuum = idem()
        .args(["vacuum", "--into", t, "--retention", "0s", "--json"])
        .output()
        .expect("vacuum");
    assert!(
        vacuum.status.success(),
        "{}",
        String::from_utf8_lossy(&vacuum.stderr)
    );
    let active = read_log_files(&table);
    let on_disk: BTreeSet<String> = std::fs::read_dir(&table)
        .expect("dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".parquet"))
        .collect();
    assert_eq!(on_disk, active);
    assert_eq!(read_table(&table), *states.last().expect("state"));
}

#[cfg(feature = "cloud")]
#[test]
fn merge_into_s3_serialises_writers_and_detects_reruns() {
    let Some(prefix) = common::s3_prefix("merge") else {
        return;
    };
    let dir = TempDir::new().expect("tmp");
    let table = format!("{prefix}/table");
    let batches = generated_batches(dir.path(), "40000", "4");
    let local = dir.path().join("local");
    let run = |batch: &Path, into: &str| -> Value {
        let output = idem()
            .args([
                "merge",
                p(batch),
                "--into",
                into,
                "--op",
                "op",
                "--stats",
                "-",
                "-q",
            ])
            .env("AWS_SECRET_ACCESS_KEY", common::SECRET)
            .output()
            .expect("run");
        let stderr = String::from_utf8_lossy(&output.stderr);
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{stderr}");
        assert!(!stdout.contains(common::SECRET) && !stderr.contains(common::SECRET));
        serde_json::from_str(&stdout).expect("stats")
    };
    for batch in &batches[..2] {
        let remote = run(batch, &table);
        let local = run(batch, p(&local));
        for key in [
            "inserted",
            "updated",
            "deleted",
            "stale",
            "resurrections_blocked",
            "table_rows",
        ] {
            assert_eq!(remote[key], local[key], "{key}: {remote} vs {local}");
        }
    }
    let again = run(&batches[0], &table);
    assert_eq!(again["already_applied"], true, "{again}");

    // Two writers at once: both succeed, one after the other.
    merge_all_at_once(&batches[2..], &table);
    for batch in &batches[2..] {
        run(batch, p(&local));
    }
    // The table on S3 equals the local one, read through every command's table input.
    assert_table_is_dedup_of(&batches, &table);
    assert_table_is_dedup_of(&batches, p(&local));

    // A batch on S3 too, written there by the generator.
    let remote_batch = format!("{prefix}/generated");
    let generated = idem()
        .args([
            "generate",
            "-o",
            &remote_batch,
            "--rows",
            "2000",
            "--files",
            "2",
        ])
        .output()
        .expect("generate");
    assert!(generated.status.success(), "{generated:?}");
    let output = idem()
        .args([
            "merge",
            &remote_batch,
            "--into",
            &table,
            "--op",
            "op",
            "--stats",
            "-",
            "-q",
        ])
        .output()
        .expect("merge");
    assert!(output.status.success(), "{output:?}");
    let stats: Value = serde_json::from_slice(&output.stdout).expect("stats");
    assert_eq!(
        (stats["rows_in"].as_u64(), stats["input_files"].as_u64()),
        (Some(2000), Some(2))
    );
}

/// Writes events whose `lsn` is `UInt64`, the natural type of a PostgreSQL LSN.
fn write_unsigned_events(path: &Path, events: &[(&str, u64, &str)]) {
    let batch = RecordBatch::try_from_iter([
        (
            "event_id",
            Arc::new(StringArray::from_iter_values(events.iter().map(|e| e.0))) as ArrayRef,
        ),
        (
            "sequence",
            Arc::new(Int64Array::from_iter_values(events.iter().map(|_| 0))),
        ),
        (
            "lsn",
            Arc::new(arrow::array::UInt64Array::from_iter_values(
                events.iter().map(|e| e.1),
            )),
        ),
        (
            "op",
            Arc::new(StringArray::from_iter_values(events.iter().map(|e| e.2))),
        ),
    ])
    .expect("batch");
    write_batch(path, &batch);
}

/// The table's (event_id → lsn), its `lsn` read as the `decimal(20,0)` the log declares.
fn read_unsigned_table(table: &Path) -> BTreeMap<String, u64> {
    let mut rows = BTreeMap::new();
    for (file, batches) in active_batches(table) {
        for batch in batches {
            let ids = batch.column_by_name("event_id").expect("event_id");
            let lsn = batch.column_by_name("lsn").expect("lsn");
            assert_eq!(
                lsn.data_type(),
                &arrow::datatypes::DataType::Decimal128(20, 0),
                "{file}"
            );
            let lsn = lsn.as_primitive::<arrow::datatypes::Decimal128Type>();
            for i in 0..batch.num_rows() {
                let version = u64::try_from(lsn.value(i)).expect("a u64 value");
                rows.insert(ids.as_string::<i32>().value(i).to_owned(), version);
            }
        }
    }
    rows
}

#[test]
fn unsigned_versions_straddling_two_to_the_63_keep_their_order_across_batches() {
    const HALF: u64 = 1 << 63;
    let dir = TempDir::new().expect("tmp");
    let table = dir.path().join("table");
    let t = p(&table);
    let batches = [
        vec![
            ("a", HALF - 1, "c"),
            ("b", HALF + 5, "c"),
            ("c", HALF - 2, "c"),
            ("b", HALF - 7, "u"),
        ],
        // a moves across 2^63 (newer); b's replay below 2^63 is stale; c is deleted above it.
        vec![
            ("a", HALF + 1, "u"),
            ("b", HALF - 1, "u"),
            ("c", HALF + 10, "d"),
        ],
        // c's late update between its old row and its delete stays deleted; d at u64::MAX.
        vec![("c", HALF + 3, "u"), ("d", u64::MAX, "c"), ("a", HALF, "u")],
    ];
    let expected_counts = [[3, 0, 0, 0, 0], [0, 1, 1, 1, 0], [1, 0, 0, 1, 1]];
    let mut paths = Vec::new();
    for (i, (events, expected)) in batches.iter().zip(expected_counts).enumerate() {
        let path = dir.path().join(format!("b{i}.parquet"));
        write_unsigned_events(&path, events);
        let stats = merge_ok(&[&path], t, &[]);
        assert_eq!(counts(&stats), expected, "batch {i}: {stats}");
        paths.push(path);
    }
    let expected: BTreeMap<String, u64> = [("a", HALF + 1), ("b", HALF + 5), ("d", u64::MAX)]
        .map(|(k, v)| (k.to_owned(), v))
        .into();
    assert_eq!(read_unsigned_table(&table), expected);
    let rerun = merge_ok(&[&paths[1]], t, &[]);
    assert_eq!(rerun["already_applied"], true, "{rerun}");
    assert_eq!(read_unsigned_table(&table), expected);
}
