"""The documentation's examples run as they are: README's tour, docs/training.md, docs/distributed.md.

docs/huggingface.md's examples run in tests/integrations/test_hf_integration.py. README's second
example is a summary of docs/training.md's, which run here in full.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _examples(name: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / name).read_text(), flags=re.S)


def _exec(code: str, where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # In this process (a fresh interpreter spends seconds importing torch), in a namespace of its own
    # and a scratch directory, as a user's script would run.
    monkeypatch.chdir(tmp_path)
    exec(compile(code, where, "exec"), {"__name__": "__main__"})


def test_the_readme_tour_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tour = _examples("README.md")[0]
    assert "remat.apply(model, plan)" in tour and "remat.remove(model)" in tour
    _exec(tour, "README.md, example 0", tmp_path, monkeypatch)


@pytest.mark.parametrize("index", range(len(_examples("docs/training.md"))))
def test_a_training_example_runs(index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _exec(_examples("docs/training.md")[index], f"docs/training.md, example {index}", tmp_path, monkeypatch)


@pytest.mark.parametrize("index", range(len(_examples("docs/distributed.md"))))
def test_a_distributed_example_runs_under_torchrun(index: int, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_examples("docs/distributed.md")[index])
    # As the page says: torchrun, 2 processes, gloo; --standalone picks a free port on this machine.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    done = subprocess.run(
        command,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ranks" in done.stdout or "predicted peak" in done.stdout, done.stdout[-3000:]
