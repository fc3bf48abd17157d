"""NOTE [ Parameters edited by the forward ] in ``remat.core.probe``: a block whose forward edits one of its
parameters in place (``nn.Embedding(max_norm=...)`` renormalises the rows it looks up) is stateful. The
profile used to fail on such a model in its first checkpointed timing iteration (with a message about
``apply``); now it profiles, the planner keeps that block, and the plan's gradients and parameters match
the plain model's bitwise."""

from __future__ import annotations

import copy

import torch
from torch import nn

import remat


class Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Lookup(nn.Module):
    """A block that embeds token ids with a renormalising embedding and adds them to the stream."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, d, max_norm=1.0)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return x + self.emb(ids)


class Net(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.layers = nn.ModuleList([Layer(d), Layer(d)])
        self.lookup = Lookup(d)
        self.more = nn.ModuleList([Layer(d), Layer(d)])

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        h = self.lookup(h, ids)
        for layer in self.more:
            h = layer(h)
        return h


def _case() -> tuple[Net, tuple[torch.Tensor, torch.Tensor], list[remat.Block]]:
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.lookup.emb.weight.mul_(5.0)  # rows above max_norm: every forward renormalises those it looks up
    x, ids = torch.randn(4, 16, 8), torch.randint(0, 50, (4, 16))
    blocks = remat.blocks(model, named=["layers.0", "layers.1", "lookup", "more.0", "more.1"])
    return model, (x, ids), blocks


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _step(model: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    _loss(model(*inputs)).backward()
    return [p.grad.clone() for p in model.parameters()]


def _smallest(prof: remat.Profile) -> remat.Plan:
    try:
        remat.plan(prof, "1B")
    except remat.BudgetInfeasibleError as e:
        return remat.plan(prof, e.min_peak_bytes)
    raise AssertionError("a 1-byte budget was accepted")


def test_a_block_editing_its_parameter_is_profiled_as_stateful_and_kept() -> None:
    model, inputs, blocks = _case()
    before = copy.deepcopy(model)
    prof = remat.profile(model, inputs, _loss, blocks=blocks, repeats=1, progress=False)
    lookup = prof.block_profiles[2]
    assert any(s.startswith("parameter ") and "weight" in s for s in lookup.stateful), lookup.stateful
    assert not any(bp.stateful for i, bp in enumerate(prof.block_profiles) if i != 2)
    # The profile left the model as plain forwards do: parameters are not copied and put back, so the
    # forward's own edit stays (renormalising again moves a row by at most one rounding step).
    before(*inputs)
    for a, b in zip(before.state_dict().values(), model.state_dict().values()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
    plan = _smallest(prof)
    assert 2 not in plan.checkpointed and plan.checkpointed, plan.describe()
    ref_model = copy.deepcopy(model)
    ref = _step(ref_model, inputs)
    remat.apply(model, plan)
    got = _step(model, inputs)
    remat.remove(model)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    assert torch.equal(ref_model.lookup.emb.weight, model.lookup.emb.weight)


def test_the_smallest_plan_keeps_it_and_fits() -> None:
    model, inputs, blocks = _case()
    prof = remat.profile(model, inputs, _loss, blocks=blocks, repeats=1, progress=False)
    plan = _smallest(prof)
    assert 2 not in plan.checkpointed
    m = remat.measure(copy.deepcopy(model), inputs, _loss, steps=1, progress=False)
    applied = copy.deepcopy(model)
    remat.apply(applied, plan)
    measured = remat.measure(applied, inputs, _loss, steps=1, progress=False).peak_bytes
    assert measured <= 1.05 * plan.budget_bytes, (measured, plan.budget_bytes)
    assert measured < m.peak_bytes
