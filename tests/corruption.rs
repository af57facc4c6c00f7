//! Damaged inputs, states and tables: seeded mutations of the sample files (bit flips
//! anywhere and in footers, truncations, zero-length files, files replaced by
//! directories), of Arrow IPC copies of them, of a small `--state` directory and of a
//! small Delta table. Every run must end with exit 0 (the damage decoded as other valid
//! data) or exit 1 with one line naming what it read — never a panic, a signal or a hang —
//! and a failed run must leave no output behind and the state or table as it was
//! (regression test for the arrow-ipc panic on a corrupt footer schema, issue 60).
//!
//! `IDEM_CORRUPTION_MUTATIONS` (default 2,400) sets how many runs; `IDEM_CORRUPTION_SEED`
//! the seed. Longer searches of the input path: `fuzz/README.md`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tempfile::TempDir;

mod common;
use common::{idem, p};

/// Longest a run on these small files may take before it counts as a hang (debug build,
/// both cores busy with two runs).
const HANG: Duration = Duration::from_secs(120);

/// xorshift64*: a seeded, dependency-free source of mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// One way of damaging a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Damage {
    FlipAnywhere,
    FlipInFooter,
    Truncate,
    Empty,
    Directory,
}

impl Damage {
    fn pick(rng: &mut Rng) -> Self {
        match rng.below(100) {
            0..35 => Self::FlipAnywhere,
            35..75 => Self::FlipInFooter,
            75..95 => Self::Truncate,
            95..98 => Self::Empty,
            _ => Self::Directory,
        }
    }

    /// Writes `original` damaged to `path`.
    fn apply(self, original: &[u8], path: &Path, rng: &mut Rng) {
        let mut bytes = original.to_vec();
        match self {
            Self::FlipAnywhere | Self::FlipInFooter => {
                let window = if self == Self::FlipInFooter {
                    bytes.len().min(2000)
                } else {
                    bytes.len()
                };
                for _ in 0..=rng.below(3) {
                    let at = bytes.len() - 1 - rng.below(window as u64) as usize;
                    bytes[at] ^= 1 << rng.below(8);
                }
            }
            Self::Truncate => bytes.truncate(rng.below(bytes.len() as u64) as usize),
            Self::Empty => bytes.clear(),
            Self::Directory => {
                std::fs::create_dir_all(path.join("nested")).expect("directory");
                return;
            }
        }
        std::fs::write(path, bytes).expect("write damaged copy");
    }
}

/// What the runs came to, per target.
#[derive(Default)]
struct Tally {
    runs: BTreeMap<&'static str, [u64; 2]>,
    failures: Vec<String>,
}

/// Every file below `dir` with its bytes (directories as such), to tell "unchanged".
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Option<Vec<u8>>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                out.insert(path.clone(), None);
                stack.push(path);
            } else {
                out.insert(path.clone(), std::fs::read(&path).ok());
            }
        }
    }
    out
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("dir");
    for entry in std::fs::read_dir(from).expect("read dir").flatten() {
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).expect("copy");
        }
    }
}

/// Files below `dir` (recursively), sorted.
fn files_below(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = snapshot(dir)
        .into_iter()
        .filter(|(_, bytes)| bytes.is_some())
        .map(|(path, _)| path)
        .collect();
    files.sort();
    files
}

