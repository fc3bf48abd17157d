"""A block holding a sparse buffer: profiled, planned and recomputed like any other (a raw
NotImplementedError from torch.equal before)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import remat

D = 32


class _Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        i = torch.tensor([[0, 1, 2, 5], [3, 4, 7, 1]])
        self.register_buffer("sp", torch.sparse_coo_tensor(i, torch.ones(4), (D, D)).coalesce())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sparse.mm(self.sp, torch.tanh(self.fc(x)).t()).t().sigmoid()


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_same_values_compares_sparse_tensors() -> None:
    from remat.core.probe import same_values

    i = torch.tensor([[0, 1], [1, 0]])
    a = torch.sparse_coo_tensor(i, torch.ones(2), (2, 2)).coalesce()
    assert same_values(a, a.clone())
    assert not same_values(a, a * 2)
    assert not same_values(a, a.to_dense())
    csr = a.to_sparse_csr()
    assert same_values(csr, csr.clone()) and not same_values(csr, (a * 3).to_sparse_csr())


def test_a_block_with_a_sparse_buffer_is_profiled_planned_and_recomputed_exactly() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Sparse(), _Sparse(), nn.Linear(D, 1))
    x = torch.randn(64, D)
    plain = _grads(copy.deepcopy(model), x)
    prof = remat.profile(model, x, lambda y: y.square().mean(), repeats=1)
    assert not any(bp.stateful for bp in prof.block_profiles[:2])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        remat.plan(prof, "1B")
    except remat.BudgetInfeasibleError as e:
        smallest = remat.plan(prof, e.min_peak_bytes)
    assert smallest.checkpointed
    for plan in (smallest, remat.full()):
        remat.apply(model, plan)
        assert all(torch.equal(a, b) for a, b in zip(plain, _grads(model, x)))
        remat.remove(model)
    after = model.state_dict()
    assert all(torch.equal(before[k].to_dense(), after[k].to_dense()) for k in before)
