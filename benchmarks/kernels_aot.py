"""Instruction counts of the DynamiQ Triton kernels on sm_90, compiled without a GPU.

``python benchmarks/kernels.py --aot 90 --json FILE`` (this module does the work) compiles every
kernel exactly as a launch on an H100 would, disassembles the cubin with Triton's bundled
``nvdisasm`` and counts the SASS instructions the executed path issues per coordinate, with the
bytes the kernel moves, so that the question "is the fused hop memory-bound on an H100?" has an
answer on any CPU machine.

**Exactly as a launch.** The public launchers of :mod:`dqcoll.kernels.dynamiq_triton` are called
on ``meta`` tensors shaped as the scheme passes them for a large call (2**24 coordinates; records
written into a payload at byte offset 0, ``keep_sum=False`` for the fused hop, as
``DynamiqScheme.decompress_accumulate_recompress`` does). Each ``@triton.jit`` kernel's ``run``
is intercepted, and the captured arguments go through Triton's own binder
(``create_function_from_signature`` + ``JITFunction._pack_args``, as ``JITFunction.run`` does): the
signature, the ``tt.divisibility=16`` attributes of 16-byte-aligned pointers and of integers
divisible by 16, the integers equal to 1, the ``do_not_specialize`` arguments and the constexprs
(``_launch.launch_config``'s rows and warps) are the JIT's, not a hand-written table. Meta tensors
report ``data_ptr() == 0`` plus their byte offset, so a view's alignment is the real one relative
to a 16-byte-aligned allocation (CUDA's caching allocator aligns to 512 bytes).

**Definitions** (all per coordinate; a program handles ``ROWS * 256`` coordinates with
``num_warps`` warps; a warp-instruction covers 32 lanes):

* ``warp_instructions_per_program`` = expected SASS instructions one warp issues along the
  executed path (:mod:`benchmarks.sass`: basic blocks weighted by their expected visits; loop
  bodies by their measured passes) times ``num_warps``;
* ``sass_per_coord`` = ``warp_instructions_per_program * 32 / (ROWS * 256)``: thread-instructions
  per coordinate, the unit of the H100's issue rate;
* ``int_pipe_per_coord``: the same for the instructions on the ALU (integer/logic) pipe
  (:data:`benchmarks.sass.PIPES`; IMAD runs on the FMA pipe on Hopper);
* ``bytes_per_coord``: bytes the kernel reads and writes (model below);
* ``instr_bound_gbps`` = ``min(29.7e12 / sass_per_coord, 14.8e12 / int_pipe_per_coord) *
  bytes_per_coord / 1e9``: H100 SXM issues 132 SMs x 4 schedulers x 32 lanes x 1.755 GHz =
  29.7 T thread-instructions/s, the ALU half that; ``bound`` names the binding one;
* ``pct_of_copy`` = ``instr_bound_gbps / 3000`` (3.0 TB/s copy bandwidth), capped at 100: above
  100 the kernel is memory-bound, below it the instruction stream limits it.

**Loop passes.** Format 2 of the codec has no data-dependent loop in any kernel (format 1's
cycle-walking ``while`` of the correlated-rounding permutation moved into a per-call table,
:func:`dqcoll.kernels.rng.permutation_table`). A kernel whose SASS still has a loop is
counted with the loop body once per program and reported in ``loops`` and ``warnings``; pass
``loop_passes`` (``{"mean": ..., "p_any": ...}``) to weight it by measured passes instead.

**Bytes per super-group** (``R`` = record bytes; small tables that stay in cache are not
counted): stats_center ``256*4 + 4 | 256*4 + 8``; encode ``256*4 + 8 | R``; decode ``R | 256*4``;
decode_accumulate ``R + 256*4 | 256*4``; decode_accumulate_encode ``R + 256*4 + 8 | R``
(``keep_sum=False``: the sum stays in registers; the scheme hands the kernel its payload as
``out=``, so no copy follows); restore ``256*4 + 16 | 256*4``. The scheme makes one pass of its
own around a kernel on the Triton path: the reorder gather ``centred[order]`` after stats_center
(``extra_pass_bytes_per_coord``, a separate torch kernel, not part of the bound).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from dqcoll.kernels import _dynamiq_kernels, dynamiq_triton
from dqcoll.kernels.codec import (
    SUPER,
    WIDTHS,
    CodecConfig,
    Levels,
    RoundingMode,
    Scales,
    record_nbytes,
)

try:  # run as a script (benchmarks/ on sys.path) or imported as benchmarks.kernels_aot
    import sass  # type: ignore[import-not-found,no-redef]
except ImportError:  # pragma: no cover
    from benchmarks import sass  # type: ignore[no-redef]

__all__ = ["CapturedLaunch", "aot_records", "capture_launch", "count_kernel",
           "print_table"]

H100_ISSUE_PER_S = 132 * 4 * 32 * 1.755e9  # 29.7e12 thread-instructions/s (SXM5, boost clock)
H100_ALU_PER_S = H100_ISSUE_PER_S / 2  # 14.8e12: the ALU pipe is 16 lanes wide per scheduler
H100_COPY_GBPS = 3000.0  # device-to-device copy, read + write bytes
NUMEL = 1 << 24  # "a large call": the launch configuration for this many coordinates
KEY = 0x1234ABCD
ISSUE_TARGETS = {"sass_per_coord": 85.0, "int_pipe_per_coord": 43.0}  # issue 15, fused, 4 bits
ENCODE_LIKE = ("encode", "decode_accumulate_encode")
KERNELS = ("stats_center", "encode", "decode", "decode_accumulate", "decode_accumulate_encode",
           "restore")


@dataclasses.dataclass
class CapturedLaunch:
    """One kernel launch as ``JITFunction.run`` received it."""

    kernel: Any  # the JITFunction
    args: tuple[Any, ...]
    kwargs: dict[str, Any]  # constexprs, num_warps and compile options


@contextlib.contextmanager
def _intercepted() -> Iterator[list[CapturedLaunch]]:
    """Route meta tensors to the compiled kernels and record their launches instead of running
    them."""
    captured: list[CapturedLaunch] = []
    kernels = [v for v in vars(_dynamiq_kernels).values() if hasattr(v, "run")
               and hasattr(v, "params")]

    def recorder(kernel: Any) -> Callable[..., None]:
        def run(*args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
            captured.append(CapturedLaunch(kernel, args, kwargs))
        return run

    old_for = dynamiq_triton._kernels_for
    dynamiq_triton._kernels_for = lambda device: (_dynamiq_kernels, False)  # type: ignore
    for k in kernels:
        k.run = recorder(k)
    try:
        yield captured
    finally:
        dynamiq_triton._kernels_for = old_for  # type: ignore[assignment]
        for k in kernels:
            del k.run


def _config(rounding: RoundingMode | None, scales: Scales, levels: Levels) -> CodecConfig:
    return CodecConfig(levels=levels, scales=scales,
                       rounding=rounding or RoundingMode.CORRELATED)


def _scheme_call(kernel: str, width: int, rounding: RoundingMode | None, numel: int,
                 world_size: int, segment_offset: int, scales: Scales = Scales.HIERARCHICAL,
                 levels: Levels = Levels.NONUNIFORM) -> None:
    """Call the public launcher of ``kernel`` with meta tensors as the scheme passes them."""
    dev = torch.device("meta")
    rows = numel // SUPER
    rank = world_size // 2
    config = _config(rounding, scales, levels)
    ops = dynamiq_triton
    work = torch.empty((rows, SUPER), dtype=torch.float32, device=dev)
    index = torch.empty(rows, dtype=torch.int64, device=dev)
    valid = torch.empty(rows, dtype=torch.int32, device=dev)
    mean = torch.empty(rows, dtype=torch.float32, device=dev)
    if kernel == "stats_center":
        ops.stats_center(work, valid)
        return
    if kernel == "restore":
        ops.restore(work, mean, index, valid, torch.empty(numel, device=dev))
        return
    size = record_nbytes(width, config.scales)

    def payload_records() -> torch.Tensor:  # a segment of a chunk payload (uint8, flat)
        payload = torch.empty(segment_offset + rows * size, dtype=torch.uint8, device=dev)
        return payload[segment_offset:].view(rows, size)

    if kernel == "encode":
        ops.encode(work, width, index, rank, world_size, KEY, config, out=payload_records())
    elif kernel == "decode":
        ops.decode(payload_records(), width, config, out=work)
    elif kernel == "decode_accumulate":
        ops.decode_accumulate(payload_records(), width, config, work)
    elif kernel == "decode_accumulate_encode":
        ops.decode_accumulate_encode(payload_records(), width, work, index, rank, world_size,
                                     KEY, config, keep_sum=False, out=payload_records())
    else:
        raise ValueError(f"unknown kernel {kernel!r}; choose from {KERNELS}")


def capture_launch(kernel: str, width: int, rounding: RoundingMode | None, *,
                   numel: int = NUMEL, world_size: int = 8, segment_offset: int = 0,
                   scales: Scales = Scales.HIERARCHICAL,
                   levels: Levels = Levels.NONUNIFORM) -> CapturedLaunch:
    """The single kernel launch the launcher of ``kernel`` makes for this call."""
    with _intercepted() as captured:
        _scheme_call(kernel, width, rounding, numel, world_size, segment_offset, scales, levels)
    if len(captured) != 1:
        raise RuntimeError(f"{kernel}: expected one launch, captured {len(captured)}")
    return captured[0]


def _specialise(launch: CapturedLaunch, arch: int) -> tuple[Any, dict[str, Any], Any]:
    """(ASTSource, options dict, target) from Triton's own binder, as ``JITFunction.run`` builds
    them for these arguments."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = dict(launch.kwargs)
    # The keys JITFunction.run adds before binding (Triton 3.9).
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    compilation = getattr(knobs, "compilation", None)
    for key in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if compilation is not None and hasattr(compilation, key):
            kwargs[key] = getattr(compilation, key)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound,
                                                          specialization, options)
    return ASTSource(fn, signature, constexprs, attrs), options.__dict__, target


