"""remat.plan.strategies: each seed strategy's selection and its validation."""

from __future__ import annotations

import math

import pytest

import remat
from remat.blocks import Block, LayerType
from remat.core.ops import Keep, Recompute, RecomputeSub
from remat.errors import RematError
from remat.plan.strategies import EXAMPLES, STRATEGIES, ByKind, Strategy, Target, bench_strategies, parse_strategy
from remat.profile.types import BlockProfile, Profile


def fake_blocks(n: int, mixed: bool = False) -> tuple[Block, ...]:
    hints = [LayerType.ATTENTION, LayerType.FFN]
    return tuple(
        Block(
            index=i,
            fqns=(f"layers.{i}",),
            type_hint=LayerType.OTHER if mixed else hints[i % 2],
            class_name="L",
            attention_fqns=(f"layers.{i}.attn",) if mixed else (),
            ffn_fqns=(f"layers.{i}.mlp",) if mixed else (),
        )
        for i in range(n)
    )


def fake_profile(saved: list[int], fwd_ms: list[float]) -> Profile:
    """A profile whose per-block sizes are chosen by the test (strategies read only these)."""
    n = len(saved)
    bps = tuple(
        BlockProfile(
            input_bytes=10,
            output_bytes=10,
            saved_bytes=s,
            keep_bytes=s + 10,
            fwd_peak_bytes=s + 10,
            bwd_peak_bytes=s,
            fwd_ms=f,
            bwd_ms=2 * f,
            fwd_flops=0,
            bwd_flops=0,
        )
        for s, f in zip(saved, fwd_ms)
    )
    return Profile(
        model="M",
        device="cpu",
        blocks=fake_blocks(n),
        block_profiles=bps,
        fingerprint="x",
        is_chain=True,
        held_bytes=0,
        peak_bytes=sum(saved),
        step_ms=1.0,
        base_bytes=10,
        pre_peak_bytes=10,
        head_input_bytes=10,
        head_peak_bytes=10,
        head_ms=0.1,
        tail_peak_bytes=0,
    )


B8 = fake_blocks(8)


def checkpointed(strategy: Strategy, blocks: tuple[Block, ...], profile: Profile | None = None) -> tuple[int, ...]:
    """The blocks a strategy checkpoints, read from its plan."""
    return remat.plan(profile if profile is not None else blocks, strategy=strategy).checkpointed


def test_none_full_every_nth_selective_ratio() -> None:
    assert checkpointed(remat.none(), B8) == ()
    assert checkpointed(remat.full(), B8) == tuple(range(8))
    assert checkpointed(remat.every_nth(3), B8) == (0, 3, 6)
    assert checkpointed(remat.every_nth(1), B8) == tuple(range(8))
    assert checkpointed(remat.selective([5, 1]), B8) == (1, 5)
    chosen = remat.plan(B8, strategy=remat.selective([5, 1]))
    assert chosen.should_checkpoint(5) and not chosen.should_checkpoint(2)
    # The seed's ratio: round(r * n) blocks, every round(n / count)-th.
    assert checkpointed(remat.ratio(0.5), B8) == (0, 2, 4, 6)
    assert checkpointed(remat.ratio(0.25), B8) == (0, 4)
    assert checkpointed(remat.ratio(0.0), B8) == ()
    assert checkpointed(remat.ratio(1.0), B8) == tuple(range(8))


def test_segments_and_sqrt_follow_checkpoint_sequential() -> None:
    ops = remat.segments(3).ops(Target(B8))
    # 8 blocks in 3 segments of 3, 3, 2: the first two checkpointed, the last kept.
    assert ops == (
        Recompute(0, 3, (Keep(0), Keep(1), Keep(2))),
        Recompute(3, 6, (Keep(3), Keep(4), Keep(5))),
        Keep(6),
        Keep(7),
    )
    blocks16 = fake_blocks(16)
    k = round(math.sqrt(16))
    assert remat.sqrt().ops(Target(blocks16)) == remat.segments(k).ops(Target(blocks16))
    assert checkpointed(remat.sqrt(), blocks16) == tuple(range(12))


