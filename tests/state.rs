//! End-to-end tests of `idem dedup --state`: dedup across daily runs, with replays that
//! cross day boundaries, expiry by watermark, late rows, and a bounded state.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{
    ArrayRef, AsArray, Int64Array, RecordBatch, StringArray, TimestampMicrosecondArray,
};
use arrow::datatypes::{Int64Type, TimestampMicrosecondType};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use serde_json::Value;
use tempfile::TempDir;

mod common;

use common::{idem, p};

const DAY: i64 = 86_400_000_000;
/// 2026-01-01T00:00:00Z in microseconds.
const START: i64 = 1_767_225_600_000_000;

/// One delivered event.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Event {
    event_id: String,
    sequence: i64,
    lsn: i64,
    time: i64,
}

/// Event `i` of day `day`: a key of its own, times spread over the day.
fn event(day: i64, i: i64, per_day: i64) -> Event {
    Event {
        event_id: format!("d{day}-e{i}"),
        sequence: i % 3,
        lsn: day * per_day + i,
        time: START + day * DAY + i * (DAY / per_day),
    }
}

/// Day `day`'s delivery: its own events (every 50th twice), and replays of earlier days'
/// events, unchanged, for each lag in `lags` (event `i` of day `day - lag` when
/// `i % 10 == lag`).
fn delivery(day: i64, per_day: i64, lags: &[i64]) -> Vec<Event> {
    let mut events = Vec::new();
    for i in 0..per_day {
        events.push(event(day, i, per_day));
        if i % 50 == 0 {
            events.push(event(day, i, per_day));
        }
    }
    for &lag in lags.iter().filter(|&&lag| lag <= day) {
        events.extend(
            (0..per_day)
                .filter(|i| i % 10 == lag)
                .map(|i| event(day - lag, i, per_day)),
        );
    }
    events
}

fn write_events(path: &Path, events: &[Event]) {
    let columns: Vec<(&str, ArrayRef)> = vec![
        (
            "event_id",
            Arc::new(StringArray::from_iter_values(
                events.iter().map(|e| e.event_id.as_str()),
            )),
        ),
        (
            "sequence",
            Arc::new(Int64Array::from_iter_values(
                events.iter().map(|e| e.sequence),
            )),
        ),
        (
            "lsn",
            Arc::new(Int64Array::from_iter_values(events.iter().map(|e| e.lsn))),
        ),
        (
            "event_time",
            Arc::new(
                TimestampMicrosecondArray::from_iter_values(events.iter().map(|e| e.time))
                    .with_timezone("UTC"),
            ),
        ),
        (
            "payload",
            Arc::new(StringArray::from_iter_values(
                events.iter().map(|e| format!("payload of {}", e.event_id)),
            )),
        ),
    ];
    let batch = RecordBatch::try_from_iter(columns).expect("batch");
    let file = std::fs::File::create(path).expect("create");
    let mut writer = ArrowWriter::try_new(file, batch.schema(), None).expect("writer");
    writer.write(&batch).expect("write");
    writer.close().expect("close");
}

fn read_events(path: &Path) -> Vec<Event> {
    let reader = ParquetRecordBatchReaderBuilder::try_new(std::fs::File::open(path).expect("open"))
        .expect("parquet")
        .build()
        .expect("reader");
    let mut events = Vec::new();
    for batch in reader {
        let batch = batch.expect("batch");
        let ids = batch.column_by_name("event_id").expect("event_id");
        let ids = arrow::compute::cast(ids, &arrow::datatypes::DataType::Utf8).expect("cast");
        let ids = ids.as_string::<i32>();
        let sequences = batch
            .column_by_name("sequence")
            .expect("sequence")
            .as_primitive::<Int64Type>();
        let lsns = batch
            .column_by_name("lsn")
            .expect("lsn")
            .as_primitive::<Int64Type>();
        let times = batch
            .column_by_name("event_time")
            .expect("event_time")
            .as_primitive::<TimestampMicrosecondType>();
        for row in 0..batch.num_rows() {
            events.push(Event {
                event_id: ids.value(row).to_owned(),
                sequence: sequences.value(row),
                lsn: lsns.value(row),
                time: times.value(row),
            });
        }
    }
    events
}

