"""Every Arrow type idem accepts, merged into Delta tables and read back by other readers.

For each type, one table whose key, version and payload columns have that type (where the
type can be one: floats are never keys, binary never a version), three batches of the same
schema merged one after the other (inserts, an in-batch duplicate, updates, a stale
replay, a delete, a late older update the delete blocks, a re-insert), and one batch run
again (already applied). After every merge the table is read with delta-rs (`deltalake`)
and with Polars (`read_delta`), and compared row by row with a plain model of the merge
whose values are the batch's converted the way docs/merge.md's type table says. DuckDB's
`delta_scan` is used too where its extension is installed (it needs a download, so
offline it is skipped and said so).

Types Delta has no equivalent for (time of day, durations, null) and lossy conversions
(sub-microsecond timestamps) must fail with a one-line error naming the column, and leave
no table behind.

Usage: python tests/delta_types.py path/to/idem
"""

import datetime as dt
import decimal
import json
import os
import subprocess
import sys
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq
import polars as pl
from deltalake import DeltaTable

UTC = dt.timezone.utc
KEYS = 7


def run(args, ok=True):
    done = subprocess.run(args, capture_output=True, text=True)
    if ok and done.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{done.stderr}")
    return done


def pg_lsn(i):
    # Orders as a pg_lsn only when parsed: "0/FF" < "0/100" < "1/0".
    return f"{i // 3:X}/{(i % 3) * 0x7F + 0xFF:X}"


def parse_lsn(text):
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


BIG = 1 << 63
day = dt.date(2026, 1, 1)
t0 = dt.datetime(2026, 1, 1, 12, 0, 0)

# name: (Arrow type, 8 ascending distinct values, can be a key, can be a version,
#        the type the table stores it as)
TYPES = {
    "int8": (pa.int8(), list(range(-4, 4)), True, True, pa.int8()),
    "int16": (pa.int16(), [-300 + 100 * i for i in range(8)], True, True, pa.int16()),
    "int32": (pa.int32(), [-70000 + 20000 * i for i in range(8)], True, True, pa.int32()),
    "int64": (pa.int64(), [-(1 << 40) + (1 << 38) * i for i in range(8)], True, True, pa.int64()),
    "uint8": (pa.uint8(), [0, 1, 100, 127, 128, 200, 254, 255], True, True, pa.int16()),
    "uint16": (pa.uint16(), [0, 1, 32767, 32768, 40000, 50000, 65534, 65535], True, True, pa.int32()),
    "uint32": (pa.uint32(), [0, 1, 2**31 - 1, 2**31, 3 * 10**9, 4 * 10**9, 2**32 - 2, 2**32 - 1],
               True, True, pa.int64()),
    "uint64": (pa.uint64(), [0, BIG - 2, BIG - 1, BIG, BIG + 5, BIG + 7, 2**64 - 2, 2**64 - 1],
               True, True, pa.decimal128(20, 0)),
    "float16": (pa.float16(), None, False, False, pa.float32()),
    "float32": (pa.float32(), [-1.5, -0.25, 0.0, 0.5, 1.0, 2.5, 1e10, 3e38], False, False, pa.float32()),
    "float64": (pa.float64(), [-1e300, -1.5, 0.0, 0.1, 1.0, 2.5, 1e10, 1e300], False, False, pa.float64()),
    "decimal128": (pa.decimal128(38, 4), [decimal.Decimal(f"{i * 7 - 20}.{i}5") for i in range(8)],
                   True, True, pa.decimal128(38, 4)),
    "decimal_small": (pa.decimal128(5, 2), [decimal.Decimal(f"{i * 100 - 400}.25") for i in range(8)],
                      True, True, pa.decimal128(5, 2)),
    "utf8": (pa.string(), ["", "a", "b", "ba", "z", "é", "日本", "🙂"], True, False, pa.string()),
    "large_utf8": (pa.large_string(), ["", "a", "b", "ba", "z", "é", "日本", "🙂"], True, False, pa.string()),
    "utf8_view": (pa.string_view(), ["", "a", "b", "ba", "z", "é", "日本", "🙂"], True, False, pa.string()),
    "pg_lsn": (pa.string(), [pg_lsn(i) for i in range(8)], True, True, pa.string()),
    "dictionary": (pa.dictionary(pa.int32(), pa.string()), ["a", "b", "c", "d", "e", "f", "g", "h"],
                   True, False, pa.string()),
    "binary": (pa.binary(), [b"", b"\x00", b"\x00\x01", b"\x01", b"a", b"ab", b"\xfe", b"\xff\xff"],
               True, False, pa.binary()),
    "large_binary": (pa.large_binary(), [b"", b"\x00", b"\x01", b"a", b"ab", b"b", b"\xfe", b"\xff"],
                     True, False, pa.binary()),
    "binary_view": (pa.binary_view(), [b"", b"\x00", b"\x01", b"a", b"ab", b"b", b"\xfe", b"\xff"],
                    True, False, pa.binary()),
    "uuid": (pa.binary(16), [bytes([i]) * 16 for i in range(8)], True, False, pa.binary()),
    "bool": (pa.bool_(), [False, True], True, False, pa.bool_()),
    "date32": (pa.date32(), [day + dt.timedelta(days=d) for d in (-800, -1, 0, 1, 30, 365, 4000, 9000)],
               True, True, pa.date32()),
    "date64": (pa.date64(), [day + dt.timedelta(days=d) for d in (-800, -1, 0, 1, 30, 365, 4000, 9000)],
               True, True, pa.date32()),
    "timestamp_s": (pa.timestamp("s"), [t0 + dt.timedelta(seconds=s) for s in range(-3, 5)],
                    True, True, pa.timestamp("us")),
    "timestamp_ms": (pa.timestamp("ms"), [t0 + dt.timedelta(milliseconds=s) for s in range(-3, 5)],
                     True, True, pa.timestamp("us")),
    "timestamp_us": (pa.timestamp("us"), [t0 + dt.timedelta(microseconds=s) for s in range(-3, 5)],
                     True, True, pa.timestamp("us")),
    "timestamp_ns": (pa.timestamp("ns"), [t0 + dt.timedelta(microseconds=s) for s in range(-3, 5)],
                     True, True, pa.timestamp("us")),
    "timestamp_utc": (pa.timestamp("us", tz="UTC"),
                      [(t0 + dt.timedelta(seconds=s)).replace(tzinfo=UTC) for s in range(8)],
                      True, True, pa.timestamp("us", tz="UTC")),
    "timestamp_zoned": (pa.timestamp("ms", tz="Europe/Berlin"),
                        [(t0 + dt.timedelta(seconds=s)).replace(tzinfo=UTC) for s in range(8)],
                        True, True, pa.timestamp("us", tz="UTC")),
}

