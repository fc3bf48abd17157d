"""remat.blocks: default detection, selectors, named blocks and their errors, type hints."""

from __future__ import annotations

import pytest
from torch import nn

import remat
from remat.blocks import LayerType, fingerprint
from remat.errors import BlockSelectionError
from remat.models import gpt, mlp_chain, resnet, unet


def names(block_list: tuple[remat.Block, ...]) -> list[str]:
    return [b.name for b in block_list]


def test_default_blocks_are_the_longest_run_of_repeated_children() -> None:
    assert names(remat.blocks(gpt(vocab_size=16, d_model=8, n_heads=2, n_layers=3, seq_len=4))) == ["blocks.0", "blocks.1", "blocks.2"]
    assert names(remat.blocks(resnet(layers=(1, 1, 1)))) == ["layer1", "layer2", "layer3"]
    assert names(remat.blocks(mlp_chain(widths=(4, 8, 6, 4)))) == ["0", "1", "2"]
    # No repeated children: the root's children.
    seq = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    assert names(remat.blocks(seq)) == ["0", "1", "2"]


def test_default_prefers_runs_that_cover_the_model() -> None:
    # ResNet-50's stages have 3/4/6/3 bottlenecks: the 4 stages, not the 5 look-alike blocks of layer3.
    assert names(remat.blocks(resnet(block="bottleneck", layers=(3, 4, 6, 3)))) == ["layer1", "layer2", "layer3", "layer4"]

    class TwoTowers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2), 4, enable_nested_tensor=False)
            self.decoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2), 4, enable_nested_tensor=False)

    # 4 layers covering half the model beat 2 towers covering all of it.
    assert names(remat.blocks(TwoTowers())) == [f"encoder.layers.{i}" for i in range(4)]


def test_default_needs_something_to_choose() -> None:
    with pytest.raises(BlockSelectionError, match="no repeated children"):
        remat.blocks(nn.Linear(2, 2))


def test_include_types_and_filter() -> None:
    model = gpt(vocab_size=16, d_model=8, n_heads=2, n_layers=2, seq_len=4)
    assert names(remat.blocks(model, include="blocks.*.attn")) == ["blocks.0.attn", "blocks.1.attn"]
    # Only the outermost matches become blocks.
    assert names(remat.blocks(model, include="blocks.*")) == ["blocks.0", "blocks.1"]
    assert names(remat.blocks(model, types=nn.LayerNorm)) == ["blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2", "ln_f"]
    assert names(remat.blocks(model, filter=lambda m, fqn: fqn.endswith("mlp"))) == ["blocks.0.mlp", "blocks.1.mlp"]
    # fnmatch's * also matches dots; the outermost matches win.
    assert names(remat.blocks(model, include="blocks.*", filter=lambda m, fqn: fqn.endswith("1"))) == ["blocks.0.ln1", "blocks.1"]
    with pytest.raises(BlockSelectionError, match=r"no module of GPT matches include=\['decoder\.\*'\]"):
        remat.blocks(model, include="decoder.*")


def fc_net() -> nn.Sequential:
    return nn.Sequential(
        *[nn.Linear(4, 4) if i % 2 == 0 else nn.ReLU() for i in range(6)]
    )


def test_named_blocks_group_consecutive_siblings() -> None:
    model = nn.Sequential()
    for name, mod in [("fc1", nn.Linear(4, 8)), ("act1", nn.ReLU()), ("fc2", nn.Linear(8, 8)), ("act2", nn.ReLU()), ("out", nn.Linear(8, 2))]:
        model.add_module(name, mod)
    found = remat.blocks(model, named=[["fc1", "act1", "fc2", "act2"], "out"])
    assert [b.fqns for b in found] == [("fc1", "act1", "fc2", "act2"), ("out",)]
    assert found[0].name == "fc1..act2"
    assert found[0].type_hint is LayerType.FFN


def test_named_block_errors_name_the_offender_and_the_gap() -> None:
    model = nn.Sequential()
    for name in ["fc1", "act1", "fc2", "act2"]:
        model.add_module(name, nn.Linear(4, 4))
    with pytest.raises(BlockSelectionError, match=r"'fc3', which is not a module of Sequential \(did you mean 'fc2', 'fc1'\?\)"):
        remat.blocks(model, named=[["fc1", "fc3"]])
    with pytest.raises(BlockSelectionError, match=r"'fc2' does not follow 'fc1' \(\['act1'\] lie between them\)"):
        remat.blocks(model, named=[["fc1", "fc2"]])
    with pytest.raises(BlockSelectionError, match=r"'fc1' comes before 'act1'"):
        remat.blocks(model, named=[["act1", "fc1"]])
    with pytest.raises(BlockSelectionError, match=r"named block #1 \('act1'\) overlaps named block #0"):
        remat.blocks(model, named=[["fc1", "act1"], ["act1", "fc2"]])
    with pytest.raises(BlockSelectionError, match="is empty"):
        remat.blocks(model, named=[[]])
    with pytest.raises(BlockSelectionError, match="cannot be combined"):
        remat.blocks(model, named=[["fc1"]], include="fc*")


def test_named_blocks_must_share_a_parent() -> None:
    model = gpt(vocab_size=16, d_model=8, n_heads=2, n_layers=2, seq_len=4)
    with pytest.raises(BlockSelectionError, match="different parents"):
        remat.blocks(model, named=[["blocks.0.attn", "blocks.1.ln1"]])
    with pytest.raises(BlockSelectionError, match="overlaps"):
        remat.blocks(model, named=[["blocks.0"], ["blocks.0.attn"]])


def test_type_hints() -> None:
    model = gpt(vocab_size=16, d_model=8, n_heads=2, n_layers=2, seq_len=4)
    layer = remat.blocks(model)[0]
    assert layer.type_hint is LayerType.OTHER  # a transformer layer mixes attention and FFN
    assert layer.attention_fqns == ("blocks.0.attn",)
    assert layer.ffn_fqns == ("blocks.0.mlp",)
    hints = {b.name: b.type_hint for b in remat.blocks(model, include=["blocks.0.*", "tok_emb"])}
    assert hints == {
        "tok_emb": LayerType.EMBEDDING,
        "blocks.0.ln1": LayerType.NORM,
        "blocks.0.attn": LayerType.ATTENTION,
        "blocks.0.ln2": LayerType.NORM,
        "blocks.0.mlp": LayerType.FFN,
    }
    # Two runs of 3 (encoder downs, decoder ups): the one covering more parameters wins.
    assert names(remat.blocks(unet())) == ["ups.0", "ups.1", "ups.2"]
    assert names(remat.blocks(gpt(vocab_size=16, d_model=8, n_heads=2, n_layers=2, seq_len=4))) == ["blocks.0", "blocks.1"]


def test_fingerprint_tracks_shapes() -> None:
    a = mlp_chain(widths=(4, 8, 4))
    b = mlp_chain(widths=(4, 8, 4))
    c = mlp_chain(widths=(4, 9, 4))
    assert fingerprint(a, remat.blocks(a)) == fingerprint(b, remat.blocks(b))
    assert fingerprint(a, remat.blocks(a)) != fingerprint(c, remat.blocks(c))
