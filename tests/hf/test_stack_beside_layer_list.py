"""Conditional DETR's decoder holds its layers in a ModuleList beside two small heads of one class
(`query_scale`, `ref_point_head`). The heads were taken as the decoder's stack, its layers were no blocks,
and as `query_scale` runs once per decoder layer after the first, the profile refused the model (helper-120;
with a ResNet-18 backbone and the default 6 + 6 layers too). DAB-DETR has three such heads and was refused at its
default size (ResNet-50 backbone). NOTE [ A stack beside a list of layers ] in
remat/blocks.py."""

from __future__ import annotations

import copy
import warnings

import torch
from transformers import ConditionalDetrConfig, ConditionalDetrModel, DabDetrConfig, DabDetrModel, ResNetConfig

import remat


def _detr() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    backbone = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], out_features=["stage2"])
    config = ConditionalDetrConfig(
        backbone_config=backbone, use_timm_backbone=False, use_pretrained_backbone=False, num_queries=6,
        encoder_layers=2, decoder_layers=3, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_attention_heads=2,
        decoder_attention_heads=2, d_model=32, dropout=0.1, num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = ConditionalDetrModel(config).train()
    g = torch.Generator().manual_seed(0)
    return model, {
        "pixel_values": torch.randn(2, 3, 64, 64, generator=g),
        "pixel_mask": torch.ones(2, 64, 64, dtype=torch.long),
    }


def _loss(out: object) -> torch.Tensor:
    return out.last_hidden_state.square().mean() + out.encoder_last_hidden_state.square().mean()  # type: ignore[attr-defined]


def test_the_decoder_layers_are_blocks_not_the_heads_beside_them() -> None:
    model, _ = _detr()
    names = [b.name for b in remat.blocks(model)]
    assert [f"decoder.layers.{i}" for i in range(3)] == [n for n in names if n.startswith("decoder.")], names


def test_dab_detr_decoder_layers_are_blocks_not_its_three_heads() -> None:
    backbone = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], out_features=["stage2"])
    config = DabDetrConfig(
        backbone_config=backbone, use_timm_backbone=False, use_pretrained_backbone=False, num_queries=6,
        encoder_layers=2, decoder_layers=3, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_attention_heads=2,
        decoder_attention_heads=2, hidden_size=32,
    )  # fmt: skip
    names = [b.name for b in remat.blocks(DabDetrModel(config))]
    assert [f"decoder.layers.{i}" for i in range(3)] == [n for n in names if n.startswith("decoder.")], names


def test_the_model_is_profiled_and_a_full_plan_gives_the_plain_gradients() -> None:
    warnings.filterwarnings("ignore")
    model, inputs = _detr()
    prof = remat.profile(model, inputs, _loss, repeats=1, ops=False, progress=False)
    plan = remat.plan(prof, strategy=remat.full())
    planned = copy.deepcopy(model)
    remat.apply(planned, plan)
    torch.manual_seed(1)
    _loss(model(**inputs)).backward()
    torch.manual_seed(1)
    _loss(planned(**inputs)).backward()
    for (name, p), q in zip(model.named_parameters(), planned.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name
    measured = remat.measure(planned, inputs, _loss, steps=1).peak_bytes
    assert measured <= plan.predicted_peak_bytes * 1.05, (measured, plan.predicted_peak_bytes)
