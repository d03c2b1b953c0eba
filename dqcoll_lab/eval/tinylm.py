"""A tiny byte-level transformer language model on the Python standard library's own source text.

Two users: the ``stdlib-lm`` gradient source of :mod:`dqcoll_lab.eval.sources` (real gradients,
made here, for ``python -m dqcoll_lab eval``) and the convergence experiment
(``tools/convergence.py``); the examples train it too. All need text that is present on every
machine without a download: the ``.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``), read in sorted path order, so the corpus is fixed by the
Python version alone (recorded next to every result).

The model is a GPT-style decoder: token embeddings plus learned positions, ``layers``
pre-LayerNorm blocks of causal multi-head attention and a 4x GELU MLP, a final LayerNorm and an
output head tied to the embedding. At the defaults (width 64, 2 layers, context 64, bytes) it has
about 0.1 M parameters and trains at a few milliseconds a step on a
small CPU, which keeps a multi-scheme convergence run within minutes.

Tokens: bytes by default (``vocab=256``). With ``vocab > 256``, :func:`stdlib_tokens` adds the
``vocab - 256`` most frequent words of the training text itself (identifiers, numbers, runs of
spaces; any other byte stays a byte token), so nothing is shipped or downloaded. It matters for the
*shape* of the gradients: as in an LLM, the tied embedding/output matrix then holds most of the
parameters, and with Zipf-distributed token frequencies a few of its rows carry most of the
gradient energy (docs/accuracy.md measures how skewed each source is).

Rejected: a BPE tokenizer (a dependency or a merges file to ship; the word vocabulary already gives
the Zipfian token statistics) and a downloaded corpus (not present on every machine).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import pathlib
import re
import sysconfig
from collections import Counter
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from dqcoll.schemes.seeds import derived_seed

__all__ = [
    "LMConfig",
    "TinyLM",
    "flat_grad",
    "sample_batch",
    "set_flat_grad",
    "split_corpus",
    "stdlib_corpus",
    "stdlib_tokens",
    "torch_threads",
    "word_vocabulary",
]

VOCAB = 256  # bytes


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block with ``count`` intra-op threads, then restore the previous setting.

    A model this small is faster on one thread: with other processes busy, more intra-op
    threads than free cores fight for them, and a step gets an order of magnitude slower.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@functools.lru_cache(maxsize=4)
def stdlib_corpus(max_nbytes: int = 4 << 20) -> torch.Tensor:
    """The first ``max_nbytes`` bytes of the standard library's ``.py`` files (uint8, 1-D).

    Files directly in the stdlib tree, sorted by relative path; ``site-packages`` and test suites
    are skipped (the first is not the standard library, the second is mostly data).
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root).parts
        if "site-packages" in rel or "dist-packages" in rel or "test" in rel or "tests" in rel:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_nbytes:
            break
    blob = b"".join(chunks)[:max_nbytes]
    if len(blob) < 1 << 16:
        raise RuntimeError(f"only {len(blob)} bytes of standard-library source found under {root}")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()


_WORD = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*|[0-9]+| +|[^A-Za-z0-9_ ]")


@functools.lru_cache(maxsize=4)
def word_vocabulary(vocab: int, max_nbytes: int = 4 << 20) -> tuple[bytes, ...]:
    """The multi-byte tokens of a ``vocab``-token vocabulary (ids 256 onwards, in order): the most
    frequent words of the training part of :func:`stdlib_corpus` (ties: the smaller bytes first),
    so the vocabulary is a function of the Python version and ``vocab`` alone."""
    if vocab < VOCAB:
        raise ValueError(f"vocab must be at least {VOCAB} (the byte tokens), got {vocab}")
    train, _ = split_corpus(stdlib_corpus(max_nbytes))
    counts = Counter(w for w in _WORD.findall(train.numpy().tobytes()) if len(w) > 1)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return tuple(w for w, _ in ranked[: vocab - VOCAB])


