"""Per-block menus of op-level selective recompute: which ops' outputs to cache, which to run again.

Between keeping a block (autograd holds everything it saves, nothing runs again) and recomputing it
whole (nothing held, its whole forward runs again) lie the selective policies: cache the outputs of a
set ``S`` of the block's ops, run the rest again in the backward. NOTE [ Selective recompute semantics ]
in ``remat.core.selective`` gives the costs this module models from a :class:`~remat.profile.ops.BlockOps`:

- held between forward and backward: the storages of ``S``'s outputs (``held_bytes``);
- recompute time: every op before torch's early stop that is not in ``S`` (``recompute_ms``);
- ``S`` must not hold a view or an in-place op, an op whose output a later op mutates, or a random op
  followed (before the early stop) by a random op that is recomputed (:func:`validate_policy`).

# NOTE [ The block's output is held anyway ]
A storage the block returns (``BlockOps.outputs``) outlives the block's forward whatever the policy:
the next block saves it as its input, or its checkpoint holds it, and the model may keep it longer (an
FPN's list of stage outputs, read again by its top-down path, ``pinned_out_bytes``). Recomputing the op
that made it frees nothing while those hold it, and replays a second copy in the backward; an FPN whose
stages each recomputed their closing ReLU measured 1.18x its prediction, the four stage outputs
(475,136 bytes) counted as freed yet alive at the peak in the head's backward. So the output's saved
storage is never counted as freed (``freed_bytes``), and the menu caches the op that made it wherever
torch can (it costs nothing more than keeping the block holds, and saves its recompute time).

Both costs add up over ``S``, so choosing ``S`` is a two-objective 0/1 knapsack. :func:`policy_menu`
returns a few of its Pareto-optimal policies (held bytes down, recompute time up), found exactly over
the candidate ops when they are few and greedily otherwise. The trivial ends are left out: caching
nothing is recomputing the block whole, and a policy holding as much as keeping the block is worse
than keeping it; the planner has both already.

``recompute_ms`` counts the ops' own times. Torch's selective checkpoint also costs a fixed amount
per op of the block whatever the policy, forward and recompute alike (its Python dispatch mode asks
the policy, caches or looks up every op): tens of microseconds per op on CPU, several times a small
block's forward; like a checkpoint's overhead it is to be measured, not modelled here.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from remat._json import Reader
from remat.core.ops import RecomputeOps
from remat.core.selective import ops_in_words
from remat.errors import RematError
from remat.profile.ops import EXTERNAL, BlockOps
from remat.profile.types import Profile

__all__ = ["OpPolicy", "make_policy", "op_costs", "policy_menu", "validate_policy"]


@dataclass(frozen=True)
class OpPolicy:
    """One selective-recompute policy for a block.

    Attributes:
        save: Keys of the ops whose outputs are cached in the forward (``MUST_SAVE``), in forward order.
        recompute: Keys of the ops that run again in the backward (every op before the early stop that is
            not cached), in forward order.
        held_bytes: Bytes the cached outputs hold between forward and backward (unique storages).
        freed_bytes: Bytes held less than keeping the block: what autograd saves of the block's own
            storages, less ``held_bytes``, less what it saves of the block's outputs that are not cached
            (alive anyway: NOTE [ The block's output is held anyway ]).
        recompute_ms: Time of the ops in ``recompute``, milliseconds.
        freed: Keys of the ops whose saved outputs are recomputed rather than held (what :meth:`describe`
            counts): the op that allocated the storage, or the random op that filled it in place
            (``bernoulli`` for a dropout mask on CPU).
    """

    save: tuple[str, ...]
    recompute: tuple[str, ...]
    held_bytes: int
    freed_bytes: int
    recompute_ms: float
    freed: tuple[str, ...] = ()

    def describe(self) -> str:
        """What the policy recomputes, by op name in forward order, e.g. ``"recompute layer_norm×2, gelu×1, bernoulli×2"``.

        Counts the ops in :attr:`freed` by name, without aten's ``native_`` prefix and underscores
        (``native_layer_norm`` -> ``layer_norm``, ``bernoulli_`` -> ``bernoulli``).
        """
        if not self.freed:
            return "recompute nothing autograd saves"
        return "recompute " + ops_in_words(self.freed)

    def to_json(self) -> dict[str, Any]:
        """The policy as plain JSON values."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, data: Any, reader: Reader | None = None, path: str = "policy") -> OpPolicy:
        """Inverse of :meth:`to_json`.

        Raises:
            RematError: If a field is missing or of the wrong type.
        """
        return (reader or Reader("policy")).build(cls, data, path)


def _mutated_later(b: BlockOps) -> list[bool]:
    """Whether a later op of the block writes into a storage the op allocated."""
    last_write = [-1] * len(b.ops)
    for op in b.ops:
        for w in op.writes:
            if w != EXTERNAL:
                last_write[w] = max(last_write[w], op.index)
    return [last_write[i] > i for i in range(len(b.ops))]


def _cacheable(b: BlockOps) -> list[bool]:
    """Whether each op may be cached, random ops' order aside (NOTE [ Selective recompute semantics ]);
    never a cast, which autocast's cache may skip in the recomputation (NOTE [ Autocast's cache in a
    policy's recomputation ] in ``remat.core.selective``), nor an op whose output the block returns
    unless autograd saves all of it (NOTE [ A returned output edited after the block ])."""
    later = _mutated_later(b)
    escapes = set(b.outputs) - set(_saved_outputs(b))
    return [
        op.index < b.stop
        and op.fresh
        and not op.view
        and op.name != "_to_copy"
        and all(w == EXTERNAL for w in op.writes)
        and not later[op.index]
        and op.index not in escapes
        for op in b.ops
    ]


# NOTE [ A returned output edited after the block ]
# The per-op profile sees the block's own in-place writes only. A tensor the block returns may be edited
# in place by the model's code after it (``y, e = block(x); y.mul_(0.5)``, a next layer's in-place
# activation on its input), which the plain step allows where autograd did not save that tensor. Cached,
# torch's selective checkpoint finds the edit in the backward and refuses ("Tensor cached during
# selective activation checkpoint has been mutated"): a plan of remat.plan failed in its first backward
# (helper-87). So the menu caches a returned output only where autograd saves all of it (a closing ReLU
# or tanh: NOTE [ The block's output is held anyway ]), where such an edit fails the plain step too.


def _random(b: BlockOps) -> list[int]:
    """The random ops that run again in a recompute, in forward order."""
    return [op.index for op in b.ops[: b.stop] if op.random]


def _saved_outputs(b: BlockOps) -> list[int]:
    """The ops that allocated a storage the block returns and autograd saves all of what they allocated
    (NOTE [ The block's output is held anyway ]): a ReLU or tanh closing the block, which saves its
    output. Not a LayerNorm, which saves only its statistics: recomputing it frees those, and caching
    it would hold its output too (a [Linear, GELU, LayerNorm] chain lost its cheapest policy)."""
    return sorted(i for i in set(b.outputs) if i != EXTERNAL and 0 < b.ops[i].out_bytes <= b.ops[i].saved_bytes)


def _forced(b: BlockOps) -> list[int]:
    """The block's saved outputs that every menu policy caches: those torch can cache, a random op only
    if every random op after it can be cached too (NOTE [ The block's output is held anyway ])."""
    ok = _cacheable(b)
    out = [i for i in _saved_outputs(b) if ok[i]]
    while out:
        # A cached random op must be followed by cached random ops only (NOTE [ Selective recompute semantics ]).
        barrier = max((r for r in _random(b) if r not in out), default=-1)
        bad = [i for i in out if b.ops[i].random and i < barrier]
        if not bad:
            break
        out = [i for i in out if i not in bad]
    return out


def _candidates(b: BlockOps) -> list[int]:
    """The ops worth caching: those whose outputs autograd saves and the producers of their inputs,
    if they can be cached, and a random op only if every random op after it can be cached too (the
    block's saved outputs aside: :func:`_forced`)."""
    ok = _cacheable(b)
    chosen: set[int] = set()
    writers: dict[int, list[int]] = {}
    for op in b.ops:
        for w in op.writes:
            if w != EXTERNAL:
                writers.setdefault(w, []).append(op.index)
    for op in b.ops:
        if op.saved_bytes <= 0:
            continue
        if ok[op.index]:
            chosen.add(op.index)
        for w in (op.index, *writers.get(op.index, ())):
            for r in b.ops[w].reads:
                chosen.update(s for s in b.ops[r].storages if s != EXTERNAL and ok[s])
    # A random op left to recompute must follow every cached one (else it draws other numbers).
    forced = set(_forced(b))
    chosen |= forced
    barrier = max((r for r in _random(b) if r not in chosen), default=-1)
    return sorted(i for i in chosen - forced if not (b.ops[i].random and i < barrier))


def _freed_key(b: BlockOps, alloc: int) -> str:
    for op in b.ops:
        if op.random and alloc in op.writes:
            return op.key
    return b.ops[alloc].key


def make_policy(block_ops: BlockOps, save: Iterable[str]) -> OpPolicy:
    """The policy that caches the outputs of the ops ``save`` and recomputes the rest, with its costs.

    Args:
        block_ops: The block's op profile.
        save: Keys of the ops to cache.

    Returns:
        The :class:`OpPolicy` (not validated: see :func:`validate_policy`).

    Raises:
        RematError: If a key is not an op of the block.
    """
    b = block_ops
    cached: set[int] = set()
    for key in save:
        i = b.index_of(key)
        if i is None:
            raise _not_in_block(b, key, "cached")
        cached.add(i)
    held_storages = {s for i in cached for s in b.ops[i].storages if s != EXTERNAL}
    held = sum(b.ops[s].out_bytes for s in held_storages)
    # NOTE [ The block's output is held anyway ]: recomputing it frees nothing; nor recomputing a cast that
    # autocast's cache holds (OpRecord.autocast_cached: a parameter's, 1.06-1.10x the budget before).
    alive = (set(_saved_outputs(b)) | {op.index for op in b.ops if op.autocast_cached}) - held_storages
    recompute = [op for op in b.ops[: b.stop] if op.index not in cached]
    freed = [
        _freed_key(b, op.index)
        for op in b.ops
        if op.saved_bytes > 0 and op.index not in held_storages and op.index not in alive
    ]
    return OpPolicy(
        save=tuple(b.ops[i].key for i in sorted(cached)),
        recompute=tuple(op.key for op in recompute),
        held_bytes=held,
        freed_bytes=b.own_saved_bytes - held - sum(b.ops[i].saved_bytes for i in alive),
        recompute_ms=math.fsum(op.ms for op in recompute),
        freed=tuple(freed),
    )


def _not_in_block(b: BlockOps, key: str, role: str) -> RematError:
    shown = ", ".join(op.key for op in b.ops[:6]) + (", ..." if len(b.ops) > 6 else "")
    return RematError(
        f"policy: {role} op {key!r} is not in block {b.block} ({b.name}), whose ops are {shown or 'none'}; "
        "make the policy from this block's profile (remat.profile.ops.profile_ops)"
    )


def validate_policy(block_ops: BlockOps, policy: OpPolicy) -> None:
    """Check that ``policy`` can run on the block and recompute what it did in the forward.

    Args:
        block_ops: The block's op profile.
        policy: The policy to check.

    Raises:
        RematError: If a cached or recomputed op is not in the block, an op is both, a cached op is a
            view or in-place op, writes into the block's tensors or has its output mutated by a later op,
            a random op is recomputed after a cached random op, or a recomputed op reads an op output that
            is neither cached nor recomputed.
    """
    b = block_ops
    save: dict[int, str] = {}
    for key in policy.save:
        i = b.index_of(key)
        if i is None:
            raise _not_in_block(b, key, "cached")
        save[i] = key
    recompute: dict[int, str] = {}
    for key in policy.recompute:
        i = b.index_of(key)
        if i is None:
            raise _not_in_block(b, key, "recomputed")
        if i in save:
            raise RematError(
                f"policy: op {key!r} of block {b.block} ({b.name}) is both cached and recomputed; list it in one of them"
            )
        recompute[i] = key
    later = _mutated_later(b)
    for i, key in save.items():
        op = b.ops[i]
        if not op.fresh or op.view:
            base = next((s for s in op.storages if s not in (EXTERNAL, i)), EXTERNAL)
            where = f"the storage of {b.ops[base].key!r}" if base != EXTERNAL else "a tensor from outside the block"
            raise RematError(
                f"policy: cached op {key!r} of block {b.block} ({b.name}) is a view or in-place op (its output is "
                f"{where}); cache the op that allocates it instead"
            )
        if any(w != EXTERNAL for w in op.writes) or later[i]:
            raise RematError(
                f"policy: cached op {key!r} of block {b.block} ({b.name}) has its output or input mutated in place "
                "inside the block, so its cached value would be stale; recompute it"
            )
    cached_random = [r for r in _random(b) if r in save]
    if cached_random:
        after = [r for r in _random(b) if r > cached_random[0] and r not in save]
        if after:
            raise RematError(
                f"policy: random op {b.ops[after[0]].key!r} of block {b.block} ({b.name}) is recomputed after the "
                f"cached random op {b.ops[cached_random[0]].key!r}, so the recompute would draw other numbers "
                "than the forward; cache it too or recompute both"
            )
    for i, key in recompute.items():
        for r in b.ops[i].reads:
            if r not in save and r not in recompute:
                raise RematError(
                    f"policy: recomputed op {key!r} of block {b.block} ({b.name}) reads the output of "
                    f"{b.ops[r].key!r}, which is neither cached nor recomputed; add it to one of them"
                )


# A point of the trade-off: (held bytes, recompute time in ns, cached op indices).
_Point = tuple[int, int, frozenset[int]]


def _ns(ms: float) -> int:
    # Integer nanoseconds make sums exact, so equal trade-offs compare equal.
    return round(ms * 1e6)


def _pareto(points: list[_Point]) -> list[_Point]:
    """The points no other point beats on both held bytes and recompute time (first of equals kept)."""
    order = sorted(range(len(points)), key=lambda k: (points[k][0], points[k][1], k))
    out: list[_Point] = []
    for k in order:
        if not out or points[k][1] < out[-1][1]:
            out.append(points[k])
    return out


def _base(b: BlockOps) -> _Point:
    """What every menu policy holds of the block's outputs, as a point (held, -time saved, cached ops):
    the forced ones cached, the saved outputs torch cannot cache alive anyway (NOTE [ The block's output
    is held anyway ])."""
    forced = _forced(b)
    alive = sum(b.ops[i].saved_bytes for i in _saved_outputs(b) if i not in forced)
    return (
        sum(b.ops[i].out_bytes for i in forced) + alive,
        -sum(_ns(b.ops[i].ms) for i in forced),
        frozenset(forced),
    )


def _exact(b: BlockOps, cands: list[int]) -> list[_Point]:
    """Every Pareto-optimal cached set over ``cands`` (a knapsack over the fronts of growing item sets)."""
    full = sum(_ns(op.ms) for op in b.ops[: b.stop])
    # Points as (held, -time saved) while building, so both go down.
    front: list[_Point] = [_base(b)]
    rand = [i for i in cands if b.ops[i].random]
    for i in cands:
        if i in rand:
            continue
        item = (b.ops[i].out_bytes, -_ns(b.ops[i].ms), frozenset({i}))
        front = _pareto(front + [(h + item[0], s + item[1], m | item[2]) for h, s, m in front])
    if rand:
        # The cached random ops are a suffix of them (NOTE [ Selective recompute semantics ]).
        suffixes = [rand[k:] for k in range(len(rand) + 1)]
        choices = [
            (sum(b.ops[i].out_bytes for i in sfx), -sum(_ns(b.ops[i].ms) for i in sfx), frozenset(sfx))
            for sfx in suffixes
        ]
        front = _pareto([(h + c[0], s + c[1], m | c[2]) for h, s, m in front for c in choices])
    return [(h, full + s, m) for h, s, m in front]


def _greedy(b: BlockOps, cands: list[int]) -> list[_Point]:
    """Cached sets from caching every candidate down to none, recomputing the most bytes per ms first."""
    full = sum(_ns(op.ms) for op in b.ops[: b.stop])
    base_bytes, base_ns, forced = _base(b)
    cached = set(cands)
    out: list[_Point] = []
    while True:
        out.append(
            (
                base_bytes + sum(b.ops[i].out_bytes for i in cached),
                full + base_ns - sum(_ns(b.ops[i].ms) for i in cached),
                frozenset(cached) | forced,
            )
        )
        if not cached:
            return out
        first_random = min((i for i in cached if b.ops[i].random), default=None)
        eligible = [i for i in sorted(cached) if not b.ops[i].random or i == first_random]
        best = max(eligible, key=lambda i: (b.ops[i].out_bytes / max(_ns(b.ops[i].ms), 1), -i))
        cached.remove(best)


def _spread(points: list[_Point], k: int, full_bytes: int, full_ns: int) -> list[_Point]:
    """``k`` of the points spread along the trade-off: both ends, then each farthest from those chosen."""
    if len(points) <= k:
        return points
    xs = [(h / max(full_bytes, 1), t / max(full_ns, 1)) for h, t, _ in points]
    chosen = [0, len(points) - 1][:k]
    while len(chosen) < k:
        dist = [min(math.dist(xs[j], xs[c]) for c in chosen) for j in range(len(points))]
        chosen.append(max(range(len(points)), key=lambda j: (dist[j], -j)))
    return [points[j] for j in sorted(chosen)]


def policy_menu(block_ops: BlockOps, *, exact_limit: int = 16, max_options: int = 6) -> tuple[OpPolicy, ...]:
    """A few Pareto-optimal selective policies for one block, from most held to least.

    The candidates are the ops whose outputs autograd saves and the ops producing their inputs, when
    they can be cached; every option caches the ops that made the block's saved outputs, where torch
    can (NOTE [ The block's output is held anyway ]). With at most ``exact_limit`` candidates the
    trade-off is exact (every subset is covered by a knapsack over Pareto fronts); with more, greedy:
    cache every candidate, then stop caching the op that frees the most bytes per ms of recompute, one
    at a time. Keeping the block and recomputing it whole are not on the menu, nor anything they beat.

    Args:
        block_ops: The block's op profile.
        exact_limit: Most candidates to search exactly, >= 0.
        max_options: Most policies to return, >= 1; when the trade-off has more points, both ends and
            the points farthest from those already chosen are returned.

    Returns:
        Policies ordered by ``held_bytes`` down (``recompute_ms`` up); empty when the block has nothing
        to choose (no candidate, or no option beats both ends).

    Raises:
        RematError: If ``exact_limit`` < 0 or ``max_options`` < 1.
    """
    if exact_limit < 0 or max_options < 1:
        raise RematError(f"policy_menu: exact_limit={exact_limit} must be >= 0 and max_options={max_options} >= 1")
    b = block_ops
    cands = _candidates(b)
    if not cands and not _forced(b):
        return ()
    points = _exact(b, cands) if len(cands) <= exact_limit else _greedy(b, cands)
    full_ns = sum(_ns(op.ms) for op in b.ops[: b.stop])
    keep: _Point = (b.own_saved_bytes, 0, frozenset({-1}))
    # Recomputing the block whole frees everything but its output (NOTE [ The block's output is held anyway ]).
    alive = sum(b.ops[i].saved_bytes for i in _saved_outputs(b))
    nothing: _Point = (alive, full_ns, frozenset())
    # The ends first, so an option only as good as one of them loses to it.
    front = [p for p in _pareto([keep, nothing, *points]) if p[2] and p is not keep]
    front = _spread(front, max_options, b.own_saved_bytes, full_ns)
    policies = [make_policy(b, (b.ops[i].key for i in m)) for _, _, m in front]
    return tuple(sorted(policies, key=lambda p: (-p.held_bytes, p.recompute_ms)))


def _held_inputs(profile: Profile, i: int) -> int:
    """Bytes of block ``i``'s inputs that its checkpoint holds to its backward but the plain step frees.

    The checkpoint keeps the block's arguments. A block that does not save its input itself (a cast
    first, under autocast) lets the plain step free it in the gap after the block (``x = block(x)``
    rebinding ``x``: a negative gap), and so an input made between blocks that it does not save
    (``unsaved_input_bytes``); a segment charges the same (NOTE [ Chain cost model ]). The last
    block's gap is the head's, so there the previous block's output that it does not save is charged.
    And an input from an earlier block that the plain step frees later in the forward (``late_inputs``).
    """
    bp = profile.block_profiles[i]
    # Of a negative gap, only the block's inputs that it does not save (the rest is freed anyway:
    # Chain.released_bytes); and the inputs the gap frees while it allocates as much (a gap of 0:
    # GPT-NeoX's attention output, dropped as ``x + a`` is made; BlockProfile.gap_freed_input_bytes).
    unsaved_inputs = max(0, bp.input_bytes - profile.block_ops[i].input_saved_bytes)
    held = min(max(0, -bp.gap_bytes, bp.gap_freed_input_bytes), unsaved_inputs) + bp.unsaved_input_bytes
    # And the inputs from before the block that the plain step frees in the forward after it (T5's position
    # bias, dropped when the stack returns: Profile.late_inputs, Chain.late_held_bytes).
    late = sum(li.nbytes for li in profile.late_inputs if li.producer < i < li.freed_after and i in li.users)
    if i == len(profile.block_profiles) - 1 and i > 0:
        unsaved = profile.block_profiles[i - 1].own_output_bytes - profile.block_ops[i].input_saved_bytes
        held = max(held, unsaved - late)  # the head frees it: a late input, if the profile found it
    return held + late


def _dead_saved_bytes(profile: Profile, i: int) -> int:
    """Bytes of block ``i``'s dead branches that ``chain_of`` frees right after it (``Chain.dead_branches``,
    ``BlockProfile.dead_saved_frees``): off its ``keep_bytes`` already, so no policy frees them again."""
    n = len(profile.block_profiles)
    return sum(
        size
        for after, size in profile.block_profiles[i].dead_saved_frees
        if size > 0 and i <= after < n and not (after == i and i < n - 1)
    )


# NOTE [ A policy's replay above the gap's frees ]
# ``BlockProfile.pending_grad_bytes`` and ``bwd_peak_bytes`` are both measured against the level at the end of
# the block's forward in the plain step, which still holds what the code after the block frees in its gap (its
# input, ``x = block(x)`` rebinding ``x``, where the block saves a copy of it instead: a Linear on a
# non-contiguous input saves the ``clone``). The simulator charges a block's backward from the level after that
# gap, so ``chain_of`` adds the freed bytes (``max(0, -gap_bytes)``) back to ``bwd_peak_bytes``; the replay of a
# policy, charged from the same level, needs them as much: the plain step's pending gradients net that free,
# and under the policy it does not happen where the checkpoint holds the input, or it lies under the chain's
# level already. Left out, fuzz seed 2047's O3{clone#0,_softmax#0|relu#0} (cache the closing ReLU, recompute
# the rest of Linear, softmax * d, ReLU) measured 1.055x its budget, 1.158x minimised: the block's input,
# 131,072 bytes, alive under the replay and charged nowhere (helper-96).


# NOTE [ Replays of op-level policies ]
# A policy's recomputation runs the block's forward again with every cached output held from its start,
# where the forward made them one by one. Its rise above the level of the backward (which holds the
# cached outputs) is therefore ``max over t of L(t) - C(t)``: ``L(t)`` the bytes of the storages the
# block's ops allocated that are alive after op ``t`` (``OpRecord.out_bytes`` and ``freed``, by the
# storages' lifetimes in the per-op profile), ``C(t)`` those of them that are cached, over the ops before
# the early stop; ``L(t)`` has op ``t``'s own temporaries on it where the replay runs it (``OpRecord.temp_bytes``,
# NOTE [ An op's own temporaries ] in ``remat.profile.ops``: a softmax's buffer, under the ``mul`` after it
# in the plain forward, tops a replay that caches that ``mul``); plus what the measured forward peak has
# above the highest of them (what the per-op record missed). Taking
# the forward peak less every cached output instead (its value at the block's end) was low for a block
# whose forward peaks before the op it caches (a temporary made early, LongT5's and Hiera's attention:
# 1.07-1.09x their budget, helper-45). Each storage is counted alive through the last op that ran
# before it died (``OpRecord.freed`` is the first op that ran without it): an input an op frees as it
# makes its output (``x = f(x)``: the old ``x`` dies when ``f`` returns) is counted through ``f``, where
# both exist; one that dies inside an op is recorded as alive through that op. Counting it through one
# op more (``freed + 1``) held every temporary one op too long: a policy's replay rise was one tensor
# high wherever the replay peaked right after a temporary died (a no_grad scale feeding a division:
# 0.88x its prediction, helper-87). Never below the old figure.
# A cached output leaves the level once the replay has used it: torch's selective checkpoint hands each cached
# entry out once (``_CachedTorchDispatchMode`` marks it consumed), after which its storage lives as in the
# plain forward, to its ``freed`` op where autograd does not save it. So ``C(t)`` is every cached output from
# the replay's start to its death, and ``L(t) - C(t)`` nets the cached ones dead by ``t`` (``_consumed``).
# Held to the end instead, a policy caching the Linear's ``mm`` output that its bias add reads, next to
# the closing ReLU, was predicted the ``mm`` output (131,072 bytes) above its measured peak (fuzz seed
# 2047's O5, 0.967x its prediction, helper-96), which the uncharged gap's free (NOTE [ A policy's replay
# above the gap's frees ]) had hidden there.
def _alive(b: BlockOps, which: Collection[int]) -> list[int]:
    """Bytes of the storages allocated by the ops ``which`` that are alive after each op of the block."""
    n = len(b.ops)
    delta = [0] * (n + 1)
    for i in which:
        op = b.ops[i]
        if op.out_bytes:
            delta[i] += op.out_bytes
            delta[n if op.freed < 0 else min(n, op.freed)] -= op.out_bytes
    return list(itertools.accumulate(delta[:n]))


def _consumed(b: BlockOps, cached: Collection[int]) -> list[int]:
    """Bytes of the cached storages ``cached`` that a replay has handed out and dropped after each op of the block
    (NOTE [ Replays of op-level policies ]): dead in the plain forward by then, their output never saved."""
    n = len(b.ops)
    delta = [0] * (n + 1)
    for i in cached:
        op = b.ops[i]
        if op.out_bytes and 0 <= op.freed < n:
            delta[op.freed] += op.out_bytes
    return list(itertools.accumulate(delta[:n]))


def _replay_rise(b: BlockOps, live: list[int], cached: set[int], fwd_peak: int) -> int:
    held, gone = _alive(b, cached), _consumed(b, cached)
    # An op's own temporaries (OpRecord.temp_bytes) ride on the level after it, unless the replay takes its
    # output from the cache (NOTE [ An op's own temporaries ] in remat.profile.ops).
    top = [live[t] + (0 if t in cached else b.ops[t].temp_bytes) for t in range(len(live))]
    rise = max((top[t] - held[t] - gone[t] for t in range(min(b.stop, len(live)))), default=0)
    return rise + max(0, fwd_peak - max((live[t] + b.ops[t].temp_bytes for t in range(len(live))), default=0))


def op_costs(profile: Profile) -> dict[tuple[int, RecomputeOps], tuple[int, float, int]]:
    """Every block's policy menu as ways of keeping it, for the solvers (NOTE [ Keep variants ] in
    ``remat.plan.solver``): ``(index, RecomputeOps) -> (bytes freed relative to Keep, extra ms, bytes
    the block's backward peak rises by beyond the freed bytes coming back)``: what the checkpoint holds
    to the end of that backward, its RNG state and the inputs of :func:`_held_inputs`.

    The extra time is measured (NOTE [ Op-level policy costs ] in ``remat.profile.profiler``): what the
    block cost beyond its plain run under torch's selective checkpoint caching nothing, less the time
    of the cached ops, which the recomputation skips. The bytes freed are the policy's, less the RNG
    state the checkpoint keeps (``Profile.ckpt_state_bytes``) and the inputs it holds that the plain
    step frees (:func:`_held_inputs`). Blocks without that measurement (stateful ones,
    groups of modules, blocks writing into storages they did not allocate, profiles made with
    ``ops=False``) get no policies.
    """
    out: dict[tuple[int, RecomputeOps], tuple[int, float, int]] = {}
    for i, (bp, block_ops) in enumerate(zip(profile.block_profiles, profile.block_ops)):
        if bp.selective_ms is None or bp.stateful:
            continue
        rerun_ms = sum(op.ms for op in block_ops.ops[: block_ops.stop])
        live = _alive(block_ops, range(len(block_ops.ops)))
        for policy in policy_menu(block_ops):
            skipped_ms = rerun_ms - policy.recompute_ms
            extra_ms = max(policy.recompute_ms, bp.selective_ms - skipped_ms)
            # The RNG state and the inputs the checkpoint holds stay to the end of the block's backward.
            held = profile.ckpt_state_bytes + _held_inputs(profile, i)
            # What the block saves for a dead branch (BlockProfile.dead_saved_frees) chain_of frees right after
            # the block (keep_bytes lowered by it), so Keep is charged without it already: the policy frees
            # none of it beyond that. Recomputed, it was never saved; cached, torch's selective checkpoint
            # holds it to the block's backward, past the plain step's free (fuzz seed 807: an aux head's
            # input cached by O1{..|clone#1}, 12,288 bytes alive through the head's backward, 1.06x budget).
            saved = policy.freed_bytes - held - _dead_saved_bytes(profile, i)
            # The recomputation runs when the block's backward starts, above the gradients pending then,
            # with a copy of the RNG state (torch's checkpoint forks it) and every tensor of the forward
            # up to its early stop alive (the block's forward peak, less the cached outputs, held already):
            # the backward peak is at least that (chain_of's bwd_peak_bytes, which counts the pending
            # gradients, plus the freed bytes coming back).
            indices = [j for j in map(block_ops.index_of, policy.save) if j is not None]
            cached = {st for j in indices for st in block_ops.ops[j].storages if st >= 0}
            rise = max(bp.fwd_peak_bytes - policy.held_bytes, _replay_rise(block_ops, live, cached, bp.fwd_peak_bytes))
            # NOTE [ A policy's replay above the gap's frees ]: both readings are against the level at the end
            # of the block's forward, which still holds what the gap after it frees; charged from the chain's
            # level after that gap, each gets the freed bytes back.
            lift = max(0, -bp.gap_bytes)
            replay = bp.pending_grad_bytes + lift + profile.ckpt_state_bytes + rise
            bwd = bp.bwd_peak_bytes + lift
            # Inputs the plain step frees inside the block's backward stay held by the checkpoint to its
            # end (NOTE [ Inputs held to the sub-module's backward end ]), as for a segment over the block.
            transient = max(held + bp.held_input_bwd_bytes, replay - bwd - saved)
            out[(i, RecomputeOps(i, policy.save, policy.freed))] = (saved, extra_ms, transient)
    return out
