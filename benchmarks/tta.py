"""Time to accuracy: a GPT-style decoder trained from scratch under DDP or FSDP2 with every hook.

Users do not buy a faster all-reduce; they buy reaching the same model quality sooner. This trains
one real job under PyTorch DDP or FSDP2 over gloo once per hook, **in the same run** (the same
ranks, one hook after another) and with **paired seeds**: for a given seed every hook starts from
the same weights and sees the same batches in the same order, so the hooks differ only in how the
gradients (and, under FSDP2, the weights) travel.

==================  ===============================================================================
hook                what averages the gradients
==================  ===============================================================================
``ddp``             DDP's default (no hook): fp32 all-reduce per bucket; the reference
``fp16_hook``       torch's ``default_hooks.fp16_compress_hook``
``dqcoll``          ``dynamiq_hook`` with ``DynamiqState()``: dqcoll's defaults, warm-up included
``auto``            ``DynamiqState(scheme="auto")``
``mxfp8``           ``DynamiqState(scheme="mxfp8")``: a baseline format through dqcoll
``int4_block``      ``DynamiqState(scheme="int4_block")``: ZeRO++-style 4-bit blocks through dqcoll
``dqcoll:<policy>`` ``DynamiqState(policy=<policy>)``: a ``DQCOLL_POLICY`` text read over the
                    defaults, ``;`` between its keys (``dqcoll:warmup_steps=5;seed=1``): a variant
                    of the defaults beside them in the same run
``fsdp2``           FSDP2 (``fully_shard`` on every block and on the model), its own collectives:
                    fp32 parameter all-gathers and gradient reduce-scatters; the FSDP2 reference
``fsdp2_bf16``      FSDP2 with ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``: its gradient
                    reduce-scatter in bf16, the 16-bit peer of FSDP2 runs
``fsdp2_dqcoll``    FSDP2 with ``dqcoll.integrations.fsdp.compress(model)``: dqcoll's defaults
                    (weights in ``int8_block``, gradients in ``dynamiq`` at 5 bits)
``fsdp2_dqcoll:<p>`` the same under the policy ``<p>`` (``;`` between its keys)
==================  ===============================================================================

A hook's family is DDP's or FSDP2's (the ``fsdp2`` ones); each family has its reference, whose
final loss sets the target (``ddp``, ``fsdp2``), and its 16-bit peer, over which the speed-up is
reported (``fp16_hook``, ``fsdp2_bf16``). FSDP2 runs evaluate (and measure the gradient error
against) the exact weights: each evaluation gathers the full parameters into a plain copy of the
model, so that an FSDP2 hook that gathers weights in fewer bits (``fsdp2_dqcoll``'s ``int8_block``)
is judged by the model it trains, not by its rounded copy; its training forward and backward run
on the weights as gathered.

The job: :class:`dqcoll_lab.eval.tinylm.TinyLM`, a GPT-style decoder (learned positions,
pre-LayerNorm blocks of causal attention and a 4x GELU MLP, output head tied to the embedding) at
``--model-width`` 384, ``--layers`` 6, ``--seq-len`` 128: 10.8 M parameters, byte tokens
(vocabulary 256). The text is the ``.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``, without ``site-packages`` and test suites), present on every
machine without a download. The split is by file: a file is held out when the first 8 bytes of
the SHA-256 of its path relative to the stdlib root, as an integer, are divisible by 20 (about
one file in 20), so the held-out text is whole files the model never trains on and the split
depends on the file names alone. Training batches: ``--batch`` random windows per rank and step,
drawn from a generator keyed by (seed, step, rank). Optimiser: AdamW (lr ``--lr``, betas 0.9 /
0.95, weight decay 0.01), linear warm-up over the first tenth of the steps, cosine decay to a
tenth of the peak at the last step, gradient norm clipped to ``--clip``. Every rank:
``torch.set_num_threads(--threads)`` (1), DDP's default bucket cap (25 MB).

Reported per hook and seed (``runs`` in the JSON) and per hook over the seeds (``summary``):

* **held-out loss** (nats per byte) at step 0 and every ``--eval-every`` steps and at the last
  step, on ``--eval-windows`` fixed windows of the held-out text (evenly spaced, the same for
  every hook and seed), split over the ranks and all-reduced;
* **wall-clock**: the training time up to each evaluation, measured between barriers, without
  the evaluations (the slowest rank's: the barriers wait for it);
* **step time**: every rank times its steps (batch to optimiser step); the slowest rank's median
  with its p10 and p90, and the slowest rank of every step;
* **target**: within 1 % of the family reference's (``ddp``, ``fsdp2``) final held-out loss
  with the same seed (``loss <= 1.01 * final``); **steps and wall-clock to reach it**: at the
  first evaluation at or below it, and (``wall_to_target_interp_s``) interpolated linearly in
  loss between that evaluation and the one before; speed-up over the 16-bit peer (the fp16 hook;
  FSDP2's bf16 reduce-scatter): the peer's wall-clock to the target over the hook's, per seed,
  then the mean over seeds;
* **bytes per step** sent per rank: dqcoll's hooks from their communicators' counters (payload,
  scales, statistics, argument checks, headers) over the compressed steps, plus the 16-bit
  steps' all-reduces in fp16 or bf16 (the warm-up's, and those the step-time check chose:
  ``DynamiqState.sixteen_bit_steps``; on DDP's process group, where dqcoll's counters do not
  see them) computed as for the torch hooks; torch's hooks:
  computed from DDP's bucket sizes, ``2 (n-1)/n`` of each bucket's bytes (a ring all-reduce), in
  fp16 for the fp16 hook; FSDP2's own collectives counted as FSDP2 issues them (each
  all-gather's and reduce-scatter's ``(n-1)/n`` of its full buffer, in its dtype);
  ``fsdp2_dqcoll`` from dqcoll's counters (compressed and exact calls);
* **where a step goes** (each rank's median, mean over the ranks): the process's CPU time per
  step (every thread: compute, the hook's codec and transfers); for a DDP run with a hook, the
  time from the step's start to DDP's hand-over of its last bucket (the end of backward, with
  the averaging that overlapped it) and from there to the step's last completed average (the
  averaging left exposed after backward);
* **gradient vNMSE** of one more (untimed) step after training: the gradients DDP (FSDP2,
  gathered whole) left against the exact average (every rank's own gradients of an exact copy of
  the model, all-reduced in float64), ``|g - g_exact|^2 / |g_exact|^2`` over all parameters.

Hook order: the hooks run in ``--hooks`` order for the first seed, rotated by one for each further
seed, so no hook always runs first or last on a machine whose speed drifts.

Ranks: ``-n N`` (default 4) spawns N processes here (gloo over loopback); under an env://
launcher (``python -m dqcoll.cli.netns exec -n 4 --rate 1gbit -- python benchmarks/tta.py
--launcher env --link 1gbit``, torchrun) each process is one rank; on the emulated cluster the
link's ``tc`` rate is read from the rank's interface and recorded. Rank 0 prints a line per run
and the summary table, and writes ``--json`` (rewritten after every run, so a long run that stops
keeps what it finished) with provenance (commit, command, machine, versions, link, model, corpus)
and a PNG of held-out loss against wall-clock per hook beside it (``--png``; needs matplotlib).
``--render FILE`` prints a result file's summary as markdown (the table of docs/tta.md) and
redraws its plot. How to run it, and the results: docs/tta.md.

Rejected: a pretrained model fine-tuned (none ships without a download at 10 M parameters and
more, except as a wheel that not every machine has); byte-pair or word tokens (bytes need no
vocabulary and keep the corpus fixed by the Python version alone); a split by position in the
concatenated text (the held-out text would share files with the training text); one process per
hook (the hooks would see different machine states).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ddp_step import percentile, spawn  # noqa: E402
from torch import nn  # noqa: E402

from dqcoll.cli.provenance import device_name, git_commit  # noqa: E402
from dqcoll.schemes.seeds import derived_seed  # noqa: E402
from dqcoll.transports.base import ring_allreduce_nbytes  # noqa: E402
from dqcoll_lab.eval.tinylm import LMConfig, TinyLM  # noqa: E402

__all__ = ["DDP_HOOKS", "FSDP2_HOOKS", "HOOKS", "Corpus", "family", "is_heldout", "load_corpus",
           "lr_factor", "main", "reach", "render_markdown", "summarize"]

# hook name -> label; DDP's hooks, in the default order
DDP_HOOKS: dict[str, str] = {
    "ddp": "DDP default (fp32, no hook)",
    "fp16_hook": "torch fp16_compress_hook",
    "dqcoll": "dqcoll DynamiqState() defaults",
    "auto": "dqcoll DynamiqState(scheme=\"auto\")",
    "mxfp8": "dqcoll DynamiqState(scheme=\"mxfp8\")",
    "int4_block": "dqcoll DynamiqState(scheme=\"int4_block\")",
}
FSDP2_HOOKS: dict[str, str] = {
    "fsdp2": "FSDP2, its own collectives (fp32)",
    "fsdp2_bf16": "FSDP2, reduce_dtype=bf16",
    "fsdp2_dqcoll": "FSDP2 + dqcoll fsdp.compress() defaults",
}
HOOKS = {**DDP_HOOKS, **FSDP2_HOOKS}
DQCOLL_SCHEMES = {"dqcoll": None, "auto": "auto", "mxfp8": "mxfp8", "int4_block": "int4_block"}
# "dqcoll:<policy>": DynamiqState(policy=<policy>), a DQCOLL_POLICY text read over the defaults,
# with ";" between its keys (e.g. "dqcoll:warmup_steps=5;seed=1"): a variant of the defaults;
# "fsdp2_dqcoll:<policy>": fsdp.compress under that policy
VARIANT = "dqcoll:"
FSDP2_VARIANT = "fsdp2_dqcoll:"
REFERENCES = {"ddp": "ddp", "fsdp2": "fsdp2"}  # family -> the hook whose final loss is the target
PEERS = {"ddp": "fp16_hook", "fsdp2": "fsdp2_bf16"}  # family -> the 16-bit peer of the speed-up
TARGET_TOLERANCE = 0.01  # the target: within 1 % of the reference's final held-out loss
HELDOUT_EVERY = 20  # a file is held out when its path hash is divisible by this
WIRE_BYTES = {"ddp": 4, "fp16_hook": 2}  # torch hooks: bytes per coordinate on the wire
BUCKET_CAP_MB = 25  # DDP's default


def family(hook: str) -> str:
    """``"fsdp2"`` for the FSDP2 hooks, ``"ddp"`` for the others."""
    return "fsdp2" if hook.startswith("fsdp2") else "ddp"


def variant_policy(hook: str) -> str | None:
    """The policy text of a ``dqcoll:<policy>`` or ``fsdp2_dqcoll:<policy>`` hook (keys separated
    by commas), else None."""
    for prefix in (VARIANT, FSDP2_VARIANT):
        if hook.startswith(prefix):
            return hook[len(prefix):].replace(";", ",")
    return None


def hook_label(hook: str) -> str:
    policy = variant_policy(hook)
    if policy is None:
        return HOOKS[hook]
    if family(hook) == "fsdp2":
        return f'FSDP2 + dqcoll fsdp.compress(policy="{policy}")'
    return f'dqcoll DynamiqState(policy="{policy}")'


def known_hook(hook: str) -> bool:
    return hook in HOOKS or (variant_policy(hook) or "") != ""


# -- corpus ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The standard library's sources as bytes, split by file."""

    root: str
    train: torch.Tensor  # uint8, the training files concatenated in path order
    heldout: torch.Tensor  # uint8, the held-out files concatenated in path order
    train_files: int
    heldout_files: int

    def describe(self) -> dict[str, Any]:
        return {"source": f"*.py under {self.root} (no site-packages, no test suites)",
                "python": platform.python_version(), "tokens": "bytes (vocabulary 256)",
                "split": (f"a file is held out when int(sha256(relative path)[:8]) % "
                          f"{HELDOUT_EVERY} == 0"),
                "train_files": self.train_files, "train_bytes": int(self.train.numel()),
                "heldout_files": self.heldout_files,
                "heldout_bytes": int(self.heldout.numel())}


