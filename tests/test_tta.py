"""``benchmarks/tta.py``: time to accuracy of a real training job under DDP and FSDP2, paired seeds.

The corpus split, the target and the summary's paired speed-ups are checked on exact inputs; one
tiny end-to-end run (2 ranks over loopback, a 1-layer 32-wide decoder, 14 steps, two seeds,
every DDP hook) checks the report's structure and what pairing promises: every hook of a seed
starts from the same held-out loss and sees the same first batch, the seeds differ, the
uncompressed hooks learn, and dqcoll's hook sends fewer bytes per step than DDP's fp32
all-reduce; a second (the FSDP2 hooks, 10 steps) checks the FSDP2 family's pairing, target and
byte counts. No timing is asserted.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


tta = _load(ROOT / "benchmarks" / "tta.py", "tta")


def test_split_is_by_whole_files_and_fixed_by_their_paths(tmp_path):
    """A file is held out by the hash of its relative path alone: the same answer every time,
    about one file in 20 over many names, and the corpus puts each file's bytes wholly on one
    side (site-packages and test suites on neither)."""
    names = [f"pkg{i // 50}/mod{i}.py" for i in range(4000)]
    held = [n for n in names if tta.is_heldout(n)]
    assert held == [n for n in names if tta.is_heldout(n)]
    assert 0.035 < len(held) / len(names) < 0.065
    root = tmp_path / "lib"
    for i, name in enumerate(names[:400]):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"# {name}\n".encode() + bytes([65 + i % 26]) * 200)
    (root / "site-packages").mkdir()
    (root / "site-packages" / "x.py").write_bytes(b"SITE" * 100)
    (root / "test").mkdir()
    (root / "test" / "t.py").write_bytes(b"TEST" * 100)
    corpus = tta.load_corpus(root)
    train = corpus.train.numpy().tobytes()
    heldout = corpus.heldout.numpy().tobytes()
    assert corpus.train_files + corpus.heldout_files == 400
    for name in names[:400]:
        header = f"# {name}\n".encode()
        assert (header in heldout) == tta.is_heldout(name) and (header in train) != (
            header in heldout)
    assert b"SITE" not in train + heldout and b"TEST" not in train + heldout


def test_reach_takes_the_first_evaluation_at_the_target_and_interpolates():
    """Steps and wall-clock to the target are those of the first evaluation at or below it; the
    interpolated wall-clock lies between it and the evaluation before, linearly in loss."""
    curve = [{"step": 0, "wall_s": 0.0, "loss": 5.0}, {"step": 10, "wall_s": 20.0, "loss": 3.0},
             {"step": 20, "wall_s": 40.0, "loss": 2.0}, {"step": 30, "wall_s": 60.0, "loss": 1.9}]
    got = tta.reach(curve, 2.5)
    assert got == {"steps_to_target": 20, "wall_to_target_s": 40.0,
                   "wall_to_target_interp_s": 30.0}
    assert tta.reach(curve, 1.0)["steps_to_target"] is None
    assert tta.reach(curve, 6.0)["wall_to_target_s"] == 0.0


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    """Linear warm-up over the first tenth of the steps to the peak, then down to 0.1 of it at
    the last step, never below."""
    factors = [tta.lr_factor(s, 100) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(factors[9:]))


def _run(hook: str, seed: int, final: float, walls: list[float]) -> dict:
    losses = [5.0, 3.0, final]
    curve = [{"step": 10 * i, "wall_s": w, "loss": v}
             for i, (w, v) in enumerate(zip([0.0, *walls], losses, strict=True))]
    return {"hook": hook, "seed": seed, "status": "ok", "curve": curve, "final_loss": final,
            "initial_loss": 5.0, "median_ms": 100.0, "wall_s": walls[-1],
            "bytes_per_step": 1e6, "vnmse": 0.0}


def test_summary_targets_each_seed_by_its_own_fp32_run_and_pairs_the_speedup():
    """Each seed's target is 1.01 x that seed's ``ddp`` final loss; a hook's speed-up over the
    fp16 hook is the mean over seeds of the per-seed ratio of their wall-clocks to the target;
    a run that misses the target leaves the hook's mean undefined and its count says so."""
    runs = [_run("ddp", 0, 2.0, [10.0, 40.0]), _run("fp16_hook", 0, 2.0, [10.0, 30.0]),
            _run("dqcoll", 0, 2.01, [10.0, 15.0]),
            _run("ddp", 1, 1.0, [10.0, 40.0]), _run("fp16_hook", 1, 1.0, [10.0, 30.0]),
            _run("dqcoll", 1, 1.02, [10.0, 10.0]),
            {"hook": "mxfp8", "seed": 0, "status": "crashed: RuntimeError: x"}]
    summary = tta.summarize(runs)
    assert runs[0]["target"] == pytest.approx(2.02) and runs[3]["target"] == pytest.approx(1.01)
    assert summary["dqcoll"]["reached"] == 1 and summary["dqcoll"]["wall_to_target_s"] is None
    assert summary["fp16_hook"]["speedup_vs_fp16_s"] == pytest.approx(1.0)
    assert summary["ddp"]["speedup_vs_fp16_s"] == pytest.approx(0.75)
    assert summary["dqcoll"]["final_vs_ref"] == pytest.approx((0.005 + 0.02) / 2)
    assert summary["mxfp8"]["failed"] == ["seed 0: crashed: RuntimeError: x"]
    runs[5]["curve"][-1]["loss"] = 1.0  # now seed 1 reaches it too: 30/15 and 30/10
    summary = tta.summarize(runs)
    assert summary["dqcoll"]["speedup_vs_fp16_s"] == pytest.approx((2.0 + 3.0) / 2)


