#!/usr/bin/env bash
# Runs every test (unit, property, integration against real processes) and ends with
# one line totalling all test binaries, so the result is readable at a glance.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
cargo test -j"${JOBS:-2}" --workspace --no-fail-fast 2>&1 | tee build/test.log
status=${PIPESTATUS[0]}
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "total: %d passed, %d failed\n", p, f }' build/test.log
exit "$status"