def column(arrow_type, values):
    if pa.types.is_float16(arrow_type):
        return pa.array(values, type=pa.float64()).cast(arrow_type)
    if pa.types.is_dictionary(arrow_type):
        return pa.array(values, type=pa.string()).dictionary_encode().cast(arrow_type)
    if pa.types.is_string_view(arrow_type) or pa.types.is_binary_view(arrow_type):
        plain = pa.string() if pa.types.is_string_view(arrow_type) else pa.binary()
        return pa.array(values, type=plain).cast(arrow_type)
    return pa.array(values, type=arrow_type)


def scenario():
    """Three batches of (key index, version index, payload index, op); key index i is
    key value i (or (value i % n, i) where the type has fewer than KEYS values)."""
    return [
        # inserts, one key delivered twice (exact replay) and one at two versions
        [(0, 1, 0, "c"), (1, 1, 1, "c"), (2, 1, 2, "c"), (3, 1, 3, "c"), (4, 1, 4, "c"),
         (0, 1, 0, "c"), (4, 2, 5, "u")],
        # update, stale replay, delete, new key
        [(0, 3, 6, "u"), (1, 0, 7, "u"), (2, 4, None, "d"), (5, 2, 1, "c")],
        # late older update after the delete (blocked), update, delete, new key, replay,
        # and a re-insert of key 2 above its delete
        [(2, 3, 2, "u"), (3, 5, 0, "u"), (1, 6, None, "d"), (6, 0, 3, "c"), (0, 3, 6, "u"),
         (4, 7, 2, "u")],
    ]


def build(spec, batch_rows):
    """The batch: `k` of the type where it can be a key (else the key index), `k2` the key
    index, `v` of the type where it can be a version (else an int64), `p` of the type."""
    arrow_type, values, can_key, can_version, _ = spec
    payload_values = values if values is not None else [0.5 * i - 1 for i in range(8)]
    keys = [values[i % len(values)] if can_key else i for i, _, _, _ in batch_rows]
    versions = [values[v] if can_version else v for _, v, _, _ in batch_rows]
    payloads = [None if p is None else payload_values[p % len(payload_values)] for _, _, p, _ in batch_rows]
    fields = {
        "k": column(arrow_type, keys) if can_key else pa.array(keys, pa.int64()),
        "k2": pa.array([i for i, _, _, _ in batch_rows], pa.int64()),
        "v": column(arrow_type, versions) if can_version else pa.array(versions, pa.int64()),
        "p": column(arrow_type, payloads),
        "op": pa.array([op for _, _, _, op in batch_rows], pa.string()),
    }
    return pa.table(fields)


def model_apply(state, tombstones, rows, version_key):
    winners = {}
    for row in rows:
        key = (row["k"], row["k2"])
        if key not in winners or version_key(row["v"]) > version_key(winners[key]["v"]):
            winners[key] = row
    for key, row in winners.items():
        version = version_key(row["v"])
        if key in tombstones and tombstones[key] >= version:
            continue
        if key in state and version_key(state[key]["v"]) >= version:
            continue
        if row["op"] == "d":
            state.pop(key, None)
            tombstones[key] = version
        else:
            tombstones.pop(key, None)
            state[key] = row


