"""Executed SASS instructions of one compiled kernel, from its disassembly (no GPU needed).

``nvdisasm -c`` (Triton bundles it) prints a cubin as labelled, addressed instructions. This
module cuts that listing into basic blocks, builds the control-flow graph from the entry point,
gives every conditional branch a probability (the model below) and solves for the expected number
of times each block runs per warp and program; the weighted instruction count, split by execution
pipe, is what :mod:`benchmarks.kernels_aot` turns into instructions per coordinate.

Branch model (each rule names the code it recognises; anything else is counted at probability 1/2
and reported in ``Counts.warnings``, so a new kind of branch cannot pass unnoticed):

* *cold paths*: a successor block that calls a ``*slowpath`` subroutine (the IEEE division's
  denormal/overflow path after ``FCHK``) or traps (``BPT.TRAP``) is never entered; subroutines
  are not counted at all (``CALL`` is not followed);
* *masked tails*: a predicated ``EXIT`` is not taken (it ends programs whose rows are all past
  ``n_rows``, i.e. at most the last program of a launch);
* *loops*: a backward branch closes a loop. Its weight comes from ``loop_passes``: the mean number
  of passes per entry of the program and the probability that there is at least one. A rotated loop
  (``while c: body`` compiled as ``if c: do body while c``) has a guard that skips it (taken with
  probability ``1 - p_any``) and a conditional back edge (taken with probability ``1 - 1/m``, with
  ``m = mean / p_any`` the mean passes of the loops that run), so its body runs ``mean`` times per
  program on average. The condition code before the guard runs once, as on the GPU.

Rejected: counting the static listing (the subroutines and trap blocks alone add hundreds of
instructions that never run) and profiling on a GPU (not available where this must run; the
issue asks for a count any CPU machine can reproduce).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

__all__ = ["ALU_ASSUMED", "PIPES", "Block", "Counts", "Instruction", "LoopPasses",
           "count_executed", "parse_nvdisasm", "pipe_of"]

# Execution pipe of each SASS opcode on sm_90 (Hopper), by base opcode (the text before the first
# ".": ``IMAD.MOV.U32`` -> ``IMAD``). Sources: the Nsight Compute Kernel Profiling Guide, section
# "Pipelines" (docs.nvidia.com/nsight-compute/ProfilingGuide/, paraphrased): *alu* executes most
# bit-manipulation and logic instructions and the integer instructions except IMAD/IMUL; *fma*
# executes FP32 add/multiply/FMA and the integer multiplies (IMAD, IMUL); *xu* transcendentals and
# int<->float conversions; *uniform* the scalar ``U*`` instructions; lsu/adu/cbu memory, barriers
# and branches. NVIDIA's forum (forums.developer.nvidia.com/t/separate-cuda-core-pipeline-for-fp16-
# and-fp32/302018/7) states for GH100 that the fmaheavy pipe handles IMAD, IDP and FP32, so every
# IMAD form (.MOV, .IADD, .SHL, .WIDE, .X) is counted on the FMA pipe. The guide names classes,
# not opcodes: the ones in ``ALU_ASSUMED`` are our reading (comparisons, min/max and selects of
# fp32 values are logic on bit patterns, counted on the ALU as ISETP is); ``Counts`` reports their
# share apart, so a reader can take them out. ``I2FP`` (sm_90's int-to-float) on XU is our reading
# too. The H100 ALU is 16 lanes per scheduler (half the issue rate), the reason for the int bound.
ALU_ASSUMED = frozenset({
    "VIADD",  # sm_90's integer add form: an integer instruction other than IMAD/IMUL
    "MOV", "CS2R",  # register moves (ptxas also moves through IMAD.MOV on the FMA pipe)
    "FSETP", "FSEL", "FMNMX", "FCHK", "HSETP2", "HMNMX2",  # fp compare/select/min/max
})
PIPES: dict[str, frozenset[str]] = {
    # ALU, the integer/logic pipe (16 lanes per SM sub-partition per clock on H100: half rate).
    "alu": frozenset({
        "LOP3", "LOP", "SHF", "SHL", "SHR", "IADD3", "IADD", "ISETP", "ICMP", "SEL", "PRMT",
        "LEA", "FLO", "POPC", "BREV", "BMSK", "BFE", "BFI", "SGXT", "IABS", "IMNMX", "VIMNMX",
        "IDE", "PLOP3", "PSETP", "P2R", "R2P", "VIMNMX3", "IMNMX3",
        "F2FP",  # the ALU's fast fp32 -> fp16/bf16 conversion (guide, Ampere and later)
    }) | ALU_ASSUMED,
    # FMA pipe: fp32 arithmetic and the integer multiply-add family (IMAD.MOV/.IADD/.SHL/.WIDE).
    "fma": frozenset({"FFMA", "FADD", "FMUL", "FMUL32I", "FFMA32I", "FADD32I", "IMAD", "IMUL",
                      "IMAD32I", "IDP", "IDP4A", "HFMA2", "HADD2", "HMUL2"}),
    # XU: conversions and transcendentals.
    "xu": frozenset({"MUFU", "I2F", "F2I", "F2F", "I2I", "FRND", "I2FP", "F2IP"}),
    # Memory, shared-memory and shuffle instructions (issued to the MIO). LDSM / STSM load and
    # store matrix fragments from / to shared memory, shared-memory accesses as LDS / STS are
    # (Triton 3.6 emits STSM.16.M88.4 in the encoding kernels).
    "lsu": frozenset({"LDG", "STG", "LD", "ST", "LDS", "STS", "LDSM", "STSM", "LDL", "STL", "LDC",
                      "SHFL", "ATOM", "ATOMG", "ATOMS", "RED", "REDG", "MATCH", "LDGSTS",
                      "LDGDEPBAR", "DEPBAR", "CCTL", "MEMBAR", "FENCE", "ERRBAR"}),
    # Uniform datapath: every ``U*`` opcode (ULDC, UIADD3, ULOP3, UMOV, USHF, ...; see pipe_of)
    # and the moves into uniform registers.
    "uniform": frozenset({"R2UR"}),
    # Control: branches, convergence barriers, block barriers, warp votes and reductions.
    "control": frozenset({"BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT", "BSSY", "BSYNC",
                          "WARPSYNC", "BAR", "BPT", "NOP", "YIELD", "VOTE", "VOTEU", "REDUX",
                          "S2R", "S2UR", "CS2UR", "NANOSLEEP", "BMOV", "KILL"}),
}


def pipe_of(opcode: str) -> str:
    """Pipe of a SASS opcode (``"uniform"`` for the ``U*`` uniform-datapath opcodes, ``"other"``
    for opcodes not in :data:`PIPES`)."""
    base = opcode.split(".", 1)[0]
    for pipe, ops in PIPES.items():
        if base in ops:
            return pipe
    if base.startswith("U") and base not in ("UNKNOWN",):
        return "uniform"  # ULDC, UIADD3, ULOP3, UMOV, USHF, ... one issue per warp, uniform pipe
    return "other"


@dataclasses.dataclass(frozen=True)
class Instruction:
    address: int
    predicate: str | None  # "P0", "!P3", ... (None: always executes)
    opcode: str  # with modifiers, e.g. "IMAD.WIDE.U32"
    operands: str
    target: str | None  # branch/call target label


@dataclasses.dataclass
class Block:
    start: int  # index of the first instruction
    end: int  # one past the last instruction
    successors: list[tuple[int, float]]  # (block index, probability)
    kind: str = ""  # how the outgoing branch was classified


@dataclasses.dataclass(frozen=True)
class LoopPasses:
    """Measured passes of a loop body per program: ``mean`` over all programs and ``p_any`` the
    fraction of programs that run it at least once."""

    mean: float
    p_any: float


@dataclasses.dataclass
class Counts:
    """Expected instructions issued per warp and program along the executed path."""

    total: float
    by_pipe: dict[str, float]
    alu_assumed: float  # the part of by_pipe["alu"] from ALU_ASSUMED opcodes
    static: int  # instructions in the listing (all functions)
    blocks: int
    loops: list[dict[str, float]]  # per loop: header address, body instructions, passes used
    warnings: list[str]


_LINE = re.compile(r"/\*([0-9a-f]+)\*/\s+(?:@(!?U?P[0-9T]))?\s*([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;")
_LABEL = re.compile(r"^\s*([.$A-Za-z_][\w.$]*):\s*$")
_TARGET = re.compile(r"`\(([^)]+)\)")


def parse_nvdisasm(text: str, function: str) -> tuple[list[Instruction], dict[str, int]]:
    """Instructions of the cubin listing ``text`` (``nvdisasm -c``) in address order, and the
    instruction index of every label. ``function`` is the kernel's name: its label is the entry."""
    instructions: list[Instruction] = []
    labels: dict[str, int] = {}
    for line in text.splitlines():
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        m = _LINE.search(line)
        if not m:
            continue
        target = _TARGET.search(m.group(4))
        instructions.append(Instruction(int(m.group(1), 16), m.group(2), m.group(3),
                                        m.group(4), target.group(1) if target else None))
    if function not in labels:
        raise ValueError(f"function {function!r} not in the listing (labels: {sorted(labels)[:8]})")
    return instructions, labels


