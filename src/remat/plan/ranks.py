"""One plan for every rank.

# NOTE [ One plan for every rank ]
A plan depends on measured times and bytes, and these differ between ranks (timings always, bytes
when the ranks' batches differ), so ranks that plan on their own choose different plans: their peaks
differ, FSDP2's ranks disagree on what runs when, and a run cannot be reproduced. Under an
initialised ``torch.distributed`` process group with more than one rank, ``remat.plan`` therefore is a
collective (every rank must call it, with the same arguments):

1. every rank's profile is gathered to every rank and merged field by field (:func:`merge_profiles`):
   the largest bytes and the longest time any rank measured, a block linked (a chain) only where it
   is linked on every rank, the stateful buffers of any rank; so the plan fits the worst rank;
2. every rank solves on that same merged profile;
3. rank 0's plan (or its error) is broadcast, every rank returns it, and a rank whose own solution
   differs says so in a warning (the solvers are deterministic, so this means the ranks differ).

Profiles stay per rank (``remat.profile`` runs no collective); ``remat.apply`` on each rank checks the
plan against the model there (its fingerprint), whether the plan came from ``remat.plan`` or from a
file. Ranks whose profiles are not of the same blocks raise ``PlanMismatchError`` on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from remat.core.wrapped import active, rank
from remat.errors import PlanMismatchError, RematError
from remat.plan.types import Plan

if TYPE_CHECKING:
    from remat.profile.types import Profile

__all__ = ["merge_profiles", "one_plan"]

log = logging.getLogger(__name__)


def _merge(values: Sequence[Any]) -> Any:
    """Merge one field across ranks: bytes and times by maximum, flags by "on every rank"."""
    first = values[0]
    if isinstance(first, bool):
        return all(values)
    if isinstance(first, (int, float)):
        return max(values)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        merged = {f.name: _merge([getattr(v, f.name) for v in values]) for f in dataclasses.fields(first) if f.init}
        return type(first)(**merged)
    if isinstance(first, tuple) and all(isinstance(v, tuple) for v in values):
        if all(isinstance(x, str) for v in values for x in v):
            return tuple(dict.fromkeys(x for v in values for x in v))  # names (stateful buffers): any rank's
        if len({len(v) for v in values}) == 1:
            return tuple(_merge(list(items)) for items in zip(*values))
    return first


def merge_profiles(profiles: Sequence[Profile]) -> Profile:
    """One profile that fits every rank: each figure the largest any rank measured (NOTE [ One plan for every rank ]).

    Args:
        profiles: One profile per rank, rank 0 first.

    Returns:
        Rank 0's blocks with, per figure, the maximum over ranks (bytes, milliseconds, FLOPs); a flag
        (``is_chain``, ``linked``) only where it holds on every rank; stateful buffers of any rank.

    Raises:
        PlanMismatchError: If the ranks profiled different blocks (fingerprints or sub-modules differ).
        RematError: If ``profiles`` is empty.
    """
    if not profiles:
        raise RematError("plan: no profiles to merge; pass one profile per rank")
    first = profiles[0]
    for r, p in enumerate(profiles[1:], start=1):
        subs = [tuple(s.fqn for s in bp.subs) for bp in p.block_profiles]
        if (
            p.fingerprint != first.fingerprint
            or len(p.block_profiles) != len(first.block_profiles)
            or subs != [tuple(s.fqn for s in bp.subs) for bp in first.block_profiles]
        ):
            raise PlanMismatchError(
                f"plan: rank {r} profiled {len(p.blocks)} blocks with fingerprint {p.fingerprint}, rank 0 "
                f"{len(first.blocks)} with {first.fingerprint}; every rank must profile the same model with the "
                "same blocks (remat.profile(model, ...) with the same blocks=... on every rank)"
            )
    merged = _merge(profiles)
    return dataclasses.replace(
        merged, blocks=first.blocks, fingerprint=first.fingerprint, model=first.model, device=first.device
    )


def _gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def one_plan(profile: Profile, solve: Callable[[Profile], Plan]) -> Plan:
    """``solve`` on the profiles of every rank merged, and rank 0's result on every rank (a collective).

    NOTE [ One plan for every rank ]. Without an active process group, ``solve(profile)``.

    Args:
        profile: This rank's profile.
        solve: Makes a plan from a profile (``remat.plan`` without the agreement).

    Returns:
        Rank 0's plan, identical on every rank.

    Raises:
        PlanMismatchError: If the ranks profiled different blocks.
        RematError: Rank 0's error (``BudgetInfeasibleError`` ...), on every rank.
    """
    if not active():
        return solve(profile)
    merged = merge_profiles(_gather(profile))
    mine: Plan | None = None
    error: Exception | None = None
    try:
        mine = solve(merged)
    except Exception as e:  # re-raised below, once every rank has taken part in the broadcast
        error = e
    payload: list[Any] = [mine.to_json() if mine is not None else None, None if error is None else str(error)]
    torch.distributed.broadcast_object_list(payload, src=0)
    text, message = payload
    if text is None:
        if error is not None:
            raise error
        raise RematError(f"plan: rank 0 found no plan ({message}) where rank {rank()} found one; the ranks differ")
    if error is not None:
        log.warning("plan: rank %d found no plan (%s); using rank 0's", rank(), error)
    elif mine is not None and mine.to_json() != text:
        log.warning(
            "plan: rank %d solved %s, rank 0 %s; using rank 0's",
            rank(),
            mine.describe(),
            Plan.from_json(text).describe(),
        )
    return mine if rank() == 0 and mine is not None else Plan.from_json(text)
