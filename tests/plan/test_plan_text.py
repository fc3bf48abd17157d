"""A plan in words (NOTE [ Plan vocabulary ] in remat.plan.types): one vocabulary for what happens to a
block, the same walk (``Plan.lines``) for every rendering, and the compact form read back."""

from __future__ import annotations

import re

import pytest
from rich.console import Console

from remat.blocks import Block, LayerType
from remat.core.ops import Keep, Op, Recompute, RecomputeSub
from remat.errors import RematError
from remat.plan.types import LEGEND, Fate, Plan, PlanLine, block_fates, ops_from_text
from remat.report.tables import RECOMPUTED_NOTE, plan_tree, plans_table, recomputed_cell


def blocks(n: int = 8) -> tuple[Block, ...]:
    return tuple(
        Block(
            index=i,
            fqns=(f"blocks.{i}",),
            type_hint=LayerType.OTHER,
            class_name="Layer",
            attention_fqns=(f"blocks.{i}.attn",),
            ffn_fqns=(f"blocks.{i}.mlp",),
        )
        for i in range(n)
    )


B8 = blocks()


def attn(i: int) -> RecomputeSub:
    return RecomputeSub(i, (f"blocks.{i}.attn",))


def mlp(i: int) -> RecomputeSub:
    return RecomputeSub(i, (f"blocks.{i}.mlp",))


def own(i: int) -> Recompute:
    return Recompute(i, i + 1, (Keep(i),))


def plan(*ops: Op, strategy: str = "optimal", **figures: float) -> Plan:
    return Plan(strategy=strategy, blocks=B8, ops=ops, **figures)  # type: ignore[arg-type]


# The plan: 3 blocks recomputed, 5 kept with only their attention or MLP recomputed.
MOSTLY_SUBS = plan(own(0), attn(1), mlp(2), attn(3), attn(4), mlp(5), own(6), own(7))
# Two segments, a kept block with its MLP recomputed, a block recomputed alone, two kept.
SEGMENTS = plan(
    mlp(0), Recompute(1, 3, (Keep(1), Keep(2))), Recompute(3, 5, (Keep(3), Keep(4))), Keep(5), own(6), Keep(7)
)
# A segment with a nested one, and a segment whose last block has its attention checkpointed again.
NESTED = plan(
    Recompute(0, 4, (Keep(0), Recompute(1, 3, (Keep(1), Keep(2))), Keep(3))),
    Recompute(4, 8, (Keep(4), Keep(5), Keep(6), attn(7))),
)


def test_a_plan_of_sub_modules_is_not_called_all_recomputed() -> None:
    assert MOSTLY_SUBS.headline() == "8 blocks: 3 recomputed, 5 kept with their attention or MLP recomputed"
    assert [(line.what, MOSTLY_SUBS.span(line.blocks)) for line in MOSTLY_SUBS.lines()] == [
        ("recomputed", "blocks.0"),
        ("kept, attention recomputed", "blocks.1"),
        ("kept, MLP recomputed", "blocks.2"),
        ("kept, attention recomputed", "blocks.3–4"),
        ("kept, MLP recomputed", "blocks.5"),
        ("recomputed, each on its own", "blocks.6–7"),
    ]
    assert recomputed_cell(MOSTLY_SUBS.fates()) == "3 + 5 part"


def test_a_segment_is_one_line_without_kept_blocks_under_it() -> None:
    # Not "recompute blocks.1 .. blocks.2" followed by "keep blocks.1 / keep blocks.2".
    assert list(SEGMENTS.lines()) == [
        PlanLine(0, Fate.PART, "kept, MLP recomputed", (0,)),
        PlanLine(0, Fate.SEGMENT, "recomputed as one segment", (1, 2)),
        PlanLine(0, Fate.SEGMENT, "recomputed as one segment", (3, 4)),
        PlanLine(0, Fate.KEPT, "kept", (5,)),
        PlanLine(0, Fate.RECOMPUTED, "recomputed", (6,)),
        PlanLine(0, Fate.KEPT, "kept", (7,)),
    ]
    assert SEGMENTS.headline() == (
        "8 blocks: 1 recomputed, 4 in 2 recomputed segments, 1 kept with its MLP recomputed, 2 kept"
    )
    assert SEGMENTS.recomputes() == (
        "blocks.0: kept, MLP recomputed; blocks.1–2: recomputed as one segment; blocks.3–4: recomputed as one segment; "
        "blocks.6: recomputed"
    )


