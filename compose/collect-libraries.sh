#!/bin/sh
# Copies the shared libraries that the given binaries load (and the dynamic loader)
# into ROOT, at the paths the loader looks for them, for a FROM scratch image.
# Usage: collect-libraries.sh ROOT BINARY...
set -eu
root=$1
shift
# One ldd per binary: given several, ldd also prints each binary's path as a header.
for binary in "$@"; do ldd "$binary"; done |
  awk '$2 == "=>" && $3 ~ /^\// { print $3 } NF == 2 && $1 ~ /^\// { print $1 }' | sort -u |
  while read -r library; do
    mkdir -p "$root$(dirname "$library")"
    cp -L "$library" "$root$library"
  done