def is_heldout(relative_path: str) -> bool:
    """Whether a file (its path relative to the stdlib root, ``/``-separated) is held out."""
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_EVERY == 0


def load_corpus(root: str | Path | None = None) -> Corpus:
    """Every ``.py`` file under ``root`` (default: this interpreter's stdlib) except
    ``site-packages``, ``dist-packages`` and test suites, split by :func:`is_heldout`."""
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    for path in sorted(base.rglob("*.py"), key=lambda p: p.relative_to(base).as_posix()):
        rel = path.relative_to(base)
        if {"site-packages", "dist-packages", "test", "tests"} & set(rel.parts):
            continue
        try:
            parts[is_heldout(rel.as_posix())].append(path.read_bytes())
        except OSError:
            continue
    train, heldout = (b"".join(parts[h]) for h in (False, True))
    if len(train) < 1 << 16 or len(heldout) < 1 << 12:
        raise RuntimeError(f"too little standard-library source under {base}: {len(train)} "
                           f"training bytes, {len(heldout)} held out")
    return Corpus(str(base), torch.frombuffer(bytearray(train), dtype=torch.uint8).clone(),
                  torch.frombuffer(bytearray(heldout), dtype=torch.uint8).clone(),
                  len(parts[False]), len(parts[True]))


def train_batch(corpus: Corpus, seed: int, step: int, rank: int, batch: int, seq_len: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step``: ``batch`` random windows (inputs, next-byte
    targets, int64), the same for every hook with the same seed."""
    gen = torch.Generator().manual_seed(derived_seed(seed, "tta-batch", step, rank))
    starts = torch.randint(0, corpus.train.numel() - seq_len - 1, (batch,), generator=gen)
    windows = corpus.train[starts[:, None] + torch.arange(seq_len + 1)[None, :]].long()
    return windows[:, :-1], windows[:, 1:]


def heldout_windows(corpus: Corpus, count: int, seq_len: int) -> torch.Tensor:
    """``count`` evenly spaced held-out windows, int64 ``[count, seq_len + 1]``."""
    last = corpus.heldout.numel() - seq_len - 1
    starts = torch.linspace(0, last, count).long()
    return corpus.heldout[starts[:, None] + torch.arange(seq_len + 1)[None, :]].long()


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over the first tenth of the steps, then cosine down to 0.1 at the last."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, steps - 1 - warmup))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * t))


def build_model(args: argparse.Namespace, seed: int) -> TinyLM:
    """The decoder at the command line's size, its weights a function of ``seed`` alone."""
    heads = args.heads or max(1, args.model_width // 64)
    cfg = LMConfig(width=args.model_width, layers=args.layers, heads=heads,
                   context=args.seq_len)
    return TinyLM(cfg, seed=seed)


@torch.no_grad()
def heldout_loss(model: nn.Module, windows: torch.Tensor, args: argparse.Namespace,
                 rank: int, world_size: int) -> float:
    """Mean cross-entropy (nats per byte) over every held-out window; each rank evaluates every
    ``world_size``-th window, and the sums are all-reduced."""
    mine = windows[rank::world_size]
    total = torch.zeros(2, dtype=torch.float64)
    for chunk in mine.split(max(1, args.batch)):
        loss = model(chunk[:, :-1], chunk[:, 1:])
        total[0] += float(loss) * chunk[:, 1:].numel()
        total[1] += chunk[:, 1:].numel()
    dist.all_reduce(total)
    return float(total[0] / total[1])


# -- hooks -----------------------------------------------------------------------------------


class HookUnavailable(Exception):
    """A hook this dqcoll does not offer (e.g. a scheme it does not register)."""


def warm_up_schemes(hooks: Sequence[str], world_size: int) -> None:
    """One small all-reduce with each dqcoll scheme the hooks use, on a communicator of the
    default group: the CPU kernels compile (or load from numba's cache) now, not inside the
    first timed steps of the run that uses them first. Collective."""
    from dqcoll import allreduce
    from dqcoll.comm import Communicator
    from dqcoll.transports.torch_dist import TorchTransport

    wanted = {DQCOLL_SCHEMES.get(h) or "dynamiq" for h in hooks
              if family(h) == "ddp" and (h in DQCOLL_SCHEMES or variant_policy(h))}
    for hook in hooks:
        if hook.startswith("fsdp2_dqcoll"):
            try:
                policy = fsdp2_policy(hook)
            except Exception:  # refused: its runs say so
                continue
            wanted |= {rule.scheme for rule in (policy.weights, policy.gradients)
                       if not rule.is_exact}
    wanted = {"dynamiq" if s == "auto" else s for s in wanted}
    if not wanted:
        return
    comm = Communicator(TorchTransport(None), device=torch.device("cpu"))
    algorithm = "ring" if world_size > 2 else "auto"
    for scheme in sorted(wanted):
        try:
            allreduce(torch.randn(1 << 16), op="avg", scheme=scheme, algorithm=algorithm,
                      comm=comm)
        except Exception:  # a scheme this dqcoll lacks: its runs say so
            continue


class StepSplit:
    """Where a DDP step's time goes, for a hooked run: a wrapper of the hook notes when DDP hands
    over the step's last bucket (the end of backward) and when the step's last average completes
    (the latest of its buckets' futures): before the hand-over the step's compute ran (with
    whatever averaging overlapped it), after it the exposed averaging."""

    def __init__(self) -> None:
        self.handed = self.done = math.nan

    def wrap(self, hook: Any) -> Any:
        def timed(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
            if bucket.is_last():
                self.handed = time.perf_counter()
            future = hook(state, bucket)

            def finished(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
                now = time.perf_counter()
                self.done = now if math.isnan(self.done) else max(self.done, now)
                return fut.value()

            return future.then(finished)

        return timed

    def take(self, start: float) -> tuple[float, float]:
        """(ms from ``start`` to the last hand-over, ms from it to the last average) of the step
        begun at ``start``, and reset for the next."""
        split = ((self.handed - start) * 1e3, (self.done - self.handed) * 1e3)
        self.handed = self.done = math.nan
        return split


def register_hook(hook: str, ddp: nn.parallel.DistributedDataParallel,
                  split: StepSplit | None = None) -> Any:
    """Register ``hook`` on ``ddp`` (its function wrapped by ``split``, where given); its state
    (None for torch's hooks). ``ddp`` runs without a hook: nothing to wrap."""
    if hook == "ddp":
        return None
    wrap = split.wrap if split is not None else (lambda fn: fn)
    if hook == "fp16_hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, wrap(default_hooks.fp16_compress_hook))
        return None
    from dqcoll.integrations.torch_ddp import DynamiqState, dynamiq_hook

    scheme, policy = DQCOLL_SCHEMES.get(hook), variant_policy(hook)
    try:
        state = (DynamiqState(policy=policy) if policy is not None
                 else DynamiqState() if scheme is None else DynamiqState(scheme=scheme))
    except Exception as exc:  # the same on every rank: the argument check
        raise HookUnavailable(f"{hook_label(hook)} rejected: {_first_line(exc)}") from None
    ddp.register_comm_hook(state, wrap(dynamiq_hook))
    state.prepare()  # communicator, kernels, auto's link probe: before the clock starts
    return state


def fsdp2_policy(hook: str) -> Any:
    """The ``CompressionPolicy`` of an ``fsdp2_dqcoll`` hook: ``DQCOLL_POLICY`` (else the
    defaults), with a variant's keys read over it."""
    from dqcoll.integrations.policy import CompressionPolicy

    policy = CompressionPolicy.from_env()
    text = variant_policy(hook)
    return policy if text is None else CompressionPolicy.parse(text, policy)


def shard(hook: str, model: nn.Module) -> Any:
    """FSDP2 on ``model`` (``fully_shard`` on every block, then on the model) as ``hook`` wants
    it; the dqcoll state (None for FSDP2's own collectives)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options = ({"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)}
               if hook == "fsdp2_bf16" else {})
    for block in model.blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    if hook in ("fsdp2", "fsdp2_bf16"):
        return None
    from dqcoll.integrations import fsdp as dqfsdp

    try:
        policy = fsdp2_policy(hook)
    except Exception as exc:  # the same on every rank
        raise HookUnavailable(f"{hook_label(hook)} rejected: {_first_line(exc)}") from None
    return dqfsdp.compress(model, policy)


class CollectiveBytes:
    """Bytes this rank sends in the all-gathers and reduce-scatters FSDP2 issues through
    ``torch.distributed`` (its own collectives), counted while installed: ``(n-1)/n`` of each
    call's full buffer (the all-gather's output, the reduce-scatter's input), in its dtype, what
    a ring sends."""

    NAMES = (("all_gather_single", "all_gather_into_tensor"),
             ("reduce_scatter_single", "reduce_scatter_tensor"))

    def __init__(self) -> None:
        self.nbytes = 0
        self._saved: list[tuple[str, Any]] = []

    def __enter__(self) -> CollectiveBytes:
        # the name FSDP2 calls (torch 2.13: *_single; earlier: the *_tensor ones), one per kind
        for position, names in enumerate(self.NAMES):
            name = next(n for n in names if hasattr(dist, n))
            original = getattr(dist, name)
            self._saved.append((name, original))
            setattr(dist, name, self._counted(original, full=1 - position))
        return self

    def _counted(self, original: Any, full: int) -> Any:
        def call(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            n = dist.get_world_size(group)
            buffer = output if full else input  # the all-gather's output, reduce-scatter's input
            self.nbytes += (n - 1) * buffer.numel() * buffer.element_size() // n
            return original(output, input, *args, **kwargs)

        return call

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved:
            setattr(dist, name, original)
        self._saved.clear()


def unsharded(model: nn.Module, args: argparse.Namespace, seed: int) -> nn.Module:
    """A plain copy of an FSDP2 model with its exact full weights (collective: every rank
    gathers every parameter)."""
    plain = build_model(args, seed)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in model.state_dict().items()}
    plain.load_state_dict(full)
    return plain


def fsdp2_sent(state: Any) -> int:
    """Bytes this rank sent through dqcoll's FSDP2 state: its compressed calls' wire bytes and
    its exact calls' bytes."""
    summary = state.summary()
    return int(sum(c["wire_bytes"] for c in summary["compressed"].values())
               + sum(summary.get("exact_bytes", {}).values()))


def _comms(state: Any) -> list[Any]:
    """Every communicator of a dqcoll state (lane 0 and the other lanes)."""
    return [c for c in (getattr(state, "comm", None), *getattr(state, "lane_comms", ()))
            if getattr(c, "counters", None) is not None]


def bucket_nbytes(ddp: nn.parallel.DistributedDataParallel) -> list[int]:
    """DDP's bucket sizes in bytes (fp32 gradients), as its logging data reports them after
    the first iteration's rebuild; the parameters' sizes where it does not."""
    try:
        data = ddp._get_ddp_logging_data()
        text = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
        sizes = [int(s) for s in re.findall(r"\d+", str(text))]
        if sizes:
            return sizes
    except (AttributeError, RuntimeError):
        pass
    return [p.numel() * p.element_size() for p in ddp.parameters() if p.requires_grad]


def _flat_grads(model: nn.Module) -> torch.Tensor:
    """Every parameter's gradient, flat, in float64 (FSDP2's sharded ones gathered whole)."""
    return torch.cat([
        (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).reshape(-1).double()
        if p.grad is not None else torch.zeros(p.numel(), dtype=torch.float64)
        for p in model.parameters()])


def gradient_vnmse(ddp: nn.Module, x: torch.Tensor, y: torch.Tensor, world_size: int,
                   exact_copy: nn.Module | None = None) -> float:
    """One untimed step's vNMSE: the gradients DDP (or FSDP2, gathered whole) averaged against
    the exact fp64 average of every rank's gradients of ``exact_copy`` (default: a copy of
    DDP's module)."""
    reference = copy.deepcopy(ddp.module) if exact_copy is None else exact_copy
    ddp.zero_grad(set_to_none=True)
    ddp(x, y).backward()
    averaged = _flat_grads(ddp)
    reference(x, y).backward()
    exact = _flat_grads(reference)
    dist.all_reduce(exact)
    exact /= world_size
    norm2 = float(exact.square().sum())
    return float((averaged - exact).square().sum()) / norm2 if norm2 > 0 else math.nan


def _every_rank(values: list[float]) -> list[list[float]]:
    mine = torch.tensor(values, dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [[float(v) for v in t] for t in everyone]


# -- one run ---------------------------------------------------------------------------------


def run_one(hook: str, seed: int, corpus: Corpus, windows: torch.Tensor,
            args: argparse.Namespace, rank: int, world_size: int) -> dict[str, Any]:
    """Train the model once with ``hook`` from ``seed``; the run's record (see the module
    docstring). Collective: every rank calls it with the same arguments."""
    began = time.perf_counter()
    model = build_model(args, seed)
    sharded = family(hook) == "fsdp2"
    split = None
    if sharded:
        state = shard(hook, model)
        ddp: nn.Module = model
        counted_bytes = CollectiveBytes()
    else:
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
        split = StepSplit() if hook != "ddp" else None
        state = register_hook(hook, ddp, split)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args.steps))
    for comm in _comms(state):  # from here on: training's bytes only (not auto's link probe)
        comm.counters.reset()
    out: dict[str, Any] = {"hook": hook, "label": hook_label(hook), "seed": seed}

    def evaluate() -> float:  # FSDP2: the exact weights, gathered into a plain copy
        plain = unsharded(ddp, args, seed) if sharded else ddp.module
        return heldout_loss(plain, windows, args, rank, world_size)

    curve = [{"step": 0, "wall_s": 0.0, "loss": evaluate()}]
    step_ms: list[float] = []
    cpu_ms: list[float] = []
    parts: list[tuple[float, float]] = []  # (to the last bucket, after it) per step
    train_loss: list[float] = []
    wall = eval_s = 0.0
    dist.barrier()
    segment = time.perf_counter()
    for step in range(args.steps):
        x, y = train_batch(corpus, seed, step, rank, args.batch, args.seq_len)
        start, cpu = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        with counted_bytes if sharded else contextlib.nullcontext():
            loss = ddp(x, y)
            loss.backward()
        if args.clip > 0:
            nn.utils.clip_grad_norm_(ddp.parameters(), args.clip)
        opt.step()
        sched.step()
        step_ms.append((time.perf_counter() - start) * 1e3)
        cpu_ms.append((time.process_time() - cpu) * 1e3)
        if split is not None:
            parts.append(split.take(start))
        train_loss.append(round(float(loss.detach()), 5))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            dist.barrier()
            pause = time.perf_counter()
            wall += pause - segment
            curve.append({"step": step + 1, "wall_s": round(wall, 4), "loss": evaluate()})
            dist.barrier()
            segment = time.perf_counter()
            eval_s += segment - pause
    # bytes: dqcoll's counters (compressed steps) + warm-up and torch hooks from bucket sizes;
    # FSDP2: its own collectives as counted, or dqcoll's FSDP2 state's counters
    if sharded:
        counted = float(counted_bytes.nbytes if state is None else fsdp2_sent(state))
    else:
        counted = float(sum(c.counters["bytes_sent"] for c in _comms(state)))
    steps = args.steps
    split_ms = [percentile([p[k] for p in parts], 50) if parts else math.nan for k in (0, 1)]
    gathered = _every_rank([*step_ms, wall, eval_s, counted, percentile(cpu_ms, 50), *split_ms])
    slowest = max((row[:steps] for row in gathered), key=lambda t: percentile(t, 50))
    out.update(
        status="ok", params=sum(p.numel() for p in model.parameters()),
        initial_loss=curve[0]["loss"], final_loss=curve[-1]["loss"], curve=curve,
        median_ms=percentile(slowest, 50), p10_ms=percentile(slowest, 10),
        p90_ms=percentile(slowest, 90),
        step_ms=[round(max(row[i] for row in gathered), 2) for i in range(steps)],
        wall_s=max(row[steps] for row in gathered),
        eval_s=max(row[steps + 1] for row in gathered),
        train_loss_rank0=train_loss)
    # where a step goes: each rank's median, then the mean over the ranks
    rank_cpu, to_last, after = ([row[steps + 3 + k] for row in gathered] for k in range(3))
    out["cpu_ms"] = sum(rank_cpu) / len(rank_cpu)
    if split is not None:
        out["to_last_bucket_ms"] = sum(to_last) / len(to_last)
        out["after_backward_ms"] = sum(after) / len(after)
    if sharded:
        out["bytes_per_step"] = sum(row[steps + 2] for row in gathered) / len(gathered) / steps
        out["bytes_source"] = (
            "FSDP2's all-gathers and reduce-scatters as issued, (n-1)/n of each full buffer "
            "(mean over ranks)" if state is None else
            "dqcoll's FSDP2 counters: compressed wire bytes and exact calls (mean over ranks)")
        if state is not None:
            out["fsdp2_summary"] = state.summary()
    else:
        world_bytes = sum(ring_allreduce_nbytes(b, world_size) for b in bucket_nbytes(ddp))
        out["fp32_bytes_per_step"] = world_bytes
        if state is None:
            out["bytes_per_step"] = world_bytes * WIRE_BYTES[hook] / 4
            out["bytes_source"] = "computed: 2 (n-1)/n of DDP's bucket bytes, in the wire dtype"
        else:
            # the 16-bit steps (the warm-up's, and those auto's step-time check chose) send
            # their fp32 buckets in fp16 or bf16 on DDP's group, outside dqcoll's counters
            warm = min(steps, state.sixteen_bit_steps)
            sent = sum(row[steps + 2] for row in gathered) / len(gathered)  # mean over ranks
            out["warmup_steps"] = state.warmup_steps
            out["sixteen_bit_steps"] = warm
            out["step_choices"] = [dataclasses.asdict(c) for c in state.step_choice.choices]
            out["sixteen_bit_formats"] = [list(entry) for entry in state.sixteen_bit.history]
            out["bytes_per_step"] = (sent + warm * world_bytes / 2) / steps
            out["bytes_per_compressed_step"] = sent / (steps - warm) if steps > warm else None
            out["bytes_source"] = ("dqcoll counters over the compressed steps (mean over ranks) "
                                   "+ the 16-bit steps' all-reduces computed from bucket sizes")
    x, y = train_batch(corpus, seed, steps, rank, args.batch, args.seq_len)
    out["vnmse"] = gradient_vnmse(ddp, x, y, world_size,
                                  unsharded(ddp, args, seed) if sharded else None)
    info = getattr(state, "last_info", None) or {}
    planned = info.get("planned")
    if isinstance(planned, dict) and planned.get("label"):
        out["planned"] = str(planned["label"])  # the last bucket's plan in the vNMSE step
    if sharded and state is not None:
        state.close()
    elif state is not None:
        from dqcoll import handles

        state.drain()
        for comm in _comms(state):
            handles.shutdown(comm)
    out["run_s"] = time.perf_counter() - began  # everything: set-up, evaluations, vNMSE step
    return out


# -- summary ---------------------------------------------------------------------------------


def reach(curve: Sequence[dict[str, float]], target: float) -> dict[str, float | None]:
    """The first evaluation at or below ``target``: its step and wall-clock, and the wall-clock
    interpolated linearly in loss between it and the evaluation before (None: never reached)."""
    for i, point in enumerate(curve):
        if point["loss"] <= target:
            interp = point["wall_s"]
            if i > 0 and curve[i - 1]["loss"] > point["loss"]:
                before = curve[i - 1]
                frac = (before["loss"] - target) / (before["loss"] - point["loss"])
                interp = before["wall_s"] + frac * (point["wall_s"] - before["wall_s"])
            return {"steps_to_target": point["step"], "wall_to_target_s": point["wall_s"],
                    "wall_to_target_interp_s": interp}
    return {"steps_to_target": None, "wall_to_target_s": None, "wall_to_target_interp_s": None}


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None and math.isfinite(v)]
    return sum(present) / len(present) if present and len(present) == len(values) else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per run: the seed's target (its family reference's final loss, + 1 %) and when the run
    reached it (added to each run in place); per hook, over the seeds where every run is ok:
    means of the figures and the paired speed-up over its family's 16-bit peer (the
    ``speedup_vs_fp16_*`` keys: the fp16 hook for DDP, ``fsdp2_bf16`` for FSDP2)."""
    ok = [r for r in runs if r.get("status") == "ok"]
    finals = {(family(r["hook"]), r["seed"]): r["final_loss"] for r in ok
              if r["hook"] == REFERENCES[family(r["hook"])]}
    for run in ok:
        target = finals.get((family(run["hook"]), run["seed"]))
        run["target"] = None if target is None else target * (1 + TARGET_TOLERANCE)
        run.update(reach(run["curve"], run["target"]) if target is not None
                   else reach([], 0.0))
    peers = {(family(r["hook"]), r["seed"]): r for r in ok
             if r["hook"] == PEERS[family(r["hook"])]}
    summary: dict[str, Any] = {}
    for hook in dict.fromkeys(r["hook"] for r in runs):
        kind = family(hook)
        reference = {seed: loss for (f, seed), loss in finals.items() if f == kind}
        fp16 = {seed: run for (f, seed), run in peers.items() if f == kind}
        mine = [r for r in ok if r["hook"] == hook]
        failed = [r for r in runs if r["hook"] == hook and r.get("status") != "ok"]
        entry: dict[str, Any] = {"label": hook_label(hook), "seeds": [r["seed"] for r in mine],
                                 "failed": [f"seed {r['seed']}: {r['status']}" for r in failed]}
        if mine:
            keys = ("median_ms", "final_loss", "initial_loss", "wall_s", "bytes_per_step",
                    "vnmse", "steps_to_target", "wall_to_target_s", "wall_to_target_interp_s",
                    "cpu_ms", "to_last_bucket_ms", "after_backward_ms")
            for key in keys:
                entry[key] = _mean([r.get(key) for r in mine])
            entry["reached"] = sum(r["steps_to_target"] is not None for r in mine)
            rel = [r["final_loss"] / reference[r["seed"]] - 1 for r in mine
                   if r["seed"] in reference]
            entry["final_vs_ref"] = _mean(rel) if rel else None
            for key in ("wall_to_target_s", "wall_to_target_interp_s"):
                ratios = [fp16[r["seed"]][key] / r[key]
                          if r["seed"] in fp16 and r[key] and fp16[r["seed"]].get(key) else None
                          for r in mine]
                entry[f"speedup_vs_fp16_{key.removeprefix('wall_to_target_')}"] = _mean(ratios)
        summary[hook] = entry
    return summary


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def render_markdown(result: dict[str, Any]) -> str:
    """The summary as a markdown table (means over the seeds), and what it was run on."""
    prov = result["provenance"]
    peer = ("vs 16-bit peer" if any(family(h) == "fsdp2" for h in result["summary"])
            else "vs fp16 hook")
    lines = ["| hook | step (ms) | final held-out loss | vs fp32 | steps to target | "
             f"wall to target (s) | {peer} | MB/step | vNMSE |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for entry in result["summary"].values():
        if "median_ms" not in entry:
            lines.append(f"| {entry['label']} | failed: {'; '.join(entry['failed'])} |"
                         + " |" * 7)
            continue
        reached = f" ({entry['reached']}/{len(entry['seeds'])})" if entry["reached"] < len(
            entry["seeds"]) else ""
        lines.append(
            f"| {entry['label']} | {_fmt(entry['median_ms'], '.0f')} | "
            f"{_fmt(entry['final_loss'], '.4f')} | {_fmt(entry['final_vs_ref'], '+.2f', 100)} % | "
            f"{_fmt(entry['steps_to_target'], '.0f')}{reached} | "
            f"{_fmt(entry['wall_to_target_interp_s'], '.1f')} | "
            f"{_fmt(entry['speedup_vs_fp16_interp_s'], '.2f')}x | "
            f"{_fmt(entry['bytes_per_step'], '.2f', 1e-6)} | {_fmt(entry['vnmse'], '.2e')} |")
    split = [e for e in result["summary"].values() if e.get("cpu_ms") is not None]
    if split:
        lines += ["", "| hook | step (ms) | to the last bucket (ms) | after it (ms) | "
                  "CPU per rank (ms) |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {e['label']} | {_fmt(e['median_ms'], '.0f')} | "
                  f"{_fmt(e.get('to_last_bucket_ms'), '.0f')} | "
                  f"{_fmt(e.get('after_backward_ms'), '.0f')} | {_fmt(e['cpu_ms'], '.0f')} |"
                  for e in split]
    seeds = sorted({s for e in result["summary"].values() for s in e["seeds"]})
    lines += ["", f"{prov['params'] / 1e6:.1f} M parameters, {prov['world_size']} ranks, link "
              f"{prov['link']}" + (f" (tc rate {prov['link_rate_tc']})"
                                   if prov.get("link_rate_tc") else "")
              + f", {prov['steps']} steps, seeds {seeds}; means over the seeds. Commit "
              f"{prov['commit']}; {prov['device']}; torch {prov['torch_version']}."]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str | Path) -> bool:
    """Held-out loss against wall-clock, a colour per hook and a line per seed; a second panel
    zooms on the end, with each seed's target. False where matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in result["runs"] if r.get("status") == "ok"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    present = {r["hook"] for r in ok}
    # a colour per hook, the same in every plot; variants after the named hooks
    for i, hook in enumerate([*HOOKS, *sorted(present - set(HOOKS))]):
        if hook not in present:
            continue
        for j, run in enumerate(r for r in ok if r["hook"] == hook):
            xs = [p["wall_s"] for p in run["curve"]]
            ys = [p["loss"] for p in run["curve"]]
            for ax in axes:
                ax.plot(xs, ys, color=colours[i % len(colours)], marker=".", linewidth=1,
                        alpha=0.85, label=hook_label(hook) if j == 0 else None)
    targets = sorted({r["target"] for r in ok if r.get("target")})
    finals = [r["final_loss"] for r in ok]
    for target in targets:
        axes[1].axhline(target, color="grey", linestyle="--", linewidth=0.8)
    if finals:
        low = min(finals + targets)
        axes[1].set_ylim(low * 0.99, max(targets or finals) * 1.08)
    prov = result["provenance"]
    for ax in axes:
        ax.set_xlabel("training wall-clock (s, evaluations excluded)")
        ax.set_ylabel("held-out loss (nats/byte)")
        ax.grid(alpha=0.3)
    axes[0].set_title(f"{prov['params'] / 1e6:.1f} M-param decoder on stdlib source, "
                      f"{prov['world_size']} ranks, {prov['link']}", fontsize=10)
    axes[1].set_title("the end; dashed: each seed's target (fp32 final + 1 %)", fontsize=10)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- ranks -----------------------------------------------------------------------------------


