"""Worker for tests/distributed: DDP or FSDP2 (gloo, 2 processes on 127.0.0.1), 2 steps with and without remat."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import remat
from remat.core.ops import Keep, Recompute
from remat.plan.types import Plan


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, d: int = 32, n: int = 6) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _apply(inner: nn.Module) -> None:
    blocks = remat.blocks(inner)
    # A multi-block, nested plan: segments of three and two blocks, one nested inside.
    ops = (
        Recompute(0, 3, (Recompute(0, 2, (Keep(0), Keep(1))), Keep(2))),
        Recompute(3, 5, (Keep(3), Keep(4))),
        Keep(5),
    )
    remat.apply(inner, Plan("multi-block", blocks, ops))


def run(kind: str, use_remat: bool, rank: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    # "fsdp-after-apply": remat.apply first, then fully_shard (its parameters then move under remat's feet).
    first = kind == "fsdp-after-apply"
    if use_remat and first:
        _apply(model)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        inner = model
        wrapped: nn.Module = DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        inner = wrapped = model
    if use_remat and not first:
        _apply(inner)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)
    for _ in range(2):
        x = torch.randn(16, 8)
        opt.zero_grad()
        wrapped(x).pow(2).mean().backward()
        opt.step()
    out = []
    for p in wrapped.parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out.append(t.clone())
    return out


def retime(rank: int) -> str:
    """Every rank profiles an FSDP2 model; rank 0 finds each of its checkpointed iterations disturbed (as a
    busy machine makes them look), so it retimes (NOTE [ Disturbed iterations ]). A rank that timed one more
    step alone ran all-gathers no other rank joined: gloo aborted the run (NCCL would hang)."""
    import importlib

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    profiler = importlib.import_module("remat.profile.profiler")
    if rank == 0:
        profiler._disturbed = lambda *args, **kwargs: True  # type: ignore[attr-defined]
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    prof = remat.profile(model, torch.randn(16, 8), lambda y: y.pow(2).mean(), repeats=2, ops=False, progress=False)
    try:
        remat.plan(prof, budget="60%")  # collective: it would meet the other rank's extra all-gathers
    except remat.BudgetInfeasibleError:
        pass
    return "profiled"


def main() -> int:
    kind, rank, world, port, out_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # No destroy_process_group at the end: with gloo it can wait for a peer that has already exited (a
    # hang seen under load); the caller's os._exit ends the process and its connections.
    if kind == "fsdp-retime":
        with open(out_path, "w") as f:
            f.write(retime(rank))
        return 0
    plain = run(kind, False, rank)
    ckpt = run(kind, True, rank)
    equal = len(plain) == len(ckpt) and all(torch.equal(a, b) for a, b in zip(plain, ckpt))
    with open(out_path, "w") as f:
        f.write("equal" if equal else "different")
    return 0


if __name__ == "__main__":
    # os._exit: torch's process-group threads can abort interpreter shutdown ("terminate called without
    # an active exception") after the work is done and its result written.
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
