"""Surviving a lost rank: the survivors of a failed communicator agree on who is left and build
a new group of exactly those ranks (``Communicator.shrink()``).

After a rank dies, every survivor's collective raises (a :class:`~dqcoll.errors.PeerError` within
~0.1 s over gloo) and the communicator is dead: messages of the failed call may still be in
flight, and gloo's connections to the dead rank are gone. The survivors then meet in the job's
key-value store (the ``TCPStore`` every gloo job already has). Each shrink runs in *attempts*;
attempt ``E`` keeps its keys under ``<base>E/`` (``<base>`` = the communicator's store prefix +
``shrink/``), where ``E`` is read from the counter ``<base>epoch``. An attempt that fails
advances the counter (``compare_set`` from ``E`` to ``E + 1``, once whoever sees the failure
first), so a failed attempt's keys are never adopted again: a retry, by the survivors themselves
or by the caller, starts from fresh keys.

1. **Abort the old group** (a communicator on which a collective failed: *evidence* of a lost
   rank). Each such survivor aborts its old gloo group first, closing its connections: a
   survivor still blocked on a peer that has already left the failed call (rather than on the
   dead rank) then fails at once instead of waiting for its timeout.
2. **Heartbeat.** While it is inside ``shrink()``, every rank adds 1 to ``<base>beat/<rank>``
   every :data:`HEARTBEAT_S` seconds (a thread of its own). A rank whose counter stands still
   for ``wait_s`` seconds is taken for lost: this is how a rank killed *during* the shrink is
   found within seconds instead of at the collective timeout. Lost ranks are recorded under
   ``<base>lost/<rank>``; later attempts do not wait for them (they are still taken if they
   check in).
3. **Check in and close the membership.** Each rank sets ``<base>E/alive/<rank>``. A rank with
   evidence waits until every rank it expects has checked in: all ranks but ``exclude`` (when the
   caller names the dead ranks) and the recorded lost ones; after a failed attempt, that
   attempt's members less the lost; or, without ``exclude``, until ``wait_s`` seconds passed
   without a new arrival (survivors that fail one after another keep the window open), never
   longer than the timeout. Then it proposes the ranks it saw with one ``compare_set`` on
   ``<base>E/members``: the first proposal wins, and every rank adopts it, so all agree on the
   same ordered list. A rank that is not in the list (it arrived after the membership was
   closed) raises :class:`~dqcoll.errors.CommAbortedError`.
4. **No evidence: agreement or refusal.** A rank whose communicator is healthy (no collective
   failed on it) proposes nothing: it adopts a proposal made by a rank with evidence, or, when
   every rank of the communicator has checked in, proposes all of them (agreement). When
   neither happens within ``2 x wait_s`` of the last arrival it closes the attempt as
   ``refused`` and raises :class:`~dqcoll.errors.InvalidArgumentError` without having touched
   its communicator, which stays usable, as do its peers' (a lone ``shrink()`` on a healthy
   group would otherwise go on as a world of 1 and leave its peers' communicators dead).
5. **New group, committed.** Each member builds a gloo process group of the members
   (``ProcessGroupGloo`` over a ``PrefixStore`` of ``<base>E/pg/``, ranks renumbered in the old
   order) on a thread of its own, with its own store client (a blocking wait inside gloo's
   rendezvous would otherwise hold the client's lock), and sets ``<base>E/built/<rank>`` once it
   is built. Meanwhile it watches the others: when all members have built, one ``compare_set``
   of ``<base>E/outcome`` to ``ok`` commits the attempt for all of them; when a member that has
   not built stops its heartbeat, or building fails, ``outcome`` becomes ``failed: ...`` and
   every member abandons the attempt (so no member can keep a group that another abandoned).
   The survivors then retry at once with a fresh attempt, expecting the failed attempt's
   members less the lost ones, until the timeout.

The result is a communicator over the new group, with the old communicator's seed and device.

The old default process group (``torch.distributed``'s WORLD) is left as it is: it still counts
the dead rank, so code that must continue (DDP's gradient averaging) has to use the new
communicator (see :mod:`dqcoll.integrations.torch_ddp`).

The store must outlive the lost rank. ``dqcoll.init(backend="gloo")`` serves it from rank 0 (as
``init_process_group`` does), so losing rank 0 loses the store: pass ``store=`` (a ``TCPStore``
served elsewhere, e.g. by torchrun's agent), or expect a :class:`~dqcoll.errors.CommAbortedError`
naming the store. NCCL (``ncclCommShrink``) and the in-process ``local`` transport are not
covered here (:class:`~dqcoll.errors.UnsupportedError`).

Rejected: ``torch.distributed.new_group(survivors)``, which every rank of the *old* world
(the dead one included) must call; re-initialising the default process group, which would
invalidate every other group and object (DDP models) built on it in the surviving processes;
one generation key per shrink count (a failed attempt left its membership in the store, and a
retry adopted it again, dead rank included, and waited out the timeout once more); and a
heartbeat for the whole life of every communicator (a thread and a store write per process
all the time, for a check that only a shrink needs).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import envs
from .errors import (
    CollectiveTimeoutError,
    CommAbortedError,
    DqcollError,
    InvalidArgumentError,
    UnsupportedError,
    one_line,
)

__all__ = ["DEFAULT_WAIT_S", "HEARTBEAT_S", "shrink_torch_transport"]

log = logging.getLogger("dqcoll")

# How long a survivor waits for the ranks it expects (without ``exclude``) before it closes the
# membership with the ranks it has seen, and how long a heartbeat may stand still before its
# rank is taken for lost. Survivors of a SIGKILLed rank reach shrink() within ~0.1 s of each
# other over gloo (docs/reliability.md); 2 s leaves room for a loaded machine.
DEFAULT_WAIT_S = 2.0
HEARTBEAT_S = 0.1  # a rank inside shrink() adds 1 to its heartbeat counter this often
_POLL_S = 0.02
_REFUSED = "refused"


class _Abandoned(Exception):
    """An attempt failed for every member (its ``outcome`` is ``failed: ...``): retry."""

    def __init__(self, reason: str, members: Sequence[int] = ()) -> None:
        super().__init__(reason)
        self.members = list(members)  # the failed attempt's members


class _Heartbeat:
    """A thread adding 1 to ``key`` every :data:`HEARTBEAT_S` seconds until :meth:`stop`."""

    def __init__(self, store: Any, key: str) -> None:
        self._store, self._key = store, key
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dqcoll-shrink-heartbeat",
                                        daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._store.add(self._key, 1)
            except Exception:  # the store is gone: the main thread reports it
                return
            self._stop.wait(HEARTBEAT_S)

    def __enter__(self) -> _Heartbeat:
        self._store.add(self._key, 1)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)


class _Liveness:
    """Which ranks' heartbeat counters stood still for ``stale_s`` seconds of watching."""

    def __init__(self, store: Any, base: str, stale_s: float) -> None:
        self._store, self._base, self.stale_s = store, base, stale_s
        self._last: dict[int, tuple[int, float]] = {}  # rank -> (counter, since when)

    def stale(self, ranks: Sequence[int]) -> list[int]:
        now = time.monotonic()
        lost = []
        for r in ranks:
            count = int(self._store.add(f"{self._base}beat/{r}", 0))
            seen = self._last.get(r)
            if seen is None or seen[0] != count:
                self._last[r] = (count, now)
            elif now - seen[1] >= self.stale_s:
                lost.append(r)
        return lost


