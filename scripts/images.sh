#!/usr/bin/env bash
# Builds our images, stakegate/rpc-node and stakegate/loadgen, FROM scratch
# so nothing is pulled: the host tools `make build` makes (target/tools/)
# with the glibc libraries they link, at their paths (as
# scripts/engine-images.sh does for Debian's binaries), and the
# healthchecks' probe as a static (musl) binary, since the stack runs it
# inside images that are not ours. `make images` runs this. (The tools were
# static musl builds: a second build of them with wasmtime, about eight
# minutes of a 2-core machine.)
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET=x86_64-unknown-linux-musl
TAG=${STAKEGATE_TAG:-dev}
FONT=${STAKEGATE_FONT:-/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf}

command -v docker >/dev/null || { echo "docker not found: apt-get install docker.io docker-compose" >&2; exit 1; }
[ -f "$FONT" ] || { echo "no font at $FONT for the plots: apt-get install fonts-dejavu-core, or set STAKEGATE_FONT" >&2; exit 1; }
rustup target list --installed | grep -qx "$TARGET" || rustup target add "$TARGET"
# Up to date with the sources: make build's host build (so nothing to do after it).
cargo build --quiet --profile tools --workspace --all-targets
cargo build --quiet --profile tools --target "$TARGET" -p stakegate-probe

ctx=target/docker/tools
rm -rf "$ctx"
mkdir -p "$ctx/bin" "$ctx/libs" "$ctx/stakegate" "$ctx/fonts" "$ctx/tmp"
for tool in rpc-node loadgen stakegate; do
  cp "target/tools/$tool" "$ctx/bin/"
  # Every library ldd resolves, and the dynamic loader, at the same paths.
  ldd "target/tools/$tool" | grep -o '/[^ ]*' | sort -u | while read -r lib; do
    mkdir -p "$ctx/libs$(dirname "$lib")"
    cp -L "$lib" "$ctx/libs$lib"
  done
done
cp "target/$TARGET/tools/stakegate-probe" "$ctx/bin/"
cp -r envoy-config scenarios policies "$ctx/stakegate/"
cp "$FONT" "$ctx/fonts/DejaVuSans.ttf"
touch "$ctx/tmp/.keep"
for image in rpc-node loadgen; do
  docker build --quiet -f docker/tools.Dockerfile --target "$image" -t "stakegate/$image:$TAG" "$ctx"
done
docker image ls 'stakegate/*'