/// Runs `idem dedup INPUT -o OUTPUT --state STATE --time-column event_time EXTRA --stats -`.
fn run_day(
    input: &Path,
    output: &str,
    state: &str,
    extra: &[&str],
) -> (Option<i32>, Value, String) {
    let run = idem()
        .args(["dedup", p(input), "-o", output, "--state", state])
        .args(["--time-column", "event_time", "--stats", "-"])
        .args(extra)
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&run.stderr).to_string();
    let stats = serde_json::from_slice(&run.stdout).unwrap_or(Value::Null);
    (run.status.code(), stats, stderr)
}

/// Checks that the run's counts add up with what the state held back.
fn check_counts(stats: &Value) {
    let n = |k: &str| {
        stats[k]
            .as_u64()
            .unwrap_or_else(|| panic!("{k} in {stats}"))
    };
    let s = |k: &str| {
        stats["state"][k]
            .as_u64()
            .unwrap_or_else(|| panic!("state.{k} in {stats}"))
    };
    let late_dropped = if stats["state"]["late_policy"] == "drop" {
        s("late")
    } else {
        0
    };
    assert_eq!(
        n("rows_in"),
        n("rows_out")
            + n("duplicates")
            + n("superseded")
            + n("deleted")
            + s("seen_before")
            + late_dropped,
        "{stats}"
    );
    let kept: u64 = stats["inputs"]
        .as_array()
        .expect("inputs")
        .iter()
        .map(|f| f["kept"].as_u64().expect("kept"))
        .sum();
    assert_eq!(kept, n("rows_out"), "{stats}");
}

struct Days {
    dir: TempDir,
    per_day: i64,
    lags: Vec<i64>,
}

impl Days {
    fn new(per_day: i64, lags: &[i64]) -> Self {
        let dir = TempDir::new().expect("tmp");
        std::fs::create_dir_all(dir.path().join("in")).expect("mkdir");
        std::fs::create_dir_all(dir.path().join("out")).expect("mkdir");
        Self {
            dir,
            per_day,
            lags: lags.to_vec(),
        }
    }

    fn input(&self, day: i64) -> PathBuf {
        let path = self.dir.path().join(format!("in/day-{day:02}.parquet"));
        if !path.exists() {
            write_events(&path, &delivery(day, self.per_day, &self.lags));
        }
        path
    }

    fn output(&self, name: &str, day: i64) -> PathBuf {
        self.dir.path().join(format!("out/{name}-{day:02}.parquet"))
    }
}

fn sorted(mut events: Vec<Event>) -> Vec<Event> {
    events.sort();
    events
}

