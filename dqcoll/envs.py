"""Every ``DQCOLL_*`` environment variable, typed and documented in one place.

Nothing else in dqcoll reads ``os.environ`` for its own settings (the torchrun variables
``RANK``/``WORLD_SIZE``/... are read where a rendezvous needs them, in :mod:`dqcoll.comm`;
torchrun's ``LOCAL_WORLD_SIZE`` for the integrations' node layout through
:func:`local_world_size`).
Values are read at call time, so tests can monkeypatch them.
"""

from __future__ import annotations

import os

__all__ = [
    "ENV_VARS",
    "cpu_threads",
    "kernels",
    "local_world_size",
    "log_level",
    "policy",
    "timeout_s",
    "tuning_dir",
    "validate",
]

# name -> (default, description)
ENV_VARS: dict[str, tuple[str, str]] = {
    "DQCOLL_TIMEOUT_S": (
        "300",
        "Seconds any distributed wait may block before raising CollectiveTimeoutError.",
    ),
    "DQCOLL_KERNELS": (
        "auto",
        "auto | torch | triton | numba. auto uses Triton for CUDA tensors and the compiled numba "
        "kernels for CPU tensors when they are importable, the torch reference otherwise (with a "
        "log line saying why); an explicit choice that cannot be honoured raises.",
    ),
    "DQCOLL_CPU_THREADS": (
        "",
        "Threads each rank's compiled CPU kernels use. Empty: the machine's cores divided by the "
        "ranks sharing this machine (LOCAL_WORLD_SIZE, or the ranks of an in-process group), at "
        "least 1. Results do not depend on it.",
    ),
    "DQCOLL_VALIDATE": (
        "1",
        "1: every collective first checks, with one tiny all-reduce, that all ranks passed "
        "matching arguments (length, dtype, scheme, ...) and valid inputs. 0 skips it (saves one "
        "latency).",
    ),
    "DQCOLL_LOG_LEVEL": ("WARNING", "Log level of the 'dqcoll' logger."),
    "DQCOLL_POLICY": (
        "",
        "Per-role compression policy of the FSDP2 classes and of the 'dqcoll' torch.distributed "
        "backend (dqcoll.integrations.policy): comma-separated key=value, e.g. "
        "'weights=int8_block,gradients=dynamiq:5,allreduce=dynamiq:5,min_nbytes=65536,"
        "warmup_steps=0,intra_node=exact'. A role set to 'none' runs the wrapped process "
        "group's own exact collective. Empty: the documented defaults.",
    ),
    "DQCOLL_TUNING_DIR": (
        "",
        "Extra directory searched for tuned algorithm tables before the packaged ones.",
    ),
}


def _get(name: str) -> str:
    return os.environ.get(name, ENV_VARS[name][0])


def timeout_s() -> float:
    value = float(_get("DQCOLL_TIMEOUT_S"))
    if value <= 0:
        raise ValueError(f"DQCOLL_TIMEOUT_S must be positive, got {value}")
    return value


KERNEL_CHOICES = ("auto", "torch", "triton", "numba")


def kernels() -> str:
    value = _get("DQCOLL_KERNELS").strip().lower()
    if value not in KERNEL_CHOICES:
        raise ValueError(
            f"DQCOLL_KERNELS must be one of {', '.join(KERNEL_CHOICES)}, got {value!r}")
    return value


def cpu_threads() -> int | None:
    """The DQCOLL_CPU_THREADS setting, or None for the default (see ENV_VARS)."""
    value = _get("DQCOLL_CPU_THREADS").strip()
    if not value:
        return None
    try:
        threads = int(value)
    except ValueError:
        raise ValueError(f"DQCOLL_CPU_THREADS must be a positive integer, got {value!r}") from None
    if threads < 1:
        raise ValueError(f"DQCOLL_CPU_THREADS must be a positive integer, got {value!r}")
    return threads


def validate() -> bool:
    return _get("DQCOLL_VALIDATE").strip() not in ("0", "false", "no", "off")


def log_level() -> str:
    return _get("DQCOLL_LOG_LEVEL").upper()


def tuning_dir() -> str:
    return _get("DQCOLL_TUNING_DIR")


def policy() -> str:
    """The DQCOLL_POLICY text (parsed by :meth:`dqcoll.integrations.policy.CompressionPolicy
    .parse`); empty for the defaults."""
    return _get("DQCOLL_POLICY").strip()


def local_world_size() -> int | None:
    """torchrun's ``LOCAL_WORLD_SIZE`` (ranks on this machine), or None when unset or not a
    positive integer. Not a dqcoll setting: the node layout of
    :meth:`dqcoll.integrations.policy.CompressionPolicy.nodes` when the policy gives none."""
    text = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None
