#!/usr/bin/env bash
# The Redis state benchmark (benches/redis_bench.py) on a throwaway redis-server, and the
# binary it measures: a release build of idem with Redis states and without DataFusion
# (no LTO).
#
# Usage: benches/redis.sh [WORKDIR] [redis_bench.py options…]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-${TMPDIR:-/tmp}/idem-redis-bench}
shift || true
target=${IDEM_REDIS_BENCH_TARGET:-$HOME/.cache/idem-redis-bench-target}
venv="${IDEM_TEST_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/idem-test-venv}"
(cd "$repo" && CARGO_TARGET_DIR="$target" cargo build --quiet --release --locked \
    --no-default-features --features redis --bin idem)
source "$repo/scripts/redis.sh"
trap redis_stop EXIT
redis_start
"$venv/bin/python" "$repo/benches/redis_bench.py" "$target/release/idem" "$work" "$IDEM_TEST_REDIS_URL" "$@"
