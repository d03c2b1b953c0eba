"""Per-call metrics (``comm.metrics``, :mod:`dqcoll.call_metrics`): every collective run through
the API leaves a record of what ran and what it sent, the running totals survive the ring's
wrap, and both exports (NCCL Inspector JSON lines, Prometheus text) are well formed and agree
with the records."""

from __future__ import annotations

import io
import json
import logging
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

import dqcoll
from dqcoll.call_metrics import CallMetrics, CallRecord, exact_wire_nbytes, plan_of, size_class
from dqcoll.errors import DqcollError
from dqcoll.testing import run_local

N = 3
NUMEL = 3 * (1 << 14)  # divisible by N: reduce-scatter and all-gather shards
INSPECTOR_FIELDS = ("coll", "coll_sn", "coll_msg_size_bytes", "coll_exec_time_us",
                    "coll_timing_source", "coll_algobw_gbs", "coll_busbw_gbs")
DQCOLL_FIELDS = ("scheme", "algorithm", "bits_requested", "bits_wire", "wire_bytes",
                 "exact_wire_bytes", "plan", "predicted_us", "status", "nbytes", "numel", "dtype")


def _data(rank: int, numel: int, salt: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 * rank + salt))


def _call(comm: Any, collective: str, scheme: str, salt: int = 0) -> None:
    """One call of ``collective`` with ``scheme`` at 5 bits on this rank's data."""
    n = comm.world_size
    if collective == "allreduce":
        dqcoll.allreduce(_data(comm.rank, NUMEL, salt), scheme=scheme, bits=5, comm=comm)
    elif collective == "reduce_scatter":
        dqcoll.reduce_scatter(_data(comm.rank, NUMEL, salt), torch.empty(NUMEL // n),
                              scheme=scheme, bits=5, comm=comm)
    else:
        dqcoll.all_gather(_data(comm.rank, NUMEL // n, salt), torch.empty(NUMEL),
                          scheme=scheme, bits=5, comm=comm)


CASES = [(c, s) for s in ("dynamiq", "none", "auto")
         for c in ("allreduce", "reduce_scatter", "all_gather")
         if not (s == "auto" and c == "all_gather")]  # auto takes no all-gather


def _run_and_observe(comm: Any, cases: list[tuple[str, str]]) -> list[tuple[Any, ...]]:
    """Each call with what the test saw around it: the counter delta and last_info."""
    seen = []
    for collective, scheme in cases:
        before = comm.counters["bytes_sent"]
        _call(comm, collective, scheme)
        seen.append((collective, scheme, comm.counters["bytes_sent"] - before,
                     dict(comm.last_info), comm.metrics.last))
    return seen


@pytest.mark.parametrize("collective,scheme", CASES)
def test_record_fields(collective: str, scheme: str) -> None:
    """A call's record says what ran: the collective, its call number, the whole buffer's size,
    the scheme and algorithm of ``last_info``, the wire bytes equal to the transport counter's
    delta over the call, the uncompressed ring's bytes by formula (2(n-1)/n for all-reduce,
    (n-1)/n otherwise), measured wire bits ~5 for dynamiq at bits=5 and >= the dtype's 32 for
    none, and the planner's plan and predicted time (every call here is planned)."""
    cases = [(collective, scheme)] * 2  # the first call makes the planner, the second is plain

    def fn(comm: Any) -> list[tuple[Any, ...]]:
        return _run_and_observe(comm, cases)

    for rank, seen in enumerate(run_local(N, fn)):
        for i, (_, _, delta, info, record) in enumerate(seen):
            assert isinstance(record, CallRecord)
            assert (record.collective, record.seq, record.rank, record.world_size) == (
                collective, i, rank, N)
            assert (record.numel, record.nbytes, record.dtype, record.device) == (
                NUMEL, 4 * NUMEL, "float32", "cpu")
            assert record.status == "ok"
            assert record.wire_bytes == delta > 0
            hops = 2 * (N - 1) if collective == "allreduce" else N - 1
            assert record.exact_wire_bytes == hops * 4 * NUMEL // N
            assert record.scheme == info["scheme"]
            assert record.algorithm == info["algorithm"]
            assert record.bits_wire == pytest.approx(32 * delta / record.exact_wire_bytes)
            assert record.plan["kind"] == "flat"
            assert record.plan["scheme"] == info["scheme"]
            assert record.measured_us > 0
            # every call here is planned (algorithm="auto"): the planner's plan and prediction
            planned = info["planned"]
            assert record.plan["planner"]["label"] == planned["label"]
            assert record.plan["planner"]["alternatives"] == planned["alternatives"]
            assert planned["predicted_us"] > 0
            assert record.predicted_us == pytest.approx(planned["predicted_us"], abs=0.1)
            assert record.scheme == planned["scheme"]
            if scheme == "dynamiq":
                assert record.bits_requested == 5.0
                assert 4.5 <= record.bits_wire <= 5.6
            elif scheme == "none":
                assert record.bits_requested == 5.0  # as the caller asked (none ignores it)
                # exact: never below the dtype; the ring carries fp64 partial sums
                assert 32.0 <= record.bits_wire <= 64.5


def test_jsonl_lines_have_inspector_and_dqcoll_fields(tmp_path: Path) -> None:
    """``to_jsonl`` writes one JSON object per recorded call in NCCL Inspector's shape (header
    with rank and n_ranks, metadata, coll_perf with Inspector's names and dqcoll's own fields);
    the bandwidths follow Inspector's definitions (algorithm: the whole buffer over the time;
    bus: times 2(n-1)/n or (n-1)/n) and the message size is NCCL's (one shard for
    reduce-scatter / all-gather); a path is appended to, a file object written."""
    cases = [("allreduce", "dynamiq"), ("reduce_scatter", "none"), ("all_gather", "dynamiq"),
             ("allreduce", "auto")]

    def fn(comm: Any) -> tuple[list[CallRecord], str]:
        _run_and_observe(comm, cases)
        out = io.StringIO()
        assert comm.metrics.to_jsonl(out) == len(cases)
        comm.metrics.to_jsonl(tmp_path / f"r{comm.rank}.jsonl")
        comm.metrics.to_jsonl(str(tmp_path / f"r{comm.rank}.jsonl"))
        return comm.metrics.records, out.getvalue()

    for rank, (records, text) in enumerate(run_local(N, fn)):
        lines = text.splitlines()
        appended = (tmp_path / f"r{rank}.jsonl").read_text().splitlines()
        assert [json.loads(x)["coll_perf"] for x in appended] == [
            json.loads(x)["coll_perf"] for x in lines + lines]
        assert len(lines) == len(cases)
        for line, record, (collective, _) in zip(lines, records, cases, strict=True):
            obj = json.loads(line)
            assert obj["header"] == {"rank": rank, "n_ranks": N}
            assert {"hostname", "pid", "dump_timestamp_us"} <= set(obj["metadata"])
            perf = obj["coll_perf"]
            assert set(INSPECTOR_FIELDS + DQCOLL_FIELDS) <= set(perf)
            assert perf["coll"] == {"allreduce": "AllReduce", "reduce_scatter": "ReduceScatter",
                                    "all_gather": "AllGather"}[collective]
            assert perf["coll_sn"] == record.seq
            assert perf["coll_msg_size_bytes"] == (
                4 * NUMEL if collective == "allreduce" else 4 * NUMEL // N)
            assert perf["wire_bytes"] == record.wire_bytes
            assert perf["plan"]["kind"] == "flat"
            algo = record.nbytes / (perf["coll_exec_time_us"] * 1e3)
            factor = 2 * (N - 1) / N if collective == "allreduce" else (N - 1) / N
            assert perf["coll_algobw_gbs"] == pytest.approx(algo, rel=1e-3, abs=1e-6)
            assert perf["coll_busbw_gbs"] == pytest.approx(algo * factor, rel=1e-3, abs=1e-6)
        assert json.loads(lines[-1])["coll_perf"]["predicted_us"] is not None  # auto's


# -- Prometheus text format (https://prometheus.io/docs/instrumenting/exposition_formats/) --

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\\\|\\"|\\n)*)"'
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{((?:{_LABEL})(?:,{_LABEL})*,?)?\}})? (\S+)( -?\d+)?$")


def parse_prometheus(text: str) -> dict[str, Any]:
    """A strict parser of the text exposition format: families with their HELP and TYPE (each
    at most once, TYPE before the family's samples), samples with unique label sets and float
    values. Raises AssertionError on anything the format does not allow."""
    assert text.endswith("\n"), "the exposition ends with a line feed"
    families: dict[str, dict[str, Any]] = {}
    seen_series: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for line in text[:-1].split("\n"):
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                name = parts[2]
                assert re.fullmatch(_NAME, name), line
                family = families.setdefault(name, {"samples": []})
                key = parts[1].lower()
                assert key not in family, f"second {parts[1]} for {name}"
                if key == "type":
                    assert not family["samples"], f"TYPE after samples of {name}"
                    assert parts[3] in ("counter", "gauge", "histogram", "summary", "untyped")
                family[key] = parts[3] if len(parts) > 3 else ""
            continue
        match = _SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        name, value = match.group(1), match.group(7)
        labels = tuple(re.findall(_LABEL, match.group(2) or ""))
        assert len({k for k, _ in labels}) == len(labels), f"repeated label: {line}"
        assert (name, labels) not in seen_series, f"duplicate series: {line}"
        seen_series.add((name, labels))
        assert value in ("NaN", "+Inf", "-Inf") or math.isfinite(float(value)), line
        family = families.setdefault(name, {"samples": []})
        family["samples"].append((dict(labels), float(value)))
    for name, family in families.items():
        assert "type" in family, f"{name} has no TYPE"
        if family["type"] == "counter":
            assert name.endswith("_total"), name
            assert all(v >= 0 for _, v in family["samples"]), name
    return families


def test_prometheus_text_parses_and_totals_equal_records() -> None:
    """``prometheus_text`` is valid exposition text (HELP / TYPE once per family, counters named
    ``*_total``, unique series) labelled collective / scheme / algorithm / size_class / rank, and
    each counter's sum over the series equals the same sum over the call records."""
    cases = [(c, s) for c, s in CASES] + [("allreduce", "dynamiq")] * 2

    def fn(comm: Any) -> tuple[list[CallRecord], str]:
        _run_and_observe(comm, cases)
        return comm.metrics.records, comm.metrics.prometheus_text()

    for rank, (records, text) in enumerate(run_local(N, fn)):
        families = parse_prometheus(text)
        for name in ("dqcoll_calls_total", "dqcoll_bytes_total", "dqcoll_wire_bytes_total",
                     "dqcoll_call_seconds_total", "dqcoll_exact_wire_bytes_total"):
            assert families[name]["type"] == "counter"
            for labels, _ in families[name]["samples"]:
                assert set(labels) == {"collective", "scheme", "algorithm", "size_class",
                                       "rank"}
                assert labels["rank"] == str(rank)

        def total(name: str, families: dict[str, Any] = families) -> float:
            return sum(v for _, v in families[name]["samples"])

        assert total("dqcoll_calls_total") == len(records) == len(cases)
        assert total("dqcoll_call_errors_total") == 0
        assert total("dqcoll_bytes_total") == sum(r.nbytes for r in records)
        assert total("dqcoll_wire_bytes_total") == sum(r.wire_bytes for r in records)
        assert total("dqcoll_exact_wire_bytes_total") == sum(r.exact_wire_bytes for r in records)
        assert total("dqcoll_call_seconds_total") == pytest.approx(
            sum(r.measured_us for r in records) * 1e-6)
        predicted = [r for r in records if r.predicted_us is not None]
        assert total("dqcoll_predicted_calls_total") == len(predicted) > 0
        assert total("dqcoll_predicted_seconds_total") == pytest.approx(
            sum(r.predicted_us for r in predicted) * 1e-6)  # type: ignore[misc]
        by_series: dict[tuple[str, ...], int] = defaultdict(int)
        for r in records:
            by_series[(r.collective, r.scheme, r.algorithm, size_class(r.nbytes))] += 1
        assert {(s["collective"], s["scheme"], s["algorithm"], s["size_class"]): v
                for s, v in families["dqcoll_calls_total"]["samples"]} == by_series


def test_prometheus_label_values_escaped() -> None:
    """Label values with a quote, a backslash or a line feed are escaped as the format says,
    so the text still parses and gives the value back."""
    metrics = CallMetrics(0, 2, capacity=4)
    metrics.record_call("allreduce", torch.zeros(8), seq=0, measured_s=1e-3, wire_bytes=32,
                        info={"scheme": 'we"ird\\sch\neme', "algorithm": "ring"})
    families = parse_prometheus(metrics.prometheus_text())
    [(labels, value)] = families["dqcoll_calls_total"]["samples"]
    assert value == 1
    assert labels["scheme"].encode().decode("unicode_escape") == 'we"ird\\sch\neme'


def test_ring_wraps_without_losing_totals(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``DQCOLL_METRICS_RECORDS=3`` the ring keeps the last three records (their call
    numbers the last three), while the totals and Prometheus' counters still count every call,
    and the dropped-records counter says how many left the ring."""
    monkeypatch.setenv("DQCOLL_METRICS_RECORDS", "3")
    calls = 7

    def fn(comm: Any) -> tuple[list[CallRecord], Any, int, str]:
        for i in range(calls):
            _call(comm, "allreduce", "dynamiq", salt=i)
        m = comm.metrics
        return m.records, m.totals(), m.calls, m.prometheus_text()

    for records, totals, count, text in run_local(N, fn):
        assert [r.seq for r in records] == [4, 5, 6]
        assert count == calls
        assert sum(t.calls for t in totals.values()) == calls
        assert sum(t.nbytes for t in totals.values()) == calls * 4 * NUMEL
        assert sum(t.exact_wire_bytes for t in totals.values()) == calls * exact_wire_nbytes(
            "allreduce", 4 * NUMEL, N)
        families = parse_prometheus(text)
        assert sum(v for _, v in families["dqcoll_calls_total"]["samples"]) == calls
        assert families["dqcoll_metrics_records"]["samples"][0][1] == 3
        assert families["dqcoll_metrics_records_dropped_total"]["samples"][0][1] == calls - 3


def test_failing_call_is_recorded_with_its_error_type() -> None:
    """A call whose argument check fails (rank 0 passes another length) is recorded on every
    rank with the type of the error that rank raised, the scheme and algorithm it asked for and
    no plan; the totals count it as an error, and the next valid call is recorded as ok."""

    def fn(comm: Any) -> tuple[str, list[CallRecord], str]:
        numel = NUMEL + (1 if comm.rank == 0 else 0)
        try:
            dqcoll.allreduce(_data(comm.rank, numel), scheme="dynamiq", algorithm="ring",
                             comm=comm)
        except DqcollError as exc:
            raised = type(exc).__name__
        else:
            raise AssertionError("the mismatched call did not raise")
        _call(comm, "allreduce", "dynamiq")
        return raised, comm.metrics.records, comm.metrics.prometheus_text()

    for raised, records, text in run_local(N, fn):
        failed, ok = records
        assert failed.status == raised
        assert (failed.scheme, failed.algorithm, failed.plan, failed.seq) == (
            "dynamiq", "ring", {}, 0)
        assert ok.status == "ok" and ok.seq == 1
        families = parse_prometheus(text)
        assert sum(v for _, v in families["dqcoll_call_errors_total"]["samples"]) == 1


def test_env_jsonl_writes_one_line_per_call(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``DQCOLL_METRICS_JSONL=path`` appends one line per call as it completes to
    ``path.rank{r}``, the failed call's included, each line the same as ``to_jsonl``'s
    coll_perf for that record; a ``{rank}`` placeholder names the file instead."""
    for pattern, name in (("m.jsonl", "m.jsonl.rank{r}"), ("m{rank}.jsonl", "m{r}.jsonl")):
        monkeypatch.setenv("DQCOLL_METRICS_JSONL", str(tmp_path / pattern))

        def fn(comm: Any, name: str = name) -> list[CallRecord]:
            _call(comm, "allreduce", "dynamiq")
            _call(comm, "reduce_scatter", "none")
            with pytest.raises(DqcollError):
                dqcoll.allreduce(_data(comm.rank, NUMEL + comm.rank), comm=comm)
            lines = (tmp_path / name.format(r=comm.rank)).read_text().splitlines()
            assert len(lines) == 3  # written as the calls completed, before close()
            comm.close()
            return comm.metrics.records

        for rank, records in enumerate(run_local(N, fn)):
            lines = (tmp_path / name.format(r=rank)).read_text().splitlines()
            perfs = [json.loads(line)["coll_perf"] for line in lines]
            assert [p["coll_sn"] for p in perfs] == [0, 1, 2]
            assert [p["status"] for p in perfs] == ["ok", "ok", records[2].status]
            for perf, record in zip(perfs, records, strict=True):
                assert perf == record.to_inspector()["coll_perf"]


def test_jsonl_write_failure_logs_once_and_never_raises(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A ``DQCOLL_METRICS_JSONL`` that cannot be written (its directory does not exist) never
    fails a call: the calls run and are recorded, and each rank logs one warning naming the
    path, not one per call."""
    missing = tmp_path / "no such dir" / "m.jsonl"
    monkeypatch.setenv("DQCOLL_METRICS_JSONL", str(missing))

    def fn(comm: Any) -> int:
        for i in range(3):
            _call(comm, "allreduce", "dynamiq", salt=i)
        return len(comm.metrics.records)

    with caplog.at_level(logging.WARNING, logger="dqcoll"):
        assert run_local(N, fn) == [3] * N
    warnings = [r for r in caplog.records if "DQCOLL_METRICS_JSONL" in r.getMessage()]
    assert len(warnings) == N
    assert all(str(missing) in w.getMessage() for w in warnings)


def test_record_call_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    """``record_call`` with information it cannot use (a ``last_info`` whose predicted time is
    malformed) returns None and logs one warning, however often it is called."""
    metrics = CallMetrics(1, 4, capacity=8)
    bad = {"scheme": "dynamiq", "predicted_us": "soon"}
    with caplog.at_level(logging.WARNING, logger="dqcoll"):
        for _ in range(3):
            assert metrics.record_call("allreduce", torch.zeros(4), seq=0, measured_s=0.0,
                                       wire_bytes=0, info=bad) is None
    assert len(metrics.records) == 0
    assert len([r for r in caplog.records if "metrics" in r.getMessage()]) == 1


def test_two_level_plan_recorded() -> None:
    """A two-level all-reduce recorded with :func:`~dqcoll.call_metrics.recording` (what its
    entry point calls) has the plan of both levels, each with the scheme and algorithm that
    ran, and its phases in order (reduce-scatter inside the host, all-reduce across,
    all-gather inside), wire bytes equal to the counters' delta over the whole call; the
    levels' sub-communicators write no JSONL file of their own."""
    from dqcoll.call_metrics import recording
    from dqcoll.topology.hierarchical import HierarchicalPlan, LevelSpec
    from dqcoll.transports.subgroup import SubgroupTransport

    plan = HierarchicalPlan(((0, 1), (2, 3)), LevelSpec("none", algorithm="ring"),
                            LevelSpec("dynamiq", 5, "ring"))

    def fn(comm: Any) -> tuple[CallRecord | None, int, str | None]:
        before = comm.counters["bytes_sent"]
        buf = _data(comm.rank, 4096)
        with recording(comm, "allreduce", buf, scheme="hierarchical", algorithm=plan.name):
            dqcoll.allreduce(buf, comm=comm, algorithm=plan)
        sub = CallMetrics.for_transport(SubgroupTransport(comm.transport, plan.intra_group(
            comm.rank)))
        return comm.metrics.last, comm.counters["bytes_sent"] - before, sub.jsonl_path

    for record, delta, sub_path in run_local(4, fn):
        assert record is not None and record.status == "ok"
        assert record.wire_bytes == delta
        assert record.plan["kind"] == "two_level"
        assert record.algorithm == plan.name
        intra, inter = record.plan["levels"]
        assert (intra["level"], intra["scheme"], intra["algorithm"]) == ("intra", "none", "ring")
        assert (inter["level"], inter["scheme"], inter["algorithm"]) == (
            "inter", "dynamiq", "ring")
        assert [(p["level"], p["collective"], p["scheme"]) for p in record.plan["phases"]] == [
            ("intra", "reduce_scatter", "none"), ("inter", "allreduce", "dynamiq"),
            ("intra", "all_gather", "none")]
        assert sub_path is None


def test_plan_of_shapes() -> None:
    """``plan_of`` reads what ``last_info`` holds: a plan the call gave as is, a two-level plan
    from the levels, otherwise a flat one with auto's choice; the size classes are powers of
    two and the exact ring bytes follow the formula."""
    assert plan_of({"plan": {"kind": "x"}}) == {"kind": "x"}
    assert plan_of({"scheme": "bf16", "algorithm": "ring", "bits": 16.0}) == {
        "kind": "flat", "scheme": "bf16", "algorithm": "ring", "bits": 16.0}
    assert [size_class(b) for b in (0, 1, 1000, 1024, 1025, 64 << 20, (64 << 20) + 1)] == [
        "0B", "1B", "1KiB", "1KiB", "2KiB", "64MiB", "128MiB"]
    assert exact_wire_nbytes("allreduce", 1200, 4) == 1800
    assert exact_wire_nbytes("reduce_scatter", 1200, 4) == 900
    assert exact_wire_nbytes("all_gather", 1200, 1) == 0
