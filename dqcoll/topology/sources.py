"""Gradient sources: one tensor per rank, deterministic per (spec, seed, rank).

The data the simulator (:mod:`.simulator`) runs the codecs on: ``dqcoll tune`` checks each
configuration's error on a source (``--source``, default ``lognormal-mixture``) and ``dqcoll
simulate`` reports the vNMSE of one configuration on one. A source is named by a spec string::

    kind[:key=value[;key=value...]]        values may be comma-separated lists

and built with::

    from dqcoll.topology.sources import make_source
    src = make_source("lognormal-mixture:supergroups=4096", world_size=8, numel=None, seed=0)
    x3 = src.rank_tensor(3)           # fp32, 1-D, src.numel long; same bytes on every call
    exact = src.exact_sum()           # fp64 sum over the ranks (the reference for vNMSE)

Kinds here (``list_sources()``; defaults in brackets) are the synthetic ones and the user's own
saved gradients. The evaluation package beside the runtime (``dqcoll_lab.eval.sources``)
registers two more with :func:`register_source` when it is imported, real gradients of models it
trains (``stdlib-lm``, ``minilm``); the runtime never imports it, so ``dqcoll tune`` and
``dqcoll simulate`` know only the kinds below.

``gaussian:std=[1];mean=[0];shared=[0]``
    every coordinate of every rank ``mean + std * (sqrt(shared) z + sqrt(1 - shared) e_rank)``,
    ``z`` common to all ranks and ``e_rank`` private, both N(0, 1). ``shared`` is the correlation
    between ranks (0: independent workers; real data-parallel gradients sit in between).
    Length ``numel`` [2**20].
``lognormal-mixture:weights=[0.79,0.21];mu=[-3.99,-16.41];sigma=[1.22,4.63];supergroups=[4096];dof=[0];sparsity=[0];noise=[counter]``
    super-groups of 256 coordinates. Each super-group's magnitude ``M`` is drawn once, shared by
    all ranks, from the mixture of log-normals (natural log: ``log M ~ N(mu_k, sigma_k^2)`` with
    probability ``weights_k``); each rank's 256 coordinates are i.i.d. N(0, (M / 16)^2), so a
    super-group's expected squared norm is ``M^2``. The defaults fit the super-group norms of
    LLM gradients: most super-groups moderate, a fifth nearly zero over many decades (skew is what
    variable bit widths exploit). Length ``supergroups * 256`` (or ``numel`` if given, which must
    not be longer). ``dof > 0``: Student-t coordinates of that many degrees of freedom instead
    of normal ones (heavier tails within groups); ``sparsity=p``: each rank's half super-groups
    (128 coordinates) are exactly zero with probability ``p`` each, independently per rank (as
    the embedding rows of tokens a rank's batch does not use). ``noise=counter`` (the default
    for normal, dense coordinates) draws the N(0, 1) values from a counter-based generator
    (:mod:`dqcoll.kernels.noise_numba`: a value is a function of (seed, rank, coordinate)), so
    any slice of any rank's tensor can be made on its own (:meth:`GradientSource.fill_rows`;
    the simulator needs that at large ``n``); ``noise=torch`` (the default, and the only
    choice, with ``dof`` or ``sparsity``) is the first version's ``torch.Generator`` stream per
    rank: the same distribution, other values (numbers recorded before the counter-based
    default, e.g. in docs/accuracy.md, were made with it).
``files:path=PATH`` (or ``files:PATH``)
    saved tensors, one file per rank: ``PATH`` is a directory (its ``.pt``/``.npy``/
    ``.safetensors`` files in sorted name order), a glob, or a template with ``{rank}``. A file
    may hold one tensor or several (a state dict / safetensors file: flattened and concatenated in
    sorted key order). Rank ``r`` reads the ``r``-th file; ``numel`` truncates.

Determinism: random draws use ``torch.Generator`` streams seeded from a hash of (seed, stream,
rank) (:func:`dqcoll.schemes.seeds.derived_seed`), so a rank's tensor does not depend on the world
size or on which other ranks were asked for (except ``shared`` parts, which depend on the seed
only).

Rejected: numpy ``RandomState`` (a second generator family to keep in step) and sources as
classes picked by ``isinstance`` chains (a registry keeps the commands' ``--help`` honest and
lets the lab add kinds without the runtime knowing them).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import glob
import math
import os
import pathlib
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError
from ..schemes.seeds import derived_seed

__all__ = [
    "SUPERGROUP",
    "GradientSource",
    "SourceEntry",
    "SourceSpec",
    "float_param",
    "float_params",
    "int_param",
    "list_sources",
    "load_tensor_file",
    "make_source",
    "parse_source_spec",
    "register_source",
    "source_generator",
]

SUPERGROUP = 256  # coordinates that share one magnitude in the lognormal-mixture source


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """A parsed spec string: ``kind`` and its ``key=value`` parameters (values as text)."""

    kind: str
    params: tuple[tuple[str, str], ...] = ()

    def get(self, key: str, default: str | None = None) -> str | None:
        return dict(self.params).get(key, default)

    def __str__(self) -> str:
        if not self.params:
            return self.kind
        return self.kind + ":" + ";".join(f"{k}={v}" for k, v in self.params)


def parse_source_spec(text: str) -> SourceSpec:
    """``"kind:a=1;b=2,3"`` -> ``SourceSpec("kind", (("a", "1"), ("b", "2,3")))``.

    A parameter text without ``=`` (``files:grads/``) is taken as ``path=...``.
    """
    if not isinstance(text, str) or not text.strip():
        raise InvalidArgumentError(f"source spec must be a non-empty string, got {text!r}")
    kind, _, rest = text.strip().partition(":")
    kind = kind.strip().lower()
    params: list[tuple[str, str]] = []
    if rest.strip():
        if "=" not in rest:
            params.append(("path", rest.strip()))
        else:
            for item in rest.split(";"):
                if not item.strip():
                    continue
                key, eq, value = item.partition("=")
                if not eq:
                    raise InvalidArgumentError(
                        f"source spec {text!r}: expected key=value, got {item!r}"
                    )
                params.append((key.strip().lower(), value.strip()))
    keys = [k for k, _ in params]
    if len(set(keys)) != len(keys):
        raise InvalidArgumentError(f"source spec {text!r}: repeated parameter in {keys}")
    return SourceSpec(kind, tuple(params))


class GradientSource(abc.ABC):
    """``world_size`` fp32 tensors of ``numel`` coordinates, one per rank."""

    def __init__(self, spec: SourceSpec, world_size: int, numel: int, seed: int) -> None:
        self.spec = spec
        self.world_size = world_size
        self.numel = numel
        self.seed = seed
        # Ranks of dqcoll.testing.run_local are threads that ask for their tensors at once; a
        # source may share state between ranks (stdlib-lm: one model whose .grad every rank's
        # backward writes), so tensors are made one at a time.
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return str(self.spec)

    @abc.abstractmethod
    def _make(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s tensor (fp32, 1-D, ``numel`` long)."""

    def rank_tensor(self, rank: int) -> torch.Tensor:
        if not 0 <= rank < self.world_size:
            raise InvalidArgumentError(
                f"source {self.name!r}: rank {rank} outside [0, {self.world_size})"
            )
        with self._lock:
            return self._make(rank)

    #: whether :meth:`fill_rows` can make a slice of a rank's tensor without the whole tensor
    row_access = False

    def fill_rows(self, ranks: np.ndarray, starts: np.ndarray, out: np.ndarray) -> None:
        """``out[i] = rank_tensor(ranks[i])[starts[i] : starts[i] + L]`` (fp32 ``[k, L]``), zero
        past ``numel``: the same values as :meth:`rank_tensor`, for sources with
        :attr:`row_access` without making the whole tensor (this default makes it, per
        distinct rank)."""
        length = out.shape[1]
        for rank in np.unique(ranks):
            x = self.rank_tensor(int(rank)).numpy()
            for i in np.flatnonzero(ranks == rank):
                a = int(starts[i])
                part = x[a : a + length]
                out[i, : part.shape[0]] = part
                out[i, part.shape[0] :] = 0.0

    def tensors(self) -> list[torch.Tensor]:
        return [self.rank_tensor(r) for r in range(self.world_size)]

    def exact_sum(self) -> torch.Tensor:
        """The fp64 sum over all ranks: the reference an all-reduce is measured against."""
        total = torch.zeros(self.numel, dtype=torch.float64)
        for r in range(self.world_size):
            total += self.rank_tensor(r).double()
        return total

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name!r}, world_size={self.world_size}, "
                f"numel={self.numel}, seed={self.seed})")