def test_a_variant_hook_is_the_defaults_under_a_policy():
    """``dqcoll:<policy>`` names DynamiqState(policy=...) with ';' between the policy's keys, read
    over the defaults; anything else outside the named hooks is refused."""
    from dqcoll.integrations.torch_ddp import ddp_policy

    hook = "dqcoll:warmup_steps=5;seed=3"
    assert tta.variant_policy(hook) == "warmup_steps=5,seed=3"
    assert tta.hook_label(hook) == 'dqcoll DynamiqState(policy="warmup_steps=5,seed=3")'
    policy = ddp_policy(tta.variant_policy(hook))
    assert (policy.warmup_steps, policy.seed) == (5, 3)
    assert policy.allreduce == ddp_policy().allreduce  # the rest: the defaults
    assert tta.known_hook(hook) and tta.known_hook("fp16_hook")
    assert not tta.known_hook("dqcoll:") and not tta.known_hook("fp8_hook")
    assert tta.variant_policy("dqcoll") is None and tta.hook_label("dqcoll") == tta.HOOKS["dqcoll"]
    fsdp = "fsdp2_dqcoll:gradients=int4_block;min_nbytes=0"
    assert tta.family(fsdp) == "fsdp2" and tta.family(hook) == "ddp" and tta.known_hook(fsdp)
    policy = tta.fsdp2_policy(fsdp)
    assert (policy.gradients.scheme, policy.min_nbytes) == ("int4_block", 0)
    assert policy.weights == tta.fsdp2_policy("fsdp2_dqcoll").weights  # the rest: the defaults


def test_each_family_has_its_own_target_and_16_bit_peer():
    """FSDP2 hooks are targeted at the ``fsdp2`` run's final loss and paired with
    ``fsdp2_bf16``; DDP hooks at ``ddp``'s and the fp16 hook's, in the same result."""
    runs = [_run("ddp", 0, 2.0, [10.0, 40.0]), _run("fp16_hook", 0, 2.0, [10.0, 30.0]),
            _run("fsdp2", 0, 2.5, [10.0, 50.0]), _run("fsdp2_bf16", 0, 2.5, [10.0, 40.0]),
            _run("fsdp2_dqcoll", 0, 2.5, [10.0, 20.0])]
    summary = tta.summarize(runs)
    assert runs[0]["target"] == pytest.approx(2.02)
    assert runs[2]["target"] == pytest.approx(2.525) and runs[4]["target"] == pytest.approx(2.525)
    assert summary["fsdp2_dqcoll"]["speedup_vs_fp16_s"] == pytest.approx(2.0)
    assert summary["fsdp2"]["speedup_vs_fp16_s"] == pytest.approx(0.8)
    assert summary["fp16_hook"]["speedup_vs_fp16_s"] == pytest.approx(1.0)
    assert summary["fsdp2_dqcoll"]["final_vs_ref"] == pytest.approx(0.0)
    assert "| vs 16-bit peer |" in tta.render_markdown(
        {"provenance": {"params": 1e6, "world_size": 2, "link": "x", "steps": 2, "commit": "c",
                        "device": "d", "torch_version": "t"}, "summary": summary})


