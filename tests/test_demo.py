"""``dqcoll demo``'s table and its link section's fallback (nothing is timed here).

The table puts the loopback and the emulated-link times of each (scheme, algorithm) side by side
with the speed-up over ``none`` on the same network; a row that is not available says so; where
the emulated cluster cannot be built, the demo reports why and shows loopback only.
"""

from __future__ import annotations

import argparse

from dqcoll.cli import demo, netns


def _row(scheme: str, algorithm: str, time_ms: float, **extra: object) -> dict:
    return {"scheme": scheme, "algorithm": algorithm, "status": "ok", "chosen": "",
            "bits_per_coord": 32.0, "vnmse": 1e-15, "time_ms": time_ms, "algbw_gbps": 1.0,
            "identical": True, **extra}


def test_table_shows_both_networks_and_speedup_over_none(capsys):
    """Each line has the loopback time and the link time, each with its ratio to ``none`` on
    the same algorithm and network; unavailable rows print their reason."""
    loop = [_row("none", "ring", 200.0), _row("dynamiq", "ring", 250.0),
            {"scheme": "auto", "algorithm": "ring", "status": "not available (no auto)"}]
    link = [_row("none", "ring", 800.0), _row("dynamiq", "ring", 320.0, chosen="")]
    demo._print_table(loop, link, "1gbit")
    lines = capsys.readouterr().out.splitlines()
    assert "1gbit ms" in lines[0] and "loopback ms" in lines[0]
    dynamiq = next(ln for ln in lines if ln.startswith("dynamiq"))
    assert dynamiq.split()[4:8] == ["250.0", "0.80x", "320.0", "2.50x"]
    assert any(ln.startswith("auto") and "not available (no auto)" in ln for ln in lines)


def test_table_says_what_auto_chose_on_each_network(capsys):
    """``auto`` rows name the scheme chosen on loopback and over the link (they may differ)."""
    loop = [_row("none", "ring", 200.0), _row("auto", "ring", 201.0, chosen="none")]
    link = [_row("none", "ring", 800.0), _row("auto", "ring", 330.0, chosen="dynamiq")]
    demo._print_table(loop, link, "1gbit")
    auto = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("auto"))
    assert auto.endswith("(chose loopback: none, 1gbit: dynamiq)")


def test_table_without_link_has_loopback_columns_only(capsys):
    """Without the link section there is no link column (not an empty one)."""
    demo._print_table([_row("none", "ring", 200.0)], None, "1gbit")
    out = capsys.readouterr().out
    assert "1gbit" not in out and "loopback ms" in out


def test_link_section_says_why_it_is_skipped(monkeypatch):
    """Where the emulated cluster cannot be built, the link section returns no rows and the
    reason (the demo then prints it and shows loopback only); no rank is started."""
    monkeypatch.setattr(netns, "check_prerequisites", lambda mode: "user namespaces are off")
    monkeypatch.setattr(netns, "run_cluster", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("no cluster may be started")))
    args = argparse.Namespace(world_size=4, link_rate="1gbit")
    rows, reason = demo._link_rows(args)
    assert rows is None and reason == "user namespaces are off"
