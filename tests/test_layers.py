"""The layers of DESIGN section 1 import downwards only: planning (``dqcoll/topology``) never
calls back up into the public API or the runners, and codecs (``dqcoll/schemes``) never import a
transport, a schedule or the executor - they say what they need reduced (``ctx.reduce``) and the
call's runner does the exchange."""

from __future__ import annotations

import ast
import pathlib

import pytest

import dqcoll

ROOT = pathlib.Path(dqcoll.__file__).parent

# package -> modules (dotted, relative to dqcoll) it must not import
FORBIDDEN = {
    "topology": ("api", "hierarchical", "comm", "executor", "context", "handles"),
    "schemes": ("api", "comm", "executor", "context", "transports", "topology", "hierarchical"),
}


def _imports(path: pathlib.Path) -> list[str]:
    """Every dqcoll module ``path`` imports, as a dotted name relative to dqcoll."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
                module = [*base, *(node.module.split(".") if node.module else [])]
                names = [".".join(module)] + [".".join([*module, a.name]) for a in node.names]
                found += names
            elif node.module and node.module.startswith("dqcoll"):
                found.append(node.module.removeprefix("dqcoll").lstrip("."))
        elif isinstance(node, ast.Import):
            found += [a.name.removeprefix("dqcoll").lstrip(".") for a in node.names
                      if a.name.startswith("dqcoll")]
    return found


@pytest.mark.parametrize("package", list(FORBIDDEN))
def test_lower_layers_do_not_import_upper_ones(package):
    """No module of ``package`` imports (even lazily, inside a function) a module of a layer
    above it or beside it: ``topology`` plans without the API, ``schemes`` code without a
    transport or a schedule."""
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[package]):
                offenders.append(f"{path.relative_to(ROOT)} imports dqcoll.{name}")
    assert not offenders, offenders