def comparable(value):
    if isinstance(value, dt.datetime) and value.tzinfo is not None:
        return value.astimezone(UTC)
    if isinstance(value, float):
        return round(value, 3)
    return value


def as_rows(table):
    rows = {}
    for row in table.to_pylist():
        key = (comparable(row["k"]), row["k2"])
        assert key not in rows, f"key {key} twice"
        rows[key] = {c: comparable(row[c]) for c in ("k", "k2", "v", "p", "op")}
    return rows


def duckdb_delta():
    try:
        import duckdb
        con = duckdb.connect()
        con.sql("LOAD delta")
        return con
    except Exception as e:  # not installed, and installing needs the network
        print(f"DuckDB delta_scan: skipped ({str(e).splitlines()[0][:80]})")
        return None


def check_type(idem, workdir, name, spec, duck):
    _, values, can_key, can_version, stored = spec
    uri = f"{workdir}/{name}"
    # A type with too few values for the scenario's keys (bool) is the first column of a
    # composite key (k, k2); k2, the key index, is then part of every key.
    alone = can_key and len(values) >= KEYS
    merge = [idem, "merge", "--into", uri, "--key", "k" if alone else "k,k2", "--version", "v",
             "--op", "op", "--stats", "-", "-q"]
    version_order = parse_lsn if name == "pg_lsn" else (lambda v: v)
    stored_as = {"k": stored if can_key else pa.int64(), "v": stored if can_version else pa.int64(),
                 "p": stored}
    state, tombstones, paths = {}, {}, []
    for i, rows in enumerate(scenario()):
        batch = build(spec, rows)
        path = f"{workdir}/{name}-{i}.parquet"
        pq.write_table(batch, path)
        paths.append(path)
        stats = json.loads(run(merge[:2] + [path] + merge[2:]).stdout)
        assert stats["committed"], (name, i, stats)
        # The model holds the values as the table stores them (docs/merge.md's type table); k2,
        # the key index, identifies a key whether or not it is a key column.
        converted = {c: (batch.column(c).cast(stored_as[c]) if c in stored_as else batch.column(c)).to_pylist()
                     for c in batch.column_names}
        model_rows = [{c: comparable(converted[c][r]) for c in batch.column_names}
                      for r in range(batch.num_rows)]
        model_apply(state, tombstones, model_rows, version_order)
        table = DeltaTable(uri)
        seen = as_rows(table.to_pyarrow_table())
        assert seen == state, f"{name} after batch {i} (delta-rs):\n{seen}\n!=\n{state}"
        assert as_rows(pl.read_delta(uri).to_arrow()) == state, f"{name} after batch {i} (Polars)"
        if duck is not None:
            assert as_rows(duck.sql(f"SELECT * FROM delta_scan('{uri}')").arrow()) == state, name
    types = {f.name: f.type for f in DeltaTable(uri).to_pyarrow_table().schema}
    assert types["p"] == stored, f"{name}: stored as {types['p']}, documented as {stored}"
    rerun = json.loads(run(merge[:2] + [paths[1]] + merge[2:]).stdout)
    assert rerun["already_applied"] and not rerun["committed"], rerun
    print(f"{name}: {len(state)} rows after 3 batches and a re-run, as the model, in delta-rs and "
          f"Polars{' and DuckDB' if duck else ''}; stored as {stored}")


def check_refused(idem, workdir, name, values, column_named, message):
    uri = f"{workdir}/refused-{name}"
    batch = pa.table({"id": pa.array(range(len(values)), pa.int64()),
                      "lsn": pa.array(range(len(values)), pa.int64()),
                      column_named: values})
    path = f"{workdir}/refused-{name}.parquet"
    pq.write_table(batch, path)
    done = run([idem, "merge", path, "--into", uri, "--key", "id", "--version", "lsn", "-q"], ok=False)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, (name, done.returncode, done.stderr)
    assert f"column '{column_named}'" in lines[0] and message in lines[0], (name, lines[0])
    log = f"{uri}/_delta_log"
    assert not os.path.exists(log) or not os.listdir(log), f"{name}: a refused merge left a table"
    print(f"{name}: refused, {lines[0][len('idem: error: '):]}")


def main():
    idem = sys.argv[1]
    duck = duckdb_delta()
    with tempfile.TemporaryDirectory() as workdir:
        for name, spec in TYPES.items():
            check_type(idem, workdir, name, spec, duck)
        check_refused(idem, workdir, "time", pa.array([dt.time(1, 2, 3)] * 2, pa.time64("us")), "at",
                      "time of day")
        check_refused(idem, workdir, "duration", pa.array([dt.timedelta(seconds=1)] * 2, pa.duration("s")),
                      "took", "no Delta type")
        check_refused(idem, workdir, "nanoseconds",
                      pa.array([1_000_000_001, None], pa.int64()).cast(pa.timestamp("ns")), "at",
                      "sub-microsecond")


if __name__ == "__main__":
    main()
