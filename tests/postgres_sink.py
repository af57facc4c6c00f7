"""`idem merge --into postgres://…` against a real PostgreSQL server.

scripts/test.sh starts a throwaway cluster and sets IDEM_TEST_PG_URL (a superuser over
trust auth), IDEM_TEST_PG_CA (the server's self-signed certificate; TLS is on) and
IDEM_TEST_PG_PORT. Each check uses its own table and compares it, after every batch, with
a plain Python model of the semantics:

  per batch, the greatest version per key wins (ties: the first row); a winner replaces the
  table's row only when strictly newer; a winning delete removes the row and is remembered,
  so that a later update at or below its version is blocked (a newer one re-inserts).

Usage: python tests/postgres_sink.py path/to/idem
"""

import datetime
import decimal
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq

from cli_checks import fails_in_one_line

IDEM = sys.argv[1] if len(sys.argv) > 1 else "target/debug/idem"
URL = os.environ["IDEM_TEST_PG_URL"]
CA = os.environ["IDEM_TEST_PG_CA"]
PORT = os.environ["IDEM_TEST_PG_PORT"]
WORK = tempfile.mkdtemp(prefix="idem-pg-test-")
CDC = ["--op", "op", "--delete-values", "d"]


def sql(query, params=None):
    with psycopg.connect(URL, autocommit=True) as con:
        cur = con.execute(query, params)
        return cur.fetchall() if cur.description else None


def write(name, columns, schema=None):
    path = f"{WORK}/{name}.parquet"
    pq.write_table(pa.table(columns, schema=schema), path)
    return path


