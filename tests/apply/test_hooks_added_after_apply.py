"""Forward hooks registered on planned modules after remat.apply (NOTE [ Hooks added after apply ] in
remat/core/runtime.py): one that returns another tensor between two members of a segment broke the link
the segment replays, and the step peaked at 1.087x the plan's prediction with exact gradients, silently
(helper-119). Such a hook is refused in the forward, before any backward; hooks that return nothing or
what they were given keep working, bitwise, within the plan's prediction."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import remat
from tests.apply.residual_net import ResidualNet, squared_loss

Hook = Callable[[ResidualNet], Any]
# segments(3): R[0:2] R[2:4] R[4:6], where layers.2's output is layers.3's input (a link).
_STRATEGY = remat.segments(3)
_REPLACING: dict[str, Hook] = {
    "forward hook": lambda m: m.layers[2].register_forward_hook(lambda _m, _a, out: out * 0.5),
    "pre-hook": lambda m: m.layers[3].register_forward_pre_hook(lambda _m, args: (args[0] * 2.0,)),
    "pre-hook, a lone value": lambda m: m.layers[3].register_forward_pre_hook(lambda _m, args: args[0] * 2.0),
    "forward hook with kwargs": lambda m: m.layers[2].register_forward_hook(
        lambda _m, _a, _k, out: out + 1.0, with_kwargs=True
    ),
}
_KEEPING: dict[str, Hook] = {
    "logging hook": lambda m: m.layers[2].register_forward_hook(lambda _m, _a, out: None),
    "forward hook returning its output": lambda m: m.layers[2].register_forward_hook(lambda _m, _a, out: out),
    "pre-hook returning its arguments": lambda m: m.layers[3].register_forward_pre_hook(lambda _m, args: args),
    "pre-hook with kwargs": lambda m: m.layers[3].register_forward_pre_hook(
        lambda _m, args, kwargs: (args, kwargs), with_kwargs=True
    ),
    # Outside a link: the segment's last member's output and first member's inputs are no link.
    "forward hook on a segment's last member": lambda m: m.layers[3].register_forward_hook(lambda _m, _a, o: o * 0.5),
    "pre-hook on a segment's first member": lambda m: m.layers[2].register_forward_pre_hook(lambda _m, a: (a[0] * 2,)),
}


def _setup(hook: Hook | None = None) -> tuple[ResidualNet, torch.Tensor, remat.Plan]:
    torch.manual_seed(0)
    model, x = ResidualNet(), torch.randn(512, 8)
    if hook is not None:
        hook(model)
    prof = remat.profile(model, x, squared_loss, repeats=1, ops=False, progress=False)
    return model, x, remat.plan(prof, strategy=_STRATEGY)


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    squared_loss(model(x)).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_hooks_added_after_apply_are_refused_where_they_break_a_link_and_run_elsewhere() -> None:
    model, x, plan = _setup()
    assert plan.predicted_peak_bytes is not None
    for name, add in _REPLACING.items():
        planned = copy.deepcopy(model)
        remat.apply(planned, plan)
        add(planned)
        try:
            peak = remat.measure(planned, x, squared_loss, steps=1, progress=False).peak_bytes
        except remat.RematError as e:  # refused: the message says which module and why
            assert "after remat.apply" in str(e) and ("layers.2" in str(e) or "layers.3" in str(e)), (name, str(e))
            with pytest.raises(remat.RematError, match="register the hook before remat.profile"):
                planned(x)  # in the forward, before any backward
        else:  # or planned with it: the oracle is the prediction
            assert peak <= plan.predicted_peak_bytes * 1.05, (name, peak, plan.predicted_peak_bytes)
    for name, add in _KEEPING.items():
        plain, planned = copy.deepcopy(model), copy.deepcopy(model)
        add(plain)
        remat.apply(planned, plan)
        add(planned)
        assert all(torch.equal(a, b) for a, b in zip(_grads(planned, x), _grads(plain, x), strict=True)), name
        peak = remat.measure(planned, x, squared_loss, steps=1, progress=False).peak_bytes
        assert peak <= plan.predicted_peak_bytes * 1.05, (name, peak, plan.predicted_peak_bytes)
        hooks = [
            (k, h) for m in planned.modules() for d in (m._forward_hooks, m._forward_pre_hooks) for k, h in d.items()
        ]
        remat.remove(planned)
        after = [
            (k, h) for m in planned.modules() for d in (m._forward_hooks, m._forward_pre_hooks) for k, h in d.items()
        ]
        assert len(after) == 1 and len(hooks) >= 1  # the user's hook, as it was registered
        assert isinstance(after[0][1], type(lambda: None)), (name, after)
    # A replacing hook registered before the profile is the plan's (the profile measured what it changes):
    # not refused, bitwise, within the prediction; remat's own timeline hooks on the planned modules run too.
    model, x, plan = _setup(_REPLACING["forward hook"])
    plain = copy.deepcopy(model)
    remat.apply(model, plan)
    assert all(torch.equal(a, b) for a, b in zip(_grads(model, x), _grads(plain, x), strict=True))
    peak = remat.measure(model, x, squared_loss, steps=1, progress=False).peak_bytes
    assert plan.predicted_peak_bytes is not None and peak <= plan.predicted_peak_bytes * 1.05
    assert remat.timeline(model, x, squared_loss).runs("recompute")
