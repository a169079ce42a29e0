#!/usr/bin/env bash
# Writes every scenario's simulator summary (JSON) into DIR, to compare two
# builds byte for byte: a change that must keep every decision (a refactor,
# a speed-up) leaves them identical.
#
#   make build && scripts/sim-summaries.sh /tmp/before
#   (change, make build) && scripts/sim-summaries.sh /tmp/after
#   diff -r /tmp/before /tmp/after
set -euo pipefail
dir=${1:?usage: scripts/sim-summaries.sh DIR}
mkdir -p "$dir"
cd "$(dirname "$0")/.."
for scenario in scenarios/*.toml; do
  name=$(basename "$scenario" .toml)
  if ! ./target/tools/stakegate sim --json "$scenario" > "$dir/$name.json" 2> "$dir/$name.err"; then
    # The simulator runs one gateway: a fleet runs for real only.
    grep -q 'the simulator runs one gateway' "$dir/$name.err" || { cat "$dir/$name.err"; exit 1; }
    rm "$dir/$name.json"
  fi
  rm "$dir/$name.err"
done
echo "$(ls "$dir" | wc -l) summaries in $dir"
