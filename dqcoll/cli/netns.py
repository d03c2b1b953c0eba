"""An emulated cluster on one machine: network namespaces ("hosts") joined by rate-limited links.

What it builds, all of it inside namespaces this module creates::

    <prefix>-hub   a bridge ``br0``; the hub ends ``<prefix>-b<i>`` of every link are its ports
    <prefix>-r<i>  one per host: ``lo`` and ``<prefix>-v<i>`` with address 10.77.0.<i+1>/24

Each veth link is capped in *both* directions with ``tc ... tbf``: on the host end (what the host
sends) and on the hub end (what it receives), so every host has a full-duplex port of ``--rate``,
like a host on a switch. ``--ranks-per-host G`` ranks run in each host's namespace (default 1:
one rank per host, ``-n`` hosts) with the env:// variables set as torchrun sets them (``RANK``
host-major, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` = G, ``MASTER_ADDR`` = host 0's
address, ``MASTER_PORT``) and ``GLOO_SOCKET_IFNAME`` = the host's veth. Traffic between hosts
crosses the capped links: real bytes through a real rate limit in the kernel, not a model.
Traffic between two ranks of one host goes to an address of their own namespace, which the
kernel routes over that namespace's loopback: uncapped, as between the GPUs or processes of one
machine. ``--hosts H --ranks-per-host G`` is thus a two-level cluster of ``H x G`` ranks whose
only slow links are the hosts' ports. Everything is torn down afterwards (deleting a namespace
deletes its links), also on Ctrl-C, SIGTERM or a failure.

Two modes build the same plan (``--mode``, default ``auto``: ``root`` as root, else
``rootless``):

* ``root``: named namespaces (``ip netns add``) in the host's ``/run/netns``. Nothing is created
  in, and no address is assigned in, the root namespace: the bridge lives in the hub namespace,
  addresses only in the rank namespaces, so the host's networking is untouched and the ranks can
  reach nothing but each other. ``cleanup`` removes what a killed run left.
* ``rootless``: an unprivileged user runs the same commands inside one new user namespace with
  its own network and mount namespaces (``unshare --user --map-root-user --net --mount``), where
  it holds ``CAP_NET_ADMIN`` over the namespaces it creates; a private tmpfs on ``/run`` gives
  ``ip netns`` a place for the names. Nothing is visible outside, and nothing can be left behind:
  the namespaces die with the last process of the run, even after ``kill -9``. Needs
  unprivileged user namespaces (most distributions allow them; some disable them with
  ``kernel.unprivileged_userns_clone=0``, ``user.max_user_namespaces=0`` or an AppArmor/seccomp
  policy, and then :func:`check_prerequisites` says so).

Delay: ``tc qdisc ... netem delay`` is the usual way to add latency, but this machine's kernel has
no ``sch_netem`` (``Error: Specified qdisc kind is unknown``), so ``--delay-us`` is refused with
that message unless netem works; ``tbf``'s ``latency`` is only the bound on its queue, not an added
delay. Bandwidth limits are real: ``measure`` shows the TCP goodput of one link.

Usage (from the repository root; ``tools/netns_cluster.py`` is the same command)::

    python -m dqcoll.cli.netns bench -n 4 --rate 1gbit -- -b 1M -e 16M -f 4 --json out.json
    python -m dqcoll.cli.netns measure -n 2 --rate 200mbit
    python -m dqcoll.cli.netns exec -n 4 --rate 10gbit -- python my_job.py
    python -m dqcoll.cli.netns exec --hosts 2 --ranks-per-host 2 --rate 1gbit -- python my_job.py
    python -m dqcoll.cli.netns cleanup          # root mode: remove namespaces of a killed run

Rejected: a bridge in the root namespace (changes the host's networking and needs its own
cleanup); shaping ``lo`` (all ranks would share one qdisc: one link, not one per rank); for the
rootless mode, user-space networking (slirp4netns, pasta: a user-space TCP stack copies every
byte and would be the bottleneck, not the emulated link) and one ``unshare --net`` per rank with
its veth moved in by pid (the same links with a start-up handshake per rank; named namespaces
let both modes run one plan).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

__all__ = [
    "Cluster",
    "ClusterPlan",
    "Mode",
    "NetnsError",
    "build_plan",
    "check_prerequisites",
    "choose_mode",
    "parse_rate_bps",
    "rootless_argv",
    "run_cluster",
]

_RATE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
SUBNET = "10.77.0"  # /24; ranks get .1, .2, ... inside their own namespaces only
MASTER_PORT = 29500  # free by construction: each rank namespace starts with no sockets
# tbf bucket: at least 2 ms of traffic and at least one 64 KiB GSO segment with headroom
# (measured with `measure`: 1gbit with a 256 KiB burst gives 0.95 Gb/s of TCP goodput).
_MIN_BURST_NBYTES = 256 * 1024
_BURST_S = 0.002


class NetnsError(RuntimeError):
    """A step of building, running or tearing down the cluster failed; carries the command."""


class Mode(enum.Enum):
    """Who builds the namespaces (see the module docstring)."""

    ROOT = "root"  # named namespaces in the host's /run/netns
    ROOTLESS = "rootless"  # the same plan inside one private user + net + mount namespace


# The user namespace of the rootless mode: this user becomes root inside (CAP_NET_ADMIN over the
# namespaces it creates, none over the host's); --mount gives it a private /run for `ip netns`.
_UNSHARE = ("unshare", "--user", "--map-root-user", "--net", "--mount")
_INSIDE_FLAG = "--inside-userns"  # set on the command the rootless mode runs under unshare


def parse_rate_bps(text: str) -> int:
    """tc's rate syntax, ``1gbit``, ``200mbit``, ``500kbit`` -> bits per second."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)bit\s*", text.lower())
    if not match:
        raise ValueError(f"rate must look like 1gbit, 200mbit or 500kbit, got {text!r}")
    return int(float(match.group(1)) * _RATE_UNITS[match.group(2)])