def _tool(name: str) -> Path:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        found = shutil.which(name)
        if found is None:
            raise FileNotFoundError(f"{name} not bundled with Triton ({path}) nor on PATH")
        path = Path(found)
    return path


def _bytes_per_row(kernel: str, record: int) -> tuple[int, int]:
    """(kernel bytes, scheme's extra-pass bytes) per super-group (module docstring)."""
    f32_row = SUPER * 4
    return {
        "stats_center": (f32_row + 4 + f32_row + 8, 2 * f32_row),
        "encode": (f32_row + 8 + record, 0),
        "decode": (record + f32_row, 0),
        "decode_accumulate": (record + 2 * f32_row, 0),
        "decode_accumulate_encode": (2 * record + f32_row + 8, 0),
        "restore": (f32_row + 16 + f32_row, 0),
    }[kernel]


def count_kernel(kernel: str, width: int, rounding: RoundingMode | None, *, arch: int = 90,
                 world_size: int = 8, numel: int = NUMEL, segment_offset: int = 0,
                 loop_passes: dict[str, float] | None = None,
                 scales: Scales = Scales.HIERARCHICAL,
                 levels: Levels = Levels.NONUNIFORM) -> dict[str, Any]:
    """Compile one kernel as launched and count it: one JSON record (module docstring)."""
    import triton

    launch = capture_launch(kernel, width, rounding, numel=numel, world_size=world_size,
                            segment_offset=segment_offset, scales=scales, levels=levels)
    source, options, target = _specialise(launch, arch)
    compiled = triton.compile(source, target=target, options=options)
    rows = launch.kwargs["ROWS"]
    num_warps = launch.kwargs["num_warps"]
    name = launch.kernel.__name__
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        listing = subprocess.run([str(_tool("nvdisasm")), "-c", str(cubin)], check=True,
                                 capture_output=True, text=True).stdout
        usage = subprocess.run([str(_tool("cuobjdump")), "--dump-resource-usage", str(cubin)],
                               check=True, capture_output=True, text=True).stdout
    ins, labels = sass.parse_nvdisasm(listing, name)
    counts = sass.count_executed(
        ins, labels, name,
        None if loop_passes is None else sass.LoopPasses(loop_passes["mean"],
                                                         loop_passes["p_any"]))
    regs = re.search(r"REG:(\d+)", usage)
    local = re.search(r"LOCAL:(\d+)", usage)
    spill_stores = sum(1 for i in ins if i.opcode.startswith("STL"))
    spill_loads = sum(1 for i in ins if i.opcode.startswith("LDL"))
    coords = rows * SUPER
    per_coord = num_warps * 32 / coords  # warp-instructions per warp -> thread-instr per coord
    sass_pc = counts.total * per_coord
    int_pc = counts.by_pipe.get("alu", 0.0) * per_coord
    widthless = kernel in ("stats_center", "restore")
    record = record_nbytes(width, scales) if kernel not in (
        "stats_center", "restore") else 0
    kernel_bytes, extra_bytes = _bytes_per_row(kernel, record)
    bytes_pc = kernel_bytes / SUPER
    issue_rate = H100_ISSUE_PER_S / sass_pc
    alu_rate = H100_ALU_PER_S / int_pc if int_pc else float("inf")
    coords_per_s = min(issue_rate, alu_rate)
    gbps = coords_per_s * bytes_pc / 1e9
    ptx = compiled.asm["ptx"]
    ptx_ops = re.findall(r"^\s*(?:@%p\d+\s+)?([a-z]+(?:\.[a-z0-9]+)*)", ptx, re.M)
    attrs = [p.name for (k,), v in source.attrs.items() for p in [launch.kernel.params[k]]
             if v]
    return {
        "kernel": kernel,
        "bits": None if kernel in ("stats_center", "restore") else width,
        "rounding": rounding.value if rounding is not None else None,
        "scales": None if widthless else scales.value,
        "levels": None if widthless else levels.value,
        "registers": int(regs.group(1)) if regs else None,
        "spills": spill_stores + spill_loads,
        "spill_stores": spill_stores,
        "spill_loads": spill_loads,
        "local_bytes": int(local.group(1)) if local else None,
        "sass_per_coord": sass_pc,
        "int_pipe_per_coord": int_pc,
        "int_pipe_assumed_per_coord": counts.alu_assumed * per_coord,
        "pipe_per_coord": {k: v * per_coord for k, v in sorted(counts.by_pipe.items())},
        "bytes_per_coord": bytes_pc,
        "extra_pass_bytes_per_coord": extra_bytes / SUPER,
        "instr_bound_gbps": gbps,
        "bound": "issue" if issue_rate <= alu_rate else "alu",
        "pct_of_copy": min(100.0, 100.0 * gbps / H100_COPY_GBPS),
        "loop_passes": loop_passes,
        "loops": counts.loops,
        "warp_instructions_per_program": counts.total * num_warps,
        "static_instructions": counts.static,
        "rows_per_program": rows,
        "num_warps": num_warps,
        "coords_per_program": coords,
        "jit_kernel": name,
        "signature": {k: v for k, v in source.signature.items() if v != "constexpr"},
        "divisible_by_16": attrs,
        "constexprs": {launch.kernel.params[k].name: v for (k,), v in source.constants.items()},
        "fma_f32": sum(1 for op in ptx_ops if op.startswith("fma") and op.endswith("f32")),
        "div_rn_f32": sum(1 for op in ptx_ops if op == "div.rn.f32"),
        "div_inexact": sum(1 for op in ptx_ops if op.startswith("div.")
                           and ("approx" in op or "full" in op)),
        "warnings": counts.warnings,
    }


