"""``remat profile/plan/measure --out`` are checked before measuring, as ``bench --json`` is (helper-110).

Before, ``remat profile gpt --out /no/such/folder/p.json`` profiled for the better part of a minute and
then failed to write; ``--out /tmp`` (a directory) said "check that its folder exists".
"""

from __future__ import annotations

from pathlib import Path

import pytest

from remat.cli.common import write_file
from remat.cli.main import main
from remat.errors import RematError


@pytest.fixture
def nothing_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every subcommand's profile and measurement raise if called: the mistake must be caught first."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured before checking the arguments")

    for module in ("bench", "plan", "profile", "report"):
        monkeypatch.setattr(f"remat.cli.{module}.run_profile", forbidden)
    monkeypatch.setattr("remat.cli.measure.run_measure", forbidden)
    monkeypatch.setattr("remat.cli.bench.compare", forbidden)


CASES = [
    (
        ["profile", "gpt", "--out", "{tmp}/no/such/p.json"],
        "error: --out '{tmp}/no/such/p.json': its folder does not exist",
    ),
    (["profile", "gpt", "--out", "{tmp}"], "error: --out '{tmp}': this is a directory; give a file name"),
    (
        ["plan", "gpt", "--budget", "40%", "--out", "{tmp}"],
        "error: --out '{tmp}': this is a directory; give a file name",
    ),
    (
        ["plan", "gpt", "--budget", "40%", "--out", "{tmp}/no/plan.json"],
        "error: --out '{tmp}/no/plan.json': its folder does not exist",
    ),
    (["measure", "gpt", "--out", "{tmp}/no/m.json"], "error: --out '{tmp}/no/m.json': its folder does not exist"),
    (["measure", "gpt", "--out", "{tmp}"], "error: --out '{tmp}': this is a directory; give a file name"),
    (["bench", "gpt", "--json", "{tmp}"], "error: --json '{tmp}': this is a directory; give a file name"),
]


@pytest.mark.usefixtures("nothing_measured")
@pytest.mark.parametrize(("argv", "message"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_an_output_path_that_cannot_be_written_fails_before_measuring(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([a.format(tmp=tmp_path) for a in argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith(message.format(tmp=tmp_path)), err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_writing_onto_a_directory_says_so(tmp_path: Path) -> None:
    with pytest.raises(RematError, match=r"cannot write '.*': this is a directory; give a file name"):
        write_file(tmp_path, "{}")
