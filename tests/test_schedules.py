"""Schedules: the checker proves every builder correct, and catches broken schedules."""

from __future__ import annotations

import pytest

from dqcoll.topology import (
    Role,
    Schedule,
    Step,
    Transfer,
    algorithms,
    build_schedule,
)
from dqcoll.topology.checker import ScheduleError, check_schedule
from dqcoll.topology.schedule import Phase, assign_roles

ALGORITHMS = ["ring", "butterfly", "direct"]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_builders_are_correct_for_1_to_64_ranks(algorithm: str) -> None:
    """Every chunk's sink receives each rank's contribution exactly once and every rank receives
    every reduced chunk, for n = 1..64 (powers of two and not)."""
    for n in range(1, 65):
        check_schedule(build_schedule(algorithm, n))


@pytest.mark.parametrize("n", [2, 3, 5, 8, 13, 64])
def test_depths(n: int) -> None:
    """Ring chains are n-1 deep, butterfly as deep as the largest popcount below n (at most
    ceil(log2 n)), direct 1; all send the same number of chunks."""
    depth = {a: max(build_schedule(a, n).depth(c) for c in range(n)) for a in ALGORITHMS}
    assert depth["ring"] == n - 1
    assert depth["butterfly"] == max(bin(v).count("1") for v in range(n))
    assert depth["butterfly"] <= (n - 1).bit_length()
    assert depth["direct"] == 1
    for a in ALGORITHMS:
        sched = build_schedule(a, n)
        sent = [0] * n
        for step in sched.reduce:
            for t in step.transfers:
                sent[t.src] += 1
        assert sent == [n - 1] * n, a  # each rank sends each foreign chunk exactly once


@pytest.mark.parametrize("n", [5, 8])
def test_butterfly_one_peer_per_step(n: int) -> None:
    """In each butterfly step every rank sends to a single peer (one message per step)."""
    for step in build_schedule("butterfly", n).steps:
        peers: dict[int, set[int]] = {}
        for t in step.transfers:
            peers.setdefault(t.src, set()).add(t.dst)
        assert all(len(p) == 1 for p in peers.values())


def test_json_round_trip() -> None:
    """Schedules are plain data: JSON out and back gives the same schedule."""
    sched = build_schedule("butterfly", 6)
    assert Schedule.from_json(sched.to_json()) == sched


Triples = list[list[tuple[int, int, int]]]


def _ring_triples(n: int) -> tuple[Triples, Triples]:
    reduce = [[(r, (r + 1) % n, (r - 1 - t) % n) for r in range(n)] for t in range(n - 1)]
    gather = [[(r, (r + 1) % n, (r - t) % n) for r in range(n)] for t in range(n - 1)]
    return reduce, gather


def test_checker_rejects_double_counting() -> None:
    """A contribution that reaches a sink twice is an error."""
    reduce, gather = _ring_triples(4)
    reduce[0].append((2, 0, 0))  # rank 2 also sends chunk 0 straight to the sink
    with pytest.raises(ScheduleError):
        check_schedule(assign_roles("bad", 4, reduce, gather))


def test_checker_rejects_missing_contribution() -> None:
    """A sink that misses a rank's contribution is an error."""
    reduce, gather = _ring_triples(4)
    reduce[-1] = [t for t in reduce[-1] if t[2] != 1]
    with pytest.raises(ScheduleError, match="chunk 1"):
        check_schedule(assign_roles("bad", 4, reduce, gather))


def test_checker_rejects_forwarding_before_children() -> None:
    """A rank may not send a chunk before all of its children for that chunk arrived."""
    reduce, gather = _ring_triples(4)
    reduce[0], reduce[1] = reduce[1], reduce[0]
    with pytest.raises(ScheduleError):
        check_schedule(assign_roles("bad", 4, reduce, gather))


def test_checker_rejects_gather_before_result() -> None:
    """All-gather may only forward a chunk's final result."""
    reduce, gather = _ring_triples(4)
    gather[0], gather[1] = gather[1], gather[0]
    with pytest.raises(ScheduleError, match="before it has it"):
        check_schedule(assign_roles("bad", 4, reduce, gather))


def test_checker_rejects_wrong_roles() -> None:
    """Roles must follow the tree: the last child of an internal node is FORWARD."""
    sched = build_schedule("ring", 3)
    step0 = sched.reduce[0]
    wrong = Step(Phase.REDUCE, tuple(Transfer(t.src, t.dst, t.chunk, Role.ACCUMULATE)
                                     for t in step0.transfers))
    bad = Schedule("bad", 3, (wrong, *sched.reduce[1:]), sched.gather)
    with pytest.raises(ScheduleError, match="role"):
        check_schedule(bad)


def test_unknown_algorithm_lists_registered() -> None:
    """An unknown name raises and names what exists."""
    with pytest.raises(ValueError, match="butterfly"):
        algorithms.get("tree9")
