#!/usr/bin/env bash
# The PostgreSQL sink benchmark (benches/postgres_bench.py) on a throwaway cluster with
# fsync on, and the binary it measures: a release build of idem with PostgreSQL targets
# and without DataFusion (no LTO: the suite's release-lto build leaves them out).
#
# Usage: benches/postgres.sh [WORKDIR] [postgres_bench.py options…]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-${TMPDIR:-/tmp}/idem-pg-bench}
shift || true
target=${IDEM_PG_BENCH_TARGET:-$HOME/.cache/idem-pg-bench-target}
venv="${IDEM_TEST_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/idem-test-venv}"
(cd "$repo" && CARGO_TARGET_DIR="$target" cargo build --quiet --release --locked \
    --no-default-features --features postgres --bin idem)
source "$repo/scripts/postgres.sh"
trap pg_stop EXIT
pg_start fsync
"$venv/bin/python" "$repo/benches/postgres_bench.py" "$target/release/idem" "$work" "$@"
