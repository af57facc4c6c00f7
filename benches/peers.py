"""Wall time and peak memory of idem against its peers on the same files and job.

Every engine keeps, per (key) group, the row with the greatest version and writes the
result as zstd Parquet. Engines run alternately, each run a separate process measured
with wait4 (so peak RSS is that process's own), for several rounds; the table gives the
median wall time, CPU time, the largest peak RSS, output rows and the ratio to idem.

  idem            `idem dedup` (two passes, late materialisation)
  idem-sql        `idem sql` with the dedup() table function (DedupExec in DataFusion)
  df-distinct-on  DataFusion (same binary): SELECT DISTINCT ON (...) ... ORDER BY ... DESC
  df-row-number   DataFusion: row_number() OVER (PARTITION BY ... ORDER BY ... DESC) = 1
  duckdb          DuckDB: QUALIFY row_number() ... = 1, threads = 2   (if importable)
  polars          Polars: sort by version descending, unique on key  (if importable)

Usage:
  python benches/peers.py IDEM_BINARY INPUT_DIR [--rounds N] [--engines a,b,...]
                          [--key event_id,sequence] [--version lsn]
                          [--memory-limit SIZE] [--timeout SECONDS]

A run that fails (out of memory, timeout, error) is reported as such, and its engine is
not run again.
"""

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

DUCKDB = """
import duckdb, sys
inputs, out, keys, version = sys.argv[1:5]
con = duckdb.connect()
con.execute("SET threads = 2")
con.execute(f'''COPY (
    SELECT * FROM read_parquet('{inputs}/*.parquet')
    QUALIFY row_number() OVER (PARTITION BY {keys} ORDER BY {version} DESC) = 1
) TO '{out}' (FORMAT parquet, COMPRESSION zstd)''')
"""

POLARS = """
import polars as pl, sys
inputs, out, keys, version = sys.argv[1:5]
(pl.scan_parquet(f"{inputs}/*.parquet")
   .sort(version, descending=True)
   .unique(subset=keys.split(","), keep="first")
   .sink_parquet(out, compression="zstd"))
"""


def commands(idem, inputs, out, keys, version):
    files = f"'{inputs}/*.parquet'"
    return {
        "idem": [idem, "dedup", inputs, "-o", out, "-q", "--key", keys, "--version", version],
        "idem-sql": [idem, "sql", f"SELECT * FROM dedup('{inputs}', '{keys}', '{version}')",
                     "-o", out],
        "df-distinct-on": [idem, "sql", f"SELECT DISTINCT ON ({keys}) * FROM {files} "
                           f"ORDER BY {keys}, {version} DESC", "-o", out],
        "df-row-number": [idem, "sql", "SELECT * EXCLUDE (idem_rn) FROM (SELECT *, row_number() "
                          f"OVER (PARTITION BY {keys} ORDER BY {version} DESC) AS idem_rn "
                          f"FROM {files}) WHERE idem_rn = 1", "-o", out],
        "duckdb": [sys.executable, "-c", DUCKDB, inputs, out, keys, version],
        "polars": [sys.executable, "-c", POLARS, inputs, out, keys, version],
    }


def available(engine):
    module = {"duckdb": "duckdb", "polars": "polars"}.get(engine)
    return module is None or importlib.util.find_spec(module) is not None


def measure(argv, timeout):
    """(wall s, cpu s, peak RSS MiB, failure or None) of one run."""
    started = time.monotonic()
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    timer = threading.Timer(timeout, process.kill)
    timer.start()
    _, status, usage = os.wait4(process.pid, 0)
    timer.cancel()
    wall = time.monotonic() - started
    stderr = process.stderr.read().decode()
    process.stderr.close()
    failure = None
    if os.WIFSIGNALED(status):
        signal = os.WTERMSIG(status)
        failure = (f"timed out after {timeout} s" if wall >= timeout
                   else f"killed by signal {signal}" + (" (out of memory)" if signal == 9 else ""))
    elif os.WEXITSTATUS(status) != 0:
        failure = f"exit {os.WEXITSTATUS(status)}: {stderr.strip()[-200:]}"
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, failure


def output_rows(path):
    if importlib.util.find_spec("pyarrow") is None:
        return None
    import pyarrow.parquet as pq
    paths = [os.path.join(path, f) for f in sorted(os.listdir(path))] if os.path.isdir(path) else [path]
    return sum(pq.read_metadata(p).num_rows for p in paths)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("idem")
    parser.add_argument("inputs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", default="idem,idem-sql,df-distinct-on,df-row-number,duckdb,polars")
    parser.add_argument("--key", default="event_id,sequence")
    parser.add_argument("--version", default="lsn")
    parser.add_argument("--memory-limit", help="DataFusion memory pool for the SQL engines")
    parser.add_argument("--timeout", type=float, default=900, help="seconds before a run is killed")
    args = parser.parse_args()
    engines = [e for e in args.engines.split(",") if available(e)]
    results = {e: [] for e in engines}
    rows = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("IDEM_BENCH_TMP")) as out:
        failed = {}
        for _ in range(args.rounds):
            for engine in engines:
                if engine in failed:
                    continue
                target = f"{out}/{engine}.parquet"
                argv = commands(args.idem, args.inputs, target, args.key, args.version)[engine]
                if args.memory_limit and engine.startswith(("idem-sql", "df-")):
                    argv += ["--memory-limit", args.memory_limit]
                wall, cpu, rss, failure = measure(argv, args.timeout)
                if failure:
                    failed[engine] = (wall, rss, failure)
                    continue
                results[engine].append((wall, cpu, rss))
                rows[engine] = output_rows(target)
                if os.path.isdir(target):
                    subprocess.run(["rm", "-rf", target], check=True)
                elif os.path.exists(target):
                    os.remove(target)
    base = statistics.median(w for w, _, _ in results[engines[0]])
    print(f"{args.inputs}, {args.rounds} rounds")
    print(f"{'engine':15} {'wall median (min-max) s':>25} {'cpu s':>7} {'peak RSS MiB':>13} "
          f"{'rows out':>11} {'x ' + engines[0]:>8}")
    for engine, runs in results.items():
        if not runs:
            wall, rss, failure = failed[engine]
            print(f"{engine:15} failed after {wall:.0f} s at {rss:.0f} MiB peak RSS: {failure}")
            continue
        walls = [w for w, _, _ in runs]
        median = statistics.median(walls)
        print(f"{engine:15} {median:>9.2f} ({min(walls):6.2f}-{max(walls):6.2f}) "
              f"{statistics.median(c for _, c, _ in runs):>7.1f} {max(r for _, _, r in runs):>13.0f} "
              f"{rows[engine] if rows[engine] is not None else '?':>11} {median / base:>8.2f}")


if __name__ == "__main__":
    main()
