"""Training helpers that work under any remat plan: gradient accumulation and mixed precision.

Both helpers run the model *as it is*: apply a plan first (``remat.apply(model, remat.full())``) and
they checkpoint accordingly; remove it and they run plainly. They only compute gradients (added to
``.grad`` as ``loss.backward()`` does); stepping and zeroing stay with the caller's optimizer.

Example::

    xs, ys = remat.split_batch(x, 4), remat.split_batch(y, 4)
    loss = remat.accumulate(model, xs, F.cross_entropy, targets=ys)   # == one step on (x, y)
    loss = remat.autocast_step(model, x, lambda out: F.cross_entropy(out, y))  # bf16 on CPU

# NOTE [ Accumulated gradients ]
With ``reduction="mean"`` every micro-batch's loss is divided by the number of micro-batches before
its backward, so for a loss that averages over the batch (the default of torch's losses) the summed
gradients are the gradient of one step on the whole batch. This holds exactly in real arithmetic
when the micro-batches have equal sizes (checked) and the model treats samples independently; in
floating point the sums are only reordered (agreement to a few ulps). It does not hold for layers
that mix samples: BatchNorm normalises over each micro-batch, so accumulated gradients (and running
statistics) differ from one large batch's, with or without checkpointing. Dropout draws fresh masks
per micro-batch, so a large batch gives different masks than its micro-batches.

# NOTE [ Autocast under recomputation ]
``torch.utils.checkpoint`` (non-reentrant, which remat always uses) records the autocast state of
the forward and re-enters it when it recomputes in the backward, so a recomputed block produces the
same low-precision tensors as the first forward and the gradients are bitwise those of the same
autocast run without checkpointing (tests/test_train.py checks this for single-level and nested
plans). Were it otherwise the recomputed saved tensors would have another dtype and torch would
raise its "Recomputed values ... have different metadata" error.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from remat.core.trace import call_model, device_of
from remat.errors import RematError

__all__ = ["accumulate", "autocast_step", "split_batch", "REDUCTIONS", "DEFAULT_AUTOCAST_DTYPES"]

log = logging.getLogger(__name__)

REDUCTIONS: dict[str, Callable[[int], int]] = {
    "mean": lambda n: n,
    "sum": lambda n: 1,
}
"""What :func:`accumulate` divides each micro-batch's loss by, given the number of micro-batches."""

DEFAULT_AUTOCAST_DTYPES: dict[str, torch.dtype] = {"cpu": torch.bfloat16, "cuda": torch.float16}
"""The autocast dtype :func:`autocast_step` uses by default, per device type (others: torch's default)."""


def _plain(inputs: Any) -> Any:
    """A mapping pytree takes as one leaf (HF's ``BatchEncoding``, a ``UserDict``) as a dict of its items."""
    return dict(inputs) if isinstance(inputs, Mapping) and not isinstance(inputs, dict) else inputs


def _batch_size(where: str, inputs: Any) -> int:
    for leaf in tree_leaves(_plain(inputs)):
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0:
                raise RematError(
                    f"{where}: the first tensor of the batch is 0-dimensional (a scalar), so it has no batch dim 0"
                )
            return int(leaf.size(0))
    raise RematError(
        f"{where}: the batch holds no tensor (got {type(inputs).__name__}); pass a tensor, tuple or dict of tensors"
    )


