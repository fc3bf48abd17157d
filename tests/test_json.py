"""remat._json: one loading policy for every kind of file (NOTE [ One loading policy ]), and atomic writes."""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pytest

import remat
from remat._json import Reader, load, read, write_atomic
from remat.blocks import LayerType
from remat.cli.common import write_file
from remat.errors import RematError
from remat.measure import Measurement
from remat.measure.timeline import Interval, Phase, Timeline
from remat.plan.types import Plan
from remat.profile.types import Profile
from tests.conftest import tiny_net_workload

# ------------------------------------------------------------------------------------------------
# The reader, on small dataclasses of its own
# ------------------------------------------------------------------------------------------------


class Span(NamedTuple):
    name: str
    start_ms: float


@dataclass(frozen=True)
class Inner:
    n: int
    hint: LayerType = LayerType.OTHER


@dataclass(frozen=True)
class Doc:
    name: str
    items: tuple[Inner, ...]
    counts: dict[str, int]
    spans: tuple[Span, ...] = ()
    pair: tuple[str, float] = ("a", 0.0)
    limit: int | None = None
    flag: bool = False


R = Reader("doc", "write it again")
GOOD: dict[str, Any] = {
    "name": "x",
    "items": [{"n": 1, "hint": "ffn"}, {"n": 2}],
    "counts": {"a": 1},
    "spans": [["f", 1], {"name": "b", "start_ms": 2.5}],
}


def test_build_reads_nested_values_and_defaults() -> None:
    doc = R.build(Doc, GOOD)
    assert doc == Doc("x", (Inner(1, LayerType.FFN), Inner(2)), {"a": 1}, (Span("f", 1.0), Span("b", 2.5)))
    assert isinstance(doc.spans[0], Span) and isinstance(doc.spans[0].start_ms, float)
    assert R.build(Doc, {**GOOD, "pair": ["b", 2], "limit": None, "flag": True}).pair == ("b", 2.0)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"name": None}, r"^doc json: field 'name' is null, expected a string; write it again$"),
        ({"items": [{"hint": "ffn"}]}, r"^doc json: missing field 'items\[0\]\.n'; write it again$"),
        ({"items": [{"n": "1"}]}, r"field 'items\[0\]\.n' is \"1\", expected an integer"),
        ({"items": [{"n": True}]}, r"field 'items\[0\]\.n' is true, expected an integer"),
        (
            {"items": [{"n": 1, "hint": "mlp"}]},
            r"field 'items\[0\]\.hint' is \"mlp\", expected one of \"attention\", \"ffn\", \"embedding\", \"norm\", \"other\"",
        ),
        ({"items": {"n": 1}}, r"field 'items' is an object, expected a list"),
        ({"counts": {"a": 1.5}}, r"field 'counts\[\"a\"\]' is 1\.5, expected an integer"),
        ({"counts": [1]}, r"field 'counts' is a list of 1, expected an object"),
        ({"spans": [["f"]]}, r"field 'spans\[0\]' is a list of 1, expected a list of 2 \(name, start_ms\)"),
        ({"spans": [{"name": "f"}]}, r"missing field 'spans\[0\]\.start_ms'"),
        ({"spans": [["f", "late"]]}, r"field 'spans\[0\]\[1\]' is \"late\", expected a number"),
        ({"pair": ["b", 2, 3]}, r"field 'pair' has 3 entries, expected 2"),
        ({"limit": 1.0}, r"field 'limit' is 1\.0, expected an integer"),
        ({"flag": 1}, r"field 'flag' is 1, expected true or false"),
        ({"name": 7**60}, r"field 'name' is \d{37}\.\.\., expected a string"),  # long values are cut
    ],
)
def test_bad_values_name_the_field(change: dict[str, Any], match: str) -> None:
    with pytest.raises(RematError, match=match):
        R.build(Doc, {**GOOD, **change})