def _is_cold(block: list[Instruction]) -> bool:
    return any((i.opcode.startswith("CALL") and i.target and "slowpath" in i.target)
               or i.opcode.startswith("BPT") for i in block)


def _split_blocks(ins: list[Instruction], labels: dict[str, int], entry: int) -> list[Block]:
    """Basic blocks reachable from ``entry`` (indices into ``ins``), successors unweighted."""
    leaders = {entry}
    for k, i in enumerate(ins):
        op = i.opcode.split(".", 1)[0]
        if op in ("BRA", "EXIT", "RET", "BPT", "BRX", "JMX", "JMP") and k + 1 < len(ins):
            leaders.add(k + 1)
        if op in ("BRA", "JMP") and i.target is not None:
            leaders.add(labels[i.target])
    starts = sorted(leaders)
    by_start: dict[int, Block] = {}
    for a, b in zip(starts, [*starts[1:], len(ins)], strict=True):
        by_start[a] = Block(a, b, [])
    # Walk from the entry: only reachable code (subroutines are reached through CALL only).
    order: list[int] = []
    seen: set[int] = set()
    todo = [entry]
    while todo:
        s = todo.pop()
        if s in seen:
            continue
        seen.add(s)
        order.append(s)
        last = ins[by_start[s].end - 1]
        op = last.opcode.split(".", 1)[0]
        nxt: list[int] = []
        if op in ("BRX", "JMX"):
            raise ValueError(f"indirect branch at {last.address:#x}: not modelled")
        if op in ("BRA", "JMP"):
            assert last.target is not None
            nxt.append(labels[last.target])
            if last.predicate is not None or "," in last.operands.split("`")[0]:
                nxt.append(by_start[s].end)  # conditional: falls through too
        elif op in ("EXIT", "RET"):
            if last.predicate is not None:
                nxt.append(by_start[s].end)
        elif op == "BPT":
            pass
        elif by_start[s].end < len(ins):
            nxt.append(by_start[s].end)
        by_start[s].successors = [(t, 1.0) for t in nxt]
        todo.extend(nxt)
    return [by_start[s] for s in sorted(order)]


