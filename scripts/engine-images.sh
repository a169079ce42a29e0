#!/usr/bin/env bash
# Builds stakegate/fleet-engine: Debian's redis-server and webdis (the ones
# `make setup` installs) with the glibc libraries they link, FROM scratch,
# for docker-compose.fleet.yml on machines with no registry. The fleet file
# runs Redis and Webdis as two services of this one image.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${FLEET_ENGINE_IMAGE:-stakegate/fleet-engine:dev}
ctx=target/docker/fleet-engine
rm -rf "$ctx"
mkdir -p "$ctx/rootfs/usr/bin" "$ctx/rootfs/tmp" "$ctx/rootfs/data"
for bin in redis-server webdis; do
  path=$(command -v "$bin") || { echo "$bin not found: run make setup" >&2; exit 1; }
  cp -L "$path" "$ctx/rootfs/usr/bin/$bin"
  # Every library ldd resolves, and the dynamic loader, at the same paths.
  ldd "$path" | grep -o '/[^ ]*' | sort -u | while read -r lib; do
    mkdir -p "$ctx/rootfs$(dirname "$lib")"
    cp -L "$lib" "$ctx/rootfs$lib"
  done
done
docker build --quiet -f docker/fleet-engine.Dockerfile -t "$IMAGE" "$ctx"
docker run --rm "$IMAGE" redis-server --version
