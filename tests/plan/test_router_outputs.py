"""Blocks that return a router's output beside the hidden state (an MoE layer's top-1 index, a bool mask,
a load-balancing loss), which the model's code uses between blocks: what that code saves for the backward
(``x.gather(1, idx)`` saves the hidden state and the index) is held whatever the plan, and the profile
measures it (NOTE [ What stays alive anyway ] in ``remat.profile.profiler``). Plans made from the profile
stay within their budgets and measure what they predict."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.plan.planner import plan_from_ops
from remat.plan.types import ops_from_text
from remat.profile import Profile

from ..conftest import exact_peak

D, N, L = 32, 1024, 6
KINDS = ("index", "index_only", "mask", "aux_loss")


class _Router(nn.Module):
    """``y = x + tanh(fc(x))``, returned with a side output of the kind asked for."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x + torch.tanh(self.fc(x))
        if self.kind in ("index", "index_only"):
            return y, y.argmax(-1)  # int64, as a top-1 router's expert index
        if self.kind == "mask":
            return y, y > 0
        return y, y.softmax(-1).mean(0).square().sum()  # a load-balancing loss


class _Net(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.layers = nn.ModuleList(_Router(kind) for _ in range(L))
        self.head = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = x.new_zeros(())
        for layer in self.layers:
            x, side = layer(x)
            if self.kind == "index":
                acc = acc + x.gather(1, side[:, None]).mean()  # saves x and the index
            elif self.kind == "index_only":
                acc = acc + side.float().mean()  # saves nothing
            elif self.kind == "mask":
                acc = acc + (x * side).mean()  # saves the mask
            else:
                acc = acc + side
        return self.head(x) + acc


def _case(kind: str) -> tuple[_Net, torch.Tensor, object]:
    torch.manual_seed(0)
    model, x, target = _Net(kind), torch.randn(N, D, requires_grad=True), torch.randn(N, D)
    return model, x, lambda out: F.mse_loss(out, target)


@pytest.fixture(scope="module", params=KINDS)
def routed(request: pytest.FixtureRequest) -> tuple[str, _Net, torch.Tensor, object, Profile]:
    model, x, loss_fn = _case(request.param)
    return request.param, model, x, loss_fn, remat.profile(model, x, loss_fn, repeats=1)


def test_the_profile_counts_what_the_models_code_saves_of_a_blocks_output(routed) -> None:
    kind, _, _, _, prof = routed
    hidden, index, mask = N * D * 4, N * 8, N * D
    held = {"index": hidden + index, "index_only": 0, "mask": mask, "aux_loss": 0}[kind]
    # Every block but the last two: the last one's whole output is alive at its end, and the model's local
    # variables still refer to the one before's side output then.
    assert [bp.pinned_out_bytes for bp in prof.block_profiles[:-2]] == [held] * (L - 2)


@pytest.mark.parametrize(
    "text",
    [
        "R[0:1](K0) R[1:2](K1) R[2:3](K2) R[3:4](K3) R[4:5](K4) R[5:6](K5)",
        "R[0:3](R[0:1](K0) R[1:2](K1) K2) R[3:5](R[3:4](K3) K4) R[5:6](K5)",
        "R[0:3](K0 K1 K2) K3 K4 K5",
        "K0 K1 K2 R[3:5](K3 K4) K5",
        "R[0:2](K0 K1) R[2:4](K2 K3) R[4:6](K4 K5)",
    ],
)
def test_segments_over_blocks_whose_outputs_the_model_holds_are_predicted(routed, text: str) -> None:
    kind, model, x, loss_fn, prof = routed
    plan = plan_from_ops(prof, ops_from_text(text), "by hand")
    measured = exact_peak(model, plan, x, loss_fn)
    # Below: each checkpoint is charged its own RNG state (5 KiB), which checkpoints in a row share.
    assert 0.95 * plan.predicted_peak_bytes <= measured <= 1.05 * plan.predicted_peak_bytes, (kind, measured)


def test_plans_stay_within_their_budgets(routed) -> None:
    kind, model, x, loss_fn, prof = routed
    try:
        remat.plan(prof, budget="1B")
    except remat.BudgetInfeasibleError as e:
        floor = e.min_peak_bytes
    for budget in (floor, "70%", "85%"):
        plan = remat.plan(prof, budget=budget)
        measured = exact_peak(model, plan, x, loss_fn)
        assert plan.budget_bytes is not None and plan.predicted_peak_bytes is not None
        assert measured <= 1.05 * plan.budget_bytes, (kind, budget, plan.describe(), measured)
        assert 0.95 * plan.predicted_peak_bytes <= measured <= 1.05 * plan.predicted_peak_bytes, (
            kind,
            budget,
            plan.describe(),
            measured,
        )
