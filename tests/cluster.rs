//! End-to-end tests of `idem dedup --cluster`: a scheduler and two executors, each its own
//! process of the binary (`idem cluster scheduler|executor`, Ballista with idem's codecs),
//! on loopback ports; the dedup is a third process, the client.
#![cfg(feature = "ballista")]

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use std::sync::Arc;

use arrow::array::{ArrayRef, AsArray, Int64Array, RecordBatch, StringArray};
use arrow::compute::{SortColumn, lexsort_to_indices, take_record_batch};
use parquet::arrow::ArrowWriter;
use parquet::file::reader::{FileReader, SerializedFileReader};
use serde_json::Value;
use tempfile::TempDir;

mod common;
use common::{idem, p, read_parquet};

/// The cluster's processes, killed when dropped.
struct Cluster {
    url: String,
    scheduler: Child,
    executors: Vec<Child>,
    work_dirs: Vec<PathBuf>,
    /// The processes' stderr, shown when a test fails.
    logs: Vec<PathBuf>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for child in self.executors.iter_mut().chain([&mut self.scheduler]) {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            for log in &self.logs {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                eprintln!("--- {}:\n{text}", log.display());
            }
        }
    }
}

fn log_file(path: &Path) -> Stdio {
    Stdio::from(std::fs::File::create(path).expect("log file"))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A scheduler (declaring an executor lost after `executor_timeout`) and `executors`
/// executors of one task each, with their shuffle files under `dir`.
fn start_cluster(dir: &Path, executors: usize, executor_timeout: &str) -> Cluster {
    let mut scheduler = idem()
        .args(["cluster", "scheduler", "--bind", "127.0.0.1:0"])
        .args(["--executor-timeout", executor_timeout])
        .stdout(Stdio::piped())
        .stderr(log_file(&dir.join("scheduler.log")))
        .spawn()
        .expect("scheduler");
    let mut line = String::new();
    BufReader::new(scheduler.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("the scheduler's address");
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("scheduler said {line:?}"))
        .to_owned();
    let mut cluster = Cluster {
        url,
        scheduler,
        executors: Vec::new(),
        work_dirs: Vec::new(),
        logs: vec![dir.join("scheduler.log")],
    };
    for n in 0..executors {
        let work_dir = dir.join(format!("executor-{n}"));
        std::fs::create_dir_all(&work_dir).expect("work dir");
        let executor = idem()
            .args(["cluster", "executor", "--scheduler", &cluster.url])
            .args(["--port", &free_port().to_string()])
            .args(["--grpc-port", &free_port().to_string()])
            .args(["--concurrent-tasks", "1", "--work-dir", p(&work_dir)])
            .stdout(Stdio::null())
            .stderr(log_file(&dir.join(format!("executor-{n}.log"))))
            .spawn()
            .expect("executor");
        cluster.executors.push(executor);
        cluster.logs.push(dir.join(format!("executor-{n}.log")));
        cluster.work_dirs.push(work_dir);
    }
    cluster
}

/// `idem dedup ARGS --stats -`: success and its stats, or failure and its stderr.
fn dedup(args: &[&str]) -> Result<Value, String> {
    let output = idem()
        .arg("dedup")
        .args(args)
        .args(["--stats", "-", "--quiet"])
        .output()
        .expect("run");
    if output.status.success() {
        Ok(serde_json::from_slice(&output.stdout).expect("stats JSON"))
    } else {
        Err(String::from_utf8_lossy(&output.stderr).into_owned())
    }
}

fn part_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("output directory")
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    files
}

/// The bytes of each part of a directory output, in name order.
/// Each column's encodings over every row group of a directory's parts, by column name.
fn column_encodings(dir: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut encodings: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for part in part_files(dir) {
        let file = std::fs::File::open(&part).expect("part");
        let reader = SerializedFileReader::new(file).expect("parquet");
        for group in reader.metadata().row_groups() {
            for column in group.columns() {
                encodings
                    .entry(column.column_path().string())
                    .or_default()
                    .extend(column.encodings().map(|e| format!("{e:?}")));
            }
        }
    }
    encodings
}

