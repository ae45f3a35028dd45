#!/usr/bin/env bash
# `make run`: a local mcpgw fleet on this machine — Redis (unless REDIS_URL is given),
# the demo upstream MCP server, mesh certificates for this run, and `mcpgw serve`
# with 4 workers. Prints the MCP URL and a copy-paste curl session. Ctrl-C stops all.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release}
RUN=build/run
WORKERS=${WORKERS:-4}
TRANSPORT=${TRANSPORT:-tcp}
mkdir -p "$RUN"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
port_busy() { python3 -c "import socket,sys; s=socket.socket(); sys.exit(s.connect_ex(('127.0.0.1',$1))!=0)"; }

pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 0' INT TERM

wait_for() { # file, text
  for _ in $(seq 1 300); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "run: timed out waiting for '$2' in $1:" >&2; cat "$1" >&2; exit 1
}

if [ -z "${REDIS_URL:-}" ]; then
  redis_port=$(free_port)
  redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no \
    >"$RUN/redis.log" 2>&1 &
  pids+=($!)
  REDIS_URL="redis://127.0.0.1:$redis_port/"
  wait_for "$RUN/redis.log" "Ready to accept connections"
fi

rm -rf "$RUN/certs"
"$BIN/mcpgw" certs init --dir "$RUN/certs" >/dev/null
"$BIN/mcpgw" certs issue --dir "$RUN/certs" --name local >/dev/null

"$BIN/mcpgw-bench" upstream --listen 127.0.0.1:0 >"$RUN/upstream.log" 2>&1 &
pids+=($!)
wait_for "$RUN/upstream.log" "listening on"
upstream=$(grep -o 'http://[^ ]*' "$RUN/upstream.log" | head -1)

port=${PORT:-8080}
if port_busy "$port"; then port=$(free_port); fi
"$BIN/mcpgw" serve --workers "$WORKERS" --redis "$REDIS_URL" \
  --upstream "demo=$upstream" --listen "127.0.0.1:$port" \
  --mesh-transport "$TRANSPORT" --mesh-listen 127.0.0.1:0 \
  --mesh-ca "$RUN/certs/ca.crt" --mesh-cert "$RUN/certs/local.crt" --mesh-key "$RUN/certs/local.key" \
  >"$RUN/mcpgw.log" 2>&1 &
pids+=($!)
wait_for "$RUN/mcpgw.log" "mcpgw listening on"

url="http://127.0.0.1:$port/mcp"
cat <<TXT

mcpgw is running: $WORKERS workers, mesh over $TRANSPORT.
  MCP endpoint:   $url   (same as http://127.0.0.1:$port/servers/demo/mcp)
  Redis:          $REDIS_URL
  demo upstream:  $upstream
  logs:           $RUN/mcpgw.log

Try a session (copy and paste):

SID=\$(curl -si $url -H 'Content-Type: application/json' -H 'Accept: application/json, text/event-stream' \\
  -d '{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"curl","version":"0"}}}' \\
  | awk 'tolower(\$1)=="mcp-session-id:" {print \$2}' | tr -d '\r'); echo "session: \$SID"
curl -s $url -H 'Content-Type: application/json' -H 'Accept: application/json, text/event-stream' \\
  -H 'MCP-Protocol-Version: 2025-11-25' -H "Mcp-Session-Id: \$SID" -d '{"jsonrpc":"2.0","id":2,"method":"tools/list"}'; echo
curl -s $url -H 'Content-Type: application/json' -H 'Accept: application/json, text/event-stream' \\
  -H 'MCP-Protocol-Version: 2025-11-25' -H "Mcp-Session-Id: \$SID" \\
  -d '{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"echo","arguments":{"text":"hello mcpgw"}}}'; echo

Ctrl-C stops everything.
TXT
wait "${pids[@]}"
