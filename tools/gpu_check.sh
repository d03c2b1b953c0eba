#!/usr/bin/env bash
# The GPU check of dqcoll: everything one NVIDIA GPU (H100/H200) can show, in one call of at most
# 9 minutes, with no internet (docs/kernels.md, "GPU check").
#
#   tools/gpu_check.sh                  # every step below, in order
#   tools/gpu_check.sh --dry-run        # print the plan (steps, budgets, commands); runs nothing
#   tools/gpu_check.sh nccl ddp         # chosen steps only, in the order given
#
# Steps, each under its own time limit (its budget, in seconds; the budgets add up to 540):
#   preflight  nvidia-smi; tools/gpu/preflight.py: torch sees the GPU, the imports (torch, Triton,
#              CuPy, nccl4py, numba, pytest, dqcoll), a C compiler that compiles against this
#              Python's headers (Triton builds its launcher with them), libcuda, the NCCL versions
#   warmup     tools/gpu/warmup.py: dqcoll.kernels.warm_up compiles and launches every Triton
#              variant (into Triton's disk cache, which every later step then loads from);
#              then collectives as training calls them (odd lengths and tile offsets, 2 and 3
#              ranks, 3/5/8 bits, fp32/bf16/fp16) must compile nothing more
#   kernels    the tests marked `gpu` (kernels byte for byte against the CPU references at
#              large sizes and offsets above 2**31, the all-reduce on CUDA tensors equal to the
#              CPU run, CuPy arrays on a CuPy stream), only the modules that hold such tests
#   nccl       the tests marked `multi_rank_gpu` with 2 ranks on the GPU, over nccl4py and over
#              CuPy's NCCL: ring, butterfly and direct, tiled and untiled, reduce-scatter,
#              all-gather, CuPy arrays, async_op, all ranks bit-identical to the local transport;
#              a stalled rank times out naming the step; then the torchrun example (--fake-hosts)
#   ddp        tools/gpu/ddp_nccl.py under torchrun: the DDP hook over an NCCL process group,
#              2 ranks, 3 steps, bit-identical replicas, fewer bytes than fp32
#   fsdp       tools/gpu/fsdp_cuda.py under torchrun: FSDP2 with compress() on CUDA tensors,
#              2 ranks, 3 steps; replicas agree, the compressed lane was used (state.summary())
#   bench      benchmarks/kernels.py at reduced sizes: each kernel's GB/s against the copy
#              bandwidth measured in the same run; it runs under whatever is left of the budget
#
# Several NCCL ranks share the one GPU: every rank gets its own NCCL_HOSTID and
# NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL 2.30 and later refuse them otherwise), with sockets over
# loopback (tools/gpu/common.py, tests/test_nccl_transport.py, examples/torchrun_allreduce.py).
#
# Output: $OUT/gpu_check/ when $OUT is set (the device runner returns $OUT), else
# $GPU_CHECK_DIR (default benchmarks/results/gpu_check/). Written as it goes, so a run killed
# from outside keeps what it had: each step's log (<step>.log, streamed), its JSON results, and
# summary.json (rewritten after every step: each step's status pass / fail / skip, exit code,
# seconds, limit and log). A step is skipped when it does not fit in what is left of the budget,
# when it reports that it cannot run here (exit 3: e.g. no NCCL binding, no test ran), and after
# a failed preflight (GPU_CHECK_KEEP_GOING=1 runs the rest anyway).
#
# Settings: GPU_CHECK_BUDGET_S (540), STEP_LIMIT_S (caps every step's limit), PYTHON (default: the
# first of .venv/bin/python, python3 whose torch sees a GPU). GPU_CHECK_EXTRA=<file> sources more
# step definitions (`step_<name>() { ...; }` plus STEP_BUDGET_S[<name>]=...; the CPU test of this
# script, tests/test_gpu_check.py, uses it for stub steps). The machine needs torch with CUDA,
# Triton and pytest (`pip install -e ".[cuda12,test]"` or `.[cuda13,test]`).

set -uo pipefail
cd "$(dirname "$0")/.."