@dataclasses.dataclass(frozen=True)
class ClusterPlan:
    """Names, addresses and the exact commands that build the cluster (plain data).

    ``namespaces``, ``interfaces``, ``hub_ports`` and ``addresses`` are per host; rank ``r``
    runs on host ``r // ranks_per_host`` (host-major, as torchrun numbers ranks)."""

    world_size: int
    rate: str
    rate_bps: int
    burst_nbytes: int
    latency_ms: float
    delay_us: float
    prefix: str
    hub: str
    namespaces: tuple[str, ...]  # one per rank
    interfaces: tuple[str, ...]  # rank end of each link, inside its namespace
    hub_ports: tuple[str, ...]  # hub end of each link
    addresses: tuple[str, ...]  # one per rank, without the /24
    setup: tuple[tuple[str, ...], ...]
    ranks_per_host: int = 1

    @property
    def hosts(self) -> int:
        return len(self.namespaces)

    @property
    def master_addr(self) -> str:
        return self.addresses[0]

    def host_of(self, rank: int) -> int:
        """The host (namespace index) rank ``rank`` runs on."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return rank // self.ranks_per_host

    def rank_env(self, rank: int) -> dict[str, str]:
        host = self.host_of(rank)
        return {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank % self.ranks_per_host),
            "GROUP_RANK": str(host),
            "WORLD_SIZE": str(self.world_size),
            # one rank per host: every rank still shares this machine's cores, which is what
            # LOCAL_WORLD_SIZE tells dqcoll (ranks per core); with G per host, G, as torchrun
            "LOCAL_WORLD_SIZE": str(self.ranks_per_host if self.ranks_per_host > 1
                                    else self.world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(MASTER_PORT),
            "GLOO_SOCKET_IFNAME": self.interfaces[host],
        }

    @property
    def description(self) -> str:
        if self.ranks_per_host > 1:
            return (f"netns: {self.hosts} hosts x {self.ranks_per_host} ranks (loopback inside "
                    f"a host), veth to a bridge, tbf {self.rate} per host port and direction "
                    f"(no added delay)")
        return (f"netns: {self.world_size} namespaces, veth to a bridge, tbf {self.rate} "
                f"per link and direction (no added delay)")


def build_plan(world_size: int, rate: str, *, prefix: str | None = None,
               latency_ms: float = 50.0, delay_us: float = 0.0,
               ranks_per_host: int = 1) -> ClusterPlan:
    """The plan of ``world_size`` ranks, ``ranks_per_host`` of them in each host namespace
    (``world_size`` a multiple of it)."""
    if not 1 <= world_size <= 1000:
        raise ValueError(f"world size must be in [1, 1000], got {world_size}")
    if ranks_per_host < 1 or world_size % ranks_per_host:
        raise ValueError(f"ranks per host must divide the world size {world_size}, "
                         f"got {ranks_per_host}")
    hosts = world_size // ranks_per_host
    if hosts > 250:
        raise ValueError(f"at most 250 hosts (one /24), got {hosts}")
    rate_bps = parse_rate_bps(rate)
    prefix = prefix or f"dqc{os.getpid() % 100000}"
    if len(prefix) + 5 > 15 or not re.fullmatch(r"[a-z][a-z0-9]*", prefix):
        raise ValueError(f"prefix must be short lowercase alphanumerics (<= 10), got {prefix!r}")
    burst = max(_MIN_BURST_NBYTES, int(rate_bps / 8 * _BURST_S))
    hub = f"{prefix}-hub"
    namespaces = tuple(f"{prefix}-r{i}" for i in range(hosts))
    interfaces = tuple(f"{prefix}-v{i}" for i in range(hosts))
    hub_ports = tuple(f"{prefix}-b{i}" for i in range(hosts))
    addresses = tuple(f"{SUBNET}.{i + 1}" for i in range(hosts))
    tbf = ("tbf", "rate", rate, "burst", str(burst), "latency", f"{latency_ms:g}ms")
    setup: list[tuple[str, ...]] = [
        ("ip", "netns", "add", hub),
        ("ip", "-n", hub, "link", "add", "br0", "type", "bridge"),
        ("ip", "-n", hub, "link", "set", "br0", "up"),
    ]
    for ns, dev, port, addr in zip(namespaces, interfaces, hub_ports, addresses, strict=True):
        setup += [
            ("ip", "netns", "add", ns),
            ("ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port,
             "netns", hub),
            ("ip", "-n", hub, "link", "set", port, "master", "br0"),
            ("ip", "-n", hub, "link", "set", port, "up"),
            ("ip", "-n", ns, "link", "set", "lo", "up"),
            ("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev),
            ("ip", "-n", ns, "link", "set", dev, "up"),
            ("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf),
            ("tc", "-n", hub, "qdisc", "add", "dev", port, "root", "handle", "1:", *tbf),
        ]
        if delay_us > 0:  # netem under tbf, on both ends; refused by kernels without netem
            for where, link in ((ns, dev), (hub, port)):
                setup.append(("tc", "-n", where, "qdisc", "add", "dev", link, "parent", "1:1",
                              "handle", "10:", "netem", "delay", f"{delay_us:g}us"))
    return ClusterPlan(world_size, rate, rate_bps, burst, latency_ms, delay_us, prefix, hub,
                       namespaces, interfaces, hub_ports, addresses, tuple(setup),
                       ranks_per_host)


def _run(cmd: Sequence[str]) -> str:
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    if done.returncode:
        text = (done.stderr or done.stdout).strip()
        hint = ""
        if "netem" in cmd and "unknown" in text.lower():
            hint = " (this kernel has no sch_netem: bandwidth limits work, added delay does not)"
        raise NetnsError(f"`{' '.join(cmd)}` failed: {text}{hint}")
    return done.stdout


def choose_mode(requested: str = "auto") -> Mode:
    """``auto``: the root mode as root, the rootless mode otherwise."""
    if requested == "auto":
        return Mode.ROOT if os.geteuid() == 0 else Mode.ROOTLESS
    try:
        return Mode(requested)
    except ValueError:
        raise ValueError(f"mode must be auto, root or rootless, got {requested!r}") from None


def check_prerequisites(mode: Mode = Mode.ROOT) -> str | None:
    """None when clusters can be built here in ``mode``, else why not (one line)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, this is {sys.platform}"
    tools = ("ip", "tc") if mode is Mode.ROOT else ("ip", "tc", "unshare", "mount")
    for tool in tools:
        if shutil.which(tool) is None:
            package = "util-linux" if tool in ("unshare", "mount") else "iproute2"
            return f"`{tool}` is not installed ({package})"
    if mode is Mode.ROOT:
        return None if os.geteuid() == 0 else "network namespaces and tc need root"
    try:
        done = subprocess.run([*_UNSHARE, "--", "ip", "link", "add", "dqcprobe", "type",
                               "bridge"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot start `unshare`: {exc}"
    if done.returncode:
        text = (done.stderr or done.stdout).strip().splitlines()
        return ("user namespaces are not available to this user here (`unshare --user --net` "
                f"failed: {text[-1] if text else done.returncode})")
    return None


def rootless_argv(argv: Sequence[str]) -> list[str]:
    """The command that runs this module's ``main(argv)`` inside a new user namespace."""
    return [*_UNSHARE, "--", sys.executable, "-m", "dqcoll.cli.netns", _INSIDE_FLAG, *argv]


def _private_run_dir() -> None:
    """Inside the rootless mode's mount namespace: a tmpfs on /run, where `ip netns` keeps its
    names (the host's /run is not writable by this user, and the mount is seen by nobody else)."""
    _run(("mount", "-t", "tmpfs", "-o", "mode=0755", "dqcoll-netns", "/run"))


def _existing_namespaces() -> list[str]:
    out = _run(("ip", "netns", "list"))
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def teardown(plan: ClusterPlan) -> list[str]:
    """Delete the plan's namespaces (and with them its links); returns any that failed."""
    existing = set(_existing_namespaces())
    failed = []
    for ns in (*plan.namespaces, plan.hub):
        if ns in existing:
            try:
                _run(("ip", "netns", "del", ns))
            except NetnsError:
                failed.append(ns)
    return failed


class Cluster:
    """``with Cluster(plan):`` builds the namespaces and always tears them down."""

    def __init__(self, plan: ClusterPlan) -> None:
        self.plan = plan
        self._old_handlers: dict[int, object] = {}

    def __enter__(self) -> ClusterPlan:
        reason = check_prerequisites(Mode.ROOT)  # in the rootless mode: root of its namespace
        if reason:
            raise NetnsError(reason)
        taken = set(_existing_namespaces()) & {*self.plan.namespaces, self.plan.hub}
        if taken:
            raise NetnsError(f"namespaces already exist: {sorted(taken)} (run `cleanup`?)")
        for sig in (signal.SIGTERM, signal.SIGHUP):  # turn them into an exception: finally runs
            self._old_handlers[sig] = signal.signal(sig, _raise_interrupt)
        try:
            for cmd in self.plan.setup:
                _run(cmd)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self.plan

    def __exit__(self, *exc: object) -> None:
        failed = teardown(self.plan)
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._old_handlers.clear()
        if failed:
            raise NetnsError(f"could not delete namespaces {failed}")


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_ranks(plan: ClusterPlan, command: Sequence[str], *, timeout_s: float,
              quiet_ranks: bool = True) -> int:
    """Run ``command`` once per rank, each in its namespace; the worst exit status.

    Rank 0's output is passed through; other ranks' stdout is dropped unless ``quiet_ranks`` is
    False (their stderr always shows). A rank that fails gives the others 60 s to report their
    own errors before they are stopped; ``timeout_s`` bounds the whole run.
    """
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(plan.world_size):
            ns = plan.namespaces[plan.host_of(rank)]
            env = dict(os.environ, **plan.rank_env(rank))
            quiet = quiet_ranks and rank != 0
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, *command], env=env,
                stdout=subprocess.DEVNULL if quiet else None))
        deadline = time.monotonic() + timeout_s
        failed_at: float | None = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                return max(abs(c) for c in codes if c is not None)
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = time.monotonic()
            now = time.monotonic()
            if now > deadline or (failed_at is not None and now - failed_at > 60):
                print(f"netns_cluster: stopping ranks (exit codes {codes})", file=sys.stderr)
                return 124
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


