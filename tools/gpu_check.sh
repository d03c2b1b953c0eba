#!/usr/bin/env bash
# The GPU check of dqcoll, in one call on a machine with one NVIDIA GPU (H100/H200):
#
#   tools/gpu_check.sh                 # env, tests, bench (the default sections, in order)
#   tools/gpu_check.sh tests bench     # chosen sections only
#   tools/gpu_check.sh tune            # launch-config sweep of the fused kernel (not default)
#
# Sections (each a function `section_<name>` below, run in the order given):
#   env    the GPU, driver, Python, torch (+CUDA), Triton; fails early if torch sees no GPU
#   tests  every test marked `gpu` (tests/test_kernels.py: kernels byte for byte against
#          the CPU reference at large sizes, offsets above 2**31, the full all-reduce on CUDA
#          tensors over the `local` transport equal to the CPU run)
#   bench  benchmarks/kernels.py: each kernel at 2^20..2^28 coordinates (step 2^2) and widths
#          2/4/8, CUDA events after warm-up, GB/s and % of the copy bandwidth measured in the same
#          run, speed-up vs the torch reference; writes benchmarks/results/kernels-<device>.json;
#          then benchmarks/kernels.py --aot <arch> (executed SASS per coordinate, the predicted
#          % of copy bandwidth) into $RESULTS_DIR/kernels-aot-sm<arch>.json beside it
#   tune   benchmarks/kernels.py --tune at 2^26: rows-per-program x warps of the fused kernel;
#          copy the winners into dqcoll/kernels/_launch.py with the device and commit
#   nccl   the NCCL transport (docs/gpu_transport.md): tests marked `multi_rank_gpu` (2 and 3 NCCL
#          ranks sharing the one GPU - a distinct NCCL_HOSTID each, sockets over loopback - run
#          every scheme x algorithm x collective, tiled and untiled, CuPy arrays, async_op; all
#          ranks bit-identical and equal to the `local` transport; a stalled rank times out naming
#          the step), then the torchrun example with 4 NCCL ranks on the GPU (--fake-hosts)
#   nccl_bench  benchmarks/nccl_local.py: 8 ranks on the GPU through the `local` transport,
#          256 MiB fp32 per rank, dynamiq vs none, untiled and 4 MiB tiles, time and share of the
#          time in kernels; writes $RESULTS_DIR/nccl_local.json
#   (nccl and nccl_bench are not default sections: run them in a call of their own,
#    `tools/gpu_check.sh nccl nccl_bench`, ~5-8 min together)
#
# To add a check (e.g. the NCCL multi-rank tier): write `section_<name>() { ...; }` below, return
# non-zero on failure, and append <name> to ALL_SECTIONS (and to DEFAULT_SECTIONS if it should run
# by default). Logs and results go to $RESULTS_DIR (default benchmarks/results/gpu_check/) and are
# also copied to $OUT when that is set (the device runner returns $OUT).
#
# Python: $PYTHON if set, else the first of .venv/bin/python, python3 whose torch sees a GPU. The
# machine needs torch with CUDA, Triton and pytest installed (`pip install -e ".[cuda12,test]"`).
# Budget: tests ~5 min (Triton compiles each kernel variant once, ~3 s each), bench ~3-5 min.

set -uo pipefail
cd "$(dirname "$0")/.."

ALL_SECTIONS=(env tests bench tune nccl nccl_bench)
DEFAULT_SECTIONS=(env tests bench)
RESULTS_DIR="${RESULTS_DIR:-benchmarks/results/gpu_check}"
mkdir -p "$RESULTS_DIR"

has_cuda_torch() {
    "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null
}
pick_python() {
    if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; return; fi
    local candidate
    for candidate in .venv/bin/python python3; do
        if command -v "$candidate" >/dev/null && has_cuda_torch "$candidate"; then
            echo "$candidate"; return
        fi
    done
    # No CUDA torch anywhere: use the project's environment so the env section says why.
    if [[ -x .venv/bin/python ]]; then echo ".venv/bin/python"; else echo "python3"; fi
}
PY="$(pick_python)"
unset DQCOLL_KERNELS  # automatic dispatch: Triton for CUDA tensors

