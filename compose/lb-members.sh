#!/bin/bash
# Which gateway containers nginx spreads requests over (compose/nginx.conf includes the
# file this writes). Runs inside the lb container, as `lb-members`:
#   lb-members --init gw1 gw2 gw3   at the container's start: writes the list unless
#                                   one is there already (a restart keeps it)
#   lb-members gw1 gw3              sets the list, has nginx check it, reloads nginx and
#                                   returns once the workers of the old list are gone
# A gateway left out gets no new request; the requests it has finish (nginx reloads
# gracefully). nginx resolves the names when it loads the list, so a name must belong to
# a running container: take a gateway out before stopping it, put it back once it is
# ready (docs/operations.md, "Rolling replacement").
set -euo pipefail
FILE=/etc/mcpgw/upstreams.conf
CONF=/etc/mcpgw/nginx.conf
PID_FILE=/tmp/nginx.pid
init=0
if [ "${1:-}" = --init ]; then init=1; shift; fi
[ $# -gt 0 ] || { echo "usage: lb-members [--init] GATEWAY..." >&2; exit 2; }
for gw in "$@"; do
  [[ $gw =~ ^[A-Za-z0-9][A-Za-z0-9.-]*$ ]] || { echo "lb-members: not a host name: $gw" >&2; exit 2; }
done
if [ "$init" = 1 ] && [ -s "$FILE" ]; then exit 0; fi
list=$(for gw in "$@"; do
  # One failed connect takes a container out for 2 s; nginx then tries it again.
  echo "server $gw:8080 max_fails=1 fail_timeout=2s;"
done)
if [ "$init" = 1 ]; then
  printf '%s\n' "$list" >"$FILE"
  exit 0
fi

# The worker processes of the running master: gone once the reload is done.
workers() {
  local master pid ppid
  master=$(cat "$PID_FILE")
  for stat in /proc/[0-9]*/stat; do
    { read -r pid _ _ ppid _ <"$stat"; } 2>/dev/null || continue
    if [ "$ppid" = "$master" ]; then echo "$pid"; fi
  done
  return 0
}

cp "$FILE" "$FILE.previous"
printf '%s\n' "$list" >"$FILE"
if ! nginx -t -q -c "$CONF"; then
  mv "$FILE.previous" "$FILE"
  echo "lb-members: nginx refused the list ($*); the previous one stays" >&2
  exit 1
fi
old=$(workers)
nginx -c "$CONF" -s reload
# Old workers finish the requests they hold, then exit; their requests can be long
# (held streams), so this waits a while, then says which are left.
for _ in $(seq 1 300); do
  left=""
  for pid in $old; do
    if [ -e "/proc/$pid" ]; then left="$left $pid"; fi
  done
  if [ -z "$left" ]; then echo "lb-members: nginx serves $*"; exit 0; fi
  sleep 0.1
done
echo "lb-members: nginx serves $* for new requests; old workers$left still finish theirs"
