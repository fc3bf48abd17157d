"""NOTE [ Disturbed iterations ]: a checkpointed iteration the machine slowed down is timed again, not used."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import Keep, Recompute, RecomputeOps
from remat.profile import profiler

SLEEP_S = 0.1  # far above anything a 32-wide block costs, checkpointed or not


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps while the test disturbs an iteration."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _STATE["backward"]:
            time.sleep(SLEEP_S)
        return grad


_STATE = {"forward": False, "backward": False, "loss": False}


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _STATE["forward"]:
            time.sleep(SLEEP_S)
        return _SlowBackward.apply(torch.tanh(self.fc(x)))


def _loss(out: torch.Tensor) -> torch.Tensor:
    if _STATE["loss"]:
        time.sleep(SLEEP_S)
    return out.pow(2).mean()


def _disturb_first_timed(
    monkeypatch: pytest.MonkeyPatch, kind: type, where: tuple[str, ...], times: int = 1
) -> list[str]:
    """Disturb (sleep in ``where``) the first ``times`` timed iterations of the configuration whose ops are
    ``kind`` (none of them learns: NOTE [ Learning calls are not timed ]); return a log of the
    configurations timed."""
    timed: list[str] = []
    original = profiler._timed_step
    done = [0]

    def step(it: Any, block_list: Any, members: Any, ops: Any, dev: Any, reuse: Any) -> Any:
        name = "plain" if all(isinstance(op, Keep) for op in ops) else type(ops[0]).__name__
        timed.append(name)
        on = name == kind.__name__ and done[0] < times
        if on:
            done[0] += 1
            for key in where:
                _STATE[key] = True
        try:
            return original(it, block_list, members, ops, dev, reuse)
        finally:
            for key in _STATE:
                _STATE[key] = False

    monkeypatch.setattr(profiler, "_timed_step", step)
    return timed


def _profile() -> remat.Profile:
    torch.manual_seed(0)
    model = nn.Sequential(*(Layer() for _ in range(4)))
    return remat.profile(model, torch.randn(8, 32), _loss, blocks=remat.blocks(model, types=Layer), repeats=3)


@pytest.mark.parametrize("where", [("forward",), ("backward",)], ids=["forwards", "backwards"])
def test_a_disturbed_iteration_with_every_block_checkpointed_is_timed_again_and_not_used(
    monkeypatch: pytest.MonkeyPatch, where: tuple[str, ...]
) -> None:
    # Every block's forward (or backward) 100 ms slower in the timed iteration with every block
    # checkpointed (one at repeats=3) and in the first one timed again: used, each block's recomputation
    # would cost >= 100 ms more.
    timed = _disturb_first_timed(monkeypatch, Recompute, where, times=2)
    prof = _profile()
    # The two disturbed ones and the second one timed again.
    assert timed.count("Recompute") >= 3
    for bp in prof.block_profiles:
        assert bp.ckpt_fwd_ms < 1000 * SLEEP_S / 2, bp


def test_a_disturbed_selective_iteration_is_timed_again_and_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    # The only iteration under selective checkpoints 100 ms slower in every block's forward
    # and in the loss outside them: timed again, and the block's selective cost comes from the new one.
    timed = _disturb_first_timed(monkeypatch, RecomputeOps, ("forward", "loss"))
    prof = _profile()
    assert timed.count("RecomputeOps") >= 2
    for bp in prof.block_profiles:
        assert bp.selective_ms < 1000 * SLEEP_S / 2, bp
