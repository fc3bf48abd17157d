"""The built-in reference models: shapes, losses, gradients, seeding and error messages."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from remat.errors import RematError
from remat.models import (
    MLP,
    WORKLOADS,
    Block,
    Bottleneck,
    CausalSelfAttention,
    MLPBlock,
    Workload,
    gpt,
    mlp_chain,
    resnet,
    unet,
    workload,
)

# Small sizes per registered workload, and the output shape they give. Every registered name must
# appear here (test_every_workload_has_small_sizes), so a new workload cannot skip these tests.
SMALL: dict[str, tuple[dict[str, Any], tuple[int, ...]]] = {
    "gpt": (dict(n_layers=2, d_model=32, n_heads=2, seq_len=16, batch=2, vocab_size=64), (2, 16, 64)),
    "resnet": (dict(layers=(1, 1), width=4, image_size=16, batch=4), (4, 10)),
    "unet": (dict(features=(4, 8), image_size=16, batch=2), (2, 1, 16, 16)),
    "mlp": (dict(widths=(8, 32, 4, 16), batch=4), (4, 16)),
}


def _call(model: torch.nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def _input_tensors(inputs: Any) -> list[torch.Tensor]:
    if isinstance(inputs, dict):
        return list(inputs.values())
    if isinstance(inputs, tuple):
        return list(inputs)
    return [inputs]


def _small(name: str, **overrides: Any) -> Workload:
    sizes, _ = SMALL[name]
    return workload(name, **{**sizes, **overrides})


def test_every_workload_has_small_sizes() -> None:
    assert set(SMALL) == set(WORKLOADS)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_forward_shape_and_finite_scalar_loss(name: str) -> None:
    w = _small(name)
    assert w.name == name
    assert w.description
    assert w.model.training
    out = _call(w.model, w.inputs)
    assert tuple(out.shape) == SMALL[name][1]
    loss = w.loss_fn(out)
    assert loss.dim() == 0
    assert torch.isfinite(loss)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_backward_reaches_every_parameter(name: str) -> None:
    w = _small(name)
    assert all(not t.requires_grad for t in _input_tensors(w.inputs))
    w.loss_fn(_call(w.model, w.inputs)).backward()
    missing = [n for n, p in w.model.named_parameters() if p.grad is None]
    assert not missing, f"no grad on {missing}"
    nonfinite = [n for n, p in w.model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()]
    assert not nonfinite, f"non-finite grad on {nonfinite}"


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_same_seed_same_model_batch_and_targets(name: str) -> None:
    a, b = _small(name, seed=3), _small(name, seed=3)
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    for x, y in zip(_input_tensors(a.inputs), _input_tensors(b.inputs), strict=True):
        assert torch.equal(x, y)
    # The same output under both loss functions: their closed-over targets are the same too.
    a.model.eval()
    with torch.no_grad():
        out = _call(a.model, a.inputs)
    assert torch.equal(a.loss_fn(out), b.loss_fn(out))


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_different_seed_different_model_batch_and_targets(name: str) -> None:
    a, b = _small(name, seed=0), _small(name, seed=1)
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert any(not torch.equal(sa[key], sb[key]) for key in sa)
    assert any(not torch.equal(x, y) for x, y in zip(_input_tensors(a.inputs), _input_tensors(b.inputs), strict=True))
    a.model.eval()
    with torch.no_grad():
        out = _call(a.model, a.inputs)
    assert not torch.equal(a.loss_fn(out), b.loss_fn(out))


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_seed_leaves_global_rng_alone(name: str) -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    _small(name, seed=7)
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_dtype_reaches_parameters_and_float_inputs(name: str) -> None:
    w = _small(name, dtype=torch.float64)
    assert {p.dtype for p in w.model.parameters()} == {torch.float64}
    for x in _input_tensors(w.inputs):
        assert x.dtype in (torch.float64, torch.int64)
    assert w.loss_fn(_call(w.model, w.inputs)).dtype == torch.float64


def test_unknown_workload_lists_registered_names() -> None:
    names = ", ".join(sorted(WORKLOADS))
    with pytest.raises(RematError, match=rf"unknown workload 'transformer'; valid names are {re.escape(names)}"):
        workload("transformer")


def test_unknown_size_lists_valid_arguments() -> None:
    with pytest.raises(RematError, match=r"workload 'gpt' has no argument 'layers'; valid arguments are n_layers"):
        workload("gpt", layers=4)


def test_bad_resnet_block_lists_choices() -> None:
    with pytest.raises(RematError, match=r"unknown block 'wide'; valid blocks are basic, bottleneck"):
        resnet(block="wide")


def test_bad_activation_lists_choices() -> None:
    with pytest.raises(RematError, match=r"unknown activation 'swish'; valid activations are gelu, relu, tanh"):
        mlp_chain(activation="swish")


@pytest.mark.parametrize(
    ("build", "pattern"),
    [
        (
            lambda: gpt(vocab_size=16, d_model=30, n_heads=4, n_layers=1, seq_len=8),
            r"n_heads 4 does not divide d_model 30",
        ),
        (
            lambda: gpt(vocab_size=16, d_model=0, n_heads=1, n_layers=1, seq_len=8),
            r"d_model must be a positive int, got 0",
        ),
        (lambda: resnet(layers=()), r"layers must be a non-empty sequence"),
        (lambda: resnet(layers=(2, 0)), r"layers\[1\] must be a positive int, got 0"),
        (lambda: unet(features=(8, -1)), r"features\[1\] must be a positive int, got -1"),
        (lambda: mlp_chain(widths=(8,)), r"widths must be a sequence of at least two widths"),
        (lambda: workload("unet", features=(4, 8, 16), image_size=4), r"image_size 4 is below 8"),
        (lambda: workload("mlp", dtype=torch.int64), r"dtype must be a floating-point torch.dtype, got torch.int64"),
        (lambda: workload("resnet", seed=1.5), r"seed must be an int, got 1.5"),
    ],
)
def test_bad_sizes_raise(build: Any, pattern: str) -> None:
    with pytest.raises(RematError, match=pattern):
        build()


def test_gpt_structure_and_causality() -> None:
    w = _small("gpt", dropout=0.0)
    model = w.model
    # remat finds blocks and their sub-modules by these names.
    modules = dict(model.named_modules())
    expected = {
        "tok_emb": torch.nn.Embedding,
        "pos_emb": torch.nn.Embedding,
        "drop": torch.nn.Dropout,
        "blocks": torch.nn.ModuleList,
        "blocks.1": Block,
        "blocks.1.ln1": torch.nn.LayerNorm,
        "blocks.1.attn": CausalSelfAttention,
        "blocks.1.attn.qkv": torch.nn.Linear,
        "blocks.1.attn.proj": torch.nn.Linear,
        "blocks.1.ln2": torch.nn.LayerNorm,
        "blocks.1.mlp": MLP,
        "blocks.1.mlp.fc": torch.nn.Linear,
        "blocks.1.mlp.proj": torch.nn.Linear,
        "ln_f": torch.nn.LayerNorm,
        "head": torch.nn.Linear,
    }
    for fqn, cls in expected.items():
        assert isinstance(modules.get(fqn), cls), fqn
    model.eval()
    idx = w.inputs.clone()
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 64
    with torch.no_grad():
        a, b = model(idx), model(changed)
    # Changing the last token must not change any earlier position's logits, and must change its own.
    assert torch.equal(a[:, :-1], b[:, :-1])
    assert not torch.equal(a[:, -1], b[:, -1])


def test_gpt_rejects_sequence_longer_than_seq_len() -> None:
    w = _small("gpt")
    with pytest.raises(RematError, match=r"input has 17 tokens but the model was built for seq_len 16"):
        w.model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("layers", [(1,), (1, 2, 1)])
def test_resnet_has_one_stage_per_layers_entry(layers: tuple[int, ...]) -> None:
    model = resnet(layers=layers, width=4)
    for i, n_blocks in enumerate(layers):
        assert len(getattr(model, f"layer{i + 1}")) == n_blocks
    assert not hasattr(model, f"layer{len(layers) + 1}")
    assert tuple(model(torch.randn(2, 3, 8, 8)).shape) == (2, 10)


def test_resnet_bottleneck_expands_channels() -> None:
    model = resnet(block="bottleneck", layers=(1, 1), width=4)
    assert isinstance(model.get_submodule("layer2.0"), Bottleneck)
    assert model.fc.in_features == 4 * 8
    assert tuple(model(torch.randn(2, 3, 8, 8)).shape) == (2, 10)


def test_unet_handles_sizes_that_do_not_halve_evenly() -> None:
    model = unet(features=(4, 8))
    assert tuple(model(torch.randn(1, 3, 15, 18)).shape) == (1, 1, 15, 18)


def test_mlp_chain_blocks_follow_widths() -> None:
    model = mlp_chain(widths=(8, 32, 4), dropout=0.5)
    modules = dict(model.named_modules())
    assert all(isinstance(modules[str(i)], MLPBlock) for i in range(2))
    assert [(m.in_features, m.out_features) for m in (modules["0.fc"], modules["1.fc"])] == [(8, 32), (32, 4)]
    assert isinstance(modules["0.drop"], torch.nn.Dropout)
