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


def test_two_level_plan_puts_ranks_of_a_host_in_one_namespace():
    """``ranks_per_host=G``: one namespace (and one capped port) per host, ranks host-major as
    torchrun numbers them, every rank of a host on that host's veth, LOCAL_* as torchrun sets
    them; a world size that G does not divide is refused."""
    plan = netns.build_plan(6, "1gbit", prefix="dqctest", ranks_per_host=3)
    assert plan.hosts == 2 and len(plan.namespaces) == len(plan.interfaces) == 2
    assert [plan.host_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    envs = [plan.rank_env(r) for r in range(6)]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "0", "1", "2"]
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"3"}
    assert [e["GLOO_SOCKET_IFNAME"] for e in envs] == [plan.interfaces[0]] * 3 + [
        plan.interfaces[1]] * 3
    assert {e["MASTER_ADDR"] for e in envs} == {plan.addresses[0]}
    tbf = [cmd for cmd in plan.setup if cmd[0] == "tc"]
    assert len(tbf) == 2 * 2  # both ends of each host's port, nothing per rank
    assert "2 hosts x 3 ranks" in plan.description
    with pytest.raises(ValueError, match="divide"):
        netns.build_plan(5, "1gbit", prefix="dqctest", ranks_per_host=2)
    with pytest.raises(ValueError, match="rank must be"):
        plan.host_of(6)


def test_hosts_flag_sets_the_world_size(monkeypatch):
    """``--hosts H --ranks-per-host G`` runs H x G ranks; a contradicting ``-n`` is an error."""
    plans: list[netns.ClusterPlan] = []

    class NoCluster:
        def __init__(self, plan: netns.ClusterPlan) -> None:
            plans.append(plan)

        def __enter__(self) -> netns.ClusterPlan:
            return plans[-1]

        def __exit__(self, *exc: object) -> None:
            pass

    monkeypatch.setattr(netns, "Cluster", NoCluster)
    monkeypatch.setattr(netns, "run_ranks", lambda plan, command, **kw: 0)
    assert netns.main(["exec", "--hosts", "2", "--ranks-per-host", "2", "--mode", "root",
                       "--", "true"]) == 0
    assert (plans[-1].world_size, plans[-1].hosts, plans[-1].ranks_per_host) == (4, 2, 2)
    with pytest.raises(SystemExit):
        netns.main(["exec", "-n", "3", "--hosts", "2", "--ranks-per-host", "2", "--mode",
                    "root", "--", "true"])


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
    assert argv[:3] == ["exec", "-n", "3"]
    assert argv[argv.index("--rate") + 1] == "200mbit"
    assert argv[argv.index("--ranks-per-host") + 1] == "1"
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


_TWO_LEVEL_STREAMS = r"""
import os, socket, sys, time
rank, nbytes = int(os.environ["RANK"]), int(sys.argv[1])
host0 = os.environ["MASTER_ADDR"]
def serve(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host0, port)); s.listen(1)
    c, _ = s.accept(); got = 0; t = None
    while got < nbytes:
        d = c.recv(1 << 20)
        if not d: break
        t = t or time.perf_counter(); got += len(d)
    return got * 8 / (time.perf_counter() - t) / 1e9
def send(port):
    for _ in range(200):
        try:
            s = socket.create_connection((host0, port)); break
        except OSError:
            time.sleep(0.05)
    buf = b"\0" * (1 << 20); left = nbytes
    while left > 0:
        s.sendall(buf[: min(left, len(buf))]); left -= len(buf)
    s.close()
if rank == 0:
    print(f"inside {serve(5301):.3f}", flush=True)
    print(f"across {serve(5302):.3f}", flush=True)
elif rank == 1:
    send(5301)
elif rank == 2:
    time.sleep(1.0)
    send(5302)
"""


@pytest.mark.root
@needs_root
def test_two_level_cluster_caps_only_traffic_between_hosts():
    """2 hosts x 2 ranks at 100 Mbit/s: a TCP stream between the two ranks of host 0 (to host
    0's own address) runs far above the cap, one from host 1 to host 0 at 50-115 % of it."""
    prefix = f"dqch{os.getpid() % 10000}"
    done = _tool("exec", "--hosts", "2", "--ranks-per-host", "2", "--rate", "100mbit",
                 "--mode", "root", "--prefix", prefix, "--", sys.executable, "-c",
                 _TWO_LEVEL_STREAMS, "3000000")
    assert done.returncode == 0, done.stderr
    rates = {line.split()[0]: float(line.split()[1]) for line in done.stdout.splitlines()
             if line.startswith(("inside", "across"))}
    assert 0.05 <= rates["across"] <= 0.115, rates
    assert rates["inside"] > 5 * rates["across"], rates
    assert _leftovers(prefix) == []