def _tiny_run(out: Path, *options: str) -> tuple[dict, str]:
    """``benchmarks/tta.py`` on 2 ranks over loopback with a 32-wide decoder; its result and
    stdout."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tta.py"), "-n", "2", "--model-width", "32",
         "--seq-len", "16", "--batch", "2", "--eval-windows", "8", "--lr", "3e-3", "--json",
         str(out), "--note", "test", *options],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tta") / "tiny.json"
    result, stdout = _tiny_run(out, "--layers", "1", "--steps", "14", "--eval-every", "7",
                               "--seeds", "0,1")
    return result, out, stdout


def test_tiny_run_reports_every_hook_with_provenance(tiny):
    """Every hook runs with every seed and ends with a status; the file carries its provenance
    (commit, command, machine, versions, link, corpus), each run its held-out curve at the fixed
    steps with the wall-clock growing, step times, bytes and vNMSE, and beside the JSON a PNG."""
    result, path, stdout = tiny
    prov = result["provenance"]
    assert prov["world_size"] == 2 and prov["link"] == "loopback" and prov["steps"] == 14
    for key in ("commit", "command", "device", "host", "torch_version", "date_utc", "params"):
        assert prov[key], key
    assert prov["corpus"]["train_files"] > 100 and prov["corpus"]["heldout_files"] > 5
    runs = result["runs"]
    assert [(r["seed"], r["hook"]) for r in runs if r["seed"] == 0] == [
        (0, h) for h in tta.DDP_HOOKS]
    assert {r["hook"] for r in runs if r["seed"] == 1} == set(tta.DDP_HOOKS)
    assert next(r["hook"] for r in runs if r["seed"] == 1) == list(tta.DDP_HOOKS)[1]  # rotated
    for run in runs:
        if run["hook"] == "auto" and run["status"].startswith("not available"):
            continue
        assert run["status"] == "ok", run
        assert [p["step"] for p in run["curve"]] == [0, 7, 14]
        walls = [p["wall_s"] for p in run["curve"]]
        assert walls[0] == 0.0 and walls[1] < walls[2]
        assert len(run["step_ms"]) == 14 and run["p10_ms"] <= run["median_ms"] <= run["p90_ms"]
        assert run["bytes_per_step"] > 0 and run["vnmse"] >= 0
        assert run["target"] is not None
        # where a step goes: CPU per step, and for a hooked run the step split at the end of
        # backward (no hook on DDP's default: nothing to split)
        assert 0 < run["cpu_ms"]
        if run["hook"] == "ddp":
            assert "to_last_bucket_ms" not in run
        else:
            assert 0 < run["to_last_bucket_ms"] < run["p90_ms"], run
            assert 0 <= run["after_backward_ms"] < run["p90_ms"], run
    summary = result["summary"]
    assert list(summary) == list(tta.DDP_HOOKS) and summary["ddp"]["reached"] == 2
    assert path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| DDP default (fp32, no hook) |" in stdout
    assert "| to the last bucket (ms) | after it (ms) | CPU per rank (ms) |" in stdout


def test_tiny_run_pairs_the_seeds_and_learns(tiny):
    """For each seed every hook starts from the same held-out loss and sees the same first batch
    (the same first training loss, before any averaging), while the two seeds differ; DDP's
    default and the fp16 hook end below their initial held-out loss; DDP's fp32 average is exact
    to rounding."""
    runs = tiny[0]["runs"]
    for seed in (0, 1):
        mine = [r for r in runs if r["seed"] == seed and r["status"] == "ok"]
        assert len({r["initial_loss"] for r in mine}) == 1
        assert len({r["train_loss_rank0"][0] for r in mine}) == 1
    first = {r["seed"]: r["initial_loss"] for r in runs if r["hook"] == "ddp"}
    assert first[0] != first[1]
    for run in runs:
        if run["hook"] in ("ddp", "fp16_hook"):
            assert run["final_loss"] < run["initial_loss"], run["curve"]
        if run["hook"] == "ddp":
            assert run["vnmse"] < 1e-12


def test_tiny_run_dqcoll_sends_fewer_bytes_than_fp32(tiny):
    """DDP's default sends 2 (n-1)/n of its fp32 buckets per step and the fp16 hook half that;
    dqcoll's defaults (the planner, which on loopback may keep the group's own 32- or 16-bit
    all-reduce), counting their 10 bf16 warm-up steps, send at most fp32's bytes and
    their argument checks; the explicit compressed schemes send less than half of fp32's."""
    runs = tiny[0]["runs"]
    for seed in (0, 1):
        by = {r["hook"]: r for r in runs if r["seed"] == seed}
        fp32 = by["ddp"]["bytes_per_step"]
        assert fp32 == by["ddp"]["fp32_bytes_per_step"] > 0
        assert by["fp16_hook"]["bytes_per_step"] == fp32 / 2
        dq = by["dqcoll"]
        assert dq["warmup_steps"] == 10
        assert 0 < dq["bytes_per_step"] <= 1.02 * fp32
        for name in ("mxfp8", "int4_block"):
            assert 0 < by[name]["bytes_per_compressed_step"] < fp32 / 2, (name, by[name])


