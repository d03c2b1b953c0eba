"""``dqcoll demo``'s table and its link section's fallback (nothing is timed here).

The table puts the loopback and the emulated-link times of each (scheme, algorithm) side by side
with the speed-up over the ``torch`` row (the group's own fp32 all-reduce) on the same network;
a row that is not available says so; where the emulated cluster cannot be built, the demo
reports why and shows loopback only.
"""

from __future__ import annotations

import argparse

from dqcoll.cli import demo, netns


def _row(scheme: str, algorithm: str, time_ms: float, **extra: object) -> dict:
    return {"scheme": scheme, "algorithm": algorithm, "status": "ok", "chosen": "",
            "bits_per_coord": 32.0, "vnmse": 1e-15, "time_ms": time_ms, "algbw_gbps": 1.0,
            "identical": True, **extra}


def test_table_shows_both_networks_and_speedup_over_fp32(capsys):
    """Each line has the loopback time and the link time, each with its ratio to the ``torch``
    row (the group's own fp32 all-reduce) on the same network; unavailable rows print their
    reason."""
    loop = [_row("torch", "all_reduce", 200.0), _row("dynamiq", "ring", 250.0),
            {"scheme": "auto", "algorithm": "ring", "status": "not available (no auto)"}]
    link = [_row("torch", "all_reduce", 800.0), _row("dynamiq", "ring", 320.0, chosen="")]
    demo._print_table(loop, [("1gbit", link)])
    lines = capsys.readouterr().out.splitlines()
    assert "1gbit ms" in lines[0] and "loopback ms" in lines[0]
    dynamiq = next(ln for ln in lines if ln.startswith("dynamiq"))
    assert dynamiq.split()[4:8] == ["250.0", "0.80x", "320.0", "2.50x"]
    assert any(ln.startswith("auto") and "not available (no auto)" in ln for ln in lines)


def test_table_says_what_auto_chose_on_each_network(capsys):
    """``auto`` rows name the scheme chosen on loopback and over the link (they may differ)."""
    loop = [_row("torch", "all_reduce", 200.0), _row("auto", "ring", 201.0, chosen="none")]
    link = [_row("torch", "all_reduce", 800.0), _row("auto", "ring", 330.0, chosen="dynamiq")]
    demo._print_table(loop, [("1gbit", link)])
    auto = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("auto"))
    assert auto.endswith("(chose loopback: none, 1gbit: dynamiq)")


def test_table_without_link_has_loopback_columns_only(capsys):
    """Without the link section there is no link column (not an empty one)."""
    demo._print_table([_row("none", "ring", 200.0)], [])
    out = capsys.readouterr().out
    assert "1gbit" not in out and "loopback ms" in out


def test_table_has_a_column_per_network_with_its_own_speedups(capsys):
    """With the flat link and the two-level cluster, each network has its time and its ratio
    to the ``torch`` row on that network; ``auto``'s choice is named per network; a row missing
    on one network reads '-' there."""
    loop = [_row("torch", "all_reduce", 200.0), _row("auto", "ring", 190.0, chosen="bf16")]
    flat = [_row("torch", "all_reduce", 800.0), _row("auto", "ring", 400.0, chosen="dynamiq")]
    two = [_row("torch", "all_reduce", 600.0)]
    demo._print_table(loop, [("1gbit", flat), ("2x2 1gbit", two)])
    lines = capsys.readouterr().out.splitlines()
    assert "1gbit ms" in lines[0] and "2x2 1gbit ms" in lines[0]
    none = next(ln for ln in lines if ln.startswith("torch"))
    assert none.split()[4:10] == ["200.0", "1.00x", "800.0", "1.00x", "600.0", "1.00x"]
    auto = next(ln for ln in lines if ln.startswith("auto"))
    assert auto.split()[6:9] == ["400.0", "2.00x", "-"]
    assert auto.endswith("(chose loopback: bf16, 1gbit: dynamiq)")