def test_nesting_says_how_often_each_block_runs_again() -> None:
    assert list(NESTED.lines()) == [
        PlanLine(0, Fate.SEGMENT, "recomputed as one segment", (0, 1, 2, 3)),
        PlanLine(1, Fate.SEGMENT, "recomputed once", (0,)),
        PlanLine(1, Fate.SEGMENT, "recomputed twice, as one nested segment", (1, 2)),
        PlanLine(1, Fate.SEGMENT, "recomputed once", (3,)),
        PlanLine(0, Fate.SEGMENT, "recomputed as one segment", (4, 5, 6, 7)),
        PlanLine(1, Fate.SEGMENT, "recomputed once", (4, 5, 6)),
        PlanLine(1, Fate.SEGMENT, "recomputed once, its attention twice", (7,)),
    ]
    assert NESTED.headline() == "8 blocks, all in 2 recomputed segments; 2 of them recomputed twice (nested)"
    assert [f.times for f in NESTED.fates()] == [1, 2, 2, 1, 1, 1, 1, 1]
    assert NESTED.recomputes().count(", with more recomputation nested inside") == 2


@pytest.mark.parametrize(
    ("p", "headline", "lines"),
    [
        (plan(*(Keep(i) for i in range(8)), strategy="none"), "8 blocks, all kept (nothing recomputed)", ["kept"]),
        (
            plan(*(own(i) for i in range(8)), strategy="full"),
            "8 blocks, all recomputed, each on its own",
            ["recomputed, each on its own"],
        ),
        (
            plan(*(attn(i) for i in range(8))),
            "8 blocks, all kept with their attention recomputed",
            ["kept, attention recomputed"],
        ),
        (
            plan(Recompute(0, 8, tuple(Keep(i) for i in range(8)))),
            "8 blocks, all in 1 recomputed segment",
            ["recomputed as one segment"],
        ),
    ],
)
def test_uniform_plans_are_one_line(p: Plan, headline: str, lines: list[str]) -> None:
    assert p.headline() == headline
    assert [line.what for line in p.lines()] == lines
    assert [p.span(line.blocks) for line in p.lines()] == ["blocks.0–7"]


def test_fates_of_each_block() -> None:
    fates = block_fates(SEGMENTS.ops)
    assert [f.fate for f in fates] == [
        Fate.PART,
        Fate.SEGMENT,
        Fate.SEGMENT,
        Fate.SEGMENT,
        Fate.SEGMENT,
        Fate.KEPT,
        Fate.RECOMPUTED,
        Fate.KEPT,
    ]
    assert fates[0].subs == ("blocks.0.mlp",) and fates[0].times == 0 and fates[6].times == 1


def test_explain_and_summary_read_as_words_with_the_compact_form_explained() -> None:
    p = plan(*SEGMENTS.ops, budget_bytes=30 * 2**20, predicted_peak_bytes=25 * 2**20, predicted_extra_ms=40.0,
             baseline_peak_bytes=64 * 2**20, baseline_step_ms=100.0)  # fmt: skip
    assert p.explain().splitlines() == [
        "optimal: " + SEGMENTS.headline(),
        "  blocks.0     kept, MLP recomputed",
        "  blocks.1–2   recomputed as one segment",
        "  blocks.3–4   recomputed as one segment",
        "  blocks.5     kept",
        "  blocks.6     recomputed",
        "  blocks.7     kept",
    ]
    text = p.summary()
    assert text.startswith("plan " + p.explain())
    assert f"compact: {p.describe()}" in text and LEGEND in text  # the notation never appears without its legend
    assert (
        "predicted peak: 25.0MiB (39% of unplanned 64.0MiB)" in text
        and "predicted recompute: 40.0ms (+40% of a step)" in text
    )
    assert "checkpointed" not in text


def test_the_json_format_is_unchanged() -> None:
    p = plan(*NESTED.ops, budget_bytes=1000)
    assert Plan.from_json(p.to_json()) == p
    assert "lines" not in p.to_json() and "headline" not in p.to_json()


@pytest.mark.parametrize(
    "p",
    [
        MOSTLY_SUBS,
        SEGMENTS,
        NESTED,
        plan(RecomputeSub(0, ("blocks.0.attn", "blocks.0.mlp")), *(Keep(i) for i in range(1, 8))),
    ],
)
def test_the_compact_form_reads_back(p: Plan) -> None:
    assert ops_from_text(p.describe()) == p.ops


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("K0 X1", r"cannot read 'X1' at position 3 of 'K0 X1'; expected K<i>"),
        ("K0 R[1:3](K1 K2", r"leaves R\[1:3\]\( unclosed"),
        ("K0)", r"'\)' at position 2 of 'K0\)' closes no R\[a:b\]"),
    ],
)
def test_bad_compact_text_names_the_position(text: str, message: str) -> None:
    with pytest.raises(RematError, match=message):
        ops_from_text(text)


