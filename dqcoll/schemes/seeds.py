"""Seeds derived from named parts, the same in every process: ``derived_seed(seed, "ddp", step)``.

A 63-bit BLAKE2b digest of the parts' text, stable across processes, machines and Python versions
(``hash()`` is salted per process; arithmetic like ``seed * 1000 + rank`` collides)."""

from __future__ import annotations

import hashlib

__all__ = ["derived_seed"]


def derived_seed(*parts: object) -> int:
    """A 63-bit seed from any parts (seed, rank, step, stream name), stable across processes."""
    text = "/".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & (2**63 - 1)
