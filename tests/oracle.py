"""The oracle most planner tests share: a plan applied to a copy of the model measures its peak, and its
gradients equal the plain model's bitwise (same seed before each step)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

import remat


def _grads(model: nn.Module, x: torch.Tensor, loss_fn: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss_fn(model(x)).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def measured_bitwise(
    model: nn.Module,
    x: torch.Tensor,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    plan: remat.Plan,
    grads: str = "held",
) -> int:
    """The measured peak of ``plan`` on a copy of ``model`` (``remat.measure``, one step after one warm-up);
    asserts its gradients equal the plain model's bitwise."""
    ref = _grads(copy.deepcopy(model), x, loss_fn)
    planned = copy.deepcopy(model)
    remat.apply(planned, plan)
    try:
        peak = remat.measure(planned, (x,), loss_fn, steps=1, warmup=1, progress=False, grads=grads).peak_bytes
        got = _grads(planned, x, loss_fn)
    finally:
        remat.remove(planned)
    assert len(ref) == len(got) and all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    return peak
