"""Framed messages over gloo: a payload and its 16-byte header in one message.

The scratch pool leaves ``FRAME_HEADROOM`` bytes in front of every buffer (``ScratchPool.frame``);
the executor hands such buffers to ``exchange_framed``, and the gloo transport writes the header
into that room instead of sending it as a message of its own. Small unframed payloads are copied
behind their header. What must hold: the bytes that arrive are the payload's, every check of the
unframed path still fires (a short message, a message of another step), the counters are those
of the unframed exchange, a DynamiQ all-reduce over gloo (framed) gives the bits of the ``local``
transport (unframed), and one message goes per payload.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from conftest import run_gloo_script

from dqcoll import scratch
from dqcoll.transports.base import exchange_framed
from dqcoll.types import FRAME_HEADROOM

_WORKER = r"""
import json, sys, torch, dqcoll
from dqcoll.errors import DqcollError
from dqcoll.testing import run_local
from dqcoll.types import FRAME_HEADROOM as H

comm = dqcoll.init(backend="gloo")
t = comm.transport
rank = comm.rank
peer = 1 - rank
report = {}
posts, labels = [], []
original_run = t._run
def run(p, what):
    posts.append([[bool(s), int(x.numel())] for s, _, x in p])
    labels.append(what)
    return original_run(p, what)
t._run = run

def outcome(key, fn):
    try:
        fn()
        report[key] = "ok"
    except DqcollError as exc:
        report[key] = type(exc).__name__ + ": " + str(exc)

def payload_of(r, n):
    return ((torch.arange(n) * (r + 3)) % 251).to(torch.uint8)

# 1. a framed exchange: the payload arrives, one message each way, counted as the payload + header
n = 300_001
frame = torch.empty(H + n, dtype=torch.uint8)
frame[H:] = payload_of(rank, n)
recv = torch.full((H + n,), 7, dtype=torch.uint8)
before = dict(t.counters)
posts.clear()
t.exchange_framed([(peer, frame)], [(peer, recv)], what="framed")
report["framed_payload"] = bool(torch.equal(recv[H:], payload_of(peer, n)))
report["framed_posts"] = posts[:]
report["framed_counts"] = {k: t.counters[k] - before[k] for k in
                           ("bytes_sent", "payload_bytes_sent", "bytes_recv", "messages_sent")}

# 2. small unframed payloads go with their header in one message; large ones after it
small = torch.arange(1000, dtype=torch.float64) + rank
small_in = torch.empty(1000, dtype=torch.float64)
large = torch.arange(200_000, dtype=torch.float32) * (rank + 1)
large_in = torch.empty(200_000, dtype=torch.float32)
posts.clear()
t.exchange([(peer, small), (peer, large)], [(peer, small_in), (peer, large_in)], what="plain")
report["plain_values"] = bool(torch.equal(small_in, torch.arange(1000, dtype=torch.float64) + peer)
                              and torch.equal(large_in, torch.arange(200_000, dtype=torch.float32)
                                              * (peer + 1)))
report["plain_posts"] = posts[:]

