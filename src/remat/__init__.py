"""remat: measured activation checkpointing for PyTorch.

The pipeline, one verb per stage::

    import remat
    prof = remat.profile(model, inputs, loss_fn)      # measure every block
    plan = remat.plan(prof, budget="40%")             # fastest plan under 40% of today's peak
    remat.apply(model, plan)                          # checkpoint in place
    m = remat.measure(model, inputs, loss_fn)         # what really happened
    remat.remove(model)                               # and back
"""

from remat._version import __version__ as __version__
from remat.apply import CheckpointedSequential, applied, apply, checkpoint, remove
from remat.blocks import Block, LayerType, blocks
from remat.errors import (
    BlockSelectionError,
    BudgetInfeasibleError,
    MissingExtraError,
    PlanMismatchError,
    RematError,
)
from remat.measure import GradientCheck, Measurement, check_gradients, measure
from remat.measure.timeline import Timeline, timeline
from remat.plan import Frontier, Plan, Strategy, frontier, plan
from remat.plan.strategies import (
    attention_only,
    budget,
    dynamic,
    every_nth,
    ffn_only,
    full,
    largest,
    named,
    none,
    ratio,
    segments,
    selective,
    sqrt,
)
from remat.profile import BlockProfile, Profile, profile
from remat.train import accumulate, autocast_step, split_batch

__all__ = [
    "profile",
    "plan",
    "frontier",
    "apply",
    "remove",
    "applied",
    "measure",
    "check_gradients",
    "timeline",
    "checkpoint",
    "CheckpointedSequential",
    "blocks",
    "Block",
    "LayerType",
    "Profile",
    "BlockProfile",
    "Plan",
    "Frontier",
    "Strategy",
    "Measurement",
    "GradientCheck",
    "Timeline",
    "RematError",
    "BlockSelectionError",
    "BudgetInfeasibleError",
    "PlanMismatchError",
    "MissingExtraError",
    "none",
    "full",
    "every_nth",
    "selective",
    "dynamic",
    "ratio",
    "attention_only",
    "ffn_only",
    "largest",
    "budget",
    "segments",
    "sqrt",
    "named",
    "accumulate",
    "autocast_step",
    "split_batch",
]
