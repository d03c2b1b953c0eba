"""Communicators: a transport plus the per-communicator state every collective needs.

:func:`init` makes the process default. The call counter keys each call's random numbers, so
every rank must issue the same collectives in the same order (docs/design.md §6).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from . import agreement, envs, kernels
from .call_metrics import CallMetrics
from .errors import CollectiveTimeoutError, CommAbortedError, InvalidArgumentError, one_line
from .kernels import cpu_runtime
from .transports.base import Counters, Transport

__all__ = ["Communicator", "get_default_comm", "init", "set_default_comm"]

log = logging.getLogger("dqcoll")

NCCL_BACKENDS = ("nccl", "nccl4py", "nccl-cupy")
_default: Communicator | None = None  # dqcoll.init()'s, until closed or replaced by shrink()
_thread_default = threading.local()  # .comm: this thread's default (run_local's rank), or None


class Communicator:
    """A group of ranks that run collectives together, one collective at a time.

    Creating one is collective (the ranks agree on their settings, :mod:`dqcoll.agreement`). A
    collective that failed after its argument check leaves it *dead*: every later call raises
    :class:`~dqcoll.errors.CommAbortedError`.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        self.transport = transport
        self.seed = int(seed)
        self.device = torch.device(device or getattr(transport, "device", None) or "cpu")
        self.validate = envs.validate()  # DQCOLL_VALIDATE, as agreed
        if os.environ.get("DQCOLL_LOG_LEVEL"):  # unset: the application's logging config stands
            log.setLevel(envs.log_level())
        self.settings = {**agreement.wire_settings(self.seed), **(settings or {})}
        self.agreement_skipped = agreement.agree_over(
            transport, self.settings,
            what=f"creating a communicator of {transport.world_size} ranks")
        if self.device.type == "cpu":
            # ranks sharing this machine share its cores: the CPU kernels divide them
            local_ranks = transport.world_size if transport.name == "local" else 1
            if os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():  # torchrun sets it
                local_ranks = max(local_ranks, int(os.environ["LOCAL_WORLD_SIZE"]))
            cpu_runtime.claim_local_ranks(self, local_ranks)  # released by close() / death
        if self.device.type in ("cpu", "cuda"):
            kernels.warm_up(self.device)  # compile now, not at some step
        self._calls = 0
        self.last_info: dict[str, Any] = {}
        self.metrics = CallMetrics.for_transport(transport)
        self.planner: Any = None  # dqcoll.planner, made at the first planned call
        self.auto_force = envs.auto_force()
        self.last_plan: Any = None
        self.last_plan_us = 0
        self.last_plan_nbytes = 0
        # what schemes remember across calls (calibration); every rank updates it identically
        self.scheme_state: dict[Any, Any] = {}
        self.closed = False
        self.dead: str | None = None  # why the communicator can no longer be used
        self._busy = threading.Lock()  # held while a collective runs (the in-flight guard)
        self._busy_with = ""
        self.shrinks = 0
        self.members: list[int] = list(range(transport.world_size))  # ranks of the original

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def world_size(self) -> int:
        return self.transport.world_size

    @property
    def devices(self) -> tuple[str, ...]:
        """The device types whose tensors the transport moves (default both)."""
        return tuple(getattr(self.transport, "devices", None) or ("cpu", "cuda"))

    @property
    def counters(self) -> Counters:
        """``bytes_sent`` (payload + statistics + checks), ``bytes_recv``, message counts."""
        return self.transport.counters

    def next_step(self) -> int:
        step = self._calls
        self._calls += 1
        return step

    def barrier(self) -> None:
        self.transport.barrier(what="barrier")

    def abort(self, reason: str = "aborted by the caller") -> None:
        self.transport.abort(reason)

    @contextlib.contextmanager
    def in_flight(self, what: str) -> Iterator[None]:
        """Held while one collective runs; raises if the communicator cannot run one now."""
        if self.closed:
            raise InvalidArgumentError(
                f"rank {self.rank}: {what} on a closed communicator ({self!r}); create a new one")
        if self.dead is not None:
            raise CommAbortedError(
                f"rank {self.rank}: {what}: this communicator is dead since an earlier "
                f"collective failed ({self.dead}); create a new communicator (over gloo: a new "
                f"process group, e.g. torch.distributed.destroy_process_group() then "
                f"dqcoll.init())")
        if not self._busy.acquire(blocking=False):
            raise InvalidArgumentError(
                f"rank {self.rank}: {what} while {self._busy_with} is still running on the same "
                f"communicator (thread {threading.current_thread().name!r}): a communicator runs "
                f"one collective at a time; use one communicator per thread, or async_op=True "
                f"from one thread")
        self._busy_with = f"{what} (thread {threading.current_thread().name!r})"
        try:
            yield
        finally:
            self._busy_with = ""
            self._busy.release()

    def mark_dead(self, reason: str) -> None:
        """Refuse every later collective; the first reason sticks."""
        if self.dead is None:
            self.dead = reason
            cpu_runtime.release_local_ranks(self)
            log.warning("rank %d: communicator is dead: %s", self.rank, reason)

    def shrink(self, *, exclude: Sequence[int] | None = None, wait_s: float | None = None,
               timeout_s: float | None = None, store: Any = None) -> Communicator:
        """A new communicator over the ranks still alive (call on every survivor; gloo only) that
        replaces this one (now dead) as the default; ``exclude``, ``wait_s``, ``members`` and the
        errors: docs/reliability.md, "Surviving a lost rank"."""
        from . import handles, membership

        if self.closed or self.shrinks:
            raise InvalidArgumentError(
                f"rank {self.rank}: shrink() on a {'closed' if self.closed else 'shrunk'} "
                f"communicator ({self!r}); shrink the communicator the last shrink() returned")
        if exclude is not None:
            exclude = [int(r) for r in exclude]
            bad = [r for r in exclude if not 0 <= r < self.world_size]
            if bad:
                raise InvalidArgumentError(
                    f"rank {self.rank}: shrink(exclude={exclude}): ranks {bad} are not in this "
                    f"communicator (world size {self.world_size})")
        wait = membership.DEFAULT_WAIT_S if wait_s is None else envs.check_timeout_s(
            wait_s, "wait_s")

        def leave() -> None:
            handles.shutdown(self)
            self.mark_dead("shrunk after a lost rank: use the communicator shrink() returned")

        transport, members = membership.shrink_torch_transport(
            self.transport, exclude=exclude or (), wait_s=wait, timeout_s=timeout_s,
            store=store, evidence=self.dead is not None, leave=leave)
        self.shrinks += 1
        comm = Communicator(transport, seed=self.seed, device=self.device)
        comm.members = [self.members[r] for r in members]
        global _default
        if _default is self:
            _default = comm
        if getattr(_thread_default, "comm", None) is self:
            _thread_default.comm = comm
        return comm

    def close(self) -> None:
        """Release the communicator: later calls raise, and its async worker thread ends.
        Pending ``async_op`` calls finish first (at most twice the timeout, then abort)."""
        from . import handles

        timeout = 2 * float(getattr(self.transport, "timeout_s", envs.timeout_s()))
        if not handles.drain(self, timeout_s=timeout):
            self.transport.abort(f"close(): async collectives still running after {timeout:g} s")
        self.closed = True
        self.metrics.close()
        cpu_runtime.release_local_ranks(self)
        handles.shutdown(self)
        self.transport.close()
        global _default
        if _default is self:
            _default = None

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, world_size={self.world_size}, "
                f"transport={self.transport.name!r})")


