"""``hf.RematCallback`` plans for the loop the Trainer runs: forward, backward and its optimizer's step
(helper-110). Before, it planned forward + backward only (``hf.enable`` without ``optimizer=``), which
docs/huggingface.md warns can peak 1.05-1.13x the budget in an AdamW loop, and a Trainer always steps
an optimizer. The Trainer hands its optimizer to ``on_train_begin``; profiling with it must leave
training exactly as without the callback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import remat
from remat.integrations import hf


def _model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = GPT2Config(
            vocab_size=64, n_positions=64, n_embd=64, n_layer=4, n_head=4, use_cache=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        return GPT2LMHeadModel(config)


def _data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (4, 32), generator=g)
    return [{"input_ids": ids[i], "labels": ids[i]} for i in range(4)] * 2


def _train(tmp_path: Path, callbacks: list[Any]) -> nn.Module:
    model = _model()
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, use_cpu=True, report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    Trainer(model=model, args=args, train_dataset=_data(), callbacks=callbacks).train()
    return model


def test_the_callback_plans_for_the_trainers_optimizer_step_and_trains_like_the_plain_model(tmp_path: Path) -> None:
    plain = _train(tmp_path, [])
    callback = hf.RematCallback(budget="50%", repeats=1)
    model = _train(tmp_path, [callback])
    plan = callback.plan
    assert plan is not None and plan.checkpointed and remat.applied(model) == plan
    assert plan.loop is not None and plan.loop.optimizer is not None, plan.loop
    assert "Optimizer step" in plan.loop.describe() and "optimizer state" in plan.loop.describe()
    # Profiling stepped the Trainer's optimizer and put it back: the same weights after two steps.
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
