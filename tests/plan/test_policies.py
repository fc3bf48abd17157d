"""remat.plan.policies: the exact menu against brute force, greedy options undominated, validation, text."""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from dataclasses import dataclass

import pytest

from remat.errors import RematError
from remat.models import workload
from remat.plan.policies import OpPolicy, make_policy, policy_menu, validate_policy
from remat.profile.ops import BlockOps, OpRecord, profile_ops

# --- synthetic blocks -------------------------------------------------------------------------------


@dataclass
class Spec:
    """One op of a synthetic block. ``kind``: fresh (allocates), view or inplace (of op ``on``)."""

    name: str
    kind: str = "fresh"
    ms: float = 1.0
    out_bytes: int = 0
    saved: int = 0
    reads: tuple[int, ...] = ()
    on: int = -1
    random: bool = False


def build(specs: list[Spec], *, stop: int | None = None, input_saved: int = 0) -> BlockOps:
    ops: list[OpRecord] = []
    seen: Counter[str] = Counter()
    for i, s in enumerate(specs):
        key = f"{s.name}#{seen[s.name]}"
        seen[s.name] += 1
        storages: tuple[int, ...]
        writes: tuple[int, ...]
        if s.kind == "fresh":
            storages, writes, out, saved = (i,), (), s.out_bytes, s.saved
        else:
            storages = ops[s.on].storages
            writes = storages if s.kind == "inplace" else ()
            out, saved = 0, 0
        reads = s.reads if s.kind == "fresh" else (s.on, *s.reads)
        ops.append(OpRecord(i, key, s.name, s.ms, out, saved, reads, storages, writes, s.random, s.kind == "view"))
    return BlockOps(
        block=0,
        name="layers.0",
        ops=tuple(ops),
        saved_bytes=sum(op.saved_bytes for op in ops) + input_saved,
        input_saved_bytes=input_saved,
        stop=len(ops) if stop is None else stop,
    )


def random_block(seed: int) -> BlockOps:
    """A random block where every op that allocates has its output saved (so every cacheable op is a candidate)."""
    rng = random.Random(seed)
    n = rng.randint(5, 11)
    specs: list[Spec] = []
    for i in range(n):
        kind = "fresh" if i == 0 else rng.choices(["fresh", "view", "inplace"], weights=[6, 1, 1])[0]
        reads = tuple(sorted(set(rng.sample(range(i), min(i, rng.randint(1, 2)))))) if i else ()
        ms = rng.choice([0.25, 0.5, 1.0, 2.0, 4.0])
        is_random = rng.random() < 0.2
        if kind == "fresh":
            nbytes = rng.choice([256, 512, 1024, 4096])
            specs.append(
                Spec(rng.choice(["addmm", "gelu", "mul"]), "fresh", ms, nbytes, nbytes, reads, random=is_random)
            )
            if is_random:
                specs[-1].name = "native_dropout"
        else:
            on = rng.randrange(i)
            name = "bernoulli_" if kind == "inplace" and is_random else ("div_" if kind == "inplace" else "view")
            specs.append(Spec(name, kind, ms, reads=(), on=on, random=kind == "inplace" and is_random))
    return build(specs, stop=rng.randint(n - 2, n), input_saved=128)


def brute_force_front(b: BlockOps) -> set[tuple[int, float]]:
    """The Pareto set over every subset of the block's ops that torch can cache, by the rules themselves."""
    ops = b.ops
    mutated_later = {w for op in ops for w in op.writes if w >= 0 and op.index > w}
    cacheable = [
        op.index
        for op in ops
        if op.index < b.stop
        and op.storages == (op.index,)
        and not op.view
        and not any(w >= 0 for w in op.writes)
        and op.index not in mutated_later
    ]
    randoms = [op.index for op in ops[: b.stop] if op.random]
    points = []
    for k in range(len(cacheable) + 1):
        for subset in itertools.combinations(cacheable, k):
            s = set(subset)
            cached_random = [r for r in randoms if r in s]
            if cached_random and any(r not in s for r in randoms if r > cached_random[0]):
                continue
            held = sum(ops[i].out_bytes for i in s)
            ms = sum(op.ms for op in ops[: b.stop] if op.index not in s)
            points.append((held, round(ms, 9)))
    keep = (b.own_saved_bytes, 0.0)
    nothing = (0, round(sum(op.ms for op in ops[: b.stop]), 9))
    front = {p for p in points if not any(q[0] <= p[0] and q[1] <= p[1] and q != p for q in [*points, keep, nothing])}
    return front - {keep, nothing}


def points(menu: tuple[OpPolicy, ...]) -> set[tuple[int, float]]:
    return {(p.held_bytes, round(p.recompute_ms, 9)) for p in menu}


def dominated(p: OpPolicy, others: tuple[OpPolicy, ...]) -> bool:
    return any(
        q.held_bytes <= p.held_bytes
        and q.recompute_ms <= p.recompute_ms
        and (q.held_bytes, q.recompute_ms) != (p.held_bytes, p.recompute_ms)
        for q in others
    )


