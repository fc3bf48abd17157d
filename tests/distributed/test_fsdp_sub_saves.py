"""A sub-module's saved FSDP2 weights are not what checkpointing it frees.

NOTE [ Saves the plain step frees before the backward ] in ``remat/profile/profiler.py``: under
``fully_shard`` a Linear saves its all-gathered weight, which the layer's reshard after its forward frees
whatever autograd holds. The profile counted it in the sub-module's ``saved_bytes``: an MoE layer's experts
checkpointed on one FSDP2 rank measured 1.06x their prediction, the smallest plan 1.075-1.087x its budget.
Here (one rank, gloo, in this process) 1.048x before, exact with the fix. Gradients were always bitwise.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import remat
from remat.plan import Keep, RecomputeSub
from remat.plan.planner import plan_from_ops

from ._launch import free_port

D = 32


class _MoE(nn.Module):
    """Top-2 routing over four experts, tokens gathered and scattered back with ``index_add_``."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, 4, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, D)
        weights, chosen = self.router(tokens).softmax(-1).topk(2, -1)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, token, expert(tokens[token]) * weights[token, slot, None])
        return out.reshape(x.shape)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 4, batch_first=True)
        self.norm2 = nn.LayerNorm(D)
        self.moe = _MoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.moe(self.norm2(x))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, D)
        self.layers = nn.ModuleList(_Layer() for _ in range(4))
        self.head = nn.Linear(D, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


_TARGETS = torch.arange(4 * 32).remainder(64).reshape(4, 32)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), _TARGETS.flatten())


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sharded() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _Model()
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@pytest.mark.usefixtures("one_rank")
def test_fsdp2_sub_module_checkpoint_prediction_matches() -> None:
    model, x = _sharded(), torch.randint(64, (4, 32), generator=torch.Generator().manual_seed(1))
    prof = remat.profile(model, x, _loss, repeats=1, ops=False)
    for layer in (0, 1):
        ops = tuple(RecomputeSub(i, (f"layers.{i}.moe",)) if i == layer else Keep(i) for i in range(4))
        plan = plan_from_ops(prof, ops, "by hand")
        remat.apply(model, plan)
        measured = remat.measure(model, x, _loss, steps=1).peak_bytes
        remat.remove(model)
        assert plan.predicted_peak_bytes is not None
        # Exact with the weights left out (1.000); 1.048x with them credited as freed.
        assert 0.97 <= measured / plan.predicted_peak_bytes <= 1.03, (
            plan.describe(),
            measured,
            plan.predicted_peak_bytes,
        )