def count_executed(
    ins: list[Instruction], labels: dict[str, int], function: str,
    loop_passes: LoopPasses | None,
) -> Counts:
    """Expected instructions per warp along the executed path of ``function`` (see the module
    docstring for the branch model). ``loop_passes`` weights every loop; None where the kernel
    is expected to have none (a loop found then is an error)."""
    entry = labels[function]
    blocks = _split_blocks(ins, labels, entry)
    index = {b.start: k for k, b in enumerate(blocks)}
    warnings: list[str] = []
    loops: list[dict[str, float]] = []

    def cold(k: int) -> bool:
        b = blocks[k]
        return _is_cold(ins[b.start:b.end])

    # Loops first: their exits give the guards' targets.
    exits: dict[int, tuple[int, int]] = {}  # loop exit block -> (header block, latch block)
    for k, b in enumerate(blocks):
        for t, _ in b.successors:
            if t <= b.start:
                if loop_passes is None:
                    raise ValueError(f"loop at {ins[t].address:#x} in {function}, which has no "
                                     "measured passes")
                if b.end not in index:
                    raise ValueError(f"loop at {ins[t].address:#x} in {function} never exits "
                                     "(unconditional back edge): not modelled")
                exits[index[b.end]] = (index[t], k)
    for k, b in enumerate(blocks):
        last = ins[b.end - 1]
        op = last.opcode.split(".", 1)[0]
        succ = [index[t] for t, _ in b.successors]
        if len(succ) < 2:  # includes a predicated EXIT: the masked tail is never taken
            b.kind = "masked tail" if op == "EXIT" and last.predicate else ""
            b.successors = [(s, 1.0) for s in succ]
            continue
        taken, fall = succ[0], succ[1]
        p: float  # probability of the branch being taken
        if blocks[taken].start <= b.start:  # back edge: latch of a rotated loop
            assert loop_passes is not None
            m = loop_passes.mean / loop_passes.p_any if loop_passes.p_any > 0 else 1.0
            b.kind, p = "loop latch", max(0.0, 1.0 - 1.0 / max(m, 1.0))
            body = sum(blocks[j].end - blocks[j].start for j in range(taken, k + 1))
            loops.append({"header_address": ins[blocks[taken].start].address,
                          "body_instructions": body, "mean_passes": loop_passes.mean,
                          "p_any": loop_passes.p_any})
        elif cold(fall) and not cold(taken):
            b.kind, p = "skips cold path", 1.0
        elif cold(taken) and not cold(fall):
            b.kind, p = "enters cold path", 0.0
        elif taken in exits and fall <= exits[taken][0] < taken:  # skips the loop
            assert loop_passes is not None
            b.kind, p = "loop guard", 1.0 - loop_passes.p_any
        else:
            b.kind, p = "unclassified", 0.5
            warnings.append(f"branch at {last.address:#x} ({last.opcode} {last.operands}) not "
                            "classified: counted as taken half the time")
        b.successors = [(taken, p), (fall, 1.0 - p)]
    freq = _visits(blocks)
    by_pipe: dict[str, float] = {}
    alu_assumed = 0.0
    for f, b in zip(freq, blocks, strict=True):
        for i in ins[b.start:b.end]:
            pipe = pipe_of(i.opcode)
            by_pipe[pipe] = by_pipe.get(pipe, 0.0) + f
            if i.opcode.split(".", 1)[0] in ALU_ASSUMED:
                alu_assumed += f
            if pipe == "other":
                warnings.append(f"opcode {i.opcode} not in the pipe table")
    return Counts(total=sum(by_pipe.values()), by_pipe=by_pipe, alu_assumed=alu_assumed,
                  static=len(ins),
                  blocks=len(blocks), loops=loops, warnings=sorted(set(warnings)))


