"""The public API is pinned: every change to it is a visible diff here."""

from __future__ import annotations

import inspect

import dqcoll


def test_public_names_are_pinned() -> None:
    """dqcoll.__all__ lists exactly the documented public names."""
    assert sorted(dqcoll.__all__) == sorted([
        "Communicator",
        "DqcollError",
        "ReduceOp",
        "__version__",
        "all_gather",
        "allreduce",
        "init",
        "metrics",
        "reduce_scatter",
        "schemes",
        "testing",
        "topology",
    ])
    for name in dqcoll.__all__:
        assert hasattr(dqcoll, name), name


def test_allreduce_signature() -> None:
    """allreduce takes the buffer positionally and everything else by keyword, with the documented
    defaults."""
    params = inspect.signature(dqcoll.allreduce).parameters
    assert next(iter(params)) == "buf"
    assert params["op"].default == "sum"
    assert params["scheme"].default == "dynamiq"
    assert params["bits"].default is None  # 5 bits (dqcoll.prepare.DEFAULT_BITS)
    assert params["comm"].default is None
    assert params["seed"].default is None
    for name, p in params.items():
        if name != "buf":
            assert p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD), name


def test_default_bits_is_five() -> None:
    """``bits=None`` (the default) is 5 bits: the same result, bit for bit, as ``bits=5``, and
    the same bits reported; with ``target_vnmse`` it leaves the bits to the target."""
    import torch

    from dqcoll.testing import run_local

    def body(comm):  # type: ignore[no-untyped-def]
        x = torch.randn(1000, generator=torch.Generator().manual_seed(comm.rank))
        default = dqcoll.allreduce(x.clone(), algorithm="ring", seed=1, step=0)
        default_bits = comm.last_info["bits"]
        five = dqcoll.allreduce(x.clone(), bits=5, algorithm="ring", seed=1, step=0)
        five_bits = comm.last_info["bits"]
        dqcoll.allreduce(x.clone(), algorithm="ring", target_vnmse=1e-2)
        return default, five, default_bits, five_bits

    for default, five, default_bits, five_bits in run_local(2, body):
        assert torch.equal(default, five)
        assert default_bits == five_bits


def test_import_needs_no_gpu_stack() -> None:
    """import dqcoll works without CuPy or Triton: neither is imported by the package import."""
    import subprocess
    import sys

    code = (
        "import sys; import dqcoll; "
        "print(any(m.split('.')[0] in ('cupy', 'triton') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_registries_list_builtin_names() -> None:
    """The scheme and algorithm registries know the foundation's names."""
    assert {"none", "dynamiq"} <= set(dqcoll.schemes.list_schemes())
    assert {"ring", "butterfly", "direct"} <= set(dqcoll.topology.algorithms.list_algorithms())
