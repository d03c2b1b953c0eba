"""``dqcoll bench``: nccl-tests conventions, correctness before timing, provenance in every row.

The end-to-end test spawns 2 gloo processes on tiny sizes; it asks for an impossible tolerance
on ``dynamiq`` so that the same run shows a failed row (no speed printed, exit status 1) next to
rows that pass.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch

from dqcoll.cli import bench
from dqcoll.cli import main as cli_main
from dqcoll.transports.base import ring_allreduce_nbytes


@pytest.mark.parametrize(("text", "nbytes"), [("256", 256), ("64K", 65536), ("1M", 1 << 20),
                                              ("2G", 2 << 30), ("16MB", 16 << 20)])
def test_parse_size_uses_binary_multiples(text, nbytes):
    """Sizes follow nccl-tests: K, M, G are powers of 1024, an optional B is accepted."""
    assert bench.parse_size(text) == nbytes


def test_parse_size_rejects_garbage():
    """A size that is not a number with an optional unit is an argument error naming it."""
    with pytest.raises(argparse.ArgumentTypeError, match=r"1\.5M"):
        bench.parse_size("1.5M")


def test_size_sweep_factor_and_step():
    """-b/-e/-f multiply from min to max inclusive; -i adds a fixed step instead."""
    assert bench.size_sweep(1 << 20, 64 << 20, 4) == [1 << 20, 4 << 20, 16 << 20, 64 << 20]
    assert bench.size_sweep(100, 350, 2, step_nbytes=100) == [100, 200, 300]
    with pytest.raises(ValueError, match="stepfactor"):
        bench.size_sweep(1, 10, 1)


def test_busbw_factor_matches_nccl_tests():
    """busbw = algbw * 2(n-1)/n for all-reduce, 0 for one rank."""
    assert bench.busbw_factor(4) == pytest.approx(1.5)
    assert bench.busbw_factor(8) == pytest.approx(1.75)
    assert bench.busbw_factor(1) == 0.0


def test_build_cases_expands_lists_and_names_peers():
    """Every (scheme, bits, algorithm) gives one dqcoll row (bits only where the scheme takes
    them), followed by the peers in the order asked; unknown names raise naming what exists."""
    cases = bench.build_cases(torch.float32, ["dynamiq", "none"], [4.0, 6.0], ["ring", "direct"],
                              ["fp32", "bf16_hook"])
    labels = [c.label for c in cases]
    assert labels == ["dqcoll dynamiq 4b ring", "dqcoll dynamiq 4b direct",
                      "dqcoll dynamiq 6b ring", "dqcoll dynamiq 6b direct",
                      "dqcoll none ring", "dqcoll none direct", "torch fp32", "ddp bf16_hook"]
    hook = cases[-1]
    assert hook.hook == "bf16_compress_hook" and hook.wire_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="fp16_hook"):
        bench.build_cases(torch.float32, [], [5.0], ["ring"], ["nccl"])
    with pytest.raises(Exception, match="registered schemes"):
        bench.build_cases(torch.float32, ["nope"], [5.0], ["ring"], [])


def test_bench_is_a_dqcoll_subcommand():
    """`dqcoll bench` is registered in the console script's command table."""
    assert cli_main.COMMANDS["bench"][0] == "dqcoll.cli.bench"


def test_bench_end_to_end_checks_before_timing(tmp_path):
    """2 spawned gloo ranks: rows that pass the correctness check carry time, algbw on the
    uncompressed size, busbw = algbw * 2(n-1)/n, wire bytes and provenance; the row that fails
    its check (dynamiq held to vNMSE 1e-12) has no speed, is printed FAILED, and the command
    exits with status 1."""
    out_json = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "dqcoll.cli.bench", "-g", "2", "-b", "4K", "-e", "4K", "-f",
           "4", "-n", "2", "-w", "1", "--scheme", "dynamiq,none", "--algorithm", "butterfly",
           "--peers", "fp32,bf16,fp16_hook", "--max-vnmse", "1e-12", "--codec", "0",
           "--json", str(out_json)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    text = done.stdout
    assert "size" in text and "algbw" in text and "busbw" in text and "wire_B" in text
    assert "FAILED: vnmse" in text
    assert "# checks failed: 1 of 5" in text
    data = json.loads(out_json.read_text())
    rows = data["rows"]
    assert len(rows) == 5  # 2 dqcoll + 3 peers
    for row in rows:
        for key in ("device", "world_size", "topology", "dqcoll_version", "commit"):
            assert row[key] == data["provenance"][key]
        assert row["world_size"] == 2
        if row["impl"].startswith("dqcoll dynamiq"):
            assert not row["check_ok"] and "time_us" not in row
            continue
        assert row["check_ok"], row
        seconds = row["time_us"] / 1e6
        assert row["algbw_gbps"] == pytest.approx(row["size_nbytes"] / seconds / 1e9)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * bench.busbw_factor(2))
        assert row["ratio"] == pytest.approx(
            ring_allreduce_nbytes(row["size_nbytes"], 2) / row["wire_nbytes"])
    none_rows = [r for r in rows if r["impl"] == "dqcoll none butterfly"]
    for row in none_rows:  # measured: the payload plus the small argument-check all-reduce
        assert row["wire_nbytes"] >= ring_allreduce_nbytes(row["size_nbytes"], 2)
        assert row["vnmse"] < 1e-12
    bf16 = [r for r in rows if r["impl"] == "torch bf16"]
    assert all(r["type"] == "bfloat16" and r["size_nbytes"] == r["count"] * 2 for r in bf16)
    hooks = [r for r in rows if r["impl"] == "ddp fp16_hook"]
    assert all(r["redop"] == "avg" and r["ratio"] == pytest.approx(2.0) for r in hooks)
    table = bench.render_markdown(str(out_json))  # --render: the same rows for docs/
    main_table = table.split("Speed-up")[0]
    assert main_table.count("\n| ") == 1 + len(rows) and "FAILED" in main_table
