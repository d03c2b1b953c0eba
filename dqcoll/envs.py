"""Every ``DQCOLL_*`` environment variable (:data:`ENV_VARS`), typed and documented in one place.

Nothing else in dqcoll reads ``os.environ`` for its own settings. Values are read and validated
at call time, not at import (tests and launchers set them later); a malformed one raises
:class:`~dqcoll.errors.InvalidArgumentError` naming the variable.
"""

from __future__ import annotations

import logging
import math
import os

from .errors import InvalidArgumentError

__all__ = [
    "ENV_VARS",
    "auto_force",
    "check_timeout_s",
    "cpu_threads",
    "kernels",
    "local_world_size",
    "log_level",
    "metrics_jsonl",
    "metrics_records",
    "policy",
    "timeout_s",
    "tuning_dir",
    "validate",
]

# name -> (default, description)
ENV_VARS: dict[str, tuple[str, str]] = {
    "DQCOLL_TIMEOUT_S": (
        "300",
        "Seconds any distributed wait may block before raising CollectiveTimeoutError: "
        "collectives, dqcoll.init's store connection and rendezvous, shrink(), and the 'dqcoll' "
        "backend's waits when init_process_group is given no timeout=.",
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
        "latency). Read when a communicator is created; its ranks must agree (checked then).",
    ),
    "DQCOLL_LOG_LEVEL": ("WARNING", "Log level of the 'dqcoll' logger."),
    "DQCOLL_POLICY": (
        "",
        "Per-role compression policy of the FSDP2 classes and of the 'dqcoll' torch.distributed "
        "backend (dqcoll.integrations.policy): comma-separated key=value, e.g. "
        "'weights=int8_block,gradients=dynamiq:5,allreduce=dynamiq:5,min_nbytes=65536,"
        "warmup_steps=0,intra_node=exact'. A role set to 'none' runs the wrapped process "
        "group's own exact collective. Empty: the documented defaults. The ranks of a group "
        "agree on the policy when the backend's process group, or FSDP2's first collective "
        "of the group, is created (different policies raise MismatchError on every rank).",
    ),
    "DQCOLL_TUNING_DIR": (
        "",
        "Extra directory searched for tuned algorithm tables before the packaged ones.",
    ),
    "DQCOLL_AUTO_FORCE": (
        "",
        "none | bf16 | dynamiq: what scheme='auto' runs on every call, whatever its model "
        "predicts (last_info['auto'] still reports the predictions). Empty: the model decides. "
        "Read when a communicator is created; its ranks must agree (checked then).",
    ),
    "DQCOLL_METRICS_RECORDS": (
        "10000",
        "Call records each communicator keeps in comm.metrics (the most recent; 0 keeps none). "
        "The running totals per collective, scheme, algorithm and size class count every call "
        "whatever this is (docs/metrics.md).",
    ),
    "DQCOLL_METRICS_JSONL": (
        "",
        "Path each rank appends every call's record to as it completes, one NCCL Inspector JSON "
        "line per call: '{rank}' in it is replaced by the rank, else '.rank<r>' is appended. "
        "Empty: no file.",
    ),
}


def _get(name: str) -> str:
    return os.environ.get(name, ENV_VARS[name][0])


def check_timeout_s(value: object, name: str = "timeout_s") -> float:
    """``value`` as a finite, positive number of seconds, or an error naming ``name``."""
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        raise InvalidArgumentError(
            f"{name} must be a finite positive number of seconds, got {value!r}") from None
    if not (math.isfinite(seconds) and seconds > 0):
        raise InvalidArgumentError(
            f"{name} must be a finite positive number of seconds, got {value!r}")
    return seconds


def timeout_s() -> float:
    return check_timeout_s(_get("DQCOLL_TIMEOUT_S").strip(), "DQCOLL_TIMEOUT_S")


KERNEL_CHOICES = ("auto", "torch", "triton", "numba")


def kernels() -> str:
    value = _get("DQCOLL_KERNELS").strip().lower()
    if value not in KERNEL_CHOICES:
        raise InvalidArgumentError(
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
        raise InvalidArgumentError(
            f"DQCOLL_CPU_THREADS must be a positive integer, got {value!r}") from None
    if threads < 1:
        raise InvalidArgumentError(
            f"DQCOLL_CPU_THREADS must be a positive integer, got {value!r}")
    return threads


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def validate() -> bool:
    value = _get("DQCOLL_VALIDATE").strip().lower()
    if value not in _TRUE + _FALSE:
        raise InvalidArgumentError(
            f"DQCOLL_VALIDATE must be one of {', '.join(_TRUE + _FALSE)}, got {value!r}")
    return value in _TRUE


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level() -> str:
    value = _get("DQCOLL_LOG_LEVEL").strip().upper()
    if value not in _LOG_LEVELS or not isinstance(logging.getLevelName(value), int):
        raise InvalidArgumentError(
            f"DQCOLL_LOG_LEVEL must be one of {', '.join(_LOG_LEVELS)}, got {value!r}")
    return value


def tuning_dir() -> str:
    value = _get("DQCOLL_TUNING_DIR")
    if value and not os.path.isdir(value):
        raise InvalidArgumentError(
            f"DQCOLL_TUNING_DIR must name a directory (or be empty), got {value!r}")
    return value


AUTO_CHOICES = ("none", "bf16", "dynamiq")


def auto_force() -> str | None:
    """The DQCOLL_AUTO_FORCE setting, or None (see ENV_VARS)."""
    value = _get("DQCOLL_AUTO_FORCE").strip().lower()
    if not value:
        return None
    if value not in AUTO_CHOICES:
        raise InvalidArgumentError(
            f"DQCOLL_AUTO_FORCE must be one of {', '.join(AUTO_CHOICES)} or empty, got {value!r}")
    return value


def policy() -> str:
    """The DQCOLL_POLICY text (see :mod:`dqcoll.integrations.policy`); empty for the defaults."""
    return _get("DQCOLL_POLICY").strip()


def local_world_size() -> int | None:
    """torchrun's ``LOCAL_WORLD_SIZE`` (ranks on this machine), or None when unset or not a
    positive integer."""
    text = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def metrics_records() -> int:
    """The DQCOLL_METRICS_RECORDS setting (see ENV_VARS)."""
    value = _get("DQCOLL_METRICS_RECORDS").strip()
    try:
        records = int(value)
    except ValueError:
        raise InvalidArgumentError(
            f"DQCOLL_METRICS_RECORDS must be a non-negative integer, got {value!r}") from None
    if records < 0:
        raise InvalidArgumentError(
            f"DQCOLL_METRICS_RECORDS must be a non-negative integer, got {value!r}")
    return records


def metrics_jsonl() -> str:
    """The DQCOLL_METRICS_JSONL path, or empty for none (see ENV_VARS)."""
    return _get("DQCOLL_METRICS_JSONL").strip()