section_env() {
    nvidia-smi || echo "nvidia-smi not available"
    "$PY" - <<'EOF'
import sys
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except Exception as exc:
    print("triton: not importable:", exc)
    sys.exit(1)
if not torch.cuda.is_available():
    print("torch sees no CUDA device: install a CUDA build of torch")
    sys.exit(1)
print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
EOF
}

section_tests() {
    "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs tests
}

section_bench() {
    "$PY" benchmarks/kernels.py --min-log2 20 --max-log2 28 --step 2 || return 1
    # The compile-only prediction of the same commit beside the measurement (issue 15): executed
    # SASS per coordinate and the implied % of copy bandwidth, for the fused hop's measured GB/s.
    local arch
    arch="$("$PY" -c 'import torch; m, n = torch.cuda.get_device_capability(0); print(10 * m + n)')"
    "$PY" benchmarks/kernels.py --aot "$arch" --json "$RESULTS_DIR/kernels-aot-sm${arch}.json"
}

section_tune() {
    local device
    device="$("$PY" -c 'import torch, re; print(re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-"))')"
    "$PY" benchmarks/kernels.py --tune --min-log2 26 --max-log2 26 \
        --kernels decode_accumulate_encode --out "benchmarks/results/kernels-${device}-tune.json"
}

section_nccl() {
    local status=0
    # the repo on the path of every process (dqcoll need not be installed on the GPU machine)
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    # CuPy links libnccl.so.2 dynamically: let it find the pip wheel's copy (nvidia-nccl-cu1x)
    local nccl_lib
    nccl_lib="$("$PY" -c 'import os, nvidia.nccl as m; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null)"
    if [[ -n "$nccl_lib" && -d "$nccl_lib" ]]; then
        export LD_LIBRARY_PATH="$nccl_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        echo "NCCL library directory: $nccl_lib"
    fi
    "$PY" - <<'EOF' || return 1
import sys
from dqcoll.transports.cupy_nccl import nccl_unavailable_reason
reason = nccl_unavailable_reason()
if reason is not None:
    print("NCCL cannot run here:", reason)
    sys.exit(1)
from cupy.cuda import nccl
print("cupy NCCL available, NCCL version", nccl.get_version())
EOF
    "$PY" -m pytest -q -p no:cacheprovider -m "multi_rank_gpu or gpu" -rs \
        tests/test_nccl_transport.py tests/test_pipelining.py || status=1
    "$PY" -m torch.distributed.run --nproc-per-node 4 examples/torchrun_allreduce.py \
        --fake-hosts --numel 16M --iters 3 --check || status=1
    return $status
}

section_nccl_bench() {
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    "$PY" benchmarks/nccl_local.py --world-size 8 --size 256M --schemes none,dynamiq \
        --tile-nbytes 0,4M --iters 3 --out "${RESULTS_DIR}/nccl_local.json"
}

run_sections() {
    local failed=() name status
    for name in "$@"; do
        if ! declare -F "section_${name}" >/dev/null; then
            echo "unknown section '${name}'; sections: ${ALL_SECTIONS[*]}" >&2
            return 2
        fi
    done
    for name in "$@"; do
        echo "=== gpu_check: ${name} ==="
        local start=$SECONDS
        "section_${name}" 2>&1 | tee "${RESULTS_DIR}/${name}.log"
        status=${PIPESTATUS[0]}
        echo "=== gpu_check: ${name}: exit ${status} after $((SECONDS - start)) s ==="
        [[ $status -eq 0 ]] || failed+=("$name")
    done
    cp benchmarks/results/kernels-*.json "$RESULTS_DIR"/ 2>/dev/null || true
    if [[ -n "${OUT:-}" ]]; then
        mkdir -p "$OUT/gpu_check" && cp -r "$RESULTS_DIR"/. "$OUT/gpu_check/"
    fi
    if [[ ${#failed[@]} -gt 0 ]]; then
        echo "gpu_check: FAILED sections: ${failed[*]}"
        return 1
    fi
    echo "gpu_check: all sections passed ($*)"
}

if [[ $# -eq 0 ]]; then
    run_sections "${DEFAULT_SECTIONS[@]}"
else
    run_sections "$@"
fi