def aot_records(arch: int, *, world_size: int = 8, numel: int = NUMEL,
                kernels: tuple[str, ...] = KERNELS, widths: tuple[int, ...] = WIDTHS,
                log: Callable[[str], None] = print,
                roundings: tuple[RoundingMode, ...] = tuple(RoundingMode),
                scales: Scales = Scales.HIERARCHICAL,
                levels: Levels = Levels.NONUNIFORM) -> list[dict[str, Any]]:
    """Every kernel x width x rounding (rounding for the encoding kernels only) of one scale
    encoding and level set; widths the kernels do not implement for ``scales``
    (``dynamiq_triton.FORMATS``) are left out."""
    records = []
    implemented = dynamiq_triton.FORMATS.get(scales, ())
    for kernel in kernels:
        for width in ([0] if kernel in ("stats_center", "restore")
                      else [w for w in widths if w in implemented]):
            modes: list[RoundingMode | None] = (list(roundings) if kernel in ENCODE_LIKE
                                                else [None])
            for mode in modes:
                rec = count_kernel(kernel, width, mode, arch=arch, world_size=world_size,
                                   numel=numel, scales=scales, levels=levels)
                records.append(rec)
                log(_row(rec))
    return records


_HEADER = (f"{'kernel':>24} {'bits':>4} {'scales':>16} {'levels':>10} {'rounding':>11} "
           f"{'regs':>4} {'spill':>5} "
           f"{'sass/c':>7} {'int/c':>6} {'(asm)':>5} {'B/c':>6} {'passes':>6} {'GB/s':>7} "
           f"{'%copy':>6} {'bound':>5}")


