#!/usr/bin/env bash
# `make compose-test`: the compose fleet under faults, end to end (compose/test/fleet_faults.py
# says what it checks). Builds the images it needs without a registry
# (scripts/compose-images.sh, binaries from target/debug), runs the fleet under a unique
# compose project name, and removes every container, network and volume of that project
# afterwards, also when a step fails or the run is interrupted.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/compose-lib.sh
require_docker compose-test
started=$(date +%s)
COMPOSE=$(compose_command)
PROJECT="mcpgwtest$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')"
export MCPGW_COMPOSE="$COMPOSE" MCPGW_COMPOSE_PROJECT="$PROJECT"
export MCPGW_IMAGE=${MCPGW_IMAGE:-mcpgw:compose-test}
export MCPGW_TEST_IMAGE="$MCPGW_IMAGE"
echo "compose-test: $COMPOSE, project $PROJECT"

# First the driver's checks, each fed an input that must fail it (a second, no fleet).
build/venv/bin/python compose/test/fleet_faults.py --self-test
BIN=${BIN:-target/debug} scripts/compose-images.sh
images_done=$(date +%s)

teardown() {
  local status=$? label="label=com.docker.compose.project=$PROJECT" left
  trap - EXIT INT TERM
  # A failed step may leave a container paused (compose cannot stop it) or cut off.
  left=$(docker ps -q --filter "$label" --filter status=paused)
  if [ -n "$left" ]; then docker unpause $left >/dev/null 2>&1 || true; fi
  $COMPOSE -p "$PROJECT" -f compose/docker-compose.yml down -v --remove-orphans -t 5 \
    >build/compose/down.log 2>&1 || cat build/compose/down.log >&2
  # Whatever compose did not remove (one-off containers of an interrupted run).
  left=$(docker ps -aq --filter "$label")
  if [ -n "$left" ]; then docker rm -f -v $left >/dev/null 2>&1 || true; fi
  left=$(docker network ls -q --filter "$label")
  if [ -n "$left" ]; then docker network rm $left >/dev/null 2>&1 || true; fi
  left=$(docker volume ls -q --filter "$label")
  if [ -n "$left" ]; then docker volume rm -f $left >/dev/null 2>&1 || true; fi
  left="$(docker ps -aq --filter "$label") $(docker network ls -q --filter "$label") $(docker volume ls -q --filter "$label")"
  if [ -n "${left// /}" ]; then
    echo "compose-test: could not remove everything of $PROJECT: $left" >&2
    status=1
  else
    echo "compose-test: torn down: no container, network or volume of $PROJECT left"
  fi
  local ended
  ended=$(date +%s)
  echo "compose-test: $([ "$status" = 0 ] && echo passed || echo FAILED) in $((ended - started)) s" \
    "(images $((images_done - started)) s, fleet and steps $((ended - images_done)) s)"
  exit "$status"
}
trap teardown EXIT

# The driver bounds every wait itself; `timeout` bounds the whole run in case it hangs.
# It runs in the background so that an interrupt reaches it at once (and teardown
# follows), also when the signal is sent to this script alone.
timeout 900 build/venv/bin/python -u compose/test/fleet_faults.py &
driver=$!
interrupted=0
trap 'interrupted=1; kill -TERM "$driver" 2>/dev/null || true' INT TERM
status=0
wait "$driver" || status=$?
if [ "$interrupted" = 1 ]; then
  wait "$driver" 2>/dev/null || true
  echo "compose-test: interrupted" >&2
  exit 130
fi
exit "$status"