@functools.lru_cache(maxsize=4)
def stdlib_tokens(vocab: int = VOCAB, max_nbytes: int = 4 << 20) -> torch.Tensor:
    """:func:`stdlib_corpus` as token ids (int32, 1-D) of a ``vocab``-token vocabulary: bytes
    for ``vocab=256``, else words of :func:`word_vocabulary` and bytes for everything else.
    :func:`split_corpus` of the result holds out (nearly) the same text as for bytes."""
    data = stdlib_corpus(max_nbytes)
    if vocab == VOCAB:
        return data.to(torch.int32)
    ids = {w: VOCAB + i for i, w in enumerate(word_vocabulary(vocab, max_nbytes))}
    out: list[int] = []
    for w in _WORD.findall(data.numpy().tobytes()):
        t = ids.get(w)
        if t is None:
            out.extend(w)
        else:
            out.append(t)
    return torch.tensor(out, dtype=torch.int32)


def split_corpus(data: torch.Tensor, holdout: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation): the last ``holdout`` fraction of the bytes is held out."""
    cut = int(data.numel() * (1.0 - holdout))
    return data[:cut], data[cut:]


def sample_batch(
    data: torch.Tensor, batch: int, context: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows: inputs and next-byte targets, int64 [batch, context]."""
    starts = torch.randint(0, data.numel() - context - 1, (batch,), generator=generator)
    offsets = torch.arange(context + 1)
    windows = data[starts[:, None] + offsets[None, :]].long()
    return windows[:, :-1], windows[:, 1:]


@dataclasses.dataclass(frozen=True)
class LMConfig:
    width: int = 64  # model dimension
    layers: int = 2
    heads: int = 4
    context: int = 64  # tokens per training window
    vocab: int = VOCAB  # 256: bytes; more: words of the corpus too (stdlib_tokens)


class _Block(nn.Module):
    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.out = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyLM(nn.Module):
    """Small GPT; ``forward(inputs, targets)`` returns the mean cross-entropy (nats/token)."""

    def __init__(self, cfg: LMConfig | None = None, *, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg = cfg or LMConfig()
        if cfg.width % cfg.heads:
            raise ValueError(f"width {cfg.width} is not a multiple of heads {cfg.heads}")
        # Every weight is drawn from a private generator (overwriting the constructors' default
        # init, which uses the global RNG), so replicas built concurrently by ranks running as
        # threads start identical.
        g = torch.Generator().manual_seed(derived_seed(seed, "tinylm-init"))
        self.embed = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Parameter(torch.zeros(cfg.context, cfg.width))
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.width)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("weight") and p.dim() == 2:
                    std = 0.02
                    if name.endswith(("proj.weight", "out.weight")):  # GPT-2 residual scaling
                        std /= math.sqrt(2 * cfg.layers)
                    p.copy_(torch.randn(p.shape, generator=g) * std)
                elif name.endswith("bias"):
                    p.zero_()
                elif p.dim() == 1:
                    p.fill_(1.0)  # LayerNorm gains
            self.pos.copy_(torch.randn(self.pos.shape, generator=g) * 0.01)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = inputs.shape[1]
        x = self.embed(inputs) + self.pos[:t]
        for block in self.blocks:
            x = block(x)
        logits = self.ln(x) @ self.embed.weight.t()
        return F.cross_entropy(logits.reshape(-1, self.cfg.vocab), targets.reshape(-1))


def flat_grad(model: nn.Module) -> torch.Tensor:
    """All parameter gradients as one fp32 vector (zeros where a gradient is missing)."""
    return torch.cat([
        (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
        for p in model.parameters()
    ])


def set_flat_grad(model: nn.Module, flat: torch.Tensor) -> None:
    """Write a flat vector (as from :func:`flat_grad`) back into the parameters' gradients."""
    offset = 0
    for p in model.parameters():
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).to(p.dtype).clone()
        offset += n
    if offset != flat.numel():
        raise ValueError(f"flat gradient has {flat.numel()} values, the model {offset}")
