"""Plans read back from JSON are validated (NOTE [ One loading policy ] in remat._json), and so are plans
given to ``remat.apply`` and ``remat measure --plan``: every block once, in order, within bounds, and a
plan covering the model's blocks, not part of them."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import remat
from remat.blocks import Block, LayerType
from remat.cli.main import main
from remat.core.ops import Keep, Op, Recompute, RecomputeSub, ops_from_json, ops_to_json, validate_ops
from remat.errors import PlanMismatchError, RematError
from remat.plan.chain import Chain
from remat.plan.frontier import Frontier, FrontierPoint
from remat.plan.solver import simulate
from remat.plan.types import Plan
from tests.conftest import TinyNet


def blocks4() -> tuple[Block, ...]:
    return tuple(
        Block(
            index=i,
            fqns=(f"layers.{i}",),
            type_hint=LayerType.OTHER,
            class_name="Layer",
            attention_fqns=(f"layers.{i}.attn",),
            ffn_fqns=(f"layers.{i}.mlp",),
            param_bytes=64,
        )
        for i in range(4)
    )


# K0 R[1:3](K1 K2) S3{layers.3.attn}: a keep, a nested-ready recompute, a sub-module checkpoint.
OPS: tuple[Op, ...] = (Keep(0), Recompute(1, 3, (Keep(1), Keep(2))), RecomputeSub(3, ("layers.3.attn",)))
PLAN = Plan(
    strategy="optimal",
    blocks=blocks4(),
    ops=OPS,
    fingerprint="0123456789abcdef.01234567",
    budget_bytes=1000,
    predicted_peak_bytes=900,
    predicted_extra_ms=1.5,
    baseline_peak_bytes=2000,
    baseline_step_ms=10.0,
)
FIX = r"make the plan again with remat\.plan"


def edited(change: Callable[[dict[str, Any]], Any]) -> str:
    data = json.loads(PLAN.to_json())
    change(data)
    return json.dumps(data)


def test_round_trips() -> None:
    assert Plan.from_json(PLAN.to_json()) == PLAN
    nested = Recompute(0, 4, (Recompute(0, 2, (Keep(0), Keep(1))), Keep(2), RecomputeSub(3, ("layers.3.mlp",))))
    bare = Plan("nested", blocks4(), (nested,))
    assert Plan.from_json(bare.to_json()) == bare
    assert ops_from_json(ops_to_json(bare.ops)) == bare.ops


def test_optional_fields_take_their_defaults() -> None:
    # A file written by hand (or by an older remat) with only the required fields.
    old = edited(
        lambda d: [d.pop(k) for k in ("fingerprint", "budget_bytes", "predicted_peak_bytes", "baseline_step_ms")]
    )
    plan = Plan.from_json(old)
    assert plan.fingerprint is None and plan.budget_bytes is None and plan.baseline_step_ms is None
    assert plan.ops == OPS and plan.predicted_extra_ms == 1.5
    # JSON numbers without a fraction are fine where a float is expected.
    assert Plan.from_json(edited(lambda d: d.update(predicted_extra_ms=2))).predicted_extra_ms == 2.0


def test_unknown_keys_are_ignored_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="remat._json"):
        plan = Plan.from_json(edited(lambda d: d.update(budget_byte=5, note="hand-tuned")))
    assert plan == PLAN
    assert [r.getMessage() for r in caplog.records] == [
        "plan json: ignoring unknown fields 'budget_byte' (did you mean 'budget_bytes'?), 'note'; "
        "a newer remat may have written them, or they are a typo"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="remat._json"):
        Plan.from_json(edited(lambda d: d["ops"][0].update(size=3)))
    assert "plan json: ignoring unknown field 'size' in 'ops[0]'" in caplog.text


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], Any]:
    """A change setting ``data[k1][k2]... = value`` (``path`` like ``"ops.1.inner"``)."""
    keys: list[Any] = [int(k) if k.isdigit() else k for k in path.split(".")]

    def change(data: dict[str, Any]) -> None:
        obj: Any = data
        for k in keys[:-1]:
            obj = obj[k]
        if value is _DROP:
            del obj[keys[-1]]
        else:
            obj[keys[-1]] = value

    return change


_DROP = object()


def op_list(*ops: Op) -> list[Any]:
    return ops_to_json(tuple(ops))


R1 = Recompute(1, 2, (Keep(1),))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        # missing fields, at the top and inside
        (_set("strategy", _DROP), rf"^plan json: missing field 'strategy'; {FIX}"),
        (_set("ops", _DROP), r"^plan json: missing field 'ops'; "),
        (_set("blocks.1.fqns", _DROP), r"^plan json: missing field 'blocks\[1\]\.fqns'; "),
        (_set("ops.0.index", _DROP), r"^plan json: missing field 'ops\[0\]\.index'; "),
        (_set("ops.1.inner", _DROP), r"^plan json: missing field 'ops\[1\]\.inner'; "),
        (_set("ops.2.fqns", _DROP), r"^plan json: missing field 'ops\[2\]\.fqns'; "),
        # bad types
        (_set("strategy", 3), rf"^plan json: field 'strategy' is 3, expected a string; {FIX}"),
        (_set("blocks", {"0": {}}), r"field 'blocks' is an object, expected a list"),
        (_set("blocks.0", "layers.0"), r"field 'blocks\[0\]' is \"layers\.0\", expected an object"),
        (
            _set("blocks.2.type_hint", "attn"),
            r"field 'blocks\[2\]\.type_hint' is \"attn\", expected one of \"attention\", \"ffn\"",
        ),
        (_set("blocks.2.fqns", "layers.2"), r"field 'blocks\[2\]\.fqns' is \"layers\.2\", expected a list"),
        (_set("blocks.2.param_bytes", 1.5), r"field 'blocks\[2\]\.param_bytes' is 1\.5, expected an integer"),
        (_set("budget_bytes", "1GiB"), r"field 'budget_bytes' is \"1GiB\", expected an integer"),
        (_set("budget_bytes", True), r"field 'budget_bytes' is true, expected an integer"),
        (_set("predicted_extra_ms", "fast"), r"field 'predicted_extra_ms' is \"fast\", expected a number"),
        (_set("fingerprint", 5), r"field 'fingerprint' is 5, expected a string"),
        (_set("ops", {"op": "keep"}), r"field 'ops' is not a list, expected a list of operations"),
        (_set("ops.0", 0), r"field 'ops\[0\]' is 0, expected an object"),
        (
            _set("ops.0.op", "drop"),
            r"field 'ops\[0\]\.op' is 'drop', expected one of 'keep', 'recompute', 'recompute_sub'",
        ),
        (_set("ops.0.index", "0"), r"field 'ops\[0\]\.index' is \"0\", expected an integer"),
        (_set("ops.1.stop", None), r"field 'ops\[1\]\.stop' is null, expected an integer"),
        (_set("ops.1.inner", "K1 K2"), r"field 'ops\[1\]\.inner' is not a list"),
        (_set("ops.1.inner.0.index", 1.0), r"field 'ops\[1\]\.inner\[0\]\.index' is 1\.0, expected an integer"),
        # blocks out of order
        (
            _set("blocks.1.index", 2),
            r"field 'blocks\[1\]\.index' is 2, expected 1 \(blocks are listed in forward order from 0\)",
        ),
        # operations that do not cover every block once, in order, within bounds
        (
            _set("ops", op_list(Keep(0), Keep(2), Keep(3))),
            r"^plan json: ops: plan operation K2 at position 1 is for block 2, expected block 1",
        ),
        (
            _set("ops", op_list(Keep(0), Keep(0), Keep(1), Keep(2), Keep(3))),
            r"operation K0 at position 1 is for block 0, expected block 1",
        ),
        (
            _set("ops", op_list(Keep(0), Keep(1), Keep(2), Keep(3), Keep(4))),
            r"operation K4 at position 4 is past block 3",
        ),
        (
            _set("ops", op_list(Keep(0), Keep(1), Keep(2))),
            r"operations cover blocks 0\.\.2 but must cover 0\.\.3; add the missing",
        ),
        (
            _set("ops", op_list(Keep(0), Keep(1), Recompute(2, 5, (Keep(2), Keep(3), Keep(4))))),
            r"R\[2:5\]\(K2 K3 K4\) at position 2 spans blocks 2\.\.4, expected a non-empty span starting at block 2 and ending by block 3",
        ),
        (
            _set("ops", op_list(Keep(0), Recompute(1, 1, ()), Keep(1), Keep(2), Keep(3))),
            r"R\[1:1\]\(\) at position 1 spans blocks 1\.\.0",
        ),
        (
            _set("ops", op_list(Recompute(0, 2, (Keep(0), R1)), Keep(2), Keep(3))),
            r"ends its inner plan with R\[1:2\]\(K1\); the inner plan of a recompute must end with Keep\(1\)",
        ),
        (
            _set("ops", op_list(Recompute(0, 2, ()), Keep(2), Keep(3))),
            r"R\[0:2\]\(\) at position 0 ends its inner plan with nothing",
        ),
        (
            _set("ops", op_list(Recompute(0, 2, (Keep(1), Keep(1))), Keep(2), Keep(3))),
            r"inner plan of R\[0:2\]\(K1 K1\): operation K1 at position 0 is for block 1, expected block 0",
        ),
        (
            _set("ops", op_list(Recompute(0, 2, (Keep(0), Keep(1), Keep(2))), Keep(2), Keep(3))),
            r"inner plan of R\[0:2\]\(K0 K1 K2\): operation K2 at position 2 is past block 1",
        ),
        # sub-modules outside their block
        (
            _set("ops.2.fqns", ["layers.2.attn"]),
            r"operation S3\{layers\.2\.attn\} at position 2 names 'layers\.2\.attn', which is not inside block 3 \(layers\.3\)",
        ),
        (_set("ops.2.fqns", ["layers.3"]), r"names 'layers\.3', which is not inside block 3"),
        (_set("ops.2.fqns", []), r"operation S3\{\} at position 2 names no sub-module of block 3"),
    ],
)
def test_malformed_plans_raise_remat_error(change: Callable[[dict[str, Any]], Any], match: str) -> None:
    with pytest.raises(RematError, match=match):
        Plan.from_json(edited(change))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", r"^plan json: not valid JSON \(Expecting value at line 1\); give a file written by remat"),
        ("[1, 2]", r"^plan json: the file holds a list of 2, not an object"),
        ('{"strategy": "full"}', rf"^plan json: schema_version None is not 1; {FIX}"),
        ('{"schema_version": 2, "strategy": "full"}', r"^plan json: schema_version 2 is not 1"),
        ('{"schema_version": true}', r"^plan json: schema_version True is not 1"),
    ],
)
def test_not_a_plan_file(text: str, match: str) -> None:
    with pytest.raises(RematError, match=match):
        Plan.from_json(text)


def test_another_kind_of_file_is_named_as_such() -> None:
    profile_like = json.dumps(
        {"schema_version": 1, "model": "GPT", "device": "cpu", "block_profiles": [], "is_chain": True}
    )
    with pytest.raises(
        RematError,
        match=r"^plan json: missing field 'strategy' and 2 more of the fields a plan has \(it has 'block_profiles', "
        r"'device', 'is_chain', 'model' instead: is it another kind of file\?\); make the plan again",
    ):
        Plan.from_json(profile_like)


def test_validate_ops_is_the_one_check() -> None:
    validate_ops(OPS, 4, block_fqns=[b.fqns for b in blocks4()])
    with pytest.raises(RematError, match=r"^here: plan operation K1 at position 0 is for block 1, expected block 0"):
        validate_ops((Keep(1), Keep(0)), 2, source="here")
    with pytest.raises(RematError, match=r"^simulate: plan operation 'K0' at position 0 is a str"):
        simulate(_chain(2), ("K0", Keep(1)))  # type: ignore[arg-type]
    with pytest.raises(RematError, match=r"^plan: a plan of 4 blocks was given the names of 3 blocks"):
        validate_ops(OPS, 4, block_fqns=[b.fqns for b in blocks4()[:3]])


def _chain(n: int) -> Chain:
    ones = (1,) * (n + 1)
    return Chain(
        fwd_ms=(1.0,) * (n + 1),
        bwd_ms=(1.0,) * (n + 1),
        x_bytes=ones,
        keep_bytes=ones,
        fwd_peak_bytes=ones,
        bwd_peak_bytes=ones,
    )


# ------------------------------------------------------------------------------------------------
# apply: the ops are validated, and the plan must cover the model's blocks
# ------------------------------------------------------------------------------------------------


def tiny_net(n: int = 4) -> tuple[TinyNet, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """An embed -> n layers -> head model; also loaded by the CLI as ``tests.plan.test_plan_json:tiny_net``."""
    torch.manual_seed(0)
    return TinyNet(n=n), torch.randn(3, 8), lambda out: out.square().mean()


def test_apply_validates_the_ops_and_leaves_the_model_alone() -> None:
    model = tiny_net()[0]
    bad = Plan("by hand", remat.blocks(model), (Keep(0), Keep(2), Keep(3), Keep(1)))
    with pytest.raises(
        RematError, match=r"^apply \(by hand\): plan operation K2 at position 1 is for block 2, expected block 1"
    ):
        remat.apply(model, bad)
    assert remat.applied(model) is None
    outside = Plan("by hand", remat.blocks(model), (RecomputeSub(0, ("layers.1.fc1",)), Keep(1), Keep(2), Keep(3)))
    with pytest.raises(
        RematError, match=r"^apply \(by hand\): plan operation S0\{layers\.1\.fc1\} .* not inside block 0 \(layers\.0\)"
    ):
        remat.apply(model, outside)
    assert remat.applied(model) is None


COVERS = (
    r"^apply: the plan \(full\) covers 4 blocks \(layers\.0\.\.layers\.3\) of a model with a different number of such "
    r"modules; here remat\.blocks\(model\) finds 6 blocks \(layers\.0\.\.layers\.5\); a plan must cover the blocks of "
    r"the model it was made for, not part of them: profile and plan this model again"
)


def test_a_plan_for_4_blocks_is_refused_on_6() -> None:
    four, six = tiny_net(4)[0], tiny_net(6)[0]
    plan = remat.apply(four, remat.full())
    with pytest.raises(PlanMismatchError, match=COVERS):
        remat.apply(six, plan)
    with pytest.raises(PlanMismatchError, match=COVERS):
        remat.apply(six, Plan.from_json(plan.to_json()))
    assert remat.applied(six) is None


def test_a_profiled_plan_for_4_blocks_is_refused_on_6() -> None:
    model, x, loss_fn = tiny_net(4)
    plan = remat.plan(remat.profile(model, x, loss_fn, repeats=1), strategy=remat.full())
    with pytest.raises(PlanMismatchError, match=COVERS):
        remat.apply(tiny_net(6)[0], Plan.from_json(plan.to_json()))


def test_plans_for_user_selected_blocks_still_apply() -> None:
    model, x, loss_fn = tiny_net(6)
    chosen = remat.blocks(model, include="layers.[0-3]")
    assert len(chosen) == 4
    plan = Plan.from_json(remat.apply(model, remat.full(), blocks=chosen).to_json())
    remat.remove(model)
    twin = tiny_net(6)[0]
    assert remat.apply(twin, plan) == plan
    assert remat.check_gradients(model, plan, x, loss_fn).equal
    # The same selection on a 4-layer model is another model's layout: refused, naming both counts.
    with pytest.raises(PlanMismatchError, match=r"covers 4 blocks .* here remat\.blocks\(model\) finds 4 blocks"):
        remat.apply(tiny_net(4)[0], plan)


def test_plans_written_before_the_run_fingerprint_still_apply() -> None:
    model = tiny_net(4)[0]
    plan = remat.apply(model, remat.full())
    assert plan.fingerprint is not None and "." in plan.fingerprint
    legacy = Plan.from_json(edited_plan(plan, fingerprint=plan.fingerprint.partition(".")[0]))
    remat.remove(model)
    assert remat.apply(model, legacy) == legacy  # no run part: only the blocks are compared, as before
    other = TinyNet(d=8, n=4)
    with pytest.raises(
        PlanMismatchError, match=r"made for blocks with fingerprint [0-9a-f]{16}, but this model's blocks"
    ):
        remat.apply(other, legacy)


def edited_plan(plan: Plan, **fields: Any) -> str:
    data = json.loads(plan.to_json())
    data.update(fields)
    return json.dumps(data)


# ------------------------------------------------------------------------------------------------
# remat measure --plan: one error line
# ------------------------------------------------------------------------------------------------

NET = "tests.plan.test_plan_json:tiny_net"


def _measure_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_measure_reports_a_bad_plan_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    four = tiny_net(4)[0]
    plan = remat.apply(four, remat.full())
    bad = tmp_path / "bad.json"
    bad.write_text(edited_plan(plan, ops=op_list(Keep(0), Keep(1), Keep(1), Keep(3))))
    err = _measure_error(
        ["measure", NET, "--plan", str(bad), "--steps", "1", "--out", str(tmp_path / "m.json")], capsys
    )
    assert err.startswith("error: plan json: ops: plan operation K1 at position 2 is for block 1, expected block 2"), (
        err
    )
    missing = tmp_path / "missing.json"
    missing.write_text(edited_plan(plan, strategy=None))
    err = _measure_error(["measure", NET, "--plan", str(missing), "--steps", "1"], capsys)
    assert err.startswith("error: plan json: field 'strategy' is null, expected a string; make the plan again"), err
    good = tmp_path / "plan.json"
    good.write_text(plan.to_json())
    err = _measure_error(["measure", NET, "--set", "n=6", "--plan", str(good), "--steps", "1"], capsys)
    assert err.startswith("error: apply: the plan (full) covers 4 blocks (layers.0..layers.3)"), err
    assert "finds 6 blocks (layers.0..layers.5)" in err
    assert not (tmp_path / "m.json").exists()


# ------------------------------------------------------------------------------------------------
# a plan inside another file, and frontier.json
# ------------------------------------------------------------------------------------------------


def test_a_plan_inside_another_file_reads_back_and_is_checked_the_same() -> None:
    assert Plan.from_dict(json.loads(json.dumps(PLAN.to_dict()))) == PLAN
    assert "schema_version" not in PLAN.to_dict()
    assert json.loads(PLAN.to_json()) == {"schema_version": 1, **json.loads(json.dumps(PLAN.to_dict()))}
    bad = {**json.loads(PLAN.to_json()), "ops": op_list(Keep(0), Keep(2), Keep(3))}
    del bad["schema_version"]
    with pytest.raises(RematError, match=r"^plan json: rows\[1\]\.plan\.ops: plan operation K2 at position 1"):
        Plan.from_dict(bad, path="rows[1].plan")


FRONTIER = Frontier(
    points=(FrontierPoint(1000, 900, 2.5, "R[0:2](K0 K1) K2"), FrontierPoint(2000, 1500, 0.0, "K0 K1 K2")),
    strategies=(("none", 1500, 0.0), ("full", 700, 4.0)),
    baseline_peak_bytes=1500,
    baseline_step_ms=10.0,
)
FRONTIER_FIX = r"compute it again with remat\.frontier\(profile\)\.to_json\(\)"


def test_frontier_json_round_trip() -> None:
    assert Frontier.from_json(FRONTIER.to_json()) == FRONTIER
    empty = Frontier(points=(), strategies=(), baseline_peak_bytes=0, baseline_step_ms=0.0)
    assert Frontier.from_json(empty.to_json()) == empty


def _frontier(change: Callable[[dict[str, Any]], Any]) -> str:
    data = json.loads(FRONTIER.to_json())
    change(data)
    return json.dumps(data)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: d.pop("points"), rf"^frontier json: missing field 'points'; {FRONTIER_FIX}"),
        (lambda d: d["points"][1].pop("ops"), r"^frontier json: missing field 'points\[1\]\.ops'; "),
        (lambda d: d["points"][0].update(peak_bytes="1KiB"), r"field 'points\[0\]\.peak_bytes' is \"1KiB\", expected an integer"),
        (lambda d: d["strategies"][0].pop(), r"field 'strategies\[0\]' has 2 entries, expected 3"),
        (lambda d: d["strategies"][1].__setitem__(2, None), r"field 'strategies\[1\]\[2\]' is null, expected a number"),
        (lambda d: d.update(schema_version=3), rf"^frontier json: schema_version 3 is not 1; {FRONTIER_FIX}"),
    ],
)  # fmt: skip
def test_a_bad_frontier_file_names_the_field_and_the_fix(change: Callable[[dict[str, Any]], Any], match: str) -> None:
    with pytest.raises(RematError, match=match):
        Frontier.from_json(_frontier(change))
