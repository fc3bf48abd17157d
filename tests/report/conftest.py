"""Shared by the report tests: one small GPT profiled, benched and timelined once per session."""

from __future__ import annotations

from typing import Any

import pytest

import remat
from remat.cli.bench import _plans
from remat.measure.compare import compare
from remat.models import workload

SIZES = dict(n_layers=3, d_model=32, n_heads=2, seq_len=16, batch=2, vocab_size=64)
BUDGET = (
    "90%"  # the smallest feasible peak of this tiny GPT is about 80% of its plain peak (gradients made in the backward)
)


@pytest.fixture(scope="session")
def run() -> dict[str, Any]:
    """Everything the charts and the report draw, for a small GPT (one timing round)."""
    w = workload("gpt", **SIZES)
    prof = remat.profile(w.model, w.inputs, w.loss_fn, repeats=1)
    plans = _plans(prof, [], [BUDGET])
    result = compare(w.model, w.inputs, w.loss_fn, plans, rounds=1, description=w.description)
    chosen = next(p for p in plans if p.strategy.startswith("optimal"))
    timelines = []
    for p in (plans[0], chosen):
        remat.apply(w.model, p)
        timelines.append(remat.timeline(w.model, w.inputs, w.loss_fn))
        remat.remove(w.model)
    return {
        "profile": prof,
        "plan": chosen,
        "result": result,
        "frontier": remat.frontier(prof, points=6),
        "timelines": timelines,
    }