fn part_bytes(dir: &Path) -> Vec<Vec<u8>> {
    part_files(dir)
        .iter()
        .map(|f| std::fs::read(f).expect("part"))
        .collect()
}

/// Every row of a directory of parts, sorted by the key: the same set of rows in any
/// layout compares equal.
fn sorted_rows(dir: &Path) -> RecordBatch {
    let all = read_parquet(&part_files(dir));
    let key = |name: &str| SortColumn {
        values: Arc::clone(all.column_by_name(name).expect("key column")),
        options: None,
    };
    let order = lexsort_to_indices(&[key("event_id"), key("sequence")], None).expect("sort");
    take_record_batch(&all, &order).expect("take")
}

fn counts(stats: &Value) -> Vec<u64> {
    [
        "rows_in",
        "rows_out",
        "duplicates",
        "superseded",
        "deleted",
        "conflicts",
        "null_keys",
        "distinct_keys",
    ]
    .iter()
    .map(|k| {
        stats[k]
            .as_u64()
            .unwrap_or_else(|| panic!("{k} in {stats}"))
    })
    .collect()
}

/// No hidden staging directory is left beside `output`.
fn assert_no_staging(output: &Path) {
    let parent = output.parent().expect("parent");
    let leftovers: Vec<_> = std::fs::read_dir(parent)
        .expect("read_dir")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".idem-"))
        .map(|e| e.path())
        .collect();
    assert!(leftovers.is_empty(), "left behind: {leftovers:?}");
}

/// A dedup of `input` into `output` on the cluster: 4 partitions, parts of 500,000 rows.
fn cluster_args<'a>(input: &'a Path, output: &'a Path, url: &'a str) -> Vec<&'a str> {
    vec![
        p(input),
        "--op",
        "op",
        "-o",
        p(output),
        "--cluster",
        url,
        "--partitions",
        "4",
        "--max-rows-per-file",
        "500000",
    ]
}

/// 2,000,000 generated events in 8 files under `dir/in`.
fn generate_events(dir: &Path) -> PathBuf {
    let input = dir.join("in");
    let generated = idem()
        .args([
            "generate",
            "-o",
            p(&input),
            "--rows",
            "2000000",
            "--files",
            "8",
        ])
        .args(["--payload-bytes", "40"])
        .output()
        .expect("generate");
    assert!(generated.status.success(), "{generated:?}");
    input
}

