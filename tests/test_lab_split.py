"""The runtime (``dqcoll``) and the lab (``dqcoll_lab``) apart: the lab imports the runtime, the
runtime never imports the lab.

``dqcoll`` holds what users run; the evaluation (gradient sources made from models, the tiny LM,
the accuracy harness and its ``eval`` command) is the package ``dqcoll_lab`` beside it, run as
``python -m dqcoll_lab <command>``. What stays in the runtime and why: the synthetic and file
gradient sources (``dqcoll.topology.sources``) are the data ``dqcoll tune`` checks its error
budget on, and the simulator is the tuner's.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import setuptools

import dqcoll

ROOT = pathlib.Path(dqcoll.__file__).parent
REPO = ROOT.parent
LAB = "dqcoll_lab"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}


def _python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=_env(), cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_import_dqcoll_and_integrations_load_no_lab_module() -> None:
    """In a fresh interpreter, ``import dqcoll`` and the import of every ``dqcoll.integrations``
    module leave no ``dqcoll_lab`` module in ``sys.modules``, and the runtime's source registry
    holds only its own kinds; the same interpreter then imports the lab, which registers its
    model-made kinds with the runtime's registry (so the first check was not vacuous)."""
    code = (
        "import json, pkgutil, sys\n"
        "import dqcoll, dqcoll.integrations as integrations\n"
        "names = [i.name for i in pkgutil.iter_modules(integrations.__path__,\n"
        "                                              integrations.__name__ + '.')]\n"
        "for name in names:\n"
        "    __import__(name)\n"
        f"loaded = sorted(m for m in sys.modules if m.split('.')[0] == {LAB!r})\n"
        "from dqcoll.topology import sources\n"
        "before = [e.kind for e in sources.list_sources()]\n"
        f"import {LAB}.eval.sources\n"
        "after = [e.kind for e in sources.list_sources()]\n"
        "print(json.dumps({'integrations': names, 'loaded': loaded, 'before': before,\n"
        "                  'after': after}))\n"
    )
    import json

    report = json.loads(_python(code).strip().splitlines()[-1])
    assert {"dqcoll.integrations.torch_ddp", "dqcoll.integrations.fsdp"} <= set(
        report["integrations"])
    assert report["loaded"] == [], report["loaded"]
    assert report["before"] == ["files", "gaussian", "lognormal-mixture"]
    assert set(report["after"]) == {*report["before"], "minilm", "stdlib-lm"}


def _lab_references(path: pathlib.Path, base: pathlib.Path = REPO) -> list[str]:
    """Every place in ``path`` that imports the lab: ``import dqcoll_lab...``, ``from dqcoll_lab...
    import``, and ``importlib.import_module`` / ``__import__`` of a literal lab name, at any depth
    (inside functions and ``TYPE_CHECKING`` blocks alike)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            arg = node.args[0]
            if called in ("import_module", "__import__") and isinstance(arg, ast.Constant) \
                    and isinstance(arg.value, str):
                names = [arg.value]
        found += [f"{path.relative_to(base)}:{node.lineno} {n}" for n in names
                  if n == LAB or n.startswith(LAB + ".")]
    return found


def test_reference_finder_sees_every_import_form(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The scan below reports module-level, lazy and dynamic imports of the lab and nothing
    else (a name that merely starts with the lab's, a relative import, a string in a message)."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import dqcoll_lab\n"
        "import dqcoll_labyrinth\n"
        "from . import eval\n"
        "def f():\n"
        "    from dqcoll_lab.eval import sources\n"
        "    import importlib\n"
        "    importlib.import_module('dqcoll_lab.cli.main')\n"
        "    __import__('dqcoll_lab')\n"
        "    print('run python -m dqcoll_lab eval')\n"
    )
    found = [ref.split(" ", 1)[1] for ref in _lab_references(sample, tmp_path)]
    assert found == ["dqcoll_lab", "dqcoll_lab.eval", "dqcoll_lab.cli.main", "dqcoll_lab"]


def test_no_runtime_module_imports_the_lab() -> None:
    """No module under ``dqcoll/`` (the command line included) imports ``dqcoll_lab``, even
    lazily inside a function or by ``importlib``; the evaluation is not in the runtime package
    (no ``dqcoll/eval``, no ``dqcoll/cli/eval.py``)."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        offenders += _lab_references(path)
    assert not offenders, offenders
    assert not (ROOT / "eval").exists()
    assert not (ROOT / "cli" / "eval.py").exists()


def test_the_lab_imports_the_runtime() -> None:
    """Every module of the lab imports (its ``__main__`` aside, which runs the command line), and
    the lab is built on the runtime: its accuracy harness runs ``dqcoll.allreduce``, its sources
    are the runtime's registry plus the lab's kinds."""
    import importlib
    import pkgutil

    lab = importlib.import_module(LAB)
    modules = [i.name for i in pkgutil.walk_packages(lab.__path__, LAB + ".")
               if not i.name.endswith("__main__")]
    assert {f"{LAB}.eval.accuracy", f"{LAB}.eval.sources", f"{LAB}.eval.tinylm",
            f"{LAB}.eval.minilm", f"{LAB}.cli.eval", f"{LAB}.cli.main"} <= set(modules)
    for name in modules:
        importlib.import_module(name)
    from dqcoll.topology import sources as runtime_sources
    from dqcoll_lab.eval import accuracy, sources

    assert accuracy.allreduce is dqcoll.allreduce
    assert sources.make_source is runtime_sources.make_source
    assert {"stdlib-lm", "minilm"} <= {e.kind for e in runtime_sources.list_sources()}


def test_packaging_ships_the_lab_and_its_command() -> None:
    """pyproject.toml's package search finds the lab's packages beside the runtime's, and its
    ``dqcoll-lab`` console script names the lab's entry point; ``python -m dqcoll_lab --help``
    lists the moved ``eval`` command."""
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    find = config["tool"]["setuptools"]["packages"]["find"]
    packages = setuptools.find_packages(str(REPO), include=find["include"])
    assert {"dqcoll", "dqcoll.cli", LAB, f"{LAB}.eval", f"{LAB}.cli"} <= set(packages)
    assert not any(p.startswith(("tests", "tools", "benchmarks", "examples")) for p in packages)
    assert config["project"]["scripts"]["dqcoll-lab"] == f"{LAB}.cli.main:main"
    out = subprocess.run([sys.executable, "-m", LAB, "--help"], capture_output=True, text=True,
                         env=_env(), cwd=REPO, timeout=120)
    assert out.returncode == 0 and "eval" in out.stdout, out.stderr