# 3. a short framed message is refused by its receiver, naming the sender and the byte counts
recv = torch.empty(H + n, dtype=torch.uint8)
sent = frame[: H + n // 2] if rank == 1 else frame
outcome("short", lambda: t.exchange_framed([(peer, sent)], [(peer, recv)], what="short"))

# 4. a framed message of another step is refused on both sides
outcome("other_step", lambda: t.exchange_framed([(peer, frame)], [(peer, recv)],
                                                what=f"step {rank}"))

# 5. a DynamiQ all-reduce over gloo (framed) gives the local transport's bits (unframed)
def data(r):
    return torch.randn(300_000, generator=torch.Generator().manual_seed(40 + r))
x = data(rank)
posts.clear()
labels.clear()
before = dict(t.counters)
dqcoll.allreduce(x, scheme="dynamiq", bits=5, algorithm="ring", seed=3, step=4)
report["allreduce_messages"] = sum(t.counters[k] - before[k]
                                   for k in ("messages_sent", "messages_recv"))
steps = [p for p, what in zip(posts, labels) if " step " in what]
report["allreduce_steps"] = len(steps)
report["allreduce_posts"] = sum(len(p) for p in steps)
local = run_local(2, lambda c: dqcoll.allreduce(data(c.rank), scheme="dynamiq", bits=5,
                                                algorithm="ring", seed=3, step=4))
report["same_as_local"] = bool(torch.equal(x, local[rank]))
print("REPORT " + json.dumps(report), flush=True)
"""


def test_gloo_framed_and_small_messages_carry_their_header_inside() -> None:
    reports = run_gloo_script(_WORKER, 2, timeout_s=240, env={"DQCOLL_TIMEOUT_S": "20"})
    n = 300_001
    for rank, rep in reports.items():
        assert rep["exit"] == 0, rep
        assert rep["framed_payload"], rank
        assert rep["framed_posts"] == [[[True, FRAME_HEADROOM + n], [False, FRAME_HEADROOM + n]]]
        assert rep["framed_counts"] == {"bytes_sent": n + FRAME_HEADROOM,
                                        "payload_bytes_sent": n,
                                        "bytes_recv": n + FRAME_HEADROOM, "messages_sent": 1}
        assert rep["plain_values"], rank
        # the small float64 payload in one message (header + 8000 bytes), the large one after
        # its own 16-byte header: three sends, three receives
        assert rep["plain_posts"] == [[[True, FRAME_HEADROOM + 8000], [True, FRAME_HEADROOM],
                                       [True, 200_000], [False, FRAME_HEADROOM + 8000],
                                       [False, FRAME_HEADROOM], [False, 200_000]]]
        # every exchange of the all-reduce posted one message per payload (no header messages)
        assert rep["allreduce_steps"] == 2, rep  # ring of 2: a reduce step, a gather step
        assert rep["allreduce_posts"] == rep["allreduce_messages"] == 4, rep
        assert rep["same_as_local"], rank
        assert rep["other_step"].startswith("MismatchError") and "another step" in \
            rep["other_step"], rep["other_step"]
    # rank 0 received half a payload from rank 1: refused with the counts, nothing accepted
    assert reports[0]["short"].startswith("PeerError"), reports[0]["short"]
    assert f"rank 1 sent {n // 2} bytes" in reports[0]["short"], reports[0]["short"]
    assert f"{n} expected" in reports[0]["short"]


def test_pool_frames_only_its_own_buffers() -> None:
    """Every buffer the pool hands out has FRAME_HEADROOM bytes of its block in front that no
    other buffer of the call uses; ``frame`` returns them with the buffer, and nothing for a
    tensor the pool did not hand out (or a view that does not start one)."""
    pool = scratch.ScratchPool()
    sizes = [1, 100, 65_536 - FRAME_HEADROOM, 65_536, 300_000]  # (0 bytes: never sent)
    buffers = [pool.take(n) for n in sizes]
    spans = []
    for buffer, n in zip(buffers, sizes, strict=True):
        frame = pool.frame(buffer)
        assert frame is not None and frame.numel() == FRAME_HEADROOM + n
        assert frame[FRAME_HEADROOM:].data_ptr() == buffer.data_ptr()
        spans.append((frame.data_ptr(), frame.data_ptr() + frame.numel()))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans
    assert pool.frame(torch.empty(100, dtype=torch.uint8)) is None
    assert pool.frame(buffers[-1][8:]) is None  # inside a buffer: its room is another's bytes
    assert pool.frame(buffers[-1].view(torch.int32)) is None
    pool.release()
    assert pool.frame(buffers[-1]) is None  # released: no longer this call's


def test_transports_without_frames_exchange_the_payloads() -> None:
    """``exchange_framed`` over a transport with no frame support passes the payload views."""
    seen: list[tuple[list[Any], list[Any], str]] = []

    class Plain:
        def exchange(self, sends: Any, recvs: Any, *, what: str) -> None:
            seen.append((sends, recvs, what))

    frame = torch.arange(FRAME_HEADROOM + 5, dtype=torch.uint8)
    into = torch.empty(FRAME_HEADROOM + 3, dtype=torch.uint8)
    exchange_framed(Plain(), [(1, frame)], [(2, into)], what="w")  # type: ignore[arg-type]
    ((sends, recvs, what),) = seen
    assert what == "w" and sends[0][0] == 1 and recvs[0][0] == 2
    assert torch.equal(sends[0][1], frame[FRAME_HEADROOM:])
    assert recvs[0][1].data_ptr() == into[FRAME_HEADROOM:].data_ptr()
    assert recvs[0][1].numel() == 3
