"""Threads share torch's default CPU generator: a replay redraws its forward's dropout masks only if no
other thread drew while that forward ran (NOTE [ Draws of other threads ] in remat.core.runtime)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import Keep, Recompute
from remat.errors import RematError
from remat.plan.types import Plan


class _Pausing(nn.Module):
    """Linear, dropout, a pause (``hook``), dropout: another thread can draw between the two dropouts."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop1, self.drop2 = nn.Linear(16, 16), nn.Dropout(0.5), nn.Dropout(0.5)
        self.hook: Callable[[], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop1(self.fc(x))
        if self.hook is not None:
            self.hook()
        return x + self.drop2(h)


def _net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(_Pausing(), _Pausing(), nn.Linear(16, 1))


def _x(seed: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))


def _one_segment(model: nn.Module) -> Plan:
    return Plan(strategy="by hand", blocks=tuple(remat.blocks(model)), ops=(Recompute(0, 2, (Keep(0), Keep(1))),))


@pytest.mark.parametrize("one_segment", [False, True], ids=["full", "one_segment"])
def test_a_draw_of_another_thread_inside_a_forward_is_a_remat_error(one_segment: bool) -> None:
    # Deterministic interleaving: thread B runs a planned forward (dropout) while thread A's first block
    # pauses between its two dropouts; A's replay would draw B's numbers for its second mask (the
    # replay of a block alone stops early, at its last saved tensor; in a segment it runs to the end).
    a, b = _net(0), _net(1)
    for net in (a, b):
        remat.apply(net, _one_segment(net) if one_segment else remat.full())
    b_done = threading.Event()
    errors: list[BaseException] = []

    def run_b() -> None:
        try:
            b(_x(1)).sum().backward()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            b_done.set()

    started: list[threading.Thread] = []

    def pause() -> None:
        # Once: the replay runs the forward's Python again, with the attributes as at the call (NOTE
        # [ Attributes other code sets ]), so it calls this hook again; it must not start the thread again.
        if started:
            return
        thread = threading.Thread(target=run_b)
        started.append(thread)
        thread.start()
        b_done.wait(timeout=60)

    a[0].hook = pause
    out = a(_x(0)).sum()
    assert not errors, errors
    with pytest.raises(RematError, match=r"recomputing module '0' drew other random numbers .*another thread training"):
        out.backward()