def test_hosts_layout_defaults_to_two_hosts_and_checks_the_world_size():
    """``--hosts-layout auto`` is 2 hosts of half the ranks for an even world of 4 or more, none
    otherwise; an explicit layout must multiply to the world size."""
    import pytest

    parser = argparse.ArgumentParser()
    layout = lambda world, text: demo._parse_layout(  # noqa: E731
        parser, argparse.Namespace(world_size=world, hosts_layout=text))
    assert layout(4, "auto") == (2, 2)
    assert layout(8, "auto") == (2, 4)
    assert layout(3, "auto") is None and layout(2, "auto") is None
    assert layout(8, "4x2") == (4, 2)
    assert layout(4, "off") is None
    with pytest.raises(SystemExit):
        layout(4, "3x2")


def test_link_section_says_why_it_is_skipped(monkeypatch):
    """Where the emulated cluster cannot be built, the link section returns no rows and the
    reason (the demo then prints it and shows loopback only); no rank is started."""
    monkeypatch.setattr(netns, "check_prerequisites", lambda mode: "user namespaces are off")
    monkeypatch.setattr(netns, "run_cluster", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("no cluster may be started")))
    args = argparse.Namespace(world_size=4, link_rate="1gbit")
    rows, reason = demo._link_rows(args)
    assert rows is None and reason == "user namespaces are off"


def test_row_missing_on_loopback_shows_where_it_ran(capsys):
    """The two-level row cannot run on loopback (one host) but runs on the 2 x 2 cluster: its
    line has '-' on loopback and the cluster's time, bits and ratio."""
    loop = [_row("torch", "all_reduce", 200.0),
            {"scheme": "dynamiq", "algorithm": "two-level",
             "status": "not available (one host)"}]
    two = [_row("torch", "all_reduce", 600.0),
           _row("dynamiq", "two-level", 300.0, bits_per_coord=12.5)]
    demo._print_table(loop, [("2x2 1gbit", two)])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "two-level" in ln)
    assert line.split()[2:7] == ["12.500", "1.000e-15", "-", "300.0", "2.00x"]


class _PlannedComm:
    """A communicator whose planned calls report the plans of ``plans`` in turn (label, whether
    the planner explored it), as ``last_info["planned"]`` does."""

    def __init__(self, plans: list[tuple[str, bool]]) -> None:
        self.plans, self.last_info, self.calls = plans, {}, 0

    def call(self) -> None:
        label, explored = self.plans[min(self.calls, len(self.plans) - 1)]
        reason = "explored once: never measured" if explored else "least predicted time"
        self.last_info = {"planned": {"label": label, "reason": reason}}
        self.calls += 1


def test_planned_row_is_timed_once_the_planner_settled():
    """The planned row's untimed calls go on while the planner explores and until two calls in a
    row ran the same plan (at least PLANNED_WARMUP_CALLS, the demo's first call included; at
    most PLANNED_WARMUP_MAX)."""
    early = _PlannedComm([("ring/dynamiq5", False)])
    assert demo._settle(early.call, early) == demo.PLANNED_WARMUP_CALLS
    assert early.calls == demo.PLANNED_WARMUP_CALLS - 1  # the first call ran before _settle
    plans = [("butterfly/dynamiq5", False), ("ring/dynamiq5", True), ("native/bf16", True),
             ("ring/bf16", True), ("butterfly/dynamiq5", False), ("two-level", True),
             ("two-level b", True), ("ring/dynamiq5", False), ("ring/dynamiq5", False)]
    late = _PlannedComm(plans)
    assert demo._settle(late.call, late) == len(plans) + 1
    never = _PlannedComm([("a", True)])
    assert demo._settle(never.call, never) == demo.PLANNED_WARMUP_MAX
    flipping = _PlannedComm([("a", False), ("b", False)] * 20)
    assert demo._settle(flipping.call, flipping) == demo.PLANNED_WARMUP_MAX
