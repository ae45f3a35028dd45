#!/bin/bash
# Container health probe without curl: GET http://127.0.0.1:PORT/PATH over bash's
# /dev/tcp; healthy on a 200. Usage: http-health PORT PATH
set -u
port=${1:?usage: http-health PORT PATH}
path=${2:-/}
exec 3<>"/dev/tcp/127.0.0.1/$port" || exit 1
printf 'GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n' "$path" >&3
IFS= read -r -t 3 status <&3 || { echo "no answer from 127.0.0.1:$port$path"; exit 1; }
case $status in
  "HTTP/1."[01]" 200"*) exit 0 ;;
  *) echo "127.0.0.1:$port$path answered: ${status%$'\r'}"; exit 1 ;;
esac
