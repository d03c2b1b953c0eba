#!/usr/bin/env bash
# The GPU check of dqcoll, on a machine with one NVIDIA GPU (H100/H200):
#
#   tools/gpu_check.sh                 # env, tests, bench (the default sections, in order)
#   tools/gpu_check.sh tests bench     # chosen sections only
#   tools/gpu_check.sh nccl            # the NCCL transports (not default)
#   tools/gpu_check.sh tune            # launch-config sweep of the fused kernel (not default)
#
# Time limits. A GPU runner stops a command at 10 minutes, and a cold start compiles ~370 Triton
# variants (~0.5 s each, ~3 min per process). So nothing is kept for the end: each section's log
# is written straight into $OUT/gpu_check/ (when $OUT is set) and its JSON results are copied
# there as soon as it ends; each section runs under its own limit (SECTION_LIMIT_S, below); and
# the script starts a section only while its estimate fits in what is left of GPU_CHECK_BUDGET_S
# (default 540 s). Sections it did not start are listed with the command that runs them next,
# so the whole check is a few calls, each under 10 minutes (docs/kernels.md, "GPU check"):
#   call 1  tools/gpu_check.sh env tests   ~5 min cold (Triton compiles), ~2 min warm
#   call 2  tools/gpu_check.sh bench       ~3-5 min
#   call 3  tools/gpu_check.sh nccl        ~5-8 min
#   call 4  tools/gpu_check.sh nccl_bench  ~3 min
#   call 5  tools/gpu_check.sh tune        ~5 min
#
# Sections (each a function `section_<name>` below, run in the order given):
#   env    the GPU, driver, Python, torch (+CUDA), Triton, CuPy, nccl4py; fails early if torch
#          sees no GPU
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
#   nccl   the NCCL transports (docs/gpu_transport.md), nccl4py and CuPy's each: tests marked
#          `multi_rank_gpu` (2 and 3 NCCL ranks sharing the one GPU - a distinct NCCL_HOSTID
#          each, sockets over loopback - run every scheme x algorithm x collective, tiled and
#          untiled, CuPy arrays, async_op; all ranks bit-identical and equal to the `local`
#          transport; a stalled rank times out naming the step, and the caller's buffer is left
#          untouched), then the torchrun example with 4 NCCL ranks on the GPU (--fake-hosts)
#   nccl_bench  benchmarks/nccl_local.py: 8 ranks on the GPU through the `local` transport,
#          256 MiB fp32 per rank, dynamiq vs none, untiled and 4 MiB tiles, time and share of the
#          time in kernels; writes $RESULTS_DIR/nccl_local.json
#
# To add a check: write `section_<name>() { ...; }` below, return non-zero on failure, give it an
# estimate in SECTION_ESTIMATE_S, and append <name> to ALL_SECTIONS (and to DEFAULT_SECTIONS if it
# should run by default). GPU_CHECK_EXTRA=<file> sources more section definitions (the CPU test
# of this script uses it for stub sections). Logs and results go to $RESULTS_DIR (default
# benchmarks/results/gpu_check/) and to $OUT/gpu_check/ when $OUT is set (the device runner
# returns $OUT).
#
# Python: $PYTHON if set, else the first of .venv/bin/python, python3 whose torch sees a GPU. The
# machine needs torch with CUDA, Triton and pytest installed (`pip install -e ".[cuda12,test]"`).

set -uo pipefail
cd "$(dirname "$0")/.."

ALL_SECTIONS=(env tests bench tune nccl nccl_bench)
DEFAULT_SECTIONS=(env tests bench)
# Seconds each section is expected to take (cold Triton cache), and the limit it runs under.
declare -A SECTION_ESTIMATE_S=([env]=20 [tests]=300 [bench]=300 [tune]=300 [nccl]=480
                               [nccl_bench]=180)
SECTION_LIMIT_S="${SECTION_LIMIT_S:-560}"
GPU_CHECK_BUDGET_S="${GPU_CHECK_BUDGET_S:-540}"
RESULTS_DIR="${RESULTS_DIR:-benchmarks/results/gpu_check}"
mkdir -p "$RESULTS_DIR"
OUT_DIR=""
if [[ -n "${OUT:-}" ]]; then
    OUT_DIR="$OUT/gpu_check"
    mkdir -p "$OUT_DIR"
fi
if [[ -n "${GPU_CHECK_EXTRA:-}" ]]; then
    # shellcheck source=/dev/null
    source "$GPU_CHECK_EXTRA"
