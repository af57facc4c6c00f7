#!/usr/bin/env bash
# The whole test suite, from nothing: formatting, lints, unit / property / end-to-end tests,
# the object-storage tests against a real S3-compatible server, the check of idem's output
# against DuckDB on generated data, the Delta interop check, the PostgreSQL sink and the
# Redis state against real servers. It installs what the tests need (DuckDB, moto,
# deltalake, pyarrow, Polars, psycopg and redis-py from PyPI, in a virtualenv outside the
# clone; Debian's chromium for the report's browser test, postgresql for the sink and
# redis-server for the state), starts moto's S3 server, a throwaway PostgreSQL cluster and
# a redis-server on free loopback ports for the duration of the tests, and stops them on
# exit.
set -euo pipefail
cd "$(dirname "$0")/.."
target_dir="${CARGO_TARGET_DIR:-$PWD/target}"
venv="${IDEM_TEST_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/idem-test-venv}"

echo "== test tools (virtualenv $venv)"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import duckdb, moto.server, deltalake, pyarrow, polars, psycopg, redis' 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check 'duckdb==2.0.1' 'moto[server]==5.2.5' \
    'deltalake==1.6.6' 'pyarrow==26.0.1' 'polars==2.1.0' 'psycopg[binary]==3.3.9' 'redis==8.1.0'
fi

echo "== browser (Debian chromium, for the HTML report test)"
if ! command -v chromium >/dev/null; then
  as_root=""
  [ "$(id -u)" = 0 ] || as_root="sudo"
  $as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $as_root apt-get install -y -qq chromium >/dev/null
fi
export IDEM_TEST_CHROMIUM="$(command -v chromium)"

echo "== S3 server (moto, loopback)"
port="$("$venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$venv/bin/python" -m moto.server -H 127.0.0.1 -p "$port" >"${TMPDIR:-/tmp}/idem-moto-$port.log" 2>&1 &
moto_pid=$!
source scripts/postgres.sh
source scripts/redis.sh
trap 'kill "$moto_pid" 2>/dev/null || true; wait "$moto_pid" 2>/dev/null || true; pg_stop; redis_stop' EXIT
"$venv/bin/python" - "$port" <<'PY'
import sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(200):
    try:
        urllib.request.urlopen(url, timeout=1)
        break
    except OSError:
        time.sleep(0.1)
urllib.request.urlopen(urllib.request.Request(f"{url}/idem-test", method="PUT"), timeout=5)
PY
export IDEM_TEST_S3_BUCKET=idem-test
export AWS_ENDPOINT_URL="http://127.0.0.1:$port" AWS_ALLOW_HTTP=true AWS_REGION=us-east-1
export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing

echo "== PostgreSQL (throwaway cluster, loopback)"
pg_start
echo "postgres on 127.0.0.1:$IDEM_TEST_PG_PORT"

echo "== Redis (throwaway server, loopback)"
redis_start
echo "redis on $IDEM_TEST_REDIS_URL"

echo "== cargo fmt"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== cargo test"
cargo test --workspace --locked

echo "== DuckDB equivalence"
"$venv/bin/python" tests/duckdb_equivalence.py "$target_dir/debug/idem"

echo "== Delta interop (tables written by idem merge, read by delta-rs)"
"$venv/bin/python" tests/delta_interop.py "$target_dir/debug/idem"

echo "== Delta types (every accepted Arrow type merged, read back by delta-rs and Polars)"
"$venv/bin/python" tests/delta_types.py "$target_dir/debug/idem"

echo "== PostgreSQL sink (idem merge into a real server, against a model)"
"$venv/bin/python" tests/postgres_sink.py "$target_dir/debug/idem"

echo "== Redis state (idem dedup --state redis://…, against the file state)"
"$venv/bin/python" tests/redis_state.py "$target_dir/debug/idem"
