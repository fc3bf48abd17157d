"""An input the model's code makes between two blocks of a segment is charged once (NOTE [ Unlinked inputs made
in the gap ] in remat.plan.chain).

Split layers: each layer runs ``a``, then makes ``b``'s input (``h * 2 + 1``) and ``c``'s input (``torch.cat``) in
its own code. A segment over ``a``, ``b``, ``c`` holds each of those as the recorded argument of ``b`` / ``c``
(``unlinked_bytes``) while the gap before each counted its allocation too (``gap_bytes``), and the gaps' frees of
``a``'s and ``b``'s own outputs (held by the code until the next child returns, never charged by the segment)
were netted: the level after ``R[0:3](K0 K1 K2)`` was predicted 8 KiB above the measured one (fuzz seed 836's
split ``sqrt()``). The fuzz seeds below are the cases where taking the double charge off alone went under the
measured peak (1041: a block's unlinked input freed in the gap after the segment's last block, which the segment
holds; helper-116's and helper-121's reports): with both, each is within 2% of its prediction.
"""

from __future__ import annotations

import bisect
import copy

import pytest
import torch
from torch import nn

import remat
from remat.plan.chain import chain_of
from remat.plan.planner import plan_from_ops
from remat.plan.types import ops_from_text
from tests.benchmark_scripts import load
from tests.oracle import measured_bitwise

D = 32


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)
        self.c = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = self.b(h * 2.0 + 1.0)
        return self.c(torch.cat([h, x], dim=-1))


def _loss(y: torch.Tensor) -> torch.Tensor:
    return y.square().mean()


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    model, x = nn.Sequential(_Layer(), _Layer()), torch.randn(64, D)
    prof = remat.profile(model, (x,), _loss, blocks=remat.blocks(model, split=True), repeats=1, progress=False)
    return model, x, prof


def test_the_segment_holds_the_measured_level(case) -> None:
    model, x, prof = case
    chain = chain_of(prof)
    plan = plan_from_ops(prof, ops_from_text("R[0:3](K0 K1 K2) K3 K4 K5"), "by hand")
    planned = copy.deepcopy(model)
    remat.apply(planned, plan)
    try:
        tl = remat.timeline(planned, (x,), _loss, grads="none")
    finally:
        remat.remove(planned)
    start = min(iv.start_ms for iv in tl.intervals if iv.block == "1.a" and iv.kind == "forward")
    level = tl.bytes[bisect.bisect_right(tl.t_ms, start) - 1]
    # The oracle is the measured level where block 3 starts: the segment's output, the inputs it recorded,
    # what the code between holds, its RNG state.
    assert chain.base_bytes + chain.segment_bytes(0, 3) == level


@pytest.mark.parametrize("text", ["R[0:3](K0 K1 K2) K3 K4 K5", "R[0:3](K0 K1 K2) R[3:6](K3 K4 K5)"])
def test_plans_stay_on_the_safe_side(case, text) -> None:
    model, x, prof = case
    plan = plan_from_ops(prof, ops_from_text(text), "by hand")
    peak = measured_bitwise(model, x, _loss, plan, grads="none")
    assert peak <= plan.predicted_peak_bytes, (text, peak, plan.predicted_peak_bytes)


fuzz = load("fuzz")


@pytest.mark.parametrize("seed", [1008, 1011, 1041])
def test_fuzz_split_sqrt_is_predicted(seed: int) -> None:
    model, inputs, loss_fn, cfg = fuzz.make_case(seed)
    model.train()
    torch.manual_seed(seed + 999)
    prof = remat.profile(
        model,
        inputs,
        loss_fn,
        blocks=remat.blocks(model, split=True),
        repeats=1,
        progress=False,
        ops=cfg["ops"],
        grads=cfg["grads"],
    )
    plan = remat.plan(prof, strategy="sqrt")

    def step(m: nn.Module) -> list[torch.Tensor]:
        m.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss_fn(m(*inputs)).backward()
        return [p.grad.clone() for p in m.parameters() if p.grad is not None]

    ref = step(copy.deepcopy(model))
    planned = copy.deepcopy(model)
    remat.apply(planned, plan)
    try:
        peak = remat.measure(planned, inputs, loss_fn, steps=1, warmup=1, progress=False, grads=cfg["grads"]).peak_bytes
        got = step(planned)
    finally:
        remat.remove(planned)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    assert 0.98 * plan.predicted_peak_bytes <= peak <= 1.02 * plan.predicted_peak_bytes, (
        plan.describe(),
        peak,
        plan.predicted_peak_bytes,
    )