def merge(batch, table, *extra, url=URL, env=None, check=True):
    args = [IDEM, "merge", *([batch] if isinstance(batch, str) else batch), "--into", url,
            "--table", table, "--stats", "-", "-q", *extra]
    done = subprocess.run(args, capture_output=True, text=True, env=env)
    if check and done.returncode != 0:
        sys.exit(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
    stats = json.loads(done.stdout) if done.returncode == 0 else None
    return done, stats


class Model:
    """The table and its tombstones as the semantics say they must be."""

    def __init__(self):
        self.rows = {}  # key -> (version, row)
        self.tombstones = {}  # key -> version

    def apply(self, rows, key, version, is_delete):
        """rows: dicts in input order. Returns the expected counts."""
        winners = {}
        for row in rows:
            k = key(row)
            if k not in winners or version(row) > version(winners[k]):
                winners[k] = row
        counts = dict(inserted=0, updated=0, deleted=0, deletes_without_row=0, stale=0,
                      resurrections_blocked=0, distinct_keys=len(winners))
        for k, row in winners.items():
            v = version(row)
            if k in self.tombstones and self.tombstones[k] >= v:
                counts["stale" if is_delete(row) else "resurrections_blocked"] += 1
                continue
            if k in self.rows and self.rows[k][0] >= v:
                counts["stale"] += 1
                continue
            if is_delete(row):
                counts["deleted" if k in self.rows else "deletes_without_row"] += 1
                self.rows.pop(k, None)
                self.tombstones[k] = v
            else:
                counts["updated" if k in self.rows else "inserted"] += 1
                self.tombstones.pop(k, None)
                self.rows[k] = (v, row)
        return counts


def nullable_max(v):
    # NULL versions lose to any value (as idem orders them).
    return tuple((x is not None, x if x is not None else 0) for x in v)


def check_counts(stats, counts, what):
    for name, value in counts.items():
        assert stats[name] == value, f"{what}: {name} = {stats[name]}, expected {value}\n{stats}"
    accounted = sum(stats[n] for n in ("inserted", "updated", "stale", "deleted",
                                       "resurrections_blocked", "deletes_without_row"))
    assert accounted == stats["distinct_keys"], f"{what}: {accounted} keys accounted of {stats}"


# --- CDC scenario -----------------------------------------------------------------------

CDC_SCHEMA = pa.schema([("event_id", pa.string()), ("sequence", pa.int64()), ("lsn", pa.int64()),
                        ("op", pa.string()), ("payload", pa.string()), ("amount", pa.float64())])


def cdc_batch(name, rows):
    columns = {f.name: [r[i] for r in rows] for i, f in enumerate(CDC_SCHEMA)}
    return write(name, columns, CDC_SCHEMA)


def cdc_scenario():
    table = "public.cdc_orders"
    model = Model()
    key = lambda r: (r["event_id"], r["sequence"])
    version = lambda r: r["lsn"]
    deleting = lambda r: r["op"] == "d"

    def table_rows():
        return {(e, s): (l, o, p, a) for e, s, l, o, p, a in
                sql("SELECT event_id, sequence, lsn, op, payload, amount FROM cdc_orders")}

    def expected_rows():
        return {k: (v, r["op"], r["payload"], r["amount"]) for k, (v, r) in model.rows.items()}

    committed = 0
    steps = [
        ("inserts", [("a", 1, 10, "c", "a1", 1.0), ("b", 1, 10, "c", "b1", 2.0),
                     ("c", 1, 10, "c", "c1", 3.0), ("d", 1, 10, "c", "d1", 4.0)]),
        ("updates, in-batch duplicates and an older update in the batch",
         [("a", 1, 20, "u", "a2", 1.5), ("a", 1, 20, "u", "a2", 1.5), ("b", 1, 15, "u", "b-old", 0.0),
          ("b", 1, 30, "u", "b3", 2.5), ("e", 1, 5, "c", "e1", 5.0), ("e", 1, 5, "c", "e1", 5.0)]),
        ("out-of-order older updates and an exact replay of the first batch",
         [("a", 1, 15, "u", "a-late", 9.0), ("c", 1, 10, "c", "c1", 3.0), ("d", 1, 9, "u", "d0", 0.0)]),
        ("deletes, one of a key never seen", [("c", 1, 40, "d", None, None), ("d", 1, 40, "d", None, None),
                                              ("z", 1, 40, "d", None, None)]),
        ("a late older update after a delete, a replay of the delete",
         [("c", 1, 35, "u", "c-late", 7.0), ("d", 1, 40, "d", None, None), ("z", 1, 1, "c", "z-old", 0.0)]),
        ("a re-insert with a newer version", [("c", 1, 50, "c", "c-again", 8.0), ("a", 1, 21, "u", "a3", 1.75)]),
    ]
    for i, (what, rows) in enumerate(steps):
        batch = cdc_batch(f"cdc-{i}", rows)
        counts = model.apply([dict(zip(CDC_SCHEMA.names, r)) for r in rows], key, version, deleting)
        _, stats = merge(batch, table, *CDC)
        check_counts(stats, counts, what)
        changes = counts["inserted"] + counts["updated"] + counts["deleted"] + counts["deletes_without_row"]
        assert stats["committed"] == (changes > 0) and not stats["already_applied"], stats
        committed += stats["committed"]
        assert table_rows() == expected_rows(), f"{what}:\n{table_rows()}\n!=\n{expected_rows()}"
        assert stats["database"].startswith("postgres://postgres@127.0.0.1:"), stats
        assert stats["table"] == "public.cdc_orders", stats
    tombstones = sql('SELECT event_id, sequence, lsn FROM idem."tombstones:public.cdc_orders"')
    assert {(e, s): l for e, s, l in tombstones} == model.tombstones, tombstones

    # The same batch again: recognised from its files, nothing staged or changed.
    before = table_rows()
    started = time.monotonic()
    _, stats = merge(f"{WORK}/cdc-3.parquet", table, *CDC)
    took = time.monotonic() - started
    assert stats["already_applied"] and not stats["committed"], stats
    assert took < 1.0, f"an applied batch took {took:.2f} s"
    assert table_rows() == before
    runs = sql("SELECT count(*) FROM idem.runs WHERE target = 'public.cdc_orders'")[0][0]
    assert runs == committed, f"{runs} runs for {committed} commits: a batch that changes nothing commits nothing"
    # The same rows in a new file: merged again, every key stale.
    copy = cdc_batch("cdc-3-copy", steps[3][1])
    _, stats = merge(copy, table, *CDC)
    assert stats["stale"] == stats["distinct_keys"] == 3 and not stats["committed"], stats
    assert table_rows() == before

    # idem verify reads the table back: the dedup of all batches with deletes dropped is
    # what the table holds, except for the row the late older update could not revive.
    verify = subprocess.run([IDEM, "verify", "--source", *[f"{WORK}/cdc-{i}.parquet" for i in range(len(steps))],
                             "--target", URL, "--table", table, *CDC, "--json"],
                            capture_output=True, text=True)
    report = json.loads(verify.stdout)
    assert verify.returncode == 0 and report["matches"], verify.stdout + verify.stderr
    print(f"cdc scenario: {len(steps)} batches, {len(before)} rows equal to the model after each")


# --- generated events, checked by idem verify -----------------------------------------

def generated():
    gen = f"{WORK}/generated"
    subprocess.run([IDEM, "generate", "-o", gen, "--rows", "30000", "--files", "5", "--seed", "7",
                    "--delete-rate", "0.05", "--reorder-rate", "0.3", "--update-rate", "0.3"],
                   check=True, capture_output=True)
    batches = sorted(f"{gen}/{n}" for n in os.listdir(gen))
    for batch in batches:
        _, stats = merge(batch, "generated", "--op", "op")
        assert stats["committed"], stats
    verify = subprocess.run([IDEM, "verify", "--source", *batches, "--target", URL, "--table", "generated",
                             "--op", "op", "--json"], capture_output=True, text=True)
    report = json.loads(verify.stdout)
    assert verify.returncode == 0 and report["matches"], verify.stdout + verify.stderr
    assert report["target_rows"] == sql("SELECT count(*) FROM generated")[0][0]
    # A changed row is seen by verify.
    sql("UPDATE generated SET payload = 'tampered' WHERE ctid = (SELECT min(ctid) FROM generated)")
    verify = subprocess.run([IDEM, "verify", "--source", *batches, "--target", URL, "--table", "generated",
                             "--op", "op", "--json"], capture_output=True, text=True)
    report = json.loads(verify.stdout)
    assert verify.returncode == 1 and report["differing_rows"] == 1, verify.stdout + verify.stderr
    assert report["differing_columns"] == ["payload"], report
    print(f"generated: {len(batches)} batches, {report['target_rows']} rows, verified (and a tampered row found)")


# --- types ------------------------------------------------------------------------------

def types():
    u = [uuid.UUID(int=i * 0x1234567) for i in range(4)]
    ts = [datetime.datetime(2026, 1, 1, 12, 0, i, 1000 * i, tzinfo=datetime.timezone.utc) for i in range(4)]
    schema = pa.schema([
        ("tenant", pa.string()), ("id", pa.binary(16)), ("at", pa.timestamp("us", tz="UTC")),
        ("epoch", pa.int32()), ("lsn", pa.uint64()), ("amount", pa.decimal128(12, 3)),
        ("day", pa.date32()), ("flag", pa.bool_()), ("blob", pa.binary()), ("small", pa.uint8()),
    ])
    big = [2**63 + 5, 2**64 - 1, 2**63 - 1, 2**63 + 1]

    def batch(name, rows):
        return write(name, {f.name: [r[i] for r in rows] for i, f in enumerate(schema)}, schema)

    first = [("t1", u[0].bytes, ts[0], 1, big[0], decimal.Decimal("12.345"), datetime.date(2026, 1, 1), True, b"\x00", 255),
             ("t1", u[1].bytes, ts[1], 1, big[2], decimal.Decimal("-0.001"), datetime.date(1999, 12, 31), False, b"", 0),
             ("t2", u[0].bytes, ts[2], None, 7, None, None, None, None, None)]
    merge(batch("types-1", first), "typed", "--key", "tenant,id,at", "--version", "epoch,lsn")
    columns = dict(sql("SELECT column_name, data_type FROM information_schema.columns WHERE table_name = 'typed'"))
    assert columns["id"] == "uuid" and columns["lsn"] == "numeric" and columns["at"] == "timestamp with time zone", columns
    assert columns["amount"] == "numeric" and columns["small"] == "smallint" and columns["day"] == "date", columns
    # Composite versions left to right: (1, 2^64-1) beats (1, 2^63+5); a NULL epoch loses to 1;
    # (0, anything) loses to (1, …).
    second = [("t1", u[0].bytes, ts[0], 1, big[1], decimal.Decimal("99.999"), datetime.date(2026, 1, 2), False, b"\x01", 1),
              ("t1", u[1].bytes, ts[1], 0, big[1], decimal.Decimal("0"), None, None, None, None),
              ("t2", u[0].bytes, ts[2], 1, 0, decimal.Decimal("1.5"), None, True, b"x", 2)]
    _, stats = merge(batch("types-2", second), "typed", "--key", "tenant,id,at", "--version", "epoch,lsn")
    assert (stats["updated"], stats["stale"]) == (2, 1), stats
    got = sql("SELECT tenant, id, at, epoch, lsn, amount, flag, small FROM typed ORDER BY tenant, id")
    assert got == [("t1", u[0], ts[0], 1, big[1], decimal.Decimal("99.999"), False, 1),
                   ("t1", u[1], ts[1], 1, big[2], decimal.Decimal("-0.001"), False, 0),
                   ("t2", u[0], ts[2], 1, 0, decimal.Decimal("1.500"), True, 2)], got
    verify = subprocess.run([IDEM, "verify", "--source", f"{WORK}/types-1.parquet", f"{WORK}/types-2.parquet",
                             "--target", URL, "--table", "typed", "--key", "tenant,id,at",
                             "--version", "epoch,lsn", "--json"], capture_output=True, text=True)
    assert verify.returncode == 0 and json.loads(verify.stdout)["matches"], verify.stdout + verify.stderr

    # pg_lsn text versions: compared as LSNs (0/FF < 0/100), stored as pg_lsn.
    lsn_schema = pa.schema([("event_id", pa.string()), ("sequence", pa.int64()), ("lsn", pa.string()),
                            ("payload", pa.string())])
    w = lambda name, rows: write(name, {f.name: [r[i] for r in rows] for i, f in enumerate(lsn_schema)}, lsn_schema)
    merge(w("lsn-1", [("a", 1, "0/FF", "old"), ("b", 1, "16/B374D848", "b")]), "lsn_versions")
    _, stats = merge(w("lsn-2", [("a", 1, "0/100", "new"), ("b", 1, "16/b374d847", "older")]), "lsn_versions")
    assert (stats["updated"], stats["stale"]) == (1, 1), stats
    assert sql("SELECT data_type FROM information_schema.columns WHERE table_name = 'lsn_versions' AND column_name = 'lsn'") == [("pg_lsn",)]
    assert sql("SELECT event_id, lsn::text, payload FROM lsn_versions ORDER BY 1") == [("a", "0/100", "new"), ("b", "16/B374D848", "b")]
    print("types: composite key and version, uuid, timestamptz, UInt64 above 2^63, decimals, null versions, pg_lsn")


# --- two writers at once ---------------------------------------------------------------

def concurrent():
    table = "concurrent"
    rng = random.Random(11)
    best = {}
    for round_ in range(10):
        files = []
        for writer in range(2):
            rows = []
            for _ in range(3000):
                k = rng.randrange(2000)
                rows.append((f"k{k}", 1, rng.randrange(1_000_000), "c", f"w{writer}r{round_}", 0.0))
            for r in rows:
                k = (r[0], r[1])
                if k not in best or r[2] > best[k]:
                    best[k] = r[2]
            files.append(cdc_batch(f"concurrent-{round_}-{writer}", rows))
        procs = [subprocess.Popen([IDEM, "merge", f, "--into", URL, "--table", table, "-q"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for f in files]
        for p in procs:
            out, err = p.communicate()
            assert p.returncode == 0, f"round {round_}: {err}"
    got = {(e, s): l for e, s, l in sql(f"SELECT event_id, sequence, lsn FROM {table}")}
    assert got == best, f"{len(got)} keys, {len(best)} expected"
    print(f"concurrent: 10 rounds of 2 writers, {len(got)} keys at the per-key maximum")


# --- kills ------------------------------------------------------------------------------

def killed():
    table = "killed"
    rng = random.Random(3)
    model = {}
    interrupted = 0
    typical = 0.5  # seconds of an uninterrupted merge, measured by each re-run
    key_count = 20000

    def state():
        return dict(((e, s), l) for e, s, l in sql(f"SELECT event_id, sequence, lsn FROM {table}")) \
            if sql(f"SELECT to_regclass('{table}')")[0][0] else {}

    for i in range(20):
        rows = [(f"k{rng.randrange(key_count)}", 1, rng.randrange(10**9), "c", "x" * 50, 1.0)
                for _ in range(40000)]
        batch = cdc_batch(f"killed-{i}", rows)
        after = dict(model)
        for r in rows:
            k = (r[0], r[1])
            if k not in after or r[2] > after[k]:
                after[k] = r[2]
        before = state()
        assert before == model
        p = subprocess.Popen([IDEM, "merge", batch, "--into", URL, "--table", table, "-q"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.0, typical * 1.1))
        p.send_signal(signal.SIGKILL)
        interrupted += p.wait() == -signal.SIGKILL
        # The server notices the dropped connection and rolls its transaction back.
        for _ in range(100):
            if not sql("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'idem' AND state <> 'idle'")[0][0]:
                break
            time.sleep(0.05)
        seen = state()
        assert seen in (before, after), f"merge {i}: the table is between two states"
        rerun = time.monotonic()
        merge(batch, table)
        typical = time.monotonic() - rerun
        assert state() == after, f"merge {i}: a re-run did not converge"
        model = after
    assert interrupted >= 10, f"only {interrupted} of 20 kills landed before the merge ended"
    print(f"killed: 20 merges sent SIGKILL at random moments ({interrupted} before they ended), "
          "each left the table before or after, re-runs converged")


# --- bad input and connections ---------------------------------------------------------

def fails(args, *needles, env=None):
    return fails_in_one_line(IDEM, args, *needles, env=env)


def bad_input():
    good = cdc_batch("good", [("a", 1, 1, "c", "p", 1.0)])
    merge(good, "guarded")
    snapshot = lambda: sql("SELECT * FROM guarded ORDER BY 1, 2")
    before = snapshot()
    runs_before = sql("SELECT count(*) FROM idem.runs")[0][0]

    # An unreachable server: a closed port.
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    closed = s.getsockname()[1]
    s.close()
    fails(["merge", good, "--into", f"postgres://postgres@127.0.0.1:{closed}/postgres", "--table", "t"],
          f"127.0.0.1:{closed}")
    # A wrong password: the message names the user, never the password.
    sql("DO $$ BEGIN CREATE ROLE idem_writer LOGIN PASSWORD 'right-horse'; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    # idem's own tables are the superuser's here: the writer is granted their use.
    sql("GRANT ALL ON SCHEMA public, idem TO idem_writer")
    sql("GRANT ALL ON ALL TABLES IN SCHEMA idem TO idem_writer")
    sql("GRANT ALL ON ALL SEQUENCES IN SCHEMA idem TO idem_writer")
    line = fails(["merge", good, "--into", f"postgres://idem_writer:wrong-battery@127.0.0.1:{PORT}/postgres",
                  "--table", "t", "--stats", "-"], "idem_writer", "password")
    assert "wrong-battery" not in line
    # The right password from PGPASSWORD, as psql takes it; never shown anywhere.
    env = dict(os.environ, PGPASSWORD="right-horse", PGUSER="idem_writer")
    done, stats = merge(good, "writer_table", url=f"postgres://127.0.0.1:{PORT}/postgres", env=env)
    metrics = f"{WORK}/writer.prom"
    done, stats = merge(cdc_batch("good-2", [("b", 1, 1, "c", "p", 1.0)]), "writer_table", "--metrics", metrics,
                        url=f"postgres://idem_writer:right-horse@127.0.0.1:{PORT}/postgres")
    assert "right-horse" not in json.dumps(stats) + done.stderr + open(metrics).read()
    assert stats["database"] == f"postgres://idem_writer@127.0.0.1:{PORT}/postgres", stats

    # A column the table lacks; an incompatible type; no key constraint; corrupt Parquet.
    extra = write("extra-column", {"event_id": ["a"], "sequence": [1], "lsn": [2], "op": ["u"], "payload": ["p"],
                                   "amount": [1.0], "colour": ["red"]})
    fails(["merge", extra, "--into", URL, "--table", "guarded"], "colour", "no such column")
    wrong = write("wrong-type", {"event_id": ["a"], "sequence": [1], "lsn": [2], "op": ["u"], "payload": [1.5],
                                 "amount": [1.0]})
    fails(["merge", wrong, "--into", URL, "--table", "guarded"], "payload", "text")
    sql("CREATE TABLE IF NOT EXISTS unkeyed (event_id text, sequence bigint, lsn bigint, op text, payload text, amount float8)")
    fails(["merge", good, "--into", URL, "--table", "unkeyed"], "primary key", "event_id, sequence")
    corrupt = f"{WORK}/corrupt.parquet"
    with open(corrupt, "wb") as f:
        f.write(open(good, "rb").read()[:40] + b"\x00" * 50 + b"PAR1")
    fails(["merge", corrupt, "--into", URL, "--table", "guarded"], "corrupt.parquet")
    fails(["merge", good, "--into", URL], "--table")
    # A tie between differing rows under --on-tie error.
    tie = cdc_batch("tie", [("a", 1, 5, "u", "x", 1.0), ("a", 1, 5, "u", "y", 1.0)])
    fails(["merge", tie, "--into", URL, "--table", "guarded", "--on-tie", "error"], "tie")
    assert snapshot() == before, "a failed merge changed the table"
    assert sql("SELECT count(*) FROM idem.runs")[0][0] == runs_before + 2
    assert not sql("SELECT to_regclass('public.t')")[0][0], "a failed merge created its table"
    print("bad input: unreachable server, wrong password, missing column, wrong type, no key, corrupt file, "
          "tie: one line, exit 1, nothing changed")


def tls():
    good = cdc_batch("tls", [("a", 1, 1, "c", "p", 1.0)])
    # The server lets role idem_tls in over TLS only.
    sql("DO $$ BEGIN CREATE ROLE idem_tls LOGIN SUPERUSER; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    base = f"postgres://idem_tls@127.0.0.1:{PORT}/postgres"
    merge(good, "tls_required", url=f"{base}?sslmode=require")
    merge(good, "tls_preferred", url=base)
    fails(["merge", good, "--into", f"{base}?sslmode=disable", "--table", "tls_plain"], "idem_tls")
    merge(good, "tls_verified", url=f"postgres://postgres@localhost:{PORT}/postgres?sslmode=verify-full&sslrootcert={CA}")
    # The server's certificate is self-signed: the system's roots do not vouch for it.
    fails(["merge", good, "--into", f"postgres://postgres@localhost:{PORT}/postgres?sslmode=verify-full&sslrootcert=system",
           "--table", "tls_refused"], "localhost")
    env = dict(os.environ, PGSSLMODE="verify-full", PGSSLROOTCERT=CA)
    merge(good, "tls_env", url=f"postgres://postgres@localhost:{PORT}/postgres", env=env)
    print("tls: require and prefer encrypt (a TLS-only role gets in), disable does not; verify-full with the "
          "server's CA (URL and PGSSL* environment), refused without it")


def main():
    started = time.monotonic()
    for check in (cdc_scenario, generated, types, concurrent, killed, bad_input, tls):
        check()
    print(f"postgres sink: all checks passed in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