def test_missing_required_and_unknown_keys(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(RematError, match=r"^doc json: missing field 'counts'; write it again$"):
        R.build(Doc, {"name": "x", "items": []})
    with caplog.at_level(logging.WARNING, logger="remat._json"):
        doc = R.build(Doc, {**GOOD, "nmae": "typo", "items": [{"n": 1, "extra": 0}]})
    assert doc.name == "x"
    assert [r.getMessage() for r in caplog.records] == [
        "doc json: ignoring unknown field 'extra' in 'items[0]'; a newer remat may have written it, or it is a typo",
        "doc json: ignoring unknown field 'nmae' (did you mean 'name'?); a newer remat may have written it, or it is a typo",
    ]


def test_default_fix() -> None:
    with pytest.raises(
        RematError, match=r"^doc json: missing field 'name'; write the doc file again with this version of remat$"
    ):
        Reader("doc").build(Doc, {"items": [], "counts": {}})


# ------------------------------------------------------------------------------------------------
# Every kind of file
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prof() -> Profile:
    w = tiny_net_workload()
    return remat.profile(w.model, w.inputs, w.loss_fn, repeats=1)


MEASUREMENT = Measurement(
    peak_bytes=1000,
    step_ms=2.0,
    step_ms_all=(2.0, 2.5),
    forward_counts={"layers.0": 2, "layers.1": 1},
    held_bytes=10,
    device="cpu",
    plan="full",
)
TIMELINE = Timeline(
    t_ms=(0.0, 1.0, 2.0),
    bytes=(0, 100, 0),
    phases=(Phase("forward", 0.0, 1.0), Phase("backward", 1.0, 2.0)),
    intervals=(Interval("layers.0", "forward", 0.0, 0.5), Interval("layers.0", "backward", 1.5, 2.0)),
    peak_bytes=100,
    duration_ms=2.0,
    held_bytes=10,
    plan="none",
    device="cpu",
)
KINDS: list[tuple[Any, str]] = [(Profile, "profile"), (Plan, "plan"), (Measurement, "measure"), (Timeline, "timeline")]


@pytest.mark.parametrize(("cls", "kind"), KINDS)
@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            '{"schema_version": 1',
            r"json: not valid JSON \(Expecting ',' delimiter at line 1\); give a file written by remat",
        ),
        ("[]", r"json: the file holds a list of 0, not an object; give a file written by remat"),
        ('"plan"', r"json: the file holds \"plan\", not an object"),
        ("{}", r"json: schema_version None is not 1; "),
        ('{"schema_version": "1"}', r"json: schema_version '1' is not 1; "),
        ('{"schema_version": 1}', r"json: missing field '"),
    ],
)
def test_every_kind_refuses_what_is_not_its_file(cls: Any, kind: str, text: str, match: str) -> None:
    with pytest.raises(RematError, match=rf"^{kind} {match}"):
        cls.from_json(text)


def test_profile_round_trip_and_robustness(prof: Profile, caplog: pytest.LogCaptureFixture) -> None:
    text = prof.to_json()
    assert Profile.from_json(text) == prof
    data = json.loads(text)

    def with_(change: Callable[[dict[str, Any]], Any]) -> str:
        d = json.loads(text)
        change(d)
        return json.dumps(d)

    fix = (
        r"profile the model again: remat\.profile\(\.\.\.\)\.to_json\(\) or `remat profile MODEL --out profile\.json`$"
    )
    with pytest.raises(RematError, match=rf"^profile json: missing field 'peak_bytes'; {fix}"):
        Profile.from_json(with_(lambda d: d.pop("peak_bytes")))
    with pytest.raises(
        RematError, match=r"^profile json: missing field 'block_profiles\[1\]\.fwd_ms'; profile the model again"
    ):
        Profile.from_json(with_(lambda d: d["block_profiles"][1].pop("fwd_ms")))
    with pytest.raises(
        RematError, match=r"^profile json: field 'block_profiles\[0\]\.saved_bytes' is \"12KiB\", expected an integer"
    ):
        Profile.from_json(with_(lambda d: d["block_profiles"][0].update(saved_bytes="12KiB")))
    with pytest.raises(RematError, match=r"^profile json: field 'is_chain' is \"yes\", expected true or false"):
        Profile.from_json(with_(lambda d: d.update(is_chain="yes")))
    with pytest.raises(
        RematError, match=r"^profile json: field 'blocks\[0\]\.type_hint' is \"layer\", expected one of \"attention\""
    ):
        Profile.from_json(with_(lambda d: d["blocks"][0].update(type_hint="layer")))
    n = len(data["blocks"])
    with pytest.raises(
        RematError,
        match=rf"^profile json: field 'block_profiles' has {n - 1} entries for {n} blocks, expected one per block",
    ):
        Profile.from_json(with_(lambda d: d["block_profiles"].pop()))
    with pytest.raises(RematError, match=r"^profile json: field 'blocks\[1\]\.index' is 0, expected 1"):
        Profile.from_json(with_(lambda d: d["blocks"][1].update(index=0)))
    # Fields with defaults may be missing (files written before they existed); unknown keys are ignored.
    old = Profile.from_json(
        with_(
            lambda d: [
                d.pop("ckpt_call_ms"),
                d["block_profiles"][0].pop("ckpt_fwd_ms"),
                d["block_profiles"][0].pop("subs"),
            ]
        )
    )
    assert old.ckpt_call_ms == 0.0 and old.block_profiles[0].ckpt_fwd_ms == 0.0 and old.block_profiles[0].subs == ()
    with caplog.at_level(logging.WARNING, logger="remat._json"):
        assert Profile.from_json(with_(lambda d: d.update(gpu_name="H100"))) == prof
    assert "profile json: ignoring unknown field 'gpu_name'" in caplog.text
    # A plan given for a profile.
    plan = remat.plan(prof, strategy=remat.full())
    with pytest.raises(
        RematError,
        match=r"^profile json: missing field 'model' and \d+ more of the fields a profile has \(it has 'baseline_peak_bytes', .*'ops'.* instead: is it another kind of file\?\); profile the model again",
    ):
        Profile.from_json(plan.to_json())


