"""The tuner on constructed cases, its tables, algorithm='auto', and the two commands."""

from __future__ import annotations

import json

import pytest
import torch

import dqcoll
from dqcoll.cli import simulate as simulate_cli
from dqcoll.cli import tune as tune_cli
from dqcoll.testing import run_local
from dqcoll.topology.graph import Topology
from dqcoll.topology.sources import make_source
from dqcoll.topology.tuning import Candidate, TunedEntry, TunedTable, tune
from dqcoll_lab.cli import simulate as lab_simulate_cli

SOURCE = "lognormal-mixture:supergroups=48"
CANDIDATES = [
    Candidate("ring", "none"),
    Candidate("ring", "dynamiq", 6.0),
    Candidate("hier:ring/ring", "dynamiq", 6.0),
    Candidate("hier:ring/ring", "none"),
]


@pytest.fixture(scope="module")
def slow_network_table():
    """2 hosts x 4 GPUs behind 1 Gb/s NICs, tuned on a small candidate set."""
    topology = Topology.cluster(2, 4, inter_gbps=1.0)
    return tune(topology, [4096, 1 << 26], error_budget=0.02, candidates=CANDIDATES,
                data=make_source(SOURCE, world_size=topology.world_size))


def test_slow_network_picks_hierarchical_compression(slow_network_table):
    """With a slow inter-node link and a large message, hierarchical with dynamiq across nodes
    wins: its bytes cross the NIC compressed once, NVLink carries the rest."""
    big = slow_network_table.lookup(1 << 26)
    assert big.choice == Candidate("hier:ring/ring", "dynamiq", 6.0)
    assert big.vnmse <= 0.02
    times = dict(big.times_us)
    assert times["ring/none"] > 5 * big.predicted_us


def test_tiny_message_picks_uncompressed(slow_network_table):
    """A 4 KiB message is latency-bound: the statistics round of dynamiq costs more than the
    bytes it saves, so an uncompressed configuration wins."""
    small = slow_network_table.lookup(4096)
    assert small.choice.scheme == "none"


def test_error_budget_excludes_lossy_candidates():
    """A budget below what dynamiq reaches leaves only uncompressed candidates."""
    topology = Topology.cluster(2, 2, inter_gbps=1.0)
    table = tune(topology, [1 << 24], error_budget=1e-9, candidates=CANDIDATES,
                 data=make_source(SOURCE, world_size=topology.world_size))
    assert table.entries[0].choice.scheme == "none"
    assert dict(table.errors)["ring/dynamiq@6"] > 1e-9


def test_table_json_round_trip_and_lookup(slow_network_table, tmp_path):
    """Tables round-trip through JSON; lookup takes the nearest smaller bucket (the smallest
    bucket below all)."""
    path = slow_network_table.save(str(tmp_path))
    assert path.endswith("2x4-nvlink-1g-w8-float32.json")
    loaded = TunedTable.load(path)
    assert loaded == slow_network_table
    assert loaded.lookup(100).nbytes == 4096
    assert loaded.lookup((1 << 26) - 1).nbytes == 4096
    assert loaded.lookup(1 << 30).nbytes == 1 << 26
    text = loaded.render()
    assert "hier:ring/ring/dynamiq@6" in text and "2x4-nvlink-1g" in text


def _table(topology_key: str, world_size: int, algorithm: str) -> TunedTable:
    entry = TunedEntry(1, Candidate(algorithm, "dynamiq", 5.0), 1.0, 0.0,
                       (("dynamiq", algorithm), ("none", algorithm)), ())
    return TunedTable(topology_key, world_size, "float32", 0.01, (entry,), ())


def test_planner_reads_a_stored_table_for_the_job(tmp_path, monkeypatch):
    """A table is the planner's stored result for a topology: for a named scheme it fixes the
    flat algorithm of the job whose detected key and world size it names; another key or no
    entry leaves the planner to price the flat algorithms."""
    from dqcoll import planner
    from dqcoll.topology.cost import KernelRates

    monkeypatch.setenv("DQCOLL_TUNING_DIR", str(tmp_path))
    _table("mine", 6, "ring").save(str(tmp_path))
    kernels = (("none", KernelRates(0.1, 0.2)), ("bf16", KernelRates(0.3, 0.6)),
               ("dynamiq", KernelRates(4.0, 0.8, 1.6)))
    p = planner.Planner(planner.JobTopology(((0, 1, 2, 3, 4, 5),), (0,) * 6),
                        planner.MeasuredRates(10.0, None, kernels, 2))
    p.table_key = "mine"
    assert p.stored_algorithm(1 << 20, "float32", "dynamiq") == "ring"
    plan = p.plan("allreduce", 1 << 20, "float32", scheme="dynamiq")
    assert plan.algorithm == "ring" and "stored table mine" in plan.reason
    assert p.stored_algorithm(1 << 20, "float32", "int8_block") is None
    p.table_key = "other"
    assert p.stored_algorithm(1 << 20, "float32", "dynamiq") is None


