"""Instruction counting of compiled kernels (benchmarks/sass.py, benchmarks/kernels_aot.py)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
try:
    import sass  # benchmarks/sass.py
finally:
    sys.path.pop(0)

# A kernel in the shape nvdisasm prints: a division with its cold slow path, a rotated loop
# (guard, body, conditional back edge), a masked tail, and a subroutine that is never counted.
LISTING = """
_k:
.text._k:
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   FCHK P0, R1, R2 ;
        /*0020*/                   BSSY B0, `(.L_x_0) ;
        /*0030*/              @!P0 BRA `(.L_x_1) ;
        /*0040*/                   MOV R3, 0x60 ;
        /*0050*/                   CALL.REL.NOINC `($__internal_0_$__div_rn_slowpath) ;
.L_x_1:
        /*0060*/                   BSYNC B0 ;
.L_x_0:
        /*0070*/                   ISETP.GE.U32.AND P1, PT, R4, 0x8, PT ;
        /*0080*/              @!P1 BRA `(.L_x_2) ;
        /*0090*/                   IMAD.MOV.U32 R5, RZ, RZ, R4 ;
.L_x_3:
        /*00a0*/                   LOP3.LUT R4, R4, 0xf, RZ, 0xc0, !PT ;
        /*00b0*/                   IMAD R4, R4, 0x3, RZ ;
        /*00c0*/                   ISETP.GE.U32.AND P1, PT, R4, 0x8, PT ;
        /*00d0*/               @P1 BRA `(.L_x_3) ;
.L_x_2:
        /*00e0*/                   STG.E desc[UR4][R6.64], R4 ;
        /*00f0*/               @P2 EXIT ;
        /*0100*/                   STG.E desc[UR4][R8.64], R4 ;
        /*0110*/                   EXIT ;
$__internal_0_$__div_rn_slowpath:
        /*0120*/                   SHF.R.U32.HI R9, RZ, 0x17, R2 ;
        /*0130*/                   RET.REL.NODEC R3 `(_k) ;
.L_x_4:
        /*0140*/                   BRA `(.L_x_4);
"""


def test_block_weights_follow_the_branch_model() -> None:
    """Straight-line code counts once, the division's slow path and the subroutine never, the loop
    body ``mean`` times (guard taken with 1 - p_any, back edge with 1 - p_any / mean), the masked
    tail's EXIT falls through; pipes follow the table (IMAD on the FMA pipe)."""
    ins, labels = sass.parse_nvdisasm(LISTING, "_k")
    assert len(ins) == 21
    # Entry..guard: S2R FCHK BSSY BRA, BSYNC, ISETP BRA (7); preheader IMAD.MOV (p_any); loop
    # body 4 instructions x mean; tail STG EXIT STG EXIT (4).
    mean, p_any = 2.5, 0.8
    counts = sass.count_executed(ins, labels, "_k", sass.LoopPasses(mean, p_any))
    assert counts.warnings == []
    assert counts.total == pytest.approx(7 + p_any + 4 * mean + 4)
    assert counts.by_pipe["alu"] == pytest.approx(2 + mean * 2)  # FCHK, ISETP; LOP3 + ISETP
    assert counts.by_pipe["fma"] == pytest.approx(p_any + mean)  # IMAD.MOV; IMAD
    assert counts.by_pipe["lsu"] == pytest.approx(2)
    assert counts.loops == [{"header_address": 0xa0, "body_instructions": 4,
                             "mean_passes": mean, "p_any": p_any}]


def test_loop_without_measured_passes_is_an_error() -> None:
    """A loop in a kernel declared loop-free is reported, not silently counted once."""
    ins, labels = sass.parse_nvdisasm(LISTING, "_k")
    with pytest.raises(ValueError, match="loop"):
        sass.count_executed(ins, labels, "_k", None)


def test_unclassified_branch_is_reported() -> None:
    """A forward branch the model does not know is counted at 1/2 and named in the warnings."""
    listing = """
_k:
        /*0000*/               @P0 BRA `(.L_x_0) ;
        /*0010*/                   IADD3 R0, R0, 0x1, RZ ;
