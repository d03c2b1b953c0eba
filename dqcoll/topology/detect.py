"""Where a :class:`~dqcoll.topology.graph.Topology` comes from: a short text
(:func:`parse_topology`) or this machine (:func:`detect`: the sources and fallbacks of
docs/topology.md §1). Detection only reads: it never probes the network nor raises for a missing
tool; :attr:`Detection.notes` says what each source gave.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import subprocess

from ..errors import InvalidArgumentError
from .graph import LinkKind, Topology

__all__ = ["FALLBACK_INTER_GBPS", "Detection", "detect", "detect_topology", "parse_topology"]

FALLBACK_INTER_GBPS = 10.0  # a common datacenter Ethernet port when the kernel does not say


@dataclasses.dataclass(frozen=True)
class Detection:
    topology: Topology
    notes: tuple[str, ...]


def _env_int(env: dict[str, str], name: str) -> int | None:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        return None


def _nvidia_topo() -> str | None:
    try:  # without nvidia-smi: FileNotFoundError
        result = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout if result.returncode == 0 else None


def parse_nvidia_topo(text: str) -> tuple[int, bool]:
    """(number of GPUs, whether any pair is joined by NVLink) from ``nvidia-smi topo -m``."""
    rows = [line for line in text.splitlines() if re.match(r"^GPU\d+\s", line)]  # header: blanks
    return len(rows), any(re.search(r"\bNV\d+\b", line) for line in rows)


def _nic_gbps(sys_net: str) -> float | None:
    gbps = []
    for path in glob.glob(os.path.join(sys_net, "*", "speed")):
        if os.path.basename(os.path.dirname(path)) == "lo":
            continue
        try:
            with open(path) as f:
                gbps.append(int(f.read().strip()) / 1000.0)
        except (OSError, ValueError):
            continue  # virtual interfaces raise EINVAL (or report -1, dropped below)
    return max((g for g in gbps if g > 0), default=None)


def detect(*, world_size: int | None = None, env: dict[str, str] | None = None,
           nvidia_smi: bool = True, sys_net: str = "/sys/class/net",
           topo_text: str | None = None) -> Detection:
    """Detect the topology; arguments exist so tests can feed each source."""
    env = dict(os.environ) if env is None else env
    n = world_size if world_size is not None else _env_int(env, "WORLD_SIZE")
    notes = ["WORLD_SIZE not set: one rank" if n is None else f"world size {n}"]
    n = 1 if n is None else n
    local = _env_int(env, "LOCAL_WORLD_SIZE")
    if local is None or local < 1 or n % local:
        if local is not None:
            notes.append(f"LOCAL_WORLD_SIZE={local} does not divide {n}: one host")
        local = n
    hosts = n // local
    text = topo_text if topo_text is not None else _nvidia_topo() if nvidia_smi else None
    gpus, nvlink = parse_nvidia_topo(text) if text else (0, False)
    nic = _nic_gbps(sys_net)
    notes.append(f"fastest NIC {nic:g} Gb/s" if nic is not None
                 else f"no NIC speed in {sys_net}: assuming {FALLBACK_INTER_GBPS:g} Gb/s")
    nic = FALLBACK_INTER_GBPS if nic is None else nic
    if gpus:
        intra = LinkKind.NVLINK if nvlink else LinkKind.PCIE
        notes.append(f"nvidia-smi: {gpus} GPU(s), {intra.value}")
        topology = Topology.cluster(hosts, local, intra=intra, inter_gbps=nic)
    else:
        notes.append("no GPU found: CPU ranks sharing each host's cores over loopback")
        topology = Topology.single_host(n) if hosts == 1 else Topology.cluster(
            hosts, local, intra="loopback", inter_gbps=nic, device_kind="cpu")
    return Detection(topology, tuple(notes))


def detect_topology(*, world_size: int | None = None) -> Topology:
    """The detected topology (named like the presets, so tuned tables for a preset apply)."""
    return detect(world_size=world_size).topology


def parse_topology(text: str | Topology, *, world_size: int | None = None) -> Topology:
    """A topology from a JSON file (:meth:`Topology.save`), ``"detect"``, ``"NxG[-intra]@GBPS"``
    (:meth:`Topology.cluster`, e.g. ``"2x4-pcie@25"``), ``"host:N"`` (:meth:`Topology.single_host`)
    or ``"flat:N@GBPS"`` (:meth:`Topology.flat`); raises :class:`InvalidArgumentError` otherwise."""
    if isinstance(text, Topology):
        return text
    spec = text.strip()
    if os.path.isfile(spec):
        return Topology.load(spec)
    if spec == "detect":
        return detect_topology(world_size=world_size)
    try:
        if spec.startswith("host:"):
            return Topology.single_host(int(spec[5:]))
        if spec.startswith("flat:"):
            count, _, gbps = spec[5:].partition("@")
            return Topology.flat(int(count), bandwidth_gbps=float(gbps or 1.0))
        shape, _, gbps = spec.partition("@")
        shape, _, intra = shape.partition("-")
        nodes, _, gpus = shape.lower().partition("x")
        return Topology.cluster(int(nodes), int(gpus), intra=intra or "nvlink",
                                inter_gbps=float(gbps or 100.0))
    except ValueError as exc:
        raise InvalidArgumentError(
            f"cannot read topology {text!r}: expected a JSON file, 'detect', 'NxG[-intra]@GBPS' "
            f"(e.g. '4x8@100'), 'host:N' or 'flat:N@GBPS' ({exc})"
        ) from None

