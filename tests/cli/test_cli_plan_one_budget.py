"""``remat plan`` is for one budget, as ``remat report`` is: a second ``--budget`` is refused before
anything is measured. Before, argparse kept the last one and planned it silently (``--budget 40%
--budget 60%`` made a plan for 60%)."""

from __future__ import annotations

import pytest

from remat.cli.main import main


@pytest.fixture
def nothing_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan subcommand's profile raises if called: the mistake must be caught first."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured before checking the arguments")

    monkeypatch.setattr("remat.cli.plan.run_profile", forbidden)


@pytest.mark.usefixtures("nothing_measured")
def test_two_budgets_to_plan_are_refused_before_measuring(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--budget", "40%", "--budget", "60%"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "error: --budget given 2 times ('40%', '60%'); a plan is for one budget: give one --budget, or compare "
        "several with remat bench --budget A --budget B"
    ), err
    assert "Traceback" not in err


@pytest.mark.usefixtures("nothing_measured")
def test_each_budget_is_checked_before_the_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--budget", "150%", "--budget", "40%"]) == 1
    assert capsys.readouterr().err.startswith("error: budget: share '150%' is outside (0%, 100%]")
