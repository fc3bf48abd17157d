"""An op that fills a tensor it saved (``rrelu_with_noise``'s noise) is not cut off by the replay's early stop.

NOTE [ Ops that fill a saved argument ] in ``remat/core/runtime.py``: autograd saves RReLU's ``noise`` before
the kernel draws into it; a replay that stopped at the last saved tensor left it unfilled and the backward read
uninitialised memory (gradients off by up to 1e33, silently).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat


def _build(split: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(8, 8), nn.RReLU(), nn.Linear(8, 8)) for _ in range(3)]
    return nn.Sequential(*layers, nn.Linear(8, 1))


def _step(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model(x).pow(2).mean().backward()
        rng = torch.get_rng_state()
    return [p.grad.clone() for p in model.parameters()] + [rng]


@pytest.mark.parametrize("strategy", ["full()", "sqrt()", "selective([1])", "every_nth(2)"])
@pytest.mark.parametrize("split", [False, True], ids=["layers", "split"])
def test_rrelu_recomputed_bitwise(strategy: str, split: bool) -> None:
    x = torch.randn(4, 5, 8)
    plain = _step(_build(), x)
    model = _build()
    remat.apply(model, remat.plan(remat.blocks(model, split=split), strategy=strategy))
    got = _step(model, x)
    assert all(torch.equal(a, b) for a, b in zip(plain, got))
    remat.remove(model)


def test_rrelu_alone_as_a_block() -> None:
    # The RReLU module its own block: the last tensor its replay saves is its input, packed before the kernel.
    x = torch.randn(4, 8)
    make = lambda: (torch.manual_seed(0), nn.Sequential(nn.Linear(8, 8), nn.RReLU(), nn.Linear(8, 1)))[1]  # noqa: E731
    plain = _step(make(), x)
    model = make()
    remat.apply(model, remat.full())
    assert all(torch.equal(a, b) for a, b in zip(plain, _step(model, x)))


def test_rrelu_plan_measured_within_budget() -> None:
    # Running the member's call to its end costs no more than the plan predicts on such a stack.
    model = _build()
    x = torch.randn(16, 12, 8)
    loss_fn = lambda out: out.pow(2).mean()  # noqa: E731
    prof = remat.profile(model, x, loss_fn, blocks=remat.blocks(model, split=True), repeats=1)
    for plan in (remat.plan(prof, strategy=remat.full()), remat.plan(prof, "70%")):
        remat.apply(model, plan)
        measured = remat.measure(model, x, loss_fn, steps=1).peak_bytes
        remat.remove(model)
        assert plan.predicted_peak_bytes is not None
        assert measured <= 1.05 * plan.predicted_peak_bytes, (plan.describe(), measured, plan.predicted_peak_bytes)
        if plan.budget_bytes is not None:
            assert measured <= 1.05 * plan.budget_bytes


class _LinearRReLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 64)
        self.act = nn.RReLU()
        self.out = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(self.act(self.fc(x)))


def _rrelu_stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(_LinearRReLU()) for _ in range(4)], nn.Linear(8, 1))


def test_no_op_level_policy_for_rrelu_blocks() -> None:
    # Torch's selective checkpoint stops its recomputation before rrelu_with_noise's kernel: a policy
    # recomputing it computed other gradients (1e-4 to 1e-3 off, silently). The menu offers none.
    from remat.plan.policies import op_costs

    x = torch.randn(16, 8)
    model = _rrelu_stack()
    prof = remat.profile(model, x, lambda out: out.pow(2).mean(), repeats=1)
    assert all(bo.fills_saved for bo in prof.block_ops[:4])
    assert not [k for k, _ in op_costs(prof) if k < 4]
    try:
        remat.plan(prof, "1B")
    except remat.BudgetInfeasibleError as e:
        smallest = e.min_peak_bytes
    plan = remat.plan(prof, smallest)
    applied = _rrelu_stack()
    remat.apply(applied, plan)
    assert all(torch.equal(a, b) for a, b in zip(_step(_rrelu_stack(), x), _step(applied, x)))


def test_hand_written_policy_on_rrelu_is_refused() -> None:
    from remat.core.ops import RecomputeOps
    from remat.plan import Keep, Plan

    model = _rrelu_stack()
    blocks = remat.blocks(model)
    ops = (RecomputeOps(0, ("addmm#0",), ("rrelu_with_noise#0",)), *(Keep(i) for i in range(1, len(blocks))))
    plan = Plan(strategy="by hand", blocks=tuple(blocks), ops=ops)
    remat.apply(model, plan)
    with pytest.raises(remat.RematError, match=r"rrelu_with_noise.*op-level policy"):
        model(torch.randn(4, 8)).sum().backward()
