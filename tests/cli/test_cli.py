"""The ``remat`` command line: each subcommand end to end on tiny models, and its error path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from remat.cli.main import main
from remat.measure import Measurement
from remat.plan.types import Plan
from remat.profile import Profile

# batch 64: activations dominate the per-checkpoint RNG state (about 5 KiB on CPU).
MLP = ["mlp", "--set", "widths=(8, 32, 8, 48, 8, 24)", "--set", "batch=256"]


def test_bench_writes_every_strategy_with_equal_gradients(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", *MLP, "--budget", "80%", "--rounds", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    labels = [row["label"] for row in data["rows"]]
    assert labels[0] == "none" and "full" in labels and "optimal @ 80%" in labels
    assert all(row["grads_equal"] for row in data["rows"])
    full = next(row for row in data["rows"] if row["label"] == "full")
    assert full["peak_bytes"] > 0 and full["step_ms"] > 0  # memory savings are tested at sizes where they exist
    assert set(full["forward_counts"].values()) == {2}
    printed = capsys.readouterr().out
    assert "memory saved" in printed and "optimal @ 80%" in printed


def test_profile_and_plan_write_json_that_reads_back(tmp_path: Path) -> None:
    prof_path, plan_path = tmp_path / "profile.json", tmp_path / "plan.json"
    assert main(["profile", *MLP, "--repeats", "1", "--out", str(prof_path)]) == 0
    prof = Profile.from_json(prof_path.read_text())
    assert len(prof.blocks) == 5
    assert main(["plan", *MLP, "--budget", "85%", "--profile", str(prof_path), "--out", str(plan_path)]) == 0
    plan = Plan.from_json(plan_path.read_text())
    assert plan.fingerprint == prof.fingerprint
    assert plan.predicted_peak_bytes is not None and plan.predicted_peak_bytes <= 0.85 * prof.peak_bytes
    measured_path = tmp_path / "measure.json"
    assert main(["measure", *MLP, "--plan", str(plan_path), "--steps", "1", "--out", str(measured_path)]) == 0
    measured = Measurement.from_json(measured_path.read_text())
    assert measured.plan == plan.strategy
    assert abs(measured.peak_bytes - plan.predicted_peak_bytes) <= 0.1 * plan.predicted_peak_bytes
    assert main(["measure", "mlp", "--set", "widths=(8, 16, 8)", "--plan", str(plan_path), "--steps", "1"]) == 1


def test_user_factory(tmp_path: Path) -> None:
    assert main(["bench", "tests.cli.factory:make", "--set", "width=6", "--strategy", "full", "--rounds", "1", "--json", str(tmp_path / "b.json")]) == 0
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [r["label"] for r in rows] == ["none", "full"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "resnet50"], "error: models: unknown workload 'resnet50'; valid names are gpt, mlp, resnet, unet"),
        (["plan", *MLP, "--budget", "1B"], "error: plan: budget 1B is below the smallest feasible peak"),
        (["plan", *MLP, "--budget", "lots"], "error: size: cannot read 'lots'"),
        (["bench", *MLP, "--strategy", "every_nth(0)"], "error: strategy every_nth: n=0 is invalid"),
        (["bench", "no_such_module:fn"], "error: model: cannot import 'no_such_module:fn'"),
        (["bench", "mlp", "--set", "depth"], "error: --set: cannot read 'depth'"),
        (["measure", "mlp", "--plan", "/no/such/plan.json"], "error: cannot read '/no/such/plan.json'"),
        (["measure", "mlp", "--plan", "/dev/null"], "error: plan json: not valid JSON"),
        (["bench", "tests.cli.factory:broken"], "error: model: tests.cli.factory:broken() raised ValueError: boom"),
        (["bench", "tests.cli.factory:mismatched"], "error: RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
        (["profile", *MLP, "--out", "/no/such/dir/p.json"], "error: cannot write '/no/such/dir/p.json'"),
        (["bench", *MLP, "--rounds", "0"], "error: bench: rounds=0 must be an integer >= 1"),
        (["bench", *MLP, "--strategy", "named([['zz']])"], "error: strategy named: [['zz']] are not blocks here"),
        (["plan", *MLP, "--budget", "1e400"], "error: size: '1e400' is negative, infinite or not a number"),
    ],
)
def test_user_mistakes_print_one_error_line_and_exit_1(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(message), err
    assert "Traceback" not in err


def test_python_dash_m_entry_point() -> None:
    done = subprocess.run([sys.executable, "-m", "remat", "--help"], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "bench" in done.stdout and "report" in done.stdout
