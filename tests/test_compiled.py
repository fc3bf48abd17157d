"""remat.plan_compiled: the budget measured on the compiled step, with plans lowered until it holds.

One test compiles for real (``aot_eager``: dynamo and AOT autograd, where checkpoints are partitioned);
the others give ``compile_fn`` a stand-in "compiler" that holds a known number of bytes more than the
eager model through the step, the way a compiled backward may, so that the loop's arithmetic is checked
against exact figures without a compile.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.errors import BudgetInfeasibleError, RematError
from remat.models import workload


def _gpt() -> Any:
    return workload("gpt", n_layers=4, d_model=64, n_heads=2, seq_len=64, batch=4, vocab_size=128, dropout=0.0)


class _Heavier(nn.Module):
    """The model, plus ``extra`` bytes saved for the backward from the end of the forward to its start.

    The output gains ``(zeros * out.sum()).sum()``: 0 exactly, and 0 added to every gradient, while the
    multiplication saves the zeros for the backward.
    """

    def __init__(self, model: nn.Module, extra: int) -> None:
        super().__init__()
        self.model = model
        self.extra = extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        zeros = torch.zeros(self.extra // 4, dtype=torch.float32)
        return out + (zeros * out.sum()).sum()  # type: ignore[no-any-return]


def _measured(model: nn.Module, inputs: Any, loss_fn: Any) -> int:
    return remat.measure(model, inputs, loss_fn, steps=1, blocks=()).peak_bytes


def test_a_compiled_plan_fits_the_budget_on_the_compiled_step_and_trains_like_the_plain_model() -> None:
    w = _gpt()
    plain = copy.deepcopy(w.model)
    result = remat.plan_compiled(
        w.model, w.inputs, w.loss_fn, "60%", compile_fn=lambda m: torch.compile(m, backend="aot_eager"), repeats=1
    )
    assert remat.applied(w.model) == result.plan and result.plan.strategy == "compile"
    assert result.budget_bytes == int(0.6 * result.plain_peak_bytes)
    assert result.peak_bytes <= result.budget_bytes
    chosen = [a for a in result.attempts if a.plan == result.plan.describe()]
    assert len(chosen) == 1 and chosen[0].peak_bytes == result.peak_bytes
    # The figures are the compiled step's: measured again on the compiled model returned, and (plan off) on
    # the plain model compiled.
    assert _measured(result.model, w.inputs, w.loss_fn) == result.peak_bytes
    for m in (plain, w.model):
        for p in m.parameters():
            p.grad = None
    w.loss_fn(plain(w.inputs)).backward()
    w.loss_fn(result.model(w.inputs)).backward()
    for (name, a), b in zip(plain.named_parameters(), w.model.parameters()):
        assert a.grad is not None and b.grad is not None
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), name
    remat.remove(w.model)
    torch._dynamo.reset()
    assert _measured(torch.compile(w.model, backend="aot_eager"), w.inputs, w.loss_fn) == result.plain_peak_bytes
    torch._dynamo.reset()


def test_a_plan_over_the_budget_compiled_is_replaced_by_one_planned_lower() -> None:
    w = _gpt()
    eager_peak = _measured(w.model, w.inputs, w.loss_fn)
    extra = eager_peak // 5
    result = remat.plan_compiled(
        w.model, w.inputs, w.loss_fn, "60%", compile_fn=lambda m: _Heavier(m, extra), repeats=1
    )
    first = result.attempts[0]
    assert len(result.attempts) >= 2
    # The first plan was made for the budget and measured over it (the stand-in holds extra bytes more) ...
    assert first.target_bytes == result.budget_bytes < first.peak_bytes
    # ... each next one for the target less the excess (and below the last plan's prediction) after a plan
    # over the budget, or plus the room left after one that fits with more than 2% to spare.
    budget = result.budget_bytes
    for before, after in zip(result.attempts, result.attempts[1:]):
        if before.peak_bytes > budget:
            expected = min(before.target_bytes - (before.peak_bytes - budget), before.predicted_peak_bytes - 1)
        else:
            assert before.peak_bytes < budget * 0.98
            expected = before.target_bytes + (budget - before.peak_bytes)
        assert after.target_bytes == expected
    assert len({a.plan for a in result.attempts}) == len(result.attempts)  # no plan measured twice
    # The plan kept: of those that fit, the least predicted recomputation time.
    fitting = [a for a in result.attempts if a.peak_bytes <= budget]
    kept = min(fitting, key=lambda a: a.predicted_extra_ms)
    assert result.plan.describe() == kept.plan and result.peak_bytes == kept.peak_bytes <= budget
    assert _measured(result.model, w.inputs, w.loss_fn) == result.peak_bytes
    assert isinstance(result.model, _Heavier) and remat.applied(w.model) == result.plan
    # The stand-in changes no gradient, so the planned model is bitwise the plain one's.
    remat.remove(w.model)
    check = remat.check_gradients(w.model, result.plan, w.inputs, w.loss_fn)
    assert check.exact and check.equal


def test_no_plan_that_fits_compiled_raises_with_every_attempt_and_leaves_no_plan() -> None:
    w = _gpt()
    extra = _measured(w.model, w.inputs, w.loss_fn)  # the stand-in doubles the plain peak's bytes
    with pytest.raises(
        BudgetInfeasibleError, match=r"plan_compiled: no plan's compiled peak fits .*\n  1\. planned for"
    ):
        remat.plan_compiled(w.model, w.inputs, w.loss_fn, "55%", compile_fn=lambda m: _Heavier(m, extra), repeats=1)
    assert remat.applied(w.model) is None


def test_bad_calls_are_refused() -> None:
    w = _gpt()
    with pytest.raises(RematError, match=r"plan_compiled: tries=0 must be at least 1"):
        remat.plan_compiled(w.model, w.inputs, w.loss_fn, "50%", tries=0)
    remat.apply(w.model, remat.full())
    with pytest.raises(RematError, match=r"plan_compiled: the model has a plan applied already; remat.remove"):
        remat.plan_compiled(w.model, w.inputs, w.loss_fn, "50%")
    remat.remove(w.model)
    with pytest.raises(RematError, match=r"budget: share '150%' is outside"):
        remat.plan_compiled(w.model, w.inputs, w.loss_fn, "150%")


def test_a_compile_that_fails_leaves_the_model_without_a_plan() -> None:
    w = _gpt()

    def fails_when_planned(m: nn.Module) -> nn.Module:
        if remat.applied(m) is not None:
            raise RuntimeError("backend failed")
        return m

    with pytest.raises(RuntimeError, match="backend failed"):
        remat.plan_compiled(w.model, w.inputs, w.loss_fn, "60%", compile_fn=fails_when_planned, repeats=1)
    assert remat.applied(w.model) is None


def test_a_raised_target_whose_plan_measures_far_over_ends_the_search_with_the_plan_that_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Scripted compiled peaks: the first plan fits with 20% to spare (so the target is raised by that
    # room), the next measures 3x the budget (so the lowered target falls below zero). The search stops
    # there and keeps the first plan instead of planning for a negative budget.
    import remat.compiled as compiled_module

    w = _gpt()
    real = compiled_module.measure
    peaks: list[int] = []

    def scripted(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        m = real(model, *args, **kwargs)
        if not peaks:
            peaks.append(m.peak_bytes)  # the plain step: a share is taken of it
            return m
        budget = int(0.6 * peaks[0])
        peaks.append(int(0.8 * budget) if len(peaks) == 1 else 3 * budget)
        return dataclasses.replace(m, peak_bytes=peaks[-1])

    monkeypatch.setattr(compiled_module, "measure", scripted)
    result = remat.plan_compiled(w.model, w.inputs, w.loss_fn, "60%", compile_fn=lambda m: m, repeats=1)
    first, second = result.attempts
    assert second.target_bytes == first.target_bytes + (result.budget_bytes - first.peak_bytes)
    assert second.peak_bytes == 3 * result.budget_bytes
    assert result.plan.describe() == first.plan and result.peak_bytes == first.peak_bytes
    assert remat.applied(w.model) == result.plan
