"""NOTE [ Twin blocks ]: blocks doing the same work share the medians of their measured times."""

from __future__ import annotations

from dataclasses import replace
from statistics import median

import torch
from torch import nn

import remat
from remat.blocks import resolve
from remat.models import Workload
from remat.profile.twins import pool_twins, twin_groups


class Layer(nn.Module):
    def __init__(self, a: int, b: int) -> None:
        super().__init__()
        self.fc = nn.Linear(a, b)
        self.norm = nn.LayerNorm(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.nn.functional.gelu(self.fc(x)))


def _profile(model: nn.Module, x: torch.Tensor) -> remat.Profile:
    return remat.profile(model, x, lambda out: out.pow(2).mean(), blocks=remat.blocks(model, types=Layer), repeats=1)


def test_identical_layers_are_twins_and_layers_of_other_widths_or_frozen_ones_are_not() -> None:
    torch.manual_seed(0)
    # Layers 1 and 4 do the same work. 0 takes the batch, which needs no gradient (a smaller backward);
    # 2 and 3 have other widths; 5 is frozen (no weight gradients).
    model = nn.Sequential(Layer(32, 32), Layer(32, 32), Layer(32, 64), Layer(64, 32), Layer(32, 32), Layer(32, 32))
    model[5].requires_grad_(False)
    prof = _profile(model, torch.randn(16, 32))
    assert twin_groups(resolve(model, prof.blocks), prof) == [(1, 4)]
    bps = prof.block_profiles
    for field in ("fwd_ms", "bwd_ms", "ckpt_fwd_ms", "stop_ms", "selective_ms"):
        assert getattr(bps[1], field) == getattr(bps[4], field)
    assert [op.ms for op in prof.block_ops[1].ops] == [op.ms for op in prof.block_ops[4].ops]


def test_pooling_takes_the_median_so_one_slow_sample_does_not_price_its_block(small_gpt: Workload) -> None:
    w = small_gpt
    prof = remat.profile(w.model, w.inputs, w.loss_fn, repeats=1)
    groups = twin_groups(resolve(w.model, prof.blocks), prof)
    assert groups == [tuple(range(len(prof.blocks)))]  # the GPT's layers are all alike
    # One block's samples ten times slower (a fault storm): the pooled times are the others' medians.
    slow = [
        replace(bp, selective_ms=10 * (bp.selective_ms or 1.0), fwd_ms=10 * bp.fwd_ms) if i == 1 else bp
        for i, bp in enumerate(prof.block_profiles)
    ]
    slow_ops = [
        replace(bo, ops=tuple(replace(op, ms=10 * op.ms) for op in bo.ops)) if i == 1 else bo
        for i, bo in enumerate(prof.block_ops)
    ]
    noisy = replace(prof, block_profiles=tuple(slow), block_ops=tuple(slow_ops))
    pooled = pool_twins(noisy, groups)
    want = median(bp.selective_ms for bp in slow)
    assert all(bp.selective_ms == want for bp in pooled.block_profiles)
    assert all(bp.fwd_ms == median(b.fwd_ms for b in slow) for bp in pooled.block_profiles)
    k = max(range(len(prof.block_ops[0].ops)), key=lambda k: prof.block_ops[0].ops[k].ms)
    assert pooled.block_ops[1].ops[k].ms == median(bo.ops[k].ms for bo in slow_ops)
    assert pooled.block_ops[1].ops[k].ms < slow_ops[1].ops[k].ms
    # Memory is measured, not pooled.
    assert [bp.saved_bytes for bp in pooled.block_profiles] == [bp.saved_bytes for bp in prof.block_profiles]