# --- the menu ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_exact_menu_is_the_brute_force_pareto_set(seed: int) -> None:
    b = random_block(seed)
    menu = policy_menu(b, exact_limit=64, max_options=10**6)
    assert points(menu) == brute_force_front(b)
    for p in menu:
        validate_policy(b, p)
        assert 0 < p.held_bytes < b.own_saved_bytes and p.freed_bytes == b.own_saved_bytes - p.held_bytes
    assert [p.held_bytes for p in menu] == sorted((p.held_bytes for p in menu), reverse=True)


def test_the_random_blocks_exercise_the_rules() -> None:
    # Without these the brute-force test could pass on blocks where no rule bites.
    blocks = [random_block(seed) for seed in range(40)]
    assert sum(any(op.random and op.storages == (op.index,) for op in b.ops) for b in blocks) >= 5
    assert sum(any(op.writes for op in b.ops) for b in blocks) >= 5
    assert sum(len(brute_force_front(b)) >= 3 for b in blocks) >= 20


@pytest.mark.parametrize("seed", range(40))
def test_greedy_options_are_undominated_and_valid(seed: int) -> None:
    b = random_block(seed)
    greedy = policy_menu(b, exact_limit=0, max_options=10**6)
    exact = policy_menu(b, exact_limit=64, max_options=10**6)
    for p in greedy:
        validate_policy(b, p)
        assert not dominated(p, greedy)
        assert 0 < p.held_bytes < b.own_saved_bytes  # the ends beat nothing on the menu
        # Greedy is never better than the exact trade-off.
        assert any(q.held_bytes <= p.held_bytes and q.recompute_ms <= p.recompute_ms + 1e-9 for q in exact)


def test_a_small_menu_keeps_both_ends_of_the_trade_off() -> None:
    b = next(b for b in map(random_block, range(100)) if len(brute_force_front(b)) >= 5)
    full = policy_menu(b, exact_limit=64, max_options=10**6)
    small = policy_menu(b, exact_limit=64, max_options=3)
    assert len(small) == 3 and points(small) <= points(full)
    assert small[0] == full[0] and small[-1] == full[-1]
    with pytest.raises(RematError, match="max_options=0"):
        policy_menu(b, max_options=0)


def test_a_cheap_saved_op_is_recomputed_from_its_cached_producer() -> None:
    # addmm (4 ms, 500 B, not saved) feeds mul (0.1 ms, 1000 B saved). Caching addmm only is the one
    # option between keeping (1000 B) and recomputing all (4.1 ms); cos, read by nothing saved, is no candidate.
    b = build(
        [
            Spec("cos", ms=3.0, out_bytes=100),
            Spec("addmm", ms=4.0, out_bytes=500),
            Spec("mul", ms=0.1, out_bytes=1000, saved=1000, reads=(1,)),
        ]
    )
    (only,) = policy_menu(b)
    assert only.save == ("addmm#0",) and only.recompute == ("cos#0", "mul#0")
    assert (only.held_bytes, only.freed_bytes, only.recompute_ms) == (500, 500, pytest.approx(3.1))
    assert only.freed == ("mul#0",)


def test_nothing_to_choose_gives_an_empty_menu() -> None:
    b = build([Spec("addmm", ms=1.0, out_bytes=100, saved=100)], stop=0)  # nothing saved runs again
    assert policy_menu(b) == ()


# --- validation -------------------------------------------------------------------------------------


def mlp_block() -> BlockOps:
    """LayerNorm, Linear, GELU, Linear, dropout (as on CPU), residual add, LayerNorm, dropout."""
    return build(
        [
            Spec("native_layer_norm", ms=0.2, out_bytes=1040, saved=1040),  # 0
            Spec("addmm", ms=2.0, out_bytes=4096, saved=4096, reads=(0,)),  # 1
            Spec("gelu", ms=0.5, out_bytes=4096, saved=4096, reads=(1,)),  # 2
            Spec("addmm", ms=2.0, out_bytes=1024, reads=(2,)),  # 3
            Spec("empty_like", ms=0.01, out_bytes=1024, saved=1024, reads=(3,)),  # 4
            Spec("bernoulli_", "inplace", ms=0.1, on=4, random=True),  # 5
            Spec("div_", "inplace", ms=0.05, on=5),  # 6
            Spec("mul", ms=0.05, out_bytes=1024, reads=(3, 6)),  # 7
            Spec("add", ms=0.05, out_bytes=1024, saved=1024, reads=(7,)),  # 8
            Spec("native_layer_norm", ms=0.2, out_bytes=1040, saved=1040, reads=(8,)),  # 9
            Spec("empty_like", ms=0.01, out_bytes=1040, saved=1040, reads=(9,)),  # 10
            Spec("bernoulli_", "inplace", ms=0.1, on=10, random=True),  # 11
            Spec("div_", "inplace", ms=0.05, on=11),  # 12
            Spec("mul", ms=0.05, out_bytes=1040, reads=(9, 12)),  # 13
        ],
        stop=13,
    )


