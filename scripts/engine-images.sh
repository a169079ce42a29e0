#!/usr/bin/env bash
# Builds, from Debian binaries `make setup` installs (with the glibc
# libraries they link, FROM scratch), for machines with no registry:
# - stakegate/fleet-engine: redis-server and webdis, for
#   docker-compose.fleet.yml (Redis and Webdis run as two services of it);
# - stakegate/prometheus: prometheus, scraping the gateways in
#   docker-compose.yml with monitoring/'s rules.
set -euo pipefail
cd "$(dirname "$0")/.."

# image NAME BINARY...: one image holding BINARY... under /usr/bin.
image() {
  local name=$1 ctx=target/docker/$(basename "${1%%:*}")
  shift
  rm -rf "$ctx"
  mkdir -p "$ctx/rootfs/usr/bin" "$ctx/rootfs/tmp" "$ctx/rootfs/data"
  for bin in "$@"; do
    path=$(command -v "$bin") || { echo "$bin not found: run make setup" >&2; exit 1; }
    cp -L "$path" "$ctx/rootfs/usr/bin/$bin"
    # Every library ldd resolves, and the dynamic loader, at the same paths.
    ldd "$path" | grep -o '/[^ ]*' | sort -u | while read -r lib; do
      mkdir -p "$ctx/rootfs$(dirname "$lib")"
      cp -L "$lib" "$ctx/rootfs$lib"
    done
  done
  docker build --quiet -f docker/engine.Dockerfile -t "$name" "$ctx"
  docker run --rm "$name" "$1" --version | head -1
}

image "${FLEET_ENGINE_IMAGE:-stakegate/fleet-engine:dev}" redis-server webdis
image "${PROMETHEUS_IMAGE:-stakegate/prometheus:dev}" prometheus
