"""The ``remat`` command line: each subcommand end to end on tiny models, and its error path."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from remat.cli import main as main_module
from remat.cli.common import load_workload
from remat.cli.main import TIMING_ENV, build_parser, main
from remat.errors import RematError
from remat.measure import Measurement
from remat.measure import compare as compare_module
from remat.measure.compare import BenchResult, BenchRow
from remat.models import WORKLOADS
from remat.plan.strategies import STRATEGIES
from remat.plan.types import Plan
from remat.profile import Profile
from remat.report.tables import budget_verdicts

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
    assert "saved" in printed and "overhead" in printed and "optimal @ 80%" in printed
    assert "timings not ranked: with 1 round the run-to-run spread cannot be measured" in " ".join(printed.split())
    assert printed.count("timings not ranked") == 1  # in the table's caption, not again in the summary


def test_bench_out_writes_the_values_that_report_from_reads_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from remat.report import ReportData

    values, plots = tmp_path / "values", tmp_path / "plots"
    argv = ["bench", *MLP, "--budget", "80%", "--rounds", "1", "--out", str(values), "--plots", str(plots)]
    assert main(argv) == 0
    data = ReportData.read(values)
    assert data.plan.strategy == "optimal @ 80%" and data.result.row_of(data.plan) is not None and not data.timelines
    assert sorted(p.name for p in plots.iterdir()) == ["comparison.png", "heatmap.png", "tradeoff.png"]
    assert f"wrote {values / 'frontier.json'}" in capsys.readouterr().out  # `remat report --from`: tests/report


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


def test_split_profiles_and_plans_each_layers_children(tmp_path: Path) -> None:
    # --split: remat.blocks(model, split=True), so a plan written by `plan` fits the model `measure` builds.
    prof_path, plan_path = tmp_path / "profile.json", tmp_path / "plan.json"
    assert main(["profile", *MLP, "--split", "--repeats", "1", "--out", str(prof_path)]) == 0
    prof = Profile.from_json(prof_path.read_text())
    w = load_workload("mlp", MLP[1:][1::2])
    from remat.blocks import blocks

    assert [b.name for b in prof.blocks] == [b.name for b in blocks(w.model, split=True)]
    assert len(prof.blocks) > 5
    assert main(["plan", *MLP, "--split", "--budget", "85%", "--out", str(plan_path)]) == 0
    plan = Plan.from_json(plan_path.read_text())
    assert [b.name for b in plan.blocks] == [b.name for b in prof.blocks]
    assert main(["measure", *MLP, "--plan", str(plan_path), "--steps", "1", "--out", str(tmp_path / "m.json")]) == 0


def test_plan_on_a_profile_checks_the_model_and_loop_given_and_suggests_the_profiles(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prof_path, plan_path = tmp_path / "profile.json", tmp_path / "plan.json"
    loop = ["--grads", "held", "--optimizer", "adamw"]
    assert main(["profile", *MLP, *loop, "--repeats", "1", "--out", str(prof_path)]) == 0
    capsys.readouterr()
    solve = ["--budget", "85%", "--profile", str(prof_path), "--out", str(plan_path)]
    # The profile alone: the suggestion names no model it cannot know, but the loop it measured.
    assert main(["plan", *solve]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert f"measure it with: remat measure MODEL --plan {plan_path} --grads held --optimizer adamw (MODEL: " in printed
    # The matching model: checked, and named in the suggestion.
    assert main(["plan", *MLP, *loop, *solve]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert (
        f"remat measure mlp '--set=widths=(8, 32, 8, 48, 8, 24)' --set=batch=256 --plan {plan_path} --grads held --optimizer adamw"
        in printed
    )
    assert Plan.from_json(plan_path.read_text()).loop == Profile.from_json(prof_path.read_text()).loop
    refused = [
        (["gpt"], "error: plan: gpt is not the model --profile"),
        (["mlp", "--set", "widths=(8, 16, 8)"], "is not the model --profile"),
        ([*MLP, "--split"], "drop --split: the profile was made without it"),
        (["--set", "batch=2"], "error: plan: --set batch=2 describes a model, but --profile"),
        (["--grads", "none"], "error: plan: --grads none differs from the loop --profile"),
        (["--optimizer", "sgd"], "(that is: --grads held --optimizer adamw)"),
    ]
    for extra, message in refused:
        assert main(["plan", *extra, *solve]) == 1
        assert message in " ".join(capsys.readouterr().err.split())
    # measure warns when its loop is not the plan's, and not when it is.
    measure = ["measure", *MLP, "--plan", str(plan_path), "--steps", "1", "--out", str(tmp_path / "m.json")]
    assert main(measure) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "warning: the plan was made for the peak of forward + backward + AdamW step" in printed
    assert "pass --grads held --optimizer adamw to measure the plan's loop" in printed
    assert main([*measure, *loop]) == 0
    assert "warning" not in capsys.readouterr().out


def test_model_spec_mistakes_say_what_to_write(capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        (
            "tests/cli/factory.py",
            [],
            "error: model: 'tests/cli/factory.py' is a file; add the function in it that returns a "
            "remat.models.Workload or (model, inputs, loss_fn), e.g. tests/cli/factory.py:make (functions defined "
            "there: make, broken, mismatched, timing_env, needs)",
        ),
        ("./no_such.py", [], "error: model: no file './no_such.py' in"),
        (
            "tests/cli/factory.py:Model",
            [],
            "error: model: tests/cli/factory.py:Model is a class, not a function; give a function",
        ),
        (
            "tests/cli/factory.py:needs",
            [],
            "cannot be called without arguments: missing a required argument: 'width'; its parameters are width: "
            "set them with --set KEY=VALUE",
        ),
        ("tests.cli.factory:make", ["--set", "w=3"], "cannot be called with w=3 (from --set): got an unexpected"),
    ]
    for spec, sizes, message in cases:
        assert main(["profile", spec, *sizes, "--repeats", "1"]) == 1
        assert message in " ".join(capsys.readouterr().err.split())


def test_user_factory(tmp_path: Path) -> None:
    assert (
        main(
            [
                "bench",
                "tests.cli.factory:make",
                "--set",
                "width=6",
                "--strategy",
                "full",
                "--rounds",
                "1",
                "--json",
                str(tmp_path / "b.json"),
            ]
        )
        == 0
    )
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [r["label"] for r in rows] == ["none", "full"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["bench", "resnet50"],
            "error: model: unknown built-in 'resnet50'; did you mean 'resnet'? built-in models are gpt, resnet",
        ),
        (["plan", *MLP, "--budget", "1B"], "error: plan: budget 1B is below the smallest feasible peak"),
        (["plan", *MLP, "--budget", "lots"], "error: budget: cannot read 'lots'"),
        (["bench", *MLP, "--strategy", "every_nth(0)"], "error: strategy every_nth: n=0 is invalid"),
        (["bench", "no_such_module:fn"], "error: model: no module 'no_such_module' (from 'no_such_module:fn')"),
        (["bench", "mlp", "--set", "depth"], "error: --set: cannot read 'depth'"),
        (["measure", "mlp", "--plan", "/no/such/plan.json"], "error: cannot read '/no/such/plan.json'"),
        (["measure", "mlp", "--plan", "/dev/null"], "error: plan json: not valid JSON"),
        (["bench", "tests.cli.factory:broken"], "error: model: tests.cli.factory:broken() raised ValueError: boom"),
        (["bench", "tests.cli.factory:mismatched"], "error: RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
        (
            ["profile", *MLP, "--out", "/no/such/dir/p.json"],
            "error: --out '/no/such/dir/p.json': its folder does not exist",
        ),
        (["bench", *MLP, "--rounds", "0"], "error: --rounds 0: must be an integer >= 1"),
        (["bench", *MLP, "--strategy", "named([['zz']])"], "error: strategy named: [['zz']] are not blocks here"),
        (["plan", *MLP, "--budget", "1e400"], "error: budget: '1e400' is negative, infinite or not a number"),
    ],
)
def test_user_mistakes_print_one_error_line_and_exit_1(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(message), err
    assert "Traceback" not in err


def test_python_dash_m_entry_point() -> None:
    done = subprocess.run([sys.executable, "-m", "remat", "--help"], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "bench" in done.stdout and "report" in done.stdout


# --- validate before measuring ----------------------------------------------------------------------


@pytest.fixture
def nothing_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every subcommand's profile, measurement and bench raise if called: a mistake must be caught first."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured before checking the arguments")

    for module in ("bench", "plan", "profile", "report"):
        monkeypatch.setattr(f"remat.cli.{module}.run_profile", forbidden)
    monkeypatch.setattr("remat.cli.measure.run_measure", forbidden)
    monkeypatch.setattr("remat.cli.bench.compare", forbidden)
    monkeypatch.setattr("remat.report.pipeline.compare", forbidden)


@pytest.fixture
def remat_files(tmp_path: Path) -> dict[str, str]:
    """A profile-like and a plan-like JSON file (enough for the CLI to tell which is which)."""
    prof, plan = tmp_path / "profile.json", tmp_path / "plan.json"
    prof.write_text(json.dumps({"schema_version": 1, "model": "m", "block_profiles": []}))
    plan.write_text(json.dumps({"schema_version": 1, "strategy": "full", "blocks": [], "ops": []}))
    return {"profile": str(prof), "plan": str(plan)}


FAST_MISTAKES = [
    (
        ["bench", "--budget", "150%"],
        "error: budget: share '150%' is outside (0%, 100%]; 100% is the unplanned peak itself",
    ),
    (
        ["bench", "--budget", "-1GiB"],
        "error: budget: '-1GiB' is negative; give a size >= 0 such as '1.5GiB' or a share",
    ),
    (["plan", "--budget", "40"], "error: budget: '40' has no unit, so it means 40 bytes; did you mean '40%'?"),
    (["report", "--budget", "0.4"], "error: budget: '0.4' has no unit, so it means 0 bytes; did you mean '40%'?"),
    (["bench", "--rounds", "0"], "error: --rounds 0: must be an integer >= 1; e.g. --rounds 5"),
    (["report", "--budget", "40%", "--rounds", "-2"], "error: --rounds -2: must be an integer >= 1"),
    (
        ["report", "--budget", "40%", "--budget", "60%"],
        "error: --budget given 2 times ('40%', '60%'); a report is for one budget: give one --budget",
    ),
    (["profile", "--repeats", "0"], "error: --repeats 0: must be an integer >= 1"),
    (["measure", "--steps", "0"], "error: --steps 0: must be an integer >= 1"),
    (
        ["bench", "--strategy", "every_nt(2)"],
        "error: --strategy 'every_nt(2)': unknown strategy 'every_nt'; did you mean 'every_nth'? valid strategies are none, full, every_nth",
    ),
    (["bench", "--strategy", "every_nth(0)"], "error: strategy every_nth: n=0 is invalid"),
    (
        ["bench", *MLP, "--strategy", "selective([0, 9])"],
        "error: strategy selective: indices [9] are out of range for 5 blocks",
    ),
    (["bench", *MLP, "--strategy", "named([['zz']])"], "error: strategy named: [['zz']] are not blocks here"),
    (
        ["measure", "--plan", "{profile}"],
        "error: --plan '{profile}': this is a profile file (from `remat profile`), not a plan; make a plan from it with `remat plan MODEL --budget 40% --profile {profile}`",
    ),
    (
        ["plan", "--budget", "40%", "--profile", "{plan}"],
        "error: --profile '{plan}': this is a plan file (from `remat plan`), not a profile; pass a profile.json",
    ),
    (["bench", "gpt", "--plots", "{plan}"], "error: --plots '{plan}': this is a file, not a directory"),
    (["bench", "gpt", "--json", "{plan}/out.json"], "error: --json '{plan}/out.json': its folder does not exist"),
    (["report", "gpt", "--budget", "40%", "--out", "{plan}"], "error: --out '{plan}': this is a file, not a directory"),
    (["bench", "resnet50"], "error: model: unknown built-in 'resnet50'; did you mean 'resnet'?"),
    (
        ["bench", "gpt", "--set", "depth=3"],
        "error: --set: model 'gpt' has no size 'depth'; its keys are n_layers, d_model",
    ),
    (["bench", "mymodel:convnet"], "error: model: no module 'mymodel' (from 'mymodel:convnet') in "),
    (["bench", "./mymodel.py:convnet"], "error: model: no file './mymodel.py' (from './mymodel.py:convnet') in "),
]


@pytest.mark.usefixtures("nothing_measured")
@pytest.mark.parametrize(("argv", "message"), FAST_MISTAKES, ids=[" ".join(a) for a, _ in FAST_MISTAKES])
def test_mistakes_fail_before_any_measuring(
    argv: list[str], message: str, remat_files: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a.format(**remat_files) for a in argv]
    start = time.perf_counter()
    assert main(argv) == 1
    assert time.perf_counter() - start < 5.0
    err = capsys.readouterr().err
    assert err.startswith(message.format(**remat_files)), err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_budget_at_the_plain_peak_says_nothing_needs_checkpointing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prof_path = tmp_path / "profile.json"
    assert main(["profile", *MLP, "--repeats", "1", "--out", str(prof_path)]) == 0
    assert (
        main(["plan", *MLP, "--budget", "100%", "--profile", str(prof_path), "--out", str(tmp_path / "plan.json")]) == 0
    )
    assert "budget 100% is at or above the unplanned peak" in capsys.readouterr().out


# --- first five minutes --------------------------------------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("remat 0.")


@pytest.mark.parametrize("argv", [["-v", "bench"], ["bench", "-v"], ["bench", "mlp", "--verbose"]])
def test_verbose_anywhere(argv: list[str]) -> None:
    assert build_parser().parse_args(argv).verbose is True
    assert build_parser().parse_args(["bench"]).verbose is False


def test_verbose_after_the_subcommand_shows_the_traceback() -> None:
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        main(["profile", "tests.cli.factory:mismatched", "-v"])


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"]])
def test_help_lists_models_their_sizes_and_strategies(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    out = capsys.readouterr().out
    assert "gpt (default): n_layers=8 d_model=128" in out
    assert all(f"  {name}" in out for name in WORKLOADS)
    assert "mlp: widths=(128, 512, 192, ...) activation='gelu'" in out
    assert all(name in out for name in STRATEGIES) and "every_nth(n)" in out


def test_help_fits_100_columns(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert max(map(len, capsys.readouterr().out.splitlines())) <= 100


FACTORY = """
import torch
from torch import nn