def split_batch(inputs: Any, n: int) -> list[Any]:
    """Split a batch into ``n`` equal micro-batches along dim 0.

    Every tensor in ``inputs`` (a tensor, or a tuple / list / dict of them, nested; any mapping, e.g. HF's
    ``BatchEncoding``) is split; each micro-batch has the same structure. Other values (ints, flags, ``None``) are repeated unchanged
    in every micro-batch. The pieces are views of the original tensors, so no memory is copied.

    Args:
        inputs: The batch: a tensor, or a tuple / list / dict of tensors sharing the size of dim 0.
        n: Number of micro-batches, >= 1; must divide the batch size.

    Returns:
        A list of ``n`` micro-batches, in order, each of ``batch_size // n`` samples.

    Raises:
        RematError: If ``n`` is not a positive int, does not divide the batch size, the batch holds no
            tensor, or its tensors disagree on the size of dim 0.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise RematError(
            f"split_batch: n must be a positive int, got {n!r}; pass the number of micro-batches, e.g. n=4"
        )
    leaves, spec = tree_flatten(_plain(inputs))
    size = _batch_size("split_batch", inputs)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and (leaf.dim() == 0 or leaf.size(0) != size):
            got = "a 0-dimensional tensor" if leaf.dim() == 0 else f"size {leaf.size(0)} in dim 0"
            raise RematError(
                f"split_batch: tensor {i} of the batch has {got} but the first tensor has {size}; every tensor "
                "must have the batch in dim 0 (pass shared tensors such as masks through a closure instead)"
            )
    if size % n:
        divisors = [d for d in range(1, size + 1) if size % d == 0]
        raise RematError(
            f"split_batch: batch size {size} is not divisible by n={n}; pick n among {divisors} "
            f"or drop {size % n} sample(s) from the batch"
        )
    step = size // n
    pieces = [leaf.split(step) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
    out = [
        tree_unflatten([leaf if piece is None else piece[k] for leaf, piece in zip(leaves, pieces, strict=True)], spec)
        for k in range(n)
    ]
    if _plain(inputs) is not inputs:  # a BatchEncoding's micro-batches are BatchEncodings (a dict if it cannot)
        try:
            out = [type(inputs)(piece) for piece in out]
        except Exception:  # noqa: BLE001 - a Mapping class whose constructor takes no dict: plain dicts then
            pass
    return out


def _checked_loss(where: str, loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            what += " without grad"
        raise RematError(
            f"{where}: loss_fn returned {what}; it must map the model's output to a scalar loss that depends on "
            "the parameters (check that grad is enabled and the model is not frozen)"
        )
    return loss


def accumulate(
    model: nn.Module,
    micro_batches: Sequence[Any],
    loss_fn: Callable[..., torch.Tensor],
    *,
    targets: Sequence[Any] | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Forward and backward over micro-batches, one at a time, accumulating gradients as one large batch.

    Only one micro-batch's activations are alive at a time; with a plan applied, only its checkpoints.
    Each loss is weighed so the accumulated ``.grad`` equals the gradient of one step on the
    concatenated batch (see NOTE [ Accumulated gradients ]). Gradients are *added* to ``.grad``, as
    ``loss.backward()`` does: zero them first (``optimizer.zero_grad()``) unless you mean to add.

    A :class:`~remat.models.Workload`'s ``loss_fn`` closes over the whole batch's targets and cannot
    score a micro-batch; split the targets with :func:`split_batch` too and pass them as ``targets``.

    Args:
        model: The model, with or without a remat plan applied.
        micro_batches: The micro-batches, e.g. from :func:`split_batch`: each a tensor (``model(x)``),
            a tuple (``model(*x)``) or a dict (``model(**x)``).
        loss_fn: ``loss_fn(output)`` or, with ``targets``, ``loss_fn(output, target)``: a scalar loss of
            one micro-batch, averaged over its samples for ``reduction="mean"``, summed for ``"sum"``.
        targets: One target per micro-batch (any value ``loss_fn`` takes), or ``None``.
        reduction: ``"mean"``: each loss is divided by the number of micro-batches, which must all
            have the same size (dim 0 of the first tensor); ``"sum"``: losses are added unscaled.

    Returns:
        The loss of the whole batch (detached): the mean of the micro-batch losses for ``"mean"``,
        their sum for ``"sum"``.

    Raises:
        RematError: If there are no micro-batches, ``targets`` has another length, ``reduction`` is
            unknown, micro-batch sizes differ under ``"mean"``, or ``loss_fn`` does not return a scalar
            loss that requires grad.
    """
    if reduction not in REDUCTIONS:
        raise RematError(
            f"accumulate: unknown reduction {reduction!r}; valid reductions are {', '.join(map(repr, REDUCTIONS))}"
        )
    n = len(micro_batches)
    if n == 0:
        raise RematError("accumulate: micro_batches is empty; pass at least one, e.g. remat.split_batch(inputs, 4)")
    if targets is not None and len(targets) != n:
        raise RematError(
            f"accumulate: {len(targets)} targets for {n} micro-batches; pass one target per micro-batch "
            "(split them with remat.split_batch(targets, n))"
        )
    if reduction == "mean":
        sizes = [_batch_size("accumulate", mb) for mb in micro_batches]
        if len(set(sizes)) > 1:
            raise RematError(
                f"accumulate: micro-batch sizes {sizes} differ, so reduction='mean' would weigh samples unequally; "
                "split the batch evenly (remat.split_batch) or average yourself with reduction='sum'"
            )
    divisor = REDUCTIONS[reduction](n)
    losses = []
    for k, mb in enumerate(micro_batches):
        out = call_model(model, mb, "accumulate")
        loss = _checked_loss("accumulate", loss_fn(out) if targets is None else loss_fn(out, targets[k]))
        if divisor != 1:
            loss = loss / divisor
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses).sum()


