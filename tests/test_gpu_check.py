"""The GPU check's CPU side (tools/gpu_check.sh, tools/gpu/): what can be shown without a GPU.

* ``--dry-run`` prints every step with its budget, the budgets adding up to at most 540 s, and
  writes nothing;
* the bookkeeping: each step's status (pass / fail / skip), exit code and log, and summary.json,
  written as the run goes, so that a run killed from outside keeps what it had; a step over its
  limit is stopped and failed; a failed preflight skips the rest; the last step gets the time
  that is left;
* the check's torchrun scripts (the DDP hook, FSDP2 with ``compress()``) run and pass on CPU
  processes over gloo with the same checks they make on the GPU, and the preflight reports this
  machine;
* the ``gpu`` tests are collected without hypothesis, and the suite's numba warm-up can be
  skipped;
* every place that gives several NCCL ranks on one GPU their own ``NCCL_HOSTID`` also sets
  ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (NCCL 2.30 and later refuse them without it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
STEPS = ["preflight", "warmup", "kernels", "nccl", "ddp", "fsdp", "bench"]

needs_shell = pytest.mark.skipif(shutil.which("timeout") is None or shutil.which("bash") is None,
                                 reason="needs bash and coreutils' timeout")


def _gpu_check(out: Path, *args: str, extra: str | None = None, outer: float = 60,
               **env: str) -> subprocess.CompletedProcess[str]:
    """Run the script with ``OUT=out`` (stub steps from ``extra``, sourced after its own)."""
    full = dict(os.environ, OUT=str(out), PYTHON="true", **env)
    if extra is not None:
        stub = out.parent / f"{out.name}-extra.sh"
        stub.write_text(extra)
        full["GPU_CHECK_EXTRA"] = str(stub)
    return subprocess.run(["timeout", str(outer), "bash", str(SCRIPT), *args], capture_output=True,
                          text=True, env=full, cwd=ROOT, timeout=outer + 30)


def _summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "gpu_check" / "summary.json").read_text())


@needs_shell
def test_dry_run_prints_every_step_within_540_s(tmp_path: Path) -> None:
    """``--dry-run`` lists the steps in order (preflight, warm-up, kernels, NCCL, DDP, FSDP2,
    bench), each with a positive budget and what it runs; the budgets add up to at most 540 s
    and the total line says so; nothing is written."""
    done = _gpu_check(tmp_path, "--dry-run")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = re.findall(r"^\s+\d+\.\s+(\S+)\s+(\d+) s\s+(.+)$", done.stdout, re.M)
    assert [name for name, _, _ in rows] == STEPS, done.stdout
    budgets = [int(b) for _, b, _ in rows]
    assert all(b > 0 for b in budgets) and sum(budgets) <= 540, budgets
    assert f"total: {sum(budgets)} s" in done.stdout
    for name, _, what in rows:
        assert what.strip() and what.strip() != f"step_{name}", (name, what)
    assert not (tmp_path / "gpu_check").exists()


@needs_shell
def test_unknown_step_is_refused(tmp_path: Path) -> None:
    """A step name the script does not define is refused before anything runs, and the message
    lists the steps."""
    done = _gpu_check(tmp_path, "preflight", "nosuchstep")
    assert done.returncode == 2
    assert "unknown step 'nosuchstep'" in done.stderr and "preflight" in done.stderr
    assert not (tmp_path / "gpu_check").exists()


STUBS = (
    'step_fast() { echo "fast ran"; echo \'{"ok": 1}\' > "$RESULTS_DIR/fast.json"; }\n'
    'step_slow() { echo "slow started"; sleep 60; }\n'
    'step_cannot() { echo "no binding here"; return 3; }\n'
    'step_big() { echo "never"; }\n'
    "STEP_BUDGET_S[fast]=5; STEP_BUDGET_S[slow]=5; STEP_BUDGET_S[cannot]=5\n"
    "STEP_BUDGET_S[big]=9999\n")


@needs_shell
def test_steps_record_pass_fail_skip_and_keep_results_when_killed(tmp_path: Path) -> None:
    """Stub steps: one that writes a result passes, and its log and JSON are in
    $OUT/gpu_check/; one that outlives its limit is stopped and recorded as failed; one that
    exits 3 and one that does not fit the budget are recorded as skipped; summary.json lists all
    four with exit codes and logs, and the script fails. Killed from outside mid-step (as the
    device runner does at its limit), the finished step's results, the running step's log so far
    and a valid summary.json are still there."""
    out = tmp_path / "limit"
    done = _gpu_check(out, "fast", "slow", "cannot", "big", extra=STUBS, STEP_LIMIT_S="2")
    assert done.returncode == 1, done.stdout + done.stderr
    folder = out / "gpu_check"
    assert (folder / "fast.json").read_text().strip() == '{"ok": 1}'
    assert "fast ran" in (folder / "fast.log").read_text()
    assert "stopped at its limit" in (folder / "slow.log").read_text()
    summary = _summary(out)
    assert summary["finished"] is True and summary["budget_s"] == 540
    steps = {s["name"]: s for s in summary["steps"]}
    assert [s["name"] for s in summary["steps"]] == ["fast", "slow", "cannot", "big"]
    assert (steps["fast"]["status"], steps["fast"]["exit"]) == ("pass", 0)
    assert (steps["slow"]["status"], steps["slow"]["exit"]) == ("fail", 124)
    assert (steps["cannot"]["status"], steps["cannot"]["exit"]) == ("skip", 3)
    assert steps["big"]["status"] == "skip" and "does not fit" in steps["big"]["note"]
    assert all(s["log"] == f"{s['name']}.log" for s in summary["steps"])
    assert "FAILED: slow" in done.stdout

    out = tmp_path / "killed"
    killed = _gpu_check(out, "fast", "slow", extra=STUBS, outer=4)
    assert killed.returncode == 124
    folder = out / "gpu_check"
    assert (folder / "fast.json").exists()
    assert "slow started" in (folder / "slow.log").read_text()
    summary = _summary(out)
    assert summary["finished"] is False
    assert [(s["name"], s["status"]) for s in summary["steps"]] == [("fast", "pass")]


@needs_shell
def test_failed_preflight_skips_the_other_steps(tmp_path: Path) -> None:
    """When the preflight fails, the later steps are recorded as skipped (and do not run)
    unless GPU_CHECK_KEEP_GOING=1, which runs them anyway."""
    extra = ('step_preflight() { echo "no GPU"; return 1; }\n'
             'step_fast() { echo "fast ran"; }\nSTEP_BUDGET_S[fast]=5\n')
    done = _gpu_check(tmp_path / "stop", "preflight", "fast", extra=extra)
    assert done.returncode == 1
    steps = [(s["name"], s["status"], s["note"]) for s in _summary(tmp_path / "stop")["steps"]]
    assert steps == [("preflight", "fail", ""), ("fast", "skip", "preflight failed")]
    assert "fast ran" not in done.stdout
    done = _gpu_check(tmp_path / "go", "preflight", "fast", extra=extra, GPU_CHECK_KEEP_GOING="1")
    assert [s["status"] for s in _summary(tmp_path / "go")["steps"]] == ["fail", "pass"]
    assert "fast ran" in done.stdout


@needs_shell
def test_last_step_gets_what_is_left(tmp_path: Path) -> None:
    """The bench step runs under all the budget that is left (less the kill grace), not only its
    own budget; with less than the minimum left it is skipped."""
    extra = 'step_bench() { echo "bench ran"; }\nstep_fast() { :; }\nSTEP_BUDGET_S[fast]=5\n'
    done = _gpu_check(tmp_path / "roomy", "fast", "bench", extra=extra, GPU_CHECK_BUDGET_S="200")
    assert done.returncode == 0, done.stdout + done.stderr
    bench = _summary(tmp_path / "roomy")["steps"][1]
    assert bench["status"] == "pass" and 180 <= bench["limit_s"] <= 195, bench
    done = _gpu_check(tmp_path / "tight", "fast", "bench", extra=extra, GPU_CHECK_BUDGET_S="12")
    bench = _summary(tmp_path / "tight")["steps"][1]
    assert bench["status"] == "skip" and "does not fit" in bench["note"], bench
    assert "bench ran" not in done.stdout


# -- the check's own scripts, on CPU ---------------------------------------------------------------


def _torchrun(script: str, out: Path, *args: str) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(ROOT / "tools" / "gpu" / script),
                           "--backend", "gloo", "--out", str(out), *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads(out.read_text())


def test_ddp_script_passes_on_gloo(tmp_path: Path) -> None:
    """tools/gpu/ddp_nccl.py on 2 gloo ranks: every step's gradients and parameters are
    bit-identical on both ranks and finite, the hook compressed every step (fewer bytes than fp32
    all-reduces), and the ranks carried the multi-rank NCCL variables."""
    report = _torchrun("ddp_nccl.py", tmp_path / "ddp.json", "--steps", "2", "--width", "256")
    assert report["ok"] and report["compressed"] and report["hook_iterations"] == 2
    assert all(s["grads_identical"] and s["params_identical"] and s["grads_finite"]
               for s in report["steps"]) and len(report["steps"]) == 2
    assert 0 < report["bytes_sent"] < report["exact_fp32_bytes"]
    assert report["nccl_env"]["NCCL_MULTI_RANK_GPU_ENABLE"] == "1"


def test_fsdp_script_passes_on_gloo(tmp_path: Path) -> None:
    """tools/gpu/fsdp_cuda.py on 2 gloo ranks: compress() took its lane for the weights and the
    gradients at every step (state.summary() counts them; fewer bytes than exact), the weights
    every block computed with are bit-identical on both ranks, and so are the parameters."""
    report = _torchrun("fsdp_cuda.py", tmp_path / "fsdp.json", "--steps", "2", "--width", "256")
    assert report["ok"] and report["lane_used"] and report["lanes"] == ["cpu"]
    compressed = report["summary"]["compressed"]
    assert compressed["weights"]["calls"] >= 2 and compressed["gradients"]["calls"] >= 2
    assert report["weights_identical"] and report["params_identical"] and report["finite"]
    assert 0 < report["wire_bytes"] < report["exact_bytes"]


def test_preflight_reports_this_machine(tmp_path: Path) -> None:
    """tools/gpu/preflight.py records torch's version, the C compiler check and the NCCL
    wheels; without a CUDA device it fails and says so, with one it names the device."""
    import torch

    out = tmp_path / "preflight.json"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu" / "preflight.py"), "--out",
                           str(out)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    report = json.loads(out.read_text())
    assert report["versions"]["torch"] == torch.__version__
    assert {"compiler", "python_include", "python_h"} <= set(report["c_compiler"])
    assert isinstance(report["nccl"]["wheels"], dict)
    if torch.cuda.is_available():
        assert report["device"]["name"]
    else:
        assert done.returncode == 1 and not report["ok"]
        assert any("no CUDA device" in p for p in report["problems"]), report["problems"]


# -- collecting the gpu tests ----------------------------------------------------------------------


def test_gpu_tests_collect_without_hypothesis(tmp_path: Path) -> None:
    """``pytest -m gpu tests`` collects without errors when hypothesis is not importable (a bare
    GPU machine): the module that needs it is skipped, not an error that stops the run."""
    blocked = tmp_path / "blocked" / "hypothesis"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text(  # as an absent package fails to import
        'raise ModuleNotFoundError("No module named \'hypothesis\'", name="hypothesis")\n')
    env = dict(os.environ, DQCOLL_TEST_NUMBA_WARMUP="0",
               PYTHONPATH=os.pathsep.join([str(blocked.parent), str(ROOT),
                                           os.environ.get("PYTHONPATH", "")]))
    # hypothesis' own pytest plugin imports it too: off, as it is where hypothesis is absent
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p",
                           "no:xdist", "-p", "no:hypothesispytest", "--collect-only", "-q",
                           "-m", "gpu", "tests"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "test_kernels.py::test_gpu_kernels_match_cpu_reference" in done.stdout
    assert " error" not in done.stdout.splitlines()[-1], done.stdout[-500:]


def test_numba_warm_up_is_skipped_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite's session start compiles the numba kernels (warm_up, then every scheme over 2
    local ranks), except with DQCOLL_TEST_NUMBA_WARMUP=0, where it compiles nothing."""
    pytest.importorskip("numba")
    import conftest

    import dqcoll.testing
    from dqcoll.kernels import dynamiq_numba

    calls: list[str] = []
    monkeypatch.setattr(dynamiq_numba, "warm_up", lambda *a, **k: calls.append("warm_up"))
    monkeypatch.setattr(dqcoll.testing, "run_local", lambda *a, **k: calls.append("run_local"))
    session = types.SimpleNamespace(config=types.SimpleNamespace())
    monkeypatch.setenv("DQCOLL_TEST_NUMBA_WARMUP", "0")
    conftest.pytest_sessionstart(session)
    assert calls == []
    monkeypatch.setenv("DQCOLL_TEST_NUMBA_WARMUP", "1")
    conftest.pytest_sessionstart(session)
    assert calls == ["warm_up", "run_local"]