.L_x_0:
        /*0020*/                   EXIT ;
"""
    ins, labels = sass.parse_nvdisasm(listing, "_k")
    counts = sass.count_executed(ins, labels, "_k", None)
    assert counts.total == pytest.approx(2.5)
    assert len(counts.warnings) == 1 and "0x0" in counts.warnings[0]


def test_shared_memory_matrix_opcodes_count_on_the_lsu() -> None:
    """LDSM and STSM (matrix fragments from / to shared memory; Triton 3.6 emits STSM.16.M88.4 in
    the encoding kernels) count on the LSU pipe, as LDS and STS do, whatever their modifiers."""
    for opcode in ("LDS.128", "STS.64", "LDSM.16.M88.4", "STSM.16.M88.4", "STSM.16.MT88.2"):
        assert sass.pipe_of(opcode) == "lsu", opcode


def _nvidia_backend_usable() -> str | None:
    try:
        import kernels_aot
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401

        kernels_aot._tool("nvdisasm")
        kernels_aot._tool("cuobjdump")
    except Exception as exc:
        return f"{exc.__class__.__name__}: {exc}"
    return None


def test_fused_kernel_record_is_sane() -> None:
    """The fused hop at 4 bits, correlated rounding, compiled for sm_90 as a launch specialises it:
    positive counts, ALU <= total, spills an integer, pointers (but the per-row index) and the fp32
    row stride divisible by 16 (the record stride only when the record size is), and no loop
    (format 2: the permutation comes from a per-call table, no cycle walking)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    try:
        reason = _nvidia_backend_usable()
        if reason is not None:
            pytest.skip(f"no usable Triton NVIDIA backend: {reason}")
        import kernels_aot

        from dqcoll.kernels.codec import CodecConfig, RoundingMode, record_nbytes

        try:
            rec = kernels_aot.count_kernel("decode_accumulate_encode", 4,
                                           RoundingMode.CORRELATED)
        except RuntimeError as exc:  # ptxas cannot run on this machine
            pytest.skip(f"cannot compile for sm_90 here: {exc}")
    finally:
        sys.path.pop(0)
    record = record_nbytes(4, CodecConfig().scales)
    assert rec["kernel"] == "decode_accumulate_encode" and rec["bits"] == 4
    assert rec["rounding"] == "correlated"
    assert isinstance(rec["spills"], int) and rec["spills"] >= 0
    assert isinstance(rec["registers"], int) and 0 < rec["registers"] <= 255
    assert 0 < rec["int_pipe_per_coord"] <= rec["sass_per_coord"]
    assert 0 <= rec["int_pipe_assumed_per_coord"] <= rec["int_pipe_per_coord"]
    assert rec["sass_per_coord"] == pytest.approx(sum(rec["pipe_per_coord"].values()))
    assert rec["bytes_per_coord"] == pytest.approx((2 * record + 1024 + 8) / 256)
    assert 0 < rec["pct_of_copy"] <= 100 and rec["bound"] in ("issue", "alu")
    assert rec["loop_passes"] is None and rec["loops"] == []
    # As a launch specialises: every pointer (allocations and the payload segment at offset 0 are
    # 16-byte aligned) and the fp32 row stride (256) divisible by 16, except the per-row index
    # (do_not_specialize: callers slice it at any row); the record stride only if the record
    # size is.
    from dqcoll.kernels import _dynamiq_kernels

    unspecialised = set(_dynamiq_kernels._decode_accumulate_encode_kernel.do_not_specialize)
    assert "index_ptr" in unspecialised and not unspecialised & set(rec["divisible_by_16"])
    pointers = {k for k, v in rec["signature"].items() if v.startswith("*")} - unspecialised
    assert pointers and pointers <= set(rec["divisible_by_16"])
    strides = {k for k in rec["signature"] if k.endswith("row_stride")}
    divisible = {k for k in strides if k in rec["divisible_by_16"]}
    assert len(divisible) == (len(strides) if record % 16 == 0 else 1)
    assert rec["div_inexact"] == 0 and rec["div_rn_f32"] > 0  # IEEE divisions only
    assert rec["warnings"] == []