_MEASURE = r"""
import os, socket, sys, time
rank, nbytes = int(os.environ["RANK"]), int(sys.argv[1])
if rank == 0:
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((os.environ["MASTER_ADDR"], 5201)); s.listen(1)
    c, _ = s.accept(); got = 0; t = None
    while got < nbytes:
        d = c.recv(1 << 20)
        if not d: break
        t = t or time.perf_counter(); got += len(d)
    dt = time.perf_counter() - t
    print(f"link goodput rank 1 -> rank 0: {got} B in {dt:.3f} s = {got * 8 / dt / 1e9:.3f} Gb/s")
elif rank == 1:
    for _ in range(100):
        try:
            s = socket.create_connection((os.environ["MASTER_ADDR"], 5201)); break
        except OSError:
            time.sleep(0.05)
    buf = b"\0" * (1 << 20); left = nbytes
    while left > 0:
        s.sendall(buf[: min(left, len(buf))]); left -= len(buf)
    s.close()
"""


def measure_command(nbytes: int) -> list[str]:
    """Command (per rank) that times one TCP stream from rank 1 to rank 0 across the links."""
    return [sys.executable, "-c", _MEASURE, str(nbytes)]


def _bench_command(plan: ClusterPlan, bench_args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "dqcoll.cli.bench", "--launcher", "env",
            "--topology", plan.description, "--link-gbps", f"{plan.rate_bps / 1e9:g}",
            *bench_args]