#[test]
fn daily_runs_with_replays_across_days_emit_each_event_once() {
    let days = Days::new(2_000, &[1, 2, 5]);
    let state = days.dir.path().join("state");
    let mut union = Vec::new();
    for day in 0..8 {
        let output = days.output("long", day);
        let (code, stats, stderr) = run_day(
            &days.input(day),
            p(&output),
            p(&state),
            &["--retention", "7d"],
        );
        assert_eq!(code, Some(0), "{stderr}");
        check_counts(&stats);
        let replays = [1, 2, 5].iter().filter(|&&lag| lag <= day).count() as u64 * 200;
        assert_eq!(stats["state"]["seen_before"], replays, "day {day}: {stats}");
        assert_eq!(stats["state"]["new_keys"], 2_000, "day {day}: {stats}");
        assert_eq!(stats["state"]["late"], 0, "{stats}");
        assert_eq!(stats["state"]["evicted_then_seen"], 0, "{stats}");
        assert_eq!(stats["state"]["version"], day + 1, "{stats}");
        union.extend(read_events(&output));
    }
    // Within the horizon, the union of the daily outputs is the dedup of the union.
    let all: Vec<PathBuf> = (0..8).map(|day| days.input(day)).collect();
    let together = days.dir.path().join("together.parquet");
    let mut args = vec!["dedup".to_owned()];
    args.extend(all.iter().map(|path| p(path).to_owned()));
    args.extend(["-o".to_owned(), p(&together).to_owned(), "-q".to_owned()]);
    let run = idem().args(&args).output().expect("run");
    assert!(run.status.success(), "{run:?}");
    let expected = sorted(read_events(&together));
    assert_eq!(expected.len(), 16_000);
    assert_eq!(sorted(union), expected);

    // The same batch again: already applied, nothing read or written.
    let last = days.output("long", 7);
    let before = std::fs::read(&last).expect("read");
    let (code, stats, stderr) =
        run_day(&days.input(7), p(&last), p(&state), &["--retention", "7d"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(stats["state"]["already_applied"], true, "{stats}");
    assert_eq!(stats["state"]["version"], 8, "{stats}");
    assert_eq!(std::fs::read(&last).expect("read"), before);

    // Another key is another state: refused before anything is read.
    let (code, _, stderr) = run_day(
        &days.input(7),
        p(&days.output("other", 7)),
        p(&state),
        &["--retention", "7d", "--key", "event_id"],
    );
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("state was built with key"), "{stderr}");
    assert!(!days.output("other", 7).exists());
}

#[test]
fn a_short_retention_expires_keys_counts_late_rows_and_keys_seen_again() {
    let days = Days::new(2_000, &[1, 2, 5]);
    let state = days.dir.path().join("state");
    let mut union = Vec::new();
    for day in 0..8 {
        let input = if day == 5 {
            // A producer re-sends 50 of day 1's events stamped with today's time: their keys
            // expired from a 2-day state, so they pass, and are counted.
            let mut events = delivery(day, 2_000, &[1, 2, 5]);
            events.extend((0..500).filter(|i| i % 10 == 7).map(|i| Event {
                time: START + 5 * DAY + i,
                ..event(1, i, 2_000)
            }));
            let path = days.dir.path().join("in/day-05-restamped.parquet");
            write_events(&path, &events);
            path
        } else {
            days.input(day)
        };
        let output = days.output("short", day);
        let prom = days.dir.path().join("idem.prom");
        let (code, stats, stderr) = run_day(
            &input,
            p(&output),
            p(&state),
            &["--retention", "2d", "--metrics", p(&prom)],
        );
        assert_eq!(code, Some(0), "{stderr}");
        check_counts(&stats);
        // Replays one and two days late find their keys; five days late, the keys are gone
        // and the rows are older than the watermark (newest time − 2 days).
        let late = if day >= 5 { 200 } else { 0 };
        let in_state = [1, 2].iter().filter(|&&lag| lag <= day).count() as u64 * 200;
        assert_eq!(stats["state"]["late"], late, "day {day}: {stats}");
        assert_eq!(
            stats["state"]["seen_before"], in_state,
            "day {day}: {stats}"
        );
        let seen_again = stats["state"]["evicted_then_seen"].as_u64().expect("count");
        // Bloom filters: up to a few false positives among the day's 2,000 new keys.
        if day == 5 {
            assert!((50..=70).contains(&seen_again), "{stats}");
        } else {
            assert!(seen_again <= 20, "day {day}: {stats}");
        }
        if day >= 3 {
            assert!(stats["state"]["expired"].as_u64() > Some(0), "{stats}");
        }
        let metrics = std::fs::read_to_string(&prom).expect("metrics");
        for (name, key) in [
            ("idem_state_evicted_then_seen", "evicted_then_seen"),
            ("idem_state_late", "late"),
            ("idem_state_keys", "keys"),
        ] {
            let line = metrics
                .lines()
                .find(|l| l.starts_with(&format!("{name}{{")))
                .unwrap_or_else(|| panic!("{name} in {metrics}"));
            let value: f64 = line
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse().ok())
                .expect("value");
            assert_eq!(Some(value as u64), stats["state"][key].as_u64(), "{line}");
        }
        union.extend(read_events(&output));
    }
    let restamped = union
        .iter()
        .filter(|e| e.event_id.starts_with("d1-") && e.time > START + 5 * DAY)
        .count();
    assert_eq!(restamped, 50);

    // --late error fails the run: no output, the state unchanged.
    let output = days.output("short", 8);
    let (code, _, stderr) = run_day(
        &days.input(8),
        p(&output),
        p(&state),
        &["--retention", "2d", "--late", "error"],
    );
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("older than the state's watermark"),
        "{stderr}"
    );
    assert!(!output.exists());
    let (code, stats, stderr) = run_day(
        &days.input(8),
        p(&output),
        p(&state),
        &["--retention", "2d", "--late", "emit"],
    );
    assert_eq!(code, Some(0), "{stderr}");
    check_counts(&stats);
    assert_eq!(stats["state"]["version"], 9, "{stats}");
    assert_eq!(stats["state"]["late"], 200, "{stats}");
    // Emitted late rows are the only events that leave twice.
    let mut counts: BTreeMap<(String, i64), u32> = BTreeMap::new();
    for e in union.iter().chain(&read_events(&output)) {
        *counts.entry((e.event_id.clone(), e.sequence)).or_default() += 1;
    }
    let twice = counts.values().filter(|&&c| c > 1).count();
    assert_eq!(twice, 200 + 50);
}

