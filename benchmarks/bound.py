"""The least recomputation time any recompute plan needs to reach a memory budget (a lower bound).

Usage: python benchmarks/bound.py [--workloads A,B,gpt2,llama] [--budgets 50%,20%]

Why: issue #9 asks for plans at 50% of none's peak with at most 5% step overhead. This script
answers "is that possible at all on this machine, by recomputation?" with a bound that no plan, by
remat or any other tool that recomputes rather than offloads or compresses, can beat:

- Dropping a storage autograd saves lowers the step's peak by at most its size, so reaching a budget
  ``b`` from none's peak ``P`` drops at least ``P - b`` bytes of saved storages.
- Getting a dropped storage back for the backward runs at least the op that made it (bitwise equal
  gradients rule out any other formula), whose time the per-op profile measures (kernel time only:
  no checkpoint, dispatch or Python overhead, which only add), and every op between it and what
  autograd saved: an input of that op that nothing saved (a matmul's output that only feeds a
  residual add) has to be made again too. Such an op, needed by ``n`` of the saved storages, is
  charged ``1/n`` of its time to each, so any set of dropped storages is charged at most what
  recomputing the ops they need takes. Saved storages are taken as at hand (kept) when another
  storage needs them, which only lowers the charge.
- Storages saved outside the blocks (the embedding, the head) are counted as free to drop, and a
  block's saved input as free when no block made it: the bound only gets lower.

The least total time of storages whose bytes reach ``P - b`` is then a fractional knapsack: take
them by saved bytes per millisecond, the last one in part. The result is a lower bound on the extra
time of a step, reported against none's median step time from the same profile. ``--loose`` charges
each storage its own op's time only (the bound before the ops between were counted).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers  # noqa: E402

import remat  # noqa: E402
from remat.core.trace import call_model  # noqa: E402
from remat.units import format_bytes, parse_budget  # noqa: E402


def saved_storage_bytes(model: torch.nn.Module, inputs: Any) -> int:
    """Bytes of the unique storages autograd saves in one forward, parameters and buffers excluded."""
    own = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in own and st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = call_model(model, inputs)
    del out
    return sum(seen.values())


def _at_hand(bo: Any, i: int) -> bool:
    """Whether op ``i``'s output is there in the backward without running it: its storages are saved
    (by this block) or were not allocated by the block (a parameter, an input)."""
    return all(s < 0 or bo.ops[s].saved_bytes > 0 for s in bo.ops[i].storages)


def _needs(bo: Any, start: Sequence[int]) -> set[int]:
    """The ops that must run to get the outputs of ``start`` back: themselves, and every op they read
    whose output nothing saved, transitively (``_at_hand`` ops end the walk)."""
    need: set[int] = set()
    todo = list(start)
    while todo:
        i = todo.pop()
        if i in need:
            continue
        need.add(i)
        todo.extend(r for r in bo.ops[i].reads if r not in need and not _at_hand(bo, r))
    return need


def needs_per_storage(prof: remat.Profile, *, loose: bool = False) -> list[tuple[int, set[tuple[int, int]]]]:
    """Every storage the blocks save: ``(bytes, the ops getting it back runs as (block, op index))``.

    ``loose``: only the op that made it (module docstring).
    """
    ops = prof.block_ops
    wanted: list[tuple[int, set[tuple[int, int]]]] = []
    for i, bo in enumerate(ops):
        for op in bo.ops:
            if op.saved_bytes:
                needs = {op.index} if loose else _needs(bo, [op.index])
                wanted.append((op.saved_bytes, {(i, j) for j in needs}))
        if bo.input_saved_bytes:
            # Made by the previous block's output ops (free when no block made it).
            prev = ops[i - 1] if i else None
            outs = list(prev.outputs) if prev is not None else []
            needs = set(outs) if loose or prev is None else _needs(prev, outs)
            wanted.append((bo.input_saved_bytes, {(i - 1, j) for j in needs}))
    return wanted


def candidates(prof: remat.Profile, *, loose: bool = False) -> list[tuple[int, float]]:
    """``(saved bytes, least ms to get them back)`` for every storage the blocks save: an op that
    ``n`` storages need is charged ``1/n`` of its time to each (module docstring)."""
    wanted = needs_per_storage(prof, loose=loose)
    shared: dict[tuple[int, int], int] = {}
    for _, needs in wanted:
        for u in needs:
            shared[u] = shared.get(u, 0) + 1
    ops = prof.block_ops
    return [(size, sum(ops[b].ops[j].ms / shared[(b, j)] for b, j in needs)) for size, needs in wanted]


def least_ms(items: list[tuple[int, float]], need: int) -> float | None:
    """The fractional knapsack: least time whose bytes reach ``need`` (``None``: they do not)."""
    total = 0.0
    for size, ms in sorted(items, key=lambda it: it[1] / it[0]):
        if need <= 0:
            break
        take = min(1.0, need / size)
        total += take * ms
        need -= size * take
    return total if need <= 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="A,B")
    ap.add_argument("--budgets", default="50%,20%")
    ap.add_argument("--loose", action="store_true", help="charge each storage its own op's time only")
    args = ap.parse_args()
    print(
        "| workload | none's peak | budget | bytes to drop | of them, saved in blocks | least recompute | of none's step |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in args.workloads.split(","):
        w = peers.build(name, small=False)
        prof = remat.profile(w.model, w.inputs, w.loss_fn, progress=False)
        peak = prof.peak_bytes  # above the memory held before the step, as budgets are
        items = candidates(prof, loose=args.loose)
        in_blocks = sum(size for size, _ in items)
        outside = max(0, saved_storage_bytes(w.model, w.inputs) - in_blocks)
        for budget in args.budgets.split(","):
            parsed = parse_budget(budget)
            b = int(parsed.fraction * peak) if parsed.fraction is not None else int(parsed.bytes or 0)
            need = peak - b
            ms = least_ms(items, need - outside)
            cell = "infeasible by recomputation" if ms is None else f"{ms:.1f} ms | {ms / prof.step_ms:+.1%}"
            print(
                f"| {name} | {format_bytes(peak)} | {budget} | {format_bytes(need)} | "
                f"{format_bytes(in_blocks)} (+{format_bytes(outside)} outside, counted free) | {cell} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
