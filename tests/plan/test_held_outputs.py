"""Blocks whose outputs are alive whatever the plan, and blocks that return their input: plans from the
profile stay within their budgets and measure what they predict.

- An FPN keeps its stage outputs in a list for its top-down path: a policy that recomputes a stage's
  closing ReLU frees nothing of that output (NOTE [ The block's output is held anyway ] in
  ``remat.plan.policies``).
- A stochastic-depth ResNet split into its layers has an ``nn.Identity`` where the drop rate is 0: a
  segment ending at it returns the output of the block before, made inside the segment, which the chain
  does not charge (``remat.plan.chain.chain_of``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.core.ops import RecomputeOps
from remat.plan.chain import chain_of
from remat.plan.policies import make_policy, policy_menu
from remat.profile import Profile
from remat.profile.ops import BlockOps, OpRecord

from ..conftest import exact_peak

# --- an FPN -----------------------------------------------------------------------------------------


class _Stage(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.c1, self.n1 = nn.Conv2d(cin, cout, 3, 2, 1), nn.GroupNorm(4, cout)
        self.c2, self.n2 = nn.Conv2d(cout, cout, 3, 1, 1), nn.GroupNorm(4, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.n2(self.c2(F.relu(self.n1(self.c1(x))))))


class _FPN(nn.Module):
    """Stage outputs kept in a list; the top-down path reads every one of them (its lateral convs save them)."""

    def __init__(self, ch: tuple[int, ...] = (16, 32, 64, 64)) -> None:
        super().__init__()
        self.stages = nn.ModuleList()
        c = 3
        for co in ch:
            self.stages.append(_Stage(c, co))
            c = co
        self.lat = nn.ModuleList(nn.Conv2d(co, 32, 1) for co in ch)
        self.head = nn.Conv2d(32, 5, 3, padding=1)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        feats = []
        for stage in self.stages:
            x = stage(x)
            feats.append(x)
        p = self.lat[-1](feats[-1])
        outs = [p]
        for f, lat in zip(reversed(feats[:-1]), reversed(list(self.lat[:-1]))):
            p = lat(f) + F.interpolate(p, size=f.shape[-2:], mode="nearest")
            outs.append(p)
        return [self.head(o) for o in outs]


def _fpn_loss(outs: list[torch.Tensor]) -> torch.Tensor:
    return sum((o.pow(2).mean() for o in outs), torch.zeros(()))


@pytest.fixture(scope="module")
def fpn() -> tuple[_FPN, torch.Tensor, Profile]:
    torch.manual_seed(0)
    model, x = _FPN(), torch.randn(4, 3, 64, 64)
    return model, x, remat.profile(model, (x,), _fpn_loss, repeats=1)


def test_every_stage_policy_caches_the_stage_output(fpn) -> None:
    _, _, prof = fpn
    for block_ops in prof.block_ops:
        (out,) = block_ops.outputs
        key = block_ops.ops[out].key  # the closing relu
        menu = policy_menu(block_ops)
        assert menu
        for policy in menu:
            assert key in policy.save and key not in policy.freed, policy


def _budgets(prof: Profile) -> list[Any]:
    try:
        remat.plan(prof, budget="1B")
    except remat.BudgetInfeasibleError as e:
        return [e.min_peak_bytes, "80%"]
    raise AssertionError("a 1-byte budget was feasible")


def _within(model: nn.Module, inputs: Any, loss_fn: Any, prof: Profile) -> None:
    for budget in _budgets(prof):
        plan = remat.plan(prof, budget=budget)
        measured = exact_peak(model, plan, inputs, loss_fn)
        assert plan.budget_bytes is not None and plan.predicted_peak_bytes is not None
        assert measured <= 1.05 * plan.budget_bytes, (budget, plan.describe(), measured)
        assert 0.95 * plan.predicted_peak_bytes <= measured <= 1.05 * plan.predicted_peak_bytes, (
            budget,
            plan.describe(),
            plan.predicted_peak_bytes,
            measured,
        )


def test_fpn_plans_with_op_policies_measure_what_they_predict(fpn) -> None:
    model, x, prof = fpn
    # The smallest budget needs op-level policies on the stages (they were 1.18x over before).
    plan = remat.plan(prof, budget=_budgets(prof)[0])
    assert any(isinstance(op, RecomputeOps) for op in plan.ops), plan.describe()
    _within(model, x, _fpn_loss, prof)


def test_recomputing_an_output_op_frees_none_of_it() -> None:
    # conv (saved by norm) -> norm -> relu (output, saved by itself), as a stage's ops.
    ops = (
        OpRecord(0, "convolution#0", "convolution", 1.0, 1000, 1000, (), (0,)),
        OpRecord(1, "native_group_norm#0", "native_group_norm", 0.5, 1016, 16, (0,), (1,)),
        OpRecord(2, "relu#0", "relu", 0.1, 1000, 1000, (1,), (2,)),
    )
    b = BlockOps(0, "stages.0", ops, saved_bytes=2016, input_saved_bytes=0, stop=3, outputs=(2,))
    recomputed = make_policy(b, ["convolution#0"])
    assert recomputed.freed_bytes == 16 and recomputed.freed == ("native_group_norm#0",)
    cached = make_policy(b, ["convolution#0", "relu#0"])
    assert cached.freed_bytes == 16 and cached.held_bytes == 2000
    # Every option caches the output; the one that frees most recomputes the conv and the norm.
    menu = policy_menu(b)
    assert all("relu#0" in p.save for p in menu)
    assert menu[-1].save == ("relu#0",) and menu[-1].freed_bytes == 1016


# --- a split stochastic-depth ResNet ---------------------------------------------------------------


class _DropPath(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.rand(x.shape[0], 1, 1, 1) >= self.p
        return x * keep / (1 - self.p)


class _SDBlock(nn.Module):
    def __init__(self, c: int, p: float) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.dp = _DropPath(p) if p > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.dp(self.bn2(self.conv2(h))))


class _SDResNet(nn.Module):
    def __init__(self, c: int = 32, n: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(*(_SDBlock(c, 0.3 * i / (n - 1)) for i in range(n)))
        self.fc = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.blocks(self.stem(x)).mean((2, 3)))


@pytest.fixture(scope="module")
def sd_resnet() -> tuple[_SDResNet, torch.Tensor, Any, Profile]:
    torch.manual_seed(0)
    model, x, y = _SDResNet(), torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    blocks = remat.blocks(model, split=True)
    return model, x, loss_fn, remat.profile(model, x, loss_fn, blocks=blocks, repeats=1)


def test_no_segment_goes_on_into_a_block_that_returns_its_input(sd_resnet) -> None:
    _, _, _, prof = sd_resnet
    names = [b.name for b in prof.blocks]
    identity = names.index("blocks.0.dp")
    assert prof.block_profiles[identity].own_output_bytes == 0 < prof.block_profiles[identity].output_bytes
    assert not chain_of(prof).joinable[identity - 1]


def test_split_stochastic_depth_plans_measure_what_they_predict(sd_resnet) -> None:
    model, x, loss_fn, prof = sd_resnet
    _within(model, x, loss_fn, prof)
