"""DDP and FSDP2 (gloo, 2 processes on 127.0.0.1): a multi-block nested plan trains like the plain model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("_fsdp_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_multi_block_plan_trains_two_steps_like_the_plain_model(kind: str, tmp_path: Path) -> None:
    port = str(_free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), kind, str(rank), "2", port, str(tmp_path / f"r{rank}")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    # Each rank compares every parameter after 2 optimizer steps, with and without remat (torch.equal).
    assert [(tmp_path / f"r{rank}").read_text() for rank in range(2)] == ["equal", "equal"], logs
