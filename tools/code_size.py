#!/usr/bin/env python3
"""Size of the runtime: its non-blank lines, and every class and function over the limits.

The runtime is what a user's process loads: the modules under ``dqcoll`` in ``sys.modules`` after
``import dqcoll`` and the import of every ``dqcoll.integrations`` module, in a fresh interpreter.
For each of their files the script counts the non-blank lines and, with ``ast``, the length of
every class and every function or method (``end_lineno - lineno + 1``, decorators excluded, nested
definitions reported on their own as well as inside their parent).

Prints the line total and the offenders, and exits 1 if any class is over ``--max-class`` lines
(400) or any function over ``--max-function`` lines (80).

Usage: ``python tools/code_size.py [--max-class 400] [--max-function 80] [--all]``
(``--all`` lists every module's line count).
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

MAX_CLASS = 400
MAX_FUNCTION = 80

_LIST_MODULES = """
import json, pkgutil, sys
import dqcoll
import dqcoll.integrations as integrations
for info in pkgutil.iter_modules(integrations.__path__, integrations.__name__ + "."):
    __import__(info.name)
out = {}
for name, module in sorted(sys.modules.items()):
    if name == "dqcoll" or name.startswith("dqcoll."):
        path = getattr(module, "__file__", None)
        if path:
            out[name] = path
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Definition:
    """One class or function: where it is and how many lines it spans."""

    module: str
    qualname: str
    kind: str  # "class" or "function"
    lineno: int
    lines: int


@dataclass
class Report:
    """The runtime's size: per-module non-blank lines and every definition measured."""

    module_lines: dict[str, int] = field(default_factory=dict)
    definitions: list[Definition] = field(default_factory=list)
    max_class: int = MAX_CLASS
    max_function: int = MAX_FUNCTION

    @property
    def total_lines(self) -> int:
        return sum(self.module_lines.values())

    @property
    def classes_over(self) -> list[Definition]:
        return sorted((d for d in self.definitions
                       if d.kind == "class" and d.lines > self.max_class),
                      key=lambda d: -d.lines)

    @property
    def functions_over(self) -> list[Definition]:
        return sorted((d for d in self.definitions
                       if d.kind == "function" and d.lines > self.max_function),
                      key=lambda d: -d.lines)

    @property
    def ok(self) -> bool:
        return not self.classes_over and not self.functions_over


def runtime_modules(python: str = sys.executable) -> dict[str, Path]:
    """Module name -> source file of every ``dqcoll`` module a fresh interpreter holds after
    ``import dqcoll`` and the import of each ``dqcoll.integrations`` module."""
    done = subprocess.run([python, "-c", _LIST_MODULES], capture_output=True, text=True,
                          check=True)
    return {name: Path(path) for name, path in json.loads(done.stdout).items()}


def _definitions(module: str, tree: ast.AST) -> list[Definition]:
    found: list[Definition] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                qualname = f"{prefix}{child.name}"
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                end = child.end_lineno if child.end_lineno is not None else child.lineno
                found.append(Definition(module, qualname, kind, child.lineno,
                                        end - child.lineno + 1))
                visit(child, qualname + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def measure(modules: dict[str, Path], max_class: int = MAX_CLASS,
            max_function: int = MAX_FUNCTION) -> Report:
    """The report for the given modules' files."""
    report = Report(max_class=max_class, max_function=max_function)
    for name, path in sorted(modules.items()):
        source = path.read_text()
        report.module_lines[name] = sum(1 for line in source.splitlines() if line.strip())
        report.definitions.extend(_definitions(name, ast.parse(source, filename=str(path))))
    return report


def check(max_class: int = MAX_CLASS, max_function: int = MAX_FUNCTION) -> Report:
    """Measure the runtime modules (listed by a fresh interpreter)."""
    return measure(runtime_modules(), max_class, max_function)


def render(report: Report, every_module: bool = False) -> str:
    out = [f"runtime: {len(report.module_lines)} modules, "
           f"{report.total_lines} non-blank lines"]
    if every_module:
        for name, lines in sorted(report.module_lines.items(), key=lambda kv: -kv[1]):
            out.append(f"  {lines:6d}  {name}")
    out.append(f"classes over {report.max_class} lines: {len(report.classes_over)}")
    out += [f"  {d.lines:5d}  {d.module}:{d.lineno} {d.qualname}" for d in report.classes_over]
    out.append(f"functions over {report.max_function} lines: {len(report.functions_over)}")
    out += [f"  {d.lines:5d}  {d.module}:{d.lineno} {d.qualname}"
            for d in report.functions_over]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-class", type=int, default=MAX_CLASS)
    parser.add_argument("--max-function", type=int, default=MAX_FUNCTION)
    parser.add_argument("--all", action="store_true", help="list every module's line count")
    args = parser.parse_args(argv)
    report = check(args.max_class, args.max_function)
    print(render(report, args.all))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