def make(width=8):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(3)]), torch.randn(2, width), lambda out: out.sum()
"""


@pytest.fixture
def own_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The current directory holds own_factory_<test>.py; sys.path and sys.modules are restored afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    return tmp_path


def test_module_function_from_the_current_directory(own_folder: Path) -> None:
    (own_folder / "own_cwd.py").write_text(FACTORY)
    w = load_workload("own_cwd:make", ["width=4"])
    assert w.inputs.shape == (2, 4) and w.description == "own_cwd:make"


def test_file_path_function(own_folder: Path, tmp_path: Path) -> None:
    (own_folder / "sub").mkdir()
    (own_folder / "sub" / "own_file.py").write_text(FACTORY)
    assert main(["bench", "./sub/own_file.py:make", "--strategy", "full", "--rounds", "1", "--json", "b.json"]) == 0
    assert [r["label"] for r in json.loads((own_folder / "b.json").read_text())["rows"]] == ["none", "full"]


@pytest.mark.parametrize(
    ("source", "spec", "message"),
    [
        (FACTORY, "./own_err.py:build", "model: './own_err.py' has no function 'build'; functions defined there: make"),
        (
            "import not_installed_pkg\n",
            "own_err:make",
            "model: importing 'own_err' failed: No module named 'not_installed_pkg'",
        ),
        (
            "raise KeyError('x')\n",
            "./own_err.py:make",
            "model: loading './own_err.py' raised KeyError: 'x'; fix that file",
        ),
    ],
)
def test_factory_import_errors_name_the_fix(own_folder: Path, source: str, spec: str, message: str) -> None:
    (own_folder / "own_err.py").write_text(source)
    with pytest.raises(RematError, match=re.escape(message)):
        load_workload(spec, [])


# --- honest timings by default ------------------------------------------------------------------


def test_the_remat_program_reexecutes_with_the_timing_environment_keeping_the_users_values() -> None:
    env = {k: v for k, v in os.environ.items() if k not in TIMING_ENV and k != "_REMAT_TIMING_ENV"}
    env["OMP_WAIT_POLICY"] = "ACTIVE"  # the user's own choice is kept
    cmd = [sys.executable, "-m", "remat", "profile", "tests.cli.factory:timing_env"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 1
    assert "raised ValueError: OMP_WAIT_POLICY=ACTIVE,MALLOC_TOP_PAD_=0" in done.stderr, done.stderr


def test_reexec_happens_once_and_only_when_something_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, str]] = []
    monkeypatch.setattr(os, "execve", lambda path, args, env: calls.append(env))
    for k in TIMING_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("_REMAT_TIMING_ENV", "1")  # already re-executed once: never again
    main_module._reexec_with_timing_env()
    assert calls == []
    monkeypatch.delenv("_REMAT_TIMING_ENV")
    main_module._reexec_with_timing_env()
    assert len(calls) == 1 and all(calls[0][k] == v for k, v in TIMING_ENV.items())
    for k, v in TIMING_ENV.items():
        monkeypatch.setenv(k, v)
    main_module._reexec_with_timing_env()
    assert len(calls) == 1


def test_main_called_from_python_never_reexecutes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("main(argv) re-executed the caller's process"))
    for k in TIMING_ENV:
        monkeypatch.delenv(k, raising=False)
    assert main(["profile", "tests.cli.factory:broken"]) == 1


# --- noise warning ---------------------------------------------------------------------------------


def _fake_timer(monkeypatch: pytest.MonkeyPatch, times_ms: list[float]) -> None:
    order = iter(times_ms)
    monkeypatch.setattr(compare_module, "timed_steps", lambda step, device, repeats: [next(order)])


def test_bench_warns_when_the_spread_is_too_large_to_rank(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # none, full per round: the 2-3x scatter; full is only ~7% slower than none.
    _fake_timer(monkeypatch, [310, 150, 131, 330, 168, 180, 267, 290, 148, 160])
    assert main(["bench", "tests.cli.factory:make", "--strategy", "full", "--rounds", "5"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the caption wraps at the table's width
    # spreads: none (267 - 148) / 168 = 71%, full (290 - 160) / 180 = 72%; medians 168 and 180 ms: 7% apart
    warning = (
        "WARNING: timings too noisy to rank the plans: run-to-run spread 72% (interquartile range / median) "
        "is larger than the typical difference between plans (7%)"
    )
    assert out.count(warning) == 1  # in the table's caption, right above the summary; not repeated there


def test_bench_does_not_warn_on_steady_timings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_timer(monkeypatch, [100, 130, 101, 131, 99, 129])
    assert main(["bench", "tests.cli.factory:make", "--strategy", "full", "--rounds", "3"]) == 0
    out = capsys.readouterr().out
    assert "WARNING" not in out and "0.0%" in out


def _row(label: str, step_ms: float, spread: float, peak: int, budget: int | None = None) -> BenchRow:
    solver = label.partition(" @ ")[0] if budget is not None else None  # "optimal @ 50%": the optimal solver's
    return BenchRow(
        label=label, checkpointed=0, n_blocks=4, depth=1, peak_bytes=peak, step_ms=step_ms, step_ms_all=(step_ms,),
        saved_pct=0.0, overhead_pct=0.0, grads_equal=True, forward_counts={}, predicted_peak_bytes=peak,
        predicted_extra_ms=0.0, budget_bytes=budget, ops="", spread_pct=spread, solver=solver,
    )  # fmt: skip


def test_summary_claims_fastest_only_beyond_the_spread() -> None:
    mib = 2**20
    rows = (
        _row("none", 100.0, 2.0, 100 * mib),
        _row("full", 140.0, 2.0, 30 * mib),
        _row("sqrt", 120.0, 2.0, 45 * mib),
        _row("optimal @ 50%", 110.0, 2.0, 48 * mib, budget=50 * mib),
        _row("knapsack @ 50%", 111.0, 2.0, 49 * mib, budget=50 * mib),
    )
    result = BenchResult(model="m", device="cpu", held_bytes=0, rounds=5, rows=rows)
    [line] = budget_verdicts(result)
    # knapsack is 0.9% slower, within the 2% spread: no "fastest" claim, and it is named.
    assert line.endswith(
        "no faster plan fits, but knapsack @ 50% (111.0ms) is within the run-to-run spread (spreads up to 2%): not ranked"
    )
    faster_knapsack = rows[:4] + (_row("knapsack @ 50%", 90.0, 2.0, 49 * mib, budget=50 * mib),)
    [line] = budget_verdicts(BenchResult(model="m", device="cpu", held_bytes=0, rounds=5, rows=faster_knapsack))
    assert line.endswith("-> slower than knapsack @ 50% (90.0ms)")
    assert "best knapsack" not in line  # the verdict names it already
    ties_and_faster = (*faster_knapsack, _row("sqrt @ x", 109.0, 2.0, 44 * mib))
    [line] = budget_verdicts(BenchResult(model="m", device="cpu", held_bytes=0, rounds=5, rows=ties_and_faster))
    assert "fit -> slower than knapsack @ 50% (90.0ms)" in line
    [line] = budget_verdicts(BenchResult(model="m", device="cpu", held_bytes=0, rounds=1, rows=rows))
    assert line.startswith("budget 50.0MiB")  # the noise warning is the table's caption, not a summary line
    alone = rows[:3] + (_row("optimal @ 50%", 110.0, 2.0, 48 * mib, budget=50 * mib),)
    [line] = budget_verdicts(BenchResult(model="m", device="cpu", held_bytes=0, rounds=5, rows=alone))
    assert line.endswith("-> fastest of all that fit")


def test_the_report_command_line_keeps_split() -> None:
    from remat.cli.report import _command, check

    args = build_parser().parse_args(["report", "gpt", "--budget", "40%", "--split", "--set", "n_layers=2"])
    check(args)
    assert _command(args).split()[-1] == "--split"  # re-running the printed line profiles the same blocks


def test_the_reports_python_line_runs_as_pasted(tmp_path: Path) -> None:
    import remat
    from remat.report.html import REPORT_PLAN, _reuse

    model = WORKLOADS["mlp"]().model
    (tmp_path / REPORT_PLAN).write_text(remat.plan(model, strategy="full()").to_json())
    _, line = _reuse("remat report mlp --budget 40%", tmp_path)
    exec(line, {"model": model})  # a NameError (remat, Path) before
    assert remat.applied(model) is not None
