#!/usr/bin/env bash
# Builds the two binaries the peer suite measures, the way a release of idem is built for
# speed: `idem` (the dedup of local files, without DataFusion) and its I/O floor, the
# `copy` example. Both get the same build, so the floor stays a floor:
#
# - the `release-lto` profile (fat LTO, one codegen unit; see Cargo.toml);
# - `-C target-cpu=x86-64-v3` (AVX2, BMI2: every x86-64 server since 2013-2015; Polars'
#   default wheels ask for the same);
# - profile-guided optimisation: an instrumented build deduplicates and copies generated
#   events (seeds the suite does not use, a fraction of its sizes), and the final build is
#   optimised with the profile that run left.
#
# Usage: benches/build.sh OUT_DIR        (puts OUT_DIR/idem and OUT_DIR/copy)
#
# Needs `llvm-profdata` of the LLVM major version rustc was built with (Debian:
# `apt-get install llvm-NN`). Two optimised builds and a training run: 18 min 15 s measured
# on 2 cores from empty target directories. The target directory defaults to one outside
# the clone, so that the next build is incremental.
set -euo pipefail

out=${1:?usage: benches/build.sh OUT_DIR}
repo=$(cd "$(dirname "$0")/.." && pwd)
target_root=${IDEM_BENCH_TARGET:-$HOME/.cache/idem-bench-target}
host=$(rustc -vV | sed -n 's/^host: //p')
llvm_major=$(rustc -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')

profdata=""
for candidate in "llvm-profdata-$llvm_major" "/usr/lib/llvm-$llvm_major/bin/llvm-profdata" llvm-profdata; do
    if command -v "$candidate" >/dev/null &&
        "$candidate" --version 2>/dev/null | grep -q "LLVM version $llvm_major\."; then
        profdata=$candidate
        break
    fi
done
if [[ -z $profdata ]]; then
    echo "build.sh: no llvm-profdata for LLVM $llvm_major (rustc's); install llvm-$llvm_major" >&2
    exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cpu="-C target-cpu=x86-64-v3"

# `--target` keeps RUSTFLAGS off build scripts and proc macros, so that only idem's own
# binaries are instrumented and only their runs write profiles.
# One cargo invocation for both binaries, so that their dependencies are built once with
# the same features.
build() {
    local flags=$1 dir=$2
    (cd "$repo" &&
        RUSTFLAGS="$cpu $flags" CARGO_TARGET_DIR="$dir" cargo build --quiet \
            --profile release-lto --target "$host" --no-default-features \
            -p idem-cli -p idem --bin idem --example copy)
}

# Stable paths in RUSTFLAGS keep the instrumented build incremental; the profile's name
# carries its hash, so that the optimised build is redone exactly when the profile changed
# (cargo does not track the file itself).
raw=$target_root/pgo-raw
rm -rf "$raw"
echo "build.sh: instrumented build" >&2
build "-C profile-generate=$raw" "$target_root/pgo-generate"
trained=$target_root/pgo-generate/$host/release-lto

echo "build.sh: training run" >&2
"$trained/idem" generate -o "$work/events" --rows 2000000 --files 4 --seed 101 >/dev/null
"$trained/idem" generate -o "$work/wide" --rows 200000 --files 2 --extra-columns 91 --seed 102 >/dev/null
"$trained/idem" generate -o "$work/payload" --rows 200000 --files 2 --payload-bytes 2500 --seed 103 >/dev/null
for shape in events wide payload; do
    "$trained/idem" dedup "$work/$shape" -o "$work/$shape-dedup" >/dev/null
done
"$trained/idem" dedup "$work/events" --op op -o "$work/events-deletes" >/dev/null
"$trained/examples/copy" "$work/events" "$work/events-copy" >/dev/null
"$profdata" merge -o "$work/idem.profdata" "$raw"
profile=$target_root/idem-$(sha256sum "$work/idem.profdata" | cut -c1-16).profdata
rm -f "$target_root"/idem-*.profdata
mv "$work/idem.profdata" "$profile"

echo "build.sh: optimised build" >&2
build "-C profile-use=$profile" "$target_root/pgo-use"
optimised=$target_root/pgo-use/$host/release-lto
mkdir -p "$out"
cp "$optimised/idem" "$out/idem"
cp "$optimised/examples/copy" "$out/copy"
echo "build.sh: $out/idem and $out/copy" >&2
