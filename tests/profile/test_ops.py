"""remat.profile.ops: the per-op profile of a block names its ops, counts what autograd saves, and is stable."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import remat
from remat.errors import RematError
from remat.profile.ops import BlockOps, profile_ops

BATCH, D_IN, D = 4, 16, 32


def small_net(seed: int = 0) -> nn.Sequential:
    """Two blocks of Linear -> GELU -> LayerNorm -> Dropout."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Sequential(nn.Linear(D_IN, D), nn.GELU(), nn.LayerNorm(D), nn.Dropout(0.5)),
        nn.Sequential(nn.Linear(D, D_IN), nn.GELU(), nn.LayerNorm(D_IN), nn.Dropout(0.5)),
    )


def profiled(seed: int = 0) -> tuple[nn.Sequential, torch.Tensor, tuple[BlockOps, ...]]:
    model = small_net(seed)
    x = torch.randn(BATCH, D_IN)
    return model, x, profile_ops(model, x, lambda out: out.sum(), remat.blocks(model))


def test_the_records_name_the_ops_in_forward_order() -> None:
    _, _, (first, _) = profiled()
    # Linear on a 2-D input is t + addmm; dropout on CPU is empty_like, bernoulli_, div_, mul.
    assert [op.key for op in first.ops] == [
        "t#0",
        "addmm#0",
        "gelu#0",
        "native_layer_norm#0",
        "empty_like#0",
        "bernoulli_#0",
        "div_#0",
        "mul#0",
    ]
    by_key = {op.key: op for op in first.ops}
    assert by_key["t#0"].view and by_key["t#0"].storages == (-1,)  # a view of the weight
    assert by_key["bernoulli_#0"].random and not by_key["bernoulli_#0"].view
    assert [op.key for op in first.ops if op.random] == ["bernoulli_#0"]
    # In-place ops allocate nothing: their output is empty_like's storage, which they write.
    noise = by_key["empty_like#0"].index
    assert by_key["bernoulli_#0"].storages == by_key["div_#0"].storages == (noise,)
    assert by_key["div_#0"].writes == (noise,) and by_key["div_#0"].out_bytes == 0
    assert by_key["gelu#0"].reads == (by_key["addmm#0"].index,)
    assert by_key["mul#0"].reads == (by_key["native_layer_norm#0"].index, by_key["div_#0"].index)
    assert all(op.ms > 0 for op in first.ops)


def test_saved_bytes_are_what_saved_tensor_hooks_see() -> None:
    model, x, blocks_ops = profiled()
    # The oracle: run each block plain under saved-tensor hooks, count unique storages, parameters apart.
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    h = x
    for block, ops in zip(model, blocks_ops):
        seen: dict[int, int] = {}
        inputs = {h.untyped_storage().data_ptr()}

        def pack(t: torch.Tensor, seen: dict[int, int] = seen) -> torch.Tensor:
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                seen[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = block(h)
        assert ops.saved_bytes == sum(seen.values())
        assert ops.input_saved_bytes == sum(n for p, n in seen.items() if p in inputs)
        h = out
    # By hand for block 0 (float32): addmm saves its input x (4x16) and its output is saved by gelu
    # (4x32); gelu's output is saved by layer_norm; layer_norm saves mean and rstd (4x1 each); the
    # dropout's mul saves the mask (4x32), which empty_like allocated.
    saved = {op.key: op.saved_bytes for op in blocks_ops[0].ops}
    f = 4
    assert saved["addmm#0"] == saved["gelu#0"] == saved["empty_like#0"] == BATCH * D * f
    assert saved["native_layer_norm#0"] == 2 * BATCH * f
    assert saved["mul#0"] == 0  # the block's output: nothing of this block saves it
    assert [blocks_ops[0].ops[i].key for i in blocks_ops[0].outputs] == ["mul#0"]
    assert blocks_ops[0].input_saved_bytes == BATCH * D_IN * f
    # The last tensor saved is the mask, before the mul that saves it runs: the recompute stops there.
    assert blocks_ops[0].stop == len(blocks_ops[0].ops) - 1


def test_keys_and_bytes_are_stable_across_runs_and_the_model_is_left_as_it_was() -> None:
    model, x, first = profiled()
    rng = torch.get_rng_state()
    again = profile_ops(model, x, lambda out: out.sum(), remat.blocks(model), rounds=2)
    assert torch.equal(torch.get_rng_state(), rng)
    assert [[op.key for op in b.ops] for b in again] == [[op.key for op in b.ops] for b in first]
    assert [(b.saved_bytes, b.input_saved_bytes, b.stop) for b in again] == [
        (b.saved_bytes, b.input_saved_bytes, b.stop) for b in first
    ]
    assert [[(op.out_bytes, op.saved_bytes, op.reads, op.storages) for op in b.ops] for b in again] == [
        [(op.out_bytes, op.saved_bytes, op.reads, op.storages) for op in b.ops] for b in first
    ]
    assert all(p.grad is None for p in model.parameters())


def test_json_round_trip() -> None:
    _, _, blocks_ops = profiled()
    for b in blocks_ops:
        back = BlockOps.from_json(json.loads(json.dumps(b.to_json())))
        assert back == b and back.index_of("gelu#0") == b.index_of("gelu#0") == 2


class Flaky(nn.Module):
    """A block whose forward runs other ops every other call (data-dependent control flow)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.relu(self.fc(x)) if self.calls % 2 else torch.sigmoid(self.fc(x))


def test_a_block_that_runs_other_ops_each_time_is_refused() -> None:
    model = nn.Sequential(Flaky(), Flaky())
    with pytest.raises(
        RematError, match=r"ran different ops in forward 1 and forward 2 \(op 2: relu#0 then sigmoid#0\)"
    ):
        profile_ops(model, torch.randn(2, 4), lambda out: out.sum(), remat.blocks(model), rounds=2)


def test_bad_arguments_are_refused() -> None:
    model = small_net()
    x = torch.randn(BATCH, D_IN)
    with pytest.raises(RematError, match="rounds=0 must be >= 1"):
        profile_ops(model, x, lambda out: out.sum(), remat.blocks(model), rounds=0)
    with pytest.raises(RematError, match="loss_fn returned a tensor of shape"):
        profile_ops(model, x, lambda out: out, remat.blocks(model))
