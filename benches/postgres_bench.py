"""`idem merge --into postgres://…` against the hand-written floor and a Python ETL.

Two jobs (data made once by DuckDB, not timed):
  update   a batch of 1M rows into a table of 10M: 450k updates (newer lsn) of keys among
           the first 5 % of the table, 450k new events, 100k in-batch replays (exact
           copies), shuffled
  load     a batch of 10M rows (9M events + 1M replays) into an empty table

Contenders, each on a fresh copy of the database (CREATE DATABASE … TEMPLATE), alternating:
  idem     `idem merge BATCH --into postgres://… --table events`: the batch deduplicated,
           the table's versions of its keys read, one transaction of COPY + guarded upsert
           + tombstones + run marker
  floor    psql: COPY of the already-deduplicated rows (CSV, made by `idem dedup`, not
           timed) into a temporary table, then one INSERT … ON CONFLICT … DO UPDATE … WHERE
           events.lsn < EXCLUDED.lsn — what a careful engineer writes by hand, without the
           dedup, the tombstones, the run marker or the stats
  psycopg  a Python ETL: the raw batch read with pyarrow in pages of 10,000 rows, each page
           sent by psycopg's executemany (pipelined) as the same guarded upsert
and `idem dedup` of the batch, for the peak RSS that a merge's is compared with.

After every run the table's count(*), sum(lsn) and sum(hashtext(payload)) must equal
every other contender's.

Usage: benches/postgres.sh [--rounds R] [--psycopg-rounds R] [--table-rows N] [--batch-rows N]
(which starts a cluster with fsync on and runs: python benches/postgres_bench.py IDEM WORKDIR …)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from peers import measure  # noqa: E402

UPSERT_SET = "lsn = EXCLUDED.lsn, op = EXCLUDED.op, payload = EXCLUDED.payload, amount = EXCLUDED.amount"
CREATE = ("CREATE TABLE events (event_id text, sequence bigint, lsn bigint, op text, payload text, "
          "amount double precision, PRIMARY KEY (event_id, sequence))")


def psql(url, command):
    subprocess.run(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", url, "-c", command],
                   check=True, capture_output=True)


def query(url, command):
    done = subprocess.run(["psql", "-X", "-At", "-v", "ON_ERROR_STOP=1", "-d", url, "-c", command],
                          check=True, capture_output=True, text=True)
    return done.stdout.strip()


def url_of(base, database):
    return base.rsplit("/", 1)[0] + "/" + database


def make_data(work, table_rows, batch_rows):
    import duckdb
    con = duckdb.connect()
    con.execute("SET threads = 2")
    row = ("printf('e%010d', i) AS event_id, 0::BIGINT AS sequence, {lsn} AS lsn, '{op}' AS op, "
           "md5(i::VARCHAR || '{salt}') || '-' || md5(i::VARCHAR) AS payload, (i % 10000) / 100.0 AS amount")
    paths = {name: f"{work}/{name}.parquet" for name in ("base", "update", "load")}
    if all(os.path.exists(p) for p in paths.values()):
        return paths
    con.execute(f"COPY (SELECT {row.format(lsn='1000 + i % 1000', op='c', salt='a')} FROM range({table_rows}) t(i)) "
                f"TO '{paths['base']}' (FORMAT parquet)")
    distinct = batch_rows * 9 // 10
    updates = distinct // 2
    hot = table_rows // 20  # the first 5 % of the keys
    step = max(1, hot // updates)
    con.execute(f"""
        CREATE TABLE batch AS
        SELECT {row.format(lsn='5000 + i % 1000', op='u', salt='b')} FROM range(0, {hot}, {step}) t(i) LIMIT {updates};
        INSERT INTO batch SELECT {row.format(lsn='1000 + i % 1000', op='c', salt='c')}
            FROM range({table_rows}, {table_rows + distinct - updates}) t(i);
        INSERT INTO batch SELECT * FROM batch USING SAMPLE {batch_rows - distinct} ROWS (reservoir, 42);
        COPY (SELECT * FROM batch ORDER BY hash(event_id || random()::VARCHAR)) TO '{paths['update']}' (FORMAT parquet);
        CREATE TABLE big AS SELECT {row.format(lsn='1000 + i % 1000', op='c', salt='d')}
            FROM range({table_rows * 2}, {table_rows * 2 + table_rows * 9 // 10}) t(i);
        INSERT INTO big SELECT * FROM big USING SAMPLE {table_rows - table_rows * 9 // 10} ROWS (reservoir, 43);
        COPY (SELECT * FROM big ORDER BY hash(event_id || random()::VARCHAR)) TO '{paths['load']}' (FORMAT parquet);
    """)
    return paths


def dedup_csv(idem, batch, work):
    """The batch deduplicated by idem, as CSV for psql's \\copy (not timed)."""
    import duckdb
    csv = batch.replace(".parquet", "-dedup.csv")
    if not os.path.exists(csv):
        parquet = batch.replace(".parquet", "-dedup.parquet")
        subprocess.run([idem, "dedup", batch, "-o", parquet, "-q"], check=True)
        duckdb.sql(f"COPY (SELECT event_id, sequence, lsn, op, payload, amount FROM read_parquet('{parquet}')) "
                   f"TO '{csv}' (HEADER false)")
    return csv


def etl(url, batch):
    """The Python ETL contender, run as a child process."""
    import psycopg
    import pyarrow.parquet as pq
    statement = ("INSERT INTO events (event_id, sequence, lsn, op, payload, amount) VALUES (%s, %s, %s, %s, %s, %s) "
                 f"ON CONFLICT (event_id, sequence) DO UPDATE SET {UPSERT_SET} WHERE events.lsn < EXCLUDED.lsn")
    with psycopg.connect(url) as con:
        with con.cursor() as cur:
            for page in pq.ParquetFile(batch).iter_batches(batch_size=10_000):
                columns = [page.column(n).to_pylist() for n in ("event_id", "sequence", "lsn", "op", "payload", "amount")]
                cur.executemany(statement, list(zip(*columns)))
        con.commit()


def fingerprint(url):
    return query(url, "SELECT count(*) || ' ' || sum(lsn) || ' ' || sum(hashtext(payload)::bigint) FROM events")


def run_job(args, base_url, name, batch, template, table_exists):
    csv = dedup_csv(args.idem, batch, args.work)
    floor_sql = f"{args.work}/{name}-floor.sql"
    with open(floor_sql, "w") as f:
        f.write("BEGIN;\nCREATE TEMP TABLE s (LIKE events) ON COMMIT DROP;\n"
                f"\\copy s FROM '{csv}' CSV\n"
                f"INSERT INTO events SELECT * FROM s ON CONFLICT (event_id, sequence) DO UPDATE SET {UPSERT_SET} "
                "WHERE events.lsn < EXCLUDED.lsn;\nCOMMIT;\n")
    run_url = url_of(base_url, "bench_run")
    contenders = {
        "idem": [args.idem, "merge", batch, "--into", run_url, "--table", "events", "-q"],
        "floor": ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", run_url, "-f", floor_sql],
        "psycopg": [sys.executable, __file__, "--etl", run_url, batch],
    }
    results = {c: [] for c in contenders}
    seen = {}
    for round_ in range(args.rounds):
        for contender, argv in contenders.items():
            if contender == "psycopg" and round_ >= args.psycopg_rounds:
                continue
            psql(base_url, "DROP DATABASE IF EXISTS bench_run")
            psql(base_url, f"CREATE DATABASE bench_run TEMPLATE {template}")
            if not table_exists and contender != "idem":
                psql(run_url, CREATE)
            psql(run_url, "CHECKPOINT")
            wall, cpu, rss, failure = measure(argv, 7200)
            if failure:
                sys.exit(f"{name} {contender}: {failure}")
            seen.setdefault(fingerprint(run_url), []).append(contender)
            results[contender].append((wall, rss))
            print(f"{name} round {round_ + 1} {contender}: {wall:.2f} s, {rss:.0f} MiB", flush=True)
    if len(seen) != 1:
        sys.exit(f"{name}: contenders left different tables: {seen}")
    dedup = [measure([args.idem, "dedup", batch, "-o", f"{args.work}/rss-dedup.parquet", "-q"], 3600)
             for _ in range(args.rounds)]
    return {
        "median_seconds": {c: statistics.median(w for w, _ in r) for c, r in results.items() if r},
        "peak_rss_mib": {c: max(m for _, m in r) for c, r in results.items() if r},
        "runs": {c: len(r) for c, r in results.items()},
        "dedup_peak_rss_mib": max(d[2] for d in dedup),
        "table": next(iter(seen)),
    }


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--etl":
        return etl(sys.argv[2], sys.argv[3])
    parser = argparse.ArgumentParser()
    parser.add_argument("idem")
    parser.add_argument("work")
    parser.add_argument("--table-rows", type=int, default=10_000_000)
    parser.add_argument("--batch-rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--psycopg-rounds", type=int, default=1)
    parser.add_argument("--jobs", default="update,load")
    args = parser.parse_args()
    base_url = os.environ["IDEM_TEST_PG_URL"]
    os.makedirs(args.work, exist_ok=True)
    started = time.monotonic()
    paths = make_data(args.work, args.table_rows, args.batch_rows)
    print(f"data ready in {time.monotonic() - started:.0f} s", flush=True)
    report = {"table_rows": args.table_rows, "batch_rows": args.batch_rows}
    jobs = args.jobs.split(",")
    if "update" in jobs:
        psql(base_url, "DROP DATABASE IF EXISTS bench_base")
        psql(base_url, "CREATE DATABASE bench_base")
        base = url_of(base_url, "bench_base")
        subprocess.run([args.idem, "merge", paths["base"], "--into", base, "--table", "events", "-q"], check=True)
        psql(base, "VACUUM ANALYZE events")
        report["update"] = run_job(args, base_url, "update", paths["update"], "bench_base", True)
    if "load" in jobs:
        psql(base_url, "DROP DATABASE IF EXISTS bench_empty")
        psql(base_url, "CREATE DATABASE bench_empty")
        report["load"] = run_job(args, base_url, "load", paths["load"], "bench_empty", False)
    for job in ("update", "load"):
        if job not in report:
            continue
        r = report[job]
        t, m = r["median_seconds"], r["peak_rss_mib"]
        line = f"{job}: idem {t['idem']:.2f} s ({m['idem']:.0f} MiB), floor {t['floor']:.2f} s, " \
               f"idem/floor {t['idem'] / t['floor']:.2f}"
        if "psycopg" in t:
            line += f", psycopg {t['psycopg']:.2f} s ({t['psycopg'] / t['idem']:.1f}x idem)"
        line += f"; idem merge RSS / idem dedup RSS {m['idem'] / r['dedup_peak_rss_mib']:.2f}"
        print(line)
    with open(f"{args.work}/postgres_bench.json", "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