STEPS=(preflight warmup kernels nccl ddp fsdp bench)
# Budgets: estimates until a GPU run measures them (summary.json records each step's seconds)
declare -A STEP_BUDGET_S=([preflight]=20 [warmup]=210 [kernels]=80 [nccl]=120 [ddp]=40
                          [fsdp]=40 [bench]=30)
declare -A STEP_WHAT=(
    [preflight]="nvidia-smi; tools/gpu/preflight.py (imports, C compiler + Python.h, libcuda, NCCL versions)"
    [warmup]="tools/gpu/warmup.py (every Triton variant compiled and launched, none after); numba beside it"
    [kernels]="pytest -m gpu on the modules with gpu tests (kernels byte-equal to the references)"
    [nccl]="pytest -m multi_rank_gpu, 2 ranks, nccl4py + CuPy; torchrun example --fake-hosts"
    [ddp]="torchrun -nproc 2 tools/gpu/ddp_nccl.py --steps 3 (DDP hook over an NCCL group)"
    [fsdp]="torchrun -nproc 2 tools/gpu/fsdp_cuda.py --steps 3 (FSDP2 compress() on CUDA)"
    [bench]="benchmarks/kernels.py, 2^20..2^24, widths 2/4/8 (GB/s vs copy bandwidth; time left)"
)
LAST_STEP_USES_WHAT_IS_LEFT=bench  # "if time is left": this step gets the rest of the budget
MIN_STEP_S=10                      # ... when at least this much is left
KILL_AFTER_S=5                     # a step still running this long after its limit is killed
GPU_CHECK_BUDGET_S="${GPU_CHECK_BUDGET_S:-540}"

if [[ -n "${OUT:-}" ]]; then
    OUT_DIR="$OUT/gpu_check"
else
    OUT_DIR="${GPU_CHECK_DIR:-benchmarks/results/gpu_check}"
fi
BEGIN=$SECONDS

# -- the steps ------------------------------------------------------------------------------------

# pytest with a JUnit file beside the log; exit 3 (skip) when no test ran or every test skipped
pytest_step() {
    local name=$1
    shift
    local xml="$RESULTS_DIR/${name}.junit.xml"
    "$PY" -m pytest -q -p no:cacheprovider -rs --junitxml="$xml" "$@"
    local status=$?
    [[ $status -eq 5 ]] && { echo "no test collected"; return 3; }
    if [[ $status -eq 0 && -f "$xml" ]]; then
        local tests skipped
        tests=$(sed -n 's/.*<testsuite [^>]*tests="\([0-9]*\)".*/\1/p' "$xml" | head -1)
        skipped=$(sed -n 's/.*<testsuite [^>]*skipped="\([0-9]*\)".*/\1/p' "$xml" | head -1)
        if [[ -n "$tests" && "$tests" == "${skipped:-0}" ]]; then
            echo "every test skipped"
            return 3
        fi
    fi
    return $status
}

step_preflight() {
    nvidia-smi || echo "nvidia-smi: not available"
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv \
        2>/dev/null || true
    "$PY" tools/gpu/preflight.py --out "$RESULTS_DIR/preflight.json"
}

step_warmup() {
    # the CPU kernels (numba, single-threaded compile) beside the Triton ones, into numba's disk
    # cache: the CPU references of the later steps' tests then load instead of compiling
    "$PY" -c "from dqcoll.kernels import dynamiq_numba; dynamiq_numba.warm_up()
print('numba kernels: compiled or loaded')" &
    local numba_pid=$! status=0
    "$PY" tools/gpu/warmup.py --out "$RESULTS_DIR/warmup.json" || status=$?
    wait "$numba_pid" || echo "numba warm-up failed: the CPU references compile at first use"
    return $status
}

step_kernels() {
    local files
    # only the modules that hold `gpu` tests: the others are not imported at all
    mapfile -t files < <(grep -lE '(mark\.gpu\b|pytestmark.*\bgpu\b)' tests/test_*.py)
    echo "modules: ${files[*]}"
    pytest_step kernels -m gpu "${files[@]}"
}

step_nccl() {
    local status=0
    # 2 ranks only (the 3-rank cases would double the time); both bindings; the stalled rank
    pytest_step nccl -m multi_rank_gpu -k "not [3-" tests/test_nccl_transport.py || status=$?
    "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
        examples/torchrun_allreduce.py --fake-hosts --numel 1M --iters 1 --check || status=1
    return $status
}