def _autocast_dtype(device_type: str, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    if device_type in DEFAULT_AUTOCAST_DTYPES:
        return DEFAULT_AUTOCAST_DTYPES[device_type]
    return torch.get_autocast_dtype(device_type)


def _unscale(model: nn.Module, scaler: torch.amp.GradScaler, kept: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    # GradScaler.unscale_ wants an optimizer that owns the gradients; an SGD that never steps owns them
    # here, so the scaler's own check-and-unscale kernel runs and records overflows for update().
    params = [p for p in model.parameters() if p.grad is not None]
    if params:
        owner = torch.optim.SGD(params, lr=0.0)
        scale = scaler.get_scale()
        scaler.unscale_(owner)
        scaler.update()
        if scaler.get_scale() < scale:
            log.info(
                "autocast_step: gradients overflowed at loss scale %g (the scaler backed off to %g); "
                "some .grad are inf/NaN, skip this optimizer step",
                scale,
                scaler.get_scale(),
            )
    with torch.no_grad():
        for p, g in kept:
            p.grad = g if p.grad is None else g.add_(p.grad)


def autocast_step(
    model: nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    dtype: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> torch.Tensor:
    """One forward and backward under ``torch.autocast``, with any plan applied.

    The forward and the loss run under ``torch.autocast(device_type, dtype)``, the backward after it,
    as torch recommends; checkpointed blocks recompute under the same autocast state (NOTE [ Autocast
    under recomputation ]), so the gradients equal those of the same autocast step without remat.

    With a ``scaler`` (float16 on CUDA) the loss is multiplied by the scaler's scale before the
    backward and the new gradients divided by it afterwards with the scaler's own kernel, so ``.grad``
    holds true gradients; then ``scaler.update()`` runs (the scale backs off after an overflow and
    grows after ``growth_interval`` clean steps). After an overflow some gradients are inf/NaN (logged
    at INFO): skip that optimizer step. Step the optimizer directly (``optimizer.step()``), not through
    ``scaler.step``, which would unscale the gradients a second time.

    Args:
        model: The model (float32 parameters), with or without a remat plan applied.
        inputs: A tensor (``model(x)``), a tuple (``model(*x)``) or a dict (``model(**x)``).
        loss_fn: Maps the model's output to a scalar loss.
        dtype: The autocast dtype; default ``torch.bfloat16`` on CPU, ``torch.float16`` on CUDA.
        scaler: A ``torch.amp.GradScaler`` for float16, or ``None``.

    Returns:
        The loss (detached, unscaled), in the dtype autocast gave it (float32 for torch's losses).

    Raises:
        RematError: If autocast is unavailable on the model's device or torch disables it for ``dtype``,
            a scaler is given for float16 parameters, or ``loss_fn`` does not return a scalar loss that
            requires grad.
    """
    device_type = device_of(model, inputs).type
    if not torch.amp.is_autocast_available(device_type):
        raise RematError(f"autocast_step: torch has no autocast for device type {device_type!r}; run on cpu or cuda")
    cast = _autocast_dtype(device_type, dtype)
    kept: list[tuple[nn.Parameter, torch.Tensor]] = []
    if scaler is not None:
        half = [name for name, p in model.named_parameters() if p.dtype == torch.float16]
        if half:
            raise RematError(
                f"autocast_step: parameter {half[0]!r} is float16, and a GradScaler cannot unscale float16 gradients; "
                "keep the parameters in float32 (autocast casts inside the forward)"
            )
        # The scaler must unscale only this step's gradients, so earlier ones are set aside and added back.
        for p in model.parameters():
            if p.grad is not None:
                kept.append((p, p.grad))
                p.grad = None
    try:
        with warnings.catch_warnings():
            # torch warns and runs *without* autocast for a dtype it does not support; caught below.
            warnings.simplefilter("ignore", UserWarning)
            ctx = torch.autocast(device_type, dtype=cast)
        with ctx:
            if not torch.is_autocast_enabled(device_type):
                raise RematError(
                    f"autocast_step: torch does not autocast to {cast} on {device_type}; pass "
                    f"dtype={_autocast_dtype(device_type, None)} (the default there) or another dtype it supports"
                )
            loss = _checked_loss("autocast_step", loss_fn(call_model(model, inputs, "autocast_step")))
        (loss if scaler is None else scaler.scale(loss)).backward()
    except BaseException:
        for p, g in kept:  # a failed step leaves the earlier gradients as they were
            p.grad = g
        raise
    if scaler is not None:
        _unscale(model, scaler, kept)
    return loss.detach()
