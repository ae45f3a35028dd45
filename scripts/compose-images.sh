#!/usr/bin/env bash
# The images `make compose-test` needs, on a Docker engine that may reach no image
# registry. For each base image that compose/Dockerfile and compose/docker-compose.yml
# name, in order: use it if the engine has it; else pull it; else build a stand-in
# locally and tag it with that same name:
#   debian:bookworm-slim   a Debian root file system made with debootstrap from the
#                          mirror apt-get uses here, imported with `docker import`
#   nginx / redis          that Debian image plus the Debian nginx / redis-server package
# An image that exists under its name is never replaced, so what a user with a
# registry runs does not change. The stand-ins carry the label org.mcpgw.local-base.
#
# Then the mcpgw image of the test, $MCPGW_TEST_IMAGE: the Dockerfile's runtime-base
# stage (user, health check, entrypoint) plus the binaries built on this host
# (BIN, default target/debug), so no Rust is compiled inside a container.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${BIN:-target/debug}
WORK=build/compose
DEBIAN_IMAGE=debian:bookworm-slim
# Keep these two in step with compose/docker-compose.yml (MCPGW_*_IMAGE defaults).
NGINX_IMAGE=${MCPGW_NGINX_IMAGE:-nginx:1.28-bookworm}
REDIS_IMAGE=${MCPGW_REDIS_IMAGE:-redis:7.4-bookworm}
MCPGW_TEST_IMAGE=${MCPGW_TEST_IMAGE:-mcpgw:compose-test}
export DOCKER_BUILDKIT=0 # the engine here has only the legacy builder; say so explicitly
mkdir -p "$WORK"

say() { echo "compose-images: $*"; }

# docker build with its output in a log, shown only when the build fails. Builds may
# run side by side, so each has its own log.
build() { # log-name, docker build arguments...
  local log="$WORK/build-$1.log"
  shift
  if ! docker build "$@" >"$log" 2>&1; then
    cat "$log" >&2
    say "docker build $* failed" >&2
    exit 1
  fi
}

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

# A registry that cannot be reached fails fast (name resolution); one that answers
# slowly is given a minute, then the local stand-in is built.
pull_image() { timeout 60 docker pull -q "$1" >/dev/null 2>&1; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    say "need root (or sudo) to run: $*" >&2; exit 1; fi
}

# The Debian mirror apt-get uses on this machine (deb822 or one-line sources).
debian_mirror() {
  local uri
  uri=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null |
    awk '{print $2}' | grep -E '/debian/?$' | head -1 || true)
  if [ -z "$uri" ]; then
    uri=$(grep -hsE '^deb +(\[[^]]*\] +)?https?://[^ ]*/debian/? ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
      sed -E 's/^deb +(\[[^]]*\] +)?//' | awk '{print $1}' | head -1 || true)
  fi
  echo "${uri:-http://deb.debian.org/debian}"
}

build_debian_base() {
  command -v debootstrap >/dev/null || {
    say "installing debootstrap (apt-get)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  }
  local mirror rootfs
  mirror=$(debian_mirror)
  rootfs="$WORK/rootfs"
  as_root rm -rf "$rootfs"
  say "debootstrap bookworm from $mirror (about a minute)"
  as_root debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1 || {
    tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
  # What a slim image leaves out: package caches and lists, documentation.
  as_root rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*
  as_root tar -C "$rootfs" -c . | docker import \
    --change 'CMD ["bash"]' --change 'LABEL org.mcpgw.local-base=debootstrap' \
    - "$DEBIAN_IMAGE" >/dev/null
  as_root rm -rf "$rootfs"
}

# A stand-in for an official image: the Debian package of the same program. The
# compose file runs each with an explicit command and configuration, which both the
# official image and the Debian package accept.
build_from_debian() { # image, packages, dockerfile tail
  local image=$1 packages=$2 tail=$3
  say "building $image from the Debian package(s) $packages"
  build "${image%%:*}" -t "$image" - <<DOCKERFILE
FROM $DEBIAN_IMAGE
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $packages >/dev/null \
 && apt-get clean && rm -rf /var/lib/apt/lists/*
LABEL org.mcpgw.local-base=debian-package
$tail
DOCKERFILE
}

ensure_base() { # image, builder...
  local image=$1
  shift
  if have_image "$image"; then return; fi
  if pull_image "$image"; then say "pulled $image"; return; fi
  "$@"
}

started=$(date +%s)
ensure_base "$DEBIAN_IMAGE" build_debian_base
# The three images on top of Debian wait mostly on the package mirror: side by side.
builds=()
ensure_base "$NGINX_IMAGE" build_from_debian "$NGINX_IMAGE" "nginx" \
  $'STOPSIGNAL SIGQUIT\nCMD ["nginx", "-g", "daemon off;"]' &
builds+=($!)
ensure_base "$REDIS_IMAGE" build_from_debian "$REDIS_IMAGE" "redis-server" \
  $'USER redis\nCMD ["redis-server"]' &
builds+=($!)
# The runtime stage without binaries, exactly as a registry user's build makes it.
build runtime-base --target runtime-base -t mcpgw-runtime-base:compose-test -f compose/Dockerfile . &
builds+=($!)
failed=0
for pid in "${builds[@]}"; do wait "$pid" || failed=1; done
[ "$failed" = 0 ] || exit 1

# The binaries as the test runs them: debug information stripped (the image is
# smaller, the code the same).
context="$WORK/context"
rm -rf "$context"
mkdir -p "$context/rootfs/usr/local/bin"
for binary in mcpgw mcpgw-bench; do
  [ -x "$BIN/$binary" ] || { say "missing $BIN/$binary: run cargo build first" >&2; exit 1; }
  objcopy --strip-debug "$BIN/$binary" "$context/$binary"
  cp "$context/$binary" "$context/rootfs/usr/local/bin/"
done
compose/collect-libraries.sh "$context/rootfs" "$context/mcpgw" "$context/mcpgw-bench"
cp compose/Dockerfile.host-binaries "$context/Dockerfile"
build runtime --build-arg RUNTIME_BASE=mcpgw-runtime-base:compose-test --target runtime --label org.mcpgw.host-binaries=1 \
  -t "$MCPGW_TEST_IMAGE" "$context"
# The FROM scratch variant, checked to start: its loader, libraries and user work.
build small --build-arg RUNTIME_BASE=mcpgw-runtime-base:compose-test --target small --label org.mcpgw.host-binaries=1 \
  -t "$MCPGW_TEST_IMAGE-small" "$context"
rm -rf "$context"
# The images these replaced (every run brings new binaries) are of no further use.
docker image prune -f --filter label=org.mcpgw.host-binaries=1 >/dev/null
small_version=$(docker run --rm "$MCPGW_TEST_IMAGE-small" --version) || {
  say "the small (FROM scratch) image does not start" >&2; exit 1; }
docker run --rm "$MCPGW_TEST_IMAGE-small" certs init --dir /var/lib/mcpgw/ca >/dev/null || {
  say "the small image cannot write its data directory" >&2; exit 1; }
say "small image: $small_version runs as $(docker image inspect -f '{{.Config.User}}' "$MCPGW_TEST_IMAGE-small"), $(docker image inspect -f '{{.Size}}' "$MCPGW_TEST_IMAGE-small" | awk '{printf "%.0f MB", $1/1e6}')"
say "images ready in $(( $(date +%s) - started )) s: $MCPGW_TEST_IMAGE (and -small), $NGINX_IMAGE, $REDIS_IMAGE"
