"""What the GPU check needs, before it spends minutes on it (the first step of tools/gpu_check.sh).

    python tools/gpu/preflight.py --out preflight.json

Records the versions of Python, torch (and its CUDA), Triton, NumPy, numba, CuPy, nccl4py and
pytest; the GPU torch sees; the NCCL versions of torch, CuPy and nccl4py and of the NCCL wheels
installed; whether dqcoll's NCCL transports can run here (and why not); and whether Triton can
build its launcher: a C compiler (``$CC``, ``cc``, ``gcc`` or ``clang``) that compiles a file
including ``Python.h`` from this interpreter's include directory, and ``libcuda.so`` for it to
link. ``problems`` lists what stops the check (no CUDA device, Triton not importable, no
compiler or Python headers, dqcoll not importable); ``warnings`` what only skips a part (a
missing NCCL binding). Exit status 1 when there is a problem.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any


def _version(module_name: str) -> tuple[str | None, str | None]:
    """(version, None) when the module imports, else (None, the error)."""
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import failure is a finding, not a crash
        return None, f"{type(exc).__name__}: {exc}"
    return str(getattr(module, "__version__", "(no __version__)")), None


def _compiler_check() -> dict[str, Any]:
    """Compile a C file that includes Python.h, as Triton's launcher build does."""
    candidates = [os.environ.get("CC"), "cc", "gcc", "clang"]
    compiler = next((shutil.which(c) for c in candidates if c and shutil.which(c)), None)
    include = sysconfig.get_paths()["include"]
    result: dict[str, Any] = {"compiler": compiler, "python_include": include,
                              "python_h": os.path.exists(os.path.join(include, "Python.h"))}
    if compiler is None:
        result["error"] = "no C compiler ($CC, cc, gcc, clang) on PATH"
        return result
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text("#include <Python.h>\nint probe(void) { return Py_IsInitialized(); }\n")
        done = subprocess.run([compiler, "-c", "-fPIC", f"-I{include}", str(src), "-o",
                               str(Path(tmp) / "probe.o")], capture_output=True, text=True,
                              timeout=60)
    result["compiles"] = done.returncode == 0
    if done.returncode != 0:
        result["error"] = done.stderr.strip()[-1000:]
    return result


def _libcuda() -> list[str]:
    """Where the dynamic loader finds libcuda.so (Triton links its launcher against it)."""
    paths: list[str] = []
    if os.environ.get("TRITON_LIBCUDA_PATH"):
        paths.append(os.environ["TRITON_LIBCUDA_PATH"])
    try:
        out = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True,
                             timeout=30).stdout
        paths += [line.split("=>")[-1].strip() for line in out.splitlines()
                  if "libcuda.so" in line]
    except (OSError, subprocess.SubprocessError):
        pass
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable,
                              "versions": {}, "import_errors": {}, "nccl": {}}
    problems: list[str] = []
    warnings: list[str] = []
    for name in ("torch", "triton", "numpy", "numba", "cupy", "nccl.core", "pytest", "dqcoll"):
        version, error = _version(name)
        if error is None:
            report["versions"][name] = version
        else:
            report["import_errors"][name] = error
    for name in ("torch", "triton", "dqcoll", "pytest"):
        if name in report["import_errors"]:
            problems.append(f"{name} is not importable: {report['import_errors'][name]}")
    for name in ("cupy", "nccl.core"):
        if name in report["import_errors"]:
            warnings.append(f"{name} is not importable (its NCCL tests skip): "
                            f"{report['import_errors'][name]}")

    try:
        import torch

        report["torch_cuda"] = torch.version.cuda
        report["cuda_available"] = bool(torch.cuda.is_available())
        if report["cuda_available"]:
            props = torch.cuda.get_device_properties(0)
            report["device"] = {"name": props.name, "capability": list(torch.cuda
                                                                        .get_device_capability(0)),
                                "memory_gib": round(props.total_memory / 2**30, 1),
                                "count": torch.cuda.device_count()}
            report["nccl"]["torch"] = ".".join(map(str, torch.cuda.nccl.version()))
        else:
            problems.append("torch sees no CUDA device (a CPU build of torch, or no driver)")
    except Exception as exc:
        problems.append(f"torch's CUDA state: {type(exc).__name__}: {exc}")

    try:
        from cupy.cuda import nccl as cupy_nccl

        report["nccl"]["cupy"] = str(cupy_nccl.get_version())
    except Exception as exc:
        report["nccl"]["cupy_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import nccl.core

        report["nccl"]["nccl4py"] = str(nccl.core.get_version())
    except Exception as exc:
        report["nccl"]["nccl4py_error"] = f"{type(exc).__name__}: {exc}"
    report["nccl"]["wheels"] = {
        dist.metadata["Name"]: dist.version for dist in importlib.metadata.distributions()
        if (dist.metadata["Name"] or "").lower().startswith("nvidia-nccl")}
    try:
        from dqcoll.transports.cupy_nccl import nccl_unavailable_reason
        from dqcoll.transports.nccl4py import nccl4py_unavailable_reason

        reasons = {"nccl-cupy": nccl_unavailable_reason(),
                   "nccl4py": nccl4py_unavailable_reason()}
        report["dqcoll_nccl_bindings"] = {k: v or "available" for k, v in reasons.items()}
        if all(v is not None for v in reasons.values()):
            warnings.append("no NCCL transport of dqcoll can run here: "
                            + "; ".join(f"{k}: {v}" for k, v in reasons.items()))
    except Exception as exc:
        problems.append(f"dqcoll's NCCL transports: {type(exc).__name__}: {exc}")

    report["c_compiler"] = _compiler_check()
    if "error" in report["c_compiler"] or not report["c_compiler"]["python_h"]:
        problems.append("Triton cannot build its launcher: "
                        + report["c_compiler"].get("error", "no Python.h in "
                                                   + report["c_compiler"]["python_include"]))
    report["libcuda"] = _libcuda()
    if report.get("cuda_available") and not report["libcuda"]:
        warnings.append("ldconfig lists no libcuda.so (Triton may not find it; "
                        "TRITON_LIBCUDA_PATH sets its directory)")
    report["problems"], report["warnings"] = problems, warnings
    report["ok"] = not problems
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print(json.dumps(report, indent=2, sort_keys=True))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
