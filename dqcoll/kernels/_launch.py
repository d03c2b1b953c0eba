"""Launch heuristics of the DynamiQ Triton kernels: rows per program, warps, compile options.

Kept apart from the kernels (which hold no policy) and from the launchers (which only check,
allocate and launch), so that tuning touches one file.

GPU values are *untuned*: chosen from the tile shape (a program holds ``rows * 256`` fp32
coordinates; 8 rows with 4 warps is one scale block of 16 coordinates per thread, so per-block work
is not replicated, with 56-72 registers and no spill in the fused kernel). They are owed a
measurement on an H100/H200: ``tools/gpu_check.sh`` runs ``benchmarks/kernels.py --tune``, which
sweeps these choices and records the best per kernel and width; replace the table below with those
numbers (and the device and commit they came from).

On CPU tensors the kernels run in Triton's interpreter, which costs ~10 ms per program and little
per element: there one program takes as many rows as possible (up to 32, a few MB of numpy
temporaries per tile).
"""

from __future__ import annotations

import dataclasses
import enum
import functools

__all__ = ["OVERRIDES", "Kernel", "LaunchConfig", "compile_options", "launch_config"]


class Kernel(enum.Enum):
    STATS_CENTER = "stats_center"
    ENCODE = "encode"
    DECODE = "decode"
    DECODE_ACCUMULATE = "decode_accumulate"
    DECODE_ACCUMULATE_ENCODE = "decode_accumulate_encode"
    RESTORE = "restore"


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    rows_per_program: int  # super-groups of 256 coordinates per program (a power of two)
    num_warps: int

    def grid(self, n_rows: int) -> tuple[int]:
        return (-(-n_rows // self.rows_per_program),)


# (kernel, width or 0) -> config on CUDA devices. Untuned, see the module docstring.
# The codec kernels give each thread whole scale blocks (see _dynamiq_kernels._tile_coords):
# 8 rows = 128 blocks of 16 over 4 warps, one block (16 coordinates) per thread.
_GPU_DEFAULT = LaunchConfig(rows_per_program=8, num_warps=4)
_GPU_TABLE: dict[tuple[Kernel, int], LaunchConfig] = {
    # Row-wise tree sums and the restore scatter: plain streaming, wider tiles.
    (Kernel.STATS_CENTER, 0): LaunchConfig(rows_per_program=8, num_warps=8),
    (Kernel.RESTORE, 0): LaunchConfig(rows_per_program=8, num_warps=8),
}
_INTERPRETER_MAX_ROWS = 32
# Set only by ``benchmarks/kernels.py --tune`` while it sweeps; consulted first on GPU.
OVERRIDES: dict[tuple[Kernel, int], LaunchConfig] = {}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch_config(kernel: Kernel, width: int, n_rows: int, *, interpreted: bool) -> LaunchConfig:
    """The launch configuration of ``kernel`` at ``width`` bits (0 where the kernel has none)
    over ``n_rows`` super-groups."""
    if (kernel, width) in OVERRIDES:
        return OVERRIDES[(kernel, width)]
    if interpreted:
        rows = min(_next_pow2(max(n_rows, 1)), _INTERPRETER_MAX_ROWS)
        return LaunchConfig(rows_per_program=rows, num_warps=4)
    return _GPU_TABLE.get((kernel, width), _GPU_DEFAULT)


@functools.lru_cache(maxsize=1)
def compile_options() -> dict[str, bool]:
    """Options passed at every GPU launch so the bits match the torch reference:

    * ``enable_fp_fusion=False``: no ``a*b+c`` -> FMA contraction (torch rounds twice);
    * ``enable_reflect_ftz=False`` where this Triton has it: libdevice keeps fp32 denormals
      (torch does not flush them), e.g. in ``div_rn`` on Triton versions that route it there.
    """
    options = {"enable_fp_fusion": False}
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        if "enable_reflect_ftz" in CUDAOptions.__dataclass_fields__:
            options["enable_reflect_ftz"] = False
    except Exception:  # no NVIDIA backend in this Triton build: the option does not apply
        pass
    return options
