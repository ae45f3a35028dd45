#!/usr/bin/env bash
# Installs what mcpgw's run and tests need and that a fresh Debian/Ubuntu machine with
# Rust may lack: redis-server and redis-cli (Debian packages) and the Python MCP SDK (in a virtualenv
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
# redis-cli makes the test Redis Cluster (redis-server depends on it; named in case).
command -v redis-cli >/dev/null || apt_packages+=(redis-tools)
command -v python3 >/dev/null || apt_packages+=(python3)
# promtool checks and unit-tests the alert rules (deploy/monitoring).
command -v promtool >/dev/null || apt_packages+=(prometheus)
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
# kubectl (>= 1.27, for `kubectl kustomize` with kustomize 5) renders the Kubernetes
# manifests in tests/tests/kubernetes.rs; Debian's kubernetes-client is too old, so it
# is not installed here. Without it the test checks the base's files unrendered.
command -v kubectl >/dev/null ||
  echo "deps: kubectl not found: tests/tests/kubernetes.rs will fail; install kubectl >= 1.27 from https://kubernetes.io/docs/tasks/tools/ (or set MCPGW_ALLOW_SKIP=kubectl to check deploy/kubernetes/base unrendered)" >&2
