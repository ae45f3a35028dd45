#!/usr/bin/env bash
# `make compose-up`: the container fleet of compose/docker-compose.yml (Redis, the demo
# upstream, 3 gateway containers x 2 workers, nginx) under the compose project
# $MCPGW_PROJECT (default mcpgw), with the image built from compose/Dockerfile; waits
# until the load balancer is healthy and prints the MCP URL and a curl session.
#
# MCPGW_HOST_BINARIES=1 is for a Docker engine that reaches no registry (as on this
# project's CI machine): the images are built as `make compose-test` builds them
# (scripts/compose-images.sh), with release binaries built on this host.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/compose-lib.sh
require_docker compose-up
COMPOSE=$(compose_command)
PROJECT=${MCPGW_PROJECT:-mcpgw}

port_busy() { python3 -c "import socket,sys; s=socket.socket(); sys.exit(s.connect_ex(('127.0.0.1',$1))!=0)"; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
already_up=$(docker ps -q --filter "label=com.docker.compose.project=$PROJECT" --filter "label=com.docker.compose.service=lb")
if [ -z "${MCPGW_LB_PORT:-}" ]; then
  MCPGW_LB_PORT=8080
  if [ -z "$already_up" ] && port_busy 8080; then MCPGW_LB_PORT=$(free_port); fi
fi
export MCPGW_LB_PORT

if [ "${MCPGW_HOST_BINARIES:-0}" = 1 ]; then
  BIN=${BIN:-target/release}
  if [ "$BIN" = target/release ]; then cargo build -j"${JOBS:-2}" --release --workspace --bins; fi
  export MCPGW_IMAGE=${MCPGW_IMAGE:-mcpgw:host-binaries}
  BIN=$BIN MCPGW_TEST_IMAGE=$MCPGW_IMAGE scripts/compose-images.sh
  build=--no-build
else
  build=--build
fi
$COMPOSE -p "$PROJECT" -f compose/docker-compose.yml up -d $build
wait_healthy "$PROJECT" lb 120

url="http://${MCPGW_LB_BIND:-127.0.0.1}:$MCPGW_LB_PORT/mcp"
cat <<TXT

The mcpgw container fleet is up (compose project $PROJECT): 3 gateway containers with
${MCPGW_WORKERS:-2} workers each behind nginx (round-robin, no session pinning), Redis, the demo upstream.
  MCP endpoint:   $url
  containers:     docker ps --filter label=com.docker.compose.project=$PROJECT
  logs:           $COMPOSE -p $PROJECT -f compose/docker-compose.yml logs -f gw1

Try a session (copy and paste); the mcpgw-edge-worker / mcpgw-owner-worker headers
show which container received each request and which one executed it:

SID=\$(curl -si $url -H 'Content-Type: application/json' -H 'Accept: application/json, text/event-stream' \\
  -d '{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"curl","version":"0"}}}' \\
  | awk 'tolower(\$1)=="mcp-session-id:" {print \$2}' | tr -d '\r'); echo "session: \$SID"
curl -si $url -H 'Content-Type: application/json' -H 'Accept: application/json, text/event-stream' \\
  -H 'MCP-Protocol-Version: 2025-11-25' -H "Mcp-Session-Id: \$SID" \\
  -d '{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"counter_increment","arguments":{}}}'; echo

\`make compose-down\` stops it and removes its containers, network and volumes.
TXT
