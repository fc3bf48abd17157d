"""DDP and FSDP2 (gloo, 2 processes on 127.0.0.1): a multi-block nested plan trains like the plain model."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed._launch import free_port, run_ranks

WORKER = Path(__file__).with_name("_fsdp_worker.py")


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "fsdp-after-apply"])
def test_multi_block_plan_trains_two_steps_like_the_plain_model(kind: str, tmp_path: Path) -> None:
    port = str(free_port())
    codes, logs = run_ranks(WORKER, lambda rank: (kind, str(rank), "2", port, str(tmp_path / f"r{rank}")), tmp_path)
    assert codes == [0, 0], logs
    # Each rank compares every parameter after 2 optimizer steps, with and without remat (torch.equal).
    assert [(tmp_path / f"r{rank}").read_text() for rank in range(2)] == ["equal", "equal"], logs


def test_ranks_retime_together_under_fsdp2(tmp_path: Path) -> None:
    # Rank 0's timings look disturbed, rank 1's do not: both must run the same number of profiled steps.
    port = str(free_port())
    codes, logs = run_ranks(
        WORKER, lambda rank: ("fsdp-retime", str(rank), "2", port, str(tmp_path / f"r{rank}")), tmp_path, timeout_s=120
    )
    assert codes == [0, 0], logs
    assert [(tmp_path / f"r{rank}").read_text() for rank in range(2)] == ["profiled", "profiled"], logs
