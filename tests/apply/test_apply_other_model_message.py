"""A plan applied to another model says so and how to fix it (helper-110's first hour).

``remat measure resnet --plan plan.json`` with a GPT's plan said "... block 'blocks.0' is not in ResNet;
select blocks on this model", a fix a command-line user cannot apply: the plan is for another model.
"""

from __future__ import annotations

import pytest
from torch import nn

import remat
from remat.errors import PlanMismatchError


def test_a_plan_for_another_model_names_its_blocks_and_the_fix() -> None:
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)])
    plan = remat.plan(nn.ModuleDict({"layers": layers}), strategy=remat.full())
    other = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(
        PlanMismatchError,
        match=r"^apply: the plan \(full\) does not fit this model: block 'layers\.0' is not in Sequential; the plan "
        r"was made for another model \(blocks layers\.0\.\.layers\.2\): profile and plan this model again$",
    ):
        remat.apply(other, plan)
    assert remat.applied(other) is None
