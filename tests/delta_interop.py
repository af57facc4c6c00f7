"""idem merge read back by an independent Delta reader (the `deltalake` package, delta-rs).

A series of generated batches (replays, updates, deletes, late out-of-order events) is
merged one by one into a Delta table (and into one partitioned and bucketed), with one
batch re-run; then the table as the
`deltalake` reader sees it must equal
  * a simple reference: the batches applied in order with the monotonic guard and
    remembered deletes (pure Python), on key and version, and
  * `idem dedup` of all the batches together with deletes dropped, on every column
    (EXCEPT ALL both ways in DuckDB).
It runs on a local table and, when IDEM_TEST_S3_BUCKET is set, on one in the local S3
server.

Usage: python tests/delta_interop.py path/to/idem
"""

import json
import os
import subprocess
import sys
import tempfile
import time

import duckdb
from deltalake import DeltaTable, QueryBuilder


def run(args):
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{done.stderr}")
    return done.stdout


def reference(batches):
    """Applies the batches in order: per batch the greatest lsn per key wins (ties: first);
    a winner replaces the table's row only when strictly newer, and a delete is remembered
    so that an older update cannot bring its key back."""
    rows, tombstones = {}, {}
    con = duckdb.connect()
    for batch in batches:
        winners = {}
        for event_id, sequence, lsn, op in con.sql(
            f"SELECT event_id, sequence, lsn, op FROM read_parquet('{batch}')"
        ).fetchall():
            key = (event_id, sequence)
            if key not in winners or lsn > winners[key][0]:
                winners[key] = (lsn, op)
        for key, (lsn, op) in winners.items():
            if key in tombstones and tombstones[key] >= lsn:
                continue
            if key in rows and rows[key] >= lsn:
                continue
            if op == "d":
                rows.pop(key, None)
                tombstones[key] = lsn
            else:
                tombstones.pop(key, None)
                rows[key] = lsn
    return rows


def check_table(idem, uri, storage_options, batches, workdir, create=()):
    for i, batch in enumerate(batches):
        extra = list(create) if i == 0 else []
        stats = json.loads(run([idem, "merge", batch, "--into", uri, "--op", "op", "--stats", "-", "-q", *extra]))
        assert stats["committed"], f"batch {i} committed nothing: {stats}"
    rerun = json.loads(run([idem, "merge", batches[1], "--into", uri, "--op", "op", "--stats", "-", "-q"]))
    assert rerun["already_applied"] and not rerun["committed"], rerun

    table = DeltaTable(uri, storage_options=storage_options)
    if "--partition-by" in create:
        wanted = create[list(create).index("--partition-by") + 1].split(",")
        assert table.metadata().partition_columns == wanted, table.metadata().partition_columns
    reader = QueryBuilder().register("t", table).execute("SELECT * FROM t")
    con = duckdb.connect()
    con.from_arrow(reader).create("delta_rows")
    seen = {
        (event_id, sequence): lsn
        for event_id, sequence, lsn in con.sql("SELECT event_id, sequence, lsn FROM delta_rows").fetchall()
    }
    assert con.sql("SELECT count(*) FROM delta_rows").fetchall()[0][0] == len(seen), "duplicated keys"
    expected = reference(batches)
    assert seen == expected, f"{uri}: {len(seen)} keys read, {len(expected)} expected"

    dedup = f"{workdir}/dedup-{int(time.time() * 1e6)}.parquet"
    run([idem, "dedup", *batches, "--op", "op", "-o", dedup])
    # By name: a reader may put partition columns last.
    columns = ", ".join(f'"{c}"' for c in con.sql(f"SELECT * FROM read_parquet('{dedup}') LIMIT 0").columns)
    for a, b in (("delta_rows", f"read_parquet('{dedup}')"), (f"read_parquet('{dedup}')", "delta_rows")):
        extra = con.sql(
            f"SELECT count(*) FROM (SELECT {columns} FROM {a} EXCEPT ALL SELECT {columns} FROM {b})"
        ).fetchall()[0][0]
        assert extra == 0, f"{uri}: {extra} rows of {a} are not in {b}"
    print(f"{uri} {' '.join(create)}: {len(seen)} rows, version {table.version()}, "
          "equal to the reference and to idem dedup")


def main():
    idem = sys.argv[1]
    with tempfile.TemporaryDirectory() as workdir:
        generated = f"{workdir}/generated"
        run([idem, "generate", "-o", generated, "--rows", "30000", "--files", "5", "--seed", "5",
             "--delete-rate", "0.05", "--reorder-rate", "0.3", "--update-rate", "0.3"])
        batches = sorted(f"{generated}/{name}" for name in os.listdir(generated))
        check_table(idem, f"{workdir}/table", None, batches, workdir)
        # Partitioned by a column that changes on update, bucketed within partitions.
        partitioned = ("--partition-by", "status", "--buckets", "4")
        check_table(idem, f"{workdir}/partitioned", None, batches, workdir, partitioned)
        bucket = os.environ.get("IDEM_TEST_S3_BUCKET")
        if bucket:
            options = {
                "AWS_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"],
                "AWS_ALLOW_HTTP": "true",
                "AWS_REGION": os.environ.get("AWS_REGION", "us-east-1"),
                "AWS_ACCESS_KEY_ID": os.environ["AWS_ACCESS_KEY_ID"],
                "AWS_SECRET_ACCESS_KEY": os.environ["AWS_SECRET_ACCESS_KEY"],
            }
            check_table(idem, f"s3://{bucket}/interop-{os.getpid()}/table", options, batches, workdir)
            check_table(idem, f"s3://{bucket}/interop-{os.getpid()}/partitioned", options, batches, workdir,
                        partitioned)
        elif os.environ.get("CI"):
            sys.exit("IDEM_TEST_S3_BUCKET is not set: run through scripts/test.sh")


if __name__ == "__main__":
    main()
