"""Models wrapped for data parallelism, and the process group's rank.

# NOTE [ Wrapped models ]
``DistributedDataParallel`` (and ``nn.DataParallel``) hold the model as ``.module``: block names gain
``module.`` and the wrapper's forward adds its own buffers (gradient buckets). Profile the wrapped
module (``ddp.module``), so these buffers are not charged as activations; ``remat.apply(ddp, plan)``
takes a plan made on the unwrapped model and applies it to ``ddp.module`` (``remat.remove(ddp)`` and
``remat.applied(ddp)`` look there too). FSDP2's ``fully_shard`` changes modules in place, keeping their
names; ``remat.blocks.fingerprint`` hashes the classes they had before sharding and the parameters'
global shapes, so a plan made before sharding fits the sharded model. A ``DistributedDataParallel``
with ``static_graph=True`` is not profiled through: the profile's backwards run outside DDP's forward
and its static-graph reducer counted them as training steps (the ranks' weights then drifted apart,
silently, helper-47); profile the model before wrapping it (``refuse_static_graph``).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["active", "rank", "refuse_static_graph", "unwrap"]


def active() -> bool:
    """Whether a ``torch.distributed`` process group with more than one rank is initialised."""
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    return int(torch.distributed.get_rank()) if active() else 0


def unwrap(model: nn.Module) -> nn.Module:
    """The module a data-parallel wrapper (``DistributedDataParallel``, ``nn.DataParallel``) holds, else ``model``.

    See NOTE [ Wrapped models ].
    """
    while isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        model = model.module
    return model


def refuse_static_graph(model: nn.Module, where: str) -> None:
    """Raise a :class:`~remat.errors.RematError` if ``model`` is (or wraps) a ``DistributedDataParallel`` with
    ``static_graph=True`` (NOTE [ Wrapped models ])."""
    from remat.errors import RematError

    while isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        if getattr(model, "static_graph", False):
            raise RematError(
                f"{where}: the model is a DistributedDataParallel with static_graph=True, whose reducer counts every "
                "backward through its parameters as a training step: the profile's own backwards would put its "
                "ranks out of step and training would go wrong silently; profile the model before wrapping it "
                "(remat.profile(model, ...), then remat.apply(ddp, plan)), or wrap it without static_graph"
            )
        model = model.module