step_ddp() {
    "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 tools/gpu/ddp_nccl.py \
        --steps 3 --out "$RESULTS_DIR/ddp_nccl.json"
}

step_fsdp() {
    "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 tools/gpu/fsdp_cuda.py \
        --steps 3 --out "$RESULTS_DIR/fsdp_cuda.json"
}

step_bench() {
    "$PY" benchmarks/kernels.py --min-log2 20 --max-log2 24 --step 2 --widths 2 4 8 \
        --max-iters 20 --min-time-s 0.05 --torch-max-log2 22 \
        --out "$RESULTS_DIR/kernels-bench.json"
}

# more steps, or stubs of these (sourced after them, so its definitions win)
if [[ -n "${GPU_CHECK_EXTRA:-}" ]]; then
    # shellcheck source=/dev/null
    source "$GPU_CHECK_EXTRA"
fi

# -- the plan -------------------------------------------------------------------------------------

print_plan() {
    local total=0 i=0 name
    echo "gpu_check plan: ${#@} steps, budget ${GPU_CHECK_BUDGET_S} s, output ${OUT_DIR}/"
    for name in "$@"; do
        i=$((i + 1))
        local budget="${STEP_BUDGET_S[$name]:-60}"
        total=$((total + budget))
        printf '  %d. %-10s %4d s  %s\n' "$i" "$name" "$budget" "${STEP_WHAT[$name]:-step_$name}"
    done
    echo "total: ${total} s of budgets (limit ${GPU_CHECK_BUDGET_S} s)"
    if [[ $total -gt $GPU_CHECK_BUDGET_S ]]; then
        echo "over the limit: the steps that do not fit in what is left will be skipped"
    fi
}

# -- running --------------------------------------------------------------------------------------

