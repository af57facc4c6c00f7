"""idem dedup against DuckDB's QUALIFY row_number() on the same generated files.

For each case, the set of rows idem writes must equal DuckDB's
  QUALIFY row_number() OVER (PARTITION BY key ORDER BY version DESC NULLS LAST,
                             <input position>) = 1
(less winning tombstones when deletes are honoured), compared as multisets with EXCEPT ALL
both ways, and idem's stats must add up and agree with DuckDB's counts.

Usage: python tests/duckdb_equivalence.py path/to/idem
"""

import json
import subprocess
import sys
import tempfile

import duckdb

CASES = [
    # name, generator flags, dedup flags, tombstones dropped, tie order
    ("defaults", ["--seed", "11"], [], False, "ASC"),
    ("deletes", ["--seed", "12", "--delete-rate", "0.05"], ["--op", "op"], True, "ASC"),
    ("late-replays-last", ["--seed", "13", "--reorder-rate", "0.4", "--duplicate-rate", "0.5"],
     ["--on-tie", "last"], False, "DESC"),
]


def run_case(idem, workdir, name, gen_flags, dedup_flags, drop_tombstones, tie_order):
    inputs = f"{workdir}/{name}/in"
    output = f"{workdir}/{name}/out"
    subprocess.run([idem, "generate", "-o", inputs, "--rows", "200000", "--files", "3", *gen_flags],
                   check=True, capture_output=True)
    subprocess.run([idem, "dedup", inputs, "-o", output, "--stats", f"{workdir}/{name}/stats.json",
                    "--max-rows-per-file", "50000", "-q", *dedup_flags], check=True)
    stats = json.load(open(f"{workdir}/{name}/stats.json"))
    con = duckdb.connect()
    con.execute("SET threads = 2")
    winners = f"""
        SELECT * EXCLUDE (filename, file_row_number)
        FROM read_parquet('{inputs}/*.parquet', filename = true, file_row_number = true)
        QUALIFY row_number() OVER (
            PARTITION BY event_id, sequence
            ORDER BY lsn DESC NULLS LAST, filename {tie_order}, file_row_number {tie_order}) = 1"""
    expected = f"SELECT * FROM ({winners}) WHERE op <> 'd'" if drop_tombstones else winners
    actual = f"SELECT * FROM read_parquet('{output}/*.parquet')"
    missing = con.execute(f"SELECT count(*) FROM ({expected} EXCEPT ALL {actual})").fetchone()[0]
    extra = con.execute(f"SELECT count(*) FROM ({actual} EXCEPT ALL {expected})").fetchone()[0]
    rows_expected = con.execute(f"SELECT count(*) FROM ({expected})").fetchone()[0]
    rows_in = con.execute(f"SELECT count(*) FROM read_parquet('{inputs}/*.parquet')").fetchone()[0]
    keys = con.execute(f"SELECT count(*) FROM (SELECT DISTINCT event_id, sequence FROM read_parquet('{inputs}/*.parquet'))").fetchone()[0]
    problems = []
    if missing or extra:
        problems.append(f"{missing} rows missing from idem's output, {extra} extra")
    if stats["rows_out"] != rows_expected:
        problems.append(f"rows_out {stats['rows_out']} != DuckDB's {rows_expected}")
    if stats["rows_in"] != rows_in or stats["distinct_keys"] != keys:
        problems.append(f"rows_in/distinct_keys {stats['rows_in']}/{stats['distinct_keys']} != {rows_in}/{keys}")
    total = stats["rows_out"] + stats["duplicates"] + stats["superseded"] + stats["deleted"]
    if total != stats["rows_in"]:
        problems.append(f"stats do not add up: {stats}")
    if stats["superseded"] == 0 or stats["duplicates"] == 0:
        problems.append("the case exercised no replays or updates")
    return problems


def main():
    idem = sys.argv[1]
    passed = failed = 0
    with tempfile.TemporaryDirectory() as workdir:
        for case in CASES:
            problems = run_case(idem, workdir, *case)
            if problems:
                failed += 1
                print(f"FAIL {case[0]}: " + "; ".join(problems))
            else:
                passed += 1
                print(f"ok   {case[0]}")
    print(f"duckdb: {passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
