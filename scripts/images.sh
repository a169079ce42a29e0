#!/usr/bin/env bash
# Builds our images, stakegate/rpc-node and stakegate/loadgen: static (musl)
# binaries FROM scratch, so nothing is pulled. `make images` runs this.
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET=x86_64-unknown-linux-musl
TAG=${STAKEGATE_TAG:-dev}
FONT=${STAKEGATE_FONT:-/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf}

command -v docker >/dev/null || { echo "docker not found: apt-get install docker.io docker-compose" >&2; exit 1; }
[ -f "$FONT" ] || { echo "no font at $FONT for the plots: apt-get install fonts-dejavu-core, or set STAKEGATE_FONT" >&2; exit 1; }
rustup target list --installed | grep -qx "$TARGET" || rustup target add "$TARGET"
# wasmtime compiles a little C: musl's gcc wrapper (Debian's musl-tools).
if ! command -v musl-gcc >/dev/null; then
  command -v apt-get >/dev/null || { echo "musl-gcc not found: install musl-tools" >&2; exit 1; }
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq musl-tools >/dev/null
fi
export CC_x86_64_unknown_linux_musl=${CC_x86_64_unknown_linux_musl:-musl-gcc}
cargo build --profile tools --target "$TARGET" -p rpc-node -p stakegate-loadgen -p stakegate-cli

ctx=target/docker/tools
rm -rf "$ctx"
mkdir -p "$ctx/bin" "$ctx/stakegate" "$ctx/fonts" "$ctx/tmp"
cp "target/$TARGET/tools/rpc-node" "target/$TARGET/tools/loadgen" "target/$TARGET/tools/stakegate" "$ctx/bin/"
cp -r envoy-config scenarios policies "$ctx/stakegate/"
cp "$FONT" "$ctx/fonts/DejaVuSans.ttf"
touch "$ctx/tmp/.keep"
for image in rpc-node loadgen; do
  docker build --quiet -f docker/tools.Dockerfile --target "$image" -t "stakegate/$image:$TAG" "$ctx"
done
docker image ls 'stakegate/*'
