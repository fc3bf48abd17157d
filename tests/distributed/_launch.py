"""Launching the 2-process workers of these tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    worker: Path, args: Callable[[int], Sequence[str]], logs_dir: Path, *, ranks: int = 2, timeout_s: float = 300
) -> tuple[list[int | None], list[str]]:
    """Run ``worker`` once per rank (``args(rank)`` after the script) and wait for all of them.

    Each rank's output goes to a file, not a pipe: a rank blocked on a full pipe would stall the
    collective its peer waits in, and the test would hang until the timeout. Ranks still running at
    the deadline are killed.

    Returns:
        The return codes (``None`` for a killed rank) and each rank's output.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    paths = [logs_dir / f"rank{rank}.log" for rank in range(ranks)]
    files = [p.open("w") for p in paths]
    procs = [
        subprocess.Popen([sys.executable, str(worker), *args(rank)], env=env, stdout=f, stderr=subprocess.STDOUT)
        for rank, f in enumerate(files)
    ]
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in files:
            f.close()
    return [p.returncode if p.returncode is not None and p.returncode >= 0 else None for p in procs], [
        p.read_text() for p in paths
    ]
