"""Wall time and peak memory of idem against its peers on the same files and job.

Every engine keeps, per key, the row with the greatest version and writes the result as
zstd Parquet; the two floor engines copy every row with no dedup. Engines run
alternately, each run a separate process measured with wait4 (so peak RSS is that
process's own), for several rounds. After the rounds, every engine's last output is read
back with DuckDB: row count and an order-independent checksum of all columns (each value
as text, in column-name order, hashed; summed over rows) must equal idem's.

  idem                `idem dedup` (two passes, late materialisation)
  idem-sql            `idem sql` with the dedup() table function (DedupExec in DataFusion)
  df-distinct-on      DataFusion (same binary): SELECT DISTINCT ON (...) ... ORDER BY ... DESC
  df-row-number       DataFusion: row_number() OVER (PARTITION BY ... ORDER BY ... DESC) = 1
  duckdb-qualify      DuckDB: QUALIFY row_number() OVER (...) = 1      (threads = 2)
  duckdb-arg-max      DuckDB: arg_max(row, version) GROUP BY key
  duckdb-distinct-on  DuckDB: DISTINCT ON (key) ... ORDER BY key, version DESC
  polars-unique       Polars: sort by version descending, unique(key, keep='first')
  polars-group-by     Polars: group_by(key).agg(all().sort_by(version).last())
  floor-idem          I/O floor: idem's reader and writer copying every row
                      (crates/idem/examples/copy.rs; give its binary with --copy)
  floor-duckdb        I/O floor: DuckDB COPY (SELECT * FROM read_parquet(...)) TO ...

Before every run the input files are read through once, so that every engine starts with
them in the page cache: on the VMs this is measured on, the host reclaims cached pages
between runs, and an engine that happened to find part of its input evicted waited on the
disk for it (100 % iowait on both cores for 0.45 s of a 10M run, seen with /proc/stat).

After every run its output's files and directories are synced (fsync), and that time is
kept apart from the run's. idem syncs its output before it publishes it, so that a crash
cannot leave a file that is named but not on the disk; DuckDB and Polars leave theirs in
the page cache, and the suite used to delete it before the kernel wrote it back, so their
writes never reached the disk at all. The sync makes every engine pay for the same end
state, and keeps one engine's write-back out of the next engine's run.

The table gives wall median (min-max), CPU seconds (median), the largest peak RSS, the
size of the last round's output, rows out, the ratio to the first engine and to the faster
I/O floor, and the paired ratio (see `paired`), all of the run alone; then the median time
of the sync after it, and the two ratios to the first engine of the run and sync together
("durable": the wall time until the output is on the disk).

Usage:
  python benches/peers.py IDEM_BINARY INPUT_DIR [--copy COPY_BINARY] [--sql-binary BINARY]
                          [--rounds N]
                          [--engines a,b,...] [--key event_id,sequence] [--version lsn]
                          [--memory-limit SIZE] [--timeout SECONDS]

A run that fails (out of memory, timeout, error) is reported as such, and its engine is
not run again.
"""

import argparse
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

DUCKDB = """
import duckdb, sys
inputs, out, keys, version, variant = sys.argv[1:6]
con = duckdb.connect()
con.execute("SET threads = 2")
source = f"read_parquet('{inputs}/*.parquet')"
query = {
    "qualify": f"SELECT * FROM {source} "
               f"QUALIFY row_number() OVER (PARTITION BY {keys} ORDER BY {version} DESC) = 1",
    "arg-max": f"SELECT unnest(winner) FROM (SELECT arg_max(t, {version}) AS winner "
               f"FROM {source} t GROUP BY {keys})",
    "distinct-on": f"SELECT DISTINCT ON ({keys}) * FROM {source} ORDER BY {keys}, {version} DESC",
    "copy": f"SELECT * FROM {source}",
}[variant]
con.execute(f"COPY ({query}) TO '{out}' (FORMAT parquet, COMPRESSION zstd)")
"""

