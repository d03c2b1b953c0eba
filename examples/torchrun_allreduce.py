"""Quantized all-reduce in a job launched by torchrun.

    torchrun --nproc-per-node 8 examples/torchrun_allreduce.py                  # NCCL, one GPU each
    torchrun --nproc-per-node 4 examples/torchrun_allreduce.py --backend gloo   # CPU processes

Every rank makes a gradient-like tensor from its own seed (log-normal magnitudes per 256
coordinates, as gradients have), all-reduces it with each scheme, and checks that every rank ends
with the very same bits (a fingerprint all-reduced through dqcoll's own transport). Rank 0 rebuilds
every rank's input from its seed, computes the exact sum in float64 and prints one row per scheme:
time, algbw (uncompressed bytes, as nccl-tests), bits per coordinate actually sent, vNMSE and
whether the ranks agree. The last row runs dynamiq with ``async_op=True`` (the host is free while
it runs) and checks it equals the synchronous call bit for bit.

``--fake-hosts`` (testing only) gives every rank its own ``NCCL_HOSTID`` and NCCL sockets over
loopback, and sets ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (NCCL 2.30 and later refuse several ranks on
one GPU without it), so that several NCCL ranks can share one GPU
(:func:`fake_host_env`):
``torchrun --nproc-per-node 4 examples/torchrun_allreduce.py --fake-hosts --check``.

With ``--check`` the exit status is 1 when any rank disagrees, the async result differs, or a
vNMSE is above its budget (``none``: 1e-10, quantized schemes: 0.05).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import zlib

import torch

import dqcoll
from dqcoll.executor import DEFAULT_TILE_NBYTES

VNMSE_BUDGET = {"none": 1e-10}
DEFAULT_VNMSE_BUDGET = 0.05


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def gradient(rank: int, numel: int, device: torch.device) -> torch.Tensor:
    """Rank ``rank``'s input, re-creatable anywhere from the rank alone."""
    rows = -(-numel // 256)
    magnitude = torch.exp(torch.randn(rows, generator=torch.Generator().manual_seed(1)) * 1.5)
    noise = torch.randn(rows, 256, generator=torch.Generator().manual_seed(100 + rank))
    return (noise * magnitude[:, None]).reshape(-1)[:numel].contiguous().to(device)


def fake_host_env(rank: int | str, hostname: str | None = None) -> dict[str, str]:
    """The NCCL variables that let several ranks share one GPU (``--fake-hosts``): a
    ``NCCL_HOSTID`` of the rank's own, so NCCL treats each rank as a host of its own and connects
    them with sockets over loopback; ``NCCL_MULTI_RANK_GPU_ENABLE=1``, without which NCCL 2.30
    and later refuse two ranks on one device; no InfiniBand, peer-to-peer or shared memory."""
    host = socket.gethostname() if hostname is None else hostname
    return {"NCCL_HOSTID": f"{host}-rank{rank}", "NCCL_MULTI_RANK_GPU_ENABLE": "1",
            "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "NCCL_P2P_DISABLE": "1",
            "NCCL_SHM_DISABLE": "1"}


def ranks_agree(comm: dqcoll.Communicator, x: torch.Tensor) -> bool:
    """Every rank holds the same bytes: max and min of a CRC over the ranks are equal."""
    crc = zlib.crc32(x.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    both = torch.tensor([crc, -crc], dtype=torch.int64, device=comm.device)
    comm.transport.allreduce(both, "max", what="example fingerprint")
    high, neg_low = both.tolist()
    return bool(high == -neg_low)


def synchronize(comm: dqcoll.Communicator) -> None:
    if comm.device.type == "cuda":
        torch.cuda.synchronize(comm.device)
    comm.barrier()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="nccl",
                        choices=("nccl", "nccl4py", "nccl-cupy", "gloo"),
                        help="nccl: NCCL on cuda:LOCAL_RANK (nccl4py where it imports, else "
                             "CuPy's; nccl4py / nccl-cupy choose one); gloo: CPU processes")
    parser.add_argument("--numel", default="4M", help="coordinates per rank (K/M/G suffixes)")
    parser.add_argument("--schemes", default="none,dynamiq")
    parser.add_argument("--algorithm", default="auto")
    parser.add_argument("--bits", type=float, default=5.0)
    parser.add_argument("--iters", type=int, default=3, help="timed runs per scheme (best kept)")
    parser.add_argument("--tile-nbytes", default=str(DEFAULT_TILE_NBYTES),
                        help="pipelining tile size (0: untiled)")
    parser.add_argument("--check", action="store_true", help="exit 1 on any failed check")
    parser.add_argument("--fake-hosts", action="store_true",
                        help="NCCL: each rank its own NCCL_HOSTID (several ranks on one GPU)")
    args = parser.parse_args(argv)
    if args.fake_hosts:
        # NCCL refuses two ranks of one host on one GPU; as separate "hosts" they connect with
        # sockets over loopback. The rank's host id and the multi-rank switch are set; the
        # transport choices only where the caller has not chosen
        for name, value in fake_host_env(os.environ.get("RANK", "0")).items():
            if name in ("NCCL_HOSTID", "NCCL_MULTI_RANK_GPU_ENABLE"):
                os.environ[name] = value
            else:
                os.environ.setdefault(name, value)

    comm = dqcoll.init(backend=args.backend)
    rank, n = comm.rank, comm.world_size
    numel = _size(args.numel)
    tile_nbytes = _size(args.tile_nbytes)
    device = comm.device
    exact = None
    if rank == 0:
        exact = torch.zeros(numel, dtype=torch.float64)
        for r in range(n):
            exact += gradient(r, numel, torch.device("cpu")).double()

    rows: list[tuple[str, float, float, float, float, bool]] = []
    failures: list[str] = []
    sync_dynamiq: torch.Tensor | None = None
    sync_algorithm = args.algorithm  # the async row runs the plan the synchronous one ran
    for scheme in [s for s in args.schemes.split(",") if s] + ["dynamiq (async)"]:
        name = scheme.split()[0]
        is_async = scheme.endswith("(async)")
        best_s = float("inf")
        bits = 0.0
        for iteration in range(max(1, args.iters)):
            x = gradient(rank, numel, device)
            synchronize(comm)
            sent = comm.counters["bytes_sent"]
            start = time.perf_counter()
            algorithm = sync_algorithm if is_async else args.algorithm
            kwargs = dict(scheme=name, bits=args.bits, algorithm=algorithm, seed=7,
                          step=iteration, tile_nbytes=tile_nbytes)
            if is_async:
                handle = dqcoll.allreduce(x, async_op=True, **kwargs)
                busy = sum(range(10_000))  # the host is free while the collective runs
                assert busy > 0
                handle.wait()
            else:
                dqcoll.allreduce(x, **kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best_s = min(best_s, time.perf_counter() - start)
            wire = comm.counters["bytes_sent"] - sent
            bits = 8.0 * wire / (numel * 2 * (n - 1) / n) if n > 1 else 0.0
        agree = ranks_agree(comm, x)
        if name == "dynamiq" and not is_async:
            sync_dynamiq = x.clone()
            sync_algorithm = str(comm.last_info.get("algorithm", args.algorithm))
        if is_async and sync_dynamiq is not None:
            same = bool(torch.equal(x, sync_dynamiq))
            if not same:
                failures.append("async_op result differs from the synchronous one")
        vnmse = float("nan")
        if rank == 0:
            assert exact is not None
            vnmse = dqcoll.metrics.vnmse(x.detach().cpu().double(), exact)
            if vnmse > VNMSE_BUDGET.get(name, DEFAULT_VNMSE_BUDGET):
                failures.append(f"{scheme}: vNMSE {vnmse:.3g} over budget")
        if not agree:
            failures.append(f"{scheme}: ranks disagree")
        algbw = numel * x.element_size() / best_s / 1e9
        rows.append((scheme, best_s * 1e3, algbw, bits, vnmse, agree))

    if rank == 0:
        print(f"# dqcoll {dqcoll.__version__}, backend {args.backend}, world size {n}, "
              f"{numel} fp32 coordinates per rank on {device}, tile_nbytes {tile_nbytes}, "
              f"algorithm {comm.last_info.get('algorithm')}")
        print(f"{'scheme':<16} {'time(ms)':>10} {'algbw(GB/s)':>12} {'bits/coord':>11} "
              f"{'vNMSE':>10} {'identical':>10}")
        for scheme, ms, algbw, bits, vnmse, agree in rows:
            print(f"{scheme:<16} {ms:>10.2f} {algbw:>12.3f} {bits:>11.3f} {vnmse:>10.3g} "
                  f"{'yes' if agree else 'NO':>10}")
        for failure in failures:
            print(f"FAILED: {failure}")
        if not failures:
            print("all checks passed")
        sys.stdout.flush()
    failed = torch.tensor([float(bool(failures))], device=device)
    comm.transport.allreduce(failed, "max", what="example result")
    comm.close()
    return 1 if (args.check and failed.item()) else 0


if __name__ == "__main__":
    sys.exit(main())
