"""Simulating a plan on a chain, and the solvers that choose a plan under a memory budget.

:func:`simulate` applies the rules of NOTE [ Chain cost model ] (``remat/plan/chain.py``) to one
plan; :func:`solve` finds the fastest plan within a memory headroom (NOTE [ Rotor dynamic program ]);
:func:`min_peak` / :func:`min_peak_plan` find the lowest peak any plan reaches; :func:`all_plans`
enumerates the plan space of the solver, for brute-force tests.

# NOTE [ Rotor dynamic program ]
After "Optimal checkpointing for heterogeneous chains" (Beaumont et al., rotor). Write ``f, b`` for
the times, ``S, fp, bp, x`` for the sizes of NOTE [ Chain cost model ], index ``n`` for the head.
``opt(s, t, m)`` (``0 <= s <= t <= n``) is the least time to run the forward of blocks ``s..t``
then their backward, with ``m`` bytes of headroom above the level at the start of block ``s``
(``t == n`` includes the head, which is always kept):

  s == t          f[s] + b[s]                                   if fp[s] <= m and S[s] + bp[s] <= m
  keep-first      f[s] + b[s] + opt(s+1, t, m - S[s])           if fp[s] <= m and S[s] + bp[s] <= m
  checkpoint k    sum(g[s..k-1]) + opt(k, t, m - x[k]) + opt(s, k-1, m - x[k])
                  (s < k <= t)                                   if nosave(s, k) <= m
  with nosave(s, k) = max over q in s..k-1 of fp[q] + (x[q] if q > s else 0), and g the cost of a
  no-save forward under a checkpoint (``ckpt_fwd_ms``, measured: checkpoint overhead included)
  plus, once per checkpoint call, ``ckpt_call_ms`` less ``stop_ms[k-1]`` (the replay's early stop).

Keep-first yields ``Keep(s)`` and the plan of ``s+1..t``; checkpoint ``k`` yields
``Recompute(s, k, plan(s, k-1))`` then the plan of ``k..t``. The inner plan ``plan(s, k-1)`` ends
with a ``Keep`` by construction (every recursion bottoms out in the ``s == t`` case). The
"knapsack" variant (``nested=False``) only allows ``k = s + 1``: single blocks checkpointed on their
own, no nesting. Each term is exactly what :func:`simulate` charges, so the value of the program is
the simulated time of the plan it returns, and its peak is within ``m``.

Memory is counted in whole units of ``u = ceil(headroom / slots)`` bytes so that the table is small.
The rounding is on the safe side, so a plan that fits in units fits in bytes: the headroom is
rounded *down*, and every size that is subtracted or compared is rounded *up* (toward +inf, negative
sizes included), with one refinement. Rounding each ``S[s]`` up on its own would lose up to a unit
per kept block, most of the headroom on a long chain; instead ``m`` units at block ``s`` stand for
at least ``m * u + slack[s]`` bytes, where ``slack[s] = u * ceil(Q[s] / u) - Q[s]`` and ``Q[s] =
S[0] + ... + S[s-1]``. Keeping ``s`` then costs ``ceil(Q[s+1] / u) - ceil(Q[s] / u)`` units, exactly
(a run of kept blocks telescopes), a comparison with ``p`` bytes at block ``s`` needs ``m >=
ceil((p - slack[s]) / u)``, and a checkpoint ``s -> k`` costs ``ceil((x[k] + slack[k]) / u)`` units
for the rest (``slack[s] >= 0`` dropped) and ``ceil(x[k] / u)`` for the inner plan, which starts at
``s`` again. So only checkpoints lose headroom to rounding, less than two units each. Headroom that
negative sizes push beyond the table is clamped to its top (``opt`` does not increase with ``m``, so
this is safe too). With 1-byte units (small headrooms) the program is exact.

# NOTE [ The replay's first block ]
A ``Recompute(s, k, I)`` replays ``I`` above ``Chain.replay_hold_bytes(s, k)``, of which the first block's
freed input (``Chain.replay_input_bytes(s)``: the checkpoint holds it, the replayed ``Keep(s)``'s ``S'`` nets
its free) is held from the end of that replayed forward on, not before it: the level holds the input
already and ``fp[s]`` was measured with it present (charged before it, a chain whose first block does not
save its 2 MiB input had full() predicted 1.32x its measured peak). An ``I`` that starts with a nested
checkpoint at ``s`` never nets the free and is charged nothing for it. So an inner plan is not ``opt(s, t)``,
the rest after a checkpoint ending before ``s``: the program keeps ``opt_start(s, t, m)`` (keep-first as in
``opt`` but ``fi[s]`` higher after the forward; checkpoint-first exactly as in ``opt``) for the ``t`` being
filled, which only ``W[s, t+1]`` reads, and ``_rebuild`` re-evaluates it (``_Table.start_choice``); the peak
recursion keeps its ``P_start`` as a table.

# NOTE [ Keep variants ]
A block may be kept in more than one way: plainly, or with a sub-module (its attention, its MLP)
checkpointed inside it (``RecomputeSub``, measured by the profile as bytes freed and recompute ms).
Each way has its own ``S, fp, bp`` (lowered by the bytes freed) and extra time; wherever the
program keeps a block (keep-first, and the last block of a range) it takes the best way. So the
optimal plan dominates ``attention_only`` / ``ffn_only`` as it dominates the block-level rules.

# NOTE [ Inputs held once ]
A sub-module checkpoint holds its inputs from its forward to its recomputation; ``saved_bytes`` charges
those its block does not save (T5's position bias, taken by every layer's attention, saved by none and
freed after the stack). A block's sub-module checkpoints open and close nested in each other's
(forward in order, backward in reverse), so one tensor that several take is held over the span of the
earliest open one, once. :func:`simulate` charges it once (``sub_held``: which inputs each
``RecomputeSub`` holds); the program's per-block costs charge it each time, on the safe side of the
simulation, as for late inputs held across segments (the planner settles on the simulation).

# NOTE [ Gradients in the program ]
With gradients set to ``None`` before the iteration, block ``k``'s backward leaves ``G[k]`` bytes of
parameter gradients (NOTE [ Chain cost model ]), so what runs later runs above more memory: in
``opt(s, t, ·)`` the backward of ``s`` (kept first) runs above ``G[s+1..t]``, and the inner plan of
a checkpoint ``s -> k`` above ``G[k..t]``. Counting ``m`` above the entry level would make the inner
shift ``x[k] + G[k..t]`` depend on ``t`` and break the layout of ``W`` below; so ``m`` counts the
headroom above the entry level *less the gradients of the blocks after t*, ``A[t+1] = G[t+1..n]``,
which are held throughout ``s..t``. The real headroom is ``m - A[t+1]``, and the rules read
  s == t          if max(fp[s], S[s] + bp[s]) + A[s+1] <= m
  keep-first      opt(s+1, t, m - S[s])  if fp[s] + A[t+1] <= m and S[s] + bp[s] + A[s+1] <= m
  checkpoint k    opt(k, t, m - x[k]) + opt(s, k-1, m - x[k])    if nosave(s, k) + A[t+1] <= m
(the inner plan's ``m`` is ``m - x[k] - A[t+1] - G[k..t] + A[k]``, i.e. ``m - x[k]``): every shift
is as before and only the thresholds of forwards move with ``t``. ``W[s, k]`` keeps the cut at
``nosave(s, k)``; where ``A[t+1] > 0`` the candidates of ``(s, t)`` are cut again at
``nosave(s, k) + A[t+1]`` (one vectorised mask per ``(s, t)``). With gradients held, ``G = 0`` and
the program is the one above. The peak recursion of :func:`min_peak` counts from the entry level and
adds ``G[s+1..t]`` and ``G[k..t]`` where they are held.

The table is filled for ``t = 0..n`` and, within ``t``, for ``s = t..0``, one numpy row over ``m``
at a time. Two shifted copies of every finished row are kept in one array ``W``, laid out so that
the candidates ``k = s+1..t`` of ``(s, t)`` are two contiguous ``(t - s, M)`` slices:
  ``W[t, k]`` (``k <= t``) = ``opt(k, t, m - x[k])``;
  ``W[s, k]`` (``k > s``)  = ``sum(f[s..k-1]) + opt(s, k-1, m - x[k])``, or inf where
                             ``m < nosave(s, k)``
(sizes in units as above).
The plan is rebuilt by re-evaluating the candidates at the chosen ``(s, t, m)`` with the same
floating-point operations, preferring keep, then the smallest ``k``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import numpy.typing as npt

from remat.core.ops import Keep, Op, Recompute, RecomputeOps, RecomputeSub, validate_ops
from remat.errors import RematError
from remat.plan.chain import Chain

__all__ = [
    "Simulation",
    "SubCosts",
    "SubHeld",
    "VariantCost",
    "VariantId",
    "simulate",
    "solve",
    "min_peak",
    "min_peak_plan",
    "all_plans",
]

# A way to keep a block other than plainly: the sub-modules checkpointed inside it (RecomputeSub), or an
# op-level policy (RecomputeOps, the operation itself).
VariantId = tuple[str, ...] | RecomputeOps
# (bytes saved, recompute ms[, bytes added to the backward peak[, bytes off the forward peak]]), see SubCosts.
VariantCost = tuple[int, float] | tuple[int, float, int] | tuple[int, float, int, int]
SubCosts = Mapping[tuple[int, VariantId], VariantCost]
"""``(block index, fqns or RecomputeOps) -> (bytes saved relative to Keep, recompute milliseconds[,
bytes the recomputation adds to the block's backward peak beyond the bytes saved (negative where it
adds less)[, bytes the block's forward peak drops by]])`` for ``RecomputeSub`` and ``RecomputeOps``;
op-level policies only at the top level of a plan (NOTE [ Keep variants ], NOTE [ Sub-module
recomputation peak ] in ``remat.profile.types``)."""

SubHeld = Mapping[tuple[int, tuple[str, ...]], tuple[tuple[int, int], ...]]
"""``(block index, fqns) -> ((number, bytes), ...)``: the inputs a ``RecomputeSub``'s checkpoints hold that
its costs charge (NOTE [ Inputs held once ])."""

# Headrooms up to this many bytes are solved in 1-byte units, i.e. exactly.
_EXACT_MAX_BYTES = 4096
# Automatic memory resolution: 1000 units while the work (about n^3 / 6 * slots element operations)
# stays under the target, about a second for 200 blocks at 500 units on a 2-core machine; never
# fewer than 250 units, whatever the time.
_SLOTS_MAX = 16384
_SLOTS_MIN = 250
_WORK_TARGET = 200**3 // 6 * 500
# Keep the two (n+1) x (n+1) x slots float64 tables of the solver below about this size.
_TABLE_MAX_BYTES = 1 << 30

_INF = math.inf
_FloatArray = npt.NDArray[np.float64]


# ----------------------------------------------------------------------------------------------
# Simulation
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Simulation:
    """What a plan costs on a chain, as predicted by NOTE [ Chain cost model ].

    Attributes:
        peak_bytes: Peak memory of the step above the memory held before it, bytes:
            ``max(pre_peak_bytes, base_bytes, peak during the chain, base_bytes + tail_peak_bytes)``.
        total_ms: Every forward (recomputations included) and every backward, milliseconds.
        extra_ms: The recomputation alone: ``total_ms`` minus the forward and backward time of every
            block and the head run once, milliseconds.
    """

    peak_bytes: int
    total_ms: float
    extra_ms: float


def _kept_sizes(
    chain: Chain, k: int, saved: int, transient: int = 0, fwd_drop: int = 0, replay: bool = False
) -> tuple[int, int, int]:
    """(S, fp, bp) of block ``k`` run normally, with ``saved`` bytes of sub-modules checkpointed.

    Checkpointing a sub-module lowers what the block holds between its forward and its backward by
    ``saved``; its own peaks stay where they were (the sub-module's activations exist during its
    forward, and are recomputed during the block's backward), so ``bp`` rises by ``saved`` relative
    to the lower level, and by what the recomputation itself holds for a while (``transient``: the
    output of the op where it stops early, the RNG state it forks). Where the profile saw the block's
    peaks fall after a sub-module's forward end or before its recomputation, ``fwd_drop`` lowers ``fp``
    and a negative ``transient`` lowers ``bp`` (NOTE [ Sub-module recomputation peak ] in
    ``remat.profile.types``). In a replay (``replay``) the code before the block does not run: its forward
    peaks as its own (``Chain.replay_fwd_peak_bytes``), without the rise of that code.
    """
    keep, bwd_peak = chain.kept_level_bytes(k), int(chain.bwd_peak_bytes[k])
    if replay:
        return keep - saved, int(chain.replay_fwd_peak_bytes[k]) - fwd_drop, bwd_peak + saved + transient
    fwd_peak = int(chain.fwd_peak_bytes[k])
    return keep - saved, max(fwd_peak - fwd_drop, int(chain.gap_rise_bytes[k])), bwd_peak + saved + transient


@dataclass(frozen=True)
class _TopOnly:
    """A sub-module variant that the solver may use at the top level of a plan only (``top_level_variants``)."""

    fqns: tuple[str, ...]


# A way to keep a block: (variant or None for plain, S, fp, bp, extra ms, fp in a replay).
_Variant = tuple[VariantId | _TopOnly | None, int, int, int, float, int]
# The same in the program's units (see _Table.kept), fp in a replay last.
_Way = tuple[VariantId | _TopOnly | None, int, int, int, int, float, int]


def _top_only(variant: VariantId | _TopOnly | None) -> bool:
    """Whether a way of keeping a block is allowed only at the top level of a plan (not inside a segment)."""
    return isinstance(variant, (RecomputeOps, _TopOnly))


def _allowed(variant: VariantId | _TopOnly | None, s: int, t: int, n: int) -> bool:
    """Whether block ``s`` may be kept this way in the range ``s..t`` (``t == n``: the top level)."""
    return not _top_only(variant) or (t == n and s < t)


def _variants(chain: Chain, sub_costs: SubCosts | None, top_only: bool = False) -> list[list[_Variant]]:
    """For every block (and the head), the plain Keep first, then one variant per ``sub_costs`` entry
    (``top_only``: sub-module variants too only at the top level of a plan)."""
    out: list[list[_Variant]] = []
    for k in range(chain.n + 1):
        out.append([(None, *_kept_sizes(chain, k, 0), 0.0, _kept_sizes(chain, k, 0, replay=True)[1])])
    for (k, variant), cost in sorted((sub_costs or {}).items(), key=lambda kv: (kv[0][0], repr(kv[0][1]))):
        ok = chain.recomputable if isinstance(variant, RecomputeOps) else chain.sub_recomputable
        if 0 <= k < chain.n and ok[k]:
            key: VariantId | _TopOnly = variant if isinstance(variant, RecomputeOps) else tuple(variant)
            if top_only and isinstance(key, tuple):
                key = _TopOnly(key)
            sizes = _kept_sizes(chain, k, int(cost[0]), _transient(cost), _fwd_drop(cost))
            replay_fp = _kept_sizes(chain, k, int(cost[0]), _transient(cost), _fwd_drop(cost), replay=True)[1]
            out[k].append((key, *sizes, float(cost[1]), replay_fp))
    return out


def _transient(cost: VariantCost) -> int:
    return int(cost[2]) if len(cost) > 2 else 0  # type: ignore[misc]


def _fwd_drop(cost: VariantCost) -> int:
    return int(cost[3]) if len(cost) > 3 else 0  # type: ignore[misc]


def _kept_op(k: int, variant: VariantId | _TopOnly | None) -> Op:
    if variant is None:
        return Keep(k)
    if isinstance(variant, _TopOnly):
        return RecomputeSub(k, variant.fqns)
    return variant if isinstance(variant, RecomputeOps) else RecomputeSub(k, variant)


class _Simulator:
    """The level/peak bookkeeping of NOTE [ Chain cost model ] for one plan."""

    def __init__(self, chain: Chain, sub_costs: SubCosts | None, sub_held: SubHeld | None = None) -> None:
        self.chain = chain
        self.sub_costs = sub_costs
        # NOTE [ Inputs held once ]: the inputs open sub-module checkpoints hold (number -> bytes), and per
        # RecomputeSub the bytes its costs charge that an open one holds already.
        self.sub_held = sub_held or {}
        self.held_open: dict[int, int] = {}
        self.held_credit: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.level = chain.base_bytes
        self.peak = chain.base_bytes
        # The blocks kept so far in the forward running now (the step's, or one replay's): the dead branches
        # of the others do not exist (Chain.dead_branches).
        self.kept_run: set[int] = set()
        # The blocks run so far in the replay running now, kept or not (None: the step's forward runs): the
        # outputs of the others that the model's code drops are not alive in it (Chain.dropped_outputs).
        self.replay_run: set[int] | None = None
        self.extra_ms = 0.0
        # Late inputs (Chain.late_inputs) that an open checkpoint holds from its end: one tensor, charged
        # once, by the first (Chain.late_records); per checkpoint: the bytes it charged, and which.
        self.late_open: set[int] = set()
        self.late_charged: dict[int, tuple[int, tuple[int, ...]]] = {}
        # What the top-level segments hold through the forward only (Chain.segment_fwd_only_bytes): per
        # checkpoint, the bytes still on the level; dropped at the head.
        self.fwd_only: dict[int, int] = {}
        # Code-held tensors a top-level segment made, freed after a later kept block (Chain.code_held_frees): per
        # block, (checkpoint, bytes, netted_after); per checkpoint, the bytes already taken off the level.
        self.code_frees: dict[int, list[tuple[int, int, int]]] = {}
        self.code_freed: dict[int, int] = {}
        # The blocks of the top-level segments run so far: whether each is its segment's last (its gap then nets
        # a free as Chain.gap_netted_bytes says).
        self.in_segment: dict[int, bool] = {}
        # NOTE [ Shared RNG states ]: whether the RNG state an earlier top-level segment keeps is still the
        # runtime's last one and equal to the generator's (a segment starting now shares it), and the
        # segments that share one (charged no state of their own).
        self.rng_live = False
        self.rng_shared: set[int] = set()

    def _top_rng(self, op: Op) -> int:
        """The RNG state bytes a top-level ``op`` does not hold of its own (NOTE [ Shared RNG states ]), and
        what the runtime's last state is after it."""
        c = self.chain
        first = op.start if isinstance(op, Recompute) else op.index
        live = self.rng_live and not c.rng_copy_bytes[first]
        if isinstance(op, Recompute):
            shared = live
            # A single-block segment's call leaves its state as the last one; the last call of several drops it.
            self.rng_live = op.stop - op.start == 1 and not c.rng_draws[op.start]
            if shared:
                self.rng_shared.add(id(op))
                return int(c.ckpt_state_bytes)
            return 0
        # A kept block does not go through the runtime: the state stays the last one while nothing draws.
        self.rng_live = live and isinstance(op, Keep) and not c.rng_draws[op.index]
        return 0

    def _late(self, op: Recompute) -> tuple[int, tuple[int, ...]]:
        """What a checkpoint charges for the late inputs it holds from its end that no open checkpoint
        holds yet (they are open until its backward ends), less those an open checkpoint holds that the
        plain step frees after one of its blocks: the segment frees them from the level as a kept block
        would (the open checkpoint charged them from its end on)."""
        held, inside, _replay = self.chain.late_records(op.start, op.stop)
        fresh = tuple(i for i, _ in held if i not in self.late_open)
        size = dict(held)
        return sum(size[i] for i in fresh) - sum(nbytes for i, nbytes in inside if i in self.late_open), fresh

    def _block_sizes(
        self, op: Keep | RecomputeSub | RecomputeOps, replay: bool = False, stops: bool = False
    ) -> tuple[int, int, int]:
        """(S, fp, bp) of a normally run block; RecomputeSub / RecomputeOps lower them by the saved bytes
        (``replay``: run in a replay, fp without the rise of the code before it; ``stops``: a ``Keep`` ending the
        replay, fp up to its early stop, NOTE [ The replay's last block stops early ] in ``remat.plan.chain``)."""
        if not isinstance(op, (RecomputeSub, RecomputeOps)):
            keep, fwd_peak, bwd_peak = _kept_sizes(self.chain, op.index, 0, replay=replay)
            if replay and stops:
                fwd_peak = min(fwd_peak, int(self.chain.replay_stop_peak_bytes[op.index]))
            return keep, fwd_peak, bwd_peak
        cost = self._sub_cost(op)
        return _kept_sizes(self.chain, op.index, int(cost[0]), _transient(cost), _fwd_drop(cost), replay=replay)

    def _sub_cost(self, op: RecomputeSub | RecomputeOps) -> VariantCost:
        key: tuple[int, VariantId] = (op.index, op if isinstance(op, RecomputeOps) else tuple(op.fqns))
        if self.sub_costs is None or key not in self.sub_costs:
            raise RematError(
                f"simulate: no costs for {op!r}; pass sub_costs={{{key!r}: (saved_bytes, recompute_ms)}} "
                f"(measured by the profile) to simulate {type(op).__name__}."
            )
        return self.sub_costs[key]

    def _rise(self, nbytes: int) -> None:
        self.peak = max(self.peak, self.level + nbytes)

    def forward(self, op: Op, replay: bool, discard: int = 0, stops: bool = False) -> None:
        """Run ``op``'s forward; ``replay`` marks a recomputation (its time is extra); ``discard``
        bytes of a last recomputed block's output are not held (``out_free_bytes``); ``stops``: the op ends
        the replay (NOTE [ The replay's last block stops early ] in ``remat.plan.chain``)."""
        c = self.chain
        # In a replay the code between blocks does not run (NOTE [ Spans ]): the blocks peak as their own.
        fwd_peaks = c.replay_fwd_peak_bytes if replay else c.fwd_peak_bytes
        shared_rng = 0 if replay else self._top_rng(op)
        if isinstance(op, Recompute):
            self.extra_ms += float(c.ckpt_call_ms)
            for q in range(op.start, op.stop):
                # What the segment already holds from its earlier blocks (NOTE [ Chain cost model ]; what
                # the gap after block q-1 released is not credited here, as in the solvers' nosave).
                # Nor the late inputs it holds from its end: they are still alive here in the plain step too.
                held = (
                    c.segment_bytes(op.start, q)
                    + int(c.released_bytes[q - 1])
                    - c.x_bytes[q]
                    - c.ckpt_state_bytes
                    - c.late_held_bytes(op.start, q)
                    # In a replay each block call's casts die with it (Chain.segment_fwd_only_bytes).
                    - (c.segment_fwd_only_bytes(op.start, q) if replay else 0)
                    if q > op.start
                    else 0
                )
                self._rise(
                    c.ckpt_state_bytes
                    - shared_rng
                    + fwd_peaks[q]
                    - self._absent_dead(q)
                    - self._absent_dropped(q, op.start)
                    + (c.x_bytes[q] if q > op.start else 0)
                    + held
                )
                # The no-save run costs ckpt_fwd_ms; the plain forward counted once is then not run.
                self.extra_ms += float(c.ckpt_fwd_ms[q]) - (0.0 if replay else float(c.fwd_ms[q]))
            late = self._late(op)
            self.late_charged[id(op)] = late
            self.late_open.update(late[1])
            self.level += (
                c.segment_bytes(op.start, op.stop) - c.late_held_bytes(op.start, op.stop) + late[0] - shared_rng
            )
            # Held to the head at the top level, never in a replay (Chain.segment_fwd_only_bytes).
            fwd_only = c.segment_fwd_only_bytes(op.start, op.stop)
            if replay:
                self.level -= fwd_only
                # A replay runs its blocks without the model's code between them: nothing holds them.
                gone = sum(nbytes for _, nbytes, _ in c.code_held_frees(op.start, op.stop))
                self.level -= gone
                self.code_freed[id(op)] = gone
            else:
                self.fwd_only[id(op)] = fwd_only
                # Taken off after that block's forward, at the top level (a replay's, a later segment's: held).
                for after, nbytes, netted_after in c.code_held_frees(op.start, op.stop):
                    self.code_frees.setdefault(after, []).append((id(op), nbytes, netted_after))
                self.in_segment.update((q, q == op.stop - 1) for q in range(op.start, op.stop))
                # So are the side outputs of its last block, which the model's code drops in the forward
                # (NOTE [ Side outputs of a segment's last block ] in remat.profile.profiler; the plain step keeps
                # them, so no measured number nets that free: -1): the replay, which Chain.replay_hold_bytes nets
                # them at, gets them back as it gets these (code_freed).
                last, side = op.stop - 1, int(c.side_output_bytes[op.stop - 1])
                if side > 0 and last <= c.side_output_after[last] <= c.n:
                    self.code_frees.setdefault(int(c.side_output_after[last]), []).append((id(op), side, -1))
                # Those an earlier segment made that the code freed inside this one: gone by its end.
                for q in range(op.start, op.stop):
                    self._code_free(q)
            if self.replay_run is not None:
                self.replay_run.update(range(op.start, op.stop))
            return
        keep, fwd_peak, _ = self._block_sizes(op, replay, stops)
        self._rise(fwd_peak - self._absent_dead(op.index) - self._absent_dropped(op.index))
        self.kept_run.add(op.index)
        if self.replay_run is not None:
            self.replay_run.add(op.index)
        self.level += keep - discard - self._open_held(op)
        if not replay:
            self._code_free(op.index)
        if replay:
            self.extra_ms += float(c.fwd_ms[op.index])

    def _code_free(self, q: int) -> None:
        """Takes off the level the code-held tensors freed in the code before block ``q`` (the head's for
        ``q = n``), once its forward has peaked (NOTE [ Outputs the model's code holds past their saving
        taker ] in ``remat.profile.profiler``). Less what the measured numbers take off already of one the plain
        step frees too (NOTE [ Code-held frees the plain step nets ]): all of it after a block kept in this
        forward (its ``gap_bytes``) or the last block (the head's peak), what the gap nets where a segment runs
        the block (``Chain.gap_netted_bytes``)."""
        c = self.chain
        for key, nbytes, fa in self.code_frees.pop(q, ()):
            if fa >= 0:
                if fa in self.kept_run or fa >= c.n - 1:
                    nbytes = 0
                elif fa in self.in_segment:
                    nbytes -= c.gap_netted_bytes(fa, nbytes, last=self.in_segment[fa])
            if nbytes <= 0:
                continue
            self.level -= nbytes
            self.code_freed[key] = self.code_freed.get(key, 0) + nbytes

    def _absent_dead(self, q: int) -> int:
        """The part of block ``q``'s forward peak (the head's for ``q = n``) owed to dead branches of blocks not
        kept in the forward running now (``Chain.dead_branches``: charged by ``fwd_peak_bytes`` and
        ``replay_fwd_peak_bytes`` as if they were), bytes."""
        n = self.chain.n
        return sum(
            (late if q == n else nbytes)
            for block, after, nbytes, late in self.chain.dead_branches
            if block < q and (q <= after or (q == n and after == n - 1)) and block not in self.kept_run
        )

    # NOTE [ Dropped outputs in a replay ]
    # A block returning ``(hidden, scores)`` whose scores the model's code drops when the next call rebinds its
    # name (x-transformers' attention intermediates, HF's attention weights) leaves them alive through the next
    # block's forward: chain_of frees them from the level right after their block and charges them to the
    # forward peaks of the blocks they outlive (``fwd_peak_bytes``, ``replay_fwd_peak_bytes``). In the step's
    # forward that is right whatever the plan (a recomputed block returns them too). A replay runs the
    # recorded blocks only: the scores exist there only where their block ran in the same replay before, so
    # a one-block replay of layer k was charged layer k-1's scores that nothing made (full() over six
    # attention layers at 1.09x its measured peak, x-transformers decoders 1.10-1.32x, and budgets its own
    # plans met refused). The simulator takes them off there; the solvers' tables still charge them (on the
    # safe side: a plan they choose is never predicted lower by the simulation than by them).
    def _absent_dropped(self, q: int, start: int | None = None) -> int:
        """The part of block ``q``'s forward peak owed to outputs of earlier blocks that the model's code drops
        (``Chain.dropped_outputs``) where they do not exist: in a replay that did not run their block before
        ``q`` (NOTE [ Dropped outputs in a replay ]); ``start``: the first block of the segment ``q`` runs in
        now, whose earlier blocks in it ran no-save (their outputs alive), bytes."""
        if self.replay_run is None:
            return 0
        ran = self.replay_run if start is None else self.replay_run | set(range(start, q))
        return sum(
            nbytes for block, after, nbytes in self.chain.dropped_outputs if block < q <= after and block not in ran
        )

    def _open_held(self, op: Op) -> int:
        """Open ``op``'s sub-module checkpoints: the bytes of their held inputs that an open one holds already."""
        if not isinstance(op, RecomputeSub):
            return 0
        credit, fresh = 0, []
        for number, nbytes in self.sub_held.get((op.index, tuple(op.fqns)), ()):
            if number in self.held_open:
                credit += nbytes
            else:
                self.held_open[number] = nbytes
                fresh.append(number)
        self.held_credit[id(op)] = (credit, tuple(fresh))
        return credit

    def _close_held(self, op: Op) -> int:
        """Close what :meth:`_open_held` opened; the bytes it credited."""
        credit, fresh = self.held_credit.pop(id(op), (0, ()))
        for number in fresh:
            del self.held_open[number]
        return credit

    def backward(self, op: Op, discard: int = 0, replay: bool = False, stops: bool = False) -> None:
        """Run ``op``'s backward (and, for a recompute, the replay of its inner plan; ``replay``: the op ran in
        a replay, as :meth:`forward` says; ``stops``: a ``Keep`` ending a top-level segment, whose backward
        peaks as its own only, NOTE [ The gap's backward runs before the replay ])."""
        if isinstance(op, Recompute):
            last = len(op.inner) - 1
            # NOTE [ The gap's backward runs before the replay ]: at the top level, the backward of the code after
            # the segment runs first, above the level holding it; then that code's rise is gone.
            gap_gone = 0
            if not replay and op.stop - 1 < self.chain.n:
                self._rise(int(self.chain.code_bwd_peak_bytes[op.stop - 1]))
                gap_gone = max(0, int(self.chain.gap_bytes[op.stop - 1]))
                self.level -= gap_gone
            freed = int(self.chain.out_free_bytes[op.stop - 1])
            # The checkpoint holds the segment's input through the replay and its backward, where the
            # replayed first block's gap (a plain step's) would free it: hold it back.
            # And it replays above the activation gradients pending when the backward reaches its last block.
            late_held, late_ids = self.late_charged.pop(id(op))
            # (what the last block's gap released, and late inputs its blocks free: Chain.late_replay_bytes)
            hold = self.chain.replay_hold_bytes(op.start, op.stop)
            # Of which the first block's freed input, from the end of its replayed forward on (a nested
            # checkpoint first never nets its free: Chain.replay_input_bytes).
            hold -= self.chain.replay_input_bytes(op.start)
            first = 0 if isinstance(op.inner[0], Recompute) else self.chain.replay_input_bytes(op.start)
            pending = self.chain.replay_above_bytes(op.stop - 1)  # and the RNG state its replay forks
            # A late input it made, which segment_bytes charges, was freed in the forward: not under the
            # replay, whose own kept blocks charge it again (NOTE [ Late inputs made inside a segment ]).
            made = self.chain.late_made_bytes(op.start, op.stop)
            gone = self.code_freed.pop(id(op), 0)  # taken off where the model's code freed it
            self.level += hold + pending - made + gone  # the replay runs when the backward reaches the last block
            outer_kept, self.kept_run = self.kept_run, set()  # a replay keeps its own blocks only
            outer_run, self.replay_run = self.replay_run, set()
            for i, inner_op in enumerate(op.inner):
                self.forward(inner_op, replay=True, discard=freed if i == last else 0, stops=i == last)
                if i == 0:
                    self.level += first
            self.level -= pending  # a kept block's bp counts the gradients pending at its own backward
            # The replay stops after the last block's last saved tensor (torch's early stop).
            self.extra_ms -= float(self.chain.stop_ms[op.stop - 1])
            for i in range(last, -1, -1):
                self.backward(
                    op.inner[i], discard=freed if i == last else 0, replay=True, stops=i == last and not replay
                )
            self.kept_run = outer_kept
            self.replay_run = outer_run
            self.level -= hold + first - gap_gone
            self.level -= (
                self.chain.segment_bytes(op.start, op.stop) - self.chain.late_held_bytes(op.start, op.stop) - made
            )
            if id(op) in self.rng_shared:  # an earlier segment holds the state (NOTE [ Shared RNG states ])
                self.rng_shared.discard(id(op))
                self.level += int(self.chain.ckpt_state_bytes)
            # What it held through the forward only left at the head (top level) or was never held (replay).
            self.level += self.chain.segment_fwd_only_bytes(op.start, op.stop) - self.fwd_only.pop(id(op), 0)
            self.level -= late_held
            self.late_open.difference_update(late_ids)
            return
        keep, _, bwd_peak = self._block_sizes(op, replay=replay)
        if stops and isinstance(op, Keep):
            bwd_peak = min(bwd_peak, int(self.chain.stop_bwd_peak_bytes[op.index]))
        self._rise(bwd_peak)
        self.level -= keep - discard - self._close_held(op)
        self.level += int(self.chain.grad_bytes[op.index])  # its parameters' gradients stay
        if isinstance(op, (RecomputeSub, RecomputeOps)):
            self.extra_ms += float(self._sub_cost(op)[1])

    def head(self, last: Op | None = None) -> None:
        """The head, after ``last`` (the plan's last operation): after a ``Recompute`` it runs
        ``Chain.head_freed_bytes`` higher (its measured rise nets frees that do not happen then)."""
        c, n = self.chain, self.chain.n
        extra = c.head_freed_bytes(last.start) if isinstance(last, Recompute) else 0
        self.level += extra
        self._rise(c.fwd_peak_bytes[n] - self._absent_dead(n))
        self._code_free(n)
        self.level += c.keep_bytes[n]
        self._rise(c.bwd_peak_bytes[n])
        self.level -= c.keep_bytes[n]
        self.level -= extra
        # NOTE [ Pinned through the forward only ] in remat.profile.profiler: freed before the loss (charged
        # through the head's peak, on the safe side), held by no segment in the backward.
        for key in self.fwd_only:
            self.level -= self.fwd_only[key]
            self.fwd_only[key] = 0
        self.level += int(c.grad_bytes[n])


# NOTE [ The gap's backward runs before the replay ]
# The code after block ``k`` (its gap, ``g[k]``: Whisper's encoder-final LayerNorm, whose output every decoder
# layer's cross-attention takes) runs its backward after block ``k + 1``'s and before block ``k``'s. The chain
# model holds what that code left (``max(0, g[k])``) on the level until block ``k``'s backward ends (a kept
# block's ``S'``, a segment's ``segment_bytes``), and the profile measures block ``k``'s backward peak above
# the level at its forward's end, so that the window of the gap's backward is taken less ``max(0, g[k])``.
# Three charges did not follow from that:
#   * block ``k``'s own backward window was not taken less it (``bwd_peak_bytes``' first term): a kept block
#     was charged what the gap left twice wherever its own backward, not the gap's, peaked;
#   * a top-level segment ending with block ``k`` replays after the gap's backward has run: what the gap left
#     is gone (what of it is still alive is in ``pending_grad_bytes``, measured at block ``k``'s backward
#     start), while the simulator held it through the replay, and charged the gap's backward window inside
#     the replayed last block's backward, above the replay;
#   * so the replay of a segment ending before Whisper's decoder ran 16,896 bytes (the LayerNorm's output and
#     statistics) too high from its start, and its last block's backward peaked that much and more above it:
#     ``full()`` over Whisper's four layers was predicted 35,432 bytes above its measured peak (0.896x), a
#     fuzz model's (seed 1079) at 0.79x, one whose layers end with a LayerNorm and SiLU between them at 0.94x.
# The profile now keeps both windows apart (``BlockProfile.bwd_own_peak_bytes``, ``bwd_code_peak_bytes``, each
# above the level holding ``max(0, g[k])``): a kept block peaks at the higher of the two
# (``Chain.bwd_peak_bytes``, the solvers' tables too); at a top-level segment's backward the gap's window is
# charged above the level before the replay (``Chain.code_bwd_peak_bytes``), ``max(0, g[k])`` leaves the level
# until the segment's backward ends, and the replayed last block charges its own window only
# (``Chain.stop_bwd_peak_bytes``). Inside a replay (a nested segment, a block before the replay's last) the gap
# code did not run in the replay but its backward runs between the blocks' backward: nothing changes there.
# The solvers' tables charge a segment's last block its whole ``bwd_peak_bytes`` above the replay, as before:
# never below the simulation (they only lose the first double charge, which they share with it). Profiles
# without the two windows (written before them) keep the old charges.
def reached_ops(chain: Chain, ops: tuple[Op, ...]) -> tuple[Op, ...]:
    """``ops`` with every ``Recompute`` over a block the backward does not reach (``Chain.reached``) run
    as ``Keep`` of its blocks, for the memory (NOTE [ Blocks the backward does not reach ])."""
    out: list[Op] = []
    for op in ops:
        if isinstance(op, Recompute) and not all(chain.reached[q] for q in range(op.start, op.stop)):
            out.extend(Keep(q) for q in range(op.start, op.stop))
        else:
            out.append(op)
    return tuple(out)


def _no_op_checkpoints(chain: Chain, ops: tuple[Op, ...]) -> bool:
    """Whether every ``Recompute`` of ``ops`` over a block the backward does not reach is over blocks that return
    no tensor requiring a gradient only (frozen blocks taking no gradient: the checkpoint holds nothing)."""
    return all(
        not any(chain.output_grad[q] for q in range(op.start, op.stop))
        for op in ops
        if isinstance(op, Recompute) and not all(chain.reached[q] for q in range(op.start, op.stop))
    )


def _step(chain: Chain, ops: tuple[Op, ...], sub_costs: SubCosts | None, sub_held: SubHeld | None) -> _Simulator:
    """One iteration of ``ops`` through the simulator: the forward, the head, the backward."""
    sim = _Simulator(chain, sub_costs, sub_held)
    for op in ops:
        sim.forward(op, replay=False)
    sim.head(ops[-1] if ops else None)
    for op in reversed(ops):
        sim.backward(op)
    return sim


def simulate(
    chain: Chain, ops: tuple[Op, ...], sub_costs: SubCosts | None = None, sub_held: SubHeld | None = None
) -> Simulation:
    """Predict the peak memory and the time of a plan (NOTE [ Chain cost model ]).

    Args:
        chain: The measured chain of ``n`` blocks and the head.
        ops: The plan: operations covering blocks ``0..n-1`` once each, in order (the head is implicit).
        sub_costs: For each ``RecomputeSub(k, fqns)`` in the plan, ``(k, fqns) -> (saved_bytes,
            recompute_ms)``: the bytes (bytes) it saves relative to ``Keep(k)`` and the time
            (milliseconds) of recomputing the sub-modules. It is simulated as ``Keep(k)`` with
            ``keep_bytes`` lowered by ``saved_bytes``, the block's own peaks unchanged in absolute
            terms, and ``recompute_ms`` of extra time.
        sub_held: For each ``RecomputeSub``, ``(number, bytes)`` of the inputs its checkpoints hold that
            ``saved_bytes`` charges (``Profile.sub_held_inputs``): one that an open sub-module checkpoint
            holds already is charged once (NOTE [ Inputs held once ]); without it, each time.

    Returns:
        The predicted peak (bytes) and times (milliseconds).

    Raises:
        RematError: If the operations do not cover the blocks once each in order, an inner plan does
            not end with a ``Keep``, or ``sub_costs`` lacks a ``RecomputeSub`` of the plan.
    """
    validate_ops(ops, chain.n, source="simulate")
    sim = _step(chain, ops, sub_costs, sub_held)
    peak = max(sim.peak, chain.pre_peak_bytes, chain.base_bytes + chain.tail_peak_bytes)
    # NOTE [ Blocks the backward does not reach ]: a checkpoint over such a block (a classic strategy
    # checkpoints every block; the solvers keep them, Chain.recomputable) holds only its output, but the
    # plain step frees what the block saved wherever its graph dies (HF Encodec's encoder, whose output
    # reaches the loss only through an argmin: in the head, before the head's backward, where the step
    # peaks), which the chain does not locate. Charged as kept, such blocks are never predicted to lower
    # a peak they cannot lower (full() on Encodec measured 1.05x, sqrt() 1.57x its prediction).
    kept_ops = reached_ops(chain, ops)
    if kept_ops != ops:
        kept = _step(chain, kept_ops, sub_costs, sub_held)
        if _no_op_checkpoints(chain, ops):
            # NOTE [ Blocks whose outputs need no gradient ] in remat.core.probe: such a checkpoint holds
            # nothing and never replays; the plan runs as the one keeping those blocks.
            sim = kept
            peak = max(kept.peak, chain.pre_peak_bytes, chain.base_bytes + chain.tail_peak_bytes)
        else:
            peak = max(peak, kept.peak)
    once_ms = float(sum(chain.fwd_ms)) + float(sum(chain.bwd_ms))
    return Simulation(peak_bytes=int(peak), total_ms=once_ms + sim.extra_ms, extra_ms=sim.extra_ms)


# ----------------------------------------------------------------------------------------------
# The time-optimal solver (NOTE [ Rotor dynamic program ])
# ----------------------------------------------------------------------------------------------


def _ceil_div(num: int, den: int) -> int:
    """``ceil(num / den)`` for integers of any sign (``den > 0``)."""
    return -(-num // den)


def finest_slots(n: int, headroom_bytes: int) -> int:
    """Memory units for a finer solve of ``n`` blocks (a budget within rounding of the smallest peak):
    up to 1-byte units and 65536 of them, but within the table size and about 8 times the automatic
    solve's work, so a long chain (a split U-Net: 200+ blocks) neither allocates tens of GiB nor runs
    for hours."""
    fit = _TABLE_MAX_BYTES // (16 * (n + 1) ** 2) - 1
    work = 8 * _WORK_TARGET // max(1, n**3 // 6)
    return max(1, min(1 << 16, max(1, headroom_bytes), max(_auto_slots(n), min(fit, work))))


def _auto_slots(n: int) -> int:
    """Memory units for a chain of ``n`` blocks when the caller does not choose."""
    slots = max(_SLOTS_MIN, min(_SLOTS_MAX, _WORK_TARGET // max(1, n**3 // 6)))
    # Two float64 tables of (n + 1) x (n + 1) x (slots + 1) entries.
    fit = _TABLE_MAX_BYTES // (16 * (n + 1) ** 2) - 1
    return max(8, min(slots, fit))


@dataclass(frozen=True)
class _Table:
    """The filled dynamic program and the sizes, in units, it was filled with."""

    n: int
    size: int  # entries over m: 0..size-1 units
    opt: _FloatArray  # opt[s, t, m]
    shifted: _FloatArray  # W of NOTE [ Rotor dynamic program ]
    rest_units: list[int]  # checkpoint s..k-1, then run k..t: m -> m - rest_units[k]
    inner_units: list[int]  # checkpoint s..k-1, then its inner plan: m -> m - inner_units[k]
    # Per block, per way of keeping it (NOTE [ Keep variants ]): sub-modules checkpointed (None: plain),
    # units it costs, fp in bytes, units its backward needs when kept before more blocks, units it
    # needs as the last block of a range, and f + b + extra (NOTE [ Gradients in the program ]).
    kept: list[list[_Way]]
    nested: bool
    unit_bytes: int
    slack: list[int]  # m units at block s stand for at least m * u + slack[s] bytes
    grads_after: list[int]  # grads_after[j] = G[j] + ... + G[n] (0 for j = n + 1)
    nosave_bytes: npt.NDArray[np.int64]  # [s, k]: nosave(s, k) + ckpt_state_bytes (0 where blocked)
    nosave_replay: npt.NDArray[np.int64]  # the same in a replay, where the code between blocks does not run
    hold_units: list[list[int]]  # [s][k]: checkpoint s..k-1: its inner plan runs above Chain.replay_hold_bytes
    # (less the first block's freed input, Chain.replay_input_bytes: charged from the end of its replayed forward)
    pending: list[int]  # pending[t]: gradients pending when t's backward starts; s..t (t < n) is a replay's
    # inner plan, whose forward runs above them
    head_units: list[int]  # [s]: checkpoint s..n-1, then the head: m -> m - head_units[s] (Chain.head_freed_bytes)
    # Per block, per way of keeping it, as the first block of a replay's inner plan (Chain.replay_input_bytes
    # held from the end of its forward on): (units it costs, units its backward needs kept before more
    # blocks, units it needs as the last block of a range).
    start_kept: list[list[tuple[int, int, int]]]

    def rest_units_after(self, s: int, k: int) -> int:
        """Units the rest ``k..t`` runs below ``m`` after a checkpoint ``s..k-1``: ``rest_units[k]``, and for the
        head alone (``k = n``) ``head_units[s]``."""
        return self.head_units[s] if k == self.n else self.rest_units[k]

    def rest_value(self, s: int, t: int, k: int, m: int) -> float:
        """``W[t, k]`` at ``m`` after a checkpoint ``s..k-1``: ``opt(k, t, m - rest_units_after(s, k))``."""
        if k != self.n:
            return float(self.shifted[t, k, m])
        j = self.shift_index(m, self.head_units[s])
        return _INF if j < 0 else float(self.opt[k, t, j])

    def shift_index(self, m: int, units: int) -> int:
        """Index of ``opt(·, ·, m - units)`` in the table (clamped at the top), or -1 if below 0."""
        j = m - units
        return -1 if j < 0 else min(j, self.size - 1)

    def units_for(self, nbytes: int, s: int) -> int:
        """Units of ``m`` at block ``s`` needed for ``nbytes`` bytes of headroom."""
        return _ceil_div(nbytes - self.slack[s], self.unit_bytes)

    def keep_ok(self, s: int, t: int, way: _Way) -> int:
        """Units of ``m`` needed to keep ``s`` (this way) before blocks ``s+1..t``: its forward runs above the
        gradients of the blocks after ``t`` (NOTE [ Gradients in the program ])."""
        fwd = way[2] if t == self.n else way[6]  # s..t with t < n runs in a replay (Chain.replay_fwd_peak_bytes)
        return max(self.units_for(fwd + self.grads_after[t + 1] + self.pending[t], s), way[3])

    def nosave_ok(self, s: int, t: int, k: int) -> int:
        """Units of ``m`` needed for the no-save forward of ``s..k-1`` in ``(s, t)``."""
        nosave = self.nosave_bytes if t == self.n else self.nosave_replay
        return self.units_for(int(nosave[s, k]) + self.grads_after[t + 1] + self.pending[t], s)

    def keep_choice(self, s: int, t: int, m: int, value: float) -> tuple[VariantId | _TopOnly | None, int] | None:
        """The first way of keeping ``s`` that reproduces ``value`` at ``(s, t, m)``, and the next ``m``."""
        for way in self.kept[s]:
            fqns, units, _fwd, _bwd_ok, last_ok, fb, _replay_fwd = way
            if not _allowed(fqns, s, t, self.n):
                continue
            if s == t:
                if m >= last_ok and fb == value:
                    return fqns, m
                continue
            j = self.shift_index(m, units)
            if m >= self.keep_ok(s, t, way) and j >= 0 and float(fb + self.opt[s + 1, t, j]) == value:
                return fqns, j
        return None

    def start_choice(self, s: int, t: int, m: int) -> tuple[VariantId | _TopOnly | None, int] | tuple[int, int]:
        """How the inner plan of a checkpoint from ``s`` (``opt_start(s, t, m)``, NOTE [ The replay's first
        block ]) runs: ``(way, next m)`` to keep ``s`` first (preferred on ties), else ``(k, -1)`` for a
        nested checkpoint ``s..k-1`` first; re-evaluated with the fill's floating-point operations."""
        keeps: list[tuple[float, VariantId | _TopOnly | None, int]] = []
        for way, (units, bwd_ok, last_ok) in zip(self.kept[s], self.start_kept[s], strict=True):
            fqns, _units, _fwd, _bwd_ok, _last_ok, fb, _replay_fwd = way
            if not _allowed(fqns, s, t, self.n):
                continue
            if s == t:
                if m >= last_ok:
                    keeps.append((fb, fqns, m))
                continue
            j = self.shift_index(m, units)
            if j >= 0 and m >= max(self.keep_ok(s, t, way), bwd_ok):
                keeps.append((float(fb + self.opt[s + 1, t, j]), fqns, j))
        ckpts = [
            (self.rest_value(s, t, k, m) + float(self.shifted[s, k, m]), k)
            for k in (self.candidates(s, t) if s < t else ())
            if m >= self.nosave_ok(s, t, k)
        ]
        value = min([v for v, _f, _j in keeps] + [v for v, _k in ckpts])
        for v, fqns, j in keeps:
            if v == value:
                return fqns, j
        return next(k for v, k in ckpts if v == value), -1

    def candidates(self, s: int, t: int) -> range:
        return range(s + 1, t + 1) if self.nested else range(s + 1, s + 2)


def _shift(row: _FloatArray, units: int, out: _FloatArray) -> _FloatArray:
    """``out[m] = row[m - units]``: inf below 0, clamped to the top entry above the table. Returns ``out``.

    The fill calls this some n**3 times on rows of thousands of entries: writing into a buffer it
    reuses, not a new array, keeps the allocator (and the page faults of fresh large blocks) out of it.
    """
    size = row.shape[0]
    if units >= 0:
        d = min(units, size)
        out[:d] = _INF
        out[d:] = row[: size - d]
    else:
        d = min(-units, size)
        out[: size - d] = row[d:]
        out[size - d :] = row[size - 1]
    return out


def _fill(chain: Chain, unit_bytes: int, top_units: int, nested: bool, variants: list[list[_Variant]]) -> _Table:
    n = chain.n
    f, b = chain.fwd_ms, chain.bwd_ms
    u = unit_bytes
    # Units of m at block s stand for at least m * u + slack[s] bytes (NOTE [ Rotor dynamic program ]).
    level_units, slack, level = [], [], 0
    for s in range(n + 1):
        level_units.append(_ceil_div(level, u))
        slack.append(level_units[-1] * u - level)
        level += chain.kept_level_bytes(s)
    slack.append(0)
    # A checkpoint holds the segment's output, its saved RNG state (ckpt_state_bytes) and what stays
    # alive anyway (Chain.segment_bytes; multi-block segments only where nothing else is held).
    held = _held(chain)
    rest_units = [_ceil_div(held[k] + slack[k], u) for k in range(n + 1)]
    # The head after a checkpoint s..n-1 runs Chain.head_freed_bytes(s) higher (the rest k = n of (s, n)).
    head_units = [_ceil_div(held[n] + slack[n] + chain.head_freed_bytes(s), u) for s in range(n + 1)]
    inner_units = [_ceil_div(held[k], u) for k in range(n + 1)]
    hold_units = [[_ceil_div(_replay_hold(chain, s, k), u) if k > s else 0 for k in range(n + 2)] for s in range(n + 1)]
    # A range s..t with t < n is only ever the inner plan of a checkpoint ending at t (or part of one):
    # its forwards run in the replay, above the gradients pending at t's backward; its backwards do not.
    pending = [chain.replay_above_bytes(t) for t in range(n)] + [0]  # the top level (t = n) is no replay
    # NOTE [ Gradients in the program ]: m is headroom above the entry level less the gradients of
    # the blocks after t; a backward needs them, a forward of s..t runs above those of blocks after t.
    after = _grads_after(chain)
    # NOTE [ Keep variants ]: a block kept with sub-modules checkpointed holds fewer bytes for more time.
    # Keeping s the plain way costs exactly level_units[s+1] - level_units[s] (the ceil telescopes);
    # any way costs ceil((S_v + slack[s+1] - slack[s]) / u), which is that for the plain S.
    kept: list[list[_Way]] = []
    start_kept: list[list[tuple[int, int, int]]] = []
    for s in range(n + 1):
        ways: list[_Way] = []
        # As the first block of a replay's inner plan: its freed input held from the end of its forward on.
        first = chain.replay_input_bytes(s) if s < n else 0
        start_ways: list[tuple[int, int, int]] = []
        for fqns, keep, fwd_peak, bwd_peak, extra, replay_fwd in variants[s]:
            units = _ceil_div(keep + slack[s + 1] - slack[s], u) if s < n else _ceil_div(keep, u)
            # Kept before s+1..t, its backward runs above their gradients: t drops out (grads_after[s+1]).
            bwd_ok = _ceil_div(keep + bwd_peak + after[s + 1] - slack[s], u)
            freed = int(chain.out_free_bytes[s]) if s < n else 0  # the last block of a recomputed range
            # As the last block of s..t (t = s < n: in a replay): its forward runs above pending[s], without the
            # rise of the code before it (Chain.replay_fwd_peak_bytes; the head, s = t = n, is no replay).
            last_fwd = replay_fwd if s < n else fwd_peak
            last_ok = _ceil_div(max(last_fwd + pending[s], keep - freed + bwd_peak) + after[s + 1] - slack[s], u)
            ways.append(
                (fqns, units, int(fwd_peak), bwd_ok, last_ok, float(f[s]) + float(b[s]) + extra, int(replay_fwd))
            )
            start_ways.append(
                (
                    _ceil_div(keep + first + slack[s + 1] - slack[s], u) if s < n else units,
                    _ceil_div(keep + first + bwd_peak + after[s + 1] - slack[s], u),
                    _ceil_div(max(last_fwd + pending[s], keep - freed + bwd_peak + first) + after[s + 1] - slack[s], u),
                )
            )
        kept.append(ways)
        start_kept.append(start_ways)
    # Negative sizes give headroom back; widen the table by as much so that is not lost to clamping.
    gain = (
        sum(max(0, -w[1]) for ways in kept for w in ways)
        + sum(max(0, -w[0]) for ways in start_kept for w in ways)
        + sum(max(0, -v) for v in rest_units + inner_units)
    )
    size = top_units + 1 + min(gain, top_units + 1)

    opt = np.full((n + 1, n + 1, size), _INF)
    shifted = np.full((n + 1, n + 1, size), _INF)
    nosave_bytes = np.zeros((n + 1, n + 1), dtype=np.int64)
    nosave_replay = np.zeros((n + 1, n + 1), dtype=np.int64)
    table = _Table(
        n,
        size,
        opt,
        shifted,
        rest_units,
        inner_units,
        kept,
        nested,
        u,
        slack,
        after,
        nosave_bytes,
        nosave_replay,
        hold_units,
        pending,
        head_units,
        start_kept,
    )
    scratch = np.empty((n + 1, size))
    # opt_start(s, t) for the t being filled (NOTE [ The replay's first block ]): only W[s, t+1] reads it.
    start_rows = np.full((n + 1, size), _INF)
    best, cand, least = np.empty(size), np.empty(size), np.empty(size)  # reused rows (see _shift)
    columns = np.arange(size)
    for t in range(n + 1):
        start_rows.fill(_INF)
        for s in range(t, -1, -1):
            row = opt[s, t]
            start_row = start_rows[s]
            if s == t:
                for (variant, _units, _fwd, _bwd_ok, last_ok, fb, _replay_fwd), start_way in zip(
                    kept[s], start_kept[s], strict=True
                ):
                    if not _allowed(variant, s, t, n):
                        continue
                    lo = min(max(0, last_ok), size)
                    np.minimum(row[lo:], fb, out=row[lo:])
                    if t < n:
                        lo = min(max(0, start_way[2]), size)
                        np.minimum(start_row[lo:], fb, out=start_row[lo:])
            else:
                best.fill(_INF)
                for way in kept[s]:
                    if not _allowed(way[0], s, t, n):
                        continue
                    np.add(_shift(opt[s + 1, t], way[1], cand), way[5], out=cand)
                    cand[: max(0, min(table.keep_ok(s, t, way), size))] = _INF
                    np.minimum(best, cand, out=best)
                hi = t + 1 if nested else s + 2
                buf = scratch[: hi - s - 1]
                np.add(shifted[t, s + 1 : hi], shifted[s, s + 1 : hi], out=buf)
                if hi == n + 1 and head_units[s] != rest_units[n]:
                    # The head alone after a checkpoint s..n-1 runs higher (Chain.head_freed_bytes(s)).
                    np.add(_shift(opt[n, n], head_units[s], cand), shifted[s, n], out=buf[-1])
                if after[t + 1] or pending[t] or t == n:
                    # W[s, k] is cut where the no-save forward in a replay does not fit with no gradients
                    # held; here it runs above those of the blocks after t (NOTE [ Gradients in the program ]),
                    # and at the top level (t = n) with the code between blocks (Chain.replay_fwd_peak_bytes).
                    nosave_st = nosave_bytes if t == n else nosave_replay
                    need = -((slack[s] - after[t + 1] - pending[t] - nosave_st[s, s + 1 : hi]) // u)
                    lim = int(min(size, max(0, int(need.max()))))
                    if lim:
                        np.copyto(buf[:, :lim], _INF, where=columns[None, :lim] < need[:, None])
                np.minimum(best, buf.min(axis=0, out=least), out=row)
                if t < n:
                    # The same range as the inner plan of a checkpoint from s: s kept first holds its freed
                    # input from the end of its forward on; a nested checkpoint first as above.
                    np.copyto(start_row, least)
                    for way, start_way in zip(kept[s], start_kept[s], strict=True):
                        if not _allowed(way[0], s, t, n):
                            continue
                        np.add(_shift(opt[s + 1, t], start_way[0], cand), way[5], out=cand)
                        cand[: max(0, min(max(table.keep_ok(s, t, way), start_way[1]), size))] = _INF
                        np.minimum(start_row, cand, out=start_row)
            # W[t, s] = opt(s, t, m - rest_units[s]), used by (s', t) with s' < s as "the rest after
            # checkpointing s'..s-1".
            if s > 0:
                _shift(row, rest_units[s], shifted[t, s])
        if t < n:
            # W[s, t+1] = sum(f[s..t]) + opt(s, t, m - inner_units[t+1]) where the no-save forward of
            # s..t fits, used by (s, t') with t' > t as "checkpoint s..t, recompute it under plan(s, t)".
            fsum = 0.0
            later = -_INF  # max of fp[q] + x[q] over q in s+1..t: blocks that hold their input
            later_replay = -_INF  # the same in a replay (Chain.replay_fwd_peak_bytes)
            blocked = False  # a block in s..t may not be recomputed (stateful), or s..t crosses a barrier
            for s in range(t, -1, -1):
                blocked = blocked or not chain.recomputable[s] or (s < t and not chain.joinable[s])
                if blocked:
                    shifted[s, t + 1] = _INF
                    continue
                fsum = float(chain.ckpt_fwd_ms[s]) + fsum
                if s < t:
                    later = max(later, int(chain.fwd_peak_bytes[s + 1]) + int(chain.x_bytes[s + 1]))
                    later_replay = max(
                        later_replay, int(chain.replay_fwd_peak_bytes[s + 1]) + int(chain.x_bytes[s + 1])
                    )
                    if chain.late_inputs or chain.code_held_inputs:
                        # A late input s..q-1 made and took, alive at q's forward (NOTE [ Late inputs made
                        # inside a segment ]): it depends on s, so over every q again.
                        for q in range(s + 1, t + 1):
                            made = chain.late_made_bytes(s, q)
                            if made:
                                x_q = int(chain.x_bytes[q]) + made
                                later = max(later, int(chain.fwd_peak_bytes[q]) + x_q)
                                later_replay = max(later_replay, int(chain.replay_fwd_peak_bytes[q]) + x_q)
                if not chain.startable[s]:  # it may be recomputed only with the block before it
                    shifted[s, t + 1] = _INF
                    continue
                nosave_bytes[s, t + 1] = int(max(int(chain.fwd_peak_bytes[s]), later)) + int(chain.ckpt_state_bytes)
                nosave = int(max(int(chain.replay_fwd_peak_bytes[s]), later_replay)) + int(chain.ckpt_state_bytes)
                nosave_replay[s, t + 1] = nosave
                # The checkpoint holds s's freed input through the inner plan (Chain.freed_input_bytes).
                w = _shift(start_rows[s], inner_units[t + 1] + hold_units[s][t + 1], shifted[s, t + 1])
                # The replay of s..t stops after t's last saved tensor (Chain.stop_ms).
                np.add(w, fsum + float(chain.ckpt_call_ms) - float(chain.stop_ms[t]), out=w)
                w[: max(0, min(_ceil_div(nosave - slack[s], u), size))] = _INF
    return table


def _rebuild(table: _Table, s: int, t: int, m: int, start: bool = False) -> tuple[Op, ...]:
    """The plan realising ``opt(s, t, m)`` (finite; ``start``: ``opt_start``, the inner plan of a checkpoint
    from ``s``), by re-evaluating the candidates in order."""
    ops: list[Op] = []
    if start:
        how, j = table.start_choice(s, t, m)
        if j >= 0:  # s kept first (or alone)
            ops.append(_kept_op(s, how))  # type: ignore[arg-type]
            if s == t:
                return tuple(ops)
            m, s = j, s + 1
        else:  # a nested checkpoint s..k-1 first
            k = cast(int, how)  # the nested checkpoint's end
            inner_m = table.shift_index(m, table.inner_units[k] + table.hold_units[s][k])
            ops.append(Recompute(s, k, _rebuild(table, s, k - 1, inner_m, start=True)))
            m, s = table.shift_index(m, table.rest_units_after(s, k)), k  # type: ignore[arg-type,assignment]
    while s < t:
        value = table.opt[s, t, m]
        choice = table.keep_choice(s, t, m, value)
        if choice is not None:
            ops.append(_kept_op(s, choice[0]))
            m = choice[1]
            s += 1
            continue
        for k in table.candidates(s, t):
            if m >= table.nosave_ok(s, t, k) and table.rest_value(s, t, k, m) + table.shifted[s, k, m] == value:
                inner_m = table.shift_index(m, table.inner_units[k] + table.hold_units[s][k])
                ops.append(Recompute(s, k, _rebuild(table, s, k - 1, inner_m, start=True)))
                m, s = table.shift_index(m, table.rest_units_after(s, k)), k
                break
        else:  # pragma: no cover - the fill and this loop evaluate the same expressions
            raise RematError(f"solve: internal error, no candidate reproduces opt({s}, {t}, {m}) = {value}")
    if t < table.n:
        last = table.keep_choice(t, t, m, table.opt[t, t, m])
        if last is None:  # pragma: no cover - the fill and this loop evaluate the same expressions
            raise RematError(f"solve: internal error, no way of keeping block {t} reproduces opt({t}, {t}, {m})")
        ops.append(_kept_op(t, last[0]))
    return tuple(ops)


def solve(
    chain: Chain,
    headroom_bytes: int,
    *,
    nested: bool = True,
    slots: int | None = None,
    sub_costs: SubCosts | None = None,
    top_level_variants: bool = False,
) -> tuple[Op, ...] | None:
    """The fastest plan whose chain peak stays within ``base_bytes + headroom_bytes``.

    A rotor-style dynamic program (NOTE [ Rotor dynamic program ]). The caller checks
    ``pre_peak_bytes`` and ``tail_peak_bytes`` against its budget separately: they do not depend on
    the plan.

    Args:
        chain: The measured chain of ``n`` blocks and the head.
        headroom_bytes: Memory available to the chain (head included) above ``base_bytes``, bytes.
            A negative headroom has no plan.
        nested: ``True`` for nested recomputation (rotor); ``False`` for the best set of blocks
            checkpointed one by one (knapsack).
        slots: Number of memory units the headroom is divided into (more: closer to optimal,
            slower; time grows as ``n**3 * slots``). ``None`` picks exact 1-byte units up to 4096
            bytes of headroom, else 1000 units up to about 160 blocks, falling to 500 at 200
            blocks and 250 from about 250 blocks.
        sub_costs: Optional ways to keep a block with sub-modules checkpointed inside it (as for
            :func:`simulate`); the solver then also chooses ``RecomputeSub`` (NOTE [ Keep variants ]).
        top_level_variants: Allow sub-module variants only where a block is kept at the top level of
            the plan, not inside a segment (op-level policies always are): with ``nested=False`` and no
            op-level costs the plan is then one that torch.compile traces without graph breaks (op-level
            policies run eagerly under it: NOTE [ Under torch.compile ]).

    Returns:
        The plan with the least simulated ``total_ms`` among those the rounding lets through (with
        1-byte units: among all plans), ties going to the plan that keeps earliest; ``None`` when no
        plan fits. Its simulated chain peak never exceeds ``base_bytes + headroom_bytes``.

    Raises:
        RematError: If ``slots`` is given and is below 1.
    """
    if slots is not None and slots < 1:
        raise RematError(f"solve: slots={slots} must be at least 1; pass None to choose automatically.")
    if headroom_bytes < 0:
        return None
    headroom_bytes = int(headroom_bytes)
    if slots is None:
        slots = headroom_bytes if headroom_bytes <= _EXACT_MAX_BYTES else _auto_slots(chain.n)
    unit_bytes = max(1, _ceil_div(headroom_bytes, max(1, slots)))
    top_units = headroom_bytes // unit_bytes
    table = _fill(chain, unit_bytes, top_units, nested, _variants(chain, sub_costs, top_level_variants))
    if not math.isfinite(table.opt[0, chain.n, top_units]):
        return None
    return _rebuild(table, 0, chain.n, top_units)


# ----------------------------------------------------------------------------------------------
# The lowest peak
# ----------------------------------------------------------------------------------------------


# Stands for "infeasible" in the integer peak tables (a segment over a block that may not be recomputed).
_BIG = 1 << 62


def _grads_after(chain: Chain) -> list[int]:
    """``out[j] = G[j] + ... + G[n]``: the gradients held once blocks ``j..n`` ran their backward (``out[n+1] = 0``)."""
    out = [0] * (chain.n + 2)
    for j in range(chain.n, -1, -1):
        out[j] = out[j + 1] + int(chain.grad_bytes[j])
    return out


def _held(chain: Chain) -> list[int]:
    """What a checkpoint ending before block ``k`` holds (single-block segments; see ``Chain.segment_bytes``),
    and at least the inputs that any longer segment ending there holds beyond that: those of its first
    block that the block does not save (``unsaved_input_bytes``) and those the blocks after it take from
    outside the segment (``unlinked_bytes``; T5's position bias, made by a stack's first layer). The
    tables cannot tell segments ending at ``k`` apart by their start, so they take the most (safe side)."""
    out = []
    for k in range(chain.n + 1):
        if not k:
            out.append(int(chain.x_bytes[0]) + int(chain.ckpt_state_bytes))
            continue
        best, through = 0, 0
        s = k - 1
        own_late = chain.late_held_bytes(k - 1, k)
        while s > 0 and chain.joinable[s - 1] and chain.recomputable[s - 1]:
            through += int(chain.unlinked_bytes[s])
            s -= 1
            best = max(
                best,
                chain.first_input_bytes(s)
                + through
                - chain.first_input_bytes(k - 1)
                + chain.late_held_bytes(s, k)
                - own_late
                # Made inside and held by the model's code (NOTE [ Late inputs made inside a segment ]).
                + chain.late_made_bytes(s, k),
            )
        out.append(chain.segment_bytes(k - 1, k) + max(0, best))
    return out


def _hold_table(chain: Chain) -> npt.NDArray[np.int64]:
    """``[s, k]``: what the replay of a checkpoint ``s..k-1`` runs above from its start (:func:`_replay_hold`;
    0 for ``k <= s``)."""
    n = chain.n
    out = np.zeros((n + 1, n + 1), dtype=np.int64)
    for s in range(n):
        for k in range(s + 1, n + 1):
            out[s, k] = _replay_hold(chain, s, k)
    return out


def _replay_hold(chain: Chain, s: int, k: int) -> int:
    """What the replay of a checkpoint ``s..k-1`` runs above from its start, bytes: ``Chain.replay_hold_bytes``
    less the first block's freed input (``Chain.replay_input_bytes``, charged from the end of its replayed
    forward on), less the late inputs it made that ``Chain.segment_bytes`` charges and the forward freed
    (NOTE [ Late inputs made inside a segment ]; the replay's own kept blocks charge them again), as the
    simulator's backward."""
    return chain.replay_hold_bytes(s, k) - chain.replay_input_bytes(s) - chain.late_made_bytes(s, k)


def _start_kept_peak(way: _PeakWay, first: int, grads: int, rest: int, pending: int) -> int:
    """Peak of keeping a block (this way) first in a replay's inner plan, before a range whose peak is ``rest``:
    its freed input (``first``) is held from the end of its forward on (NOTE [ The replay's first block ])."""
    _fqns, keep, _fwd_peak, keep_bwd_peak, _last, replay_fwd = way
    return max(replay_fwd + pending, keep_bwd_peak + first + grads, keep + first + rest)


def _start_last_peak(way: _PeakWay, first: int, freed: int, pending: int) -> int:
    """Peak of a block (this way) alone as a replay's inner plan: its freed input held after its forward."""
    _fqns, _keep, _fwd_peak, keep_bwd_peak, _last, replay_fwd = way
    return max(replay_fwd + pending, keep_bwd_peak - freed + first)


_PeakWay = tuple[VariantId | _TopOnly | None, int, int, int, int, int]


def _peak_ways(chain: Chain, variants: list[list[_Variant]]) -> list[list[_PeakWay]]:
    """Per block, per way of keeping it: (sub-modules, S, fp, S + bp, peak as the last block of a range, fp in
    a replay). The last block of a range ``s..s`` with ``s < n`` runs in a replay: its own forward peak."""
    out = []
    for s, ways in enumerate(variants):
        freed = int(chain.out_free_bytes[s]) if s < chain.n else 0
        out.append(
            [
                (fqns, keep, fp, keep + bp, max(rfp if s < chain.n else fp, keep - freed + bp), rfp)
                for fqns, keep, fp, bp, _extra, rfp in ways
            ]
        )
    return out


def _kept_peak(way: _PeakWay, grads: int, rest: int, pending: int = 0, replay: bool = False) -> int:
    """Peak of keeping a block (this way) before a range whose peak is ``rest`` and whose backward
    allocates ``grads`` bytes of gradients, above the block's entry level; its forward runs above
    ``pending`` bytes (a replay's, see ``_peak_table``; ``replay``: without the code before it)."""
    _fqns, keep, fwd_peak, keep_bwd_peak, _last, replay_fwd = way
    return max((replay_fwd if replay else fwd_peak) + pending, keep_bwd_peak + grads, keep + rest)


def _last_peak(way: _PeakWay, pending: int = 0) -> int:
    """Peak of a block (this way) as the last of a range, its forward above ``pending`` bytes."""
    _fqns, keep, fwd_peak, keep_bwd_peak, last, replay_fwd = way
    return max(last, replay_fwd + pending)


def _peak_table(
    chain: Chain, nested: bool, variants: list[list[_Variant]]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``P[s, t]``: the least chain peak of running ``s..t`` above its entry level, ``nosave``, and ``P`` of
    ``s..t`` as the inner plan of a checkpoint from ``s`` (NOTE [ The replay's first block ]; ``t < n``)."""
    n = chain.n
    x = np.asarray(_held(chain), dtype=np.int64)  # what a checkpoint holds
    ways = _peak_ways(chain, variants)
    nosave = np.zeros((n + 1, n + 1), dtype=np.int64)  # nosave[s, k] for s < k
    nosave_replay = np.zeros((n + 1, n + 1), dtype=np.int64)  # the same in a replay (Chain.replay_fwd_peak_bytes)
    for s in range(n):
        running, running_replay = int(chain.fwd_peak_bytes[s]), int(chain.replay_fwd_peak_bytes[s])
        for k in range(s + 1, n + 1):
            blocked = not chain.startable[s] or not all(chain.recomputable[s:k]) or not all(chain.joinable[s : k - 1])
            nosave[s, k] = _BIG if blocked else running + int(chain.ckpt_state_bytes)
            nosave_replay[s, k] = _BIG if blocked else running_replay + int(chain.ckpt_state_bytes)
            if k < n:
                # A late input made inside and held by the model's code is alive there too (NOTE [ Late
                # inputs made inside a segment ]).
                made = chain.late_made_bytes(s, k)
                running = max(running, int(chain.fwd_peak_bytes[k]) + int(chain.x_bytes[k]) + made)
                running_replay = max(running_replay, int(chain.replay_fwd_peak_bytes[k]) + int(chain.x_bytes[k]) + made)
    # NOTE [ Gradients in the program ]: the backward of s..k-1 runs above the gradients of k..t.
    after = np.asarray(_grads_after(chain), dtype=np.int64)
    pending = np.asarray([chain.replay_above_bytes(t) for t in range(n)] + [0], dtype=np.int64)
    hold = _hold_table(chain)
    peak = np.zeros((n + 1, n + 1), dtype=np.int64)
    start = np.zeros((n + 1, n + 1), dtype=np.int64)
    first = [chain.replay_input_bytes(s) for s in range(n)] + [0]
    freed = [int(chain.out_free_bytes[s]) for s in range(n)] + [0]
    for t in range(n + 1):
        # s..t with t < n runs as (part of) a replay's inner plan: its forwards above pending[t].
        pend = int(pending[t]) if t < n else 0
        peak[t, t] = min(_last_peak(way, pend) for way in ways[t] if _allowed(way[0], t, t, n))
        if t < n:
            start[t, t] = min(
                _start_last_peak(way, first[t], freed[t], pend) for way in ways[t] if _allowed(way[0], t, t, n)
            )
        # And without the code between blocks, which a replay does not run (Chain.replay_fwd_peak_bytes).
        replay, nos = t < n, nosave if t == n else nosave_replay
        for s in range(t - 1, -1, -1):
            grads = int(after[s + 1] - after[t + 1])
            best = min(
                _kept_peak(way, grads, int(peak[s + 1, t]), pend, replay)
                for way in ways[s]
                if _allowed(way[0], s, t, n)
            )
            hi = t + 1 if nested else s + 2
            ks = slice(s + 1, hi)
            inner = after[ks] - after[t + 1] + start[s, s : hi - 1] + hold[s, ks]
            rest = peak[ks, t].copy()
            if hi == n + 1:  # the head alone after a checkpoint s..n-1 runs higher (Chain.head_freed_bytes(s))
                rest[-1] += chain.head_freed_bytes(s)
            cand = np.maximum(nos[s, ks] + pend, x[ks] + np.maximum(rest, inner))
            peak[s, t] = min(best, int(cand.min()))
            if t < n:
                start[s, t] = min(
                    int(cand.min()),
                    *(
                        _start_kept_peak(way, first[s], grads, int(peak[s + 1, t]), pend)
                        for way in ways[s]
                        if _allowed(way[0], s, t, n)
                    ),
                )
    return peak, np.stack((nosave, nosave_replay)), start


def min_peak_plan(
    chain: Chain, *, nested: bool = True, sub_costs: SubCosts | None = None, top_level_variants: bool = False
) -> tuple[Op, ...]:
    """A plan reaching the lowest simulated peak of all plans (see :func:`min_peak`).

    Args:
        chain: The measured chain of ``n`` blocks and the head.
        nested: ``True`` to allow nested recomputation; ``False`` for single-level plans.
        sub_costs: Optional ways to keep a block with sub-modules checkpointed (NOTE [ Keep variants ]).
        top_level_variants: As for :func:`solve`.

    Returns:
        The plan; among plans with the lowest peak, the one that keeps earliest, then checkpoints the
        shortest segment (not necessarily the fastest).
    """
    variants = _variants(chain, sub_costs, top_level_variants)
    peak, nosave, start_peak = _peak_table(chain, nested, variants)
    ways = _peak_ways(chain, variants)
    n = chain.n
    x = _held(chain)  # what a checkpoint holds
    after = _grads_after(chain)
    hold = _hold_table(chain)

    def checkpoint_first(s: int, t: int, target: int, pend: int, nos: npt.NDArray[np.int64]) -> int | None:
        for k in range(s + 1, t + 1 if nested else s + 2):
            inner = after[k] - after[t + 1] + int(start_peak[s, k - 1]) + int(hold[s, k])
            rest = int(peak[k, t]) + (chain.head_freed_bytes(s) if k == n else 0)
            if max(int(nos[s, k]) + pend, int(x[k]) + max(rest, inner)) == target:
                return k
        return None

    def build(s: int, t: int, start: bool = False) -> tuple[Op, ...]:
        ops: list[Op] = []
        pend = chain.replay_above_bytes(t) if t < n else 0
        nos = nosave[0] if t == n else nosave[1]
        if start:  # the inner plan of a checkpoint from s (NOTE [ The replay's first block ])
            target, fi = int(start_peak[s, t]), chain.replay_input_bytes(s)
            freed = int(chain.out_free_bytes[s])
            if s == t:
                return (
                    _kept_op(
                        s,
                        next(
                            w[0]
                            for w in ways[s]
                            if _allowed(w[0], s, t, n) and _start_last_peak(w, fi, freed, pend) == target
                        ),
                    ),
                )
            grads = after[s + 1] - after[t + 1]
            kept = [
                way[0]
                for way in ways[s]
                if _allowed(way[0], s, t, n) and _start_kept_peak(way, fi, grads, int(peak[s + 1, t]), pend) == target
            ]
            if kept:
                ops.append(_kept_op(s, kept[0]))
                s += 1
            else:
                k = checkpoint_first(s, t, target, pend, nos)
                if k is None:  # pragma: no cover - mirrors _peak_table
                    raise RematError(f"min_peak: internal error, no candidate reproduces the replay's P({s}, {t})")
                ops.append(Recompute(s, k, build(s, k - 1, start=True)))
                s = k
        while s < t:
            grads = after[s + 1] - after[t + 1]
            kept = [
                way[0]
                for way in ways[s]
                if _allowed(way[0], s, t, n) and _kept_peak(way, grads, int(peak[s + 1, t]), pend, t < n) == peak[s, t]
            ]
            if kept:
                ops.append(_kept_op(s, kept[0]))
                s += 1
                continue
            k = checkpoint_first(s, t, int(peak[s, t]), pend, nos)
            if k is None:  # pragma: no cover - mirrors _peak_table
                raise RematError(f"min_peak: internal error, no candidate reproduces P({s}, {t}) = {peak[s, t]}")
            ops.append(Recompute(s, k, build(s, k - 1, start=True)))
            s = k
        if t < n:
            ops.append(
                _kept_op(
                    t,
                    next(w[0] for w in ways[t] if _allowed(w[0], t, t, n) and _last_peak(w, pend) == peak[t, t]),
                )
            )
        return tuple(ops)

    return build(0, n)


def min_peak(
    chain: Chain, *, nested: bool = True, sub_costs: SubCosts | None = None, top_level_variants: bool = False
) -> int:
    """The lowest simulated peak any plan reaches (recompute as much as helps), bytes.

    An exact ``O(n**3)`` recursion on peaks, the counterpart of NOTE [ Rotor dynamic program ] with
    ``max`` in place of ``+``.

    Args:
        chain: The measured chain of ``n`` blocks and the head.
        nested: ``True`` to allow nested recomputation; ``False`` for single-level plans.
        sub_costs: Optional ways to keep a block with sub-modules checkpointed (NOTE [ Keep variants ]).
        top_level_variants: As for :func:`solve`.

    Returns:
        ``max(pre_peak_bytes, base_bytes, base_bytes + lowest chain peak, base_bytes +
        tail_peak_bytes)``, bytes: the ``peak_bytes`` :func:`simulate` gives :func:`min_peak_plan`.
    """
    peak, _, _ = _peak_table(chain, nested, _variants(chain, sub_costs, top_level_variants))
    chain_peak = int(peak[0, chain.n])
    return max(
        int(chain.pre_peak_bytes),
        int(chain.base_bytes),
        int(chain.base_bytes) + chain_peak,
        int(chain.base_bytes) + int(chain.tail_peak_bytes),
    )


# ----------------------------------------------------------------------------------------------
# The plan space, for brute force
# ----------------------------------------------------------------------------------------------


def _plans(
    s: int, t: int, n: int, nested: bool, subs: Mapping[int, Sequence[VariantId | _TopOnly]]
) -> Iterator[tuple[Op, ...]]:
    kept: list[Op] = [Keep(s), *(_kept_op(s, v) for v in subs.get(s, ()) if _allowed(v, s, t, n))] if s < n else []
    if s == t:
        if t == n:
            yield ()
        else:
            yield from ((op,) for op in kept)
        return
    for op in kept:
        for rest in _plans(s + 1, t, n, nested, subs):
            yield (op, *rest)
    for k in range(s + 1, t + 1) if nested else (s + 1,):
        for inner in _plans(s, k - 1, n, nested, subs):
            for rest in _plans(k, t, n, nested, subs):
                yield (Recompute(s, k, inner), *rest)


def all_plans(
    n: int,
    *,
    nested: bool = True,
    subs: Mapping[int, Sequence[VariantId]] | None = None,
    top_level_variants: bool = False,
) -> Iterator[tuple[Op, ...]]:
    """Every plan the solvers choose from, for ``n`` blocks (brute force in tests; grows exponentially).

    Args:
        n: Number of blocks, the head excluded.
        nested: ``True`` for the plan space of nested recomputation; ``False`` for single-level plans.
        subs: For each block, the other ways it may be kept: sub-module groups checkpointed
            (``RecomputeSub``) or op-level policies (``RecomputeOps``, at the top level only).
        top_level_variants: As for :func:`solve`.

    Yields:
        Each plan once, keep-first plans before checkpoint-first ones.
    """
    if n < 0:
        raise RematError(f"all_plans: n={n} must be at least 0.")
    wrapped: dict[int, list[VariantId | _TopOnly]] = {
        k: [_TopOnly(tuple(v)) if top_level_variants and isinstance(v, tuple) else v for v in vs]
        for k, vs in (subs or {}).items()
    }
    yield from _plans(0, n, n, nested, wrapped)
