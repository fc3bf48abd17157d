"""``remat.timeline``: memory over one training step, with its phases and every block's runs marked.

The step is recorded by :func:`remat.core.trace.record_memory` (every allocation and free, see
NOTE [ What a step's peak means ]) while :func:`remat.profile.profiler.probe` leaves a marker at each
block boundary; the markers become the forward/backward phases and one interval per block run.

# NOTE [ Real forward runs ]
With a plan applied, every call the model makes to a block is a real run (NOTE [ Spans ] in
``remat.core.runtime``): the probe's hooks see it as usual. A recomputation replays the calls without
going through ``__call__``, so no module hook fires for a replayed block; remat's runner reports those
runs (``remat.core.runtime.observed``): start, and end or raise. A replay ends early by raising once
it has every tensor it needs, so a run ends when its last member returns or raises. Sub-modules
(``attention_only``/``ffn_only``) checkpointed on their own are replayed the same way and reported too.
Calls nest properly per block, so a stack per block pairs each end with its F. A real run after the
loss was computed is a recomputation.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from remat._json import Reader, read
from remat.apply import applied
from remat.blocks import Block, resolve
from remat.core import runtime as _runtime
from remat.core.probe import Event, probe
from remat.core.trace import Grads, Loop, OptimizerLike, device_of, iteration, mark, record_memory
from remat.errors import RematError
from remat.measure import _count_blocks

__all__ = ["Timeline", "Phase", "Interval", "timeline", "INTERVAL_KINDS"]

INTERVAL_KINDS = ("forward", "recompute", "backward")
"""The kinds of :class:`Interval`, in drawing order."""


class Phase(NamedTuple):
    """A phase of the step.

    Attributes:
        name: ``"forward"`` (up to the loss), ``"backward"`` or ``"optimizer"`` (its step, when the loop has one).
        start_ms: Start, milliseconds from the start of the step.
        end_ms: End, milliseconds from the start of the step.
    """

    name: str
    start_ms: float
    end_ms: float


class Interval(NamedTuple):
    """One run of a block.

    Attributes:
        block: The block's name (for a recomputed attention/FFN sub-module: its block's name).
        kind: ``"forward"``, ``"recompute"`` (a forward run during the backward) or ``"backward"``.
        start_ms: Start, milliseconds from the start of the step.
        end_ms: End, milliseconds from the start of the step.
    """

    block: str
    kind: str
    start_ms: float
    end_ms: float


@dataclass(frozen=True)
class Timeline:
    """Memory over one training step, with the phases and every block's runs.

    Times are taken under the torch profiler (which slows the step a little); memory is the exact
    allocation trace (see NOTE [ What a step's peak means ] in ``remat.core.trace``).

    Attributes:
        t_ms: Time of every allocation or free, milliseconds from the start of the step.
        bytes: Bytes allocated above the memory held before the step, after each event.
        phases: The forward phase (up to the loss), the backward phase and, when the loop has an
            optimizer, its step.
        intervals: Every block run as ``(block, kind, start_ms, end_ms)``, ordered by start.
        peak_bytes: Peak of the step above the held memory, bytes (the figure ``remat.measure`` reports).
        duration_ms: Length of the step, milliseconds.
        held_bytes: Memory held before the step (parameters, buffers, inputs, optimizer state, and
            gradients when held), bytes.
        plan: The label of the plan applied while recording (``"none"`` if nothing was applied).
        device: ``"cpu"`` or ``"cuda"``.
        loop: The iteration recorded (NOTE [ What a step's peak means ]; files written before loops
            existed recorded ``grads="held"``).
    """

    schema_version: ClassVar[int] = 1

    t_ms: tuple[float, ...]
    bytes: tuple[int, ...]
    phases: tuple[Phase, ...]
    intervals: tuple[Interval, ...]
    peak_bytes: int
    duration_ms: float
    held_bytes: int
    plan: str
    device: str
    loop: Loop = Loop(Grads.HELD)

    @property
    def peak_ms(self) -> float:
        """When the recorded level first reaches its highest value, milliseconds (0.0 for an empty trace)."""
        if not self.bytes:
            return 0.0
        top = max(self.bytes)
        return self.t_ms[self.bytes.index(top)]

    def runs(self, kind: str) -> dict[str, int]:
        """How many intervals of ``kind`` each block has (blocks without any are left out)."""
        out: dict[str, int] = {}
        for iv in self.intervals:
            if iv.kind == kind:
                out[iv.block] = out.get(iv.block, 0) + 1
        return out

    def to_json(self) -> str:
        """Serialise to a JSON string (with ``schema_version``)."""
        data = asdict(self)
        data["phases"] = [list(p) for p in self.phases]
        data["intervals"] = [list(iv) for iv in self.intervals]
        return json.dumps({"schema_version": self.schema_version, **data})

    @classmethod
    def from_json(cls, text: str) -> Timeline:
        """Read a timeline written by :meth:`to_json` (NOTE [ One loading policy ] in ``remat._json``).

        Raises:
            RematError: If the text is not a timeline of this schema version, or lacks or mistypes a field.
        """
        tl = read(cls, text, Reader("timeline", "record the timeline again with remat.timeline(...).to_json()"))
        if len(tl.t_ms) != len(tl.bytes):
            raise RematError(
                f"timeline json: field 't_ms' has {len(tl.t_ms)} entries and 'bytes' {len(tl.bytes)}, expected one "
                "time per level; record the timeline again with remat.timeline(...).to_json()"
            )
        return tl


def timeline(
    model: nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    blocks: Sequence[Block] | None = None,
    warmup: int = 1,
    grads: Grads | str = Grads.NONE,
    optimizer: OptimizerLike | None = None,
) -> Timeline:
    """Record memory over one iteration of the training loop on the model as it is (checkpointed or not).

    Runs ``warmup`` untimed iterations (they allocate the optimizer state, and the gradients when
    held), then one under the torch profiler with a marker at every block boundary. The model is left
    exactly as it was: parameters, gradients, buffers, RNG state, train/eval mode, the optimizer's
    state and any plan applied to it.

    Args:
        model: The model, with or without a remat plan applied.
        inputs: A tensor, a tuple of positional arguments or a dict of keyword arguments.
        loss_fn: Maps the model's output to a scalar loss.
        blocks: The blocks whose runs to mark (default: the applied plan's, else ``remat.blocks(model)``).
        warmup: Untimed iterations first, >= 1.
        grads: ``"none"`` (gradients set to ``None`` before each iteration) or ``"held"``, as for ``remat.measure``.
        optimizer: The optimizer whose ``step()`` ends the iteration, a factory of one, or ``None``.

    Returns:
        The :class:`Timeline`; its ``peak_bytes`` is the figure ``remat.measure`` reports.

    Raises:
        RematError: For ``warmup`` < 1, a loss that is not a scalar, or when the profiler loses markers.
    """
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise RematError(f"timeline: warmup={warmup!r} must be an int >= 1 (it also allocates the optimizer state)")
    dev = device_of(model, inputs)
    block_list = _count_blocks(model, blocks)
    members = resolve(model, block_list)
    firsts = [mods[0] for mods in members]
    sub_modules = [model.get_submodule(f) for b in block_list for f in (*b.attention_fqns, *b.ffn_fqns)]
    sub_block = [i for i, b in enumerate(block_list) for _ in (*b.attention_fqns, *b.ffn_fqns)]
    plan = applied(model)

    # Each event is (kind, index, real run): a probe Event, or "E"/"X" when a real run of a block / sub-module
    # ends (reported by the runtime), or "L" at the loss; its time is the marker e<sequence number> in the trace.
    events: list[tuple[str, int, bool]] = []

    def note(kind: str, index: int) -> None:
        if kind in (Event.FORWARD_END, Event.SUB_END):
            return  # ends come from the hooks below (NOTE [ Real forward runs ])
        events.append((kind, index, True))
        mark(f"e{len(events) - 1}")

    first_of = {id(m): i for i, m in enumerate(firsts)}
    last_of = {id(mods[-1]): i for i, mods in enumerate(members)}
    sub_of = {id(m): j for j, m in enumerate(sub_modules)}

    def runner_report(module: nn.Module, started: bool, _raised: bool) -> None:
        # NOTE [ Real forward runs ]: a replay calls forwards without hooks; the runner reports them.
        key = id(module)
        if started and key in first_of:
            events.append((Event.FORWARD, first_of[key], True))
            mark(f"e{len(events) - 1}")
        elif started and key in sub_of:
            events.append((Event.SUB, sub_of[key], True))
            mark(f"e{len(events) - 1}")
        elif not started and key in last_of:
            note("E", last_of[key])
        elif not started and key in sub_of:
            note("X", sub_of[key])

    def ended(kind: str, index: int, last: bool) -> Callable[..., None]:
        def hook(_mod: nn.Module, _args: Any, result: Any) -> None:
            if last or result is None:  # None: the forward raised (an early-stopped recomputation)
                note(kind, index)

        return hook

    def marked_loss(out: Any) -> torch.Tensor:
        loss = loss_fn(out)
        note("L", 0)  # train_step calls backward right after the loss
        return loss

    with iteration(model, inputs, loss_fn, grads=grads, optimizer=optimizer, where="timeline") as it:
        held = it.warm_up(warmup)
        handles = [
            m.register_forward_hook(ended("E", i, k == len(mods) - 1), always_call=True)
            for i, mods in enumerate(members)
            for k, m in enumerate(mods)
        ]
        handles += [m.register_forward_hook(ended("X", j, True), always_call=True) for j, m in enumerate(sub_modules)]
        try:
            with probe(model, block_list, note), _runtime.observed(runner_report):
                trace = record_memory(lambda: it.step(marked_loss), dev)
        finally:
            for h in handles:
                h.remove()

    stamps = trace.mark_times()
    try:
        times_ms = [stamps[f"e{seq}"][0] / 1e6 for seq in range(len(events))]
    except KeyError:
        raise RematError(
            "timeline: the profiler lost remat's block markers; run with no other profiler active"
        ) from None
    duration_ms = trace.duration_ns / 1e6
    # With an optimizer the backward ends where its step starts.
    bwd_end_ms = stamps["optimizer_start"][0] / 1e6 if "optimizer_start" in stamps else duration_ms
    intervals = _intervals(events, times_ms, [b.name for b in block_list], sub_block, bwd_end_ms)
    loss_ms = next((t for (kind, _, _), t in zip(events, times_ms, strict=True) if kind == "L"), bwd_end_ms)
    phases = [Phase("forward", 0.0, loss_ms), Phase("backward", loss_ms, bwd_end_ms)]
    if it.optimizer is not None:
        phases.append(Phase("optimizer", bwd_end_ms, duration_ms))
    return Timeline(
        t_ms=tuple(t / 1e6 for t in trace.t_ns),
        bytes=trace.level_bytes,
        phases=tuple(phases),
        intervals=intervals,
        peak_bytes=trace.peak_bytes,
        duration_ms=duration_ms,
        held_bytes=held,
        plan=plan.strategy if plan is not None else "none",
        device=trace.device,
        loop=it.loop,
    )


def _intervals(
    events: list[tuple[str, int, bool]],
    times_ms: list[float],
    names: list[str],
    sub_block: list[int],
    bwd_end_ms: float,
) -> tuple[Interval, ...]:
    """Pair the boundaries into intervals (see NOTE [ Real forward runs ])."""
    out: list[Interval] = []
    open_runs: dict[tuple[str, int], list[tuple[float, bool]]] = {}
    bwd_start: dict[int, float] = {}
    bwd_end: dict[int, float] = {}
    in_backward = False
    for (kind, i, real), t in zip(events, times_ms, strict=True):
        if kind == "L":
            in_backward = True
        elif kind in (Event.FORWARD, Event.SUB):
            open_runs.setdefault((kind, i), []).append((t, real))
        elif kind in ("E", "X"):
            stack = open_runs.get((Event.FORWARD if kind == "E" else Event.SUB, i))
            if not stack:
                continue
            start, was_real = stack.pop()
            if not was_real:
                continue  # a dispatch or a pass-through
            if kind == "X":
                block = sub_block[i]
                if not in_backward or any(real for _, real in open_runs.get((Event.FORWARD, block), [])):
                    continue  # the sub-module ran inside its block's own run
                out.append(Interval(names[block], "recompute", start, t))
            else:
                out.append(Interval(names[i], "recompute" if in_backward else "forward", start, t))
        elif kind == Event.BACKWARD:
            bwd_start.setdefault(i, t)
        elif kind == Event.BACKWARD_END:
            bwd_end.setdefault(i, t)
    for i, start in bwd_start.items():
        # A block whose input needs no gradient reports no end of backward: it lasts to the end of the backward.
        out.append(Interval(names[i], "backward", start, bwd_end.get(i, bwd_end_ms)))
    out.sort(key=lambda iv: (iv.start_ms, INTERVAL_KINDS.index(iv.kind)))
    return tuple(out)
