"""A DistributedDataParallel with static_graph=True is not profiled through: the profile's backwards run
outside DDP's forward and its reducer counted them as steps (2 ranks drifted apart silently, helper-47)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import remat
from tests.distributed._launch import free_port


def test_profiling_through_a_static_graph_ddp_is_a_remat_error() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)))
        x = torch.randn(4, 8)
        with pytest.raises(remat.RematError, match=r"static_graph=True.*profile the model before wrapping it"):
            remat.profile(DistributedDataParallel(model, static_graph=True), x, lambda y: y.sum(), progress=False)
        # Without static_graph the wrapper's module is profiled (NOTE [ Wrapped models ]).
        prof = remat.profile(DistributedDataParallel(model), x, lambda y: y.sum(), repeats=1, progress=False)
        assert len(prof.blocks) == 3
    finally:
        dist.destroy_process_group()
