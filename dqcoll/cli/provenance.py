"""Provenance of measured numbers: which commit of dqcoll produced them, on which device.

Every tool that writes results (``dqcoll bench``/``simulate``, ``tools/*.py``, ``benchmarks/*``)
records the commit and the device next to its numbers; this is the one place that asks git and
reads the CPU model.
"""

from __future__ import annotations

import os
import platform
import subprocess

import torch

__all__ = ["device_name", "git_commit"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # dqcoll/


def git_commit(*paths: str) -> str:
    """The short commit of the checkout dqcoll runs from, with ``-dirty`` when the library itself
    (``dqcoll/``) or any of ``paths`` (relative to the repository root, e.g. ``"tools"``)
    differs from it; ``"unknown"`` outside a git checkout."""
    root = os.path.dirname(_PACKAGE)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root,
                                capture_output=True, text=True, timeout=10, check=True).stdout
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "dqcoll", *paths],
                               cwd=root, capture_output=True, timeout=10).returncode
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit.strip() + ("-dirty" if dirty else "")


def device_name(device: torch.device | str = "cpu") -> str:
    """``"CPU: <model>, <n> cores"`` or the CUDA device's name."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU: {model}, {os.cpu_count()} cores"