def run_cluster(world_size: int, rate: str, command: Sequence[str], *, mode: str = "auto",
                timeout_s: float = 900.0, quiet_ranks: bool = True,
                ranks_per_host: int = 1) -> int:
    """Run ``command`` once per rank on an emulated cluster of ``world_size`` ranks with
    ``rate`` links, ``ranks_per_host`` ranks per host namespace, built in ``mode``; the worst
    exit status of the ranks (1 with a message on stderr when the cluster cannot be built).
    What :func:`main`'s ``exec`` does, for callers such as ``dqcoll demo``."""
    argv = ["exec", "-n", str(world_size), "--ranks-per-host", str(ranks_per_host),
            "--rate", rate, "--mode", mode,
            "--timeout-s", f"{timeout_s:g}", *([] if quiet_ranks else ["--all-output"]),
            "--", *command]
    return main(argv)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="netns_cluster.py", description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=("bench", "measure", "exec", "cleanup"))
    parser.add_argument("-n", "--world-size", type=int, default=None,
                        help="ranks in all (default 4, or hosts x ranks per host)")
    parser.add_argument("--hosts", type=int, default=None,
                        help="host namespaces, each with one capped port (default: world size "
                        "/ ranks per host)")
    parser.add_argument("--ranks-per-host", type=int, default=1,
                        help="ranks sharing each host namespace (they talk over its loopback)")
    parser.add_argument("--rate", default="1gbit", help="per link and direction, tc syntax")
    parser.add_argument("--mode", default="auto", choices=("auto", "root", "rootless"),
                        help="auto: root as root, rootless (user namespaces) otherwise")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="tbf queue bound")
    parser.add_argument("--delay-us", type=float, default=0.0,
                        help="added one-way delay per link end (needs sch_netem)")
    parser.add_argument("--prefix", default=None, help="namespace name prefix (default dqc<pid>)")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--measure-nbytes", type=int, default=50 * 10**6)
    parser.add_argument("--all-output", action="store_true",
                        help="show every rank's stdout (default: rank 0's only)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    inside = bool(argv) and argv[0] == _INSIDE_FLAG  # the rootless mode, under unshare
    if inside:
        argv = argv[1:]
    extra: list[str] = []
    cut = argv.index("--") if "--" in argv else len(argv)
    own, extra = argv[:cut], argv[cut + 1 :]
    parser = _build_parser()
    args = parser.parse_args(own)
    if args.ranks_per_host < 1:
        parser.error(f"--ranks-per-host must be >= 1, got {args.ranks_per_host}")
    if args.hosts is not None:
        world = args.hosts * args.ranks_per_host
        if args.world_size is not None and args.world_size != world:
            parser.error(f"-n {args.world_size} disagrees with --hosts {args.hosts} x "
                         f"--ranks-per-host {args.ranks_per_host} = {world}")
        args.world_size = world
    elif args.world_size is None:
        args.world_size = 4
    mode = Mode.ROOT if inside else choose_mode(args.mode)
    if args.action == "cleanup":
        if mode is Mode.ROOTLESS:
            print("rootless mode: nothing to clean up (its namespaces die with the run)")
            return 0
        prefix = args.prefix or "dqc"
        left = [ns for ns in _existing_namespaces() if re.fullmatch(rf"{prefix}\d*-(hub|r\d+)", ns)]
        for ns in left:
            _run(("ip", "netns", "del", ns))
        print(f"removed {len(left)} namespaces: {left}")
        return 0
    if args.action == "measure" and (args.world_size < 2 or args.ranks_per_host > 1):
        parser.error("measure needs -n 2 or more, one rank per host (it times rank 1 -> 0)")
    if args.action == "exec" and not extra:
        parser.error("exec needs a command after --")
    if mode is Mode.ROOTLESS:
        reason = check_prerequisites(Mode.ROOTLESS)
        if reason:
            print(f"netns_cluster: {reason}", file=sys.stderr)
            return 1
        child = subprocess.Popen(rootless_argv(argv))
        try:
            return child.wait()
        except KeyboardInterrupt:  # the child got the same SIGINT and tears its cluster down
            child.wait()
            print("netns_cluster: interrupted", file=sys.stderr)
            return 130
        finally:
            if child.poll() is None:
                child.terminate()
                child.wait()
    try:
        plan = build_plan(args.world_size, args.rate, prefix=args.prefix,
                          latency_ms=args.latency_ms, delay_us=args.delay_us,
                          ranks_per_host=args.ranks_per_host)
    except ValueError as exc:
        parser.error(str(exc))
    if args.action == "bench":
        command = _bench_command(plan, extra)
    elif args.action == "measure":
        command = measure_command(args.measure_nbytes)
    else:
        command = extra
    how = ("rootless: one user namespace, private to this run" if inside
           else "root: named namespaces")
    try:
        if inside:
            _private_run_dir()
        with Cluster(plan):
            print(f"# {plan.description}; burst {plan.burst_nbytes} B, hosts at "
                  f"{', '.join(plan.addresses)}; {how}", flush=True)
            return run_ranks(plan, command, timeout_s=args.timeout_s,
                             quiet_ranks=not args.all_output)
    except NetnsError as exc:
        print(f"netns_cluster: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("netns_cluster: interrupted; namespaces removed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
