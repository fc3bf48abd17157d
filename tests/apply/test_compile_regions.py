"""torch.compile over a planned model: plans of the ``compile`` solver trace whole (NOTE [ Under
torch.compile ] in ``remat.core.runtime``): no graph break and no block left to remat's eager runtime,
recomputation inside the compiled graph, and training like the eager model.

With torch 2.13, dynamo reports no graph break at a ``torch.compiler.disable`` function either: it calls
it as an opaque function. So besides ``graph_break_count`` the tests count the calls that reach remat's
eager runtime from the compiled model: none means every block runs compiled. They compile with the
``aot_eager`` backend (dynamo and AOT autograd, where checkpoints are partitioned for recomputation,
without inductor's code generation, tens of seconds per model on a cold cache);
``benchmarks/compile_plans.py`` measures the same plans with inductor."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import Keep, Recompute, RecomputeOps, RecomputeSub
from remat.models import workload
from remat.profile.ops import profile_ops


def _breaks(model: nn.Module, inputs: Any) -> int:
    torch._dynamo.reset()
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    kwargs = inputs if isinstance(inputs, dict) else {}
    count = torch._dynamo.explain(model)(*(() if kwargs else args), **kwargs).graph_break_count
    torch._dynamo.reset()
    return int(count)


def _counting_eager_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on (until ``monkeypatch.undo()``), ``out[0]`` counts the calls of remat's eager runtime."""
    from remat.core import runtime

    calls = [0]
    invoke = runtime._invoke

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return invoke(*args, **kwargs)

    monkeypatch.setattr(runtime, "_invoke", counted)
    return calls


def _eager_calls(model: nn.Module, inputs: Any, monkeypatch: pytest.MonkeyPatch) -> int:
    """Calls of remat's eager runtime during one compiled forward (after a first one that compiles)."""
    torch._dynamo.reset()
    # aot_eager: dynamo and AOT autograd (where a checkpoint's recomputation is partitioned), without
    # inductor's code generation, which these counts do not need.
    compiled = torch.compile(model, backend="aot_eager")
    run = (lambda: compiled(**inputs)) if isinstance(inputs, dict) else (lambda: compiled(inputs))
    run()
    calls = _counting_eager_calls(monkeypatch)
    run()
    monkeypatch.undo()
    torch._dynamo.reset()
    return calls[0]


def _gpt() -> tuple[nn.Module, Any, Callable[[Any], torch.Tensor]]:
    w = workload("gpt", n_layers=4, d_model=64, n_heads=2, seq_len=64, batch=4, vocab_size=128, dropout=0.0)
    return w.model, w.inputs, w.loss_fn