#[test]
fn state_size_stays_bounded_over_thirty_days() {
    let days = Days::new(1_000, &[1, 2]);
    let state = days.dir.path().join("state");
    let mut sizes = Vec::new();
    for day in 0..30 {
        let output = days.output("month", day);
        let (code, stats, stderr) = run_day(
            &days.input(day),
            p(&output),
            p(&state),
            &["--retention", "3d", "-q"],
        );
        assert_eq!(code, Some(0), "{stderr}");
        check_counts(&stats);
        assert_eq!(stats["state"]["new_keys"], 1_000, "{stats}");
        sizes.push((
            stats["state"]["keys"].as_u64().expect("keys"),
            stats["state"]["bytes"].as_u64().expect("bytes"),
        ));
        std::fs::remove_file(days.input(day)).expect("rm");
    }
    // After the first days the state holds about four days of keys (the 3-day horizon plus
    // the day in progress), and stays there.
    for &(keys, bytes) in &sizes[5..] {
        assert!((3_000..=4_000).contains(&keys), "{sizes:?}");
        assert!(bytes < keys * 48, "{sizes:?}");
    }
    let objects = walk(&state);
    assert!(objects.len() <= 16 + 6 + 11, "{objects:?}");
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).expect("read_dir") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            found.extend(walk(&path));
        } else {
            found.push(path);
        }
    }
    found
}

#[test]
fn a_bad_time_column_fails_before_anything_is_written() {
    let days = Days::new(100, &[]);
    let state = days.dir.path().join("state");
    let output = days.output("bad", 0);
    let run = idem()
        .args([
            "dedup",
            p(&days.input(0)),
            "-o",
            p(&output),
            "--state",
            p(&state),
        ])
        .args(["--time-column", "payload", "--retention", "1d"])
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("payload") && stderr.contains("day-00.parquet"),
        "{stderr}"
    );
    assert!(!output.exists());
    assert!(walk(&state).is_empty(), "{:?}", walk(&state));
    let run = idem()
        .args([
            "dedup",
            p(&days.input(0)),
            "-o",
            p(&output),
            "--state",
            p(&state),
        ])
        .args(["--time-column", "event_time"])
        .output()
        .expect("run");
    assert_eq!(run.status.code(), Some(2), "usage error");
    assert!(String::from_utf8_lossy(&run.stderr).contains("--retention"));
}