POLARS = """
import polars as pl, sys
inputs, out, keys, version, variant = sys.argv[1:6]
keys = keys.split(",")
frame = pl.scan_parquet(f"{inputs}/*.parquet")
if variant == "unique":
    frame = frame.sort(version, descending=True).unique(subset=keys, keep="first")
else:
    frame = frame.group_by(keys).agg(pl.all().sort_by(version).last())
frame.sink_parquet(out, compression="zstd")
"""

CHECKSUM = """
import duckdb, os, sys
con = duckdb.connect()
con.execute("SET threads = 2")
con.execute("SET enable_progress_bar = false")
for path in sys.argv[1:]:
    source = f"read_parquet('{path}/*.parquet')" if os.path.isdir(path) else f"read_parquet('{path}')"
    names = sorted(r[0] for r in con.execute(f"DESCRIBE SELECT * FROM {source}").fetchall())
    # A null is chr(0), which no text value here holds.
    row = " || '|' || ".join(f'coalesce(CAST("{n}" AS VARCHAR), chr(0))' for n in names)
    count, total = con.execute(
        f"SELECT count(*), sum(hash({row})::HUGEINT) FROM {source}").fetchone()
    print("checksum", path, count, total)
"""


def commands(idem, copy, inputs, out, keys, version):
    files = f"'{inputs}/*.parquet'"
    python = [sys.executable, "-c"]
    args = [inputs, out, keys, version]
    return {
        "idem": [idem, "dedup", inputs, "-o", out, "-q", "--key", keys, "--version", version],
        "idem-sql": [idem, "sql", f"SELECT * FROM dedup('{inputs}', '{keys}', '{version}')",
                     "-o", out],
        "df-distinct-on": [idem, "sql", f"SELECT DISTINCT ON ({keys}) * FROM {files} "
                           f"ORDER BY {keys}, {version} DESC", "-o", out],
        "df-row-number": [idem, "sql", "SELECT * EXCLUDE (idem_rn) FROM (SELECT *, row_number() "
                          f"OVER (PARTITION BY {keys} ORDER BY {version} DESC) AS idem_rn "
                          f"FROM {files}) WHERE idem_rn = 1", "-o", out],
        "duckdb-qualify": python + [DUCKDB] + args + ["qualify"],
        "duckdb-arg-max": python + [DUCKDB] + args + ["arg-max"],
        "duckdb-distinct-on": python + [DUCKDB] + args + ["distinct-on"],
        "polars-unique": python + [POLARS] + args + ["unique"],
        "polars-group-by": python + [POLARS] + args + ["group-by"],
        "floor-idem": [copy, inputs, out] if copy else None,
        "floor-duckdb": python + [DUCKDB] + args + ["copy"],
    }


def available(engine, copy):
    if engine == "floor-idem":
        return copy is not None
    module = engine.split("-")[0] if engine.startswith(("duckdb", "polars")) else None
    return module is None or importlib.util.find_spec(module) is not None


