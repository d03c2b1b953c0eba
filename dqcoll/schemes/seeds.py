"""Seeds derived from named parts, the same in every process: ``derived_seed(seed, "ddp", step)``.

A call's randomness (THC's rotation, the DDP hook's per-iteration rounding seed, an evaluation's
per-rank data) is keyed by a seed that every rank must compute alike without communicating. A
63-bit BLAKE2b digest of the parts' text gives that, stable across processes, machines and Python
versions (unlike ``hash()``, which is salted per process).

Rejected: ``torch.Generator`` seeded by arithmetic on the parts (``seed * 1000 + rank`` collides
between streams) and Python's ``hash`` (randomized per process by ``PYTHONHASHSEED``).
"""

from __future__ import annotations

import hashlib

__all__ = ["derived_seed"]


def derived_seed(*parts: object) -> int:
    """A 63-bit seed from any parts (seed, rank, step, stream name), stable across processes."""
    text = "/".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & (2**63 - 1)
