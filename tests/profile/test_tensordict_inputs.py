"""A TensorDict batch is one argument of its model, and a model that writes into its batch (every
tensordict.nn TensorDictModule does) is profiled and measured as the user's loop runs it: a fresh batch
container per iteration. Gradients and buffers bitwise equal to the plain step."""

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn

import remat

D, N = 32, 128


def _make():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layers = [
            TensorDictModule(
                nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * D, D)),
                in_keys=["h"],
                out_keys=["h"],
            )
            for _ in range(6)
        ]
        model = TensorDictSequential(*layers)
        h = torch.randn(N, D)
    return model, (lambda: TensorDict({"h": h.clone()}, batch_size=[N])), (lambda out: out["h"].pow(2).mean())


def _step(model, td, loss_fn):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        out = model(td)
        loss_fn(out).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, out["h"].detach().clone()


@pytest.mark.parametrize("wrap", [False, True], ids=["td", "(td,)"])
def test_tensordict_model_profiles_plans_and_is_exact(wrap: bool) -> None:
    model, batch, loss_fn = _make()
    plain_grads, plain_out = _step(model, batch(), loss_fn)
    model.zero_grad(set_to_none=True)
    inputs = (batch(),) if wrap else batch()
    prof = remat.profile(model, inputs, loss_fn, repeats=1, progress=False)  # raised TypeError / RuntimeError
    plan = remat.plan(prof, budget="60%")
    remat.apply(model, plan)
    grads, out = _step(model, batch(), loss_fn)
    assert torch.equal(out, plain_out)
    for n, g in plain_grads.items():
        assert torch.equal(grads[n], g), n
    m = remat.measure(model, inputs, loss_fn, steps=1, progress=False)
    assert m.peak_bytes <= plan.budget_bytes * 1.05
    assert abs(m.peak_bytes / plan.predicted_peak_bytes - 1) <= 0.05
    # the user's batch is left as it was: remat's iterations wrote into copies of its container
    td = inputs[0] if wrap else inputs
    assert set(td.keys()) == {"h"} and td["h"].grad_fn is None
