"""``dqcoll.cli.netns`` (``tools/netns_cluster.py``): the emulated cluster's plan, and the real
thing, as root and rootless.

The plan tests run anywhere: names fit Linux's 15-character limit, addresses are assigned only
inside the rank namespaces, every link gets a tbf limit on both ends, and the rootless mode runs
the same plan inside ``unshare --user --net --mount``. The root tests build a 2-rank cluster,
measure one link's TCP goodput against its cap, and check that everything is gone afterwards,
also when the command fails or a setup step is refused (netem); they skip cleanly without root or
iproute2. The rootless tests do the same in a user namespace; they skip where user namespaces are
unavailable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dqcoll.cli import netns

_PATH = Path(__file__).resolve().parents[1] / "tools" / "netns_cluster.py"


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


def test_auto_mode_is_root_as_root_and_rootless_otherwise(monkeypatch):
    """``--mode auto`` keeps the named namespaces for root and uses a user namespace for anyone
    else; an unknown mode is refused with the choices."""
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    assert netns.choose_mode("auto") is netns.Mode.ROOT
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert netns.choose_mode("auto") is netns.Mode.ROOTLESS
    assert netns.choose_mode("root") is netns.Mode.ROOT
    with pytest.raises(ValueError, match="rootless"):
        netns.choose_mode("sudo")


def test_rootless_runs_this_module_inside_a_user_namespace():
    """The rootless mode re-enters this module under ``unshare`` with a new user (mapped to
    root), network and mount namespace, and passes the arguments through unchanged."""
    argv = ["exec", "-n", "2", "--rate", "1gbit", "--", "python", "job.py"]
    cmd = netns.rootless_argv(argv)
    cut = cmd.index("--")
    assert cmd[0] == "unshare"
    assert {"--user", "--map-root-user", "--net", "--mount"} <= set(cmd[:cut])
    assert cmd[cut + 1 : cut + 4] == [sys.executable, "-m", "dqcoll.cli.netns"]
    assert cmd[cut + 5 :] == argv


def test_prerequisites_name_what_is_missing(monkeypatch):
    """Without ``unshare`` the rootless mode says which package provides it; without root the
    root mode says it needs root."""
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "unshare" else tool)
    reason = netns.check_prerequisites(netns.Mode.ROOTLESS)
    assert reason is not None and "unshare" in reason and "util-linux" in reason
    monkeypatch.setattr(netns.shutil, "which", lambda tool: tool)
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert netns.check_prerequisites(netns.Mode.ROOT) == "network namespaces and tc need root"


def test_run_cluster_passes_the_command_to_exec(monkeypatch):
    """``run_cluster`` (the demo's entry) is the ``exec`` action with the mode, the timeout and
    the command after ``--``."""
    seen: list[list[str]] = []
    monkeypatch.setattr(netns, "main", lambda argv: seen.append(argv) or 0)
    assert netns.run_cluster(3, "200mbit", ["python", "-c", "pass"], mode="rootless",
                             timeout_s=60) == 0
    argv = seen[0]
    assert argv[:5] == ["exec", "-n", "3", "--rate", "200mbit"]
    assert argv[argv.index("--mode") + 1] == "rootless"
    assert argv[argv.index("--") + 1 :] == ["python", "-c", "pass"]


# -- rootless (user namespaces) -------------------------------------------------------------------

_ROOTLESS_REASON = netns.check_prerequisites(netns.Mode.ROOTLESS)
needs_userns = pytest.mark.skipif(_ROOTLESS_REASON is not None, reason=str(_ROOTLESS_REASON))


def _host_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return sorted(line.split()[0] for line in out.splitlines() if line.strip())


@needs_userns
def test_rootless_link_is_capped_and_invisible_to_the_host():
    """Rootless, a 100 Mbit/s cluster carries one TCP stream at 50-115% of the cap."""
    done = _tool("measure", "-n", "2", "--rate", "100mbit", "--mode", "rootless",
                 "--prefix", "dqcu", "--measure-nbytes", "3000000")
    assert done.returncode == 0, done.stderr
    assert "rootless" in done.stdout
    line = next(ln for ln in done.stdout.splitlines() if "goodput" in ln)
    gbps = float(line.split("=")[-1].split()[0])
    assert 0.05 <= gbps <= 0.115, line


@needs_userns
def test_rootless_namespaces_are_invisible_to_the_host_while_they_run():
    """While a rootless cluster is up (its ranks are running), none of its namespaces is in the
    host's ``ip netns list``, and the run leaves none behind (other jobs' namespaces may come
    and go meanwhile: only this run's prefix is checked)."""
    proc = subprocess.Popen(
        [sys.executable, str(_PATH), "exec", "-n", "2", "--rate", "1gbit", "--mode", "rootless",
         "--prefix", "dqcv", "--", sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=_PATH.parents[1])
    try:
        assert proc.stdout is not None and proc.stdin is not None
        first = proc.stdout.readline()  # printed once the cluster is built, as the ranks start
        assert "rootless" in first, first
        assert [ns for ns in _host_namespaces() if ns.startswith("dqcv-")] == []
        proc.stdin.close()  # the ranks read stdin to its end, then exit
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert [ns for ns in _host_namespaces() if ns.startswith("dqcv-")] == []


@needs_userns
def test_rootless_failed_command_fails_the_run():
    """Rootless, a rank command that fails makes the tool fail; ``cleanup`` has nothing to do."""
    done = _tool("exec", "-n", "2", "--rate", "1gbit", "--mode", "rootless", "--", "false")
    assert done.returncode != 0
    done = _tool("cleanup", "--mode", "rootless")
    assert done.returncode == 0 and "nothing to clean up" in done.stdout


# -- as root --------------------------------------------------------------------------------------


def _can_build() -> str | None:
    reason = netns.check_prerequisites(netns.Mode.ROOT)
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
    # (run as the script beside the other tools, which is the package module's command line)
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
    done = _tool("exec", "-n", "2", "--rate", "1gbit", "--mode", "root", "--prefix", prefix,
                 "--", "false")
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
