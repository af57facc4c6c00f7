"""`idem merge` of a batch into a large Delta table, against DuckDB doing the same job.

Setup (once, not timed): a table of N distinct events (default 10M) created by
`idem merge`, and a batch of about 1M rows: updates (newer lsn, another status) of every
table row whose event_id sorts below a prefix — about 5 % of the keys, which lie in few of
the table's files since idem writes them sorted by key — and as many new events.

Timed, alternating, each on a fresh copy of the table:
  idem     `idem merge BATCH --into TABLE`: reads the key and version columns of the files
           the batch's keys may be in, rewrites the files holding updated keys, adds the
           new rows, commits
  duckdb   DuckDB (2 threads) computes the same new table state — the batch deduplicated,
           table rows replaced only by strictly newer versions, deletes applied — and
           writes it whole as zstd Parquet (a full rewrite: DuckDB has no Delta writer)

After the rounds, both results are checked to hold the same rows (count and EXCEPT ALL).

Usage: python benches/merge_bench.py IDEM_BINARY WORKDIR [--rows N] [--rounds R]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from peers import measure  # noqa: E402

DUCKDB_REWRITE = """
import duckdb, json, sys
files, batch, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
con = duckdb.connect()
con.execute("SET threads = 2")
con.execute(f'''COPY (
    WITH b AS (
        SELECT * FROM read_parquet('{batch}')
        QUALIFY row_number() OVER (PARTITION BY event_id, sequence ORDER BY lsn DESC) = 1),
    t AS (SELECT * FROM read_parquet({files}))
    SELECT t.* FROM t ANTI JOIN b
        ON t.event_id = b.event_id AND t.sequence = b.sequence AND b.lsn > t.lsn
    UNION ALL
    SELECT b.* FROM b ANTI JOIN t
        ON t.event_id = b.event_id AND t.sequence = b.sequence AND t.lsn >= b.lsn
    WHERE b.op <> 'd'
) TO '{out}' (FORMAT parquet, COMPRESSION zstd)''')
"""


def active_files(table):
    """The data files of the table's latest version, from its JSON log."""
    log = os.path.join(table, "_delta_log")
    active = set()
    for name in sorted(n for n in os.listdir(log) if n.endswith(".json")):
        with open(os.path.join(log, name)) as f:
            for line in f:
                action = json.loads(line)
                if "add" in action:
                    active.add(action["add"]["path"])
                if "remove" in action:
                    active.discard(action["remove"]["path"])
    return sorted(os.path.join(table, p) for p in active)


def run(argv):
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(argv)}:\n{done.stderr}")
    return done.stdout


def setup(idem, work, rows):
    import duckdb
    base, table, batch = f"{work}/base", f"{work}/table", f"{work}/batch.parquet"
    if os.path.exists(batch):
        return table, batch
    run([idem, "generate", "-o", base, "--rows", str(rows), "--files", "10", "--seed", "1",
         "--duplicate-rate", "0", "--update-rate", "0", "--delete-rate", "0", "--reorder-rate", "0"])
    created = json.loads(run([idem, "merge", base, "--into", table, "--stats", "-", "-q"]))
    print(f"table: {created['table_rows']:,} rows in {created['files_added']} files, "
          f"created in {created['elapsed_seconds']:.1f} s")
    run([idem, "generate", "-o", f"{work}/fresh", "--rows", str(rows // 20), "--files", "1",
         "--seed", "2", "--duplicate-rate", "0", "--update-rate", "0", "--delete-rate", "0"])
    con = duckdb.connect()
    files = active_files(table)
    con.execute(f"""COPY (
        SELECT * REPLACE (lsn + 1000000000 AS lsn, 'updated' AS status, 'u' AS op)
        FROM read_parquet({files}) WHERE event_id < '0d'
        UNION ALL
        SELECT * FROM read_parquet('{work}/fresh/*.parquet')
    ) TO '{batch}' (FORMAT parquet, COMPRESSION zstd)""")
    n = con.sql(f"SELECT count(*) FROM read_parquet('{batch}')").fetchall()[0][0]
    print(f"batch: {n:,} rows")
    return table, batch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("idem")
    parser.add_argument("work")
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    table, batch = setup(args.idem, args.work, args.rows)
    files = active_files(table)
    results = {"idem": [], "duckdb": []}
    stats = None
    for _ in range(args.rounds):
        copy = f"{args.work}/run-table"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(table, copy)
        stats_path = f"{args.work}/merge-stats.json"
        wall, cpu, rss, failure = measure(
            [args.idem, "merge", batch, "--into", copy, "--op", "op", "-q", "--stats", stats_path], 3600)
        if failure:
            sys.exit(f"idem: {failure}")
        results["idem"].append((wall, cpu, rss))
        with open(stats_path) as f:
            stats = json.load(f)
        out = f"{args.work}/duckdb-out.parquet"
        wall, cpu, rss, failure = measure(
            [sys.executable, "-c", DUCKDB_REWRITE, json.dumps(files), batch, out], 3600)
        if failure:
            sys.exit(f"duckdb: {failure}")
        results["duckdb"].append((wall, cpu, rss))

    import duckdb
    con = duckdb.connect()
    merged = active_files(f"{args.work}/run-table")
    counts = [con.sql(f"SELECT count(*) FROM read_parquet({q})").fetchall()[0][0]
              for q in (merged, f"'{args.work}/duckdb-out.parquet'")]
    differ = con.sql(f"""SELECT count(*) FROM (
        (SELECT * FROM read_parquet({merged}) EXCEPT ALL SELECT * FROM read_parquet('{args.work}/duckdb-out.parquet'))
        UNION ALL
        (SELECT * FROM read_parquet('{args.work}/duckdb-out.parquet') EXCEPT ALL SELECT * FROM read_parquet({merged})))""").fetchall()[0][0]
    print(f"idem: {stats['updated']:,} updated, {stats['inserted']:,} inserted, "
          f"{stats['files_scanned']} of {stats['table_files']} files scanned, "
          f"{stats['files_removed']} rewritten, {stats['files_added']} added")
    print(f"rows after: idem {counts[0]:,}, duckdb {counts[1]:,}; rows differing: {differ}")
    base = statistics.median(w for w, _, _ in results["idem"])
    print(f"{'engine':8} {'wall median (min-max) s':>25} {'cpu s':>7} {'peak RSS MiB':>13} {'x idem':>7}")
    for engine, runs in results.items():
        walls = [w for w, _, _ in runs]
        median = statistics.median(walls)
        print(f"{engine:8} {median:>9.2f} ({min(walls):6.2f}-{max(walls):6.2f}) "
              f"{statistics.median(c for _, c, _ in runs):>7.1f} {max(r for _, _, r in runs):>13.0f} "
              f"{median / base:>7.2f}")


if __name__ == "__main__":
    main()
