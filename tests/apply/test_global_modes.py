"""Global modes set around the forward only are the ones a replay runs under (NOTE [ Backend flags under
recomputation ] in remat.core.runtime)."""

import copy

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import Keep, Recompute, RecomputeOps
from remat.plan.types import Plan

D = 16


class _Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.fc(x))
        c = torch.tensor([0.1] * D)  # the default dtype
        det = 2.0 if torch.are_deterministic_algorithms_enabled() else 3.0
        anomaly = 1.5 if torch.is_anomaly_enabled() else 1.0
        return y * det * anomaly + c.to(y.dtype) * (2.0 if c.dtype == torch.float64 else 1.0)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Blk() for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _deterministic(model, x):
    torch.use_deterministic_algorithms(True)
    try:
        return model(x)
    finally:
        torch.use_deterministic_algorithms(False)


def _default_dtype(model, x):
    torch.set_default_dtype(torch.float64)
    try:
        return model(x)
    finally:
        torch.set_default_dtype(torch.float32)


def _anomaly(model, x):
    with torch.autograd.detect_anomaly(check_nan=False):
        return model(x)


_OPS = {
    "full": lambda n: tuple(Recompute(i, i + 1, (Keep(i),)) for i in range(n)),
    "segment": lambda n: (Recompute(0, n, tuple(Keep(i) for i in range(n))),),
    "nested": lambda n: (Recompute(0, n, (*(Recompute(i, i + 1, (Keep(i),)) for i in range(n - 1)), Keep(n - 1))),),
    "policy": lambda n: tuple(RecomputeOps(i, ()) for i in range(n)),
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("forward", [_deterministic, _default_dtype, _anomaly])
@pytest.mark.parametrize("ops", sorted(_OPS))
def test_a_global_mode_set_around_the_forward_only_is_the_replays(forward, ops):
    torch.manual_seed(0)
    plain = _Net()
    planned = copy.deepcopy(plain)
    x = torch.randn(4, D)
    blocks = remat.blocks(planned, include="layers.*")
    remat.apply(planned, Plan("custom", blocks, _OPS[ops](len(blocks))))
    grads = []
    for model in (plain, planned):
        forward(model, x).pow(2).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.get_default_dtype() == torch.float32
    assert not torch.is_anomaly_enabled()
