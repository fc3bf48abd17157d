"""remat's recomputation touches only the modules it recomputes, in the thread that recomputes them."""

from __future__ import annotations

import threading

import torch
from torch import nn

import remat


def _bn_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU()) for _ in range(4)])


def _train(model: nn.Module, steps: int, seed: int, no_grad_every: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(steps):
        x = torch.randn(32, 16, generator=gen)
        if no_grad_every and i % no_grad_every == 0:
            with torch.no_grad():
                model(x)
            continue
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def test_a_plain_batchnorm_model_in_another_thread_is_untouched() -> None:
    reference = _bn_net(0)
    _train(reference, 100, seed=1, no_grad_every=7)
    checkpointed_alone = _bn_net(2)
    _train(checkpointed_alone, 100, seed=3)

    plain, planned = _bn_net(0), _bn_net(2)
    remat.apply(planned, remat.segments(2))
    errors: list[BaseException] = []

    def guarded(fn: object) -> None:
        try:
            fn()  # type: ignore[operator]
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [
        threading.Thread(target=guarded, args=(lambda: _train(plain, 100, seed=1, no_grad_every=7),)),
        threading.Thread(target=guarded, args=(lambda: _train(planned, 100, seed=3),)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(torch.equal(a, b) for a, b in zip(_state(reference), _state(plain)))
    # The planned model trained exactly as the same model without remat, alone.
    assert all(torch.equal(a, b) for a, b in zip(_state(checkpointed_alone), _state(planned)))
