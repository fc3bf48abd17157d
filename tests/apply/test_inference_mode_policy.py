"""An op-level policy on a block that computes a constant under ``torch.inference_mode()``
(NOTE [ Ops run under inference mode ] in ``remat.core.selective``)."""

from __future__ import annotations

import torch
from torch import nn

import remat
from remat.core.selective import run_selective
from remat.plan.policies import policy_menu
from remat.profile.ops import profile_ops


class InferenceScale(nn.Module):
    """Divides its input by a per-row statistic computed under inference mode (then cloned out of it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            s = x.abs().mean(1, keepdim=True) + 1.0
        s = s.clone()
        return x + self.fc2(torch.tanh(self.fc1(x / s)))


def grads(block: nn.Module, x: torch.Tensor, save: frozenset[str] | None) -> dict[str, torch.Tensor]:
    block.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    out = block(xi) if save is None else run_selective(block.forward, (xi,), {}, save)
    (out**2).mean().backward()
    return {"x": xi.grad.clone(), **{n: p.grad.clone() for n, p in block.named_parameters()}}


def test_every_menu_policy_and_one_caching_the_inference_op_give_the_plain_gradients() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(InferenceScale(), InferenceScale())
    x = torch.randn(64, 16)
    ops = profile_ops(model, x, lambda out: (out**2).mean(), remat.blocks(model), rounds=1)
    keys = [op.key for op in ops[0].ops]
    assert "add#0" in keys[:4], keys  # the ``+ 1.0`` under inference mode
    block = model[0]
    plain = grads(block, x, None)
    # Every policy of the planner's menu, and by hand the op under inference mode, then all of them:
    # torch's selective checkpoint cannot cache an inference tensor (it crashed in the forward).
    policies = [frozenset(p.save) for p in policy_menu(ops[0])]
    policies += [frozenset({"add#0"}), frozenset(keys)]
    for save in policies:
        got = grads(block, x, save)
        bad = [k for k in plain if not torch.equal(plain[k], got[k])]
        assert not bad, (sorted(save), bad)
