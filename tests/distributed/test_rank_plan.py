"""One plan for every rank (NOTE [ One plan for every rank ]) and plans made on unwrapped models.

The 2-process tests (gloo, 127.0.0.1) run ``_plan_worker.py``: each rank profiles its own batch, plans
at 50% through ``remat.plan``, and trains DDP or FSDP2 3 steps with the plan; both ranks must hold the
same plan, made from the merged profiles, and every step's gradients must be ``torch.equal`` to those
of the run without remat. The others need no process group.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.core.wrapped import active, unwrap
from remat.errors import PlanMismatchError
from remat.models import Workload
from remat.plan.ranks import merge_profiles, one_plan
from remat.profile import Profile
from tests.distributed._launch import free_port, run_ranks

from ..conftest import TinyNet

WORKER = Path(__file__).with_name("_plan_worker.py")


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_every_rank_trains_with_one_plan_and_plain_gradients(kind: str, tmp_path: Path) -> None:
    port = str(free_port())
    codes, logs = run_ranks(WORKER, lambda rank: (kind, str(rank), "2", port, str(tmp_path)), tmp_path)
    assert codes == [0, 0], logs
    results = [json.loads((tmp_path / f"{kind}-r{rank}.json").read_text()) for rank in range(2)]
    for rank, r in enumerate(results):
        # The identical plan on both ranks, made from the merged profiles (the slower rank's step time).
        assert r["plans"][0] == r["plans"][1], (rank, r["plans"])
        assert r["baseline_step_ms"] == max(r["step_ms"]), (rank, r)
        assert r["applied"] is not None and r["checkpointed"], r  # something is recomputed (whole, sub or ops)
        assert r["unwrapped_fits"] and r["mismatch_refused"], r
        assert r["grads_equal"] == [True, True, True] and r["params_equal"], r
    assert results[0]["plans"] == results[1]["plans"] and results[0]["applied"] == results[1]["applied"]


@pytest.fixture(scope="module")
def tiny_profile() -> tuple[Workload, Profile]:
    torch.manual_seed(0)
    x, target = torch.randn(256, 8), torch.randn(256, 4)  # activations well above a checkpoint's fixed cost
    w = Workload("tiny", TinyNet(), x, lambda out: F.mse_loss(out, target), "TinyNet")
    return w, remat.profile(w.model, w.inputs, w.loss_fn, repeats=1)


def test_merged_profile_takes_every_ranks_worst_figures(tiny_profile: tuple[Workload, Profile]) -> None:
    _, prof = tiny_profile
    bps = list(prof.block_profiles)
    bps[1] = dataclasses.replace(bps[1], keep_bytes=bps[1].keep_bytes + 4096, fwd_ms=bps[1].fwd_ms + 5.0, linked=False)
    other = dataclasses.replace(
        prof, block_profiles=tuple(bps), step_ms=prof.step_ms * 2, peak_bytes=prof.peak_bytes - 1
    )
    merged = merge_profiles([prof, other])
    assert merged.blocks == prof.blocks and merged.fingerprint == prof.fingerprint
    assert merged.step_ms == prof.step_ms * 2 and merged.peak_bytes == prof.peak_bytes
    assert merged.block_profiles[1].keep_bytes == prof.block_profiles[1].keep_bytes + 4096
    assert merged.block_profiles[1].fwd_ms == prof.block_profiles[1].fwd_ms + 5.0
    assert merged.block_profiles[1].linked is False and merged.block_profiles[0].linked is True
    assert merged.block_profiles[2] == prof.block_profiles[2]
    assert merge_profiles([prof]) == prof


def test_ranks_with_different_models_are_refused(tiny_profile: tuple[Workload, Profile]) -> None:
    _, prof = tiny_profile
    other = dataclasses.replace(prof, fingerprint="0" * 16 + ".00000000")
    with pytest.raises(
        PlanMismatchError, match=r"plan: rank 1 profiled 5 blocks with fingerprint 0+\.0+, rank 0 5 with"
    ):
        merge_profiles([prof, other])


def test_without_a_process_group_plan_is_local(tiny_profile: tuple[Workload, Profile]) -> None:
    _, prof = tiny_profile
    assert not active()
    assert one_plan(prof, lambda p: remat.plan(p, "60%")) == remat.plan(prof, "60%")


def test_plan_for_the_unwrapped_model_applies_to_its_wrapper(tiny_profile: tuple[Workload, Profile]) -> None:
    w, prof = tiny_profile
    plan = remat.plan(prof, "60%")
    wrapper = nn.DataParallel(w.model)  # on CPU it calls the module; block names gain "module." like DDP's
    assert unwrap(wrapper) is w.model
    assert remat.apply(wrapper, plan) == plan
    assert remat.applied(wrapper) == plan and remat.applied(w.model) == plan
    calls = sum(layer.calls for layer in w.model.layers)  # type: ignore[union-attr]
    w.loss_fn(wrapper(w.inputs)).backward()
    assert plan.checkpointed and sum(layer.calls for layer in w.model.layers) > calls + 5  # type: ignore[union-attr]
    assert remat.remove(wrapper) == plan and remat.applied(w.model) is None