json_escape() {
    local s=${1//\\/\\\\}
    s=${s//\"/\\\"}
    printf '%s' "${s//$'\n'/ }"
}

SUMMARY_ROWS=()
write_summary() {  # $1: finished (true/false); rewritten after every step
    local rows="" row
    for row in "${SUMMARY_ROWS[@]}"; do
        rows+="${rows:+,}"$'\n    '"$row"
    done
    local commit
    commit="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
    cat > "$OUT_DIR/summary.json.tmp" <<EOF
{
  "finished": $1,
  "budget_s": ${GPU_CHECK_BUDGET_S},
  "elapsed_s": $((SECONDS - BEGIN)),
  "commit": "$(json_escape "$commit")",
  "python": "$(json_escape "$PY")",
  "steps": [${rows}
  ]
}
EOF
    mv "$OUT_DIR/summary.json.tmp" "$OUT_DIR/summary.json"
}

record() {  # name status exit elapsed limit note
    SUMMARY_ROWS+=("{\"name\": \"$1\", \"status\": \"$2\", \"exit\": $3, \"elapsed_s\": $4, \
\"limit_s\": $5, \"budget_s\": ${STEP_BUDGET_S[$1]:-60}, \"log\": \"$1.log\", \
\"note\": \"$(json_escape "$6")\"}")
    echo "=== gpu_check: $1: $2 (exit $3, $4 s of $5 s)${6:+: $6} ===" | tee -a "$OUT_DIR/$1.log"
    write_summary false
}

run_steps() {
    local name status left limit budget start preflight_failed=0
    local failed=() skipped=()
    for name in "$@"; do
        left=$((GPU_CHECK_BUDGET_S - (SECONDS - BEGIN)))
        budget="${STEP_BUDGET_S[$name]:-60}"
        # a step runs under its budget, when that fits in what is left; the last step ("if time
        # is left") under all that is left, when that is at least MIN_STEP_S
        limit=$budget
        fits=$((budget <= left))
        if [[ $name == "$LAST_STEP_USES_WHAT_IS_LEFT" ]]; then
            limit=$((left - KILL_AFTER_S))  # its kill, too, within the budget
            fits=$((limit >= MIN_STEP_S))
        fi
        [[ -n "${STEP_LIMIT_S:-}" && $limit -gt $STEP_LIMIT_S ]] && limit=$STEP_LIMIT_S
        if [[ $preflight_failed -eq 1 && "${GPU_CHECK_KEEP_GOING:-0}" != 1 ]]; then
            skipped+=("$name"); record "$name" skip 0 0 0 "preflight failed"; continue
        fi
        if [[ $fits -eq 0 ]]; then
            skipped+=("$name")
            record "$name" skip 0 0 0 "does not fit: ${left} s of the budget left"
            continue
        fi
        echo "=== gpu_check: ${name} (limit ${limit} s, ${left} s of the budget left) ===" \
            | tee "$OUT_DIR/${name}.log"
        start=$SECONDS
        export -f "step_${name}"
        # streamed into the log as it runs: a run killed from outside keeps it
        timeout --kill-after="$KILL_AFTER_S" "$limit" bash -c "step_${name}" 2>&1 \
            | tee -a "$OUT_DIR/${name}.log"
        status=${PIPESTATUS[0]}
        local elapsed=$((SECONDS - start))
        if [[ $status -eq 0 ]]; then
            record "$name" pass 0 "$elapsed" "$limit" ""
        elif [[ $status -eq 3 ]]; then
            skipped+=("$name"); record "$name" skip 3 "$elapsed" "$limit" "cannot run here"
        elif [[ $status -eq 124 || $status -eq 137 ]]; then
            failed+=("$name")
            record "$name" fail "$status" "$elapsed" "$limit" "stopped at its limit of ${limit} s"
        else
            failed+=("$name"); record "$name" fail "$status" "$elapsed" "$limit" ""
        fi
        [[ $name == preflight && $status -ne 0 && $status -ne 3 ]] && preflight_failed=1
    done
    write_summary true
    [[ ${#skipped[@]} -gt 0 ]] && echo "gpu_check: skipped: ${skipped[*]}"
    if [[ ${#failed[@]} -gt 0 ]]; then
        echo "gpu_check: FAILED: ${failed[*]} (logs and summary.json in ${OUT_DIR}/)"
        return 1
    fi
    echo "gpu_check: no step failed ($*); logs and summary.json in ${OUT_DIR}/"
}

pick_python() {
    if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; return; fi
    local candidate
    for candidate in .venv/bin/python python3; do
        if command -v "$candidate" >/dev/null \
            && "$candidate" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" \
                2>/dev/null; then
            echo "$candidate"; return
        fi
    done
    # no CUDA torch anywhere: the preflight then says why
    if [[ -x .venv/bin/python ]]; then echo ".venv/bin/python"; else echo "python3"; fi
}

dry_run=0
chosen=()
for arg in "$@"; do
    case "$arg" in
        --dry-run) dry_run=1 ;;
        -h|--help) sed -n '2,/^$/{s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
        *) chosen+=("$arg") ;;
    esac
done
[[ ${#chosen[@]} -eq 0 ]] && chosen=("${STEPS[@]}")
for name in "${chosen[@]}"; do
    if ! declare -F "step_${name}" >/dev/null; then
        echo "unknown step '${name}'; steps: ${STEPS[*]}" >&2
        exit 2
    fi
done
if [[ $dry_run -eq 1 ]]; then
    print_plan "${chosen[@]}"
    exit 0
fi

mkdir -p "$OUT_DIR"
RESULTS_DIR="$OUT_DIR"
PY="$(pick_python)"
# every process: the repo on the path (dqcoll need not be installed), automatic kernel dispatch
# (Triton for CUDA tensors), no numba warm-up of the whole suite in pytest (tests/conftest.py)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DQCOLL_TEST_NUMBA_WARMUP=0
unset DQCOLL_KERNELS
# CuPy loads libnccl.so.2 by name: let it find the NCCL wheels' copies
nccl_libs="$("$PY" -c 'import glob, os, site
dirs = sorted({os.path.dirname(p) for s in site.getsitepackages()
               for p in glob.glob(os.path.join(s, "nvidia", "**", "libnccl.so*"), recursive=True)})
print(":".join(dirs))' 2>/dev/null)"
if [[ -n "$nccl_libs" ]]; then
    export LD_LIBRARY_PATH="$nccl_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export PY RESULTS_DIR
export -f pytest_step
print_plan "${chosen[@]}"
write_summary false
run_steps "${chosen[@]}"