#[test]
fn a_two_executor_cluster_writes_the_rows_of_a_local_run_in_deterministic_parts() {
    let dir = TempDir::new().expect("tmp");
    let input = generate_events(dir.path());
    let cluster = start_cluster(dir.path(), 2, "10s");

    let local = dir.path().join("local");
    let local_stats = dedup(&[p(&input), "--op", "op", "-o", p(&local)]).expect("local run");
    let first = dir.path().join("first");
    let first_stats = dedup(&cluster_args(&input, &first, &cluster.url)).expect("cluster run");

    assert_eq!(counts(&first_stats), counts(&local_stats), "{first_stats}");
    assert_eq!(first_stats["cluster"]["partitions"], 4);
    assert_eq!(
        first_stats["rows_in"].as_u64(),
        Some(2_000_000),
        "{first_stats}"
    );
    let parts = part_files(&first);
    let names: Vec<String> = parts
        .iter()
        .map(|f| f.file_name().expect("name").to_string_lossy().into_owned())
        .collect();
    let expected: Vec<String> = (0..names.len())
        .map(|n| format!("part-{n:05}.parquet"))
        .collect();
    assert_eq!(names, expected);
    assert!(names.len() >= 4, "{names:?}");
    assert_eq!(
        first_stats["output_files"].as_array().map(Vec::len),
        Some(names.len())
    );
    assert_eq!(sorted_rows(&first), sorted_rows(&local));
    assert_no_staging(&first);
    // The executors write with the client's settings: full dictionaries fall back to the
    // delta encodings there as they do in a local run.
    let encodings = column_encodings(&first);
    assert_eq!(encodings, column_encodings(&local));
    assert!(
        encodings["lsn"].contains("DELTA_BINARY_PACKED"),
        "{encodings:?}"
    );
    assert!(
        encodings["event_id"].contains("DELTA_LENGTH_BYTE_ARRAY"),
        "{encodings:?}"
    );

    // Again, over the first output: the same parts, byte for byte, replacing it whole.
    let before = part_bytes(&first);
    let again_stats = dedup(&cluster_args(&input, &first, &cluster.url)).expect("second run");
    assert_eq!(counts(&again_stats), counts(&first_stats));
    let after = part_bytes(&first);
    assert!(before == after, "a re-run wrote different parts");
    assert_no_staging(&first);

    // Ties between files are decided by input order, as locally: --on-tie first keeps
    // the earlier file's row, last the later one's.
    let ties = dir.path().join("ties");
    std::fs::create_dir(&ties).expect("mkdir");
    for (n, status) in ["early", "late"].iter().enumerate() {
        let ids: Vec<String> = (0..20_000).map(|i| format!("e{i}")).collect();
        let batch = RecordBatch::try_from_iter([
            ("event_id", Arc::new(StringArray::from(ids)) as ArrayRef),
            (
                "sequence",
                Arc::new(Int64Array::from(vec![0; 20_000])) as ArrayRef,
            ),
            (
                "lsn",
                Arc::new(Int64Array::from(vec![7; 20_000])) as ArrayRef,
            ),
            (
                "status",
                Arc::new(StringArray::from(vec![*status; 20_000])) as ArrayRef,
            ),
        ])
        .expect("batch");
        let file = std::fs::File::create(ties.join(format!("batch-{n}.parquet"))).expect("file");
        let mut writer = ArrowWriter::try_new(file, batch.schema(), None).expect("writer");
        writer.write(&batch).expect("write");
        writer.close().expect("close");
    }
    for (policy, kept) in [("first", "early"), ("last", "late")] {
        let out = dir.path().join(format!("ties-{policy}"));
        let stats = dedup(&[
            p(&ties),
            "--on-tie",
            policy,
            "-o",
            p(&out),
            "--cluster",
            &cluster.url,
            "--partitions",
            "3",
        ])
        .expect("ties on the cluster");
        assert_eq!(stats["duplicates"].as_u64(), Some(20_000), "{stats}");
        let rows = sorted_rows(&out);
        let statuses = rows
            .column_by_name("status")
            .and_then(|c| c.as_string_opt::<i32>())
            .expect("status");
        assert!(
            statuses.iter().all(|s| s == Some(kept)),
            "--on-tie {policy}"
        );
        assert_eq!(rows.num_rows(), 20_000);
    }

    // A job that fails on the executors (a conflicting tie under --on-tie error) commits
    // nothing: the previous output stays as it was and no staging is left behind.
    let previous = dir.path().join("ties-first");
    let before = part_bytes(&previous);
    let failed = dedup(&[
        p(&ties),
        "--on-tie",
        "error",
        "-o",
        p(&previous),
        "--cluster",
        &cluster.url,
        "--partitions",
        "3",
    ])
    .expect_err("a conflicting tie");
    assert!(failed.contains("conflicting rows for key"), "{failed}");
    let after = part_bytes(&previous);
    assert!(before == after, "a failed job changed the output");
    assert_no_staging(&previous);

    // What a cluster cannot do is refused before anything runs.
    let refused = dedup(&[
        p(&input),
        "-o",
        p(&dir.path().join("one.parquet")),
        "--cluster",
        &cluster.url,
    ])
    .expect_err("a single-file output");
    assert!(refused.contains("directory of parts"), "{refused}");
    let missing = dedup(&[
        p(&input),
        "--key",
        "no_such_column",
        "-o",
        p(&dir.path().join("bad")),
        "--cluster",
        &cluster.url,
    ])
    .expect_err("a missing key column");
    assert!(
        missing.contains("no_such_column") && missing.contains("events-"),
        "{missing}"
    );
    assert!(!dir.path().join("bad").exists());
    assert_no_staging(&dir.path().join("bad"));
}

