"""``X.from_json`` given a file name, a ``Path`` or a dict says to read the file first (helper-110).

Before: ``Plan.from_json("plan.json")`` said "not valid JSON (Expecting value at line 1)", and
``Plan.from_json(Path("plan.json"))`` or ``Profile.from_json({...})`` raised json's raw TypeError.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

import remat
from remat.measure import Measurement
from remat.plan import Frontier, Plan
from remat.profile import Profile


@pytest.fixture
def plan_file(tmp_path: Path) -> Path:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
    path = tmp_path / "plan.json"
    path.write_text(remat.plan(model, strategy=remat.full()).to_json())
    return path


@pytest.mark.parametrize("cls", [Plan, Profile, Measurement, Frontier])
def test_a_file_name_or_path_is_refused_with_the_fix(cls: type, plan_file: Path) -> None:
    for given in (str(plan_file), plan_file):
        with pytest.raises(
            remat.RematError, match=r"json: got the file name '.*plan\.json', not the file's text; read it"
        ):
            cls.from_json(given)


@pytest.mark.parametrize("cls", [Plan, Profile])
def test_a_parsed_object_is_refused_with_the_fix(cls: type) -> None:
    with pytest.raises(remat.RematError, match=r"json: got dict, not the file's text; .*json\.dumps"):
        cls.from_json({"schema_version": 1})


def test_the_files_text_still_reads(plan_file: Path) -> None:
    plan = Plan.from_json(plan_file.read_text())
    assert plan.describe().startswith("R[0:1](K0)")
    assert len(plan.blocks) == 3
