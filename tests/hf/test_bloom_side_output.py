"""HF BLOOM on split blocks: each layer's ``self_attention`` returns its attention probabilities, which the layer
returns in turn and the model's loop drops when it rebinds ``outputs`` after the next layer's call (the last
layer's when the model returns, before the loss). Kept, the attention saves them (its ``bmm``); under a checkpoint
ending with the attention nothing does, while the chain charged them from the segment's end to its replay
(NOTE [ Side outputs of a segment's last block ]): plans measured 0.84-0.87x their prediction, the smallest feasible
peak was stated at 0.644 of the plain peak where that plan measured 0.542, and a 60% budget was refused. Now the
profile records where the model's code drops them (``BlockProfile.side_output_frees``) and the simulation takes
them off there."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import BloomConfig, BloomForCausalLM

import remat
from remat.plan.chain import chain_of

B, T, H, D, LAYERS = 2, 64, 4, 64, 4
PROBS = B * H * T * T * 4  # one layer's attention probabilities, float32


def _loss(out) -> torch.Tensor:
    return out.loss


def _grads(model, inputs) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    _loss(model(**inputs)).backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.fixture(scope="module")
def case():
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    config = BloomConfig(
        n_layer=LAYERS, hidden_size=D, n_head=H, vocab_size=1000, use_cache=False, attn_implementation="eager"
    )
    model = BloomForCausalLM(config).train()
    ids = torch.randint(0, 1000, (B, T))
    inputs = {"input_ids": ids, "labels": ids}
    blocks = remat.blocks(model, split=True)
    prof = remat.profile(model, inputs, _loss, blocks=blocks, repeats=1, progress=False, ops=False)
    plain = remat.measure(model, inputs, _loss, steps=1, warmup=1, progress=False).peak_bytes
    return model, inputs, prof, plain, _grads(model, inputs)


def _run(case, plan) -> int:
    model, inputs, _prof, _plain, want = case
    remat.apply(model, plan)
    try:
        got = _grads(model, inputs)
        peak = remat.measure(model, inputs, _loss, steps=1, warmup=1, progress=False).peak_bytes
    finally:
        remat.remove(model)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    return peak


def test_where_the_model_drops_the_probabilities_is_measured(case) -> None:
    _model, _inputs, prof, _plain, _want = case
    names = [b.name for b in prof.blocks]
    attention = [i for i, name in enumerate(names) if name.endswith("self_attention")]
    assert len(attention) == LAYERS
    last = len(names) - 1
    for layer, i in enumerate(attention):
        bp = prof.block_profiles[i]
        # Dropped after the next layer's last child returns; the last layer's when the model returns, before
        # the head's peak (the logits): gone after the last block.
        after = attention[layer + 1] + 2 if layer + 1 < LAYERS else last
        assert bp.side_output_bytes == PROBS, (names[i], bp.side_output_bytes)
        assert bp.side_output_frees == ((after, PROBS),), (names[i], bp.side_output_frees)
    chain = chain_of(prof)
    assert [chain.side_output_after[i] for i in attention] == [attention[1] + 2, attention[2] + 2, last, last]


@pytest.mark.parametrize("budget", ["min", "70%"])
def test_plans_are_predicted_within_5_percent(case, budget: str) -> None:
    _model, _inputs, prof, _plain, _want = case
    if budget == "min":
        with pytest.raises(remat.BudgetInfeasibleError) as e:
            remat.plan(prof, budget="1B")
        budget = e.value.min_peak_bytes
    plan = remat.plan(prof, budget=budget)
    peak = _run(case, plan)
    predicted = plan.predicted_peak_bytes
    assert predicted is not None and plan.budget_bytes is not None
    assert peak <= plan.budget_bytes * 1.05, (plan.describe(), peak, plan.budget_bytes)
    # Never under (a plan above its budget), and no longer 0.84-0.87x over.
    assert predicted * 0.95 <= peak <= predicted * 1.05, (plan.describe(), peak, predicted)


def test_a_budget_the_lowest_peak_plan_measures_below_is_planned(case) -> None:
    # The lowest-peak plan measured 0.542 of the plain peak while the planner stated 0.644 as the smallest
    # feasible peak and refused 60%: a budget 5% above what that plan measures is planned and kept.
    _model, _inputs, prof, plain, _want = case
    with pytest.raises(remat.BudgetInfeasibleError) as e:
        remat.plan(prof, budget="1B")
    lowest = remat.plan(prof, budget=e.value.min_peak_bytes)
    budget = int(_run(case, lowest) * 1.05)
    assert budget < 0.6 * plain
    plan = remat.plan(prof, budget=budget)
    peak = _run(case, plan)
    assert peak <= budget, (plan.describe(), peak, budget)
    assert plan.predicted_peak_bytes is not None and peak <= plan.predicted_peak_bytes * 1.05
