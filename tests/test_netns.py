"""``tools/netns_cluster.py``: the emulated cluster's plan, and (as root) the real thing.

The plan tests run anywhere: names fit Linux's 15-character limit, addresses are assigned only
inside the rank namespaces, and every link gets a tbf limit on both ends. The root tests build a
2-rank cluster, measure one link's TCP goodput against its cap, and check that everything is
gone afterwards, also when the command fails or a setup step is refused (netem); they skip
cleanly without root or iproute2.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "tools" / "netns_cluster.py"
_spec = importlib.util.spec_from_file_location("netns_cluster", _PATH)
assert _spec is not None and _spec.loader is not None
netns = importlib.util.module_from_spec(_spec)
sys.modules["netns_cluster"] = netns
_spec.loader.exec_module(netns)


def test_parse_rate():
    """tc's rate syntax converts to bits per second; anything else is refused."""
    assert netns.parse_rate_bps("1gbit") == 10**9
    assert netns.parse_rate_bps("200mbit") == 200 * 10**6
    assert netns.parse_rate_bps("2.5gbit") == 2_500_000_000
    with pytest.raises(ValueError, match="1gbps"):
        netns.parse_rate_bps("1gbps")


def test_plan_stays_inside_its_namespaces():
    """Every command of the plan acts inside a namespace the plan creates: addresses only in
    rank namespaces, the bridge in the hub, veth ends created directly in their namespaces."""
    plan = netns.build_plan(4, "1gbit", prefix="dqctest")
    own = {*plan.namespaces, plan.hub}
    for cmd in plan.setup:
        if cmd[:3] == ("ip", "netns", "add"):
            assert cmd[3] in own
        elif cmd[:3] == ("ip", "link", "add"):  # veth pair, both ends placed in our namespaces
            assert cmd[cmd.index("netns") + 1] in plan.namespaces
            assert cmd[-1] == plan.hub
        else:
            assert cmd[1] == "-n" and cmd[2] in own, cmd
        if "addr" in cmd:
            assert cmd[2] in plan.namespaces and cmd[cmd.index("add") + 1].startswith("10.")
    names = [*own, *plan.interfaces, *plan.hub_ports]
    assert all(len(name) <= 15 for name in names)


def test_plan_caps_both_ends_of_every_link():
    """Each rank's link has a tbf at the rank end (upload) and at the hub end (download), at the
    requested rate with a burst of at least one GSO segment."""
    plan = netns.build_plan(3, "200mbit", prefix="dqctest")
    tbf = [cmd for cmd in plan.setup if "tbf" in cmd]
    devices = sorted(cmd[cmd.index("dev") + 1] for cmd in tbf)
    assert devices == sorted([*plan.interfaces, *plan.hub_ports])
    for cmd in tbf:
        assert cmd[cmd.index("rate") + 1] == "200mbit"
        assert int(cmd[cmd.index("burst") + 1]) >= 64 * 1024
    assert not any("netem" in cmd for cmd in plan.setup)
    delayed = netns.build_plan(2, "1gbit", prefix="dqctest", delay_us=100)
    assert sum("netem" in cmd for cmd in delayed.setup) == 4


def test_rank_env_is_env_style():
    """Each rank gets the env:// variables, rank 0's address as master, and its own veth for
    gloo."""
    plan = netns.build_plan(2, "1gbit", prefix="dqctest")
    env = plan.rank_env(1)
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2"
    assert env["MASTER_ADDR"] == plan.addresses[0]
    assert env["GLOO_SOCKET_IFNAME"] == plan.interfaces[1]


# -- as root --------------------------------------------------------------------------------------


def _can_build() -> str | None:
    reason = netns.check_prerequisites()
    if reason:
        return reason
    probe = f"dqcprobe{os.getpid()}"  # xdist workers probe at the same time: one name each
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode:
        return f"cannot create network namespaces here: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


_REASON = _can_build()
needs_root = pytest.mark.skipif(_REASON is not None, reason=str(_REASON))


def _leftovers(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix + "-")]


def _tool(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(_PATH), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=_PATH.parents[1])


@pytest.mark.root
@needs_root
def test_link_rate_is_capped_and_cluster_removed():
    """A 100 Mbit/s cluster carries one TCP stream at 50-115% of the cap (a short stream may
    exceed it by the tbf burst), and no namespace of the run is left afterwards."""
    prefix = f"dqct{os.getpid() % 10000}"
    done = _tool("measure", "-n", "2", "--rate", "100mbit", "--prefix", prefix,
                 "--measure-nbytes", "3000000")
    assert done.returncode == 0, done.stderr
    line = next(ln for ln in done.stdout.splitlines() if "goodput" in ln)
    gbps = float(line.split("=")[-1].split()[0])
    assert 0.05 <= gbps <= 0.115, line  # above the cap only by the 256 KiB tbf burst
    assert _leftovers(prefix) == []


@pytest.mark.root
@needs_root
def test_failed_command_and_refused_setup_leave_nothing_behind():
    """A rank command that fails makes the tool fail, and a setup step that the kernel refuses
    (netem where sch_netem is missing) is reported with the reason; either way every namespace
    is removed."""
    prefix = f"dqcf{os.getpid() % 10000}"
    done = _tool("exec", "-n", "2", "--rate", "1gbit", "--prefix", prefix, "--", "false")
    assert done.returncode != 0
    assert _leftovers(prefix) == []
    done = _tool("measure", "-n", "2", "--rate", "1gbit", "--prefix", prefix, "--delay-us", "100",
                 "--measure-nbytes", "100000")
    if done.returncode != 0:  # no netem here: the message says what works and what does not
        assert "netem" in done.stderr
    assert _leftovers(prefix) == []


@pytest.mark.root
@pytest.mark.slow
@needs_root
def test_bench_runs_one_rank_per_namespace(tmp_path):
    """`netns_cluster.py bench` runs dqcoll bench with one gloo rank per namespace: the check
    passes, and the JSON records the emulated topology and the link rate."""
    prefix = f"dqcb{os.getpid() % 10000}"
    out_json = tmp_path / "netns.json"
    done = _tool("bench", "-n", "2", "--rate", "1gbit", "--prefix", prefix, "--", "-b", "64K",
                 "-e", "64K", "-n", "1", "-w", "0", "--scheme", "none", "--peers", "fp32",
                 "--codec", "0", "--json", str(out_json), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out_json.read_text())["rows"]
    assert all(r["check_ok"] for r in rows)
    assert all("tbf 1gbit" in r["topology"] and r["world_size"] == 2 for r in rows)
    assert all("link_floor_us" in r for r in rows)
    assert _leftovers(prefix) == []
