"""The cluster as a graph: ranks on hosts, joined by links with a bandwidth and a latency.

Routing (docs/topology.md §1): ranks of one host talk through their *ports*; others out through
the sender's NIC and in through the receiver's. A shared link (a NIC, a PCIe root) is *one* link
carrying every rank's bytes. :data:`LINK_DEFAULTS` are round numbers near what NCCL reaches, not
peaks. Rejected: a general graph with shortest-path routing; every target cluster is hosts with a
fabric behind one NIC each.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import pathlib
from typing import Any

from ..errors import InvalidArgumentError

__all__ = [
    "LINK_DEFAULTS",
    "Link",
    "LinkKind",
    "LinkSpec",
    "Topology",
]


class LinkKind(enum.Enum):
    NVLINK = "nvlink"  # GPU port into an NVSwitch fabric: one per GPU, not shared
    PCIE = "pcie"  # the node's PCIe root: shared by every GPU of the node
    LOOPBACK = "loopback"  # CPU ranks on one host talking through the kernel's TCP loopback
    NETWORK = "network"  # a host's NIC: shared by every rank of the host


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """Default figures of a link kind and whether one link serves a whole host."""

    bandwidth_gbps: float  # per direction, gigabits per second
    latency_us: float
    shared_per_host: bool


LINK_DEFAULTS: dict[LinkKind, LinkSpec] = {
    LinkKind.NVLINK: LinkSpec(bandwidth_gbps=2880.0, latency_us=3.0, shared_per_host=False),
    LinkKind.PCIE: LinkSpec(bandwidth_gbps=200.0, latency_us=5.0, shared_per_host=True),
    # gloo through one host's loopback, per direction and per message round (docs/topology.md).
    LinkKind.LOOPBACK: LinkSpec(bandwidth_gbps=4.5, latency_us=60.0, shared_per_host=True),
    LinkKind.NETWORK: LinkSpec(bandwidth_gbps=100.0, latency_us=5.0, shared_per_host=True),
}


@dataclasses.dataclass(frozen=True)
class Link:
    name: str
    kind: LinkKind
    bandwidth_gbps: float  # per direction
    latency_us: float

    @property
    def bytes_per_us(self) -> float:
        return self.bandwidth_gbps * 1e3 / 8.0  # Gb/s -> bytes per microsecond

    def to_dict(self) -> dict[str, Any]:
        return dict(dataclasses.asdict(self), kind=self.kind.value)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Link:
        return cls(str(data["name"]), LinkKind(data["kind"]), float(data["bandwidth_gbps"]),
                   float(data["latency_us"]))


@dataclasses.dataclass(frozen=True)
class Topology:
    """Ranks, hosts and links, routed by the module docstring's rule."""

    name: str
    hosts: tuple[int, ...]  # hosts[rank]: the host a rank lives on
    ports: tuple[int, ...]  # ports[rank]: index in ``links`` of the rank's port into its host
    nics: tuple[int, ...]  # nics[host]: index in ``links`` of the host's NIC
    links: tuple[Link, ...]
    devices: tuple[int, ...]  # devices[rank]: compute device id (equal ids share throughput)
    device_kind: str = "cpu"  # key into the cost model's kernel throughput table

    def __post_init__(self) -> None:
        n = len(self.hosts)
        if n < 1:
            raise InvalidArgumentError("a topology needs at least one rank")
        for field, values in (("ports", self.ports), ("devices", self.devices)):
            if len(values) != n:
                raise InvalidArgumentError(f"topology {self.name!r}: {field} has {len(values)} "
                                           f"entries for {n} ranks")
        num_hosts = max(self.hosts) + 1
        if sorted(set(self.hosts)) != list(range(num_hosts)):
            raise InvalidArgumentError(f"topology {self.name!r}: hosts must be numbered 0.."
                                       f"{num_hosts - 1}, got {sorted(set(self.hosts))}")
        if len(self.nics) != num_hosts:
            raise InvalidArgumentError(f"topology {self.name!r}: {len(self.nics)} NICs for "
                                       f"{num_hosts} hosts")
        for index in (*self.ports, *self.nics):
            if not 0 <= index < len(self.links):
                raise InvalidArgumentError(f"topology {self.name!r}: link index {index} outside "
                                           f"[0, {len(self.links)})")

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    @property
    def num_hosts(self) -> int:
        return len(self.nics)

    def host_ranks(self, host: int) -> tuple[int, ...]:
        return tuple(r for r, h in enumerate(self.hosts) if h == host)

    def local_rank(self, rank: int) -> int:
        return self.host_ranks(self.hosts[rank]).index(rank)

    @property
    def gpus_per_host(self) -> int | None:
        """Ranks per host when every host has the same number, else None."""
        counts = {len(self.host_ranks(h)) for h in range(self.num_hosts)}
        return counts.pop() if len(counts) == 1 else None

    @property
    def key(self) -> str:
        """A file-name-safe identifier (the tuned tables are named by it)."""
        return "".join(c if c.isalnum() or c in "-_." else "-" for c in self.name)

    def route(self, src: int, dst: int) -> tuple[tuple[int, str], ...]:
        """The ``(link index, "tx" | "rx")`` resources a message from ``src`` to ``dst`` uses."""
        if src == dst:
            return ()
        if self.hosts[src] == self.hosts[dst]:
            return ((self.ports[src], "tx"), (self.ports[dst], "rx"))
        return ((self.nics[self.hosts[src]], "tx"), (self.nics[self.hosts[dst]], "rx"))

    def latency_us(self, src: int, dst: int) -> float:
        return max((self.links[i].latency_us for i, _ in self.route(src, dst)), default=0.0)

    def is_intra(self, src: int, dst: int) -> bool:
        return self.hosts[src] == self.hosts[dst]

    @classmethod
    def cluster(
        cls,
        nodes: int,
        gpus_per_node: int,
        *,
        intra: str | LinkKind = "nvlink",
        inter_gbps: float = 100.0,
        intra_gbps: float | None = None,
        inter_latency_us: float | None = None,
        intra_latency_us: float | None = None,
        device_kind: str = "h100",
        name: str | None = None,
    ) -> Topology:
        """``nodes`` hosts of ``gpus_per_node`` GPUs, ranks numbered host-major (as torchrun
        does), one NIC of ``inter_gbps`` per node shared by its GPUs (figures ``None``: the link
        kind's :data:`LINK_DEFAULTS`)."""
        if nodes < 1 or gpus_per_node < 1:
            raise InvalidArgumentError(
                f"cluster needs nodes >= 1 and gpus_per_node >= 1, got {nodes}x{gpus_per_node}")
        kind = LinkKind(intra)
        if kind is LinkKind.NETWORK:
            raise InvalidArgumentError("intra must be nvlink, pcie or loopback, not network")
        spec, net = LINK_DEFAULTS[kind], LINK_DEFAULTS[LinkKind.NETWORK]
        bw = spec.bandwidth_gbps if intra_gbps is None else float(intra_gbps)
        lat = spec.latency_us if intra_latency_us is None else float(intra_latency_us)
        nic_lat = net.latency_us if inter_latency_us is None else float(inter_latency_us)
        links: list[Link] = []
        ports: list[int] = []
        nics: list[int] = []
        for node in range(nodes):
            nics.append(len(links))
            links.append(Link(f"nic{node}", LinkKind.NETWORK, float(inter_gbps), nic_lat))
            for local in range(gpus_per_node):
                if not spec.shared_per_host:  # a port per rank
                    links.append(Link(f"{kind.value}{node}.{local}", kind, bw, lat))
                elif local == 0:  # one port per host
                    links.append(Link(f"{kind.value}{node}", kind, bw, lat))
                ports.append(len(links) - 1)
        hosts = tuple(r // gpus_per_node for r in range(nodes * gpus_per_node))
        return cls(name or f"{nodes}x{gpus_per_node}-{kind.value}-{inter_gbps:g}g", hosts,
                   tuple(ports), tuple(nics), tuple(links),
                   hosts if device_kind == "cpu" else tuple(range(len(hosts))),
                   device_kind=device_kind)

    @classmethod
    def single_host(
        cls,
        world_size: int,
        *,
        kind: str | LinkKind = "loopback",
        bandwidth_gbps: float | None = None,
        latency_us: float | None = None,
        shared_device: bool = True,
        device_kind: str = "cpu",
        name: str | None = None,
    ) -> Topology:
        """``world_size`` ranks on one host; CPU ranks share its cores (``shared_device``)."""
        link_kind = LinkKind(kind)
        one = cls.cluster(1, world_size, intra=link_kind, intra_gbps=bandwidth_gbps,
                          intra_latency_us=latency_us, device_kind=device_kind,
                          name=name or f"host{world_size}-{link_kind.value}")
        return dataclasses.replace(one, devices=(0,) * world_size if shared_device
                                   else tuple(range(world_size)))

    @classmethod
    def flat(
        cls,
        world_size: int,
        *,
        bandwidth_gbps: float,
        latency_us: float = 50.0,
        shared_device: bool = False,
        device_kind: str = "cpu",
        name: str | None = None,
    ) -> Topology:
        """One rank per host behind its own NIC (the network-namespace emulation);
        ``shared_device``: the "hosts" share one machine's cores."""
        links = tuple(Link(f"nic{r}", LinkKind.NETWORK, float(bandwidth_gbps), float(latency_us))
                      for r in range(world_size))
        devices = (0,) * world_size if shared_device else tuple(range(world_size))
        label = name or f"flat{world_size}-{bandwidth_gbps:g}g"
        return cls(label, tuple(range(world_size)), tuple(range(world_size)),
                   tuple(range(world_size)), links, devices, device_kind=device_kind)

    def to_dict(self) -> dict[str, Any]:
        return dict(dataclasses.asdict(self), links=[link.to_dict() for link in self.links])

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Topology:
        try:
            name = str(data["name"])
            ints = {key: tuple(map(int, data[key])) for key in ("hosts", "ports", "nics")}
            return cls(name, **ints, links=tuple(Link.from_dict(d) for d in data["links"]),
                       devices=tuple(map(int, data.get("devices", range(len(ints["hosts"]))))),
                       device_kind=str(data.get("device_kind", "cpu")))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"not a topology description: {exc}") from exc

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Topology:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike[str]) -> None:
        pathlib.Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Topology:
        return cls.from_json(pathlib.Path(path).read_text())

    def describe(self) -> str:
        g = self.gpus_per_host
        shape = f"{self.num_hosts} host(s) x {g} rank(s)" if g else f"{self.world_size} ranks"
        kinds: dict[str, Link] = {}
        for link in self.links:
            kinds.setdefault(link.kind.value, link)
        parts = [f"{k} {v.bandwidth_gbps:g} Gb/s {v.latency_us:g} us" for k, v in kinds.items()]
        return f"{self.name}: {shape}; " + ", ".join(parts)
