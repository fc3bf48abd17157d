"""An op-level policy on a block whose input the plain step frees in the gap after it (a Linear on a
non-contiguous input saves a clone of it, not the input itself) is predicted within 5% of its measured
peak, its gradients equal the plain model's, and the smallest-peak plan keeps its budget (fuzz seed 2047:
O3{clone#0,_softmax#0|relu#0} measured 1.158x its budget; NOTE [ A policy's replay above the gap's frees ])."""

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.core.ops import Keep, RecomputeOps
from remat.errors import BudgetInfeasibleError
from remat.plan.planner import plan_from_ops
from remat.plan.policies import op_costs

D, B, T = 64, 4, 128


class Shuffle(nn.Module):
    """Returns a fresh, non-contiguous copy of its input (saves nothing)."""

    def forward(self, x):
        return x.transpose(0, 1).contiguous().transpose(0, 1)


class SoftRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        x = self.lin(x)  # x non-contiguous: F.linear saves a clone of it; the input dies in the gap after
        x = torch.softmax(x, dim=-1) * D
        return torch.relu(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, D)
        self.layer0 = Shuffle()
        self.layer1 = Shuffle()
        self.layer2 = SoftRelu()
        self.layer3 = Shuffle()
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, 7)

    def forward(self, x):
        h = self.inp(x)
        for layer in (self.layer0, self.layer1, self.layer2, self.layer3):
            h = layer(h)
        return self.head(self.norm(h))


def _case():
    torch.manual_seed(0)
    model = Net().train()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, 5, generator=g)
    tgt = torch.randn(B, T, 7, generator=g)

    def loss_fn(out):
        return F.mse_loss(out, tgt)

    return model, x, loss_fn


def _grads(model, x, loss_fn):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss_fn(model(x)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(model, x, loss_fn, pl, ref):
    remat.apply(model, pl)
    try:
        got = _grads(model, x, loss_fn)
        assert ref.keys() == got.keys() and all(torch.equal(ref[n], got[n]) for n in ref), pl.describe()
        return remat.measure(model, (x,), loss_fn, steps=1, warmup=1, progress=False).peak_bytes
    finally:
        remat.remove(model)


def test_policy_replay_above_the_gap_freed_input_is_predicted():
    model, x, loss_fn = _case()
    ref = _grads(model, x, loss_fn)
    prof = remat.profile(model, (x,), loss_fn, repeats=1, progress=False, ops=True)
    k = [b.fqns[0] for b in prof.blocks].index("layer2")
    assert prof.block_profiles[k].gap_bytes < 0, "the plain step frees the block's input in the gap after it"
    policies = [op for (i, op) in op_costs(prof) if i == k]
    assert any(isinstance(op, RecomputeOps) and "_softmax#0" in op.recompute for op in policies), policies
    for op in policies:
        ops = tuple(op if j == k else Keep(j) for j in range(len(prof.blocks)))
        pl = plan_from_ops(prof, ops, "test")
        peak = _run(model, x, loss_fn, pl, ref)
        assert 0.95 <= peak / pl.predicted_peak_bytes <= 1.05, (pl.describe(), peak, pl.predicted_peak_bytes)


def test_smallest_peak_plan_keeps_its_budget():
    model, x, loss_fn = _case()
    ref = _grads(model, x, loss_fn)
    prof = remat.profile(model, (x,), loss_fn, repeats=1, progress=False, ops=True)
    try:
        remat.plan(prof, budget="1B")
        raise AssertionError("a 1-byte budget must be infeasible")
    except BudgetInfeasibleError as e:
        pl = remat.plan(prof, budget=e.min_peak_bytes)
    peak = _run(model, x, loss_fn, pl, ref)
    assert peak <= pl.budget_bytes * 1.05, (pl.describe(), peak, pl.budget_bytes)
    # Above the prediction is the bug; below it, a plan of recompute segments (chosen where their predicted
    # peaks tie with the policy's) is the over-prediction the README lists under Known limits.
    assert peak <= pl.predicted_peak_bytes * 1.05, (pl.describe(), peak, pl.predicted_peak_bytes)