@pytest.fixture(scope="module")
def tiny_fsdp2(tmp_path_factory):
    return _tiny_run(tmp_path_factory.mktemp("tta") / "tiny-fsdp2.json", "--layers", "2",
                     "--steps", "10", "--eval-every", "5", "--seeds", "0",
                     "--hooks", "fsdp2,fsdp2_bf16,fsdp2_dqcoll:min_nbytes=0")


def test_tiny_fsdp2_run_pairs_its_hooks_and_counts_their_bytes(tiny_fsdp2):
    """Under FSDP2 every hook starts from the same weights and batch (dqcoll's first forward on
    its int8 all-gather of them); FSDP2's own fp32
    collectives average exactly to rounding and learn; its bf16 reduce-scatter sends fewer bytes
    and adds error; dqcoll's FSDP2 policy (every call compressed: ``min_nbytes=0``) sends fewer
    bytes than either, counted by its own state; the targets are the ``fsdp2`` run's."""
    result, stdout = tiny_fsdp2
    runs = {r["hook"]: r for r in result["runs"]}
    assert all(r["status"] == "ok" for r in runs.values()), runs
    assert all(r["cpu_ms"] > 0 and "to_last_bucket_ms" not in r for r in runs.values())
    assert len({r["initial_loss"] for r in runs.values()}) == 1  # evaluated on exact weights
    exact, bf16, dq = runs["fsdp2"], runs["fsdp2_bf16"], runs["fsdp2_dqcoll:min_nbytes=0"]
    # the same first batch on the same weights; dqcoll's forward runs on int8-gathered weights
    assert exact["train_loss_rank0"][0] == bf16["train_loss_rank0"][0]
    assert dq["train_loss_rank0"][0] == pytest.approx(exact["train_loss_rank0"][0], rel=1e-3)
    assert exact["final_loss"] < exact["initial_loss"] and exact["vnmse"] < 1e-12
    assert exact["vnmse"] < bf16["vnmse"] < 1e-3
    assert 0 < dq["bytes_per_step"] < bf16["bytes_per_step"] < exact["bytes_per_step"]
    summary = dq["fsdp2_summary"]["compressed"]
    # 10 steps: 3 all-gathers forward and 2 backward (the root keeps its weights), 3
    # reduce-scatters; none of the evaluations' gathers (exact, outside FSDP2's collectives)
    assert (summary["weights"]["calls"], summary["gradients"]["calls"]) == (50, 30), summary
    assert summary["weights"]["wire_bytes"] < summary["weights"]["exact_bytes"] / 3
    assert exact["target"] == pytest.approx(1.01 * exact["final_loss"]) == dq["target"]
    assert "| vs 16-bit peer |" in stdout