#[cfg(feature = "cloud")]
#[test]
fn state_on_s3_decides_like_a_local_state() {
    let Some(prefix) = common::s3_prefix("state") else {
        return;
    };
    let days = Days::new(1_000, &[1, 2]);
    let local = days.dir.path().join("state");
    let remote = format!("{prefix}/state");
    for day in 0..4 {
        let (code, local_stats, stderr) = run_day(
            &days.input(day),
            p(&days.output("local", day)),
            p(&local),
            &["--retention", "1d"],
        );
        assert_eq!(code, Some(0), "{stderr}");
        let (code, remote_stats, stderr) = run_day(
            &days.input(day),
            p(&days.output("remote", day)),
            &remote,
            &["--retention", "1d"],
        );
        assert_eq!(code, Some(0), "{stderr}");
        check_counts(&remote_stats);
        for key in [
            "new_keys",
            "seen_before",
            "late",
            "expired",
            "keys",
            "version",
        ] {
            assert_eq!(
                local_stats["state"][key], remote_stats["state"][key],
                "{key}: {local_stats} vs {remote_stats}"
            );
        }
        assert_eq!(
            std::fs::read(days.output("local", day)).expect("local"),
            std::fs::read(days.output("remote", day)).expect("remote"),
        );
    }
    let (code, stats, stderr) = run_day(
        &days.input(3),
        p(&days.output("remote", 3)),
        &remote,
        &["--retention", "1d"],
    );
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(stats["state"]["already_applied"], true, "{stats}");
}

/// A row of (event_id, sequence, lsn, day of its event time, op).
type OpRow = (&'static str, i64, i64, i64, &'static str);

fn write_ops(path: &Path, rows: &[OpRow]) {
    let columns: Vec<(&str, ArrayRef)> = vec![
        (
            "event_id",
            Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.0))),
        ),
        (
            "sequence",
            Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.1))),
        ),
        (
            "lsn",
            Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.2))),
        ),
        (
            "event_time",
            Arc::new(
                TimestampMicrosecondArray::from_iter_values(rows.iter().map(|r| START + r.3 * DAY))
                    .with_timezone("UTC"),
            ),
        ),
        (
            "op",
            Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.4))),
        ),
    ];
    let batch = RecordBatch::try_from_iter(columns).expect("batch");
    let file = std::fs::File::create(path).expect("create");
    let mut writer = ArrowWriter::try_new(file, batch.schema(), None).expect("writer");
    writer.write(&batch).expect("write");
    writer.close().expect("close");
}

#[test]
fn updates_and_deletes_of_emitted_keys_are_emitted_once_and_stale_ones_are_not() {
    let dir = TempDir::new().expect("tmp");
    let state = dir.path().join("state");
    let days: [&[OpRow]; 3] = [
        &[("a", 1, 1, 0, "c"), ("b", 1, 1, 0, "c")],
        // a updated; b replayed and deleted in one batch (the delete wins); c deleted
        // before it was ever emitted.
        &[
            ("a", 1, 2, 1, "u"),
            ("b", 1, 1, 0, "c"),
            ("b", 1, 2, 1, "d"),
            ("c", 1, 5, 1, "d"),
        ],
        // Stale: a's first version, c older than its delete. New: b re-inserted.
        &[
            ("a", 1, 1, 0, "c"),
            ("c", 1, 4, 1, "c"),
            ("b", 1, 3, 2, "c"),
        ],
    ];
    let mut emitted = Vec::new();
    let mut counts = Vec::new();
    for (day, rows) in days.iter().enumerate() {
        let input = dir.path().join(format!("day-{day}.parquet"));
        write_ops(&input, rows);
        let output = dir.path().join(format!("out-{day}.parquet"));
        let (code, stats, stderr) = run_day(
            &input,
            p(&output),
            p(&state),
            &["--retention", "30d", "--op", "op"],
        );
        assert_eq!(code, Some(0), "{stderr}");
        check_counts(&stats);
        let s = |k: &str| stats["state"][k].as_u64().expect("count");
        counts.push([
            s("new_keys"),
            s("updated"),
            s("seen_before"),
            s("deletes_emitted"),
            s("deletes_recorded"),
        ]);
        let out = read_events(&output);
        emitted.extend(out.into_iter().map(|e| (day, e.event_id, e.lsn)));
    }
    // [new, updated, seen before, deletes emitted, deletes recorded] per day.
    assert_eq!(
        counts,
        vec![[2, 0, 0, 0, 0], [0, 2, 0, 1, 1], [0, 1, 2, 0, 0]]
    );
    let emitted: Vec<(usize, &str, i64)> = emitted
        .iter()
        .map(|(day, id, lsn)| (*day, id.as_str(), *lsn))
        .collect();
    assert_eq!(
        emitted,
        vec![
            (0, "a", 1),
            (0, "b", 1),
            (1, "a", 2),
            (1, "b", 2),
            (2, "b", 3)
        ]
    );
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read_dir") {
        let path = entry.expect("entry").path();
        let target = to.join(path.file_name().expect("name"));
        if path.is_dir() {
            copy_dir(&path, &target);
        } else {
            std::fs::copy(&path, &target).expect("copy");
        }
    }
}

