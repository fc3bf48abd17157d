import pytest
import torch
import torch.nn as nn

import remat
from remat.core.ops import Keep, Recompute
from remat.plan.types import Plan


def _make() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 16), nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.Linear(16, 16)
    )
    for p in list(model.parameters())[:4]:
        p.requires_grad_(False)
    return model


_PLANS = {
    "flat": (Recompute(0, 5, (Keep(0), Keep(1), Keep(2), Keep(3), Keep(4))),),
    "nested first": (Recompute(0, 5, (Recompute(0, 1, (Keep(0),)), Keep(1), Keep(2), Keep(3), Keep(4))),),
    "nested pair": (Recompute(0, 5, (Recompute(0, 2, (Keep(0), Keep(1))), Keep(2), Keep(3), Keep(4))),),
    "nested second": (Recompute(0, 5, (Keep(0), Recompute(1, 2, (Keep(1),)), Keep(2), Keep(3), Keep(4))),),
}


@pytest.mark.parametrize("name", list(_PLANS))
def test_in_place_activation_after_frozen_nested_span_is_replayed(name: str) -> None:
    x = torch.randn(4, 16)
    plain = _make()
    plain(x).square().sum().backward()
    model = _make()
    remat.apply(
        model, Plan(strategy="by hand", blocks=remat.blocks(model, types=(nn.Linear, nn.ReLU)), ops=_PLANS[name])
    )
    for _ in range(2):  # a second step reuses nothing of the first
        model.zero_grad(set_to_none=True)
        model(x).square().sum().backward()
        for a, b in zip(plain.parameters(), model.parameters()):
            assert (a.grad is None) == (b.grad is None)
            assert a.grad is None or torch.equal(a.grad, b.grad)
