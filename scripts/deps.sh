#!/usr/bin/env bash
# Installs what mcpgw's run and tests need and that a fresh Debian/Ubuntu machine with
# Rust may lack: redis-server (Debian package) and the Python MCP SDK (in a virtualenv
# under build/). Idempotent; fast when everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
VENV="$BUILD/venv"

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    echo "deps: need root (or sudo) to run: $*" >&2; exit 1; fi
}

apt_packages=()
command -v redis-server >/dev/null || apt_packages+=(redis-server)
command -v python3 >/dev/null || apt_packages+=(python3)
if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then apt_packages+=(python3-venv); fi
if ((${#apt_packages[@]})); then
  echo "deps: installing ${apt_packages[*]} (apt-get)"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_packages[@]}" >/dev/null
fi

stamp="$VENV/.requirements"
if [ ! -x "$VENV/bin/python" ] || ! cmp -s tests/python/requirements.txt "$stamp"; then
  echo "deps: creating $VENV with the MCP Python SDK"
  rm -rf "$VENV"
  mkdir -p "$BUILD"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check -r tests/python/requirements.txt
  cp tests/python/requirements.txt "$stamp"
fi