# -- parameter helpers (public: the lab's sources parse their specs with them) -------------------


def float_params(spec: SourceSpec, key: str, default: str) -> list[float]:
    """The comma-separated numbers of parameter ``key`` (``default`` when it is absent)."""
    text = spec.get(key, default) or default
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InvalidArgumentError(
            f"source {spec.kind!r}: {key} must be numbers, got {text!r}"
        ) from None


def float_param(spec: SourceSpec, key: str, default: float) -> float:
    """Parameter ``key`` as one number."""
    values = float_params(spec, key, repr(default))
    if len(values) != 1:
        raise InvalidArgumentError(f"source {spec.kind!r}: {key} takes one number, got {values}")
    return values[0]


def int_param(spec: SourceSpec, key: str, default: int) -> int:
    """Parameter ``key`` as a whole number >= 0."""
    value = float_param(spec, key, default)
    if value != int(value) or value < 0:
        raise InvalidArgumentError(
            f"source {spec.kind!r}: {key} must be a whole number >= 0, got {value}"
        )
    return int(value)


def source_generator(*parts: object) -> torch.Generator:
    """A ``torch.Generator`` seeded from a hash of ``parts`` (e.g. seed, stream name, rank)."""
    return torch.Generator().manual_seed(derived_seed(*parts))