def link_rate_tc() -> str | None:
    """The tbf rate on this rank's interface (``GLOO_SOCKET_IFNAME``), as ``tc`` shows it: the
    emulated cluster's link; None on loopback or where ``tc`` cannot tell."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if not ifname or ifname == "lo":
        return None
    try:
        text = subprocess.run(["tc", "qdisc", "show", "dev", ifname], capture_output=True,
                              text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"\brate (\S+)", text)
    return match.group(1) if match else None


def provenance(args: argparse.Namespace, world_size: int, params: int,
               corpus: Corpus) -> dict[str, Any]:
    import numba

    import dqcoll

    return {
        "commit": git_commit("benchmarks"),
        "command": "python benchmarks/tta.py " + shlex.join(args.argv),
        "device": device_name("cpu"),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "numba_version": numba.__version__,
        "dqcoll_version": dqcoll.__version__,
        "backend": "gloo",
        "world_size": world_size,
        "link": args.link,
        "link_rate_tc": link_rate_tc(),
        "topology": args.topology,
        "note": args.note,
        "model": (f"TinyLM: GPT-style decoder, width {args.model_width}, {args.layers} layers, "
                  f"{args.heads or max(1, args.model_width // 64)} heads, context "
                  f"{args.seq_len}, tied byte embedding"),
        "params": params,
        "corpus": corpus.describe(),
        "batch_per_rank": args.batch,
        "seq_len": args.seq_len,
        "tokens_per_step": args.batch * args.seq_len * world_size,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "eval_windows": args.eval_windows,
        "optimizer": (f"AdamW lr {args.lr:g} betas (0.9, 0.95) wd 0.01, warm-up 10 %, cosine "
                      f"to 0.1, clip {args.clip:g}"),
        "bucket_cap_mb": BUCKET_CAP_MB,
        "threads_per_rank": torch.get_num_threads(),
        "hooks": args.hooks,
        "seeds": args.seeds,
        "target": (f"held-out loss <= (1 + {TARGET_TOLERANCE:g}) x the final of the family "
                   f"reference's run (DDP: {REFERENCES['ddp']}, FSDP2: {REFERENCES['fsdp2']})"),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def _write(args: argparse.Namespace, prov: dict[str, Any], runs: list[dict[str, Any]],
           final: bool) -> dict[str, Any]:
    result = {"provenance": prov, "summary": summarize(runs), "runs": runs}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    if final:
        png = Path(args.png) if args.png else path.with_suffix(".png")
        drawn = plot(result, png)
        print(f"# wrote {path}" + (f" and {png}" if drawn else " (no PNG: matplotlib missing)"),
              flush=True)
    return result


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[-1][:200] if lines else ''}"


def run_rank(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    corpus = load_corpus()
    windows = heldout_windows(corpus, args.eval_windows, args.seq_len)
    params = sum(p.numel() for p in build_model(args, 0).parameters())
    prov = provenance(args, world_size, params, corpus)
    warm_up_schemes(args.hooks, world_size)
    if rank == 0:
        print(f"# tta: {params / 1e6:.2f} M params, {world_size} ranks, link {args.link}, "
              f"{args.steps} steps, hooks {args.hooks}, seeds {args.seeds}", flush=True)
    runs: list[dict[str, Any]] = []
    broken = False
    for k, seed in enumerate(args.seeds):
        shift = k % len(args.hooks)
        for hook in args.hooks[shift:] + args.hooks[:shift]:
            entry: dict[str, Any] = {"hook": hook, "label": hook_label(hook), "seed": seed}
            if broken:
                entry["status"] = "not run: the process group failed in an earlier run"
            else:
                try:
                    entry = run_one(hook, seed, corpus, windows, args, rank, world_size)
                except HookUnavailable as exc:
                    entry["status"] = f"not available: {exc}"
                except Exception as exc:
                    entry["status"] = f"crashed: {_first_line(exc)}"
                flag = torch.tensor([0 if entry["status"].startswith("crashed") else 1],
                                    dtype=torch.int32)
                try:
                    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                    if not flag.item() and not entry["status"].startswith("crashed"):
                        entry = {"hook": hook, "label": hook_label(hook), "seed": seed,
                                 "status": "crashed on another rank"}
                except Exception as exc:
                    broken = True
                    entry = {"hook": hook, "label": hook_label(hook), "seed": seed,
                             "status": f"crashed: {_first_line(exc)}"}
            runs.append(entry)
            if rank == 0:
                _print_run(entry)
                _write(args, prov, runs, final=False)
    if rank == 0:
        result = _write(args, prov, runs, final=True)
        print(render_markdown(result), flush=True)
    if not broken:
        dist.barrier()
    dist.destroy_process_group()
    return 0


def _print_run(entry: dict[str, Any]) -> None:
    head = f"seed {entry['seed']} {entry['label']:<40}"
    if entry.get("status") != "ok":
        print(head + entry.get("status", "?"), flush=True)
        return
    print(f"{head} loss {entry['initial_loss']:.4f} -> {entry['final_loss']:.4f}, step "
          f"{entry['median_ms']:.0f} ms, train {entry['wall_s']:.1f} s, "
          f"{entry['bytes_per_step'] / 1e6:.2f} MB/step, vNMSE {entry['vnmse']:.2e}",
          flush=True)


# -- command line ----------------------------------------------------------------------------


def _names(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tta.py", description=__doc__.split("\n")[0])
    p.add_argument("-n", "--world-size", type=int, default=4,
                   help="ranks to spawn here (ignored under --launcher env)")
    p.add_argument("--hooks", type=_names, default=list(DDP_HOOKS),
                   help=f"comma-separated from {list(HOOKS)}, or {VARIANT}<policy> / "
                        f"{FSDP2_VARIANT}<policy> (a DQCOLL_POLICY text over the defaults, ';' "
                        f"between its keys); default: DDP's")
    p.add_argument("--seeds", type=lambda t: [int(s) for s in _names(t)], default=[0, 1, 2],
                   help="comma-separated; each seed: every hook from the same init and data")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-windows", type=int, default=128, help="held-out windows per eval")
    p.add_argument("--model-width", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=0, help="default: width / 64")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="windows per rank and step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0: none)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--link", default="", help="label of the network (default: loopback)")
    p.add_argument("--topology", default="", help="how the network is built (recorded)")
    p.add_argument("--note", default="", help="recorded with the results (machine state)")
    p.add_argument("--json", default="", metavar="FILE",
                   help="default: benchmarks/results/tta-<link>-<ranks>.json")
    p.add_argument("--png", default="", metavar="FILE", help="default: beside the JSON")
    p.add_argument("--timeout-s", type=float, default=600.0, help="gloo timeout per collective")
    p.add_argument("--launcher", default="auto", choices=("auto", "spawn", "env"))
    p.add_argument("--render", default="", metavar="FILE",
                   help="print a result file's table as markdown, redraw its PNG, and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    if args.render:
        result = json.loads(Path(args.render).read_text())
        result["summary"] = summarize(result["runs"])
        print(render_markdown(result))
        png = Path(args.png) if args.png else Path(args.render).with_suffix(".png")
        if plot(result, png):
            print(f"# wrote {png}")
        return 0
    unknown = [h for h in args.hooks if not known_hook(h)]
    if unknown or not args.hooks:
        parser.error(f"unknown hooks {unknown}; choose from {list(HOOKS)}, {VARIANT}<policy> "
                     f"or {FSDP2_VARIANT}<policy>")
    if not args.seeds or args.steps < 1 or args.eval_every < 1 or args.eval_windows < 1:
        parser.error("--seeds needs one seed or more; --steps, --eval-every and --eval-windows "
                     "must be >= 1")
    launcher = args.launcher
    if launcher == "auto":
        launcher = "env" if "RANK" in os.environ and "WORLD_SIZE" in os.environ else "spawn"
    if launcher == "env":
        args.link = args.link or "env://"
        world = int(os.environ.get("WORLD_SIZE", "0"))
        args.json = args.json or str(ROOT / "benchmarks" / "results"
                                     / f"tta-{re.sub(r'[^A-Za-z0-9]+', '', args.link)}-"
                                       f"{world}.json")
        return run_rank(args)
    if args.world_size < 2:
        parser.error(f"-n must be >= 2 (an all-reduce needs peers), got {args.world_size}")
    if not args.link:
        argv = [*argv, "--link", "loopback"]
    if not args.topology:
        argv = [*argv, "--topology", f"1 host, {args.world_size} processes, gloo over lo"]
    return spawn(argv, args.world_size, timeout_s=math.inf, script=__file__)


if __name__ == "__main__":
    sys.exit(main())