def test_measurement_round_trip_and_robustness() -> None:
    text = MEASUREMENT.to_json()
    assert Measurement.from_json(text) == MEASUREMENT
    fix = r"measure again with remat\.measure\(\.\.\.\)\.to_json\(\) or `remat measure MODEL --out measure\.json`$"
    d = json.loads(text)
    d["forward_counts"]["layers.1"] = "once"
    with pytest.raises(
        RematError,
        match=rf"^measure json: field 'forward_counts\[\"layers\.1\"\]' is \"once\", expected an integer; {fix}",
    ):
        Measurement.from_json(json.dumps(d))
    d = json.loads(text)
    d["step_ms_all"] = 2.0
    with pytest.raises(RematError, match=r"^measure json: field 'step_ms_all' is 2\.0, expected a list"):
        Measurement.from_json(json.dumps(d))
    d = json.loads(text)
    del d["device"]
    with pytest.raises(RematError, match=rf"^measure json: missing field 'device'; {fix}"):
        Measurement.from_json(json.dumps(d))


def test_timeline_round_trip_and_robustness() -> None:
    text = TIMELINE.to_json()
    back = Timeline.from_json(text)
    assert back == TIMELINE and isinstance(back.phases[0], Phase) and isinstance(back.intervals[1], Interval)
    fix = r"record the timeline again with remat\.timeline\(\.\.\.\)\.to_json\(\)$"

    def bad(change: Callable[[dict[str, Any]], Any], match: str) -> None:
        d = json.loads(text)
        change(d)
        with pytest.raises(RematError, match=match):
            Timeline.from_json(json.dumps(d))

    bad(
        lambda d: d["phases"][0].pop(),
        rf"^timeline json: field 'phases\[0\]' is a list of 2, expected a list of 3 \(name, start_ms, end_ms\); {fix}",
    )
    bad(
        lambda d: d["intervals"][1].__setitem__(1, 7),
        r"^timeline json: field 'intervals\[1\]\[1\]' is 7, expected a string",
    )
    bad(
        lambda d: d["bytes"].append(5),
        rf"^timeline json: field 't_ms' has 3 entries and 'bytes' 4, expected one time per level; {fix}",
    )
    bad(lambda d: d.pop("intervals"), r"^timeline json: missing field 'intervals'")
    bad(lambda d: d.update(peak_bytes=None), r"^timeline json: field 'peak_bytes' is null, expected an integer")


def test_load_keeps_its_signature() -> None:
    assert load('{"schema_version": 3, "x": 1}', "thing", 3) == {"schema_version": 3, "x": 1}
    with pytest.raises(
        RematError,
        match=r"^thing json: schema_version 2 is not 3; write the thing file again with this version of remat$",
    ):
        load('{"schema_version": 2}', "thing", 3)
    with pytest.raises(RematError, match=r"^thing json: nested too deeply"):
        load("[" * 100_000 + "]" * 100_000, "thing", 3)


def test_read_is_load_then_build() -> None:
    @dataclass(frozen=True)
    class Versioned:
        schema_version = 2
        x: int

    assert read(Versioned, '{"schema_version": 2, "x": 4}', "v") == Versioned(4)
    with pytest.raises(RematError, match=r"^v json: schema_version 1 is not 2"):
        read(Versioned, '{"schema_version": 1, "x": 4}', "v")


# ------------------------------------------------------------------------------------------------
# Atomic writes
# ------------------------------------------------------------------------------------------------


def test_write_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    write_atomic(path, "first")
    assert path.read_text() == "first"
    old = tmp_path / "old-link"
    os.link(path, old)  # a second name for the old file: an in-place write would change it too
    os.chmod(path, 0o640)
    write_atomic(str(path), "second ✓")
    assert path.read_text(encoding="utf-8") == "second ✓" and old.read_text() == "first"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old-link", "plan.json"]


def test_write_atomic_through_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new"


def test_a_failed_write_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_text("old")
    with pytest.raises(UnicodeEncodeError):
        write_atomic(path, "half \ud800 written")  # a lone surrogate cannot be encoded: fails mid-write
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "no" / "such.json", "x")


def test_write_atomic_to_a_device_writes_in_place() -> None:
    write_atomic(os.devnull, "discarded")
    assert os.path.exists(os.devnull) and not stat.S_ISREG(os.stat(os.devnull).st_mode)


def test_cli_write_file_is_atomic(tmp_path: Path) -> None:
    path = tmp_path / "measure.json"
    path.write_text("old")
    os.link(path, tmp_path / "old")
    write_file(path, "new")
    assert path.read_text() == "new" and (tmp_path / "old").read_text() == "old"
    with pytest.raises(
        RematError, match=r"^cannot write '.*/no/m\.json': No such file or directory; check that its folder exists"
    ):
        write_file(tmp_path / "no" / "m.json", "x")
