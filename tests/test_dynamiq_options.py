"""DynamiQ's options (format presets, the lab's research knobs, flags) and the state a call keeps
on its communicator (the rho estimates, the CPU buffers)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dqcoll
from dqcoll.errors import InvalidArgumentError
from dqcoll.schemes import get
from dqcoll.schemes.dynamiq import FORMATS, DynamiqScheme, call
from dqcoll.testing import run_local
from dqcoll_lab.dynamiq import PAPER, PaperRule, research_format, research_scheme, scheme_options

# The paper's configuration spelled out, as tools/dense_gap.py and tools/make_accuracy_docs.py do.
PAPER_OPTIONS = {"stats": "fp32", "thresholds": "paper", "width_set": "paper",
                 "levels": "nonuniform", "scales": "hierarchical", "max_width": 8,
                 "hop_widths": False}


def _data(rank: int, numel: int, shared: float = 0.0) -> torch.Tensor:
    common = torch.randn(numel, generator=torch.Generator().manual_seed(99))
    own = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    return (shared * common + own) * torch.linspace(0.01, 4.0, numel)


def _allreduce(comm: dqcoll.Communicator, numel: int, options: dict[str, Any]
               ) -> tuple[torch.Tensor, dict[str, Any]]:
    x = _data(comm.rank, numel)
    dqcoll.allreduce(x, algorithm="butterfly", seed=3, **options)
    return x, dict(comm.last_info)


@pytest.mark.parametrize("preset, spelled", [("paper", PAPER_OPTIONS), ("dqcoll", {})])
def test_format_preset_equals_its_options_spelled_out(preset: str, spelled: dict[str, Any]
                                                      ) -> None:
    """format="paper" is the paper's configuration byte for byte (the same result as its seven
    research options), format="dqcoll" the defaults; every rank ends identical."""
    by_preset = run_local(3, _allreduce, 5000, {"format": preset})
    by_options = run_local(3, _allreduce, 5000, scheme_options(**spelled))
    for (x, info), (y, other) in zip(by_preset, by_options, strict=True):
        assert torch.equal(x, y) and torch.equal(x, by_preset[0][0])
        assert info["widths"] == other["widths"]
    if preset == "paper":
        assert set(by_preset[0][1]["widths"]) >= {2, 4, 8}
        assert all(by_preset[0][1]["widths"][w] == 0 for w in (3, 5, 6, 7, 16))


def test_research_option_overrides_its_preset_field() -> None:
    """A research knob replaces one field of the preset; the rest stays the preset's, and the
    allocation rule follows the fields."""
    scheme = research_scheme(format="paper", stats="norm16")
    assert scheme.format == PAPER.__class__(**{**PAPER.__dict__, "stats": "norm16"})
    assert isinstance(scheme.format.rule, PaperRule) and scheme.stats_bytes == 2
    assert FORMATS["paper"] is PAPER and DynamiqScheme().format.rule is None
    fine = research_scheme(format="paper", width_set="fine")
    assert fine.measured_errors is None and fine.format.rule is None
    assert research_format() == FORMATS["dqcoll"]


def test_runtime_takes_user_options_only() -> None:
    """The runtime's scheme takes the user options and a format; the research knobs are the
    lab's, and the error names where they are."""
    with pytest.raises(TypeError):
        DynamiqScheme(colour="blue")  # type: ignore[call-arg]
    with pytest.raises(InvalidArgumentError, match=r"does not take \['stats'\].*target_vnmse"):
        get("dynamiq", stats="fp32")
    with pytest.raises(InvalidArgumentError, match=r"format must be one of.*dqcoll_lab"):
        get("dynamiq", format="format3")
    assert get("dynamiq", format=PAPER).format is PAPER


def test_unknown_options_and_formats_name_the_valid_ones() -> None:
    """An unknown research option or format raises, naming what exists (the registry and the
    lab's scheme alike)."""
    with pytest.raises(InvalidArgumentError, match=r"research options.*width_set"):
        research_scheme(colour="blue")
    with pytest.raises(InvalidArgumentError, match=r"does not take.*target_vnmse"):
        get("dynamiq", colour="blue")
    with pytest.raises(InvalidArgumentError, match=r"format must be one of \['dqcoll', 'paper'\]"):
        research_scheme(format="format3")
    with pytest.raises(InvalidArgumentError, match="max_width"):
        research_scheme(max_width=12)


