"""`idem dedup --state redis://…` against a real Redis server.

scripts/test.sh starts a throwaway redis-server and sets IDEM_TEST_REDIS_URL (the default
user, no password), IDEM_TEST_REDIS_PASSWORD (the password of user `idem`),
IDEM_TEST_REDIS_TLS_URL (its TLS port) and IDEM_TEST_REDIS_CA (the CA that signed the
server's certificate). Each check uses its own key prefix.

The file state is the reference: on the same sequence of batches a Redis state must make
the same decisions, so the outputs are compared byte for byte and the counts one by one.

Usage: python tests/redis_state.py path/to/idem
"""

import datetime
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

import pyarrow as pa
import pyarrow.parquet as pq
import redis

from cli_checks import fails_in_one_line

IDEM = sys.argv[1] if len(sys.argv) > 1 else "target/debug/idem"
URL = os.environ["IDEM_TEST_REDIS_URL"]
PASSWORD = os.environ["IDEM_TEST_REDIS_PASSWORD"]
TLS_URL = os.environ["IDEM_TEST_REDIS_TLS_URL"]
CA = os.environ["IDEM_TEST_REDIS_CA"]
WORK = tempfile.mkdtemp(prefix="idem-redis-test-")
SERVER = redis.Redis.from_url(URL)
DAY_US = 86_400_000_000
# Tomorrow, 00:00 UTC: event times ahead of the server's clock, so that no entry expires
# on the clock during a check and the two back-ends see the same keys.
START = (int(time.time()) // 86_400 + 1) * DAY_US
# The counts of the two back-ends that must agree (the Bloom-filter estimate of keys seen
# again after expiry is the file state's own).
COUNTS = ["new_keys", "updated", "seen_before", "deletes_emitted", "deletes_recorded", "late"]


def state_url(prefix, url=URL):
    return f"{url}?prefix={urllib.parse.quote(prefix)}"


def event(day, i, per_day, lsn=None, op="c", time_us=None):
    return dict(event_id=f"d{day}-e{i}", sequence=i % 3,
                lsn=day * per_day + i if lsn is None else lsn, op=op,
                event_time=START + day * DAY_US + i * (DAY_US // per_day) if time_us is None else time_us)


def delivery(day, per_day, lags):
    """Day `day`'s events (every 50th twice), replays of earlier days for each lag, updates
    of 1 % of yesterday's keys, and deletes of 0.5 % of the day before's."""
    events = []
    for i in range(per_day):
        events.append(event(day, i, per_day))
        if i % 50 == 0:
            events.append(event(day, i, per_day))
    for lag in lags:
        if lag <= day:
            events.extend(event(day - lag, i, per_day) for i in range(per_day) if i % 10 == lag)
    if day >= 1:
        events.extend(event(day - 1, i, per_day, lsn=10**9 + day * per_day + i, op="u",
                            time_us=START + day * DAY_US + i)
                      for i in range(per_day) if i % 100 == 3)
    if day >= 2:
        events.extend(event(day - 2, i, per_day, lsn=2 * 10**9 + day * per_day + i, op="d",
                            time_us=START + day * DAY_US + i)
                      for i in range(per_day) if i % 200 == 7)
    return events


def write(name, events):
    path = f"{WORK}/{name}.parquet"
    table = pa.table({
        "event_id": pa.array([e["event_id"] for e in events], pa.string()),
        "sequence": pa.array([e["sequence"] for e in events], pa.int64()),
        "lsn": pa.array([e["lsn"] for e in events], pa.int64()),
        "op": pa.array([e["op"] for e in events], pa.string()),
        "event_time": pa.array([e["event_time"] for e in events], pa.timestamp("us", tz="UTC")),
        "payload": pa.array([f"payload of {e['event_id']} at {e['lsn']}" for e in events], pa.string()),
    })
    pq.write_table(table, path)
    return path


def dedup(inputs, output, state, *extra, check=True, env=None):
    args = [IDEM, "dedup", *([inputs] if isinstance(inputs, str) else inputs), "-o", output,
            "--state", state, "--time-column", "event_time", "--op", "op", "--stats", "-", "-q", *extra]
    done = subprocess.run(args, capture_output=True, text=True, env=env)
    if check and done.returncode != 0:
        sys.exit(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
    return done, (json.loads(done.stdout) if done.returncode == 0 else None)


def check_counts(stats):
    s = stats["state"]
    late_dropped = s["late"] if s["late_policy"] == "drop" else 0
    assert stats["rows_in"] == (stats["rows_out"] + stats["duplicates"] + stats["superseded"]
                                + stats["deleted"] + s["seen_before"] + late_dropped), stats


def entries(prefix):
    """Every entry under `prefix`: key → (value, expiry in ms)."""
    found = {}
    for key in SERVER.scan_iter(match=f"{prefix}:e:*".encode(), count=1000):
        found[key] = (SERVER.get(key), SERVER.pexpiretime(key))
    return found


def decode(value, width=8):
    """An entry's value: (deleted, event time µs, run tag, version) and what it replaced."""
    one = 17 + width

    def entry(b):
        return (b[0] == 1, int.from_bytes(b[1:9], "little", signed=True),
                int.from_bytes(b[9:17], "little"), b[17:one])
    return entry(value[:one]), (entry(value[one:]) if len(value) == 2 * one else None)


# --- the checks -------------------------------------------------------------------------

def same_as_files():
    """Daily batches with replays 1, 2 and 5 days late, updates and deletes across days, a
    2-day retention that expires keys and makes replays late: both back-ends, byte for
    byte, under --late drop and --late emit."""
    per_day = 2000
    for late in ("drop", "emit"):
        prefix = f"same-{late}"
        files_state = f"{WORK}/files-state-{late}"
        for day in range(8):
            batch = write(f"day-{late}-{day}", delivery(day, per_day, [1, 2, 5]))
            extra = ["--retention", "2d", "--late", late]
            _, by_files = dedup(batch, f"{WORK}/out-files-{late}-{day}.parquet", files_state, *extra)
            _, by_redis = dedup(batch, f"{WORK}/out-redis-{late}-{day}.parquet", state_url(prefix), *extra)
            check_counts(by_redis)
            for name in COUNTS:
                assert by_files["state"][name] == by_redis["state"][name], \
                    f"{late} day {day}: {name}: files {by_files['state']} redis {by_redis['state']}"
            for name in ("rows_in", "rows_out", "duplicates", "superseded", "deleted"):
                assert by_files[name] == by_redis[name], f"{late} day {day}: {name}"
            assert by_redis["state"]["watermark"] == by_files["state"]["watermark"]
            assert by_redis["state"]["version"] == day + 1, by_redis["state"]
            with open(f"{WORK}/out-files-{late}-{day}.parquet", "rb") as a, \
                    open(f"{WORK}/out-redis-{late}-{day}.parquet", "rb") as b:
                assert a.read() == b.read(), f"{late} day {day}: the outputs differ"
        assert by_redis["state"]["late"] > 0 and by_redis["state"]["seen_before"] > 0
        assert by_redis["state"]["updated"] > 0 and by_redis["state"]["deletes_emitted"] > 0
        # Every entry expires at its event time + retention, on the server's clock.
        found = entries(prefix)
        assert len(found) >= by_redis["state"]["keys"] > 0
        for key, (value, expires_ms) in found.items():
            (_, time_us, _, _), _ = decode(value)
            assert expires_ms == time_us // 1000 + 2 * 86_400_000, (key, time_us, expires_ms)
        # The same batch again: already applied, nothing read or written.
        output = f"{WORK}/out-redis-{late}-7.parquet"
        before = open(output, "rb").read()
        _, again = dedup(batch, output, state_url(prefix), *extra)
        assert again["state"]["already_applied"] is True and again["state"]["version"] == 8, again
        assert open(output, "rb").read() == before
        assert entries(prefix) == found
    print("same as files: 8 daily batches (replays 1, 2 and 5 days late, updates, deletes, a 2-day "
          "retention) under --late drop and emit gave the file state's outputs byte for byte and its "
          "counts; entries expire at event time + retention (PEXPIRETIME); a re-run is already_applied")


def backfill():
    """Events older than the retention on the server's clock are not kept."""
    now_us = int(time.time() * 1_000_000)
    old = [event(0, i, 1000, time_us=now_us - 10 * DAY_US + i) for i in range(1000)]
    _, stats = dedup(write("backfill", old), f"{WORK}/out-backfill.parquet", state_url("backfill"),
                     "--retention", "2d")
    assert stats["state"]["new_keys"] == 1000 and stats["rows_out"] == 1000, stats
    assert entries("backfill") == {}, "entries of a 10-day-old backfill were kept past a 2-day retention"
    print("backfill: a batch of 10-day-old events against a 2-day retention is emitted, its keys not kept")


def concurrent():
    """Two runs over overlapping batches at once, 10 rounds: every key emitted once in all,
    newer versions win."""
    rng = random.Random(7)
    emitted_twice = 0
    for round_ in range(10):
        prefix = f"race-{round_}"
        shared = list(range(0, 6000))
        a_rows = [event(0, i, 10000) for i in shared + list(range(6000, 8000))]
        b_rows = [event(0, i, 10000) for i in shared + list(range(8000, 10000))]
        # 200 shared keys carry a newer version in the second batch.
        newer = set(rng.sample(shared, 200))
        b_rows = [dict(r, lsn=r["lsn"] + 10**6) if int(r["event_id"].split("e")[-1]) in newer else r
                  for r in b_rows]
        rng.shuffle(a_rows)
        rng.shuffle(b_rows)
        a, b = write(f"race-a-{round_}", a_rows), write(f"race-b-{round_}", b_rows)
        results = {}

        def run(name, batch):
            results[name] = dedup(batch, f"{WORK}/out-race-{name}-{round_}.parquet", state_url(prefix),
                                  "--retention", "7d")

        threads = [threading.Thread(target=run, args=(n, x)) for n, x in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out = {}
        for name in ("a", "b"):
            table = pq.read_table(f"{WORK}/out-race-{name}-{round_}.parquet")
            for k, s, lsn in zip(table["event_id"].to_pylist(), table["sequence"].to_pylist(),
                                 table["lsn"].to_pylist()):
                out.setdefault((k, s), []).append(lsn)
        assert len(out) == 10000, f"round {round_}: {len(out)} keys emitted of 10000"
        for (k, s), lsns in out.items():
            i = int(k.split("e")[-1])
            top = event(0, i, 10000)["lsn"] + (10**6 if i in newer else 0)
            assert lsns.count(top) == 1, f"round {round_}: {k} emitted {lsns}"
            # An older version may pass only before the newer one was recorded.
            assert len(lsns) <= 2 and (len(lsns) == 1 or i in newer), f"round {round_}: {k} {lsns}"
            emitted_twice += len(lsns) == 2
        # The state holds the newest version of every key: what one run after the other
        # leaves.
        for batch in (a, b):
            dedup(batch, f"{WORK}/out-race-ref-{round_}.parquet", state_url(f"race-ref-{round_}"),
                  "--retention", "7d")

        def versions(p):
            return {k[len(p):]: decode(v)[0][3] for k, (v, _) in entries(p).items()}
        assert versions(prefix) == versions(f"race-ref-{round_}"), f"round {round_}: other versions"
    print(f"concurrent: 10 rounds of two runs over 6,000 shared keys emitted every key once, the newest "
          f"version always ({emitted_twice} older versions passed first and were then updated)")


def killed():
    """12 SIGKILLs at random moments; a re-run gives the uninterrupted output and entries."""
    per_day = 20000
    day0 = write("kill-day0", delivery(0, per_day, [1]))
    day1 = write("kill-day1", delivery(1, per_day, [1]))
    extra = ["--retention", "7d"]
    dedup(day0, f"{WORK}/out-kill-ref-0.parquet", state_url("kill-ref"), *extra)
    started = time.monotonic()
    dedup(day1, f"{WORK}/out-kill-ref-1.parquet", state_url("kill-ref"), *extra)
    typical = time.monotonic() - started
    expected = open(f"{WORK}/out-kill-ref-1.parquet", "rb").read()

    def strip(found, prefix):
        return {k[len(prefix):]: v for k, v in found.items()}
    reference = strip(entries("kill-ref"), "kill-ref")
    rng = random.Random(11)
    interrupted = 0
    for attempt in range(12):
        prefix = f"kill-{attempt}"
        dedup(day0, f"{WORK}/out-kill-{attempt}-0.parquet", state_url(prefix), *extra)
        output = f"{WORK}/out-kill-{attempt}-1.parquet"
        p = subprocess.Popen([IDEM, "dedup", day1, "-o", output, "--state", state_url(prefix),
                              "--time-column", "event_time", "--op", "op", "-q", *extra],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.0, typical * 1.1))
        p.send_signal(signal.SIGKILL)
        interrupted += p.wait() == -signal.SIGKILL
        if os.path.exists(output):
            assert open(output, "rb").read() == expected, f"attempt {attempt}: a partial output"
        _, stats = dedup(day1, output, state_url(prefix), *extra)
        assert open(output, "rb").read() == expected, f"attempt {attempt}: {stats}"
        assert strip(entries(prefix), prefix) == reference, f"attempt {attempt}: other entries"
    assert interrupted >= 8, f"only {interrupted} of 12 kills landed before the run ended"
    print(f"killed: 12 runs sent SIGKILL at random moments ({interrupted} before they ended); each "
          "re-run wrote the uninterrupted output byte for byte and the same entries")


def fails(args, *needles, env=None):
    return fails_in_one_line(IDEM, args, *needles, env=env, secret=PASSWORD)


def bad_input():
    batch = write("bad", [event(0, i, 100) for i in range(100)])
    common = ["--time-column", "event_time", "--retention", "1d"]
    out = f"{WORK}/out-bad.parquet"
    host, port = urllib.parse.urlparse(URL).hostname, urllib.parse.urlparse(URL).port
    closed = subprocess.run([sys.executable, "-c", "import socket; s = socket.socket(); "
                             "s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"],
                            capture_output=True, text=True).stdout.strip()
    fails(["dedup", batch, "-o", out, "--state", f"redis://127.0.0.1:{closed}", *common],
          f"redis://127.0.0.1:{closed}")
    fails(["dedup", batch, "-o", out, "--state", f"redis://idem:wrong-{PASSWORD}@{host}:{port}", *common],
          f"redis://idem@{host}:{port}")
    # The right password works, and is never printed.
    done, stats = dedup(batch, out, f"redis://idem:{PASSWORD}@{host}:{port}/0?prefix=bad", "--retention", "1d")
    assert PASSWORD not in done.stdout + done.stderr and stats["state"]["new_keys"] == 100
    assert stats["state"]["location"] == f"redis://idem@{host}:{port}/0?prefix=bad", stats["state"]
    os.remove(out)
    # A prefix built with another key or version, or holding something else.
    fails(["dedup", batch, "-o", out, "--state", state_url("bad"), "--key", "event_id", *common],
          "state was built with key")
    SERVER.set("foreign:meta", "not a state")
    fails(["dedup", batch, "-o", out, "--state", state_url("foreign"), *common], "something else than an idem state")
    SERVER.delete("foreign:meta")
    SERVER.hset("foreign:meta", "a", "b")
    fails(["dedup", batch, "-o", out, "--state", state_url("foreign"), *common], "something else than an idem state")
    assert not os.path.exists(out)
    # A late row under --late error: nothing written, and the entries it claimed put back.
    dedup(write("late-base", [event(5, i, 100) for i in range(100)]), f"{WORK}/out-late-0.parquet",
          state_url("late"), "--retention", "1d")
    before = entries("late")
    mixed = write("late-mixed", [event(6, i, 100) for i in range(100)] + [event(0, 1000, 100, time_us=START)])
    fails(["dedup", mixed, "-o", out, "--state", state_url("late"), *common, "--late", "error"], "watermark")
    assert not os.path.exists(out)
    assert entries("late") == before, "a failed run left its entries behind"
    print("bad input: unreachable server, wrong password, another layout, a foreign prefix, a late row "
          "under --late error: one line, exit 1, no output, entries as before; the password never printed")


def tls():
    host, port = urllib.parse.urlparse(TLS_URL).hostname, urllib.parse.urlparse(TLS_URL).port
    batch = write("tls", [event(0, i, 100) for i in range(100)])
    env = dict(os.environ, SSL_CERT_FILE=CA)
    _, stats = dedup(batch, f"{WORK}/out-tls.parquet", state_url("tls", TLS_URL), "--retention", "1d", env=env)
    assert stats["state"]["new_keys"] == 100
    # Without the CA the server's certificate is not trusted.
    fails(["dedup", batch, "-o", f"{WORK}/out-tls-2.parquet", "--state", state_url("tls2", TLS_URL),
           "--time-column", "event_time", "--retention", "1d"], f"rediss://{host}:{port}")
    print("tls: rediss:// with the server's CA (SSL_CERT_FILE) works, refused without it")


def main():
    started = time.monotonic()
    for check in (same_as_files, backfill, concurrent, killed, bad_input, tls):
        at = time.monotonic()
        check()
        print(f"  ({check.__name__}: {time.monotonic() - at:.1f} s)")
    print(f"redis state: all checks passed in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
