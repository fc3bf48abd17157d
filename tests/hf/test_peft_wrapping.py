"""PEFT prefix tuning (a KV cache every layer's attention appends to) and a plan made before PEFT wrapped the
model: setups from a sweep of training loops (helper-56)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import remat
from remat.integrations import hf

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.1, use_cache=False, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(3):
        ids = torch.randint(3, 128, (2, 16), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return out


def _train(model: torch.nn.Module, batches: list[dict[str, Any]]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(123)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for b in batches:
        loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _same(
    a: tuple[list[torch.Tensor], dict[str, torch.Tensor]], b: tuple[list[torch.Tensor], dict[str, torch.Tensor]]
) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True)) and all(
        torch.equal(a[1][k], b[1][k]) for k in a[1]
    )


def _prefix(model: torch.nn.Module) -> torch.nn.Module:
    return peft.get_peft_model(model, peft.PrefixTuningConfig(task_type=peft.TaskType.CAUSAL_LM, num_virtual_tokens=4))


def test_prefix_tuning_layers_keep_their_attention_and_recompute_their_mlp() -> None:
    # Every layer's attention appends to the prefix's DynamicCache: the layers are stateful. Their MLPs
    # never see it; before, no sub-module was offered either, and every budget below the plain peak was
    # refused with a hint to profile finer blocks.
    batches = _batches()
    expected = _train(_prefix(_llama()), batches)
    model = _prefix(_llama())
    with torch.random.fork_rng(devices=[]):
        plan = hf.enable(model, batches[0], budget="90%", optimizer=torch.optim.AdamW)
    assert "mlp" in plan.describe() and "self_attn" not in plan.describe()
    assert _same(_train(model, batches), expected)
    m = remat.measure(model, batches[0], lambda o: o.loss, steps=1, optimizer=torch.optim.AdamW)
    assert m.peak_bytes <= plan.budget_bytes * 1.05


def test_an_infeasible_budget_with_a_kv_cache_says_why() -> None:
    batches = _batches()
    model = _prefix(_llama())
    with pytest.raises(remat.BudgetInfeasibleError, match=r"never recomputed whole.*KV cache passed to the layers"):
        hf.enable(model, batches[0], budget="10%", optimizer=torch.optim.AdamW)


def test_enable_replaces_a_plan_applied_before_peft_wrapped_the_model() -> None:
    # hf.enable on the base model, get_peft_model, hf.enable on the PEFT model: the first plan, left on the
    # inner model, replayed the layers in the profile's backward (reported as HF's own checkpointing).
    batches = _batches()

    def lora(model: torch.nn.Module) -> torch.nn.Module:
        torch.manual_seed(7)
        return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_dropout=0.1, target_modules=["q_proj", "v_proj"]))

    expected = _train(lora(_llama()), batches)
    base = _llama()
    with torch.random.fork_rng(devices=[]):
        hf.enable(base, batches[0], budget="70%", optimizer=torch.optim.AdamW)
    wrapped = lora(base)
    with pytest.raises(remat.RematError, match="already applied to the sub-module"):
        remat.profile(wrapped, batches[0], lambda o: o.loss)
    with torch.random.fork_rng(devices=[]):
        hf.enable(wrapped, batches[0], budget="50%", optimizer=torch.optim.AdamW)
    assert remat.applied(base) is None
    assert _same(_train(wrapped, batches), expected)