def _llama() -> tuple[nn.Module, Any, Callable[[Any], torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (4, 128))
    # Training without a KV cache, as HF's own gradient checkpointing forces: a cache update inside a
    # checkpointed layer is a side effect dynamo will not trace inside a checkpoint.
    return model, {"input_ids": ids, "labels": ids, "use_cache": False}, lambda out: out.loss


@pytest.mark.parametrize("make", [_gpt, _llama], ids=["gpt", "llama"])
def test_compile_solver_plans_compile_whole_and_recompute_inside(
    make: Callable[[], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, inputs, loss_fn = make()
    prof = remat.profile(model, inputs, loss_fn, repeats=1, ops=False)
    plan = remat.plan(prof, "60%", solver="compile")
    # Something is recomputed, each operation one checkpoint of one module.
    assert any(isinstance(op, (Recompute, RecomputeSub)) for op in plan.ops)
    for op in plan.ops:
        if isinstance(op, Recompute):
            assert op.stop == op.start + 1 and not any(isinstance(i, RecomputeSub) for i in op.inner), plan.describe()
    eager = copy.deepcopy(model)
    remat.apply(model, plan)
    assert _breaks(model, inputs) == 0  # as the plain model (HF's Llama without a KV cache too)

    # One compiled model for the rest: a first step compiles, the second counts the calls that reach
    # remat's eager runtime (none: every block runs compiled) and gives the gradients.
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    loss_fn(compiled(**inputs) if isinstance(inputs, dict) else compiled(inputs)).backward()
    for m in (eager, model):
        for p in m.parameters():
            p.grad = None
    loss_fn(eager(**inputs) if isinstance(inputs, dict) else eager(inputs)).backward()
    calls = _counting_eager_calls(monkeypatch)
    loss_fn(compiled(**inputs) if isinstance(inputs, dict) else compiled(inputs)).backward()
    assert calls == [0]
    monkeypatch.undo()
    for (name, a), b in zip(eager.named_parameters(), model.parameters()):
        assert a.grad is not None and b.grad is not None
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), name

    # The compiled graph recomputes inside: its peak is below the compiled plain model's. The budget itself
    # is eager's: the compiled backward schedules the recomputation of its checkpoints itself, and
    # compiled peaks measured 0.88-1.10x the budget on such models (README, Known limits).
    measured = remat.measure(compiled, inputs, loss_fn, steps=1, blocks=()).peak_bytes
    remat.remove(model)
    torch._dynamo.reset()
    plain = remat.measure(torch.compile(model, backend="aot_eager"), inputs, loss_fn, steps=1, blocks=()).peak_bytes
    assert plan.budget_bytes is not None and plan.predicted_peak_bytes is not None
    assert measured < plain, (measured, plain, plan.describe())
    torch._dynamo.reset()


def test_segments_of_several_modules_run_eagerly_under_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the compile solver avoids: each member of a multi-module segment runs through the eager runtime.
    model, inputs, _loss_fn = _gpt()
    remat.apply(model, remat.plan(model, strategy=remat.segments(2)))
    assert _eager_calls(model, inputs, monkeypatch) > 0
    remat.apply(model, remat.plan(model, strategy=remat.full()))
    assert _eager_calls(model, inputs, monkeypatch) == 0


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
def test_op_level_policies_run_eagerly_under_compile_and_train_like_the_plain_model(
    dropout: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Block 0 keeps its matmuls' outputs and recomputes the rest (RecomputeOps). Dynamo cannot take
    # the policy's per-call op counters as a constant, and the region may hold in-place ops (dropout's
    # bernoulli_, which the policy's keys do not name): the policy block runs through remat's eager
    # runtime (NOTE [ Under torch.compile ]), and the compiled model trains like the plain one.
    w = workload("gpt", n_layers=3, d_model=64, n_heads=2, seq_len=64, batch=4, vocab_size=128, dropout=dropout)
    blocks = remat.blocks(w.model)
    first = profile_ops(w.model, w.inputs, w.loss_fn, blocks, rounds=1)[0]
    save = tuple(o.key for o in first.ops if o.name == "addmm")
    recompute = tuple(o.key for o in first.ops if o.saved_bytes and o.key not in save)
    # Block 0 under the policy, the others recomputed whole, each alone (which compiles).
    ops = (RecomputeOps(0, save, recompute), *(Recompute(k, k + 1, (Keep(k),)) for k in range(1, len(blocks))))
    plan = dataclasses.replace(remat.plan(w.model, strategy=remat.none()), ops=ops)
    eager = copy.deepcopy(w.model)
    remat.apply(w.model, plan)
    # Only the policy block runs eagerly (a policy traced by dynamo once sent the whole forward to eager).
    torch._dynamo.utils.counters.clear()
    assert _eager_calls(w.model, w.inputs, monkeypatch) == 1
    # One graph break, the intended one around the policy block: dynamo never tries to trace the policy
    # (it failed on its per-call counters inside the block and skipped the model's whole forward frame;
    # explain() does not count that one).
    breaks = torch._dynamo.utils.counters["graph_break"]
    assert len(breaks) == 1 and "torch.compiler.disable" in next(iter(breaks)), dict(breaks)
    if dropout:
        return  # compiled and eager dropout draw different masks
    torch._dynamo.reset()
    compiled = torch.compile(w.model, backend="aot_eager")
    for m in (eager, w.model):
        for p in m.parameters():
            p.grad = None
    w.loss_fn(eager(w.inputs)).backward()
    w.loss_fn(compiled(w.inputs)).backward()
    for (name, a), b in zip(eager.named_parameters(), w.model.parameters()):
        assert a.grad is not None and b.grad is not None
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), name
    torch._dynamo.reset()
