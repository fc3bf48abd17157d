"""``_dropped_outputs`` on a traced step where the allocator hands a dropped side output's address to a later
block's input (h132). Layers return ``(hidden, scores)`` and the model drops the scores when the next call
rebinds the name; the tensor the code makes next, as large, lands at the freed address and a later block takes
it. Matched by address alone, the scores read as "taken by a later block" and were charged as held to their
segment's backward; which layers were missed changed from one profile to the next with the allocator (full()
over six such layers predicted at 1,794,984 / 2,052,000 / 2,050,464 / 1,798,056 bytes in four profiles of one
model, measured 1,537,448).
"""

from __future__ import annotations

from types import SimpleNamespace

from remat.core.probe import Event
from remat.core.trace import MemoryTrace
from remat.profile.profiler import _dropped_outputs

X, A, S, B, C, D = 0x100, 0x200, 0x300, 0x400, 0x500, 0x600  # addresses
H, SC = 100, 200  # bytes of a hidden state, of a layer's scores


def _trace(events: list[tuple[int, int, int]], marks: list[tuple[str, int]]) -> MemoryTrace:
    level, levels = 0, []
    for _, _, delta in events:
        level += delta
        levels.append(level)
    return MemoryTrace(
        t_ns=tuple(t for t, _, _ in events),
        level_bytes=tuple(levels),
        marks=tuple(sorted(marks, key=lambda m: m[1])),
        peak_bytes=max(levels),
        duration_ns=100,
        device="cpu",
        ptrs=tuple(p for _, p, _ in events),
        deltas=tuple(d for _, _, d in events),
    )


def test_a_reused_address_is_not_a_later_input() -> None:
    f, e = Event.FORWARD, Event.FORWARD_END
    events = [
        (11, A, H),
        (12, S, SC),  # block 0 makes its hidden state and its scores
        (21, B, H),
        (22, C, SC),  # block 1
        (24, S, -SC),  # block 0's scores dropped as `sim` is rebound after block 1 returns
        (25, S, SC),  # the code's next tensor, as large, at the freed address: block 2 takes it
        (31, D, H),  # block 2
        (34, C, -SC),  # block 1's scores dropped in the head
    ]
    marks = [(f"{f}0", 10), (f"{e}0", 13), (f"{f}1", 20), (f"{e}1", 23), (f"{f}2", 30), (f"{e}2", 33), ("loss", 40)]
    tracked = SimpleNamespace(
        inputs=[{X: H}, {A: H}, {B: H, S: SC}],
        outputs=[{A: H, S: SC}, {B: H, C: SC}, {D: H}],
    )
    dropped = _dropped_outputs(_trace(events, marks), tracked, 3)  # type: ignore[arg-type]
    # Block 0's scores die after block 1 (its gap), block 1's in the head (after the last block, 2).
    assert dropped[0] == ((1, SC),)
    assert dropped[1] == ((2, SC),)
