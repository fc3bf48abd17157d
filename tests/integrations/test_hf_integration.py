"""``remat.integrations.hf``: one call (and a Trainer callback) that profiles, plans and applies.

GPT-2 and Llama built from small configs (nothing downloaded), dropout on, with and without LoRA
adapters (PEFT: the base frozen, the adapters trainable): ``hf.enable`` at 40% of the plain peak must
give a step bitwise equal to the plain model's (loss, outputs, every gradient, buffers) and a measured
peak within the budget + 5%. The runnable examples of docs/huggingface.md run as they are.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import remat
from remat.errors import RematError
from remat.integrations import hf

from ..zoo.models import Case, compare_steps, run_step

BATCH, SEQ, VOCAB, HIDDEN, LAYERS, HEADS = 4, 32, 64, 64, 6, 4
P = 0.1  # every dropout probability
BUDGET = 0.4  # of the plain peak
PEAK_SLACK = 1.05  # measured peak <= budget x this
DOCS = Path(__file__).parents[2] / "docs" / "huggingface.md"
# No special tokens outside the tiny vocabulary; use_cache=False as for training with checkpointing.
_COMMON: dict[str, Any] = {"use_cache": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _model(name: str, lora: bool) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if name == "gpt2":
            gpt2_config = GPT2Config(
                vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                resid_pdrop=P, embd_pdrop=P, attn_pdrop=P, **_COMMON,
            )  # fmt: skip
            model: nn.Module = GPT2LMHeadModel(gpt2_config)
            targets = ["c_attn", "c_fc"]
        else:
            llama_config = LlamaConfig(
                vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=HEADS // 2, max_position_embeddings=SEQ,
                attention_dropout=P, **_COMMON,
            )  # fmt: skip
            model = LlamaForCausalLM(llama_config)
            targets = ["q_proj", "v_proj", "up_proj"]
        if lora:
            # init_lora_weights=False: both adapter matrices random, so the adapters change the output
            # and every adapter weight gets a gradient.
            model = get_peft_model(
                model, LoraConfig(r=4, target_modules=targets, lora_dropout=P, init_lora_weights=False)
            )
    return model.train()


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0  # padding in one sequence, so the mask matters
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def _loss(out: Any) -> torch.Tensor:
    return out.loss  # type: ignore[no-any-return]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_enable_is_bitwise_exact_within_budget(name: str, lora: bool) -> None:
    batch = _batch()
    plain = run_step(Case(_model(name, lora), batch, _loss))
    model = _model(name, lora)
    plan = hf.enable(model, batch, budget=f"{BUDGET:.0%}", repeats=1)
    assert plan.checkpointed and remat.applied(model) == plan
    step = run_step(Case(model, batch, _loss))
    assert compare_steps(plain, step) == []
    if lora:  # the base frozen, the adapters trained
        grads = {k: v for k, v in step.items() if k.startswith("grad:")}
        assert all((v is None) != ("lora_" in k) for k, v in grads.items()), [
            k for k, v in grads.items() if v is not None
        ][:5]
    assert plan.budget_bytes is not None and plan.baseline_peak_bytes is not None
    assert abs(plan.budget_bytes / plan.baseline_peak_bytes - BUDGET) < 1e-3
    peak = remat.measure(model, batch, _loss, steps=1).peak_bytes
    assert peak <= plan.budget_bytes * PEAK_SLACK, (
        f"measured peak {peak} B > budget {plan.budget_bytes} B x {PEAK_SLACK}"
    )
    assert hf.disable(model) == plan and remat.applied(model) is None


def test_trainer_callback_plans_on_the_first_batch_and_trains_like_the_plain_model(tmp_path: Path) -> None:
    data = [{k: v[i] for k, v in _batch().items()} for i in range(BATCH)] * 2

    def train(callbacks: list[Any]) -> nn.Module:
        model = _model("gpt2", lora=False)
        args = TrainingArguments(
            output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, use_cpu=True, report_to=[],
            save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        )  # fmt: skip
        Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks).train()
        return model

    plain = train([])
    callback = hf.RematCallback(budget="50%", repeats=1)
    model = train([callback])
    assert callback.plan is not None and callback.plan.checkpointed and remat.applied(model) == callback.plan
    # Same batches, same dropout masks, bitwise equal gradients: the same weights after two steps.
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), n


def test_hf_checkpointing_on_is_refused() -> None:
    model = _model("gpt2", lora=False)
    model.gradient_checkpointing_enable()  # type: ignore[operator]
    with pytest.raises(RematError, match=r"hf.enable: HF's own checkpointing is on .*gradient_checkpointing_disable"):
        hf.enable(model, _batch())
    assert remat.applied(model) is None
    # remat.apply too, for a plan that recomputes anything (a plan that keeps everything changes nothing).
    with pytest.raises(RematError, match=r"apply: HF's own checkpointing is on \(modules \['transformer'"):
        remat.apply(model, remat.full())
    assert remat.applied(model) is None
    remat.apply(model, remat.none())
    model.gradient_checkpointing_disable()  # type: ignore[operator]
    remat.apply(model, remat.full())


def test_a_batch_without_labels_asks_for_them() -> None:
    batch = _batch()
    del batch["labels"]
    with pytest.raises(RematError, match=r"hf.enable: the model returned no loss .*give the batch 'labels'.*loss_fn="):
        hf.enable(_model("llama", lora=False), batch)
    with pytest.raises(RematError, match=r"hf.enable: sample_batch is a Tensor; give the model's keyword arguments"):
        hf.enable(_model("llama", lora=False), batch["input_ids"])  # type: ignore[arg-type]


def test_importing_the_integration_does_not_import_transformers() -> None:
    code = "import sys, remat.integrations.hf; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def _examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(_examples())))
def test_docs_example_runs(index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # In this process (transformers is imported already; a fresh interpreter spends 5 s importing it),
    # in a namespace of its own and a scratch directory, as a user's script would run.
    monkeypatch.chdir(tmp_path)
    exec(compile(_examples()[index], f"{DOCS.name}, example {index}", "exec"), {"__name__": "__main__"})


def test_a_kv_cache_built_in_training_is_refused_by_apply_and_turned_off_by_enable() -> None:
    # LlamaConfig's default use_cache=True builds a DynamicCache in a training forward; each replay
    # appended its layer's keys to it again (gradients equal, the returned cache 2x long), silently.
    model = _model("llama", lora=False)
    model.config.use_cache = True
    remat.apply(model, remat.full())
    out = model(**_batch())
    length = out.past_key_values.get_seq_length()
    with pytest.raises(RematError, match=r"\(DynamicCache\) was changed by the call.*use_cache=False"):
        out.loss.backward()
    assert out.past_key_values.get_seq_length() == length == SEQ
    remat.remove(model)
    plain = run_step(Case(_model("llama", lora=False), _batch(), _loss))
    model = _model("llama", lora=False)
    model.config.use_cache = True
    hf.enable(model, _batch(), budget="40%", repeats=1)
    assert model.config.use_cache is False
    assert compare_steps(plain, run_step(Case(model, _batch(), _loss))) == []


def test_lora_adapters_switched_between_two_forwards_before_one_backward_train_bitwise() -> None:
    # peft's set_adapter replaces the LoRA layers' list of active adapter names; before, each replay read
    # the names set since its call: gradients 0.064 off under full() and segments(2), silently (helper-38).
    def build() -> tuple[nn.Module, dict[str, torch.Tensor]]:
        model = _model("llama", lora=True)  # its adapter is "default"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(2)
            targets = ["q_proj", "v_proj", "up_proj"]
            model.add_adapter("b", LoraConfig(r=4, target_modules=targets, lora_dropout=P, init_lora_weights=False))
        return model, _batch()

    def step(model: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        torch.manual_seed(1)  # the same dropout draws in both runs
        losses = []
        for name in ("default", "b"):
            model.base_model.set_adapter(name)  # makes only that adapter's parameters trainable
            for n, p in model.named_parameters():
                p.requires_grad_("lora_" in n)
            losses.append(model(**batch).loss)
        (losses[0] + 0.5 * losses[1]).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = step(*build())
    for plan in (remat.full(), remat.segments(2)):
        model, batch = build()
        remat.apply(model, plan)
        got = step(model, batch)
        assert got.keys() == plain.keys() and all(torch.equal(got[k], plain[k]) for k in plain), plan


def test_enable_plans_for_the_optimizer_it_is_given() -> None:
    # Without the optimizer, a plan for the forward and backward only: in an AdamW loop the step peaked
    # 1.05-1.13x the budget hf.enable had accepted, every block kept (helper-47). "100%" is of the peak of
    # the loop it is told about.
    from remat.core.ops import RecomputeOps

    batch = _batch()
    model = _model("llama", False)
    plan = hf.enable(model, batch, budget="100%", repeats=1, optimizer=torch.optim.AdamW, ops=False)
    assert plan.loop.optimizer is not None and not any(isinstance(op, RecomputeOps) for op in plan.ops)
    peak = remat.measure(model, batch, _loss, steps=2, optimizer=torch.optim.AdamW).peak_bytes
    assert plan.budget_bytes is not None and peak <= plan.budget_bytes * PEAK_SLACK, (peak, plan.budget_bytes)


def test_enable_passes_allow_saved_tensor_hooks_to_apply() -> None:
    def offload(t: torch.Tensor) -> torch.Tensor:
        return t.clone()  # gives back what it was given, as an offload to the host and back does

    def step(model: nn.Module) -> list[torch.Tensor]:
        torch.manual_seed(0)
        with torch.autograd.graph.saved_tensors_hooks(offload, offload):
            loss = _loss(model(**_batch()))
        loss.backward()
        return [p.grad for p in model.parameters() if p.grad is not None]

    torch.manual_seed(0)
    model = _model("llama", lora=False)
    plain = step(copy.deepcopy(model))
    for allow in (False, True):
        planned = copy.deepcopy(model)
        plan = hf.enable(planned, _batch(), budget="40%", repeats=1, ops=False, allow_saved_tensor_hooks=allow)
        assert plan.checkpointed
        if not allow:
            with pytest.raises(RematError, match="allow_saved_tensor_hooks=True"):
                step(planned)
            continue
        got = step(planned)
        assert len(plain) == len(got) and all(torch.equal(a, b) for a, b in zip(plain, got, strict=True))
