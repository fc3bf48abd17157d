"""Parameters unfrozen after planning (NOTE [ Parameters unfrozen after planning ] in remat/blocks.py): a plan
made on a half-frozen model saves more after ``requires_grad_(True)`` than its profile measured (1.21-1.30x the
budget on the built-in GPT and a Llama, gradients exact, silently: helper-122). The profile records how many
parameters require grad per block (and outside the blocks), the plan carries it, and the planned model warns
once (remat.RematWarning) when more do; freezing more, the safe direction, and an unchanged model stay quiet."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch import nn

import remat
from tests.apply.residual_net import ResidualNet, squared_loss


def _freeze_front(model: ResidualNet) -> None:
    """Freeze the input projection and the first half of the layers (a staged fine-tune)."""
    model.inp.requires_grad_(False)
    for layer in model.layers[:3]:
        layer.requires_grad_(False)


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    squared_loss(model(x)).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _step(model: ResidualNet, plain: ResidualNet, x: torch.Tensor) -> tuple[int, list[str]]:
    """Gradients bitwise equal to the plain model's in the same state; the measured peak and the warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert all(torch.equal(a, b) for a, b in zip(_grads(model, x), _grads(plain, x), strict=True))
        peak = remat.measure(model, x, squared_loss, steps=1, progress=False).peak_bytes
        model(x)
    return peak, [str(w.message) for w in caught if issubclass(w.category, remat.RematWarning)]


def _frozen_plan() -> tuple[ResidualNet, torch.Tensor, remat.Plan]:
    torch.manual_seed(0)
    model, x = ResidualNet(), torch.randn(512, 8)
    _freeze_front(model)
    prof = remat.profile(model, x, squared_loss, repeats=1, ops=False, progress=False)
    return model, x, remat.plan(prof, strategy=remat.selective([0, 2, 4]))


@pytest.mark.parametrize("unfreeze", ["the whole model", "one layer", "the input projection only"])
def test_unfreezing_after_planning_warns_once(unfreeze: str) -> None:
    model, x, plan = _frozen_plan()
    assert plan.trainable_params is not None and plan.trainable_params[0] == 0 and plan.trainable_params[3] == 4
    assert plan.predicted_peak_bytes is not None
    planned, plain = copy.deepcopy(model), copy.deepcopy(model)
    remat.apply(planned, plan)
    peak, warned = _step(planned, plain, x)  # as profiled: quiet
    assert warned == [] and peak <= plan.predicted_peak_bytes * 1.05, (warned, peak, plan.predicted_peak_bytes)
    for m in (planned, plain):
        parts = {"the whole model": m, "one layer": m.layers[1], "the input projection only": m.inp}
        parts[unfreeze].requires_grad_(True)
    peak, warned = _step(planned, plain, x)
    assert len(warned) == 1, (unfreeze, warned)
    assert "requiring grad" in warned[0] and "profile and plan again after changing requires_grad" in warned[0]
    if unfreeze == "one layer":
        assert "block 1 ('layers.1') has 4 parameters requiring grad, more than the 0" in warned[0], warned[0]
    if unfreeze == "the whole model":  # the oracle: that step really peaks above the plan's prediction
        assert peak > plan.predicted_peak_bytes * 1.05, (peak, plan.predicted_peak_bytes)
    assert _step(planned, plain, x)[1] == []  # once per applied plan
    # Applied again (a new plan applied): the check is back, and a plan of the unfrozen model is quiet.
    remat.apply(planned, plan)
    assert len(_step(planned, plain, x)[1]) == 1
    prof = remat.profile(planned, x, squared_loss, repeats=1, ops=False, progress=False)
    remat.apply(planned, remat.plan(prof, strategy=remat.selective([0, 2, 4])))
    assert _step(planned, plain, x)[1] == []


def test_freezing_after_planning_is_quiet_and_the_count_travels_in_plan_json() -> None:
    model, x, plan = _frozen_plan()
    assert plan.predicted_peak_bytes is not None
    planned, plain = copy.deepcopy(model), copy.deepcopy(model)
    remat.apply(planned, plan)
    for m in (planned, plain):  # the safe direction: fewer saved tensors than planned
        m.layers[4].requires_grad_(False)
    peak, warned = _step(planned, plain, x)
    assert warned == [] and peak <= plan.predicted_peak_bytes * 1.05, (warned, peak)
    # plan.json keeps the counts; a file written before them loads without and never warns.
    again = remat.Plan.from_json(plan.to_json())
    assert again == plan and again.trainable_params == plan.trainable_params
    data = json.loads(plan.to_json())
    del data["trainable_params"]
    old = remat.Plan.from_json(json.dumps(data))
    assert old.trainable_params is None
    unfrozen = copy.deepcopy(model).requires_grad_(True)
    plain = copy.deepcopy(unfrozen)
    remat.apply(unfrozen, old)
    assert _step(unfrozen, plain, x)[1] == []
    remat.apply(unfrozen, again)
    assert len(_step(unfrozen, plain, x)[1]) == 1
    data["trainable_params"] = [0, 1]
    with pytest.raises(remat.RematError, match="trainable_params"):
        remat.Plan.from_json(json.dumps(data))
