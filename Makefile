# pagedserve on a fresh machine: `make serve` or `make test`. Both set up .venv first.
#
#   make serve [SERVE_ARGS="--model DIR --http-port 8000"]   the server, embedded default model
#   make test [PYTEST_ARGS="-m 'not slow'"]                  the test suite (README)
#   make lint                                                ruff, as CI checks it
#   make bench-cpu | bench-serving | bench-host | bench-placement [ARGS=...]
#   make soak | overload | long-prompt [ARGS=...]           reliability scripts, tiny model
#   make gpu-wheels, then on the GPU host: make bench-gpu [GPU_STEPS="tests bench"]
#
# Setup: torch 2.13.0 (the CPU build, or where `nvidia-smi` finds a GPU the CUDA build and
# the gpu extra: flashinfer and Triton), then this project editable with its test and dev
# extras (TORCH_BUILD=cpu or gpu overrides the guess). It runs again when pyproject.toml
# changes. TORCH_PIP_ARGS goes to the torch install: where the registry's plain torch
# wheel is a CUDA build and a CPU one is wanted,
# TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu".

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_PIP_ARGS ?=
TORCH_BUILD ?= $(shell nvidia-smi -L 2>/dev/null | grep -q GPU && echo gpu || echo cpu)
TORCH_BUILD := $(TORCH_BUILD)
SERVE_ARGS ?=
PYTEST_ARGS ?=
ARGS ?=
GPU_STEPS ?= bench
TINY_MODEL ?= /tmp/pagedserve-tiny-llama

comma := ,
EXTRAS := test,dev$(if $(filter gpu,$(TORCH_BUILD)),$(comma)gpu)
PY := $(VENV)/bin/python
SETUP := $(VENV)/.installed-$(TORCH_BUILD)

.PHONY: help setup serve test lint bench-cpu bench-serving bench-host bench-placement \
	soak overload long-prompt gpu-wheels bench-gpu

help:
	@sed -n '1,/^$$/p' Makefile | sed 's/^# \{0,1\}//'

setup: $(SETUP)

$(SETUP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIP_ARGS) torch==$(TORCH_VERSION)
	@if [ "$(TORCH_BUILD)" = gpu ]; then $(PY) -c 'import sys, torch; sys.exit(torch.version.cuda is None)' \
	  || { echo "torch is a CPU build on a GPU machine: reinstall it with TORCH_PIP_ARGS"; exit 1; }; fi
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	rm -f $(VENV)/.installed-*
	touch $@

serve: $(SETUP)
	$(VENV)/bin/pagedserve serve $(SERVE_ARGS)

test: $(SETUP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(SETUP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# Offline throughput on the CPU workload, pagedserve against transformers' generate.
bench-cpu: $(SETUP)
	$(PY) benchmarks/offline.py --compare-transformers $(ARGS)

# A gRPC server started for the run, a closed loop of 16 streams, offline in the same run.
bench-serving: $(SETUP)
	$(PY) benchmarks/serving.py --start-server --concurrency 16 --num-prompts 64 \
	  --compare-offline $(ARGS)

# The engine's host work per step, the model's compute taken out.
bench-host: $(SETUP)
	$(PY) benchmarks/host_overhead.py $(ARGS)

# The engine loop on a thread against a child process, under the same asyncio front end.
bench-placement: $(SETUP)
	$(PY) benchmarks/engine_placement.py --concurrency 16 64 $(ARGS)

$(TINY_MODEL)/config.json: | $(SETUP)
	$(PY) -c 'import sys; from tests.tiny_models import write_tiny_model; \
	  write_tiny_model(sys.argv[1], "llama")' $(TINY_MODEL)

# docs/RELIABILITY.md gives the figures these print.
soak: $(TINY_MODEL)/config.json
	$(PY) benchmarks/reliability/soak.py --start-server --model $(TINY_MODEL) \
	  --max-token-id 399 --max-num-seqs 32 --num-blocks 1024 --measure-capacity 30 \
	  --load 0.8 --minutes 3 --interval 15 $(ARGS)

overload: $(TINY_MODEL)/config.json
	$(PY) benchmarks/reliability/overload.py --model $(TINY_MODEL) --max-queued-requests 16 \
	  --max-num-seqs 8 --burst 4 --max-tokens 64 --num-blocks 512 $(ARGS)

long-prompt: $(SETUP)
	$(PY) benchmarks/reliability/long_prompt_itl.py --long-prompt 1024 --stream-tokens 64 \
	  --chunk 256 64 --rounds 2 $(ARGS)

# The wheels a GPU host without network needs (into .whl/; run where there is network).
gpu-wheels:
	bash benchmarks/gpu/prepare_wheels.sh

# On the GPU host, in a copy of the repository with .whl/: benchmarks/gpu/run.sh's steps.
bench-gpu:
	bash benchmarks/gpu/run.sh $(GPU_STEPS)