@pytest.mark.parametrize("value, expected", [
    (True, True), (False, False), (1, True), (0, False), ("true", True), ("False", False),
    ("1", True), ("0", False), ("yes", True), ("no", False), ("on", True), (" OFF ", False)])
def test_hop_widths_spellings(value: Any, expected: bool) -> None:
    """hop_widths takes a bool, 0/1 or the documented strings (the command line passes
    ``hop_widths=false`` as a string)."""
    assert research_scheme(hop_widths=value).hop_widths is expected


@pytest.mark.parametrize("value", ["maybe", 2, 1.0, None, "", [True]])
def test_hop_widths_rejects_other_values(value: Any) -> None:
    """Anything else raises and says what is accepted (it used to read as False)."""
    with pytest.raises(InvalidArgumentError, match="hop_widths must be true or false"):
        research_scheme(hop_widths=value)


@pytest.mark.parametrize("options", [scheme_options(hop_widths=False), {"format": "paper"}],
                         ids=["hull", "paper"])
def test_target_vnmse_with_one_width_per_super_group(options: dict[str, Any]) -> None:
    """target_vnmse without hop widths (the hull rule, and the paper's closed form): every rank
    picks the same widths, the prediction meets the target, and the error is near it. A first
    call has not measured the data's crests yet, so it does not claim the target met."""
    numel = 1 << 14
    results = run_local(4, _allreduce, numel, {"target_vnmse": 1e-3, **options})
    exact = sum(_data(r, numel).double() for r in range(4))
    x, info = results[0]
    assert info["target_met"] is False and info["crests"] is None
    assert info["predicted_vnmse"] <= info["predicted_vnmse_upper"] <= 1e-3
    assert info["rho"] == 0.0 and info["rho_source"] == "default"
    assert dqcoll.metrics.vnmse(x, exact) < 3e-3
    for y, other in results[1:]:
        assert torch.equal(x, y) and other["widths"] == info["widths"]


def test_rho_estimates_are_per_size_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """In target mode a call allocates with the rho its predecessor of the same size measured
    ("earlier call"); the estimates are an LRU of RHO_ENTRIES sizes, so a size pushed out starts
    from 0 again ("default"). Without target_vnmse no rho is read."""
    monkeypatch.setattr(call, "RHO_ENTRIES", 2)

    def body(comm: dqcoll.Communicator) -> list[tuple[Any, Any]]:
        seen = []
        for numel in (4096, 8192, 4096, 12288, 16384, 4096):
            x = _data(comm.rank, numel, shared=1.0)
            dqcoll.allreduce(x, algorithm="ring", target_vnmse=1e-3)
            seen.append((comm.last_info["rho_source"], comm.last_info["rho"]))
        dqcoll.allreduce(_data(comm.rank, 4096), algorithm="ring")
        seen.append((comm.last_info["rho_source"], comm.last_info["rho"]))
        return seen

    seen = run_local(3, body)[0]
    assert [s for s, _ in seen] == ["default", "default", "earlier call", "default", "default",
                                    "default", None]
    assert seen[2][1] > 0.1  # the ranks share half their signal: measured, not 0


def test_kept_buffers_are_reported_and_bounded_by_the_largest_call() -> None:
    """The CPU buffers a call keeps on its communicator (an input length that is no multiple
    of 256 needs the padded copy) are reported in last_info and grow only to the largest call
    seen: a smaller call after a larger one keeps the larger buffers, allocates nothing new."""

    def body(comm: dqcoll.Communicator) -> list[int]:
        kept = []
        for numel in (1000, 100_000, 3000):
            dqcoll.allreduce(_data(comm.rank, numel), algorithm="ring", op="avg")
            kept.append(comm.last_info["kept_buffer_nbytes"])
        return kept

    small, large, after = run_local(2, body)[0]
    assert 0 < small < large == after
    assert large <= 2 * 4 * 256 * -(-100_000 // 256)  # the input and the work rows, fp32
