"""HuggingFace transformers and PEFT: measured checkpointing in one call, where HF users switch theirs on.

``model.gradient_checkpointing_enable()`` checkpoints every layer; :func:`enable` measures the model on
a sample batch, plans the fastest checkpointing that fits a memory budget and applies it::

    from remat.integrations import hf

    plan = hf.enable(model, batch, budget="50%")  # batch: a collated batch with labels
    ...                                           # train as usual
    hf.disable(model)

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[hf.RematCallback(budget="50%")])

:class:`RematCallback` does the same on the first batch of the Trainer's training dataloader. PEFT
models (LoRA: the base frozen, the adapters trainable) are planned like any other: their blocks are
the base model's layers with the adapters inside. transformers is imported only for the callback
(the ``hf`` extra: ``pip install 'remat[hf]'``); :func:`enable` needs nothing but the model.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from remat.apply import apply, remove
from remat.core.runtime import nested_plans
from remat.core.trace import device_of
from remat.core.wrapped import refuse_static_graph, unwrap
from remat.errors import MissingExtraError, RematError
from remat.plan import Plan, plan
from remat.profile import profile
from remat.units import Budget

__all__ = ["enable", "disable", "RematCallback"]

if TYPE_CHECKING:
    RematCallback: type  # a transformers.TrainerCallback, built on first use (module __getattr__ below)

log = logging.getLogger(__name__)


def _model_loss(out: Any) -> torch.Tensor:
    # HF models return the loss in their output when the batch has labels (ModelOutput is a Mapping).
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if loss is None:
        raise RematError(
            f"hf.enable: the model returned no loss ({type(out).__name__} without 'loss') for the sample batch; "
            "give the batch 'labels', as a Trainer's data collator does, or pass loss_fn=..."
        )
    return loss  # type: ignore[no-any-return]


def enable(
    model: nn.Module,
    sample_batch: Mapping[str, Any],
    budget: int | str | Budget = "50%",
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    solver: str = "optimal",
    repeats: int = 3,
    optimizer: Any = None,
    grads: str = "none",
    ops: bool = True,
    allow_saved_tensor_hooks: bool = False,
) -> Plan:
    """Profile ``model`` on a sample batch, plan for ``budget`` and apply the plan, in place.

    The ``gradient_checkpointing_enable()`` of remat: instead of checkpointing every layer, the
    fastest plan whose predicted peak fits the budget (``remat.profile``, ``remat.plan``,
    ``remat.apply``). The profile runs in training mode (dropout on, as the Trainer trains) and leaves
    the model as it was. Like ``gradient_checkpointing_enable()``, it sets ``model.config.use_cache``
    to ``False`` (a KV cache built in a training forward would be appended to again by the replays). Under a ``torch.distributed`` process group every rank must call it, and all
    apply rank 0's plan (NOTE [ One plan for every rank ] in ``remat.plan.ranks``). A
    ``DistributedDataParallel`` wrapper's ``.module`` is profiled, so that its gradient buckets are not
    counted as activations (NOTE [ Wrapped models ]).

    Args:
        model: A transformers model, a PEFT model (``get_peft_model(...)``) or one wrapped by DDP, on the
            device it trains on.
        sample_batch: Keyword arguments of the model for one training step, as a data collator makes
            them (``input_ids``, ``attention_mask``, ``labels`` ...); tensors are moved to the model's
            device. The budget holds for batches of this shape: give the longest one.
        budget: Bytes (``"2GiB"``) or a share of the peak without checkpointing (``"50%"``): the peak
            ``remat.measure`` reports, as in ``remat.plan``.
        loss_fn: Maps the model's output to the loss; default ``output.loss`` (the batch needs labels).
        solver: A name in ``SOLVERS`` (``from remat.plan import SOLVERS``): ``"optimal"``, ``"knapsack"`` or
            ``"compile"`` (see ``remat.plan``).
        repeats: Timed steps of the profile, >= 1.
        optimizer: The optimizer whose ``step()`` ends each training step, or a factory of one
            (``torch.optim.AdamW``), as ``remat.profile`` takes it: its state and step count in the budget
            (without it, an AdamW loop peaked 1.05-1.13x the budget where every block was kept).
        grads: ``"none"`` or ``"held"``, as ``remat.profile`` takes it (gradients set to ``None`` before
            each step, ``optimizer.zero_grad()``'s default, or zeroed in place).
        ops: Offer op-level policies (``False``: plans without them, for a loop that backpropagates twice
            through a block: ``retain_graph``, a gradient penalty).
        allow_saved_tensor_hooks: Passed to ``remat.apply``: recompute blocks whose forward runs under
            saved-tensor hooks of your own that give back what they are given (activation offloading;
            NOTE [ Saved-tensor hooks around the forward ] in ``remat.core.runtime``).

    Returns:
        The plan now applied.

    Raises:
        RematError: If HF's own checkpointing is on, the batch is not a mapping, or the model returns no
            loss; ``BudgetInfeasibleError`` if no plan fits the budget.
    """
    refuse_static_graph(model, "hf.enable")
    inner = unwrap(model)
    if inner is not model:
        log.info("hf.enable: profiling the %s's module, not the wrapper", type(model).__name__)
    # transformers 5 renamed is_gradient_checkpointing (deprecated) to is_activation_checkpointing.
    hf_on = getattr(inner, "is_activation_checkpointing", None)
    if hf_on is None:
        hf_on = getattr(inner, "is_gradient_checkpointing", False)
    if hf_on:
        raise RematError(
            "hf.enable: HF's own checkpointing is on (gradient_checkpointing_enable() or TrainingArguments("
            "gradient_checkpointing=True)) and would checkpoint every layer under remat's plan; call "
            "model.gradient_checkpointing_disable() or leave the argument out"
        )
    if not isinstance(sample_batch, Mapping):
        raise RematError(
            f"hf.enable: sample_batch is a {type(sample_batch).__name__}; give the model's keyword arguments "
            "for one step as a mapping (a collated batch: input_ids, attention_mask, labels ...)"
        )
    config: Any = getattr(inner, "config", None)
    if config is not None and getattr(config, "use_cache", False) and sample_batch.get("use_cache") is None:
        # A KV cache built in a training forward: the layers append to it, and a replay would append again
        # (NOTE [ Arguments changed before the replay ] in remat.core.runtime refuses it). HF's own
        # gradient_checkpointing_enable() sets it off for training too.
        log.warning(
            "hf.enable: setting model.config.use_cache=False (a KV cache is not used in training; remat's "
            "recomputation would append to it again)"
        )
        config.use_cache = False
    for name, module, _entry in nested_plans(inner):
        # A plan applied before the model was wrapped (hf.enable on the base model, then get_peft_model):
        # replaced by this one, as applying again replaces a plan (two would replay the blocks twice).
        log.warning("hf.enable: removing the remat plan applied to the sub-module %r; the new plan replaces it", name)
        remove(module)
    device = device_of(inner, None)
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in sample_batch.items()}
    modes = [(m, m.training) for m in inner.modules()]
    inner.train()
    try:
        prof = profile(
            inner, inputs, loss_fn or _model_loss, repeats=repeats, optimizer=optimizer, grads=grads, ops=ops
        )
    finally:
        for m, training in modes:
            m.training = training
    result = plan(prof, budget, solver=solver)
    apply(model, result, allow_saved_tensor_hooks=allow_saved_tensor_hooks)
    log.info("hf.enable: %s", result.summary())
    return result


def disable(model: nn.Module) -> Plan | None:
    """Undo :func:`enable` (``remat.remove``): the model as it was.

    Returns:
        The plan that was removed, or ``None`` if none was applied.
    """
    return remove(model)


def __getattr__(name: str) -> Any:
    # RematCallback subclasses transformers.TrainerCallback: built on first use, so that importing this
    # module does not import transformers.
    if name == "RematCallback":
        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _callback_class() -> type:
    try:
        from transformers import TrainerCallback
    except ImportError:
        raise MissingExtraError(
            "hf: RematCallback needs transformers, which is not installed; pip install 'remat[hf]'"
        ) from None

    class RematCallback(TrainerCallback):  # type: ignore[misc]
        """A ``transformers.TrainerCallback`` that runs :func:`enable` on the first training batch.

        At ``on_train_begin`` it draws the first batch of the Trainer's training dataloader (the RNG
        state restored afterwards, so training sees the same batches), profiles the model on it in the
        Trainer's loop (its optimizer's step included, the optimizer put back afterwards), plans for
        ``budget`` and applies the plan; training then runs with it. Leave the Trainer's
        ``gradient_checkpointing`` off. The budget holds for batches shaped like the first one: with
        padding to the longest sequence in each batch, call :func:`enable` on the longest batch instead.

        Args:
            budget: Bytes or a share of the unplanned peak (see :func:`enable`).
            loss_fn: Maps the model's output to the loss; default ``output.loss``.
            solver: ``"optimal"``, ``"knapsack"`` or ``"compile"`` (see :func:`enable`).
            repeats: Timed steps of the profile, >= 1.

        Attributes:
            plan: The plan applied, once training has begun (``None`` before).
        """

        def __init__(
            self,
            budget: int | str | Budget = "50%",
            *,
            loss_fn: Callable[[Any], torch.Tensor] | None = None,
            solver: str = "optimal",
            repeats: int = 3,
            allow_saved_tensor_hooks: bool = False,
        ) -> None:
            self.budget = budget
            self.loss_fn = loss_fn
            self.solver = solver
            self.repeats = repeats
            self.allow_saved_tensor_hooks = allow_saved_tensor_hooks
            self.plan: Plan | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            model, loader = kwargs.get("model"), kwargs.get("train_dataloader")
            if model is None or loader is None:
                raise RematError("hf.RematCallback: the Trainer gave on_train_begin no model or training dataloader")
            # accelerate's prepared loader: iterate the loader it wraps, which neither synchronises RNG
            # across ranks nor marks the start of an epoch; the batch is moved to the model's device.
            loader = getattr(loader, "base_dataloader", loader)
            with torch.random.fork_rng(devices=[]):
                batch = next(iter(loader))
            self.plan = enable(
                model,
                batch,
                self.budget,
                loss_fn=self.loss_fn,
                solver=self.solver,
                repeats=self.repeats,
                optimizer=kwargs.get("optimizer"),
                allow_saved_tensor_hooks=self.allow_saved_tensor_hooks,
            )

    RematCallback.__module__ = __name__
    return RematCallback
