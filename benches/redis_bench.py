"""`idem dedup --state redis://…` against the same dedup with a file state and without one.

One input of generated events (`idem generate`, made once, not timed), three contenders,
alternating over the rounds, each run a process of its own measured by GNU time:
  none     `idem dedup IN -o OUT`
  files    `idem dedup IN -o OUT --state DIR …` into a new state directory
  redis    `idem dedup IN -o OUT --state redis://…?prefix=P …` into a new prefix (the
           server is flushed before, so that `INFO memory` after the run is this state's)
with `--time-column event_time --retention 400d` for both states (the generated events are
of 2026-01: a shorter retention would expire them on the server's clock at once) and
`--op op` for all three. The outputs of a round must be byte-identical across the two
states, and hold the same row count as the plain dedup's.

Usage: benches/redis.sh [WORKDIR] [--rows N] [--rounds R]
(which builds idem, starts a redis-server and runs: python benches/redis_bench.py IDEM WORKDIR URL …)
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys

import pyarrow.parquet as pq
import redis

sys.path.insert(0, os.path.dirname(__file__))
from peers import measure  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("idem")
    parser.add_argument("work")
    parser.add_argument("url")
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    events = os.path.join(args.work, f"events-{args.rows}")
    if not os.path.isdir(events):
        subprocess.run([args.idem, "generate", "-o", events, "--rows", str(args.rows),
                        "--files", "8", "--seed", "1"], check=True, stdout=subprocess.DEVNULL)
    # FLUSHALL of millions of keys takes seconds; the client waits for it.
    server = redis.Redis.from_url(args.url, socket_timeout=600)
    server_pid = server.info("server")["process_id"]
    ticks = os.sysconf("SC_CLK_TCK")

    def server_cpu():
        """CPU seconds the server has used (it runs on the same machine)."""
        with open(f"/proc/{server_pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / ticks
    state_args = ["--time-column", "event_time", "--retention", "400d"]
    runs = {"none": [], "files": [], "redis": []}
    memory = []
    server_seconds = []
    for round_ in range(args.rounds):
        outputs = {}
        for name in runs:
            output = os.path.join(args.work, f"out-{name}.parquet")
            if os.path.exists(output):
                os.remove(output)
            argv = [args.idem, "dedup", events, "-o", output, "--op", "op", "-q"]
            if name == "files":
                state = os.path.join(args.work, "state")
                shutil.rmtree(state, ignore_errors=True)
                argv += ["--state", state, *state_args]
            elif name == "redis":
                server.flushall()
                argv += ["--state", f"{args.url}?prefix=bench", *state_args]
            before = server_cpu()
            wall, cpu, rss, failure = measure(argv, 3600)
            if name == "redis":
                server_seconds.append(server_cpu() - before)
            if failure:
                sys.exit(f"{name}: {failure}")
            runs[name].append((wall, cpu, rss))
            outputs[name] = output
            if name == "redis":
                info = server.info("memory")
                keys = server.dbsize()
                memory.append((info["used_memory"], keys))
            print(f"round {round_ + 1} {name}: {wall:.2f} s, cpu {cpu:.2f} s, {rss:.0f} MiB", flush=True)
        with open(outputs["files"], "rb") as a, open(outputs["redis"], "rb") as b:
            assert a.read() == b.read(), "the file state's and the Redis state's outputs differ"
        rows = {name: pq.ParquetFile(path).metadata.num_rows for name, path in outputs.items()}
        assert rows["files"] == rows["redis"] == rows["none"], rows
    none = statistics.median(w for w, _, _ in runs["none"])
    files = statistics.median(w for w, _, _ in runs["files"])
    print(f"\n{args.rows:,} events, medians of {args.rounds} rounds:")
    print("| run | wall | cpu | peak RSS | × no state | × file state |")
    print("|---|---|---|---|---|---|")
    for name, label in (("none", "no state"), ("files", "file state"), ("redis", "Redis state")):
        wall = statistics.median(w for w, _, _ in runs[name])
        cpu = statistics.median(c for _, c, _ in runs[name])
        rss = statistics.median(r for _, _, r in runs[name])
        print(f"| {label} | {wall:.2f} s | {cpu:.2f} s | {rss:.0f} MiB | {wall / none:.2f} | {wall / files:.2f} |")
    used, keys = memory[-1]
    print(f"\nredis-server CPU during a Redis-state run: {statistics.median(server_seconds):.2f} s (median)")
    print(f"Redis after a run: {keys:,} keys (entries and the state's 4 bookkeeping keys), "
          f"used_memory {used / 2**20:.1f} MiB, {used / max(keys, 1):.1f} bytes per key")


if __name__ == "__main__":
    main()