def test_attention_and_ffn_only() -> None:
    # Blocks that are attention (even) or FFN (odd) as a whole.
    assert checkpointed(remat.attention_only(), B8) == (0, 2, 4, 6)
    assert checkpointed(remat.ffn_only(), B8) == (1, 3, 5, 7)
    assert checkpointed(remat.attention_only(min_interval=4), B8) == (0, 4)
    # Mixed blocks (transformer layers): the sub-module inside each block.
    mixed = fake_blocks(4, mixed=True)
    assert remat.attention_only().ops(Target(mixed)) == tuple(RecomputeSub(i, (f"layers.{i}.attn",)) for i in range(4))
    assert remat.ffn_only(min_interval=2).ops(Target(mixed)) == (
        RecomputeSub(0, ("layers.0.mlp",)),
        Keep(1),
        RecomputeSub(2, ("layers.2.mlp",)),
        Keep(3),
    )


def test_sized_strategies_read_the_profile() -> None:
    saved = [5, 50, 20, 80, 10, 40]
    fwd = [1.0, 10.0, 1.0, 2.0, 1.0, 1.0]
    prof = fake_profile(saved, fwd)
    blocks = prof.blocks
    assert checkpointed(remat.largest(2), blocks, prof) == (1, 3)
    assert checkpointed(remat.largest(0), blocks, prof) == ()
    # Greedy by saved bytes per recompute ms: 80/2=40, 40/1=40, 20/1=20, 10/1, 5/1, 50/10 ...
    # total 205; need <= 100: take 3 (->125), then 5 (->85).
    assert checkpointed(remat.budget(100), blocks, prof) == (3, 5)
    assert checkpointed(remat.budget(1000), blocks, prof) == ()
    assert checkpointed(remat.budget("0"), blocks, prof) == tuple(range(6))
    # dynamic: the largest interval k whose retained bytes (kept blocks' keep_bytes + checkpointed
    # blocks' outputs, 10 each) are within the share of keeping everything (265).
    retained = {k: sum(10 if i % k == 0 else s + 10 for i, s in enumerate(saved)) for k in range(1, 7)}
    for fraction in (0.3, 0.8, 0.9):
        fitting = [k for k in range(1, 7) if retained[k] <= fraction * 265]
        expected = tuple(range(0, 6, max(fitting))) if fitting else tuple(range(6))
        assert checkpointed(remat.dynamic(fraction), blocks, prof) == expected
    assert retained[3] == 180 and checkpointed(remat.dynamic(0.8), blocks, prof) == (0, 3)
    assert checkpointed(remat.dynamic(0.8, min_interval=4), blocks, prof) == (0, 4)  # 250 > 212: falls to min_interval
    assert checkpointed(remat.dynamic(1.0), blocks, prof) == ()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: remat.every_nth(0), r"every_nth: n=0 is invalid; it must be an integer >= 1"),
        (lambda: remat.selective([1, 2, 1]), r"selective: duplicate indices \[1\]"),
        (lambda: remat.selective([-1]), r"selective: indices \[-1\] are negative"),
        (lambda: remat.dynamic(1.5), r"dynamic: memory_fraction=1.5 is outside \[0, 1\]"),
        (lambda: remat.dynamic(-0.1), r"dynamic: memory_fraction=-0.1 is outside \[0, 1\]"),
        (lambda: remat.dynamic(0.5, min_interval=0), r"dynamic: min_interval=0 is invalid"),
        (lambda: remat.ratio(1.5), r"ratio: checkpoint_ratio=1.5 is outside \[0, 1\]"),
        (lambda: remat.budget(-1), r"budget: max_bytes=-1 is negative"),
        (lambda: remat.budget("-5MiB"), r"negative"),
        (lambda: remat.largest(-1), r"largest: top_k=-1 is invalid; it must be an integer >= 0"),
        (lambda: remat.segments(0), r"segments: k=0 is invalid"),
        (lambda: remat.attention_only(min_interval=0), r"attention_only: min_interval=0 is invalid"),
        (lambda: remat.named([]), r"named: groups=\(\) must be a non-empty list"),
    ],
)
def test_bad_parameters_are_rejected_with_the_value_and_range(make: object, match: str) -> None:
    with pytest.raises(RematError, match=match):
        make()  # type: ignore[operator]