#[test]
fn killing_an_executor_mid_job_reruns_its_work_or_fails_without_output() {
    let dir = TempDir::new().expect("tmp");
    let input = generate_events(dir.path());
    let local = dir.path().join("local");
    dedup(&[p(&input), "-o", p(&local)]).expect("local run");

    let mut cluster = start_cluster(dir.path(), 2, "10s");
    let output = dir.path().join("out");
    let mut job = idem()
        .args([
            "dedup",
            p(&input),
            "-o",
            p(&output),
            "--quiet",
            "--stats",
            "-",
        ])
        .args(["--cluster", &cluster.url, "--partitions", "4"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cluster run");
    // Mid-job: the first executor has written shuffle output of the map stage.
    let started = Instant::now();
    let has_shuffle_files = |dir: &Path| {
        walk(dir)
            .iter()
            .any(|f| f.extension().is_some_and(|e| e == "arrow" || e == "data"))
    };
    while !has_shuffle_files(&cluster.work_dirs[0]) {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no shuffle output after 2 minutes"
        );
        if job.try_wait().expect("poll").is_some() {
            let ended = job.wait_with_output().expect("output");
            panic!(
                "the job ended early: {}{}",
                String::from_utf8_lossy(&ended.stdout),
                String::from_utf8_lossy(&ended.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let victim = &mut cluster.executors[0];
    victim.kill().expect("kill");
    victim.wait().expect("reap");

    let deadline = Instant::now() + Duration::from_secs(300);
    let status = loop {
        if let Some(status) = job.try_wait().expect("poll") {
            break status;
        }
        assert!(Instant::now() < deadline, "the job hung after the kill");
        std::thread::sleep(Duration::from_millis(100));
    };
    let finished = job.wait_with_output().expect("output");
    if status.success() {
        eprintln!("executor killed: the job completed on the other executor");
        let stats: Value = serde_json::from_slice(&finished.stdout).expect("stats");
        assert_eq!(stats["rows_in"].as_u64(), Some(2_000_000), "{stats}");
        assert_eq!(sorted_rows(&output), sorted_rows(&local));
    } else {
        let stderr = String::from_utf8_lossy(&finished.stderr);
        eprintln!("executor killed: the job failed: {stderr}");
        assert!(stderr.contains("idem: error"), "{stderr}");
        assert!(!output.exists(), "a failed job committed output");
    }
    assert_no_staging(&output);
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.filter_map(Result::ok) {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else {
                files.push(path);
            }
        }
    }
    files
}

#[cfg(feature = "cloud")]
#[test]
fn a_cluster_reads_and_writes_object_storage_with_credentials_from_its_environment() {
    // The scheduler and executors get the S3 server's endpoint and credentials the way a
    // deployment gives them: in their environment (here, inherited from scripts/test.sh).
    let Some(prefix) = common::s3_prefix("cluster") else {
        return;
    };
    let dir = TempDir::new().expect("tmp");
    let events = format!("{prefix}/events");
    let generated = idem()
        .args([
            "generate", "-o", &events, "--rows", "200000", "--files", "4",
        ])
        .output()
        .expect("generate");
    assert!(generated.status.success(), "{generated:?}");
    let cluster = start_cluster(dir.path(), 2, "10s");

    let out = format!("{prefix}/out");
    let stats = dedup(&[
        &events,
        "--op",
        "op",
        "-o",
        &out,
        "--cluster",
        &cluster.url,
        "--partitions",
        "3",
    ])
    .expect("cluster run on S3");
    let local = dir.path().join("local");
    let local_stats = dedup(&[&events, "--op", "op", "-o", p(&local)]).expect("local run");
    assert_eq!(counts(&stats), counts(&local_stats), "{stats}");
    let files: Vec<&str> = stats["output_files"]
        .as_array()
        .expect("output_files")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(files.len(), 3, "{stats}");
    assert!(files.iter().all(|f| f.starts_with(&out)), "{files:?}");

    // The parts on S3 hold the local run's rows: deduplicated again, nothing changes.
    let back = dir.path().join("back");
    let back_stats = dedup(&[&out, "-o", p(&back)]).expect("read back");
    assert_eq!(back_stats["input_files"].as_u64(), Some(3), "{back_stats}");
    assert_eq!(back_stats["duplicates"].as_u64(), Some(0));
    assert_eq!(back_stats["superseded"].as_u64(), Some(0));
    assert_eq!(sorted_rows(&back), sorted_rows(&local));
}