def _row(r: dict[str, Any]) -> str:
    passes = "-" if r["loop_passes"] is None else f"{r['loop_passes']['mean']:.2f}"
    return (f"{r['kernel']:>24} {r['bits'] or '-'!s:>4} {r.get('scales') or '-':>16} "
            f"{r.get('levels') or '-':>10} {r['rounding'] or '-':>11} "
            f"{r['registers']!s:>4} {r['spills']:>5} {r['sass_per_coord']:>7.1f} "
            f"{r['int_pipe_per_coord']:>6.1f} {r['int_pipe_assumed_per_coord']:>5.1f} "
            f"{r['bytes_per_coord']:>6.2f} {passes:>6} "
            f"{r['instr_bound_gbps']:>7.0f} {r['pct_of_copy']:>6.1f} {r['bound']:>5}")


def print_table(records: list[dict[str, Any]]) -> None:
    """The stdout table: ``int/c`` is int_pipe_per_coord, ``(asm)`` the part of it from opcodes
    whose pipe is assumed (sass.ALU_ASSUMED), ``B/c`` bytes_per_coord, ``passes`` the mean
    cycle-walking passes per program, ``GB/s``/``%copy`` the instruction bound."""
    print(_HEADER)
    for r in records:
        print(_row(r))


def verdict(records: list[dict[str, Any]]) -> list[str]:
    """Issue 15's targets for the fused hop: <= 85 SASS and <= 43 ALU instructions per coordinate
    at 4 bits correlated, 2 and 8 bits within 1.3x of those, no spills; for scale encodings other
    than the default (``hierarchical4x32``), the 4- and 8-bit hop within 1.2x of the default's
    at the same width where both are in ``records``, and each width without a byte layout (3, 5,
    6, 7) within 1.3x of the nearest byte-aligned width with a level search (4 or 8 bits) of the
    same encoding."""
    lines = []
    fused = {(r.get("scales") or Scales.HIERARCHICAL.value, r.get("levels"), r["bits"]): r
             for r in records if r["kernel"] == "decode_accumulate_encode"
             and r["rounding"] == RoundingMode.CORRELATED.value}

    def check(what: str, r: dict[str, Any], key: str, limit: float) -> None:
        ok = r[key] <= limit
        lines.append(f"{what} {key} {r[key]:.1f} {'<=' if ok else '>'} {limit:.1f} "
                     f"({'meets' if ok else 'MISSES'})")

    default = Scales.HIERARCHICAL.value
    for (scales, levels, bits), r in sorted(fused.items(), key=lambda kv: (kv[0][0] != default,
                                                                              str(kv[0]))):
        name = f"fused {bits}-bit correlated" + ("" if scales == default
                                                 else f" {scales}/{levels}")
        if scales == default and bits in WIDTHS:
            for key, limit in ISSUE_TARGETS.items():
                check(name, r, key, (1.0 if bits == 4 else 1.3) * limit)
        elif bits in WIDTHS:
            ref = next((v for (s, _, b), v in sorted(fused.items(), key=lambda kv: str(kv[0]))
                        if s == default and b == bits), None)
            for key in ISSUE_TARGETS if ref is not None and bits in (4, 8) else ():
                check(name + f" (vs {default} {ref[key]:.1f})", r, key, 1.2 * ref[key])
        else:
            # The nearest byte-aligned width with a level search (2 bits has none), the lower
            # one on a tie: 3, 5, 6 -> 4 bits, 7 -> 8 bits.
            aligned = min((w for w in WIDTHS if w >= 4), key=lambda w: (abs(w - bits), w))
            ref = fused.get((scales, levels, aligned))
            for key in ISSUE_TARGETS if ref is not None else ():
                check(name + f" (vs {aligned}-bit {ref[key]:.1f})", r, key, 1.3 * ref[key])
        lines.append(f"{name} spills {r['spills']} "
                     f"({'meets' if r['spills'] == 0 else 'MISSES'})")
    return lines


def meta(arch: int, world_size: int, numel: int, commit: str) -> dict[str, Any]:
    import triton

    return {
        "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"),
        "triton": triton.__version__, "torch": torch.__version__, "arch": f"sm_{arch}",
        "world_size": world_size, "numel": numel,
        "h100": {"issue_per_s": H100_ISSUE_PER_S, "alu_per_s": H100_ALU_PER_S,
                 "copy_gbps": H100_COPY_GBPS},
        "targets": {"fused_4bit_correlated": ISSUE_TARGETS, "other_widths_slack": 1.3},
    }
