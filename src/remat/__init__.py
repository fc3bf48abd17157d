"""remat: measured activation checkpointing for PyTorch.

The pipeline, one verb per stage::

    import remat
    prof = remat.profile(model, inputs, loss_fn)      # measure every block
    plan = remat.plan(prof, budget="40%")             # fastest plan under 40% of today's peak
    remat.apply(model, plan)                          # checkpoint in place
    m = remat.measure(model, inputs, loss_fn)         # what really happened
    remat.remove(model)                               # and back

``remat.apply`` and ``remat.check_gradients`` also take a strategy (``remat.full()`` ...) and plan it
first; ``remat.plan(model, strategy="every_nth(2)")`` makes that plan explicitly.
"""

from remat._facade import apply, check_gradients
from remat._version import __version__ as __version__
from remat.apply import CheckpointedSequential, applied, checkpoint, remove
from remat.blocks import Block, LayerType, blocks
from remat.compiled import CompiledPlan, plan_compiled
from remat.errors import (
    BlockSelectionError,
    BudgetInfeasibleError,
    MissingExtraError,
    PlanMismatchError,
    RematError,
    RematWarning,
)
from remat.measure import GradientCheck, Measurement, measure
from remat.measure.timeline import Timeline, timeline
from remat.plan import Frontier, Plan, Strategy, frontier, plan
from remat.plan.strategies import STRATEGIES
from remat.plan.strategies import attention_only as attention_only
from remat.plan.strategies import budget as budget
from remat.plan.strategies import dynamic as dynamic
from remat.plan.strategies import every_nth as every_nth
from remat.plan.strategies import ffn_only as ffn_only
from remat.plan.strategies import full as full
from remat.plan.strategies import largest as largest
from remat.plan.strategies import named as named
from remat.plan.strategies import none as none
from remat.plan.strategies import ratio as ratio
from remat.plan.strategies import segments as segments
from remat.plan.strategies import selective as selective
from remat.plan.strategies import sqrt as sqrt
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
    "RematWarning",
    *STRATEGIES,  # one constructor per registered strategy, imported above under the same name
    "accumulate",
    "autocast_step",
    "split_batch",
    "plan_compiled",
    "CompiledPlan",
]

del STRATEGIES