def _read(store: Any, key: str) -> str:
    """The value of ``key``, or "" while it is unset (without blocking)."""
    return store.get(key).decode() if store.check([key]) else ""


def _members(text: str) -> list[int]:
    return [int(r) for r in text.split(",") if r]


class _Shrink:
    """One rank's shrink (the module docstring's steps); :meth:`run` returns the agreed ranks
    and the new gloo group."""

    def __init__(self, store: Any, base: str, rank: int, world_size: int, *,
                 exclude: Sequence[int], wait_s: float, timeout_s: float, evidence: bool,
                 leave: Callable[[], None]) -> None:
        self.store, self.base, self.rank, self.n = store, base, rank, world_size
        self.exclude = sorted(set(exclude))
        self.wait_s, self.timeout_s = wait_s, timeout_s
        self.evidence = evidence  # a collective failed on this rank's communicator
        self.leave = leave  # marks the old communicator dead and aborts its group
        self.deadline = time.monotonic() + timeout_s
        self.liveness = _Liveness(store, base, wait_s)
        self.attempts: list[str] = []  # why each failed attempt failed

    # -- attempts ------------------------------------------------------------------------------

    def run(self) -> tuple[list[int], Any, str]:
        """(agreed old ranks, their new gloo group, the successful attempt's key prefix)."""
        expected: list[int] | None = None  # after a failed attempt: its members less the lost
        while True:
            epoch = int(self.store.add(f"{self.base}epoch", 0))
            prefix = f"{self.base}{epoch}/"
            try:
                members = self._agree(epoch, prefix, expected)
                if not self.evidence:  # a healthy communicator joins an agreed shrink
                    self.leave()
                    self.evidence = True
                return members, self._build(prefix, members), prefix
            except _Abandoned as why:
                self.attempts.append(f"attempt {epoch}: {why}")
                lost = self._lost()
                expected = [m for m in why.members if m not in lost] or None
                self._next_epoch(epoch)
            if time.monotonic() >= self.deadline:
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: shrink: no new group within the timeout of "
                    f"{self.timeout_s:g} s ({'; '.join(self.attempts)})")
            log.warning("rank %d: shrink: %s; retrying with fresh keys", self.rank,
                        self.attempts[-1])

    def _lost(self) -> list[int]:
        return [r for r in range(self.n) if self.store.check([f"{self.base}lost/{r}"])]

    def _next_epoch(self, epoch: int) -> None:
        """Retire attempt ``epoch`` (whoever comes first moves the counter; later ones no-op)."""
        self.store.compare_set(f"{self.base}epoch", str(epoch), str(epoch + 1))

    # -- steps 3 and 4: the membership ---------------------------------------------------------

    def _agree(self, epoch: int, prefix: str, expected: list[int] | None) -> list[int]:
        store, rank = self.store, self.rank
        outcome = _read(store, f"{prefix}outcome")
        if outcome.startswith("failed"):  # arrived after the attempt failed
            raise _Abandoned(outcome, _members(_read(store, f"{prefix}members")))
        lost = self._lost()
        if expected is None:
            expected = [r for r in range(self.n) if r not in self.exclude and r not in lost]
            patience = self.timeout_s if self.exclude else self.wait_s
        else:
            expected = [r for r in expected if r not in self.exclude]
            patience = self.wait_s
        if not self.evidence:  # agreement needs everyone not known to be lost
            expected = [r for r in range(self.n) if r not in lost]
            patience = 2 * self.wait_s
        if rank not in expected:
            expected.append(rank)
        store.set(f"{prefix}alive/{rank}", "1")
        last_arrival = time.monotonic()
        seen: list[int] = []
        while True:
            text = _read(store, f"{prefix}members")
            if text:
                break
            now_seen = [r for r in range(self.n) if store.check([f"{prefix}alive/{r}"])]
            now = time.monotonic()
            if now_seen != seen:  # survivors arriving one after another extend the window
                seen, last_arrival = now_seen, now
            stale = self.liveness.stale([r for r in seen if r != rank])
            complete = all(r in seen for r in expected)
            late = now - last_arrival >= patience or now >= self.deadline
            proposal = ""
            if self.evidence and (complete or late):
                proposal = ",".join(str(r) for r in seen
                                    if r not in self.exclude and r not in stale)
            elif not self.evidence and complete:
                proposal = ",".join(str(r) for r in seen if r not in self.exclude)
            elif not self.evidence and late:
                proposal = _REFUSED
            if proposal:
                text = store.compare_set(f"{prefix}members", "", proposal).decode()
                break
            time.sleep(_POLL_S)
        if text == _REFUSED:
            if not self.evidence:
                self._next_epoch(epoch)
                raise InvalidArgumentError(
                    f"rank {rank}: shrink() refused: no collective failed on this communicator "
                    f"and ranks {[r for r in range(self.n) if r not in seen]} did not call "
                    f"shrink() within {2 * self.wait_s:g} s (ranks {seen} did): nothing shows "
                    f"a lost rank. Call shrink() on every survivor after a collective raised "
                    f"(PeerError, CollectiveTimeoutError); this communicator is unchanged and "
                    f"still usable")
            raise _Abandoned(f"the ranks without evidence of a lost rank refused it (only "
                             f"{seen} checked in)")
        members = _members(text)
        if rank not in members:
            raise CommAbortedError(
                f"rank {rank}: shrink: the survivors closed their new group without this rank "
                f"(members {members}, old world size {self.n}): it arrived more than "
                f"{patience:g} s after the last of them, or its heartbeat stood still for "
                f"{self.wait_s:g} s")
        return members

    # -- step 5: the new group -----------------------------------------------------------------

    def _build(self, prefix: str, members: list[int]) -> Any:
        import torch.distributed as dist

        store, rank = self.store, self.rank
        try:
            client = store.clone()  # gloo's rendezvous may block in it; our polls must not
        except Exception:
            client = store
        result: dict[str, Any] = {}

        def build() -> None:
            try:
                result["group"] = dist.ProcessGroupGloo(
                    dist.PrefixStore(f"{prefix}pg/", client), members.index(rank), len(members),
                    datetime.timedelta(seconds=self.timeout_s))
            except BaseException as exc:  # reported by the watching thread
                result["error"] = exc

        builder = threading.Thread(target=build, name="dqcoll-shrink-build", daemon=True)
        builder.start()
        built = False
        while True:
            outcome = _read(store, f"{prefix}outcome")
            if outcome == "ok":
                if built:
                    return result["group"]
                outcome = f"failed: committed without rank {rank}'s group (a bug)"
            if outcome.startswith("failed"):
                raise _Abandoned(outcome, members)
            if not built and not builder.is_alive():
                if "error" in result:
                    self._fail(prefix, f"rank {rank}: creating the gloo group of {members} "
                                       f"failed: {one_line(result['error'])}")
                    continue
                store.set(f"{prefix}built/{rank}", "1")
                built = True
            pending = [m for m in members if not store.check([f"{prefix}built/{m}"])]
            if built and not pending:
                store.compare_set(f"{prefix}outcome", "", "ok")
                continue
            lost = self.liveness.stale([m for m in pending if m != rank])
            if lost:
                for m in lost:
                    store.set(f"{self.base}lost/{m}", "1")
                self._fail(prefix, f"ranks {lost} of {members} stopped (no heartbeat for "
                                   f"{self.wait_s:g} s) before the group was built")
                continue
            if time.monotonic() >= self.deadline:
                self._fail(prefix, f"ranks {pending} had not built the group of {members} "
                                   f"within the timeout of {self.timeout_s:g} s")
                continue
            time.sleep(_POLL_S)

    def _fail(self, prefix: str, reason: str) -> None:
        self.store.compare_set(f"{prefix}outcome", "", f"failed: {reason}")


