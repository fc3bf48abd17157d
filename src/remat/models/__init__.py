"""The built-in reference models: a GPT, a ResNet, a U-Net and a chain of uneven MLP blocks.

Plain PyTorch, nothing downloaded. Each ``*_workload`` factory returns a :class:`Workload`: a model
built from a seed, a real batch and a loss, i.e. everything remat needs to profile, plan and measure
one training step. The module factories (:func:`gpt`, :func:`resnet`, :func:`unet`,
:func:`mlp_chain`) build the bare models.

Example::

    w = remat.models.workload("gpt", n_layers=4)
    loss = w.loss_fn(w.model(w.inputs))
    loss.backward()

# NOTE [ Model seeding ]
A workload is a pure function of its sizes and ``seed``: the model is initialised and the batch drawn
on the CPU from the CPU generator seeded with ``seed`` inside ``torch.random.fork_rng``, so the
caller's RNG state is left as it was and the same seed gives the same weights and batch on every
device; only then are the model and batch moved to ``device`` and ``dtype``. Dropout still draws
from the device's generator at run time (the model is returned in training mode).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.errors import RematError

__all__ = [
    "Workload",
    "WORKLOADS",
    "workload",
    "gpt",
    "gpt_workload",
    "GPT",
    "Block",
    "CausalSelfAttention",
    "MLP",
    "resnet",
    "resnet_workload",
    "ResNet",
    "BasicBlock",
    "Bottleneck",
    "unet",
    "unet_workload",
    "UNet",
    "DoubleConv",
    "Up",
    "mlp_chain",
    "mlp_workload",
    "MLPBlock",
]


@dataclass(frozen=True)
class Workload:
    """A model with a real batch and a loss: what remat profiles, plans and measures.

    Attributes:
        name: The registry name of the workload, e.g. ``"gpt"``.
        model: The model, in training mode, on the workload's device and dtype.
        inputs: The batch: a Tensor (called as ``model(x)``), a tuple (``model(*inputs)``) or a dict
            (``model(**inputs)``). Input tensors never require grad.
        loss_fn: Maps the model's output to a scalar loss tensor; the targets are closed over.
        description: One line with the sizes, e.g. ``"GPT 8x(d=128, h=4), batch 4x128 tokens"``.
    """

    name: str
    model: nn.Module
    inputs: Any
    loss_fn: Callable[[Any], torch.Tensor]
    description: str


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Runs the body with the CPU generator seeded by ``seed``; see NOTE [ Model seeding ].

    Args:
        seed: The seed, an int.

    Raises:
        RematError: If ``seed`` is not an int.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise RematError(f"models: seed must be an int, got {seed!r}; pass e.g. seed=0.")
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield


def _check_positive(where: str, **sizes: int) -> None:
    """Raises a RematError naming the first size that is not a positive int.

    Args:
        where: The factory's name, used as the message prefix, e.g. ``"gpt"``.
        **sizes: The sizes to check, by argument name (counts, not bytes).
    """
    for arg, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RematError(f"{where}: {arg} must be a positive int, got {value!r}; pass {arg} >= 1.")


def _place(module: nn.Module, where: str, device: str | torch.device, dtype: torch.dtype) -> nn.Module:
    """Moves a freshly built module to ``device`` and ``dtype``.

    Args:
        module: The module, on the CPU in float32.
        where: The factory's name, used as the message prefix.
        device: The target device, e.g. ``"cpu"`` or ``"cuda:0"``.
        dtype: The target floating-point dtype of parameters and floating-point buffers.

    Returns:
        The same module, moved.

    Raises:
        RematError: If ``dtype`` is not a floating-point dtype.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise RematError(
            f"{where}: dtype must be a floating-point torch.dtype, got {dtype!r}; "
            "pass e.g. dtype=torch.float32 or torch.bfloat16."
        )
    return module.to(device=device, dtype=dtype)


# The model files import Workload and the helpers above from this package, so they must be defined
# before these imports run (whichever of the two is imported first).
from remat.models.gpt import GPT, MLP, Block, CausalSelfAttention, gpt, gpt_workload  # noqa: E402
from remat.models.mlp import MLPBlock, mlp_chain, mlp_workload  # noqa: E402
from remat.models.resnet import BasicBlock, Bottleneck, ResNet, resnet, resnet_workload  # noqa: E402
from remat.models.unet import DoubleConv, UNet, Up, unet, unet_workload  # noqa: E402

WORKLOADS: dict[str, Callable[..., Workload]] = {
    "gpt": gpt_workload,
    "resnet": resnet_workload,
    "unet": unet_workload,
    "mlp": mlp_workload,
}
"""The built-in workloads by name; each factory takes keyword-only sizes, ``seed``, ``device``, ``dtype``."""


def workload(name: str, **sizes: Any) -> Workload:
    """Builds a registered workload by name.

    Args:
        name: A key of :data:`WORKLOADS`, e.g. ``"gpt"``.
        **sizes: Keyword arguments of that workload's factory (sizes, ``seed``, ``device``,
            ``dtype``); the factory's defaults fill in the rest.

    Returns:
        The workload.

    Raises:
        RematError: If ``name`` is not registered, or ``sizes`` names an argument its factory lacks.
    """
    factory = WORKLOADS.get(name)
    if factory is None:
        raise RematError(
            f"models: unknown workload {name!r}; valid names are {', '.join(sorted(WORKLOADS))}. "
            "Pass one of them, or build your own remat.models.Workload."
        )
    accepted = inspect.signature(factory).parameters
    unknown = sorted(set(sizes) - set(accepted))
    if unknown:
        raise RematError(
            f"models: workload {name!r} has no argument {', '.join(map(repr, unknown))}; "
            f"valid arguments are {', '.join(accepted)}."
        )
    return factory(**sizes)
