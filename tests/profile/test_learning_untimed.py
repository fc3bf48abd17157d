"""NOTE [ Learning calls are not timed ] in ``remat.profile.profiler``: a configuration's first calls after
it is installed learn what each block changes and draws (a dispatch mode over the whole forward, copies
of its buffers and arguments), once per training run. The profile lets every checkpointed configuration
learn in an untimed forward, so no timed iteration is a learning one: before, the selective
configuration (op-level policies), timed once by default, was priced from its learning iteration."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import Keep
from remat.profile import profiler


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 32)
        self.ln = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


@pytest.mark.parametrize("repeats", [1, 3])
def test_no_timed_iteration_learns(monkeypatch: pytest.MonkeyPatch, repeats: int) -> None:
    seen: list[tuple[str, int, int]] = []
    original = profiler._timed_step

    def step(it: Any, block_list: Any, members: Any, ops: Any, dev: Any, reuse: Any) -> Any:
        if all(isinstance(op, Keep) for op in ops):
            return original(it, block_list, members, ops, dev, reuse)
        roles = [role for _, role in reuse.get(ops, [])]
        seen.append((type(ops[0]).__name__, len(roles), sum(not r.learned for r in roles)))
        return original(it, block_list, members, ops, dev, reuse)

    monkeypatch.setattr(profiler, "_timed_step", step)
    torch.manual_seed(0)
    model = nn.Sequential(*(Layer() for _ in range(3)))
    prof = remat.profile(
        model, torch.randn(16, 32), lambda y: y.pow(2).mean(), blocks=remat.blocks(model, types=Layer), repeats=repeats
    )
    kinds = {kind for kind, _, _ in seen}
    assert {"Recompute", "RecomputeOps"} <= kinds, seen  # both checkpointed configurations were timed
    for kind, roles, unlearned in seen:
        assert roles > 0 and unlearned == 0, (kind, roles, unlearned)
    assert all(bp.selective_ms is not None for bp in prof.block_profiles)


def test_one_learning_forward_serves_both_configurations(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [ One learning forward ]: the selective configuration's roles take what "full" learned.
    learned: list[str] = []
    original = profiler._learn

    def learn(it: Any, block_list: Any, members: Any, ops: Any, reuse: Any) -> None:
        learned.append(type(ops[0]).__name__)
        original(it, block_list, members, ops, reuse)

    monkeypatch.setattr(profiler, "_learn", learn)
    torch.manual_seed(0)
    model = nn.Sequential(*(Layer() for _ in range(3)))
    prof = remat.profile(
        model, torch.randn(16, 32), lambda y: y.pow(2).mean(), blocks=remat.blocks(model, types=Layer), repeats=1
    )
    assert learned == ["Recompute"]
    assert all(bp.selective_ms is not None for bp in prof.block_profiles)  # the selective configuration was timed
