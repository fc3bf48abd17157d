"""Worker for tests/distributed/test_rank_plan.py: one plan for every rank under DDP or FSDP2 (gloo, 2 processes).

Each rank trains 3 steps without remat, then profiles on its own batch (so its timings differ from the
other rank's), plans at 50% through ``remat.plan`` (a collective under the process group), writes and
reads the plan back as a file, applies it to the wrapped model and trains the same 3 steps. It writes
what it saw as JSON: every rank's plan, every rank's plain step time, and whether each step's
gradients and the final parameters are ``torch.equal`` to the plain run's.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from _fsdp_worker import Net  # this script's folder is on sys.path
from torch import nn

import remat
from remat.errors import PlanMismatchError
from remat.plan import Plan

STEPS = 3


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()


def _wrap(kind: str, model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(the module to train, the module to profile): DDP's ``.module`` (NOTE [ Wrapped models ])."""
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        return ddp, ddp.module
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, model


def _train(model: nn.Module, batches: list[torch.Tensor]) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    torch.manual_seed(100 + dist.get_rank())  # dropout
    for x in batches:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        grads.append([_full(p.grad) for p in model.parameters() if p.grad is not None])
        opt.step()
    return grads, [_full(p) for p in model.parameters()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def main() -> int:
    kind, rank, world, port, out_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], Path(sys.argv[5])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    # A rank that fails makes the other's next collective time out instead of waiting for 30 minutes.
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=180))
    # No destroy_process_group at the end: with gloo it can wait for a peer that has already exited (a
    # hang seen under load); the caller's os._exit ends the process and its connections.
    torch.manual_seed(0)
    raw = Net(d=32, n=6)
    torch.manual_seed(1 + rank)  # each rank its own batches
    batches = [torch.randn(256, 8) for _ in range(STEPS)]
    plain_grads, plain_params = _train(_wrap(kind, copy.deepcopy(raw))[0], batches)

    trained, profiled = _wrap(kind, copy.deepcopy(raw))
    prof = remat.profile(profiled, batches[0], lambda out: out.pow(2).mean(), repeats=2)
    plan = remat.plan(prof, "50%")
    # A plan file written on rank 0 and read on every rank; apply checks it against the model there.
    path = out_dir / f"plan-{kind}.json"
    if rank == 0:
        path.write_text(plan.to_json())
    dist.barrier()
    loaded = Plan.from_json(path.read_text())
    remat.apply(trained, loaded)
    # A plan made on the unwrapped (unsharded) model fits the wrapper, and a wrong one is refused.
    unwrapped_fits = remat.applied(trained) == loaded
    if kind == "fsdp":
        raw_plan = remat.plan(
            remat.profile(copy.deepcopy(raw), batches[0], lambda out: out.pow(2).mean(), repeats=1), "50%"
        )
        remat.apply(trained, raw_plan)
        unwrapped_fits = unwrapped_fits and remat.applied(trained) == raw_plan
        remat.apply(trained, loaded)
    try:
        remat.apply(Net(d=32, n=4), loaded)
        refused = False
    except PlanMismatchError:
        refused = True
    grads, params = _train(trained, batches)

    plans: list[str | None] = [None] * world
    dist.all_gather_object(plans, plan.to_json())
    step_ms: list[float | None] = [None] * world
    dist.all_gather_object(step_ms, prof.step_ms)
    result = {
        "plans": plans,
        "step_ms": step_ms,
        "baseline_step_ms": plan.baseline_step_ms,
        "applied": applied.describe() if (applied := remat.applied(trained)) else None,
        "checkpointed": list(applied.checkpointed) if applied else [],
        "unwrapped_fits": unwrapped_fits,
        "mismatch_refused": refused,
        "grads_equal": [_equal(a, b) for a, b in zip(plain_grads, grads)],
        "params_equal": _equal(plain_params, params),
    }
    (out_dir / f"{kind}-r{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    # os._exit: torch's process-group threads can abort interpreter shutdown ("terminate called without
    # an active exception") after the work is done and its result written.
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
