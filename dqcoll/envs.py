"""Every ``DQCOLL_*`` environment variable (:data:`ENV_VARS`), typed and documented in one place.

Read and validated at call time, not at import (tests and launchers set them later); a malformed
value raises :class:`~dqcoll.errors.InvalidArgumentError` naming the variable.
"""

from __future__ import annotations

import math
import os

from .errors import InvalidArgumentError

__all__ = ["ENV_VARS", "auto_force", "check_timeout_s", "cpu_threads", "kernels", "log_level",
           "metrics_jsonl", "metrics_records", "policy", "timeout_s", "tuning_dir", "validate"]

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
    "DQCOLL_LOG_LEVEL": ("WARNING", "Log level of the 'dqcoll' logger, set when a communicator "
                         "is created; unset, the application's logging configuration stands."),
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


def _choice(name: str, choices: tuple[str, ...], *, empty: bool = False) -> str:
    """``name``'s value in the case of ``choices``, if one of them (or empty, where allowed)."""
    value = _get(name).strip()
    value = value.upper() if choices[0].isupper() else value.lower()
    if value not in choices and (value or not empty):
        raise InvalidArgumentError(f"{name} must be one of {', '.join(choices)}"
                                   f"{' or empty' if empty else ''}, got {value!r}")
    return value


def _integer(name: str, minimum: int) -> int:
    """``name``'s integer value, at least ``minimum`` (0 or 1)."""
    value = _get(name).strip()
    try:
        number = int(value)
    except ValueError:
        number = minimum - 1
    if number < minimum:
        kind = "positive" if minimum else "non-negative"
        raise InvalidArgumentError(f"{name} must be a {kind} integer, got {value!r}")
    return number


def check_timeout_s(value: object, name: str = "timeout_s") -> float:
    """``value`` as a finite, positive number of seconds, or an error naming ``name``."""
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise InvalidArgumentError(
            f"{name} must be a finite positive number of seconds, got {value!r}")
    return seconds


def timeout_s() -> float:
    return check_timeout_s(_get("DQCOLL_TIMEOUT_S").strip(), "DQCOLL_TIMEOUT_S")


def kernels() -> str:
    return _choice("DQCOLL_KERNELS", ("auto", "torch", "triton", "numba"))


def cpu_threads() -> int | None:
    return _integer("DQCOLL_CPU_THREADS", 1) if _get("DQCOLL_CPU_THREADS").strip() else None


_TRUE = ("1", "true", "yes", "on")


def validate() -> bool:
    return _choice("DQCOLL_VALIDATE", (*_TRUE, "0", "false", "no", "off")) in _TRUE


def log_level() -> str:
    return _choice("DQCOLL_LOG_LEVEL", ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"))


def tuning_dir() -> str:
    value = _get("DQCOLL_TUNING_DIR")
    if value and not os.path.isdir(value):
        raise InvalidArgumentError(
            f"DQCOLL_TUNING_DIR must name a directory (or be empty), got {value!r}")
    return value


def auto_force() -> str | None:
    return _choice("DQCOLL_AUTO_FORCE", ("none", "bf16", "dynamiq"), empty=True) or None


def policy() -> str:
    return _get("DQCOLL_POLICY").strip()


def metrics_records() -> int:
    return _integer("DQCOLL_METRICS_RECORDS", 0)


def metrics_jsonl() -> str:
    return _get("DQCOLL_METRICS_JSONL").strip()
