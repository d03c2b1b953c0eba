"""The layers of docs/design.md §1 import downwards only, and the import graph has no circle.

* Planning (``dqcoll/topology``) never calls back up into the public API or the runners; codecs
  (``dqcoll/schemes``) never import a transport, a schedule or the executor - they say what they
  need reduced (``ctx.reduce``) and the call's runner does the exchange; kernels
  (``dqcoll/kernels``) are the codecs' arithmetic (the DynamiQ record format with its torch
  reference and random numbers, the MX element tables, the compiled fast paths) and know nothing
  of schemes, communicators, transports or plans; transports (``dqcoll/transports``) move bytes
  and know no codec.
* Schemes use the kernels through their public names only: no ``dqcoll.kernels._private``
  module or ``_private`` name (:func:`test_schemes_use_public_kernel_names`).
* The command line (``dqcoll/cli``) sits beside the library: it may import anything, and no
  runtime module imports it, so ``import dqcoll`` and the integrations load none of it. The
  evaluation (gradient sources made from models, the tiny LM, the accuracy measurement) is a
  package of its own beside ``dqcoll``, ``dqcoll_lab``, which no module of ``dqcoll`` imports
  (tests/test_lab_split.py).
* No import circle among the modules of ``dqcoll`` (:func:`test_no_import_circles` states the
  rule it checks).
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest

import dqcoll

ROOT = pathlib.Path(dqcoll.__file__).parent

# package -> modules (dotted, relative to dqcoll) it must not import
FORBIDDEN = {
    "topology": ("api", "levels", "comm", "executor", "context", "handles", "transports",
                 "integrations"),
    "schemes": ("api", "comm", "executor", "context", "transports", "topology", "levels",
                "integrations"),
    "kernels": ("api", "comm", "executor", "context", "handles", "levels", "transports",
                "topology", "integrations", "schemes"),
    "transports": ("api", "comm", "executor", "context", "handles", "levels", "schemes",
                   "kernels", "topology", "integrations"),
}
# Beside the runtime: may import anything; no runtime module imports it (see the docstring).
OUTSIDE_RUNTIME = ("cli",)


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


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == f or name.startswith(f + ".") for f in prefixes)


def test_runtime_does_not_import_the_command_line():
    """No module outside ``dqcoll/cli`` imports it, even lazily inside a function: the tuner
    takes its simulation data as an argument."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.relative_to(ROOT).parts[0] in OUTSIDE_RUNTIME:
            continue
        offenders += [f"{path.relative_to(ROOT)} imports dqcoll.{name}"
                      for name in _imports(path) if _within(name, OUTSIDE_RUNTIME)]
    assert not offenders, offenders


