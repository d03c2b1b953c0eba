"""Byte buffers a communicator reuses from one CPU call to the next (payloads, receive buffers).

A DynamiQ call on the CPU allocates its compressed payloads, the buffers its messages arrive in
and the concatenations it sends (about 18 MB per rank for an all-reduce of 7.3 M coordinates
over 4 ranks). torch's CPU allocator has no cache: each of those ``torch.empty`` calls goes to
glibc, which hands blocks of that size out as fresh ``mmap`` pages and returns them at ``free``,
so every call would pay a page fault and the zeroing of a page per 4 KiB touched: thousands of
faults per DDP step on each rank, enough to lengthen the step measurably
(benchmarks/results/history-benchmarks.md, "two lanes, no page faults").

:class:`ScratchPool` keeps the blocks instead. Within one call every :meth:`~ScratchPool.take`
gets a block of its own (the smallest free one that fits, else a new one of the next power of
two from 64 KiB), so no two live buffers share memory; :meth:`~ScratchPool.release` at the end of
the call makes them free again and drops the blocks the call did not use, so the pool holds at
most what one call needed at once, rounded up to powers of two. A communicator runs one
collective at a time (:meth:`~dqcoll.Communicator.in_flight`), and its pool lives in its
``scheme_state``; nothing reads a call's buffers after the call returns. A call that fails
discards the pool (:func:`discard`) rather than releasing it: a receive that timed out may still
be written by the transport later, and its block must not be handed to another call.

Every buffer is handed out :data:`~dqcoll.types.FRAME_HEADROOM` bytes into its block, and those
bytes belong to no buffer: :meth:`~ScratchPool.frame` returns a buffer with that room in front, the
frame a transport sends with its message header in the room (one message per payload, no copy;
:func:`dqcoll.transports.base.exchange_framed`).

CUDA calls do not use it: torch's caching allocator already reuses device memory.
"""

from __future__ import annotations

from typing import Any

import torch

from .types import FRAME_HEADROOM

__all__ = ["ScratchPool", "discard", "pool_for"]

MIN_BLOCK_NBYTES = 1 << 16  # smaller requests still get a block of this size (glibc's mmap
# threshold starts at 128 KiB: below it, malloc reuses its own heap anyway)
_KEY = ("dqcoll.scratch", "cpu")


class ScratchPool:
    """uint8 blocks handed out once per call and reused by the next (see the module docstring)."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._used: list[torch.Tensor] = []
        self._framed: dict[int, torch.Tensor] = {}  # address of a handed-out buffer -> its block

    def take(self, nbytes: int) -> torch.Tensor:
        """An uninitialised uint8 buffer of ``nbytes`` (like ``torch.empty``) that no other
        buffer of this call shares, with FRAME_HEADROOM bytes of its block in front of it."""
        need = int(nbytes) + FRAME_HEADROOM
        best, best_size = -1, 0
        for i, block in enumerate(self._free):
            size = block.numel()
            if size >= need and (best < 0 or size < best_size):
                best, best_size = i, size
        if best >= 0:
            block = self._free.pop(best)
        else:
            size = max(MIN_BLOCK_NBYTES, 1 << (need - 1).bit_length())
            block = torch.empty(size, dtype=torch.uint8)
        self._used.append(block)
        buffer = block[FRAME_HEADROOM:need]
        self._framed[buffer.data_ptr()] = block
        return buffer

    def frame(self, buffer: torch.Tensor) -> torch.Tensor | None:
        """``buffer`` (the start of a buffer :meth:`take` handed out in this call) with the
        FRAME_HEADROOM bytes before it: ``frame[FRAME_HEADROOM:]`` is ``buffer``. None for any
        other tensor."""
        block = self._framed.get(buffer.data_ptr())
        if (block is None or buffer.dtype != torch.uint8 or not buffer.is_contiguous()
                or FRAME_HEADROOM + buffer.numel() > block.numel()):
            return None
        return block[: FRAME_HEADROOM + buffer.numel()]

    def release(self) -> None:
        """The call is over: its blocks are free for the next one; blocks it did not use go."""
        self._free = self._used
        self._used = []
        self._framed.clear()

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (free and in use)."""
        return sum(block.numel() for block in (*self._free, *self._used))


def pool_for(state: dict[Any, Any] | None, device: torch.device) -> ScratchPool | None:
    """The pool of the communicator whose ``scheme_state`` is ``state``, for calls on
    ``device``; None off the CPU or without a communicator."""
    if state is None or device.type != "cpu":
        return None
    pool = state.get(_KEY)
    if not isinstance(pool, ScratchPool):
        pool = state[_KEY] = ScratchPool()
        _adapt_malloc()
    return pool


_ADAPTED = [False]
# glibc's largest dynamic mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX, 32 MiB), less
# a page for the chunk header: a freed block up to that size raises the threshold to its size
ADAPT_NBYTES = (32 << 20) - 4096


def _adapt_malloc() -> None:
    """Free one block of :data:`ADAPT_NBYTES` through the C allocator, once per process.

    glibc serves blocks above its mmap threshold (128 KiB at start) with fresh ``mmap`` pages,
    and raises the threshold to a block's size when such a block is freed (mallopt(3),
    "dynamic mmap threshold"); from then on blocks up to that size come from its heap and are
    reused without page faults. A process that frees large blocks every step gets there by
    itself (torch's fp16 hook frees its 16-bit copy of each bucket: 4 faults per DDP step), but
    the pool above frees nothing, so with it every step's fresh 4 MiB weight gradients of the
    benchmark MLP faulted in again (12 thousand faults per step and rank, in the sgemm of
    backward). This puts the process where its own frees would have put it, through glibc's
    documented adaptive path (no ``mallopt``, nothing disabled); other allocators ignore it."""
    if not _ADAPTED[0]:
        _ADAPTED[0] = True
        block = torch.empty(ADAPT_NBYTES, dtype=torch.uint8)
        del block


def discard(state: dict[Any, Any] | None) -> None:
    """Forget the communicator's pool (after a failed call): its blocks go with the call."""
    if state is not None:
        state.pop(_KEY, None)
