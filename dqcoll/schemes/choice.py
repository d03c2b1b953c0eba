"""Scheme spec strings: ``name[:key=value[;key=value]]`` -> a scheme name and its options.

The command line names a configured scheme in one argument (``dqcoll simulate --scheme
mxfp8:scale=global``, ``dynamiq:bits=4;balance=shards``); :func:`parse_scheme_spec` splits
it and checks it against the registry (:func:`dqcoll.schemes.get`) before anything runs. A value
is an ``int`` if it reads as one, else a ``float`` if it reads as one, else the text.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import InvalidArgumentError
from . import get

__all__ = ["SchemeChoice", "parse_scheme_spec"]


@dataclasses.dataclass(frozen=True)
class SchemeChoice:
    """A scheme name and its options, in the order the spec gave them."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        if not self.options:
            return self.name
        return self.name + ":" + ";".join(f"{k}={v}" for k, v in self.options)


def _value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_scheme_spec(text: str) -> SchemeChoice:
    """``"mxfp8:element=e5m2;scale=global"`` -> SchemeChoice; checked against the registry."""
    name, _, rest = text.strip().partition(":")
    options: list[tuple[str, Any]] = []
    for item in filter(None, (p.strip() for p in rest.split(";"))):
        key, eq, value = item.partition("=")
        if not eq:
            raise InvalidArgumentError(f"scheme spec {text!r}: expected key=value, got {item!r}")
        options.append((key.strip(), _value(value.strip())))
    choice = SchemeChoice(name, tuple(options))
    get(name, **dict(options))  # raises on unknown names and options
    return choice