def shrink_torch_transport(transport: Any, *, exclude: Sequence[int] = (),
                           wait_s: float = DEFAULT_WAIT_S, timeout_s: float | None = None,
                           store: Any = None, evidence: bool = True,
                           leave: Callable[[], None] | None = None) -> tuple[Any, list[int]]:
    """The module docstring's steps for the ``torch`` transport over gloo: (new transport,
    agreed old ranks). ``evidence``: a collective failed on this communicator (its group is
    aborted first); without it the rank only joins a shrink that others with evidence, or
    every rank, take part in. ``leave()`` runs once this rank is about to leave the old
    communicator (before its group is aborted)."""
    from .transports.torch_dist import TorchTransport

    if not isinstance(transport, TorchTransport) or transport.backend != "gloo":
        raise UnsupportedError(
            f"rank {transport.rank}: shrink() needs the torch transport over gloo, not "
            f"{getattr(transport, 'name', type(transport).__name__)!r}"
            f"{' (' + transport.backend + ')' if isinstance(transport, TorchTransport) else ''}: "
            f"NCCL communicators and in-process (local) groups are recreated instead")
    timeout = transport.timeout_s if timeout_s is None else envs.check_timeout_s(timeout_s)
    base = store if store is not None else transport.store
    if base is None:
        raise UnsupportedError(
            f"rank {transport.rank}: shrink() needs the job's key-value store and found none: "
            f"pass store=")
    rank, n = transport.rank, transport.world_size
    if rank in set(exclude):
        raise InvalidArgumentError(f"rank {rank}: shrink(exclude={list(exclude)}) excludes this "
                                   f"rank itself")

    def leaving() -> None:
        if leave is not None:
            leave()
        transport.abort("shrinking after a lost rank")

    if evidence:
        leaving()  # step 1
    prefix = f"{transport.store_prefix}shrink/"
    shrink = _Shrink(base, prefix, rank, n, exclude=exclude, wait_s=wait_s, timeout_s=timeout,
                     evidence=evidence, leave=leaving)
    try:
        with _Heartbeat(base, f"{prefix}beat/{rank}"):
            members, group, epoch_prefix = shrink.run()
    except DqcollError:
        raise
    except Exception as exc:
        raise CommAbortedError(
            f"rank {rank}: shrink: the store is unreachable ({one_line(exc)}); it lived in a "
            f"lost rank's process (dqcoll.init serves it from rank 0): pass store= with a store "
            f"served elsewhere (e.g. torchrun's)") from None
    new = TorchTransport(group, timeout_s=timeout, store=base, store_prefix=epoch_prefix)
    log.warning("rank %d: shrank to ranks %s of %d (now rank %d of %d)%s", rank, members, n,
                members.index(rank), len(members),
                f" after {len(shrink.attempts)} failed attempt(s)" if shrink.attempts else "")
    return new, members
