"""remat.blocks on HuggingFace models built from tiny configs (nothing downloaded).

Every stack in forward order (T5's encoder then decoder, CLIP's vision tower then text tower), and in
every layer the attention and feed-forward sub-modules, found by structure (NOTE [ Attention and FFN
by structure ] in remat/blocks.py): the exact FQNs, that the forward really calls them in that order,
and that checkpointing them gives bitwise-equal gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import (
    BertConfig,
    BertForMaskedLM,
    CLIPConfig,
    CLIPModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
    ViTConfig,
    ViTForImageClassification,
)

import remat
from remat.blocks import LayerType
from remat.core.ops import RecomputeSub

N, D, FF, HEADS, VOCAB = 2, 16, 32, 2, 32
# Special tokens inside the vocabulary; no KV cache in training, as HF sets it with checkpointing.
TOKENS: dict[str, Any] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
TEXT: dict[str, Any] = dict(
    num_hidden_layers=N, hidden_size=D, intermediate_size=FF, num_attention_heads=HEADS, vocab_size=VOCAB
)
VISION: dict[str, Any] = dict(
    num_hidden_layers=N, hidden_size=D, intermediate_size=FF, num_attention_heads=HEADS, image_size=8, patch_size=4
)


def _ids() -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 8))


def gpt2() -> tuple[nn.Module, dict[str, Any]]:
    config = GPT2Config(n_layer=N, n_embd=D, n_head=HEADS, vocab_size=VOCAB, n_positions=16, use_cache=False, **TOKENS)
    ids = _ids()
    return GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}


def llama() -> tuple[nn.Module, dict[str, Any]]:
    config = LlamaConfig(**TEXT, num_key_value_heads=1, use_cache=False, **TOKENS)
    ids = _ids()
    return LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}


def bert() -> tuple[nn.Module, dict[str, Any]]:
    config = BertConfig(**TEXT, max_position_embeddings=16, **TOKENS)
    ids = _ids()
    return BertForMaskedLM(config), {"input_ids": ids, "labels": ids}


def t5() -> tuple[nn.Module, dict[str, Any]]:
    config = T5Config(
        num_layers=N,
        num_decoder_layers=N,
        d_model=D,
        d_ff=FF,
        num_heads=HEADS,
        d_kv=D // HEADS,
        vocab_size=VOCAB,
        decoder_start_token_id=0,
        use_cache=False,
        **TOKENS,
    )
    ids = _ids()
    return T5ForConditionalGeneration(config), {"input_ids": ids, "labels": ids}


def vit() -> tuple[nn.Module, dict[str, Any]]:
    config = ViTConfig(**VISION, num_labels=3)
    return ViTForImageClassification(config), {"pixel_values": torch.randn(2, 3, 8, 8), "labels": torch.tensor([0, 2])}


def clip() -> tuple[nn.Module, dict[str, Any]]:
    config = CLIPConfig(
        text_config=dict(TEXT, max_position_embeddings=16, **TOKENS), vision_config=VISION, projection_dim=8
    )
    return CLIPModel(config), {"input_ids": _ids(), "pixel_values": torch.randn(2, 3, 8, 8), "return_loss": True}


Layer = tuple[str, tuple[str, ...], tuple[str, ...]]  # block FQN, attention FQNs, FFN FQNs


def _stack(prefix: str, attention: tuple[str, ...], ffn: tuple[str, ...]) -> list[Layer]:
    return [
        (f"{prefix}.{i}", tuple(f"{prefix}.{i}.{a}" for a in attention), tuple(f"{prefix}.{i}.{f}" for f in ffn))
        for i in range(N)
    ]


# What remat.blocks must find, block by block.
EXPECTED: dict[str, tuple[Callable[[], tuple[nn.Module, dict[str, Any]]], list[Layer]]] = {
    # The fused c_attn (Conv1D, d -> 3d) and the Conv1D MLP.
    "gpt2": (gpt2, _stack("transformer.h", ("attn",), ("mlp",))),
    # post_attention_layernorm is a norm, not attention; the gated MLP (gate, up, down).
    "llama": (llama, _stack("model.layers", ("self_attn",), ("mlp",))),
    # q, k, v live in attention.self; the FFN is split over the siblings intermediate and output.
    "bert": (bert, _stack("bert.encoder.layer", ("attention.self",), ("intermediate", "output"))),
    # Encoder blocks, then decoder blocks (with cross-attention); the FFN without its layer norm.
    "t5": (
        t5,
        _stack("encoder.block", ("layer.0.SelfAttention",), ("layer.1.DenseReluDense",))
        + _stack("decoder.block", ("layer.0.SelfAttention", "layer.1.EncDecAttention"), ("layer.2.DenseReluDense",)),
    ),
    "vit": (vit, _stack("vit.layers", ("attention",), ("mlp",))),
    # CLIP registers text_model first but its forward runs the vision tower first.
    "clip": (
        clip,
        _stack("vision_model.encoder.layers", ("self_attn",), ("mlp",))
        + _stack("text_model.encoder.layers", ("self_attn",), ("mlp",)),
    ),
}


def _build(name: str) -> tuple[nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    model, inputs = EXPECTED[name][0]()
    return model.train(), inputs


def _loss(out: Any) -> torch.Tensor:
    return out.loss


@pytest.mark.parametrize("name", EXPECTED)
def test_every_stack_and_its_attention_and_ffn(name: str) -> None:
    model, _ = _build(name)
    found = remat.blocks(model)
    assert [(b.name, b.attention_fqns, b.ffn_fqns) for b in found] == EXPECTED[name][1]
    assert {b.type_hint for b in found} == {LayerType.OTHER}


@pytest.mark.parametrize("name", EXPECTED)
def test_the_forward_runs_blocks_in_the_listed_order_and_each_sub_module_once(name: str) -> None:
    model, inputs = _build(name)
    found = remat.blocks(model)
    ran: list[str] = []
    subs = {f: 0 for b in found for f in (*b.attention_fqns, *b.ffn_fqns)}

    def count(fqn: str) -> None:
        subs[fqn] += 1

    handles = [model.get_submodule(b.name).register_forward_pre_hook(lambda *_, n=b.name: ran.append(n)) for b in found]
    handles += [model.get_submodule(f).register_forward_pre_hook(lambda *_, f=f: count(f)) for f in subs]
    with torch.no_grad():
        model(**inputs)
    for h in handles:
        h.remove()
    assert ran == [b.name for b in found]
    assert set(subs.values()) == {1}


@pytest.mark.parametrize("name", EXPECTED)
def test_attention_only_and_ffn_only_checkpoint_every_layer_exactly(name: str) -> None:
    # Before structure: nothing to checkpoint for ffn_only on BERT and T5 (a silent no-op plan), and
    # Llama's post_attention_layernorm checkpointed as attention.
    model, inputs = _build(name)
    found = remat.blocks(model)
    for strategy in (remat.attention_only(), remat.ffn_only()):
        ops = remat.plan(found, strategy=strategy).ops
        assert all(isinstance(op, RecomputeSub) for op in ops), ops
        assert remat.check_gradients(model, strategy, inputs, _loss).equal, strategy.name


def test_lora_projections_do_not_hide_the_layers() -> None:
    # PEFT wraps each projection in a module with children; each is still one projection, not a layer.
    model, inputs = _build("llama")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = get_peft_model(model, LoraConfig(r=2, target_modules=targets))
    expected = [tuple(f"base_model.model.{f}" for f in (n, *a, *m)) for n, a, m in EXPECTED["llama"][1]]
    assert [(b.name, *b.attention_fqns, *b.ffn_fqns) for b in remat.blocks(lora)] == expected
    assert remat.check_gradients(lora, remat.ffn_only(), inputs, _loss).equal