def test_allreduce_auto_uses_the_table(tmp_path, monkeypatch):
    """allreduce(algorithm='auto') runs the flat algorithm the tuned table of the detected
    topology stores (4 CPU ranks on this host -> host4-loopback) for the call's scheme."""
    monkeypatch.setenv("DQCOLL_TUNING_DIR", str(tmp_path))
    _table("host4-loopback", 4, "direct").save(str(tmp_path))

    def body(comm):
        x = torch.ones(1000)
        dqcoll.allreduce(x, scheme="none", algorithm="auto", comm=comm)
        return comm.last_info["algorithm"], x

    for algorithm, x in run_local(4, body):
        assert algorithm == "direct" and torch.equal(x, torch.full((1000,), 4.0))


def test_tune_cli_writes_table_and_png(tmp_path, capsys):
    """dqcoll tune writes the JSON table and a PNG and prints a readable table."""
    code = tune_cli.main(["--topology", "2x2@10", "-b", "64K", "-e", "1M", "-f", "16",
                          "--schemes", "none,dynamiq", "--bits", "6", "--tiles", "1,4",
                          "--source", "lognormal-mixture:supergroups=16",
                          "--out-dir", str(tmp_path)])
    assert code == 0
    table = TunedTable.load(str(tmp_path / "2x2-nvlink-10g-w4-float32.json"))
    assert [e.nbytes for e in table.entries] == [1 << 16, 1 << 20]
    assert table.complete and dict(table.provenance)["command"].startswith("dqcoll tune")
    png = tmp_path / "2x2-nvlink-10g-w4-float32.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "size(B)" in out and "wrote" in out


def test_simulate_cli_json(capsys):
    """dqcoll simulate --json reports predicted time, speed-up over an fp32 ring and vNMSE."""
    code = simulate_cli.main(["--world-size", "4", "--algorithm", "butterfly", "--scheme",
                              "dynamiq", "--bits", "6", "--source",
                              "lognormal-mixture:supergroups=8", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["world_size"] == 4 and report["complete"] is True
    assert 0 < report["vnmse"] < 0.05
    assert report["predicted_us"] > 0 and report["speedup_vs_ring_none"] > 0
    assert report["peak_rss_mb"] > 0 and report["wall_s"] > 0 and report["memory_mb"] > 0
    assert report["command"].startswith("dqcoll simulate --world-size 4")


def test_cli_reports_a_bad_scheme_spec_without_a_traceback(capsys):
    """A bad argument ends the command with its message and exit status 2: the runtime's
    command for a format nobody registered, the lab's for an option nobody has."""
    from dqcoll.cli.main import main as dqcoll_main
    from dqcoll_lab.cli.main import main as lab_main

    assert dqcoll_main(["simulate", "-n", "4", "--scheme", "dynamiq:format=format3"]) == 2
    assert "dqcoll simulate: error: dynamiq: format must be one of" in capsys.readouterr().err
    assert lab_main(["simulate", "-n", "4", "--scheme", "dynamiq:colour=blue"]) == 2
    err = capsys.readouterr().err
    assert "dqcoll-lab simulate: error:" in err and "research options" in err


def test_simulate_cli_scheme_specs_and_large_n(capsys):
    """--scheme takes a spec (the paper's DynamiQ with a research knob through the lab's
    command, MXFP8 with global scales); past PRICE_TRANSFERS the cost model is skipped, said so
    in the report, unless --price."""
    code = lab_simulate_cli.main(["-n", "4", "--algorithm", "ring", "--scheme",
                                  "dynamiq:format=paper;max_width=16", "--bits", "6",
                                  "--source", "lognormal-mixture:supergroups=8", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["scheme_options"] == {"format": "paper+max_width=16"} and report["bits"] == 6
    assert 0 < report["vnmse"] < 0.1
    code = simulate_cli.main(["-n", "4", "--algorithm", "butterfly", "--scheme",
                              "mxfp8:scale=global", "--source",
                              "lognormal-mixture:supergroups=8", "--json", "--no-price"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bits"] is None and 0 < report["vnmse"] < 0.1
    assert report["price_skipped"] == "--no-price" and report["predicted_us"] is None
    code = simulate_cli.main(["-n", "2048", "--algorithm", "ring", "--no-error", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert "transfers" in report["price_skipped"] and report["vnmse"] is None