def test_spans_of_other_names() -> None:
    groups = tuple(
        Block(index=i, fqns=(f"layer{i}a", f"layer{i}b"), type_hint=LayerType.OTHER, class_name="X") for i in range(3)
    )
    p = Plan(strategy="named", blocks=groups, ops=(Recompute(0, 3, (Keep(0), Keep(1), Keep(2))),))
    assert p.span((0, 1, 2)) == "layer0a..layer0b – layer2a..layer2b"
    thirteen = Plan(strategy="none", blocks=blocks(13), ops=tuple(Keep(i) for i in range(13)))
    assert thirteen.span((10, 11, 12)) == "blocks.10–12" and thirteen.span((9,)) == "blocks.9"


def render(renderable: object) -> str:
    console = Console(width=100, record=True, force_terminal=False)
    console.print(renderable)
    return console.export_text()


def test_the_terminal_tree_and_table_use_the_same_words() -> None:
    tree = render(plan_tree(SEGMENTS))
    assert tree.splitlines()[:2] == ["optimal", SEGMENTS.headline()]
    assert re.search(r"blocks\.1–2\s+recomputed as one segment", tree)
    assert "keep blocks" not in tree and "8/8" not in tree
    nested = render(plan_tree(NESTED)).splitlines()
    assert re.search(r"│   ├── blocks\.1–2\s+recomputed twice, as one nested segment", nested[4])
    table = render(plans_table([plan(*(Keep(i) for i in range(8)), strategy="none"), MOSTLY_SUBS, NESTED]))
    assert (
        re.search(r"none\s+0\s", table)
        and re.search(r"optimal\s+3 \+ 5 part\s", table)
        and re.search(r"optimal\s+8\s", table)
    )
    assert "kept with a part recomputed: their attention or MLP" in " ".join(table.split())


def test_one_walk_classifies_blocks_for_every_reader() -> None:
    # block_fates is the walk that classifies; checkpointed, depth, the headline's segment count and the
    # heatmap's checkpoint edges all read it (Plan.lines is the one that renders).
    assert [f.op for f in SEGMENTS.fates()] == [0, 1, 1, 2, 2, 3, 4, 5]
    assert SEGMENTS.checkpointed == (0, 1, 2, 3, 4, 6) and SEGMENTS.depth == 1
    assert MOSTLY_SUBS.checkpointed == tuple(range(8)) and MOSTLY_SUBS.depth == 1
    assert NESTED.depth == 2 and [f.op for f in NESTED.fates()] == [0, 0, 0, 0, 1, 1, 1, 1]
    inside = plan(Recompute(0, 2, (Keep(0), attn(1))), *(Keep(i) for i in range(2, 8)))
    assert inside.depth == 2 and inside.checkpointed == (0, 1)  # a sub-module checkpointed again inside a segment
    assert plan(*(Keep(i) for i in range(8))).depth == 0 and plan(*(Keep(i) for i in range(8))).checkpointed == ()


def test_an_op_level_policy_is_a_block_kept_in_part() -> None:
    from remat.core.ops import RecomputeOps

    policy = RecomputeOps(2, save=("addmm#0", "addmm#1"), recompute=("gelu#0",))
    p = plan(own(0), attn(1), policy, *(Keep(i) for i in range(3, 8)))
    assert ops_from_text(p.describe()) == p.ops
    assert [(line.what, p.span(line.blocks)) for line in p.lines()] == [
        ("recomputed", "blocks.0"),
        ("kept, attention recomputed", "blocks.1"),
        ("kept, selected operations recomputed (gelu×1)", "blocks.2"),
        ("kept", "blocks.3–7"),
    ]
    assert p.headline() == "8 blocks: 1 recomputed, 2 kept with their parts recomputed, 5 kept"
    assert p.fates()[2].fate is Fate.PART and p.fates()[2].op_level and p.checkpointed == (0, 1, 2) and p.depth == 1
    assert recomputed_cell(p.fates()) == "1 + 2 part"
    # The tables' note says what a 'part' is: an op-level policy's block counts as one too.
    assert "attention or MLP, or selected operations under an op-level policy ('part')" in RECOMPUTED_NOTE
    alone = plan(Keep(0), Keep(1), policy, *(Keep(i) for i in range(3, 8)))
    assert "1 kept with its selected operations recomputed" in alone.headline()
