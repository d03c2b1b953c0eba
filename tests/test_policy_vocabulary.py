"""One policy vocabulary for every integration: :class:`CompressionPolicy` and its text form
(``DQCOLL_POLICY``) say what the DDP hook, the FSDP2 classes and the ``dqcoll`` backend send;
:class:`DynamiqState` is built on it (its role: ``allreduce``) with at most ten parameters."""

from __future__ import annotations

import inspect

import pytest

from dqcoll.errors import InvalidArgumentError
from dqcoll.integrations.fsdp import FsdpCompression
from dqcoll.integrations.policy import CompressionPolicy, RoleRule
from dqcoll.integrations.torch_ddp import (
    DDP_DEFAULT_POLICY,
    DynamiqState,
    HookRuntime,
    ddp_policy,
)


def test_dynamiq_state_takes_at_most_ten_parameters() -> None:
    """The hook's state has at most ten constructor parameters; how it runs (algorithm, lanes,
    device, async, calibration, scheme options) is one of them, :class:`HookRuntime`."""
    params = [p for p in inspect.signature(DynamiqState.__init__).parameters if p != "self"]
    assert len(params) <= 10, params
    assert "policy" in params and "runtime" in params


def test_text_form_round_trips_every_field() -> None:
    """A policy's text parses back to the same policy, the new keys included: a role's target,
    ``auto``, error feedback and the monitor."""
    policy = CompressionPolicy(weights=RoleRule("int8_block"),
                               gradients=RoleRule("dynamiq", target=1e-3),
                               allreduce=RoleRule("auto", 4.0), warmup_steps=7, seed=3,
                               error_feedback=True, monitor_every=50)
    assert CompressionPolicy.parse(str(policy)) == policy
    text = "allreduce=dynamiq:target=0.002,error_feedback=true,monitor_every=10"
    parsed = CompressionPolicy.parse(text)
    assert parsed.allreduce == RoleRule("dynamiq", target=0.002)
    assert parsed.allreduce.options() == {"scheme": "dynamiq", "target_vnmse": 0.002}
    assert parsed.error_feedback and parsed.monitor_every == 10


@pytest.mark.parametrize("text, message", [
    ("allreduce=bf16:target=0.01", "error model"),
    ("allreduce=dynamiq:target=-1", "finite positive"),
    ("error_feedback=maybe", "error_feedback must be"),
    ("monitor_every=-2", "non-negative"),
])
def test_bad_text_is_refused_naming_the_key(text: str, message: str) -> None:
    """A bad value of a new key raises InvalidArgumentError when the text is parsed."""
    with pytest.raises(InvalidArgumentError, match=message):
        CompressionPolicy.parse(text)


def test_state_is_built_on_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """DynamiqState's fields come from its policy: the default policy, a policy's text, the
    keyword arguments on top (``None`` keeps the policy's value), and ``DQCOLL_POLICY`` read
    over the DDP default when no policy is given."""
    monkeypatch.delenv("DQCOLL_POLICY", raising=False)
    state = DynamiqState()
    assert state.policy == DDP_DEFAULT_POLICY
    assert (state.scheme, state.bits, state.warmup_steps) == ("auto", 5.0, 10)
    state = DynamiqState(policy="allreduce=dynamiq:3,warmup_steps=4,seed=9,monitor_every=2",
                         bits=6)
    assert (state.scheme, state.bits, state.warmup_steps, state.seed) == ("dynamiq", 6.0, 4, 9)
    assert state.monitor_every == 2 and str(state.policy).startswith("weights=")
    state = DynamiqState(scheme="dynamiq", target_vnmse=1e-3, error_feedback=True)
    assert state.target_vnmse == 1e-3 and state.error_feedback
    monkeypatch.setenv("DQCOLL_POLICY", "allreduce=dynamiq:4,error_feedback=1")
    state = DynamiqState()
    assert (state.scheme, state.bits, state.error_feedback, state.warmup_steps) == (
        "dynamiq", 4.0, True, 10)
    assert DynamiqState(scheme="none", bits=5).policy.allreduce == RoleRule("none")


def test_runtime_options_are_checked_when_made() -> None:
    """HookRuntime refuses bad lanes and calibration rates; the state refuses error feedback
    under ``auto`` and options its scheme does not take, when it is made."""
    with pytest.raises(InvalidArgumentError, match="lanes"):
        HookRuntime(lanes=0)
    with pytest.raises(InvalidArgumentError, match="calibration_rate"):
        HookRuntime(calibration_rate=0.0)
    with pytest.raises(InvalidArgumentError, match="error_feedback needs a fixed scheme"):
        DynamiqState(error_feedback=True)
    with pytest.raises(InvalidArgumentError):
        DynamiqState(scheme="dynamiq", runtime=HookRuntime(scheme_options={"colour": "red"}))
    assert ddp_policy("seed=5", scheme="int8_block").allreduce == RoleRule("int8_block")


def test_hook_only_keys_are_refused_by_the_other_integrations() -> None:
    """The FSDP2 classes and the backend run no error feedback and no monitor: a policy that
    asks for them raises there, naming the keys, instead of being silently ignored."""
    with pytest.raises(InvalidArgumentError, match="error_feedback=1 is the DDP hook's"):
        FsdpCompression(CompressionPolicy(error_feedback=True))
    with pytest.raises(InvalidArgumentError, match="monitor_every=3 is the DDP hook's"):
        CompressionPolicy(monitor_every=3).refuse_hook_only("the dqcoll backend")
