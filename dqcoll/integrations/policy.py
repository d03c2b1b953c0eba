"""Which collectives are compressed, with which scheme and bits: :class:`CompressionPolicy`.

One :class:`RoleRule` per :class:`Role`, as ZeRO++ does; the text form is ``DQCOLL_POLICY``
(docs/fsdp.md, "The policy"). One scheme for every role was rejected: the weights' all-gather sums
nothing, so a deterministic block format with a cheaper codec wins.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import torch

from .. import envs, schemes
from ..errors import InvalidArgumentError

__all__ = ["CompressionPolicy", "Decision", "Role", "RoleRule"]

# Below 64 KiB the argument check's and statistics' round trips cost more than the bytes saved.
DEFAULT_MIN_NBYTES = 64 * 1024
INTRA_NODE_CHOICES = ("exact", "flat")


class Role(enum.Enum):
    """The collective's part in training."""

    WEIGHTS = "weights"  # all-gather of parameters
    GRADIENTS = "gradients"  # reduce-scatter of gradients
    ALLREDUCE = "allreduce"  # all-reduce (DDP buckets, anything else through the backend)


@dataclasses.dataclass(frozen=True)
class RoleRule:
    """The scheme and bits (or error target) of one role; ``scheme="none"`` is the exact
    wrapped collective, ``"auto"`` the planner's choice per call (dynamiq's options)."""

    scheme: str
    bits: float | None = None  # None: the scheme's default (schemes without bits ignore it)
    target: float | None = None  # target vNMSE instead of fixed bits (an error model's scheme)

    @property
    def spec(self) -> Any:
        """The scheme's spec (``auto``: dynamiq's, whose options the planner's calls take)."""
        return schemes.spec("dynamiq" if self.scheme == "auto" else self.scheme)

    def __post_init__(self) -> None:
        spec = self.spec  # an unknown name raises
        if self.target is not None and self.bits is not None:
            raise InvalidArgumentError(f"scheme {self.scheme!r}: bits or a target, not both")
        if self.target is not None and "target_vnmse" not in spec.options:
            raise InvalidArgumentError(
                f"a target vNMSE needs a scheme with an error model, not {self.scheme!r}")
        if self.bits is not None and "bits" not in spec.options:
            raise InvalidArgumentError(
                f"scheme {self.scheme!r} has a fixed format and takes no bits (got {self.bits})")
        for name, value, kind in (("target", self.target, "vNMSE"), ("bits", self.bits, "number")):
            if value is not None and (not math.isfinite(value) or value <= 0):
                raise InvalidArgumentError(
                    f"scheme {self.scheme!r}: {name} must be a finite positive {kind}, got {value}")
        if self.bits is not None:
            schemes.get(spec.name, bits=self.bits)  # refused now, not at the first call

    @property
    def is_exact(self) -> bool:
        return self.scheme == "none"

    def options(self) -> dict[str, Any]:
        """Keyword arguments for ``dqcoll.reduce_scatter`` / ``all_gather`` / ``allreduce``."""
        if self.target is not None:
            return {"scheme": self.scheme, "target_vnmse": self.target}
        return {"scheme": self.scheme, **({"bits": self.bits} if self.bits is not None else {})}

    def label(self) -> str:
        if self.target is not None:
            return f"{self.scheme}:target={self.target:g}"
        return self.scheme if self.bits is None else f"{self.scheme}:{self.bits:g}"

    @classmethod
    def parse(cls, text: str) -> RoleRule:
        name, _, rest = (part.strip() for part in text.partition(":"))
        try:
            if rest.startswith("target="):
                return cls(name, target=float(rest[len("target="):]))
            return cls(name, float(rest) if rest else None)
        except ValueError as exc:  # InvalidArgumentError is a ValueError too
            raise InvalidArgumentError(f"bad role rule {text!r}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class Decision:
    """Whether one call is compressed, and why not when it is not (logged once per reason)."""

    compress: bool
    reason: str = ""
    # exact only for its size: the backend checks such calls, another rank may compress
    by_size: bool = False


@dataclasses.dataclass(frozen=True)
class CompressionPolicy:
    """Per-role compression for sharded and data-parallel training (see the module docstring)."""

    weights: RoleRule = RoleRule("int8_block")
    gradients: RoleRule = RoleRule("dynamiq", 5.0)
    allreduce: RoleRule = RoleRule("dynamiq", 5.0)
    min_nbytes: int = DEFAULT_MIN_NBYTES  # smaller tensors take the exact path
    warmup_steps: int = 0  # the first steps are exact (the integrations count the steps)
    intra_node: str = "exact"  # "exact": two levels where local_world_size says; "flat": not
    local_world_size: int | None = None  # None: the planner decides the levels
    seed: int = 0  # keys the random rounding
    error_feedback: bool = False  # the DDP hook: a residual per bucket, added at the next step
    monitor_every: int = 0  # the DDP hook: every this many steps an exact average too (0: never)

    def __post_init__(self) -> None:
        for name in ("min_nbytes", "warmup_steps", "seed", "monitor_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(f"{name} must be a non-negative int, got {value!r}")
        if not isinstance(self.error_feedback, bool):
            raise InvalidArgumentError(
                f"error_feedback must be a bool, got {self.error_feedback!r}")
        if self.intra_node not in INTRA_NODE_CHOICES:
            raise InvalidArgumentError(
                f"intra_node must be one of {INTRA_NODE_CHOICES}, got {self.intra_node!r}")
        if self.local_world_size is not None and self.local_world_size < 1:
            raise InvalidArgumentError(
                f"local_world_size must be >= 1, got {self.local_world_size}")

    @classmethod
    def exact(cls) -> CompressionPolicy:
        """Every role exact: the wrapped process group's own collectives."""
        none = RoleRule("none")
        return cls(weights=none, gradients=none, allreduce=none)

    @classmethod
    def zeropp(cls, **overrides: Any) -> CompressionPolicy:
        """ZeRO++'s formats: weights in ``int8_block`` (qwZ), gradients in ``int4_block`` (qgZ),
        all-reduces at the default; less CPU, more error than ``dynamiq`` (docs/fsdp.md)."""
        return cls(**{"weights": RoleRule("int8_block"), "gradients": RoleRule("int4_block"),
                      **overrides})

    @classmethod
    def parse(cls, text: str, base: CompressionPolicy | None = None) -> CompressionPolicy:
        """The policy of a ``DQCOLL_POLICY`` string (a role's value: ``scheme``, ``scheme:bits``
        or ``scheme:target=v``); keys it leaves out keep ``base``'s values (default: defaults)."""
        fields: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = (part.strip() for part in item.partition("="))
            if not sep or not value:
                raise InvalidArgumentError(f"DQCOLL_POLICY: expected key=value, got {item!r}")
            if key in fields:
                raise InvalidArgumentError(f"DQCOLL_POLICY {text!r}: key {key!r} given twice")
            if key in ("weights", "gradients", "allreduce"):
                try:
                    fields[key] = RoleRule.parse(value)
                except InvalidArgumentError as exc:
                    raise InvalidArgumentError(f"DQCOLL_POLICY {text!r}: {key}: {exc}") from None
            elif key == "error_feedback":
                if value.lower() not in ("0", "1", "true", "false"):
                    raise InvalidArgumentError(
                        f"DQCOLL_POLICY: error_feedback must be 0, 1, true or false, got "
                        f"{value!r}")
                fields[key] = value.lower() in ("1", "true")
            elif key in ("min_nbytes", "warmup_steps", "seed", "local_world_size",
                         "monitor_every"):
                try:
                    fields[key] = int(value)
                except ValueError:
                    raise InvalidArgumentError(
                        f"DQCOLL_POLICY: {key} must be an integer, got {value!r}") from None
            elif key == "intra_node":
                fields[key] = value
            else:
                known = [f.name for f in dataclasses.fields(cls)]
                raise InvalidArgumentError(f"DQCOLL_POLICY: unknown key {key!r}; known: {known}")
        try:
            return dataclasses.replace(base, **fields) if base is not None else cls(**fields)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"DQCOLL_POLICY {text!r}: {exc}") from None

    @classmethod
    def from_env(cls) -> CompressionPolicy:
        """The policy of ``DQCOLL_POLICY`` (:mod:`dqcoll.envs`), the defaults when it is unset."""
        return cls.parse(envs.policy())

    def __str__(self) -> str:
        """The ``DQCOLL_POLICY`` text of every field (``local_world_size`` where set)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return ",".join(
            f"{k}={v.label() if isinstance(v, RoleRule) else int(v) if isinstance(v, bool) else v}"
            for k, v in values.items() if v is not None)

    def refuse_hook_only(self, integration: str) -> None:
        """Raise :class:`InvalidArgumentError` if the policy asks for the DDP hook's error feedback
        or monitor, which ``integration`` would ignore."""
        asked = [f"{key}={int(getattr(self, key))}" for key in ("error_feedback", "monitor_every")
                 if getattr(self, key)]
        if asked:
            raise InvalidArgumentError(
                f"{integration}: {', '.join(asked)} is the DDP hook's (DynamiqState); the "
                f"policy here takes roles, min_nbytes, warmup_steps, seed and levels")

    def rule(self, role: Role) -> RoleRule:
        return getattr(self, role.value)

    def nodes(self, world_size: int) -> int:
        """Ranks per node of a fixed two-level path, or 0 (the planner decides)."""
        local = self.local_world_size or 0
        flat = self.intra_node == "flat" or not 1 < local < world_size or world_size % local
        return 0 if flat else local

    def decide(self, role: Role, tensor: torch.Tensor, *, reducing_op_ok: bool = True,
               step: int = 0) -> Decision:
        """Compress this call? Depends only on what every rank passes alike, so every rank
        decides the same."""
        rule = self.rule(role)
        if rule.is_exact:
            return Decision(False, f"{role.value}: scheme none")
        if not reducing_op_ok:
            return Decision(False, f"{role.value}: reduce op other than SUM/AVG/PREMUL_SUM")
        if step < self.warmup_steps:
            return Decision(False, f"{role.value}: warm-up step")
        if tensor.dtype not in rule.spec.dtypes:
            return Decision(False, f"{role.value}: dtype {tensor.dtype} not taken by "
                                   f"{rule.scheme}")
        if tensor.device.type not in ("cpu", "cuda"):
            return Decision(False, f"{role.value}: {tensor.device.type} tensors are not "
                                   f"compressed by the integrations (cpu and cuda are)")
        if tensor.numel() * tensor.element_size() < self.min_nbytes:
            return Decision(False, f"{role.value}: below min_nbytes={self.min_nbytes}",
                            by_size=True)
        return Decision(True)
