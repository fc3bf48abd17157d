"""An op-level policy on a block whose aux output the model drops (BlockProfile.dead_saved_frees) is
predicted within 5% of its measured peak, and its gradients equal the plain model's (fuzz seed 807)."""

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.core.ops import Keep
from remat.plan.planner import plan_from_ops
from remat.plan.policies import op_costs

D, B, T = 24, 4, 32


class Blk(nn.Module):
    def __init__(self, aux):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.aux_head = nn.Linear(D, 1) if aux else None

    def forward(self, x):
        if self.aux_head is None:
            return torch.softmax(self.lin(x), -1) * D
        h = torch.relu(self.lin(x * 0.5))
        return h, self.aux_head(h.transpose(1, 2).contiguous().transpose(1, 2)).squeeze(-1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, D)
        self.blocks = nn.Sequential(Blk(True), Blk(False), Blk(False))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            out = b(h)
            h = out[0] if isinstance(out, tuple) else out  # the aux output is dropped: a dead branch
        return self.head(self.norm(h))


def _grads(model, x, loss_fn):
    model.zero_grad(set_to_none=True)
    loss_fn(model(x)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_policy_on_block_with_dead_branch_predicted():
    torch.manual_seed(0)
    model = Net().train()
    x = torch.randint(0, 50, (B, T))
    tgt = torch.randn(B, T, 1)

    def loss_fn(out):
        return F.mse_loss(out, tgt)

    ref = _grads(model, x, loss_fn)
    prof = remat.profile(model, (x,), loss_fn, repeats=1, progress=False, ops=True)
    k = [b.fqns[0] for b in prof.blocks].index("blocks.0")
    assert prof.block_profiles[k].dead_saved_frees, "the aux branch must be seen as dead"
    policies = [op for (i, op) in op_costs(prof) if i == k]
    assert policies, "the block has op-level policies to choose from"
    for op in policies:
        ops = tuple(op if j == k else Keep(j) for j in range(len(prof.blocks)))
        pl = plan_from_ops(prof, ops, "test")
        remat.apply(model, pl)
        try:
            got = _grads(model, x, loss_fn)
            assert ref.keys() == got.keys() and all(torch.equal(ref[n], got[n]) for n in ref)
            m = remat.measure(model, (x,), loss_fn, steps=1, warmup=1, progress=False)
        finally:
            remat.remove(model)
        assert 0.95 <= m.peak_bytes / pl.predicted_peak_bytes <= 1.05, (
            pl.describe(),
            m.peak_bytes,
            pl.predicted_peak_bytes,
        )
