"""``benchmarks/ddp_step.py`` and ``tools/ddp_step_matrix.py``: the training-step benchmark.

Statistics and rendering are checked on exact inputs; the matrix's commands without running
them; and one tiny end-to-end run (2 ranks over loopback, a 2-layer 64-wide MLP, 2 timed steps)
checks that every row ends with a status, that the JSON carries its provenance and that the
error measured beside each time is the right one: DDP's fp32 average is exact to rounding, the
fp16 hook's is close, dqcoll's is within its budget with the bits it was given. No timing is
asserted.
"""

from __future__ import annotations

import importlib.util
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


ddp_step = _load(ROOT / "benchmarks" / "ddp_step.py", "ddp_step")
ddp_timeline = _load(ROOT / "benchmarks" / "ddp_timeline.py", "ddp_timeline")
matrix = _load(ROOT / "tools" / "ddp_step_matrix.py", "ddp_step_matrix")


def test_percentiles_interpolate_like_numpy():
    """Median, p10 and p90 use linear interpolation between order statistics (numpy's default),
    whatever the order of the steps."""
    steps = [50.0, 10.0, 40.0, 20.0, 30.0]
    assert ddp_step.summarize(steps) == {"median_ms": 30.0, "p10_ms": 14.0, "p90_ms": 46.0}
    assert ddp_step.percentile([7.0], 90) == 7.0
    with pytest.raises(ValueError):
        ddp_step.percentile([], 50)


def test_step_statistics_take_the_slowest_ranks_median_not_the_maximum_per_step():
    """Two ranks that alternate long and short steps (each waits in one step for the other's
    previous one) run 30 ms per step, which both their medians and their wall times say; the
    maximum per step (the statistic of the files before 2026-11-28, kept beside it) reads 40."""
    ranks = [[20.0, 40.0, 20.0, 40.0], [40.0, 20.0, 40.0, 20.0]]
    stats = ddp_step.step_statistics(ranks, [120.0, 121.0])
    assert stats["median_ms"] == 30.0
    assert stats["p10_ms"] == 20.0 and stats["p90_ms"] == 40.0
    assert stats["wall_ms_per_step"] == 121.0 / 4
    assert stats["slowest_per_step_median_ms"] == 40.0 and stats["step_ms"] == [40.0] * 4
    # a rank that is slower in every step decides the row
    stats = ddp_step.step_statistics([[10.0, 12.0, 11.0], [30.0, 31.0, 29.0]], [33.0, 90.0])
    assert stats["median_ms"] == 30.0 and stats["wall_ms_per_step"] == 30.0


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_models_have_the_issue_size(name):
    """Both models have ~12.6 M parameters at the defaults (the MLP exactly 12 x (1024^2 +
    1024)), and the same seed gives the same weights."""
    model = ddp_step.build_model(name)
    numel = sum(p.numel() for p in model.parameters())
    if name == "mlp":
        assert numel == 12 * (1024 * 1024 + 1024)
    else:
        assert 12.0e6 <= numel <= 13.0e6
    again = ddp_step.build_model(name)
    assert all((a == b).all() for a, b in zip(model.parameters(), again.parameters(),
                                              strict=True))


def _result(link: str, rows: list[dict]) -> dict:
    return {"provenance": {"link": link, "world_size": 4, "model": "mlp", "commit": "abc123",
                           "device": "CPU: test, 2 cores", "note": "shared machine"},
            "rows": rows}