# -- gaussian -------------------------------------------------------------------------------------


class GaussianSource(GradientSource):
    def __init__(self, spec: SourceSpec, world_size: int, numel: int | None, seed: int) -> None:
        super().__init__(spec, world_size, numel if numel is not None else 1 << 20, seed)
        self.std = float_param(spec, "std", 1.0)
        self.mean = float_param(spec, "mean", 0.0)
        self.shared = float_param(spec, "shared", 0.0)
        if not 0.0 <= self.shared <= 1.0:
            raise InvalidArgumentError(
                f"source 'gaussian': shared must be in [0, 1], got {self.shared}"
            )

    @functools.cached_property
    def _common(self) -> torch.Tensor:
        return torch.randn(self.numel, generator=source_generator(self.seed, "gaussian-shared"))

    def _make(self, rank: int) -> torch.Tensor:
        own = torch.randn(self.numel, generator=source_generator(self.seed, "gaussian", rank))
        if self.shared > 0.0:
            own = math.sqrt(1.0 - self.shared) * own + math.sqrt(self.shared) * self._common
        return own * self.std + self.mean


# -- log-normal mixture of super-group magnitudes --------------------------------------------------


class LognormalMixtureSource(GradientSource):
    def __init__(self, spec: SourceSpec, world_size: int, numel: int | None, seed: int) -> None:
        weights = float_params(spec, "weights", "0.79,0.21")
        mu = float_params(spec, "mu", "-3.99,-16.41")
        sigma = float_params(spec, "sigma", "1.22,4.63")
        if not (len(weights) == len(mu) == len(sigma)) or not weights:
            raise InvalidArgumentError(
                f"source 'lognormal-mixture': weights, mu and sigma need the same length, got "
                f"{len(weights)}, {len(mu)}, {len(sigma)}"
            )
        if min(weights) < 0 or sum(weights) <= 0 or min(sigma) < 0:
            raise InvalidArgumentError(
                f"source 'lognormal-mixture': weights must be >= 0 with a positive sum and sigma "
                f">= 0, got weights={weights}, sigma={sigma}"
            )
        default_groups = 4096 if numel is None else -(-numel // SUPERGROUP)
        groups = int_param(spec, "supergroups", default_groups)
        length = groups * SUPERGROUP if numel is None else numel
        if length > groups * SUPERGROUP or groups == 0:
            raise InvalidArgumentError(
                f"source 'lognormal-mixture': numel={length} does not fit {groups} super-groups "
                f"of {SUPERGROUP}"
            )
        super().__init__(spec, world_size, length, seed)
        total = sum(weights)
        self.weights = [w / total for w in weights]
        self.mu, self.sigma, self.supergroups = mu, sigma, groups
        self.dof = float_param(spec, "dof", 0.0)
        self.sparsity = float_param(spec, "sparsity", 0.0)
        if self.dof < 0 or not 0.0 <= self.sparsity < 1.0:
            raise InvalidArgumentError(
                f"source 'lognormal-mixture': dof must be >= 0 and sparsity in [0, 1), got "
                f"dof={self.dof}, sparsity={self.sparsity}")
        plain = self.dof == 0 and self.sparsity == 0
        self.noise = (spec.get("noise") or ("counter" if plain else "torch")).lower()
        if self.noise not in ("counter", "torch"):
            raise InvalidArgumentError(
                f"source 'lognormal-mixture': noise must be 'counter' or 'torch', got "
                f"{self.noise!r}")
        if self.noise == "counter" and not plain:
            raise InvalidArgumentError(
                "source 'lognormal-mixture': noise=counter draws normal, dense coordinates; "
                "dof and sparsity take noise=torch")
        self.row_access = self.noise == "counter"

    @functools.cached_property
    def magnitudes(self) -> torch.Tensor:
        """fp64 magnitude ``M`` of each super-group, shared by every rank."""
        g = source_generator(self.seed, "lognormal-mixture-magnitudes")
        component = torch.multinomial(torch.tensor(self.weights, dtype=torch.float64),
                                      self.supergroups, replacement=True, generator=g)
        normal = torch.randn(self.supergroups, generator=g, dtype=torch.float64)
        mu = torch.tensor(self.mu, dtype=torch.float64)[component]
        sigma = torch.tensor(self.sigma, dtype=torch.float64)[component]
        return torch.exp(mu + sigma * normal)

    @functools.cached_property
    def _scale(self) -> np.ndarray:
        """fp64 ``M / 16`` per super-group: the standard deviation of its coordinates."""
        return (self.magnitudes / math.sqrt(SUPERGROUP)).numpy()

    def stream_key(self, rank: int) -> int:
        """The counter-based generator's key of ``rank`` (``noise=counter``)."""
        return derived_seed(self.seed, "lognormal-mixture-noise", rank)

    @functools.cached_property
    def _keys(self) -> np.ndarray:
        return np.array([self.stream_key(r) for r in range(self.world_size)], dtype=np.uint64)

    def fill_rows(self, ranks: np.ndarray, starts: np.ndarray, out: np.ndarray) -> None:
        if self.noise != "counter":
            super().fill_rows(ranks, starts, out)
            return
        from ..kernels import noise_numba

        ranks = np.asarray(ranks, dtype=np.int64)
        if ranks.size and (ranks.min() < 0 or ranks.max() >= self.world_size):
            raise InvalidArgumentError(
                f"source {self.name!r}: ranks outside [0, {self.world_size})")
        noise_numba.fill(self._keys[ranks], np.asarray(starts, dtype=np.int64), self.numel,
                         self._scale, out)

    def _make(self, rank: int) -> torch.Tensor:
        if self.noise == "counter":
            out = np.empty((1, self.numel), dtype=np.float32)
            self.fill_rows(np.array([rank]), np.zeros(1, dtype=np.int64), out)
            return torch.from_numpy(out[0])
        g = source_generator(self.seed, "lognormal-mixture", rank)
        noise = torch.randn(self.supergroups, SUPERGROUP, generator=g, dtype=torch.float64)
        if self.dof > 0:  # Student-t: a normal over the root of a chi-square / dof per coordinate
            chi2 = 2.0 * torch._standard_gamma(torch.full_like(noise, self.dof / 2.0), generator=g)
            noise = noise / torch.sqrt(chi2 / self.dof)
        if self.sparsity > 0:  # each half super-group of this rank zero with this probability
            halves = torch.rand(self.supergroups, 2, generator=g, dtype=torch.float64)
            keep = (halves >= self.sparsity).repeat_interleave(SUPERGROUP // 2, dim=1)
            noise = noise * keep
        values = noise * (self.magnitudes / math.sqrt(SUPERGROUP))[:, None]
        return values.reshape(-1)[: self.numel].float()


# -- saved tensors --------------------------------------------------------------------------------

_FILE_SUFFIXES = (".pt", ".pth", ".npy", ".safetensors")


def load_tensor_file(path: str | os.PathLike[str]) -> torch.Tensor:
    """One fp32 1-D tensor from a .pt/.pth, .npy or .safetensors file (several tensors: sorted
    keys, flattened and concatenated)."""
    path = pathlib.Path(path)
    suffix = path.suffix.lower()
    obj: Any
    if suffix in (".pt", ".pth"):
        obj = torch.load(path, map_location="cpu", weights_only=True)
    elif suffix == ".npy":
        import numpy as np

        obj = torch.from_numpy(np.load(path, allow_pickle=False))
    elif suffix == ".safetensors":
        from safetensors.torch import load_file

        obj = load_file(str(path))
    else:
        raise InvalidArgumentError(
            f"{path}: unsupported suffix {suffix!r}; expected {_FILE_SUFFIXES}"
        )
    if isinstance(obj, dict):
        parts = [obj[k] for k in sorted(obj)]
        if not parts or not all(isinstance(p, torch.Tensor) for p in parts):
            raise InvalidArgumentError(f"{path}: expected tensors, got keys {sorted(obj)}")
        return torch.cat([p.detach().reshape(-1).float() for p in parts])
    if not isinstance(obj, torch.Tensor):
        raise InvalidArgumentError(
            f"{path}: expected a tensor or a dict of tensors, got {type(obj)}"
        )
    return obj.detach().reshape(-1).float()


class FileSource(GradientSource):
    def __init__(self, spec: SourceSpec, world_size: int, numel: int | None, seed: int) -> None:
        pattern = spec.get("path")
        if not pattern:
            raise InvalidArgumentError("source 'files' needs a path: files:path=DIR|GLOB|TEMPLATE")
        if "{rank}" in pattern:
            paths = [pattern.format(rank=r) for r in range(world_size)]
        elif os.path.isdir(pattern):
            paths = sorted(str(p) for p in pathlib.Path(pattern).iterdir()
                           if p.suffix.lower() in _FILE_SUFFIXES)
        else:
            paths = sorted(glob.glob(pattern))
        if len(paths) < world_size:
            raise InvalidArgumentError(
                f"source 'files': {pattern!r} gives {len(paths)} files, need one per rank "
                f"({world_size})"
            )
        self.paths = paths[:world_size]
        for p in self.paths:
            if not os.path.isfile(p):
                raise InvalidArgumentError(f"source 'files': {p} does not exist")
        first = load_tensor_file(self.paths[0])
        length = first.numel() if numel is None else numel
        if length > first.numel():
            raise InvalidArgumentError(
                f"source 'files': numel={length} is longer than {self.paths[0]} ({first.numel()})"
            )
        super().__init__(spec, world_size, length, seed)

    def _make(self, rank: int) -> torch.Tensor:
        values = load_tensor_file(self.paths[rank])
        if values.numel() < self.numel:
            raise InvalidArgumentError(
                f"source 'files': {self.paths[rank]} has {values.numel()} values, rank 0's file "
                f"{self.numel}"
            )
        return values[: self.numel].contiguous()


# -- registry -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SourceEntry:
    """A registered kind: its name, its factory, the parameters it takes and one line on it."""

    kind: str
    factory: Callable[[SourceSpec, int, int | None, int], GradientSource]
    params: tuple[str, ...]
    description: str


_REGISTRY: dict[str, SourceEntry] = {}


def register_source(entry: SourceEntry) -> None:
    """Add a kind to the registry (a kind registers once)."""
    if entry.kind in _REGISTRY:
        raise InvalidArgumentError(f"source {entry.kind!r} is already registered")
    _REGISTRY[entry.kind] = entry


def list_sources() -> list[SourceEntry]:
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def make_source(spec: str | SourceSpec, *, world_size: int, numel: int | None = None,
                seed: int = 0) -> GradientSource:
    """Build a source from a spec string (see the module docstring)."""
    parsed = spec if isinstance(spec, SourceSpec) else parse_source_spec(spec)
    if parsed.kind not in _REGISTRY:
        raise InvalidArgumentError(
            f"unknown gradient source {parsed.kind!r}; registered: {sorted(_REGISTRY)} (the "
            f"sources made from models, stdlib-lm and minilm, are the lab's: importing "
            f"dqcoll_lab.eval.sources registers them)"
        )
    entry = _REGISTRY[parsed.kind]
    unknown = sorted({k for k, _ in parsed.params} - set(entry.params))
    if unknown:
        raise InvalidArgumentError(
            f"source {parsed.kind!r} does not take {unknown}; "
            f"its parameters are {list(entry.params)}"
        )
    if world_size < 1:
        raise InvalidArgumentError(f"world_size must be >= 1, got {world_size}")
    if numel is not None and numel < 1:
        raise InvalidArgumentError(f"numel must be >= 1 or None, got {numel}")
    return entry.factory(parsed, int(world_size), numel, int(seed))


for _entry in (
    SourceEntry("gaussian", GaussianSource, ("std", "mean", "shared"),
                "i.i.d. normal coordinates, optionally correlated across ranks"),
    SourceEntry("lognormal-mixture", LognormalMixtureSource,
                ("weights", "mu", "sigma", "supergroups", "dof", "sparsity", "noise"),
                "super-group magnitudes from a log-normal mixture, shared by all ranks"),
    SourceEntry("files", FileSource, ("path",), "saved tensors, one file per rank"),
):
    register_source(_entry)
del _entry
