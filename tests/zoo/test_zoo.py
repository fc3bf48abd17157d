"""Every zoo model under every strategy and the optimal planner: bitwise equal, or refused with a reason.

One test per cell (model x plan), so a failure names its cell: a silent difference (loss, an output, a
gradient or a buffer not ``torch.equal`` to the plain model's), a refusal that changed the parameters
or buffers or gives no reason, or a crash with anything but a ``RematError``.
"""

from __future__ import annotations

import pytest
import torch

import remat
from remat.plan import STRATEGIES

from .models import CELLS, STRATEGY_CELLS, ZOO, ZooRun, compare_steps, run_step


@pytest.fixture(scope="module")
def zoo() -> ZooRun:
    # Profiles and plain steps are computed once per model and shared by all its cells.
    return ZooRun(ZOO)


def test_every_registered_strategy_is_judged() -> None:
    assert set(STRATEGY_CELLS) == set(STRATEGIES)


@pytest.mark.parametrize("name", ZOO)
def test_blocks_are_the_repeated_layers(name: str) -> None:
    model = ZOO[name]().model
    n = len(model.layers)  # type: ignore[arg-type]
    assert n >= 4
    assert [b.name for b in remat.blocks(model)] == [f"layers.{i}" for i in range(n)]


@pytest.mark.parametrize("name", ZOO)
def test_zoo_is_deterministic(name: str) -> None:
    # The oracle compares a fresh build with the plain step of another build: both must be identical.
    assert compare_steps(run_step(ZOO[name]()), run_step(ZOO[name]())) == []


def test_the_oracle_sees_a_difference() -> None:
    # Dropout draws differ under another seed, and a changed weight changes the gradients.
    plain = run_step(ZOO["dropout"](), seed=0)
    assert "loss" in compare_steps(plain, run_step(ZOO["dropout"](), seed=1))
    case = ZOO["hidden_states"]()
    with torch.no_grad():
        case.model.layers[2][0].weight[0, 0] += 1e-3  # type: ignore[index]
    assert "grad:layers.0.0.weight" in compare_steps(run_step(ZOO["hidden_states"]()), run_step(case))


@pytest.mark.parametrize("name", ["frozen_bottom", "stateful_buffer"])
def test_profile_accepts(zoo: ZooRun, name: str) -> None:
    # Not a refusal the oracle accepts for these two: the issue asks the profile to handle frozen
    # bottom layers, and to notice a stateful block (and keep it) rather than give up on the model.
    prof = zoo.profile(name)
    assert isinstance(prof, remat.Profile), f"{name}: remat.profile raised {type(prof).__name__}: {prof}"


@pytest.mark.parametrize("label", CELLS)
@pytest.mark.parametrize("name", ZOO)
def test_plan_is_exact_or_refused(zoo: ZooRun, name: str, label: str) -> None:
    outcome = zoo.judge(name, CELLS[label])
    assert outcome.ok, f"{name} x {label}: {outcome.text}"


@pytest.fixture(scope="module")
def zoo_split() -> ZooRun:
    return ZooRun(ZOO, split=True)


@pytest.mark.parametrize("label", ["full", "segments(2)", "optimal 50%", "optimal min"])
@pytest.mark.parametrize("name", ZOO)
def test_split_blocks_are_exact_or_refused(zoo_split: ZooRun, name: str, label: str) -> None:
    # Each layer's children as blocks (remat.blocks(model, split=True)): segments now start and end
    # inside layers, next to the model's own code between the children (residual adds, hooks, kwargs).
    outcome = zoo_split.judge(name, CELLS[label])
    assert outcome.ok, f"{name} x {label} (split): {outcome.text}"