def test_describe_counts_the_recomputed_saved_outputs_by_name() -> None:
    p = make_policy(mlp_block(), ["addmm#0", "add#0"])
    # Dropout masks are named after the random op that filled them.
    assert p.freed == ("native_layer_norm#0", "gelu#0", "bernoulli_#0", "native_layer_norm#1", "bernoulli_#1")
    assert p.describe() == "recompute layer_norm×2, gelu×1, bernoulli×2"
    assert p.held_bytes == 4096 + 1024 and p.recompute_ms == pytest.approx(
        sum(op.ms for op in mlp_block().ops[:13]) - 2.05
    )
    assert OpPolicy.from_json(json.loads(json.dumps(p.to_json()))) == p


def test_validate_refuses_a_recomputed_op_whose_input_is_gone() -> None:
    b = mlp_block()
    # gelu is recomputed but addmm#0, which it reads, is neither cached nor recomputed.
    bad = OpPolicy(
        save=("native_layer_norm#0",), recompute=("gelu#0",), held_bytes=1040, freed_bytes=0, recompute_ms=0.5
    )
    with pytest.raises(
        RematError,
        match=r"recomputed op 'gelu#0' of block 0 \(layers.0\) reads the output of 'addmm#0', which is neither cached nor recomputed",
    ):
        validate_policy(b, bad)
    validate_policy(b, make_policy(b, ["addmm#0"]))


@pytest.mark.parametrize(
    ("save", "match"),
    [
        (["conv#0"], r"cached op 'conv#0' is not in block 0 \(layers.0\), whose ops are native_layer_norm#0, addmm#0"),
        (["div_#0"], r"cached op 'div_#0' .* is a view or in-place op \(its output is the storage of 'empty_like#0'\)"),
        (["empty_like#0"], r"cached op 'empty_like#0' .* mutated in place"),
    ],
)
def test_validate_refuses_what_torch_cannot_cache(save: list[str], match: str) -> None:
    b = mlp_block()
    with pytest.raises(RematError, match=match):
        validate_policy(b, OpPolicy(tuple(save), (), 0, 0, 0.0))


def test_validate_refuses_a_random_op_recomputed_after_a_cached_one() -> None:
    b = build(
        [
            Spec("native_dropout", ms=0.1, out_bytes=100, saved=100, random=True),
            Spec("mul", ms=0.1, out_bytes=100, saved=100, reads=(0,)),
            Spec("native_dropout", ms=0.1, out_bytes=100, saved=100, reads=(1,), random=True),
            Spec("mul", ms=0.1, out_bytes=100, reads=(2,)),
        ],
        stop=3,
    )
    with pytest.raises(
        RematError, match="random op 'native_dropout#1' .* is recomputed after the cached random op 'native_dropout#0'"
    ):
        validate_policy(b, make_policy(b, ["native_dropout#0"]))
    validate_policy(b, make_policy(b, ["native_dropout#1"]))
    validate_policy(b, make_policy(b, ["native_dropout#0", "native_dropout#1"]))
    # The menu never proposes the first one alone.
    assert all(p.save != ("native_dropout#0",) for p in policy_menu(b, max_options=100))


def test_menu_policies_of_a_real_gpt_block_validate() -> None:
    w = workload("gpt", n_layers=2, d_model=32, n_heads=2, seq_len=16, batch=2, vocab_size=64, dropout=0.1)
    import remat

    for b in profile_ops(w.model, w.inputs, w.loss_fn, remat.blocks(w.model), rounds=1):
        for exact_limit in (0, 64):
            menu = policy_menu(b, exact_limit=exact_limit)
            assert 1 <= len(menu) <= 6
            for p in menu:
                validate_policy(b, p)
                assert "recompute " in p.describe()


def test_a_replay_holds_every_cached_output_from_its_start_where_the_forward_peaked_before_them() -> None:
    # NOTE [ Replays of op-level policies ]: a temporary made first (freed before op 2 ran), then the cached
    # addmm. The forward peaks at 110 bytes (temporary + sum) before the addmm exists; the replay holds the
    # cached 40 bytes from its start, so it rises 110 above the backward's level (which holds those 40),
    # where "forward peak less the cached outputs" gave 70 (LongT5, Hiera: 1.05-1.07x their budget).
    from remat.plan.policies import _alive, _replay_rise

    ops = (
        OpRecord(0, "mul#0", "mul", 0.1, 100, 0, (), (0,), freed=2),
        OpRecord(1, "sum#0", "sum", 0.1, 10, 10, (0,), (1,)),
        OpRecord(2, "addmm#0", "addmm", 1.0, 40, 40, (1,), (2,)),
        OpRecord(3, "tanh#0", "tanh", 0.1, 40, 40, (2,), (3,)),
    )
    b = BlockOps(0, "b", ops, 90, 0, 4)
    live = _alive(b, range(4))
    assert live == [100, 110, 50, 90]  # the temporary is counted through op 1, the last op that ran before it died
    assert _replay_rise(b, live, {2}, 110) == 110  # the forward's peak at op 1, with the cached 40 held already
    assert _replay_rise(b, live, set(), 110) == 110
    assert _replay_rise(b, live, {2}, 160) == 110 + 50  # a measured peak above the storages' (a workspace)