def test_errors_that_need_the_block_count() -> None:
    prof = fake_profile([1, 2, 3], [1.0, 1.0, 1.0])
    with pytest.raises(RematError, match=r"indices \[9\] are out of range for 3 blocks \(valid 0..2\)"):
        checkpointed(remat.selective([9]), prof.blocks)
    with pytest.raises(RematError, match=r"top_k=4 exceeds the 3 blocks"):
        checkpointed(remat.largest(4), prof.blocks, prof)
    with pytest.raises(RematError, match=r"segments: k=4 exceeds the 3 blocks"):
        remat.segments(4).ops(Target(prof.blocks))
    with pytest.raises(RematError, match=r"largest: needs measured block sizes; pass profile=remat.profile"):
        remat.largest(1).ops(Target(prof.blocks))


def test_summaries_and_labels() -> None:
    assert remat.every_nth(2).label == "every_nth(n=2)"
    assert "uniform interval" in remat.every_nth(2).summary()
    # Every registered strategy's instances carry its registry name.
    made = [*bench_strategies(B8, fake_profile([1] * 8, [1.0] * 8)), remat.named([["layers.0"]])]
    assert [s.name for s in made] == list(STRATEGIES)
    assert all(isinstance(s, Strategy) for s in made)
    assert remat.budget("1KiB").max_bytes == 1024


def test_parse_strategy() -> None:
    assert parse_strategy("every_nth(2)") == remat.every_nth(2)
    assert parse_strategy("selective([0, 3])") == remat.selective([0, 3])
    assert parse_strategy("budget('1KiB')") == remat.budget(1024)
    assert parse_strategy("attention_only(min_interval=2)") == remat.attention_only(min_interval=2)
    assert parse_strategy(" full ") == remat.full()
    with pytest.raises(
        RematError, match=r"unknown 'everynth'; did you mean 'every_nth'\? valid strategies are none, full, every_nth"
    ):
        parse_strategy("everynth(2)")
    with pytest.raises(RematError, match=r"does not match every_nth\(n\)"):
        parse_strategy("every_nth(1, 2)")
    with pytest.raises(RematError, match="n=0 is invalid"):
        parse_strategy("every_nth(0)")


def test_a_text_that_does_not_fit_its_strategy_gets_an_example() -> None:
    with pytest.raises(
        RematError,
        match=r"strategy: 'selective\(0,2\)' does not match selective\(indices\); write e.g. selective\(\[0, 2\]\)",
    ):
        parse_strategy("selective(0,2)")
    with pytest.raises(RematError, match=r"'every_nth' does not match every_nth\(n\); write e.g. every_nth\(2\)$"):
        parse_strategy("every_nth")
    # Every example is a well-formed text of a registered strategy, and every strategy with a required
    # parameter has one.
    for name, text in EXAMPLES.items():
        assert parse_strategy(text).name == name
    for name in STRATEGIES:
        if name not in EXAMPLES:
            parse_strategy(name)


def test_attention_or_ffn_strategy_that_finds_nothing_says_so() -> None:
    from torch import nn

    model = nn.Sequential(*[nn.Sequential(nn.Conv2d(4, 4, 3), nn.ReLU()) for _ in range(3)])
    blocks = remat.blocks(model)
    with pytest.raises(
        RematError, match=r"strategy attention_only: found no attention block or sub-module in the 3 blocks"
    ):
        remat.apply(model, remat.attention_only(), blocks=blocks)


def test_plan_takes_a_strategy_as_text_on_a_profile_blocks_or_a_model() -> None:
    from torch import nn

    prof = fake_profile([5, 50, 20, 80], [1.0, 2.0, 1.0, 2.0])
    # Text is read as the command line's --strategy: the same plan as the strategy object.
    assert remat.plan(prof, strategy="full") == remat.plan(prof, strategy=remat.full())
    assert remat.plan(prof, strategy="full").ops == remat.full().ops(Target(prof.blocks, prof))
    assert remat.plan(prof, strategy="largest(top_k=2)").checkpointed == (1, 3)
    on_blocks = remat.plan(B8, strategy="every_nth(2)")
    assert on_blocks.ops == remat.every_nth(2).ops(Target(B8)) and on_blocks.checkpointed == (0, 2, 4, 6)
    assert on_blocks.strategy == "every_nth(n=2)" and on_blocks.predicted_peak_bytes is None
    # On a model: its remat.blocks, and named finds its own blocks there.
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(4)])
    on_model = remat.plan(model, strategy=remat.segments(2))
    assert on_model.blocks == remat.blocks(model) and on_model.ops == remat.segments(2).ops(Target(on_model.blocks))
    assert on_model.fingerprint is not None
    grouped = remat.plan(model, strategy=remat.named([["0", "1"]]))
    assert [b.fqns for b in grouped.blocks] == [("0", "1")] and grouped.checkpointed == (0,)
    with pytest.raises(
        RematError, match=r"strategy: unknown 'everynth'; did you mean 'every_nth'\? valid strategies are none, full"
    ):
        remat.plan(B8, strategy="everynth(2)")
    with pytest.raises(RematError, match=r"strategy: unknown 'zzz'; valid strategies are none, full"):
        remat.plan(B8, strategy="zzz")  # nothing close: no suggestion


