"""A block whose output is edited in place by an op that saves a copy of its input (SiLU(inplace=True)):
a replay ending with it makes the output before it stops, so plans must charge it (out_free_bytes)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat


class _Blk(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(d, d, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.conv(x.transpose(1, 2)).transpose(1, 2), inplace=True)


class _Net(nn.Module):
    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.layers = nn.ModuleList([_Blk(d) for _ in range(3)])
        self.head = nn.Linear(d, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _grads(model, x, loss_fn):
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)
    loss_fn(model(x)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("what", ["min", "every_nth(2)", "full"])
def test_inplace_closing_op_is_charged(what: str) -> None:
    torch.manual_seed(0)
    model = _Net()
    x, tgt = torch.randn(2, 32, 16), torch.randn(2, 32, 7)
    loss_fn = lambda y: F.mse_loss(y, tgt)  # noqa: E731
    ref = _grads(model, x, loss_fn)
    prof = remat.profile(model, x, loss_fn, repeats=1, progress=False, ops=False)
    assert all(b.output_saved_bytes == b.output_bytes for b in prof.block_profiles)
    if what == "min":
        with pytest.raises(remat.BudgetInfeasibleError) as e:
            remat.plan(prof, budget="1B")
        plan = remat.plan(prof, budget=e.value.min_peak_bytes)
    else:
        plan = remat.plan(prof, strategy=what)
    remat.apply(model, plan)
    try:
        got = _grads(model, x, loss_fn)
        m = remat.measure(model, x, loss_fn, steps=1, warmup=1, progress=False)
    finally:
        remat.remove(model)
    assert all(torch.equal(ref[n], got[n]) for n in ref)
    if plan.budget_bytes is not None:
        assert m.peak_bytes <= plan.budget_bytes * 1.05
    assert m.peak_bytes <= plan.predicted_peak_bytes * 1.05