/// Runs `command` to its end or to [`HANG`]; `None` when it had to be killed.
fn run(mut command: Command) -> Option<std::process::Output> {
    let mut child = command
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn idem");
    let started = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            return Some(child.wait_with_output().expect("output"));
        }
        if started.elapsed() > HANG {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Checks one run: exit 0, or exit 1 with one line that names `names`. Returns whether
/// it succeeded.
fn judge(what: &str, output: Option<std::process::Output>, names: &str) -> Result<bool, String> {
    let Some(output) = output else {
        return Err(format!("{what}: no end after {HANG:?} (a hang)"));
    };
    let stderr = String::from_utf8_lossy(&output.stderr);
    if stderr.contains("panicked") || stderr.contains("RUST_BACKTRACE") {
        return Err(format!("{what}: panicked:\n{stderr}"));
    }
    match output.status.code() {
        Some(0) => Ok(true),
        Some(1) => {
            let lines: Vec<&str> = stderr.lines().collect();
            if lines.len() != 1 || !lines[0].starts_with("idem: error: ") {
                return Err(format!(
                    "{what}: exit 1 without a one-line error:\n{stderr}"
                ));
            }
            if !lines[0].contains(names) {
                return Err(format!(
                    "{what}: the error does not name {names}: {}",
                    lines[0]
                ));
            }
            Ok(false)
        }
        code => Err(format!(
            "{what}: exit {code:?} (a signal or a panic):\n{stderr}"
        )),
    }
}

/// A target of mutations: original files, and how to run idem on a damaged copy.
struct Target {
    name: &'static str,
    /// The pristine directory (copied fresh for each run).
    pristine: PathBuf,
    /// Files inside it that mutations pick from.
    files: Vec<PathBuf>,
    /// What a run on a copy at `root` does, writing into `out` (an empty directory).
    command: fn(root: &Path, out: &Path) -> Command,
    /// What the error of a failed run must name (a path inside the copy, or the copy).
    names: fn(root: &Path, damaged: &Path) -> PathBuf,
    /// Whether a failed run must leave the copy exactly as it found it.
    must_stay: bool,
}

impl Target {
    /// Input files deduplicated: each failure must name the damaged file.
    fn input(name: &'static str, pristine: PathBuf) -> Self {
        Self {
            name,
            files: files_below(&pristine),
            pristine,
            command: dedup_input,
            names: the_damaged_file,
            must_stay: false,
        }
    }
}

fn dedup_input(root: &Path, out: &Path) -> Command {
    let mut command = idem();
    command.args(["dedup", p(root), "--op", "op", "-q", "-o"]);
    command.arg(out.join("out.parquet"));
    command
}

fn dedup_with_state(root: &Path, out: &Path) -> Command {
    let mut command = idem();
    command.args(["dedup", p(&root.join("batch.parquet")), "--op", "op", "-q"]);
    command.args([
        "--time-column",
        "event_time",
        "--retention",
        "2d",
        "--state",
    ]);
    command.arg(root.join("state"));
    command.arg("-o").arg(out.join("out.parquet"));
    command
}

#[cfg(feature = "delta")]
fn merge_into_table(root: &Path, _out: &Path) -> Command {
    let mut command = idem();
    command.args(["merge", p(&root.join("batch.parquet")), "--op", "op", "-q"]);
    command.arg("--into").arg(root.join("table"));
    command
}

fn the_damaged_file(_root: &Path, damaged: &Path) -> PathBuf {
    damaged.to_path_buf()
}

fn the_copy(root: &Path, _damaged: &Path) -> PathBuf {
    root.to_path_buf()
}

fn write_ipc(from: &Path, to: &Path, stream: bool) {
    let batch = common::read_parquet(&[from.to_path_buf()]);
    let file = std::fs::File::create(to).expect("create");
    if stream {
        let mut writer =
            arrow::ipc::writer::StreamWriter::try_new(file, &batch.schema()).expect("writer");
        for start in (0..batch.num_rows()).step_by(700) {
            let len = 700.min(batch.num_rows() - start);
            writer.write(&batch.slice(start, len)).expect("write");
        }
        writer.finish().expect("finish");
    } else {
        let mut writer =
            arrow::ipc::writer::FileWriter::try_new(file, &batch.schema()).expect("writer");
        writer.write(&batch).expect("write");
        writer.finish().expect("finish");
    }
}

/// The targets, made from the sample data in `dir`.
fn targets(dir: &Path) -> Vec<(Target, u64)> {
    let sample = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/events");
    let first = sample.join("events-00000.parquet");
    let second = sample.join("events-00001.parquet");
    let mut targets = Vec::new();

    let parquet = dir.join("parquet");
    std::fs::create_dir_all(&parquet).expect("dir");
    std::fs::copy(&first, parquet.join("events.parquet")).expect("copy");
    targets.push((Target::input("parquet input", parquet), 40));

    let ipc = dir.join("ipc");
    std::fs::create_dir_all(&ipc).expect("dir");
    write_ipc(&first, &ipc.join("events.arrow"), false);
    write_ipc(&first, &ipc.join("events.arrows"), true);
    targets.push((Target::input("arrow ipc input", ipc), 20));

    // A state written by a first run; the damaged copies meet the second day's batch.
    let state = dir.join("state");
    std::fs::create_dir_all(&state).expect("dir");
    let made = idem()
        .args([
            "dedup",
            p(&first),
            "--op",
            "op",
            "-q",
            "--time-column",
            "event_time",
        ])
        .args(["--retention", "2d", "--state", p(&state.join("state"))])
        .args(["-o", p(&dir.join("state-day-0.parquet"))])
        .output()
        .expect("run");
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    std::fs::copy(&second, state.join("batch.parquet")).expect("copy");
    targets.push((
        Target {
            name: "state directory",
            files: files_below(&state.join("state")),
            pristine: state,
            command: dedup_with_state,
            names: the_copy,
            must_stay: true,
        },
        20,
    ));

    #[cfg(feature = "delta")]
    {
        // A table of two merges (data files, a tombstone file, two log entries).
        let table = dir.join("delta");
        std::fs::create_dir_all(&table).expect("dir");
        for batch in [&first, &second] {
            let made = idem()
                .args(["merge", p(batch), "--op", "op", "-q", "--into"])
                .arg(table.join("table"))
                .output()
                .expect("run");
            assert!(
                made.status.success(),
                "{}",
                String::from_utf8_lossy(&made.stderr)
            );
        }
        std::fs::copy(
            sample.join("events-00002.parquet"),
            table.join("batch.parquet"),
        )
        .expect("copy");
        targets.push((
            Target {
                name: "delta table",
                files: files_below(&table.join("table")),
                pristine: table,
                command: merge_into_table,
                names: the_copy,
                must_stay: true,
            },
            20,
        ));
    }
    targets
}

#[test]
fn damaged_inputs_states_and_tables_fail_cleanly_or_read_as_data() {
    let runs: u64 = std::env::var("IDEM_CORRUPTION_MUTATIONS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(2400);
    let seed: u64 = std::env::var("IDEM_CORRUPTION_SEED")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0x1de5_2026);
    let dir = TempDir::new().expect("tempdir");
    let targets = targets(dir.path());
    let shares: u64 = targets.iter().map(|(_, share)| share).sum();
    // The plan, fixed by the seed before any run: (target, file, damage, mutation seed).
    let mut rng = Rng(seed | 1);
    let plan: Vec<(usize, usize, Damage, u64)> = (0..runs)
        .map(|_| {
            let mut pick = rng.below(shares);
            let target = targets
                .iter()
                .position(|(_, share)| {
                    let here = pick < *share;
                    pick = pick.saturating_sub(*share);
                    here
                })
                .unwrap_or(0);
            let file = rng.below(targets[target].0.files.len() as u64) as usize;
            (target, file, Damage::pick(&mut rng), rng.next())
        })
        .collect();
    let tally = Mutex::new(Tally::default());
    let next = Mutex::new(0usize);
    let workers = 2;
    std::thread::scope(|scope| {
        for worker in 0..workers {
            let (targets, plan, tally, next) = (&targets, &plan, &tally, &next);
            let base = dir.path().join(format!("worker-{worker}"));
            scope.spawn(move || {
                loop {
                    let index = {
                        let mut next = next.lock().expect("lock");
                        *next += 1;
                        *next - 1
                    };
                    let Some(&(t, f, damage, mutation)) = plan.get(index) else {
                        return;
                    };
                    let target = &targets[t].0;
                    let root = base.join("copy");
                    let out = base.join("out");
                    let _ = std::fs::remove_dir_all(&base);
                    copy_dir(&target.pristine, &root);
                    std::fs::create_dir_all(&out).expect("out");
                    let relative = target.files[f]
                        .strip_prefix(&target.pristine)
                        .expect("inside");
                    let damaged = root.join(relative);
                    let original = std::fs::read(&target.files[f]).expect("read");
                    let _ = std::fs::remove_file(&damaged);
                    damage.apply(&original, &damaged, &mut Rng(mutation | 1));
                    let before = snapshot(&root);
                    let what = format!(
                        "run {index}: {} {} {damage:?} (seed {mutation})",
                        target.name,
                        relative.display()
                    );
                    // A directory in a file's place is no file to name: the copy is.
                    let names = match damage {
                        Damage::Directory => root.clone(),
                        _ => (target.names)(&root, &damaged),
                    };
                    let verdict = judge(
                        &what,
                        run((target.command)(&root, &out)),
                        &names.display().to_string(),
                    )
                    .and_then(|succeeded| {
                        if !succeeded {
                            if std::fs::read_dir(&out).map_or(0, Iterator::count) != 0 {
                                return Err(format!("{what}: failed and left output behind"));
                            }
                            if target.must_stay && snapshot(&root) != before {
                                return Err(format!(
                                    "{what}: failed and changed {}",
                                    root.display()
                                ));
                            }
                        }
                        Ok(succeeded)
                    });
                    let mut tally = tally.lock().expect("lock");
                    match verdict {
                        Ok(succeeded) => {
                            tally.runs.entry(target.name).or_default()[usize::from(succeeded)] += 1;
                        }
                        Err(failure) => tally.failures.push(failure),
                    }
                }
            });
        }
    });
    let tally = tally.into_inner().expect("lock");
    for (name, [refused, accepted]) in &tally.runs {
        eprintln!("{name}: {refused} refused with a one-line error, {accepted} read as valid data");
    }
    assert!(
        tally.failures.is_empty(),
        "{} of {runs} runs failed the contract; the first:\n{}",
        tally.failures.len(),
        tally
            .failures
            .iter()
            .take(5)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    let refused: u64 = tally.runs.values().map(|r| r[0]).sum();
    assert!(
        refused > runs / 4,
        "only {refused} of {runs} damaged copies were refused"
    );
}
