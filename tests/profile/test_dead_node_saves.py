"""An attention sub-module whose forward has a node that saves a tensor and dies right away (FAVOR+'s
``x.amax(...).detach()`` in performer-pytorch's softmax_kernel: amax saves its input and result, the node is
freed with the undetached result, the input after the next op): checkpointing the sub-module alone frees
only what the graph still holds at its end. Counted as freed, every ``S{...}`` plan was predicted low by the
dead tensors (PerformerLM: 180,256 B per sub-module, 1.053x its budget)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import remat
from remat.core.ops import Keep, RecomputeSub
from remat.plan.planner import plan_from_ops


def _features(x: torch.Tensor) -> torch.Tensor:
    # amax saves x and its result; .detach() drops the node at once, so neither is held by the graph.
    return torch.exp(x - x.amax(dim=-1, keepdim=True).detach()) + 1e-4


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = _features(self.q(x)), _features(self.k(x)), self.v(x)
        context = (k * v).cumsum(dim=1)
        norm = k.cumsum(dim=1)
        return self.drop(self.o(q * context / (q * norm)))


class PreNorm(nn.Module):
    """performer-pytorch's PreLayerNorm: its sub-module's output is the block's output."""

    def __init__(self, d: int, fn: nn.Module) -> None:
        super().__init__()
        self.norm, self.fn = nn.LayerNorm(d), fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.norm(x))


class Net(nn.Module):
    def __init__(self, d: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleList(
                [
                    PreNorm(d, Attention(d)),
                    PreNorm(d, nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))),
                ]
            )
            for _ in range(depth)
        )
        self.head = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for attn, ffn in self.layers:
            x = x + attn(x)
            x = x + ffn(x)
        return self.head(x)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.logsumexp(-1).mean()


def _run() -> tuple[nn.Module, torch.Tensor, remat.Profile]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Net()
        x = torch.randn(4, 96, 64)
    return model, x, remat.profile(copy.deepcopy(model), x, _loss, repeats=1, ops=False)


def _measure(model: nn.Module, plan: remat.Plan, x: torch.Tensor) -> int:
    check = remat.check_gradients(model, plan, x, _loss)
    assert check.equal and check.exact, check.mismatched
    remat.apply(model, plan)
    try:
        return remat.measure(model, x, _loss, steps=1).peak_bytes
    finally:
        remat.remove(model)


def test_identical_layers_attentions_free_the_same_bytes() -> None:
    _, _, prof = _run()
    subs = [s for b, bp in zip(prof.blocks, prof.block_profiles) if b.attention_fqns for s in bp.subs]
    assert len(subs) == 4
    assert len({s.saved_bytes for s in subs}) == 1, [s.saved_bytes for s in subs]
    # Its backward starts with its block's (NOTE [ A sub-module returning the block's output ]).
    assert all(s.bwd_peak_bytes is not None for s in subs)


def test_attentions_checkpointed_alone_are_predicted_at_their_peak() -> None:
    model, x, prof = _run()
    subs = [b for b in prof.blocks if b.attention_fqns]
    assert len(subs) == 4
    for kept_with_subs in ({subs[1].index}, {subs[-1].index}, {b.index for b in subs}):
        ops = tuple(
            RecomputeSub(b.index, b.attention_fqns) if b.index in kept_with_subs else Keep(b.index) for b in prof.blocks
        )
        plan = plan_from_ops(prof, ops, "test")
        assert plan.predicted_peak_bytes is not None
        measured = _measure(copy.deepcopy(model), plan, x)
        assert abs(measured / plan.predicted_peak_bytes - 1) <= 0.01, (measured, plan.predicted_peak_bytes)


def test_the_smallest_plan_stays_within_its_budget() -> None:
    model, x, prof = _run()
    try:
        plan = remat.plan(prof, budget="1%")
    except remat.errors.BudgetInfeasibleError as e:
        plan = remat.plan(prof, budget=e.min_peak_bytes)
    measured = _measure(copy.deepcopy(model), plan, x)
    assert measured <= plan.budget_bytes * 1.05, (measured, plan.budget_bytes, plan.describe())
    assert plan.predicted_peak_bytes is not None
    assert abs(measured / plan.predicted_peak_bytes - 1) <= 0.05, (measured, plan.predicted_peak_bytes)
