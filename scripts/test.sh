#!/usr/bin/env bash
# The whole test suite, from nothing: formatting, lints, unit / property / end-to-end tests,
# and the check of idem's output against DuckDB on generated data. It installs what the
# tests need (DuckDB from PyPI, in a virtualenv outside the clone) and starts no services.
set -euo pipefail
cd "$(dirname "$0")/.."
target_dir="${CARGO_TARGET_DIR:-$PWD/target}"
venv="${IDEM_TEST_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/idem-test-venv}"

echo "== cargo fmt"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== cargo test"
cargo test --workspace --locked

echo "== DuckDB equivalence"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import duckdb' 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check 'duckdb==2.0.1'
fi
"$venv/bin/python" tests/duckdb_equivalence.py "$target_dir/debug/idem"
