"""Wall time and peak memory of `idem dedup` against DuckDB on the same files.

Runs idem and DuckDB's fastest usual formulation (QUALIFY row_number() = 1, 2 threads,
COPY to zstd Parquet) alternately, several rounds, and prints medians and ratios. Each run
is a separate process measured with wait4, so peak RSS is that process's own.

Usage: python benches/dedup_vs_duckdb.py IDEM_BINARY INPUT_DIR [ROUNDS]
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time

DUCKDB = """
import duckdb, sys
con = duckdb.connect()
con.execute("SET threads = 2")
con.execute(f'''COPY (
    SELECT * FROM read_parquet('{sys.argv[1]}/*.parquet')
    QUALIFY row_number() OVER (PARTITION BY event_id, sequence ORDER BY lsn DESC) = 1
) TO '{sys.argv[2]}' (FORMAT parquet, COMPRESSION zstd)''')
"""


def measure(argv):
    started = time.monotonic()
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.monotonic() - started
    stderr = process.stderr.read().decode()
    process.stderr.close()
    if status != 0:
        raise SystemExit(f"{argv[0]} failed: {stderr}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def main():
    idem, inputs = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    results = {"idem": [], "duckdb": []}
    with tempfile.TemporaryDirectory() as out:
        for _ in range(rounds):
            results["idem"].append(measure([idem, "dedup", inputs, "-o", f"{out}/idem.parquet", "-q"]))
            results["duckdb"].append(measure([sys.executable, "-c", DUCKDB, inputs, f"{out}/duckdb.parquet"]))
    base = statistics.median(w for w, _, _ in results["idem"])
    print(f"{'tool':8} {'wall median (min-max) s':>26} {'cpu s':>7} {'peak RSS MiB':>13} {'ratio':>6}")
    for tool, runs in results.items():
        walls = [w for w, _, _ in runs]
        median = statistics.median(walls)
        print(f"{tool:8} {median:>10.2f} ({min(walls):.2f}-{max(walls):.2f}){'':>6} "
              f"{statistics.median(c for _, c, _ in runs):>7.1f} {max(r for _, _, r in runs):>13.0f} "
              f"{median / base:>6.2f}")


if __name__ == "__main__":
    main()
