"""``-v`` shows the traceback of a failure in the user's own code also where remat words it as a RematError
(helper-110's first hour): "model: loading './m.py' raised SyntaxError ...; fix that file (-v for the
traceback)" printed the same one line with ``-v`` before, as did a factory that raises and a batch of
another dtype than the model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from remat.cli.main import main
from remat.errors import RematError

FACTORY = """
import torch
from torch import nn

def broken():
    raise ValueError("my factory is broken")

def double_batch():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
    return model, torch.randn(4, 8, dtype=torch.float64), lambda out: out.square().mean()
"""


@pytest.fixture
def files(tmp_path: Path) -> Path:
    (tmp_path / "facs.py").write_text(FACTORY)
    (tmp_path / "bad.py").write_text("def make(:\n    pass\n")
    return tmp_path


@pytest.mark.parametrize(
    ("spec", "cause", "line"),
    [
        ("{d}/bad.py:make", SyntaxError, "error: model: loading '{d}/bad.py' raised SyntaxError"),
        (
            "{d}/facs.py:broken",
            ValueError,
            "error: model: {d}/facs.py:broken() raised ValueError: my factory is broken",
        ),
        ("{d}/facs.py:double_batch", RuntimeError, "error: profile: the model's forward failed on the batch"),
    ],
)
def test_verbose_shows_the_cause_and_plain_prints_one_line(
    spec: str, cause: type, line: str, files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = spec.format(d=files)
    assert main(["profile", spec, "--repeats", "1", "--out", str(files / "p.json")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(line.format(d=files)) and err.count("\n") == 1, err
    with pytest.raises(RematError) as raised:
        main(["profile", spec, "--repeats", "1", "--out", str(files / "p.json"), "-v"])
    assert isinstance(raised.value.__cause__, cause)


def test_a_mistake_of_the_command_line_stays_one_line_with_verbose(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--budget", "150%", "-v"]) == 1
    assert capsys.readouterr().err.startswith("error: budget: share '150%' is outside (0%, 100%]")
