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
if [ "$status" -ne 0 ]; then
  # CI keeps only the end of this output: name each failed test and its panic here,
  # so a failure that happens once can be read afterwards, not only its binary.
  awk '/^---- .* stdout ----$/ { name = $2; lines = 0; next }
       name != "" && /panicked at/ { print "FAILED " name ": " substr($0, 1, 300); lines = 6; next }
       lines > 0 { print "    " substr($0, 1, 300); lines--; if (lines == 0) name = "" }' build/test.log
fi
exit "$status"