def get_default_comm() -> Communicator:
    comm = getattr(_thread_default, "comm", None) or _default
    if comm is None:
        raise InvalidArgumentError("no communicator: pass comm=..., call dqcoll.init() first, "
                                   "or run inside dqcoll.testing.run_local")
    return comm


def set_default_comm(comm: Communicator | None, *, thread_local: bool = False) -> None:
    global _default
    if thread_local:
        _thread_default.comm = comm
    else:
        _default = comm


def _env_int(name: str, value: int | None) -> int:
    if value is not None:
        return int(value)
    if name not in os.environ:
        raise InvalidArgumentError(f"{name} is not set: pass it to dqcoll.init() or launch with "
                                   "torchrun")
    return int(os.environ[name])


def _probe(addr: str, port: int, timeout_s: float) -> str | None:
    """None once something accepts a connection at ``addr:port`` within ``timeout_s``, else what
    the last attempt found (polls while nobody listens yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=max(0.05, min(1.0, remaining))):
                return None
        except ConnectionRefusedError:
            found = "nobody listens there (connection refused)"
        except TimeoutError:
            found = "connection attempts went unanswered"
        except OSError as exc:
            found = f"{type(exc).__name__}: {exc}"
        if remaining <= 0:
            return found
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


def _store_client(addr: str, port: int, world_size: int, timeout_s: float,
                  rank: int) -> Any:
    """A ``TCPStore`` client of rank 0's store, or an error within ``timeout_s`` saying what is at
    ``addr:port`` (made on a thread: torch's can wait forever on a port another program holds)."""
    import torch.distributed as dist

    start = time.monotonic()
    found = _probe(addr, port, timeout_s)
    where = f"dqcoll.init: rank {rank} of {world_size}: the store of rank 0 at {addr}:{port}"
    if found is not None:
        raise CollectiveTimeoutError(
            f"{where} could not be reached within {timeout_s:g} s: {found} (missing rank: 0, "
            f"or a wrong MASTER_ADDR/MASTER_PORT)")
    result: dict[str, Any] = {}

    def connect() -> None:
        try:
            result["store"] = dist.TCPStore(
                addr, port, world_size, is_master=False,
                timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        except Exception as exc:
            result["error"] = exc

    thread = threading.Thread(target=connect, name="dqcoll-store-connect", daemon=True)
    thread.start()
    thread.join(max(0.0, timeout_s - (time.monotonic() - start)))
    if "store" in result:
        return result["store"]
    if "error" in result:
        raise CollectiveTimeoutError(
            f"{where} accepted the connection but the store client failed: "
            f"{one_line(result['error'])} (a wrong MASTER_PORT, held by another program?)"
        ) from None
    raise CollectiveTimeoutError(
        f"{where}: something accepts connections there but did not answer as a "
        f"torch.distributed store within {timeout_s:g} s: MASTER_PORT is probably held by "
        f"another program (choose a free port), or rank 0 is stalled")


def _rendezvous(addr: str, port: int, rank: int, world_size: int, timeout_s: float) -> Any:
    """A TCPStore every rank has joined (rank 0 serves it), or an error naming the missing
    ranks (each leaves a key) or what holds the port."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if rank != 0:
        store = _store_client(addr, port, world_size, timeout_s, rank)
    else:
        try:
            # multi_tenant: the server outlives the process group (peers may still talk to it)
            store = dist.TCPStore(addr, port, world_size, is_master=True, timeout=timeout,
                                  wait_for_workers=False, multi_tenant=True)
        except Exception as exc:
            in_use = "EADDRINUSE" in str(exc) or "in use" in str(exc).lower()
            raise CommAbortedError(
                f"dqcoll.init: rank 0 of {world_size} cannot serve the store at {addr}:{port}: "
                + ("the port is in use by another program (EADDRINUSE); choose a free "
                   "MASTER_PORT" if in_use else one_line(exc))) from None
    keys = [f"dqcoll/joined/{r}" for r in range(world_size)]
    store.set(keys[rank], "1")
    # poll, not store.wait(): rank 0 (the store) may exit at the deadline; report the last poll
    deadline = time.monotonic() + timeout_s
    missing: list[int] | None = None
    with contextlib.suppress(Exception):  # the store itself went away (rank 0 exited)
        while not store.check(keys):
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            if time.monotonic() >= deadline:
                break
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        else:
            return store
    named = f"missing ranks {missing}" if missing else "the store of rank 0 went away"
    raise CollectiveTimeoutError(
        f"dqcoll.init: rank {rank}: {named} (world size {world_size}): not joined within "
        f"the timeout of {timeout_s:g} s at {addr}:{port} (start every rank, or raise "
        f"timeout_s / DQCOLL_TIMEOUT_S)")


def init(
    backend: str = "gloo",
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    group: Any = None,
    seed: int = 0,
    timeout_s: float | None = None,
    device: torch.device | str | None = None,
) -> Communicator:
    """Create the default communicator (collective: every rank calls it).

    ``backend="gloo"`` initialises ``torch.distributed`` with gloo unless already initialised
    (arguments, else the torchrun variables); ``"torch"`` runs over an existing ``group``;
    ``"nccl"`` uses nccl4py, else CuPy's bindings (``"nccl4py"`` / ``"nccl-cupy"`` choose one).
    """
    import torch.distributed as dist

    from .transports.torch_dist import TorchTransport

    timeout = envs.timeout_s() if timeout_s is None else envs.check_timeout_s(timeout_s)
    store = None  # the job's store: the default group's, unless made here
    if backend == "gloo":
        if dist.is_initialized():
            existing = str(dist.get_backend(group))
            if "gloo" not in existing:
                raise InvalidArgumentError(
                    f"dqcoll.init(backend='gloo'): torch.distributed is already initialised "
                    f"with backend {existing!r}; use dqcoll.init(backend='torch') to run over "
                    f"that group (its tensors' device), or destroy it first")
        else:
            r = _env_int("RANK", rank)
            n = _env_int("WORLD_SIZE", world_size)
            addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
            port = int(master_port or os.environ.get("MASTER_PORT", "29500"))
            store = _rendezvous(addr, port, r, n, timeout)
            try:
                dist.init_process_group("gloo", store=store, rank=r, world_size=n,
                                        timeout=datetime.timedelta(seconds=timeout))
            except Exception as exc:
                raise CommAbortedError(
                    f"dqcoll.init: rank {r} of {n}: creating the gloo process group at "
                    f"{addr}:{port} failed: {one_line(exc)}") from None
    if backend in ("gloo", "torch"):
        transport: Transport = TorchTransport(group, timeout_s=timeout, store=store)
    elif backend in NCCL_BACKENDS:
        from .transports import init_nccl

        transport = init_nccl(backend, rank=rank, world_size=world_size, master_addr=master_addr,
                              master_port=master_port, timeout_s=timeout, device=device)
        device = transport.device  # type: ignore[attr-defined]  # the rank's GPU
    else:
        raise InvalidArgumentError(f"unknown backend {backend!r}; expected 'gloo', 'torch' or "
                                   f"one of {NCCL_BACKENDS}")
    comm = Communicator(transport, seed=seed, device=device)
    set_default_comm(comm)
    return comm
