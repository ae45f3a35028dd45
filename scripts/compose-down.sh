#!/usr/bin/env bash
# `make compose-down`: stops the compose fleet of `make compose-up` and removes its
# containers, network and volumes (the mesh CA with them).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/compose-lib.sh
require_docker compose-down
COMPOSE=$(compose_command)
$COMPOSE -p "${MCPGW_PROJECT:-mcpgw}" -f compose/docker-compose.yml down -v --remove-orphans
