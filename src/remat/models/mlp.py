"""A chain of MLP blocks with deliberately uneven widths, so that per-block memory differs a lot.

With equal blocks every checkpointing plan of the same shape costs the same; uneven widths make the
choice of *which* blocks to recompute matter, which is what a solver has to get right.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from remat.errors import RematError
from remat.models import Workload, _check_positive, _place, _seeded

__all__ = ["MLPBlock", "mlp_chain", "mlp_workload", "DEFAULT_WIDTHS"]

DEFAULT_WIDTHS: tuple[int, ...] = (128,) + (512, 192, 1024, 128, 768, 320, 1536, 256) * 3
"""Default widths of :func:`mlp_chain` (features): 24 blocks whose outputs span 12x in size
(enough blocks that no single block's working set dominates the step's peak)."""

_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {"gelu": nn.GELU, "relu": nn.ReLU, "tanh": nn.Tanh}


class MLPBlock(nn.Module):
    """``fc`` (Linear), an activation, and dropout when ``dropout > 0``.

    Args:
        in_features: Width of the input (features).
        out_features: Width of the output (features).
        activation: Name of the activation, a key of the activation registry (e.g. ``"gelu"``).
        dropout: Dropout probability, in ``[0, 1)``; 0 uses no dropout module at all.
    """

    def __init__(self, in_features: int, out_features: int, activation: str, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.act = _ACTIVATIONS[activation]()
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Runs the block.

        Args:
            x: Input of shape ``[..., in_features]``.

        Returns:
            Output of shape ``[..., out_features]``.
        """
        return self.drop(self.act(self.fc(x)))


def mlp_chain(
    *,
    widths: Sequence[int] = DEFAULT_WIDTHS,
    activation: str = "gelu",
    dropout: float = 0.0,
) -> nn.Sequential:
    """Builds a chain of :class:`MLPBlock` s (from the current CPU generator), on the CPU.

    Block ``i`` maps ``widths[i]`` features to ``widths[i + 1]``.

    Args:
        widths: Widths of the input and of each block's output (features); at least two entries.
        activation: ``"gelu"``, ``"relu"`` or ``"tanh"``.
        dropout: Dropout probability after each activation, in ``[0, 1)``.

    Returns:
        An ``nn.Sequential`` of ``len(widths) - 1`` blocks, in training mode.

    Raises:
        RematError: If ``activation`` is unknown, ``widths`` has fewer than two entries or a
            non-positive one, or ``dropout`` is outside ``[0, 1)``.
    """
    if activation not in _ACTIVATIONS:
        raise RematError(
            f"mlp_chain: unknown activation {activation!r}; valid activations are "
            f"{', '.join(sorted(_ACTIVATIONS))}. Pass one of them as activation=."
        )
    if not isinstance(widths, Sequence) or len(widths) < 2:
        raise RematError(
            f"mlp_chain: widths must be a sequence of at least two widths, got {widths!r}; "
            "pass the input width then each block's output width, e.g. widths=(256, 1024, 256)."
        )
    _check_positive("mlp_chain", **{f"widths[{i}]": w for i, w in enumerate(widths)})
    if not 0.0 <= dropout < 1.0:
        raise RematError(f"mlp_chain: dropout must be in [0, 1), got {dropout!r}; pass e.g. dropout=0.0.")
    return nn.Sequential(*(MLPBlock(a, b, activation, dropout) for a, b in zip(widths[:-1], widths[1:], strict=True)))


def mlp_workload(
    *,
    widths: Sequence[int] = DEFAULT_WIDTHS,
    activation: str = "gelu",
    batch: int = 256,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Workload:
    """An MLP chain on a batch of random vectors, with an MSE loss against a random target.

    Args:
        widths: Widths of the input and of each block's output (features).
        activation: ``"gelu"``, ``"relu"`` or ``"tanh"``.
        batch: Number of vectors in the batch.
        seed: Seed of the weights, the batch and the target (see NOTE [ Model seeding ]).
        device: Device of the model and the batch.
        dtype: Floating-point dtype of the parameters, the batch and the target.

    Returns:
        The workload; ``inputs`` has shape ``[batch, widths[0]]`` (it does not require grad) and
        the model's output ``[batch, widths[-1]]``.

    Raises:
        RematError: If a size or the activation is invalid (see :func:`mlp_chain`) or ``dtype`` is
            not floating point.
    """
    _check_positive("mlp", batch=batch)
    with _seeded(seed):
        model = mlp_chain(widths=widths, activation=activation)
        x = torch.randn(batch, widths[0])
        target = torch.randn(batch, widths[-1])
    _place(model, "mlp", device, dtype)
    x, target = x.to(device=device, dtype=dtype), target.to(device=device, dtype=dtype)

    def loss_fn(output: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    return Workload(
        name="mlp",
        model=model,
        inputs=x,
        loss_fn=loss_fn,
        description=f"MLP chain widths={tuple(widths)} ({activation}), batch {batch}",
    )
