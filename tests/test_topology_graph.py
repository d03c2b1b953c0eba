"""Topology graph: presets, routing with shared links, JSON, parsing and detection."""

from __future__ import annotations

import pytest

from dqcoll.errors import InvalidArgumentError
from dqcoll.topology.detect import FALLBACK_INTER_GBPS, detect, parse_nvidia_topo, parse_topology
from dqcoll.topology.graph import LinkKind, Topology

TOPO_NVLINK = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity
GPU0\t X \tNV18\tNV18\tNV18\tPXB\t0-31
GPU1\tNV18\t X \tNV18\tNV18\tPXB\t0-31
GPU2\tNV18\tNV18\t X \tNV18\tPXB\t0-31
GPU3\tNV18\tNV18\tNV18\t X \tPXB\t0-31
NIC0\tPXB\tPXB\tPXB\tPXB\t X
"""
TOPO_PCIE = TOPO_NVLINK.replace("NV18", "PIX")


def test_cluster_preset_shape_and_shared_nic():
    """A 3x4 cluster numbers ranks host-major; ranks on different hosts share their hosts' NICs,
    ranks on one host use their own NVLink ports."""
    t = Topology.cluster(3, 4, inter_gbps=100)
    assert t.world_size == 12 and t.num_hosts == 3 and t.gpus_per_host == 4
    assert t.hosts == (0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2)
    assert t.host_ranks(1) == (4, 5, 6, 7) and t.local_rank(6) == 2
    a = t.route(0, 5)
    b = t.route(1, 6)
    assert a == b == ((t.nics[0], "tx"), (t.nics[1], "rx"))  # one NIC for the whole host
    assert t.links[t.nics[0]].kind is LinkKind.NETWORK
    assert t.links[t.nics[0]].bandwidth_gbps == 100
    intra = t.route(0, 1)
    assert intra == ((t.ports[0], "tx"), (t.ports[1], "rx")) and t.ports[0] != t.ports[1]
    assert t.links[t.ports[0]].kind is LinkKind.NVLINK
    assert t.route(3, 3) == ()
    assert t.is_intra(0, 3) and not t.is_intra(3, 4)


def test_pcie_and_single_host_share_one_port():
    """PCIe and loopback fabrics are one link per host, shared by all its ranks; CPU ranks on a
    host share one compute device."""
    t = Topology.cluster(2, 4, intra="pcie")
    assert len({t.ports[r] for r in t.host_ranks(0)}) == 1
    h = Topology.single_host(4)
    assert len(set(h.ports)) == 1 and set(h.devices) == {0}
    assert h.links[h.ports[0]].kind is LinkKind.LOOPBACK
    flat = Topology.flat(3, bandwidth_gbps=1.0)
    assert flat.num_hosts == 3 and flat.route(0, 2) == ((0, "tx"), (2, "rx"))


def test_json_round_trip(tmp_path):
    """save/load and to_json/from_json give back an equal topology."""
    t = Topology.cluster(2, 3, intra="pcie", inter_gbps=25, inter_latency_us=7)
    path = tmp_path / "t.json"
    t.save(path)
    assert Topology.load(path) == t
    assert Topology.from_json(t.to_json()) == t
    with pytest.raises(InvalidArgumentError, match="not a topology"):
        Topology.from_dict({"name": "x"})


def test_parse_topology_forms(tmp_path):
    """Presets, files and errors of parse_topology."""
    assert parse_topology("4x8@400").key == "4x8-nvlink-400g"
    assert parse_topology("2x4-pcie@25").links[parse_topology("2x4-pcie@25").ports[0]].kind \
        is LinkKind.PCIE
    assert parse_topology("host:3").world_size == 3
    assert parse_topology("flat:4@0.2").links[0].bandwidth_gbps == 0.2
    path = tmp_path / "c.json"
    Topology.cluster(1, 2).save(path)
    assert parse_topology(str(path)).world_size == 2
    with pytest.raises(InvalidArgumentError, match="cannot read topology"):
        parse_topology("four by eight")


def test_invalid_topology_rejected():
    """Link indices out of range and gaps in host numbering raise with the values."""
    t = Topology.single_host(2)
    with pytest.raises(InvalidArgumentError, match="link index"):
        Topology(t.name, t.hosts, (0, 9), t.nics, t.links, t.devices)
    with pytest.raises(InvalidArgumentError, match="hosts must be numbered"):
        Topology(t.name, (0, 2), t.ports, t.nics, t.links, t.devices)


def test_parse_nvidia_topo():
    """GPU count and NVLink presence from `nvidia-smi topo -m` output."""
    assert parse_nvidia_topo(TOPO_NVLINK) == (4, True)
    assert parse_nvidia_topo(TOPO_PCIE) == (4, False)


def test_detect_torchrun_gpus_and_nic(tmp_path):
    """torchrun variables give hosts x ranks, nvidia-smi the fabric, /sys/class/net the NIC."""
    (tmp_path / "eth0").mkdir()
    (tmp_path / "eth0" / "speed").write_text("25000\n")
    (tmp_path / "lo").mkdir()
    (tmp_path / "lo" / "speed").write_text("100000\n")
    env = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    d = detect(env=env, topo_text=TOPO_NVLINK, sys_net=str(tmp_path))
    t = d.topology
    assert (t.num_hosts, t.gpus_per_host) == (2, 4)
    assert t.key == "2x4-nvlink-25g"
    assert t.links[t.nics[0]].bandwidth_gbps == 25
    pcie = detect(env=env, topo_text=TOPO_PCIE, sys_net=str(tmp_path)).topology
    assert pcie.links[pcie.ports[0]].kind is LinkKind.PCIE


def test_detect_fallback(tmp_path):
    """Nothing to go on: one CPU rank on loopback, and the notes say why."""
    d = detect(env={}, nvidia_smi=False, sys_net=str(tmp_path / "missing"))
    assert d.topology.world_size == 1 and d.topology.key == "host1-loopback"
    assert any("WORLD_SIZE not set" in n for n in d.notes)
    assert any(f"{FALLBACK_INTER_GBPS:g} Gb/s" in n for n in d.notes)
    cpu = detect(world_size=4, env={}, nvidia_smi=False, sys_net=str(tmp_path)).topology
    assert cpu.key == "host4-loopback"
