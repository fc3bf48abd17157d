"""Progress bars of long library calls: on a terminal (or when asked), silent otherwise."""

from __future__ import annotations

import pytest

import remat
from remat.models import Workload


def test_profile_and_measure_show_progress_only_when_asked(tiny: Workload, capsys: pytest.CaptureFixture[str]) -> None:
    remat.profile(tiny.model, tiny.inputs, tiny.loss_fn, repeats=1)
    remat.measure(tiny.model, tiny.inputs, tiny.loss_fn, steps=1)
    assert capsys.readouterr().err == ""  # captured standard error is not a terminal: quiet by default
    remat.profile(tiny.model, tiny.inputs, tiny.loss_fn, repeats=1, progress=False)
    assert capsys.readouterr().err == ""
    # Forced on (a notebook, a log): the bar runs and the profile is the same kind of result.
    prof = remat.profile(tiny.model, tiny.inputs, tiny.loss_fn, repeats=1, progress=True)
    assert len(prof.blocks) == 5