def test_render_markdown_puts_time_speedup_and_error_side_by_side(tmp_path):
    """The summary has one line per result file with each row's median and its speed-up over
    DDP's default, the status of rows that did not run, and a second table with the bits and
    vNMSE of the compressed rows."""
    rows = [
        {"row": "floor", "label": "", "status": "ok", "median_ms": 85.0},
        {"row": "ddp", "label": "", "status": "ok", "median_ms": 765.0, "speedup_vs_ddp": 1.0},
        {"row": "dynamiq", "label": "", "status": "ok", "median_ms": 306.0,
         "speedup_vs_ddp": 2.5, "bits_per_coord": 5.01, "vnmse": 3.2e-4},
        {"row": "auto", "label": "", "status": "not available: no scheme 'auto'"},
        {"row": "powersgd", "label": "", "status": "crashed: RuntimeError: gloo"},
    ]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_result("1gbit", rows)))
    text = ddp_step.render_markdown([str(path)])
    line = next(ln for ln in text.splitlines() if ln.startswith("| 1gbit | 4 | mlp |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[3:] == ["85", "765 (1.00x)", "", "306 (2.50x)", "not available", "crashed"]
    assert "| 1gbit | 4 | mlp | dqcoll dynamiq 5 b | 5.01 | 3.20e-04 |" in text
    assert "abc123" in text and "shared machine" in text


def test_matrix_runs_every_configuration_once():
    """The matrix is links x world sizes x models, each writing its own result file: loopback
    spawns the ranks, a rate runs them on the emulated cluster with the env:// launcher."""
    runs = matrix.build_runs(["loopback", "1gbit"], [4, 2], ["mlp", "transformer"],
                             out_dir=Path("/results"), bench_args=("--steps", "5"))
    assert len(runs) == 8
    assert len({r.json_path for r in runs}) == 8
    loop = runs[0]
    assert loop.json_path == Path("/results/ddp-step-loopback-4-mlp.json")
    assert "-n" in loop.command and "dqcoll.cli.netns" not in loop.command
    link = next(r for r in runs if r.link == "1gbit" and r.world_size == 2
                and r.model == "transformer")
    cmd = list(link.command)
    assert cmd[cmd.index("--rate") + 1] == "1gbit" and cmd[cmd.index("-n") + 1] == "2"
    after = cmd[cmd.index("--") + 1 :]
    assert after[after.index("--launcher") + 1] == "env"
    assert after[after.index("--json") + 1] == "/results/ddp-step-1gbit-2-transformer.json"
    assert after[-2:] == ["--steps", "5"]


@pytest.mark.slow
def test_tiny_run_writes_every_row_with_its_error(tmp_path):
    """2 ranks, a tiny MLP, 2 timed steps: every requested row has a status; the ones that ran
    have median <= p90 and an error beside the time: DDP's default is exact to fp32 rounding,
    the fp16 hook within fp16's, dqcoll's dynamiq hook sends ~5 bits per coordinate (measured)
    with a small vNMSE; ``auto`` either ran or says it is not available."""
    out = tmp_path / "tiny.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ddp_step.py"), "-n", "2", "--width", "64",
         "--layers", "2", "--steps", "2", "--warmup", "1", "--json", str(out),
         "--rows", "floor,ddp,fp16_hook,dynamiq,auto", "--note", "test"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    prov = result["provenance"]
    assert prov["world_size"] == 2 and prov["link"] == "loopback" and prov["model"] == "mlp"
    assert "2 processes" in prov["topology"]
    assert prov["bucket_cap_mb"] == 25 and prov["params"] == 2 * (64 * 64 + 64)
    for key in ("commit", "device", "torch_version", "numba_version", "date_utc", "command"):
        assert prov[key]
    rows = {r["row"]: r for r in result["rows"]}
    assert list(rows) == ["floor", "ddp", "fp16_hook", "dynamiq", "auto"]
    for name in ("floor", "ddp", "fp16_hook", "dynamiq"):
        row = rows[name]
        assert row["status"] == "ok", row
        assert len(row["step_ms"]) == 2 and row["p10_ms"] <= row["median_ms"] <= row["p90_ms"]
        assert [len(times) for times in row["rank_step_ms"]] == [2, 2]
        assert row["median_ms"] <= row["slowest_per_step_median_ms"], row
        assert row["wall_ms_per_step"] > 0
        assert len(row["cpu_ms_per_rank"]) == 2 and min(row["cpu_ms_per_rank"]) > 0, row
    assert rows["ddp"]["vnmse"] < 1e-12 and rows["ddp"]["speedup_vs_ddp"] == 1.0
    assert "speedup_vs_ddp" not in rows["floor"]  # the floor is not a way to average
    assert rows["fp16_hook"]["vnmse"] < 1e-5
    assert 4.0 <= rows["dynamiq"]["bits_per_coord"] <= 8.0
    assert rows["dynamiq"]["vnmse"] < 1e-2
    assert rows["auto"]["status"] == "ok" or rows["auto"]["status"].startswith("not available")
    assert "no communication (no DDP)" in done.stdout  # rank 0's table


@pytest.mark.slow
def test_timeline_records_every_rank_bucket_and_exchange(tmp_path):
    """``benchmarks/ddp_timeline.py``, 2 ranks, a tiny MLP, dynamiq's hook: every rank's timed
    steps, each with the step's marks in order, a submitted, released and completed bucket, the
    call's phases and its exchanges (bytes sent), and CPU per thread; rank 0 prints the
    median step's timeline."""
    out = tmp_path / "timeline.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ddp_timeline.py"), "-n", "2", "--width", "64",
         "--layers", "2", "--steps", "2", "--warmup", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["row"] == "dynamiq" and len(result["ranks"]) == 2
    for steps in result["ranks"]:
        assert len(steps) == 2
        for step in steps:
            kinds = [kind for _, _, kind, _ in step["events"]]
            marks = [k for k in kinds if k in ("forward done", "backward returned",
                                                 "optimizer done")]
            assert marks == ["forward done", "backward returned", "optimizer done"]
            for kind in ("bucket submitted", "bucket released", "prepare", "argument check",
                         "schedule", "final decode"):
                assert kind in kinds, (kind, kinds)
            exchanges = [d for _, _, k, d in step["events"] if k == "exchange"]
            assert exchanges and all(d["bytes_sent"] > 0 for d in exchanges)
            assert step["ms"] > 0 and step["thread_cpu_ms"]
    assert "each rank's median step" in done.stdout and "CPU per rank and step" in done.stdout
    text = ddp_timeline.render(result["ranks"], 1)  # the file renders as rank 0 printed it
    assert "-- rank 0, timed step" in text and "-- rank 1" not in text