def test_import_loads_no_evaluation_module():
    """In a fresh interpreter, ``import dqcoll`` and the integrations (DDP hook, FSDP, the
    torch.distributed backend) leave no ``dqcoll.cli`` module in ``sys.modules`` (nor a
    ``dqcoll.eval`` one: the evaluation is ``dqcoll_lab``'s), and none of the planning tools no
    call runs (the schedule checker, the simulator, the tuner)."""
    code = (
        "import sys, dqcoll, dqcoll.integrations.torch_ddp, dqcoll.integrations.fsdp, "
        "dqcoll.integrations.torch_backend; "
        "tools = ['dqcoll.topology.' + t for t in ('checker', 'simulator', 'tuning')]; "
        "print(sorted(m for m in sys.modules if m.split('.')[:2] in (['dqcoll', 'eval'], "
        "['dqcoll', 'cli']) or m in tools))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT.parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout


def _module_name(path: pathlib.Path) -> str:
    """``dqcoll/kernels/ops.py`` -> ``dqcoll.kernels.ops``; a package's ``__init__.py`` -> the
    package's name."""
    parts = ("dqcoll", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """module -> the dqcoll modules it imports anywhere in its source (module level, inside
    functions, under ``TYPE_CHECKING``), resolved as :func:`test_no_import_circles` says."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    target = ".".join([*base, *(node.module.split(".") if node.module else [])])
                elif node.module and _within(node.module, ("dqcoll",)):
                    target = node.module
                else:
                    continue
                for alias in node.names:  # a submodule by name, else a name of ``target``
                    sub = f"{target}.{alias.name}"
                    found.add(sub if sub in modules else target)
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if _within(a.name, ("dqcoll",))}
        unknown = found - set(modules)
        assert not unknown, f"{name} imports {sorted(unknown)}, which the graph does not know"
        graph[name] = found - {name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest circle ``[a, b, ..., a]`` through each strongly connected component of
    more than one module (Tarjan's algorithm, iterative), in name order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)
    circles = []
    for component in components:  # breadth-first from the first member back to itself
        start = min(component)
        came_from: dict[str, str] = {}
        frontier = [start]
        while start not in came_from:
            following = []
            for node in frontier:
                for nxt in sorted(graph[node] & component):
                    if nxt not in came_from:
                        came_from[nxt] = node
                        following.append(nxt)
            frontier = following
        path = [start]
        while len(path) == 1 or path[-1] != start:
            path.append(came_from[path[-1]])
        circles.append(path[::-1])
    return sorted(circles)


def test_circle_finder_on_a_small_graph():
    """The finder reports one shortest circle per knot and nothing for a tree or a self-import."""
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a", "f"}}
    assert _circles(graph) == [["a", "b", "c", "a"], ["d", "e", "d"]]
    assert _circles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_import_circles():
    """No module of dqcoll reaches itself through imports.

    The graph: every ``.py`` file under ``dqcoll/`` is a node (a package is its ``__init__.py``);
    every import statement in its source is an edge, at module level, inside functions and under
    ``TYPE_CHECKING`` alike (a lazy import only hides a circle until the call). ``from pkg import
    name`` is an edge to the submodule ``pkg.name`` when there is one, else to ``pkg`` (its
    ``__init__``, where ``name`` is defined or re-exported); ``import pkg`` and ``from pkg import
    name`` of a non-module name count as importing ``pkg/__init__.py``.

    Package ``__init__`` files: a package that imports its own submodules to re-export them has
    edges ``pkg -> pkg.sub``, and that is no circle by itself; it becomes one when a submodule
    (or anything it imports) imports the package back, ``from . import name`` for a name defined
    in the ``__init__`` - move that name into a submodule both can import. The implicit import of
    the parent packages that Python performs before any submodule (``dqcoll/__init__.py`` runs
    before ``dqcoll.kernels.ops``) is not an edge: every module would otherwise depend on the
    whole public API.
    """
    graph = _import_graph()
    # the resolution sees lazy imports, re-exports and submodules by name
    assert "dqcoll.kernels.baselines_numba" in graph["dqcoll.kernels.baselines"]
    assert {"dqcoll.api", "dqcoll.comm", "dqcoll.schemes"} <= graph["dqcoll"]
    assert "dqcoll.kernels.ops" in graph["dqcoll.kernels.dynamiq_numba"]
    circles = _circles(graph)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


@pytest.mark.parametrize("package", list(FORBIDDEN))
def test_lower_layers_do_not_import_upper_ones(package):
    """No module of ``package`` imports (even lazily, inside a function) a module of a layer
    above it or beside it: ``topology`` plans without the API, ``schemes`` code without a
    transport or a schedule."""
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in _imports(path):
            if _within(name, FORBIDDEN[package]):
                offenders.append(f"{path.relative_to(ROOT)} imports dqcoll.{name}")
    assert not offenders, offenders


def _private(name: str) -> bool:
    """Whether a dotted name has a ``_private`` part (a dunder such as ``__all__`` is not one)."""
    return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


def test_private_name_rule() -> None:
    """The rule :func:`test_schemes_use_public_kernel_names` applies, on the names it sees."""
    assert _private("kernels._torch_ops") and _private("kernels._params.level_tables")
    assert _private("kernels.codec._magnitudes")
    assert not _private("kernels.codec.encode_torch") and not _private("kernels.rng.__all__")


def test_schemes_use_public_kernel_names() -> None:
    """No module of ``dqcoll/schemes`` imports (even lazily) a private module of
    ``dqcoll/kernels`` or a private name from one of its modules: the kernels' ``_``-prefixed
    parts can change without a scheme noticing, so the dependency stays one-way through a
    public surface."""
    offenders = []
    for path in sorted((ROOT / "schemes").rglob("*.py")):
        offenders += [f"{path.relative_to(ROOT)} imports dqcoll.{name}"
                      for name in _imports(path) if _within(name, ("kernels",)) and _private(name)]
    assert not offenders, offenders


# The public call path (docs/design.md §1, layer 3), top to bottom: each module imports only the
# ones after it (api hands the request to execute, which runs prepare, then validate, then its
# own step), so a buffer's walk never climbs back; below it nothing imports the public API.
CALL_PATH = ("api", "execute", "validate", "prepare")
# the package's front, the integrations, and what sits beside the library (OUTSIDE_RUNTIME)
API_IMPORTERS = ("__init__.py", "integrations", *OUTSIDE_RUNTIME)


def test_call_path_imports_go_down():
    """No module of dqcoll but ``__init__.py``, ``integrations/*`` and ``cli/*``
    imports ``dqcoll.api`` (even lazily), and on the call path
    ``api -> execute -> validate -> prepare`` each module imports none of the ones before it."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT)
        if relative.parts[0] in API_IMPORTERS:
            continue
        offenders += [f"{relative} imports dqcoll.{name}" for name in _imports(path)
                      if _within(name, ("api",))]
    for index, module in enumerate(CALL_PATH):
        offenders += [f"{module}.py imports dqcoll.{name} (above it on the call path)"
                      for name in _imports(ROOT / f"{module}.py")
                      if _within(name, CALL_PATH[:index])]
    assert not offenders, offenders
    assert "execute" in _imports(ROOT / "api.py")  # the pinned order is the real one
    assert {"validate", "prepare"} <= set(_imports(ROOT / "execute.py"))
    assert "prepare" in _imports(ROOT / "validate.py")
