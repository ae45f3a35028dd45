#!/usr/bin/env bash
# `make nemesis`: the compose fleet under a seeded random schedule of faults, clients
# that record everything, and a checker of the whole history (compose/test/nemesis.py
# says what it injects and checks). NEMESIS_SECONDS (default 300), NEMESIS_SEED
# (default random, printed first: the same seed repeats the same schedule),
# NEMESIS_FAULTS (at most this many faults), NEMESIS_SLOTS (client slots, default 15).
# Images, a unique compose project and the teardown on any exit as in
# scripts/compose-test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/compose-lib.sh
require_docker nemesis
started=$(date +%s)
export NEMESIS_SEED=${NEMESIS_SEED:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' \n')}
export NEMESIS_SECONDS=${NEMESIS_SECONDS:-300}
echo "nemesis: seed $NEMESIS_SEED, $NEMESIS_SECONDS s (replay: NEMESIS_SEED=$NEMESIS_SEED NEMESIS_SECONDS=$NEMESIS_SECONDS make nemesis)"
COMPOSE=$(compose_command)
PROJECT="mcpgwnemesis$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')"
export MCPGW_COMPOSE="$COMPOSE" MCPGW_COMPOSE_PROJECT="$PROJECT"
export MCPGW_IMAGE=${MCPGW_IMAGE:-mcpgw:compose-test}
export MCPGW_TEST_IMAGE="$MCPGW_IMAGE"
echo "nemesis: $COMPOSE, project $PROJECT"

# The checker first, fed each anomaly (must fail) and a clean history (must pass).
build/venv/bin/python compose/test/nemesis.py --self-test
build/venv/bin/python compose/test/nemesis.py --plan
export NEMESIS_PLAN_PRINTED=1
if [ "${NEMESIS_SKIP_IMAGES:-0}" != 1 ]; then
  BIN=${BIN:-target/debug} scripts/compose-images.sh
fi
mkdir -p build/compose build/nemesis

teardown() {
  local status=$? label="label=com.docker.compose.project=$PROJECT" left
  trap - EXIT INT TERM
  # A fault may leave a container paused (compose cannot stop it) or cut off.
  left=$(docker ps -q --filter "$label" --filter status=paused)
  if [ -n "$left" ]; then docker unpause $left >/dev/null 2>&1 || true; fi
  $COMPOSE -p "$PROJECT" -f compose/docker-compose.yml down -v --remove-orphans -t 5 \
    >build/nemesis/down.log 2>&1 || cat build/nemesis/down.log >&2
  left=$(docker ps -aq --filter "$label")
  if [ -n "$left" ]; then docker rm -f -v $left >/dev/null 2>&1 || true; fi
  left=$(docker network ls -q --filter "$label")
  if [ -n "$left" ]; then docker network rm $left >/dev/null 2>&1 || true; fi
  left=$(docker volume ls -q --filter "$label")
  if [ -n "$left" ]; then docker volume rm -f $left >/dev/null 2>&1 || true; fi
  left="$(docker ps -aq --filter "$label") $(docker network ls -q --filter "$label") $(docker volume ls -q --filter "$label")"
  if [ -n "${left// /}" ]; then
    echo "nemesis: could not remove everything of $PROJECT: $left" >&2
    status=1
  else
    echo "nemesis: torn down: no container, network or volume of $PROJECT left"
  fi
  echo "nemesis: seed $NEMESIS_SEED $([ "$status" = 0 ] && echo passed || echo FAILED)" \
    "in $(( $(date +%s) - started )) s (replay: NEMESIS_SEED=$NEMESIS_SEED NEMESIS_SECONDS=$NEMESIS_SECONDS make nemesis)"
  exit "$status"
}
trap teardown EXIT

# The driver bounds its waits; `timeout` bounds the whole run (the faults' time, the
# fleet's start, the settle time, the reading of logs) in case it hangs. In the
# background so that an interrupt reaches it at once, and teardown follows.
timeout $((NEMESIS_SECONDS + 600)) build/venv/bin/python -u compose/test/nemesis.py &
driver=$!
interrupted=0
trap 'interrupted=1; kill -TERM "$driver" 2>/dev/null || true' INT TERM
status=0
wait "$driver" || status=$?
if [ "$interrupted" = 1 ]; then
  wait "$driver" 2>/dev/null || true
  echo "nemesis: interrupted" >&2
  exit 130
fi
exit "$status"
