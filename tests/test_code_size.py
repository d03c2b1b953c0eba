"""The runtime's size limits (``tools/code_size.py``): no class over 400 lines and no function or
method over 80 in the modules ``import dqcoll`` and the integrations load, so that each piece of
the runtime can be read on its own."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("code_size", ROOT / "tools" / "code_size.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["code_size"] = module
    spec.loader.exec_module(module)
    return module


code_size = _load()


@pytest.fixture(scope="module")
def report() -> Any:
    return code_size.check()


def _names(definitions: list[Any]) -> set[str]:
    return {f"{d.module}:{d.qualname}" for d in definitions}


def test_measure_counts_classes_and_nested_functions(tmp_path: Path) -> None:
    """A class spans its ``class`` line to its last line; a method and a function nested in it
    are measured on their own with their qualified names; blank lines do not count in the
    module's total."""
    source = textwrap.dedent('''\
        class A:
            def f(self):

                def g():
                    return 1
                return g()


        def h():
            pass
        ''')
    path = tmp_path / "m.py"
    path.write_text(source)
    report = code_size.measure({"m": path}, max_class=5, max_function=4)
    lines = {d.qualname: d.lines for d in report.definitions}
    assert lines == {"A": 6, "A.f": 5, "A.f.g": 2, "h": 2}
    assert report.module_lines["m"] == 7
    assert _names(report.classes_over) == {"m:A"}
    assert _names(report.functions_over) == {"m:A.f"}
    assert not report.ok


def test_runtime_modules_are_those_import_dqcoll_loads() -> None:
    """The measured modules are dqcoll's package, its integrations and the modules they load,
    and no test or tool."""
    modules = code_size.runtime_modules()
    assert "dqcoll" in modules and "dqcoll.schemes.dynamiq.call" in modules
    assert {"dqcoll.integrations.torch_ddp", "dqcoll.integrations.fsdp"} <= set(modules)
    assert all(name == "dqcoll" or name.startswith("dqcoll.") for name in modules)


def test_no_class_over_400_lines(report: Any) -> None:
    """No class of the runtime spans more than 400 lines."""
    assert not _names(report.classes_over)


def test_no_function_over_80_lines(report: Any) -> None:
    """No function or method of the runtime spans more than 80 lines."""
    assert not _names(report.functions_over)


def test_script_exits_1_over_a_limit(report: Any) -> None:
    """The script's exit status says whether every limit holds."""
    assert code_size.main(["--max-class", "100000", "--max-function", "100000"]) == 0
    assert code_size.main(["--max-function", "1"]) == 1