def _visits(blocks: list[Block]) -> list[float]:
    """Expected visits of each block from block 0: ``f = e_0 + P^T f`` solved by Gauss-Jordan
    elimination (a few dozen blocks)."""
    n = len(blocks)
    # Rows: f_j - sum_i p_ij f_i = [j == 0]
    a = [[(1.0 if r == c else 0.0) for c in range(n)] + [1.0 if r == 0 else 0.0]
         for r in range(n)]
    for i, b in enumerate(blocks):
        for j, p in b.successors:
            a[j][i] -= p
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            raise ValueError("singular flow equations (a loop that never exits?)")
        a[col], a[pivot] = a[pivot], a[col]
        inv = 1.0 / a[col][col]
        a[col] = [v * inv for v in a[col]]
        for r in range(n):
            if r != col and a[r][col] != 0.0:
                factor = a[r][col]
                a[r] = [v - factor * w for v, w in zip(a[r], a[col], strict=True)]
    return [a[r][n] for r in range(n)]


def opcode_histogram(ins: Iterable[Instruction]) -> dict[str, int]:
    """Static count of each base opcode (for reading a listing)."""
    out: dict[str, int] = {}
    for i in ins:
        base = i.opcode.split(".", 1)[0]
        out[base] = out.get(base, 0) + 1
    return out
