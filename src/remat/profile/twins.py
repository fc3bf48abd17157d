"""Blocks that do the same work share their measured times (NOTE [ Twin blocks ])."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from statistics import median
from typing import Any

from torch import nn

from remat.profile.ops import BlockOps
from remat.profile.types import BlockProfile, Profile

__all__ = ["plain_rounds", "pool_twins", "twin_groups"]

# NOTE [ Twin blocks ]
# A profile times each block from few samples: ``repeats`` plain iterations, half as many with every
# block checkpointed, one under torch's selective checkpoint, and every op once. On a busy CPU one
# sample can be several times the rest (freed memory faulted back, another process): in one profile of
# workload A (12 identical GPT layers) four consecutive layers came out at 70-95 ms under the selective
# checkpoint where the other eight took 27-34, and two layers' ops summed to 36 ms where the others'
# took 20-26. The planner priced those layers' op-level policies 3x too high, and chose by the noise.
# Most models repeat one layer: blocks that run the same ops on tensors of the same sizes, with
# parameters of the same shapes, cost the same. Such twins (same member module types and parameter
# shapes, dtypes and ``requires_grad``; same ops with the same bytes, reads and storages; same FLOPs
# and input, output and saved bytes; same sub-modules) get the median over the group of each time:
# forward, backward, checkpointed forward, early-stop share, selective cost, each sub-module's and each
# op's. Twelve samples instead of one for the selective cost, at no cost. Memory is not pooled: it is
# measured exactly.


# NOTE [ Fewer plain iterations for twins ]
# Pooling gives each twin group ``repeats`` samples per block of every plain time, so a group of g
# twins has ``g * repeats``: workload A's twelve layers had 36 samples of each forward and backward
# from three plain iterations, each of which costs a step of the profile (issue #9 asks for at most
# ten on A). Where every block has at least one twin by its modules, ops and FLOPs (the part of the
# twin signature known before the timed iterations), the profile runs ``ceil(repeats / g)`` plain
# iterations for the smallest group size g, but never fewer than two (the step's own time, and the
# yardstick NOTE [ Disturbed iterations ] holds the checkpointed iterations to, are medians over the
# plain iterations, which have no twins) nor more than ``repeats``. A: two instead of three, 24
# samples of each layer's times. A block without a twin (workload B's 24 Linear / GELU / LayerNorm
# blocks, or a model's one odd layer) keeps ``repeats``: its times come from its own iterations only.


def _structure(members: Sequence[nn.Module], block_ops: BlockOps | None) -> tuple[Any, ...]:
    params = tuple(
        (
            type(sub).__name__,
            tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in sub.named_parameters(recurse=False)),
        )
        for m in members
        for sub in m.modules()
    )
    ops = (
        tuple(
            (op.key, op.out_bytes, op.saved_bytes, op.reads, op.storages, op.writes, op.random, op.view)
            for op in block_ops.ops
        )
        + (block_ops.stop, block_ops.saved_bytes, block_ops.input_saved_bytes)
        if block_ops is not None
        else None
    )
    return params, ops


def plain_rounds(
    members: Sequence[Sequence[nn.Module]],
    block_ops: Sequence[BlockOps],
    flops: Sequence[tuple[int, int]],
    repeats: int,
) -> int:
    """How many plain iterations to time for ``repeats`` samples of each block (NOTE [ Fewer plain
    iterations for twins ]): fewer where every block has twins by its modules, ops (``block_ops``; by
    its modules alone where it is empty) and forward and backward FLOPs (``flops``)."""
    sizes: dict[tuple[Any, ...], int] = {}
    keys = [(_structure(m, block_ops[i] if block_ops else None), flops[i]) for i, m in enumerate(members)]
    for key in keys:
        sizes[key] = sizes.get(key, 0) + 1
    smallest = min(sizes.values(), default=1)
    return min(repeats, max(2, -(-repeats // smallest)))


def _signature(members: Sequence[nn.Module], bp: BlockProfile, block_ops: BlockOps | None) -> tuple[Any, ...]:
    params, ops = _structure(members, block_ops)
    return (
        params,
        ops,
        tuple((s.saved_bytes, s.output_bytes, s.fqn.rsplit(".", 1)[-1]) for s in bp.subs),
        bp.input_bytes,
        bp.output_bytes,
        bp.saved_bytes,
        bp.fwd_flops,
        bp.bwd_flops,
        bp.selective_ms is None,
        bp.stateful,
        bp.edits_input,
    )


def twin_groups(members: Sequence[Sequence[nn.Module]], profile: Profile) -> list[tuple[int, ...]]:
    """The blocks of ``profile`` grouped by the work they do (NOTE [ Twin blocks ]), groups of two or more.

    Args:
        members: Each block's member modules (``remat.blocks.resolve``).
        profile: The profile, before pooling.
    """
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, bp in enumerate(profile.block_profiles):
        block_ops = profile.block_ops[i] if profile.block_ops else None
        groups.setdefault(_signature(members[i], bp, block_ops), []).append(i)
    return [tuple(g) for g in groups.values() if len(g) > 1]


def pool_twins(profile: Profile, groups: Sequence[tuple[int, ...]]) -> Profile:
    """``profile`` with each group's blocks given the group's median times (NOTE [ Twin blocks ])."""
    bps = list(profile.block_profiles)
    block_ops = list(profile.block_ops)
    for group in groups:
        twins = [profile.block_profiles[i] for i in group]

        def med(field: str, twins: list[BlockProfile] = twins) -> float:
            return median(getattr(bp, field) for bp in twins)

        selective = None if twins[0].selective_ms is None else med("selective_ms")
        subs = tuple(
            replace(
                sub,
                fwd_ms=median(bp.subs[j].fwd_ms for bp in twins),
                extra_ms=median(bp.subs[j].extra_ms for bp in twins),
            )
            for j, sub in enumerate(twins[0].subs)
        )
        fwd, bwd, ckpt, stop = med("fwd_ms"), med("bwd_ms"), med("ckpt_fwd_ms"), med("stop_ms")
        if block_ops:
            op_ms = [median(profile.block_ops[i].ops[k].ms for i in group) for k in range(len(block_ops[group[0]].ops))]
        for i in group:
            bps[i] = replace(
                bps[i],
                fwd_ms=fwd,
                bwd_ms=bwd,
                ckpt_fwd_ms=ckpt,
                stop_ms=stop,
                selective_ms=selective,
                subs=tuple(replace(own, fwd_ms=s.fwd_ms, extra_ms=s.extra_ms) for own, s in zip(bps[i].subs, subs)),
            )
            if block_ops:
                bo = block_ops[i]
                block_ops[i] = replace(bo, ops=tuple(replace(op, ms=ms) for op, ms in zip(bo.ops, op_ms)))
    return replace(profile, block_profiles=tuple(bps), block_ops=tuple(block_ops))