def measure(argv, timeout):
    """(wall s, cpu s, peak RSS MiB, failure or None) of one run.

    The run is launched by GNU time, not forked from this process: Linux carries a parent's
    peak RSS over into a forked child's `ru_maxrss` (through exec), so a contender forked
    from a Python holding a few hundred MiB would never report less than that."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as usage:
        started = time.monotonic()
        process = subprocess.Popen(["/usr/bin/time", "-f", "%U %S %M", "-o", usage.name, *argv],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        timer = threading.Timer(timeout, lambda: os.killpg(process.pid, 9))
        timer.start()
        stderr = process.stderr.read().decode()
        status = process.wait()
        timer.cancel()
        wall = time.monotonic() - started
        process.stderr.close()
        lines = usage.read().split("\n")
    figures = [line for line in lines if re.fullmatch(r"[0-9.]+ [0-9.]+ [0-9]+", line)]
    user, system, kib = figures[-1].split() if figures else (0, 0, 0)
    signalled = next((line for line in lines if "terminated by signal" in line), None)
    failure = None
    if signalled or status < 0:
        signal = int(signalled.split()[-1]) if signalled else -status
        failure = (f"timed out after {timeout} s" if wall >= timeout
                   else f"killed by signal {signal}" + (" (out of memory)" if signal == 9 else ""))
    elif status != 0:
        failure = f"exit {status}: {stderr.strip()[-200:]}"
    return wall, float(user) + float(system), int(kib) / 1024, failure


def files_of(path):
    """The files of an input or output: `path` itself, or every file under the directory."""
    if os.path.isfile(path):
        return [path]
    return [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]


def sync_output(path):
    """Seconds to sync an output (a file or a directory of part files) to the disk: its
    files, its directories and the directory that names it."""
    started = time.monotonic()
    if not os.path.exists(path):
        return 0.0
    directories = [] if os.path.isfile(path) else [root for root, _, _ in os.walk(path)]
    for name in files_of(path) + directories + [os.path.dirname(path)]:
        descriptor = os.open(name, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
    return time.monotonic() - started


def warm(inputs):
    """Reads every file under `inputs` once, to put it in the page cache (see the docs)."""
    for path in files_of(inputs):
        with open(path, "rb", buffering=0) as f:
            while f.read(1 << 22):
                pass


def checksums(paths):
    """{path: (rows, checksum)} of Parquet outputs, read back with DuckDB."""
    if not paths or importlib.util.find_spec("duckdb") is None:
        return {}
    result = subprocess.run([sys.executable, "-c", CHECKSUM, *paths],
                            capture_output=True, text=True)
    if result.returncode != 0:
        print(f"checksums failed: {result.stderr.strip()[-500:]}", file=sys.stderr)
    sums = {}
    for line in result.stdout.splitlines():
        if line.startswith("checksum "):
            path, rows, total = line[len("checksum "):].rsplit(" ", 2)
            sums[path] = (int(rows), total)
    return sums


def output_bytes(path):
    """Bytes of an output, a file or a directory of part files."""
    return sum(os.path.getsize(name) for name in files_of(path))


def paired(runs, base_runs):
    """The median over rounds of this engine's time (`runs`, one per round) over the base
    engine's in the same round (`base_runs`). The machine's speed drifts over minutes; a
    round's two runs are seconds apart, so their ratio drifts less than the ratio of the
    two medians (the `x` column), which can pair a slow stretch of one engine with a fast
    stretch of the other."""
    if len(runs) != len(base_runs) or not runs:
        return float("nan")
    return statistics.median(w / b for w, b in zip(runs, base_runs))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("idem")
    parser.add_argument("inputs")
    parser.add_argument("--copy", help="binary of crates/idem/examples/copy.rs (floor-idem)")
    parser.add_argument("--sql-binary", help="idem binary with the `sql` feature for idem-sql "
                        "and df-* (default: IDEM_BINARY)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", default="idem,idem-sql,df-row-number,duckdb-qualify,"
                        "duckdb-arg-max,duckdb-distinct-on,polars-unique,polars-group-by,"
                        "floor-idem,floor-duckdb")
    parser.add_argument("--key", default="event_id,sequence")
    parser.add_argument("--version", default="lsn")
    parser.add_argument("--memory-limit", help="DataFusion memory pool for the SQL engines")
    parser.add_argument("--timeout", type=float, default=900, help="seconds before a run is killed")
    args = parser.parse_args()
    engines = [e for e in args.engines.split(",") if available(e, args.copy)]
    results = {e: [] for e in engines}
    with tempfile.TemporaryDirectory(dir=os.environ.get("IDEM_BENCH_TMP")) as out:
        failed = {}
        for round_ in range(args.rounds):
            last = round_ == args.rounds - 1
            for engine in engines:
                if engine in failed:
                    continue
                target = f"{out}/{engine}.parquet"
                if os.path.isdir(target):
                    subprocess.run(["rm", "-rf", target], check=True)
                elif os.path.exists(target):
                    os.remove(target)
                binary = (args.sql_binary or args.idem) if engine.startswith(("idem-sql", "df-")) \
                    else args.idem
                argv = commands(binary, args.copy, args.inputs, target, args.key,
                                args.version)[engine]
                if args.memory_limit and engine.startswith(("idem-sql", "df-")):
                    argv += ["--memory-limit", args.memory_limit]
                warm(args.inputs)
                wall, cpu, rss, failure = measure(argv, args.timeout)
                if failure:
                    failed[engine] = (wall, rss, failure)
                    continue
                results[engine].append((wall, cpu, rss, sync_output(target)))
                # Keep the outputs of the last round for the checksums, and only those:
                # a 40M-row run writes gigabytes per engine.
                if not last and os.path.isdir(target):
                    subprocess.run(["rm", "-rf", target], check=True)
                elif not last and os.path.exists(target):
                    os.remove(target)
        # The measurements first, so that nothing is lost if reading the outputs fails.
        for engine, runs in results.items():
            print(engine, " ".join(f"{w:.2f}s/{c:.1f}cpu/{r:.0f}MiB/{y:.2f}sync"
                                   for w, c, r, y in runs),
                  failed.get(engine, ""), flush=True)
        outputs = {e: f"{out}/{e}.parquet" for e in engines if results[e]}
        sizes = {e: output_bytes(path) for e, path in outputs.items()}
        sums = checksums(list(outputs.values()))
    rows = {e: sums.get(path, (None, None)) for e, path in outputs.items()}
    reference = rows.get(engines[0], (None, None))
    floors = [statistics.median(w for w, _, _, _ in results[e])
              for e in ("floor-idem", "floor-duckdb") if results.get(e)]
    floor = min(floors) if floors else None
    base_runs = results[engines[0]]
    base_walls = [w for w, _, _, _ in base_runs]
    base = statistics.median(base_walls)
    base_durable = [w + y for w, _, _, y in base_runs]
    print(f"{args.inputs}, {args.rounds} rounds")
    print(f"{'engine':19} {'wall median (min-max) s':>25} {'cpu s':>7} {'peak RSS MiB':>13} "
          f"{'output MB':>10} {'rows out':>11} {'same rows':>9} {'x ' + engines[0]:>8} {'x floor':>8} "
          f"{'x paired':>8} {'sync s':>7} {'x durable':>9} {'x dur. paired':>13}")
    for engine, runs in results.items():
        if not runs:
            wall, rss, failure = failed[engine]
            print(f"{engine:19} failed after {wall:.0f} s at {rss:.0f} MiB peak RSS: {failure}")
            continue
        walls = [w for w, _, _, _ in runs]
        durable = [w + y for w, _, _, y in runs]
        median = statistics.median(walls)
        count, total = rows[engine]
        same = ("-" if engine.startswith("floor") or count is None
                else "yes" if (count, total) == reference else "NO")
        print(f"{engine:19} {median:>9.2f} ({min(walls):6.2f}-{max(walls):6.2f}) "
              f"{statistics.median(c for _, c, _, _ in runs):>7.1f} "
              f"{max(r for _, _, r, _ in runs):>13.0f} "
              f"{sizes[engine] / 1e6:>10.1f} {count if count is not None else '?':>11} "
              f"{same:>9} {median / base:>8.2f} "
              f"{median / floor if floor else float('nan'):>8.2f} "
              f"{paired(walls, base_walls):>8.2f} "
              f"{statistics.median(y for _, _, _, y in runs):>7.2f} "
              f"{statistics.median(durable) / statistics.median(base_durable):>9.2f} "
              f"{paired(durable, base_durable):>13.2f}")
    if any(rows[e] != reference for e in outputs if not e.startswith("floor")):
        print("ERROR: engines disagree on the rows (count or checksum)")
        sys.exit(1)


if __name__ == "__main__":
    main()
