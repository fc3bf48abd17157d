"""remat.blocks on a flat nn.Sequential that repeats a pattern of several children ((Linear, GELU) pairs,
(Linear, GELU, Dropout) triples, e3nn's (o3.Linear, Gate)): every child of the Sequential is a block, so a 50%
plan is found, measures within its budget and its prediction, and gives bitwise-equal gradients (it was
refused: the blocks were only the first two Linears)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat


def names(block_list: tuple[remat.Block, ...]) -> list[str]:
    return [b.name for b in block_list]


def _grads(model: nn.Module, x: torch.Tensor, loss_fn) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout masks in both runs
    loss_fn(model(x)).backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _mlp(pattern: str) -> nn.Sequential:
    torch.manual_seed(0)
    layer = {
        "pair": lambda: (nn.Linear(64, 64), nn.GELU()),
        "triple": lambda: (nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.1)),
    }[pattern]
    return nn.Sequential(nn.Linear(8, 64), *[m for _ in range(6) for m in layer()], nn.Linear(64, 1))


@pytest.mark.parametrize("pattern", ["pair", "triple"])
def test_a_repeating_pattern_of_children_gives_each_child_a_block(pattern: str) -> None:
    model = _mlp(pattern)
    period = 2 if pattern == "pair" else 3
    # A chain of unlike links: all of them, the stem and the head too.
    assert names(remat.blocks(model)) == [str(i) for i in range(6 * period + 2)]
    _check(model, torch.randn(512, 8), "50%")


def _check(model: nn.Module, x: torch.Tensor, budget: str) -> None:
    prof = remat.profile(model, x, _loss, repeats=1, progress=False)
    plan = remat.plan(prof, budget=budget)
    assert plan.budget_bytes is not None and plan.predicted_peak_bytes <= plan.budget_bytes
    plain = _grads(model, x, _loss)
    remat.apply(model, plan)
    try:
        got = _grads(model, x, _loss)
        measured = remat.measure(model, x, _loss, steps=1, warmup=1, progress=False).peak_bytes
    finally:
        remat.remove(model)
    assert plain.keys() == got.keys() and all(torch.equal(plain[n], got[n]) for n in plain)
    assert measured <= 1.05 * plan.budget_bytes, (measured, plan.budget_bytes)
    assert abs(measured - plan.predicted_peak_bytes) <= 0.05 * plan.predicted_peak_bytes, (
        measured,
        plan.predicted_peak_bytes,
    )


def test_runs_of_identical_children_and_no_pattern_are_unchanged() -> None:
    # Period 1 (identical leaves) as before; too short to repeat (one period): the root's children.
    assert names(remat.blocks(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)))) == ["0", "1", "2"]
    assert names(remat.blocks(nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1)))) == ["0", "1", "2"]
    # The longest run wins: four identical Linears then one (Linear, ReLU) pair.
    seq = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)], nn.ReLU(), nn.Linear(16, 2))
    assert names(remat.blocks(seq)) == ["0", "1", "2", "3"]


class _Wrapped(nn.Module):
    """A projection inside a module of its own (as e3nn's o3.Linear): a layer, with children and weights."""

    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        self.inner = nn.Linear(i, o)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class _Gate(nn.Module):
    """Weightless, with children of its own (as e3nn's Gate)."""

    def __init__(self) -> None:
        super().__init__()
        self.act, self.gate = nn.SiLU(), nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, g = x.chunk(2, dim=-1)
        return torch.cat([self.act(a), self.gate(g) * a], dim=-1)


def test_layers_alternating_with_weightless_modules_are_all_blocks() -> None:
    # The stem and the first layer are alike (a "stack" of two, as the only blocks, before); the chain
    # repeats (layer, gate): all its children.
    torch.manual_seed(0)
    model = nn.Sequential(_Wrapped(8, 64), *[m for _ in range(5) for m in (_Wrapped(64, 64), _Gate())], _Wrapped(64, 1))
    assert names(remat.blocks(model)) == [str(i) for i in range(12)]
    _check(model, torch.randn(512, 8), "50%")