# -- several NCCL ranks on one GPU ----------------------------------------------------------------


def _load(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"_gpu_check_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_fake_host_env_enables_multi_rank_gpu() -> None:
    """Each environment that gives ranks on one GPU their own NCCL_HOSTID - the NCCL tests' rank
    environment, the torchrun example's ``--fake-hosts``, the GPU check's scripts - gives
    distinct host ids and sets NCCL_MULTI_RANK_GPU_ENABLE=1."""
    from test_nccl_transport import _nccl_env

    builders = {
        "tests/test_nccl_transport.py": lambda rank: _nccl_env(rank, 2, 29500, 5.0),
        "examples/torchrun_allreduce.py": lambda rank: _load(
            ROOT / "examples" / "torchrun_allreduce.py").fake_host_env(rank, "h"),
        "tools/gpu/common.py": lambda rank: _load(
            ROOT / "tools" / "gpu" / "common.py").fake_host_env(rank, "h"),
    }
    for where, build in builders.items():
        envs = [build(rank) for rank in range(3)]
        assert len({env["NCCL_HOSTID"] for env in envs}) == 3, where
        assert [env.get("NCCL_MULTI_RANK_GPU_ENABLE") for env in envs] == ["1"] * 3, where


def test_no_file_sets_nccl_hostid_without_the_multi_rank_switch() -> None:
    """No script, example, test or library file that sets (or documents) a per-rank
    NCCL_HOSTID leaves out NCCL_MULTI_RANK_GPU_ENABLE."""
    missing = []
    for folder in ("examples", "tools", "tests", "benchmarks", "dqcoll"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".sh") and path.is_file():
                text = path.read_text(errors="replace")
                if "NCCL_HOSTID" in text and "NCCL_MULTI_RANK_GPU_ENABLE" not in text:
                    missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"NCCL_HOSTID without NCCL_MULTI_RANK_GPU_ENABLE in {missing}"