fi

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
for name in ("cupy", "nccl.core"):
    try:
        module = __import__(name, fromlist=["_"])
        print(name, getattr(module, "__version__", "(no version)"))
    except Exception as exc:
        print(f"{name}: not importable: {exc}")
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
from dqcoll.transports.nccl4py import nccl4py_unavailable_reason
reasons = {"nccl-cupy": nccl_unavailable_reason(), "nccl4py": nccl4py_unavailable_reason()}
for binding, reason in reasons.items():
    print(f"{binding}: {'available' if reason is None else 'cannot run here: ' + reason}")
if reasons["nccl-cupy"] is None:
    from cupy.cuda import nccl
    print("CuPy's NCCL version", nccl.get_version())
if reasons["nccl4py"] is None:
    import nccl.core
    print("nccl4py's NCCL version", nccl.core.get_version())
sys.exit(0 if None in reasons.values() else 1)
EOF
    # tests/test_nccl_transport.py runs its NCCL cases over nccl4py and over CuPy's bindings
    "$PY" -m pytest -q -p no:cacheprovider -m "multi_rank_gpu or gpu" -rs \
        tests/test_nccl_transport.py tests/test_nccl_contract.py tests/test_pipelining.py \
        || status=1
    "$PY" -m torch.distributed.run --nproc-per-node 4 examples/torchrun_allreduce.py \
        --fake-hosts --numel 16M --iters 3 --check || status=1
    return $status
}

section_nccl_bench() {
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    "$PY" benchmarks/nccl_local.py --world-size 8 --size 256M --schemes none,dynamiq \
        --tile-nbytes 0,4M --iters 3 --out "${RESULTS_DIR}/nccl_local.json"
}

copy_results() {
    # every result file so far, into $RESULTS_DIR and $OUT (cheap: a few small files)
    cp benchmarks/results/kernels-*.json "$RESULTS_DIR"/ 2>/dev/null || true
    if [[ -n "$OUT_DIR" ]]; then
        cp -r "$RESULTS_DIR"/. "$OUT_DIR"/ 2>/dev/null || true
    fi
}

run_sections() {
    local failed=() skipped=() name status estimate left
    for name in "$@"; do
        if ! declare -F "section_${name}" >/dev/null; then
            echo "unknown section '${name}'; sections: ${ALL_SECTIONS[*]}" >&2
            return 2
        fi
    done
    local begin=$SECONDS
    for name in "$@"; do
        estimate="${SECTION_ESTIMATE_S[$name]:-60}"
        left=$((GPU_CHECK_BUDGET_S - (SECONDS - begin)))
        if [[ ${#skipped[@]} -gt 0 || $estimate -gt $left ]]; then
            skipped+=("$name")
            continue
        fi
        echo "=== gpu_check: ${name} (estimate ${estimate} s, ${left} s of the budget left) ==="
        local start=$SECONDS limit=$SECTION_LIMIT_S
        [[ $limit -gt $left ]] && limit=$left
        local logs=("${RESULTS_DIR}/${name}.log")
        [[ -n "$OUT_DIR" ]] && logs+=("${OUT_DIR}/${name}.log")  # streamed: kept if killed
        export -f "section_${name}"
        timeout --kill-after=10 "$limit" bash -c "section_${name}" 2>&1 | tee "${logs[@]}"
        status=${PIPESTATUS[0]}
        if [[ $status -eq 124 || $status -eq 137 ]]; then
            echo "=== gpu_check: ${name}: stopped at its limit of ${limit} s ===" \
                | tee -a "${logs[@]}"
        fi
        echo "=== gpu_check: ${name}: exit ${status} after $((SECONDS - start)) s ===" \
            | tee -a "${logs[@]}"
        [[ $status -eq 0 ]] || failed+=("$name")
        copy_results
    done
    copy_results
    if [[ ${#skipped[@]} -gt 0 ]]; then
        echo "gpu_check: not started (would not fit in ${GPU_CHECK_BUDGET_S} s): ${skipped[*]}"
        echo "gpu_check: next call: tools/gpu_check.sh ${skipped[*]}"
    fi
    if [[ ${#failed[@]} -gt 0 ]]; then
        echo "gpu_check: FAILED sections: ${failed[*]}"
        return 1
    fi
    [[ ${#skipped[@]} -gt 0 ]] && return 3
    echo "gpu_check: all sections passed ($*)"
}

export PY RESULTS_DIR
if [[ $# -eq 0 ]]; then
    run_sections "${DEFAULT_SECTIONS[@]}"
else
    run_sections "$@"
fi
