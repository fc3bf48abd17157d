"""torch.compile on a model with a plan applied: the checkpointed blocks run eagerly, correctly."""

from __future__ import annotations

import copy

import torch

import remat
from remat.models import workload


def test_compiled_model_with_a_multi_block_plan_trains_like_the_eager_plain_model() -> None:
    torch._dynamo.reset()
    w = workload("gpt", n_layers=4, d_model=32, n_heads=2, seq_len=16, batch=2, vocab_size=64, dropout=0.0)
    plain = copy.deepcopy(w.model)
    w.loss_fn(plain(w.inputs)).backward()
    remat.apply(w.model, remat.segments(2))
    compiled = torch.compile(w.model)
    w.loss_fn(compiled(w.inputs)).backward()
    for (name, a), b in zip(plain.named_parameters(), w.model.parameters()):
        assert b.grad is not None and torch.allclose(a.grad, b.grad, atol=1e-6, rtol=1e-5), name  # type: ignore[arg-type]
    torch._dynamo.reset()
