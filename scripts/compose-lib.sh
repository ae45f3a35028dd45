# Shared by the compose scripts (sourced): which compose command this machine has.
# `docker compose` (v2) when the plugin is there, else `docker-compose` (v1.29).
compose_command() {
  if docker compose version >/dev/null 2>&1; then
    echo "docker compose"
  elif command -v docker-compose >/dev/null 2>&1; then
    echo "docker-compose"
  else
    echo "neither \`docker compose\` nor \`docker-compose\` is installed" >&2
    return 1
  fi
}

require_docker() {
  if ! docker info >/dev/null 2>&1; then
    echo "$1: no Docker engine answers (\`docker info\` failed); start Docker or set DOCKER_HOST" >&2
    exit 1
  fi
}

# Waits for a compose service's container to report healthy (compose v1 has no --wait).
wait_healthy() { # project service seconds
  local project=$1 service=$2 seconds=$3 id status
  for _ in $(seq 1 $((seconds * 2))); do
    id=$(docker ps -aq --filter "label=com.docker.compose.project=$project" \
      --filter "label=com.docker.compose.service=$service" --filter "label=com.docker.compose.oneoff=False")
    status=$(docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}' $id 2>/dev/null || true)
    [ "$status" = healthy ] && return 0
    sleep 0.5
  done
  echo "$service did not become healthy within $seconds s (now: ${status:-missing})" >&2
  return 1
}