fn manifest_versions(state: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(state.join("_manifest"))
        .map(|entries| {
            entries
                .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".json"))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

#[test]
fn a_run_killed_at_any_moment_never_leaves_state_without_its_output() {
    let days = Days::new(40_000, &[1]);
    let base = days.dir.path().join("base");
    let (code, _, stderr) = run_day(
        &days.input(0),
        p(&days.output("base", 0)),
        p(&base),
        &["--retention", "7d", "-q"],
    );
    assert_eq!(code, Some(0), "{stderr}");
    // The uninterrupted run of day 1, for reference.
    let reference_state = days.dir.path().join("reference");
    copy_dir(&base, &reference_state);
    let reference = days.output("reference", 1);
    let started = std::time::Instant::now();
    let (code, _, stderr) = run_day(
        &days.input(1),
        p(&reference),
        p(&reference_state),
        &["--retention", "7d", "-q"],
    );
    assert_eq!(code, Some(0), "{stderr}");
    let full_run = started.elapsed().as_micros() as u64;
    let expected = std::fs::read(&reference).expect("reference");
    let before = manifest_versions(&base);

    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut outcomes = [0u32; 3];
    for attempt in 0..12 {
        let state = days.dir.path().join(format!("killed-{attempt}"));
        copy_dir(&base, &state);
        let output = days.output("killed", attempt);
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let delay = (seed >> 33) % (full_run + full_run / 4).max(1);
        let mut child = idem()
            .args([
                "dedup",
                p(&days.input(1)),
                "-o",
                p(&output),
                "--state",
                p(&state),
            ])
            .args(["--time-column", "event_time", "--retention", "7d", "-q"])
            .spawn()
            .expect("spawn");
        std::thread::sleep(std::time::Duration::from_micros(delay));
        let _ = child.kill();
        let _ = child.wait();
        let committed = manifest_versions(&state) != before;
        match (committed, output.exists()) {
            (true, true) => outcomes[2] += 1,
            (false, true) => outcomes[1] += 1,
            (false, false) => outcomes[0] += 1,
            (true, false) => panic!("attempt {attempt}: state committed without its output"),
        }
        if output.exists() {
            assert_eq!(
                std::fs::read(&output).expect("output"),
                expected,
                "attempt {attempt}"
            );
        }
        // A re-run completes it: the same output, the state recorded once.
        let (code, stats, stderr) = run_day(
            &days.input(1),
            p(&output),
            p(&state),
            &["--retention", "7d", "-q"],
        );
        assert_eq!(code, Some(0), "{stderr}");
        assert_eq!(
            std::fs::read(&output).expect("output"),
            expected,
            "attempt {attempt}: {stats}"
        );
        assert_eq!(
            manifest_versions(&state).len(),
            before.len() + 1,
            "attempt {attempt}"
        );
    }
    eprintln!(
        "killed runs: {} before output, {} between output and state, {} after both",
        outcomes[0], outcomes[1], outcomes[2]
    );
}
