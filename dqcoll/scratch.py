"""Byte buffers a communicator reuses from one CPU call to the next: torch's CPU allocator has
no cache (a page fault per fresh 4 KiB). Blocks and lifetime: docs/design.md §6; a failed call
drops the pool (:func:`discard`): a timed-out receive may still be written."""

from __future__ import annotations

import functools
from typing import Any

import torch

from .types import FRAME_HEADROOM

__all__ = ["ScratchPool", "discard", "pool_for", "release"]

MIN_BLOCK_NBYTES = 1 << 16  # smaller requests still get a block of this size
# A block no call took for this many calls in a row is dropped: calls that alternate (a
# two-level plan's reduce-scatter and all-gather on one communicator, DDP's buckets of several
# sizes) keep their blocks, and the memory of a large call that does not recur is given back.
KEEP_IDLE_CALLS = 3
_KEY = ("dqcoll.scratch", "cpu")


class ScratchPool:
    """uint8 blocks handed out once per call and reused by the next ones."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._idle: list[int] = []  # per free block: the calls in a row that did not take it
        self._used: list[torch.Tensor] = []
        self._framed: dict[int, torch.Tensor] = {}  # address of a handed-out buffer -> its block
        self.made = 0  # blocks allocated so far (a call that reuses the pool's adds none)

    def take(self, nbytes: int) -> torch.Tensor:
        """An uninitialised uint8 buffer of ``nbytes`` (like ``torch.empty``) that no other
        buffer of this call shares, with FRAME_HEADROOM bytes of its block in front of it."""
        need = int(nbytes) + FRAME_HEADROOM
        fits = [i for i, block in enumerate(self._free) if block.numel() >= need]
        if fits:  # the smallest block that fits
            i = min(fits, key=lambda i: self._free[i].numel())
            block = self._free.pop(i)
            del self._idle[i]
        else:
            size = max(MIN_BLOCK_NBYTES, 1 << (need - 1).bit_length())
            block = torch.empty(size, dtype=torch.uint8)
            self.made += 1
        self._used.append(block)
        buffer = block[FRAME_HEADROOM:need]
        self._framed[buffer.data_ptr()] = block
        return buffer

    def frame(self, buffer: torch.Tensor) -> torch.Tensor | None:
        """``buffer`` (handed out by :meth:`take` in this call) with the FRAME_HEADROOM bytes
        before it, or None for any other tensor."""
        block = self._framed.get(buffer.data_ptr())
        if (block is None or buffer.dtype != torch.uint8 or not buffer.is_contiguous()
                or FRAME_HEADROOM + buffer.numel() > block.numel()):
            return None
        return block[: FRAME_HEADROOM + buffer.numel()]

    def release(self) -> None:
        """The call is over: its blocks are free for the next one; a block that this call and
        the :data:`KEEP_IDLE_CALLS` - 1 before it did not take goes."""
        kept = [(block, idle + 1) for block, idle in zip(self._free, self._idle, strict=True)
                if idle + 1 < KEEP_IDLE_CALLS]
        self._free = self._used + [block for block, _ in kept]
        self._idle = [0] * len(self._used) + [idle for _, idle in kept]
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


# glibc's largest dynamic mmap threshold on 64-bit (32 MiB), less a page for the chunk header
ADAPT_NBYTES = (32 << 20) - 4096


@functools.cache
def _adapt_malloc() -> None:
    """Free one block of :data:`ADAPT_NBYTES` once per process: it raises glibc's dynamic mmap
    threshold (mallopt(3)), so the pool's blocks come from the heap without page faults."""
    torch.empty(ADAPT_NBYTES, dtype=torch.uint8)


def release(state: dict[Any, Any] | None) -> None:
    """A call of the communicator whose ``scheme_state`` is ``state`` returned: its pool's
    blocks are free for the next call (:meth:`ScratchPool.release`)."""
    pool = state.get(_KEY) if state is not None else None
    if isinstance(pool, ScratchPool):
        pool.release()


def discard(state: dict[Any, Any] | None) -> None:
    """Forget the communicator's pool (after a failed call): its blocks go with the call."""
    if state is not None:
        state.pop(_KEY, None)