@pytest.mark.parametrize("sized", ["largest(1)", "budget('1KiB')", "dynamic(0.5)"])
def test_a_strategy_that_reads_sizes_needs_a_profile(sized: str) -> None:
    from torch import nn

    name = sized.partition("(")[0]
    with pytest.raises(
        RematError,
        match=rf"plan: strategy {name} needs measured block sizes, not in the 8 blocks; pass a profile instead",
    ):
        remat.plan(B8, strategy=sized)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)])
    with pytest.raises(RematError, match=rf"plan: strategy {name} needs measured block sizes, not in the model"):
        remat.plan(model, strategy=parse_strategy(sized))


def test_plan_without_a_profile_refuses_budgets_and_other_sources() -> None:
    with pytest.raises(RematError, match=r"plan: a budget needs measured sizes, not in the 8 blocks"):
        remat.plan(B8, "50%")
    with pytest.raises(RematError, match=r"plan: a budget needs measured sizes"):
        remat.plan(B8)
    with pytest.raises(RematError, match="not both"):
        remat.plan(B8, "50%", strategy="full")
    with pytest.raises(RematError, match=r"plan: strategy named finds its blocks in the model; pass the model"):
        remat.plan(B8, strategy=remat.named([["layers.0"]]))
    with pytest.raises(RematError, match=r"plan: source is a str; give a Profile"):
        remat.plan("model.pt", strategy="full")  # type: ignore[arg-type]
    with pytest.raises(RematError, match=r"plan: strategy is a Plan; give a strategy"):
        remat.plan(B8, strategy=remat.plan(B8, strategy="full"))  # type: ignore[arg-type]


def test_attention_only_and_ffn_only_are_one_rule_by_kind() -> None:
    assert remat.attention_only(min_interval=2) == ByKind(LayerType.ATTENTION, 2)
    assert remat.ffn_only() == ByKind(LayerType.FFN) and remat.ffn_only().name == "ffn_only"
    assert remat.ffn_only().label == "ffn_only(min_interval=1)"
    # The command line's forms: positional as well as by keyword.
    assert parse_strategy("ffn_only(2)") == parse_strategy("ffn_only(min_interval=2)") == remat.ffn_only(min_interval=2)
    with pytest.raises(
        RematError, match=r"kind=<LayerType.NORM: 'norm'> has no strategy; use one of LayerType.ATTENTION"
    ):
        ByKind(LayerType.NORM)


def test_every_strategy_name_is_public() -> None:
    # The registry is the one list of names: remat exports a constructor under each.
    assert set(STRATEGIES) <= set(remat.__all__)
    for name in STRATEGIES:
        assert callable(getattr(remat, name)), name
    assert remat.every_nth(2) == STRATEGIES["every_nth"](2) and remat.ffn_only() == STRATEGIES["ffn_only"]()


def test_the_registry_is_the_one_list_of_names(monkeypatch: pytest.MonkeyPatch) -> None:
    from remat.cli.common import strategies_help
    from remat.plan import strategies

    # A strategy registered under a new name is parsed, listed in messages and in the CLI's help.
    monkeypatch.setitem(strategies.STRATEGIES, "every_third", lambda: remat.every_nth(3))
    assert parse_strategy("every_third") == remat.every_nth(3)
    with pytest.raises(RematError, match=r"valid strategies are none, full, .*, named, every_third$"):
        parse_strategy("every_fourth")
    assert "every_third" in strategies_help() and "every_nth(n)" in strategies_help()
