"""Where a :class:`~dqcoll.topology.graph.Topology` comes from: this machine, or a description.

:func:`parse_topology` reads a short text (a preset shape, a JSON file, or ``"detect"``);
:func:`detect_topology` detects this job's topology from the torchrun variables, ``nvidia-smi topo
-m`` and the fastest NIC in ``/sys/class/net``, with the fallbacks of docs/topology.md §1 (nothing
to go on: one CPU rank). Detection only reads: it never probes the network nor raises for a
missing tool; :attr:`Detection.notes` says what each source gave.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
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
    value = env.get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _nvidia_topo(run: bool) -> str | None:
    if not run or shutil.which("nvidia-smi") is None:
        return None
    try:
        result = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout if result.returncode == 0 else None


def parse_nvidia_topo(text: str) -> tuple[int, bool]:
    """(number of GPUs, whether any pair is joined by NVLink) from ``nvidia-smi topo -m``."""
    gpus = 0
    nvlink = False
    for line in text.splitlines():
        if re.match(r"^GPU\d+\s", line):  # rows; the header line starts with blanks
            gpus += 1
            nvlink = nvlink or bool(re.search(r"\bNV\d+\b", line))
    return gpus, nvlink


def _nic_gbps(sys_net: str) -> float | None:
    best = None
    for path in glob.glob(os.path.join(sys_net, "*", "speed")):
        iface = os.path.basename(os.path.dirname(path))
        if iface == "lo":
            continue
        try:
            with open(path) as f:
                mbps = int(f.read().strip())
        except (OSError, ValueError):
            continue  # virtual interfaces raise EINVAL or report -1
        if mbps > 0:
            best = max(best or 0.0, mbps / 1000.0)
    return best


def detect(
    *,
    world_size: int | None = None,
    env: dict[str, str] | None = None,
    nvidia_smi: bool = True,
    sys_net: str = "/sys/class/net",
    topo_text: str | None = None,
) -> Detection:
    """Detect the topology; arguments exist so tests can feed each source."""
    env = dict(os.environ) if env is None else env
    notes: list[str] = []
    n = world_size if world_size is not None else _env_int(env, "WORLD_SIZE")
    local = _env_int(env, "LOCAL_WORLD_SIZE")
    if n is None:
        n = 1
        notes.append("WORLD_SIZE not set: one rank")
    else:
        notes.append(f"world size {n}")
    if local is None or local < 1 or n % local:
        if local is not None:
            notes.append(f"LOCAL_WORLD_SIZE={local} does not divide {n}: one host")
        local = n
    hosts = n // local
    text = topo_text if topo_text is not None else _nvidia_topo(nvidia_smi)
    gpus, nvlink = parse_nvidia_topo(text) if text else (0, False)
    nic = _nic_gbps(sys_net)
    if nic is None:
        nic = FALLBACK_INTER_GBPS
        notes.append(f"no NIC speed in {sys_net}: assuming {nic:g} Gb/s")
    else:
        notes.append(f"fastest NIC {nic:g} Gb/s")
    if gpus:
        intra = LinkKind.NVLINK if nvlink else LinkKind.PCIE
        notes.append(f"nvidia-smi: {gpus} GPU(s), {intra.value}")
        topology = Topology.cluster(hosts, local, intra=intra, inter_gbps=nic)
    else:
        notes.append("no GPU found: CPU ranks sharing each host's cores over loopback")
        if hosts == 1:
            topology = Topology.single_host(n)
        else:
            topology = Topology.cluster(hosts, local, intra="loopback", inter_gbps=nic,
                                        device_kind="cpu")
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

