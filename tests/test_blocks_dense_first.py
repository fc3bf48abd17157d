"""MoE decoders whose first layers are dense (``first_k_dense_replace``: DeepSeek-V2/V3, Kimi K2, dots1,
GLM-4.5-Air, AFMoE): every layer is one class in one ModuleList, the first with an MLP, the others with a
MoE. The dense layer is a block like the others (NOTE [ Layers of one class in a ModuleList ]); it was left
out, and a model of two such layers had no stack, so the whole decoder was one block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Dots1Config, Dots1ForCausalLM

import remat
from remat.errors import BudgetInfeasibleError

from .zoo.models import Case, compare_steps, run_step, seeded


def names(blocks: tuple[remat.Block, ...]) -> list[str]:
    return [b.fqns[0] for b in blocks]


class Mlp(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Moe(nn.Module):
    def __init__(self, d: int, n: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(d, n)
        self.experts = nn.ModuleList(Mlp(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.gate(x).softmax(-1)
        return sum(w[..., i : i + 1] * e(x) for i, e in enumerate(self.experts))


class Layer(nn.Module):
    """One decoder layer class; the MLP is dense below ``first_k_dense``, a MoE above."""

    def __init__(self, d: int, dense: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = Mlp(d) if dense else Moe(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Decoder(nn.Module):
    def __init__(self, d: int = 16, n: int = 4, first_k_dense: int = 1) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, d)
        self.layers = nn.ModuleList(Layer(d, i < first_k_dense) for i in range(n))
        self.head = nn.Linear(d, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_a_dense_first_layer_is_a_block_beside_the_moe_layers() -> None:
    assert names(remat.blocks(Decoder(n=4))) == ["layers.0", "layers.1", "layers.2", "layers.3"]
    # Two layers, one dense and one MoE: still the stack, not the root's children.
    assert names(remat.blocks(Decoder(n=2))) == ["layers.0", "layers.1"]
    # Three dense layers first (DeepSeek-V3's first_k_dense_replace=3): one stack of all.
    assert names(remat.blocks(Decoder(n=5, first_k_dense=3))) == [f"layers.{i}" for i in range(5)]


def test_layers_of_different_classes_and_sequentials_stay_apart() -> None:
    class Other(Layer):
        pass

    model = Decoder(n=3)
    model.layers.append(Other(16, dense=False))
    model.layers.append(Other(16, dense=False))
    # The two Others are a run of their own; the three Layers one stack: both are taken, in order.
    assert names(remat.blocks(model)) == [f"layers.{i}" for i in range(5)]
    # A ResNet-like Sequential stem beside Sequential stages keeps the children rule.
    stem = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
    stages = [nn.Sequential(nn.Conv2d(8, 8, 3), nn.Conv2d(8, 8, 3)) for _ in range(3)]
    net = nn.Sequential()
    net.add_module("layers", nn.ModuleList([stem, *stages]))
    assert "layers.0" not in names(remat.blocks(net))


@seeded
def dots1() -> Case:
    config = Dots1Config(
        vocab_size=1000, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=128, attention_dropout=0.1,
        use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = Dots1ForCausalLM(config)
    ids = torch.randint(3, 1000, (2, 32))
    return Case(model, {"input_ids": ids, "labels": ids}, lambda out: out.loss)


def test_hf_dots1_plans_its_dense_layer_bitwise_within_budget() -> None:
    case = dots1()
    # Before: ["model.layers.1", "model.layers.2"], and the smallest feasible peak 0.63 of the plain one (0.45 now).
    assert names(remat.blocks(case.model)) == ["model.layers.0", "model.layers.1", "model.layers.2"]
    prof = remat.profile(case.model, case.inputs, case.loss_fn, repeats=1, grads="held")
    try:
        remat.plan(prof, budget="1B")
    except BudgetInfeasibleError as e:
        smallest = e.min_peak_bytes
    plan = remat.plan(prof, budget=smallest)
    plain = run_step(dots1())
    case = dots1()
    remat.apply(case.model, plan)
    assert compare_steps(plain, run_step(case)) == []
    peak = remat.measure(case.model, case.inputs, case.loss_fn, steps=1, grads="held").peak_bytes
    assert peak <= plan.budget_bytes * 1.05
    assert abs(peak / plan.predicted_peak_bytes - 1) <= 0.05, (peak, plan.predicted_peak_bytes)


def test_hybrid_decoders_keep_their_attention_layers() -> None:
    # Qwen3.5 (Gated DeltaNet x3, then full attention) and LFM3 (short convolutions with an attention layer
    # between): one layer class, a `linear_attn` / `conv` child in most layers and `self_attn` in the others.
    # The attention layers, the ones with the largest activations, were left out of the default blocks
    # (never recomputed): ['model.layers.0', 'model.layers.1', 'model.layers.2'] and ['model.layers.0',
    # 'model.layers.1'] before.
    from transformers import Lfm3Config, Lfm3ForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    qwen = Qwen3_5TextConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, layer_types=["linear_attention"] * 3 + ["full_attention"],
    )  # fmt: skip
    assert names(remat.blocks(Qwen3_5ForCausalLM(qwen))) == [f"model.layers.{i}" for i in range(4)]
    lfm = Lfm3Config(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "conv", "full_attention", "conv"], pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    assert names(remat.blocks(Lfm3ForCausalLM(lfm))) == [f"model.layers.{i}" for i in range(4)]
