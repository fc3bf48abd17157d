"""``remat.profile``: measure a model's blocks on a real batch."""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from remat._progress import progress as show_progress
from remat.blocks import Block, fingerprint, looped_hint, resolve, trainable_counts
from remat.blocks import blocks as find_blocks
from remat.core.ops import Keep, Op, Recompute, RecomputeOps
from remat.core.probe import Event, Probe, probe, storages
from remat.core.runtime import install, nested_plans, note_profiled, share_learning, suspended, uninstall
from remat.core.trace import (
    Grads,
    Iteration,
    MemoryTrace,
    OptimizerLike,
    allocation_lifetimes,
    call_model,
    device_of,
    iteration,
    mark,
    median,
    record_memory,
    train_step,
)
from remat.core.wrapped import refuse_static_graph, unwrap
from remat.errors import BlockSelectionError, RematError, higher_order_refused
from remat.profile.ops import EXTERNAL, BlockOps, profile_ops
from remat.profile.twins import plain_rounds, pool_twins, twin_groups
from remat.profile.types import BlockProfile, LateInput, Profile, SubProfile

__all__ = ["profile"]

log = logging.getLogger(__name__)

# NOTE [ Replay level ]
# A checkpoint over a segment ending with block k replays the segment when the backward first unpacks a
# tensor the segment saved, which is inside block k's backward, not at its start: what that backward
# allocates before its first unpack sits under the whole replay. An in-place op on a view as the block's
# last op (``act_(x.transpose(1, 2))``) is the case: autograd's CopySlices allocates the gradient of the
# base and a clone of the view's slice (2x the output) and only then calls the op's backward, which
# unpacks. ``pending_grad_bytes`` is therefore read at the later of the backward's start and the first
# unpack of what the block saved (``Event.UNPACK``, tracked run): fuzz seed 124's R[0:1](K0) K1 measured
# 1.087x its budget with it read at the start (12288 bytes under the replay were not charged).

# NOTE [ Measured checkpoint costs ]
# Checkpointing a block costs more than running its forward again: saved-tensor hooks, RNG state,
# unpacking, Python. The profile does not guess that overhead: it times the step with every block
# checkpointed on its own and charges each block what its forward + backward really took in that
# configuration beyond the plain one. The solver then prices a checkpointed block at ``ckpt_fwd_ms``
# (the no-save forward with its overhead) plus its plain forward and backward. Part of the overhead
# comes once per checkpoint call, not per block (``ckpt_call_ms``): the profile measures it on two tiny
# blocks run by remat's runtime, each under a checkpoint of its own against both under one, 15 times
# interleaved (``_call_ms``: about 30 ms of wall time; it was the difference of two whole steps, one
# with every block checkpointed and one with all under one checkpoint, which cost a step, came out 0
# on B's split blocks (the step difference was within the noise) and was not timed for models that are
# not chains, so a segment of k blocks was charged k calls: B's split plans predicted +12-15% for +7%).
# A replay ends as soon as the last tensor the forward saved is saved again (torch's early stop): the
# ops of a block after its last saved tensor (a closing Linear's matmul: autograd saves its inputs
# before it runs) do not run again when the block ends a replay, and do when the replay goes on into
# the next block. The per-op profile gives their share of the block's forward (``stop_ms``); "full" ends every block's replay
# early, so ``ckpt_fwd_ms`` adds ``stop_ms`` back (a whole no-save forward and replay) and the
# chain model takes it off once per replay, for the segment's last block. A sub-module
# variant (attention / FFN checkpointed) costs its measured forward once more plus one call.
#
# What this costs (issue #9 asked for at most 10 plain steps on a 12-layer GPT): ``repeats`` plain
# iterations (fewer, at least two, where every block has twins: NOTE [ Fewer plain iterations for twins ]
# in ``remat.profile.twins``), max(1, repeats // 2) with every block checkpointed and as many under selective
# checkpoints (NOTE [ Op-level policy costs ]), interleaved, one untimed forward of each of the two
# before them (NOTE [ Learning calls are not timed ]: ceil(repeats / 2) with every block checkpointed
# before, the first of which learned and was left out, so one timed iteration fewer now times it alike), and one or two more of a configuration
# whose iterations a busy machine disturbed (NOTE [ Disturbed iterations ]); FLOPs counted in the first
# warm-up iteration, and no warm-up round per configuration (the warm-up iterations warm the
# model; the first checkpointed step measured no slower than later ones).


# NOTE [ Learning calls are not timed ]
# A plan's first call of each block after it is installed learns what the block changes and draws
# (NOTE [ State under recomputation ] in ``remat.core.runtime``: its buffers and arguments copied and
# compared, a dispatch mode watching for generators, every attribute walked): about 5 ms per layer of
# workload A, once per training run. The profile installs each configuration afresh for each of its
# timed iterations, so every one of them learned: "full" priced a recomputed A layer 5 ms too high
# (the profile's every-block-checkpointed step +417 ms where that plan trains at +280), and the planner
# chose op-level policies over recomputing whole layers where they cost more (remat at torch
# per-block's peak: 1.139x its time). Each configuration's roles are now installed again as they were
# (``install(reuse=...)``), and learn in one untimed forward before the timed iterations (``_learn``:
# no backward, about a third of a step each), so every timed iteration is one that did not learn. Before
# (stop 30), the first timed iteration learned and was used only where no other was: the selective
# configuration, timed once by default, priced every op-level policy with the learning call in it
# (5 ms a layer of A on a quiet machine, 23 ms under load, against a recomputation of about 28).


# NOTE [ One learning forward ]
# What a block's first call learns (NOTE [ State under recomputation ] in ``remat.core.runtime``: what its
# forward changes and draws, where its attributes and parameters are, the tensors it reads) is a fact
# about the block's forward, not about how a plan runs it. The selective configuration's roles take what
# the "full" configuration's learning forward found for the same modules (``share_learning``), instead of
# learning in a forward of their own: a third of a plain step fewer on workload A (issue #9: at most ten
# for the whole profile). Where a selective block has no learned role under "full" (a block that edits
# its input is kept there), the selective configuration learns in its own forward, as before.
# The checks an op-level policy makes on its learning call (a generator of its own, Python's RNG, an op
# that fills a saved argument) are the per-op profile's too: those blocks get no selective configuration
# (``_selective_ok``).

# NOTE [ Op-level policy costs ]
# An op-level policy (RecomputeOps) keeps a block under torch's selective checkpoint, caching some ops'
# outputs. Its time is measured in two parts: one timed configuration runs every single-module block
# under the selective checkpoint caching nothing, which gives each block's ``selective_ms`` (its whole
# forward again, plus what the policy machinery costs per op, forward and recompute); the per-op
# profile (``remat.profile.ops``) gives each op's time. A policy caching the ops ``S`` skips their
# recomputation, so it costs ``selective_ms - sum(ms of S before the early stop)`` (plan stage,
# ``remat.plan.policies.op_costs``). Blocks whose ops write into storages they did not allocate (a
# BatchNorm's running statistics), stateful blocks and groups of modules get no such configuration.


class _FlopCount(TorchDispatchMode):
    """FLOPs of the ops run inside, by ``torch.utils.flop_counter``'s formulas (``flop_registry``).

    ``FlopCounterMode`` without its module tracker: the probe attributes FLOPs to blocks, and the
    tracker's hooks assert on tensors that need a gradient but were made inside a custom autograd
    Function (Reformer's reversible layers), and change the backward's memory.
    """

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out


def _stop_share(block_ops: Sequence[BlockOps], n: int) -> list[float]:
    """Per block, the share of its forward's op time after the last op whose tensors autograd saves."""
    if not block_ops:
        return [0.0] * n
    return [sum(op.ms for op in bo.ops[bo.stop :]) / max(bo.fwd_ms, 1e-9) for bo in block_ops]


def _selective_ok(b: Block, stateful: tuple[str, ...], block_ops: BlockOps) -> bool:
    """Whether block ``b`` may run under an op-level policy (NOTE [ Op-level policy costs ])."""
    writes_outside = any(w == EXTERNAL for op in block_ops.ops for w in op.writes)
    return (
        len(b.fqns) == 1 and not stateful and not writes_outside and not block_ops.py_rng and not block_ops.fills_saved
    )


def _refuse_nested_plans(model: nn.Module, block_list: Sequence[Block]) -> None:
    """A RematError naming the module when a plan applied to a module inside ``model`` runs its blocks: the
    plan made on a model before a wrapper (PEFT's ``get_peft_model``) was put around it would replay them in
    the backward, which the profile would otherwise report as the model recomputing them itself."""
    inside = {id(m) for members in resolve(model, block_list) for mod in members for m in mod.modules()}
    for name, _module, entry in nested_plans(model):
        if any(id(m) in inside for m in entry.touched):
            raise RematError(
                f"profile: a remat plan ({entry.tag.strategy if hasattr(entry.tag, 'strategy') else entry.tag}) is "
                f"already applied to the sub-module {name!r} (remat.apply or hf.enable on that model before it was "
                f"wrapped, e.g. by PEFT's get_peft_model) and runs these blocks; remove it first "
                f"(remat.remove(model.get_submodule({name!r}))), or call hf.enable, which replaces it"
            )


def _timing_configs(
    block_list: Sequence[Block], *, selective: Sequence[bool] = (), editing: Sequence[bool] = ()
) -> dict[str, tuple[Op, ...]]:
    n = len(block_list)
    editing = tuple(editing) or (False,) * n  # blocks that edit an argument in place: never recomputed
    keeps = tuple(Keep(i) for i in range(n))
    configs: dict[str, tuple[Op, ...]] = {
        "plain": keeps,
        "full": tuple(Keep(i) if editing[i] else Recompute(i, i + 1, (Keep(i),)) for i in range(n)),
    }
    if any(selective):
        configs["selective"] = tuple(RecomputeOps(i, ()) if ok else Keep(i) for i, ok in enumerate(selective))
    return configs


class _Tiny(nn.Module):
    """A block that costs next to nothing and saves two tensors (the call cost probe's)."""

    def __init__(self, dev: torch.device) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((8, 8), 0.1, device=dev))  # no draw from the user's generator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w)


def _call_ms(dev: torch.device, reps: int = 15) -> float:
    """The fixed cost of one checkpoint call through remat's runtime (NOTE [ Measured checkpoint costs ]):
    two tiny blocks each under a checkpoint of its own against both under one, interleaved, median."""
    model = nn.Sequential(_Tiny(dev), _Tiny(dev))
    x = torch.full((4, 8), 0.5, device=dev, requires_grad=True)
    block_list = find_blocks(model, types=_Tiny)
    members = resolve(model, block_list)
    fqns = [b.fqns for b in block_list]
    configs = (
        (Recompute(0, 1, (Keep(0),)), Recompute(1, 2, (Keep(1),))),
        (Recompute(0, 2, (Keep(0), Keep(1))),),
    )

    def once(ops: tuple[Op, ...]) -> float:
        touched = install(model, ops, members, fqns)
        try:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter_ns()
            model(x).sum().backward()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            return (time.perf_counter_ns() - t0) / 1e6
        finally:
            uninstall(touched)

    for ops in configs:
        once(ops)
    diffs = [once(configs[0]) - once(configs[1]) for _ in range(reps)]
    return max(0.0, median(diffs))


def _schedule(configs: Sequence[str], repeats: int, plain: int | None = None) -> list[str]:
    """The timed iterations, interleaved round by round (NOTE [ Measured checkpoint costs ]); ``plain``
    plain ones (default ``repeats``: NOTE [ Fewer plain iterations for twins ] in ``remat.profile.twins``)."""
    rounds = {
        "plain": repeats if plain is None else plain,
        "full": max(1, repeats // 2),  # none learns: NOTE [ Learning calls are not timed ]
        "selective": max(1, repeats // 2),
    }
    order: list[str] = []
    for r in range(repeats):
        order += [name for name in configs if r < rounds[name]]
    return order


def _timed_step(
    it: Iteration,
    block_list: Sequence[Block],
    members: list[list[nn.Module]],
    ops: tuple[Op, ...],
    dev: torch.device,
    reuse: dict[tuple[Op, ...], Any],
) -> list[tuple[str, int, int]]:
    """One iteration with ``ops`` installed; wall-clock time of every boundary (first is start, then
    the end of the backward ``("backward_end", 0)`` and the end of the optimizer's step ``("end", 0)``;
    a ``("learning", 0)`` event where the plan's first call learned, NOTE [ Learning calls are not timed ])."""
    events: list[tuple[str, int, int]] = (
        [] if ops in reuse or all(isinstance(op, Keep) for op in ops) else [("learning", 0, 0)]
    )

    def clock(kind: str, i: int) -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        events.append((kind, i, time.perf_counter_ns()))

    # Stateful blocks are timed too (their state is put back by ``preserved``); plans keep them.
    touched = install(it.model, ops, members, [b.fqns for b in block_list], allow_stateful=True, reuse=reuse)
    try:
        with probe(it.model, block_list, clock):
            it.reset()
            events.append(("start", 0, time.perf_counter_ns()))
            train_step(it.model, it.inputs, it.loss_fn)
            clock("backward_end", 0)
            it.optimizer_step()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            events.append(("end", 0, time.perf_counter_ns()))
    finally:
        uninstall(touched)
    return events


def _learn(
    it: Iteration,
    block_list: Sequence[Block],
    members: list[list[nn.Module]],
    ops: tuple[Op, ...],
    reuse: dict[tuple[Op, ...], Any],
) -> None:
    """One untimed forward with ``ops`` installed, into ``reuse``: its first calls learn (NOTE [ Learning
    calls are not timed ]), so that every timed iteration of ``ops`` is one that did not."""
    touched = install(it.model, ops, members, [b.fqns for b in block_list], allow_stateful=True, reuse=reuse)
    try:
        it.reset()
        out = call_model(it.model, it.inputs)
        del out  # no backward: its graph, and what it saved, go with it
    finally:
        uninstall(touched)


def _times(events: list[tuple[str, int, int]]) -> dict[tuple[str, int], int]:
    out: dict[tuple[str, int], int] = {}
    for kind, i, t in events:
        out.setdefault((kind, i), t)
    return out


# NOTE [ Disturbed iterations ]
# A checkpointed configuration is timed in one or two iterations (NOTE [ Measured checkpoint costs ]),
# so one iteration that the machine slowed down (another process on the cores, memory returned to the
# system and faulted back) priced every block's recomputation at what that iteration took: a profile of
# workload A (benchmarks/peers.py) had every layer's recomputation at 72 ms for a 30 ms forward (24-29
# ms in other profiles), and its plan at torch per-block's peak chose op-level policies predicted at
# +508 ms where recomputing every layer measures +280. An iteration is disturbed where the work it
# shares with the plain iterations took longer than theirs: the code outside the blocks (embedding,
# head, loss, optimizer) over 1.5x the plain iterations' median (and 0.5 ms), or, with every block
# checkpointed on its own, the blocks' forwards (which then save nothing) over 1.3x theirs (and 1 ms a
# block: the checkpoint's own cost); or where the blocks' backwards took longer than a recomputation
# can: over 1.3x the plain backwards plus the forwards of the same iteration (a recomputation runs the
# forward again, or less of it, and 1 ms a block; on A a checkpointed layer's backward is the plain
# 48 ms plus 24-29, the 72 ms profile's was disturbed only there, as was one with 159 ms under
# contention, whose forwards and outside code took their usual time). A configuration whose every iteration is disturbed is timed once
# more, at most ``_RETIMES`` times (each about a step and a third on A); its times come from the
# iterations that are neither disturbed nor learning where it has any, else from its fastest
# (``_assemble``: the median of its iterations let two disturbed ones of three price it).
_RETIMES = 2


def _shared_ms(t: dict[tuple[str, int], int], n: int) -> tuple[float, float, float]:
    """``(time outside the blocks, the blocks' forwards, their backwards)`` of one timed iteration, ms."""
    fwd = bwd = 0
    for i in range(n):
        if (Event.FORWARD, i) in t and (Event.FORWARD_END, i) in t:
            fwd += t[(Event.FORWARD_END, i)] - t[(Event.FORWARD, i)]
        if (Event.BACKWARD, i) in t and (Event.BACKWARD_END, i) in t:
            bwd += max(0, t[(Event.BACKWARD_END, i)] - t[(Event.BACKWARD, i)])
    return (t[("end", 0)] - t[("start", 0)] - fwd - bwd) / 1e6, fwd / 1e6, bwd / 1e6


def _disturbed(
    events: list[tuple[str, int, int]], plain: list[list[tuple[str, int, int]]], n: int, *, full: bool
) -> bool:
    """Whether a checkpointed iteration is disturbed (NOTE [ Disturbed iterations ])."""
    shared = [_shared_ms(_times(e), n) for e in plain]
    out, fwd, bwd = _shared_ms(_times(events), n)
    out_plain, fwd_plain, bwd_plain = (median([s[k] for s in shared]) for k in range(3))
    return (
        (out_plain > 0 and out > 1.5 * out_plain + 0.5)
        or (full and fwd > 1.3 * fwd_plain + n)
        or bwd > 1.3 * (bwd_plain + fwd) + n
    )


def _all_ranks_agree(done: bool, dev: torch.device) -> bool:
    """Under a process group of several ranks, stop retiming only where every rank is done: a rank that
    times one more step alone would run collectives (FSDP2's all-gathers) no other rank joins."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return done
    flag = torch.tensor([0 if done else 1], device=dev if dist.get_backend() != "gloo" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return not bool(flag.item())


def _usable(runs: list[list[tuple[str, int, int]]]) -> bool:
    """Whether a configuration has an undisturbed iteration to time it by: one that did not learn, or,
    where every one learned, one of those (NOTE [ Learning calls are not timed ])."""
    timed = [e for e in runs if ("learning", 0, 0) not in e] or runs
    return any(("disturbed", 0, 0) not in e for e in timed)


def _warn_eval_mode(model: nn.Module) -> None:
    """Warn when the model is in eval mode: the profile (and every plan made from it) then measures eval-mode
    steps, where dropout saves no masks and BatchNorm no batch statistics; a training loop in train mode
    peaks above such a plan's budget (1.2-1.3x on the built-in GPT with dropout 0.1). Modules a model keeps
    in eval mode on purpose inside a model in train mode (frozen BatchNorm) are the step's own."""
    if not model.training:
        warnings.warn(
            f"profile: the model ({type(model).__name__}) is in eval mode, so the profile and its plans are for "
            "eval-mode steps, and a train-mode step can peak above their budgets: call model.train() before "
            "profiling a model you will train",
            stacklevel=3,
        )


def profile(
    model: nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    blocks: Sequence[Block] | None = None,
    repeats: int = 3,
    warmup: int = 1,
    grads: Grads | str = Grads.NONE,
    optimizer: OptimizerLike | None = None,
    progress: bool | None = None,
    ops: bool = True,
) -> Profile:
    """Measure a model's blocks on a real batch, in an iteration of the training loop the user runs.

    Runs ``warmup`` plain iterations (the first counting FLOPs by ``torch.utils.flop_counter``'s
    formulas), ``repeats`` timed iterations (median per block) and a few with blocks checkpointed (NOTE
    [ Measured checkpoint costs ]), one iteration under the torch profiler for memory, and (``ops``) a
    forward recording every op.
    The profile's peak, and the budgets of plans made from it, are the peak of that iteration (NOTE
    [ What a step's peak means ] in ``remat.core.trace``; ``Profile.loop`` records it). The model is
    left exactly as it was: parameters, gradients, buffers (BatchNorm statistics), RNG state,
    train/eval mode, the optimizer's state and any remat plan applied to it.

    Args:
        model: The model, on the device to profile on.
        inputs: A tensor, a tuple of positional arguments or a dict of keyword arguments.
        loss_fn: Maps the model's output to a scalar loss.
        blocks: The blocks to measure (default: ``remat.blocks(model)``).
        repeats: Samples of each block's plain times, >= 1: as many timed plain iterations, or fewer
            (at least two) where every block has twins (NOTE [ Fewer plain iterations for twins ]); about
            half as many checkpointed ones, plus one or two where the machine disturbed them (NOTE
            [ Disturbed iterations ]).
        warmup: Untimed iterations first, >= 1 (they create the optimizer's state).
        grads: ``"none"`` (gradients set to ``None`` before each iteration, ``optimizer.zero_grad()``'s
            default: they are allocated in the backward) or ``"held"`` (zeroed in place, held before it).
        optimizer: The optimizer whose ``step()`` ends each iteration, or a factory that builds one
            from the parameters (``torch.optim.AdamW``); ``None`` for forward + backward only.
        progress: Show a progress bar (on standard error); ``None``: when it is a terminal.
        ops: Also profile every op of each block and time blocks under torch's selective checkpoint, for
            op-level policies (NOTE [ Op-level policy costs ]); ``False`` skips it (a quicker profile).

    Returns:
        The :class:`Profile`.

    Raises:
        RematError: For bad ``repeats``/``warmup``/``grads``/``optimizer``, a loss that is not a scalar,
            or blocks that do not run exactly once per step in their listed order.
    """
    if repeats < 1 or warmup < 1:
        raise RematError(f"profile: repeats={repeats} and warmup={warmup} must both be >= 1")

    refuse_static_graph(model, "profile")
    if unwrap(model) is not model:  # DDP: its buckets are not activations; plans fit the module and the wrapper
        log.info("profile: profiling the wrapper's .module")
        model = unwrap(model)
    block_list = tuple(blocks) if blocks is not None else find_blocks(model)
    if not block_list:
        raise BlockSelectionError("profile: no blocks to profile; select at least one block")
    _refuse_nested_plans(model, block_list)
    _warn_eval_mode(model)
    dev = device_of(model, inputs)
    n = len(block_list)
    with suspended(model), iteration(model, inputs, loss_fn, grads=grads, optimizer=optimizer, where="profile") as it:
        # FLOPs, counted in the first warm-up iteration (untimed anyway: one iteration fewer to run).
        flop_events = _count_flops(it, model, inputs, loss_fn, block_list)
        ran = [i for kind, i, _ in flop_events if kind == Event.FORWARD]
        if sorted(ran) == list(range(n)) and ran != sorted(ran):
            # Blocks listed out of the order they run in, each run once (FSMT registers its decoder before its
            # encoder; Idefics3 its text layers before its vision ones): measured in the order they run.
            log.info("profile: the blocks run in another order than listed; profiling them in the order they run")
            block_list = tuple(replace(block_list[old], index=new) for new, old in enumerate(ran))
            flop_events = _count_flops(it, model, inputs, loss_fn, block_list)
        held = it.warm_up(warmup - 1)
        # NOTE [ Op-level policy costs ]: every op of each block's forward (one forward, no backward),
        # after the warm-up: on memory a step has touched before, as in training (first, it timed GELU
        # and LayerNorm at 3x their time in a step, on freshly faulted pages).
        block_ops = profile_ops(model, inputs, loss_fn, block_list, rounds=1) if ops else ()

        # Memory: every allocation of one iteration, with the boundaries as markers, and when each
        # parameter gradient is first allocated (NOTE [ Gradients in the backward ]).
        with (
            probe(model, block_list, lambda kind, i: mark(f"{kind}{i}"), track=True) as tracked,
            _grad_marks(model) as fresh,
        ):
            # The "loss" mark: where the backward starts (_dropped_outputs), before the head's backward.
            trace = record_memory(lambda: it.step(_loss_marked(it.loss_fn)), dev)
        grad_events = _grad_events(trace, fresh)
        _check_order(tracked.calls, tracked.order, block_list, tracked.backward_calls, tracked.no_grad, model)
        # Blocks that edit the previous block's output in place (NOTE [ In-place edits of a member's output ]).
        editing = {i for i in range(n) if tracked.edits_input[i] and tracked.edits_own_link[i]}
        code_held: list[LateInput] = []  # NOTE [ Outputs the model's code holds past their saving taker ]
        # NOTE [ Side outputs of a segment's last block ]: where the model's code drops each block's side outputs.
        side_frees: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
        pinned = _pinned(model, inputs, loss_fn, block_list, dev, editing, code_held, side_frees)
        gaps = _gaps(trace, n)
        # Scalars a forward caches (a few bytes) do not make a model less of a chain.
        slack = [max(1024, sum(tracked.outputs[i].values()) // 100) for i in range(n)]
        reused = [p[2] for p in pinned]  # own outputs alive past the next block (NOTE [ What stays alive anyway ])
        chain = (
            all(tracked.linked[1:])
            and not any(reused[: n - 1])
            and all(max(0, gaps[i]) + pinned[i][0] + pinned[i][1] <= slack[i] for i in range(n - 1))
        )

        # Times: wall clock at each boundary, median over repeats, for the plain model and (NOTE
        # [ Measured checkpoint costs ]) with every block, every attention, every FFN checkpointed,
        # interleaved so that drifts of the machine hit every configuration alike.
        selective = [
            bool(block_ops) and not tracked.edits_input[i] and _selective_ok(b, tracked.stateful[i], block_ops[i])
            for i, b in enumerate(block_list)
        ]
        # Blocks that change a mutable argument (NOTE [ Arguments changed by the call ] in remat.core.probe)
        # cannot be replayed: kept in the checkpointed iterations too.
        # Blocks that edit a parameter in place (NOTE [ Parameters edited by the forward ] in remat.core.probe) too.
        changes_args = [any(s.startswith(("argument ", "parameter ")) for s in tracked.stateful[i]) for i in range(n)]
        configs = _timing_configs(
            block_list, selective=selective, editing=[e or c for e, c in zip(tracked.edits_input[:n], changes_args)]
        )
        call_ms = _call_ms(dev)
        members = resolve(model, block_list)
        runs: dict[str, list[list[tuple[str, int, int]]]] = {name: [] for name in configs}
        step_ms: list[float] = []
        ft = _times(flop_events)

        def counted(start: tuple[str, int], end: tuple[str, int]) -> int:
            return max(0, ft.get(end, ft.get(("end", 0), 0)) - ft.get(start, 0))

        block_flops = [
            (
                counted((Event.FORWARD, i), (Event.FORWARD_END, i)),
                counted((Event.BACKWARD, i), (Event.BACKWARD_END, i)),
            )
            for i in range(n)
        ]
        schedule = _schedule(list(configs), repeats, plain_rounds(members, block_ops, block_flops, repeats))
        reuse: dict[tuple[Op, ...], Any] = {}  # NOTE [ Learning calls are not timed ]
        for name, config in configs.items():
            if name == "selective" and "full" in configs:
                # NOTE [ One learning forward ]
                install(it.model, config, members, [b.fqns for b in block_list], allow_stateful=True, reuse=reuse)
                uninstall([module for module, _ in reuse[config]])
                if share_learning(reuse[configs["full"]], reuse[config]):
                    continue
                del reuse[config]
            if name != "plain":
                _learn(it, block_list, members, config, reuse)
        with show_progress(progress, len(schedule), "profile") as advance:
            for k, name in enumerate(schedule):
                events = _timed_step(it, block_list, members, configs[name], dev, reuse)
                advance(f"timing {name}, {k + 1}/{len(schedule)}")
                runs[name].append(events)
                if name == "plain":
                    step_ms.append((events[-1][2] - events[0][2]) / 1e6)
            # NOTE [ Disturbed iterations ]
            for name in configs:
                if name == "plain":
                    continue
                for retime in range(_RETIMES + 1):
                    for events in runs[name]:
                        if ("disturbed", 0, 0) not in events and _disturbed(
                            events, runs["plain"], n, full=name == "full"
                        ):
                            events.append(("disturbed", 0, 0))
                    if _all_ranks_agree(_usable(runs[name]) or retime == _RETIMES, dev):
                        break
                    log.info("profile: the %s iterations were disturbed; timing one more", name)
                    runs[name].append(_timed_step(it, block_list, members, configs[name], dev, reuse))

    prof = _assemble(
        model,
        block_list,
        tracked,
        trace,
        runs,
        step_ms,
        _times(flop_events),
        held,
        dev,
        n,
        grad_events,
        selective,
        _stop_share(block_ops, n),
        call_ms,
    )
    netted: set[tuple[int, int, tuple[int, ...]]] = set()  # NOTE [ Code-held frees the plain step nets ]
    later: list[tuple[tuple[int, int, tuple[int, ...]], LateInput]] = []
    late = _late_inputs(trace, tracked, n, netted, later)
    known = {(li.nbytes, li.producer, tuple(li.users)) for li in late}
    # NOTE [ Held inputs freed in a later gap ] in remat.plan.chain: not one code_held_inputs charges already.
    code_keys = {(li.nbytes, li.producer, tuple(li.users)) for li in code_held}
    late += tuple(li for key, li in later if key not in code_keys)
    prof = replace(
        prof,
        loop=it.loop,
        block_ops=block_ops,
        late_inputs=late,
        code_held_inputs=tuple(
            li._replace(netted=(li.nbytes, li.producer, tuple(li.users)) in netted)
            for li in code_held
            if (li.nbytes, li.producer, tuple(li.users)) not in known
        ),
    )
    gap_freed = _gap_freed_inputs(trace, tracked, n)
    gap_freed_out = _gap_freed_outputs(trace, tracked, n)
    gap_freed_unlinked = _gap_freed_inputs(trace, tracked, n, unlinked=True)
    unsaved_unlinked = _unsaved_unlinked_bytes(trace, tracked, n)
    unlinked_made = _unlinked_made(trace, tracked, n)
    dropped = _dropped_outputs(trace, tracked, n)
    older_out = _gap_freed_older_outputs(trace, tracked, n, dropped)
    plain_frees = _plain_forward_frees(trace, n)  # NOTE [ Side outputs of a segment's last block ]
    dead, dead_late = _dead_saved(trace, tracked, n)
    bps = tuple(
        replace(
            bp,
            gap_bytes=gaps[i],
            gap_freed_input_bytes=gap_freed[i],
            gap_freed_output_bytes=gap_freed_out[i],
            gap_freed_unlinked_bytes=gap_freed_unlinked[i],
            unlinked_made_bytes=unlinked_made[i],
            gap_freed_older_outputs=older_out[i],
            dropped_output_frees=dropped[i],
            dead_saved_frees=dead[i],
            dead_head_late_bytes=dead_late[i],
            pinned_bytes=pinned[i][0],
            pinned_fwd_bytes=pinned[i][3],
            pinned_out_bytes=pinned[i][1],
            side_output_bytes=pinned[i][4],
            side_output_frees=_side_output_frees(side_frees[i], n, prof.head_peak_bytes, plain_frees[i]),
            reused_bytes=reused[i],
            unlinked_bytes=tracked.unlinked[i],
            unsaved_input_bytes=unsaved_unlinked[i],
            code_kept_input_bytes=max(0, tracked.unsaved_unlinked(i) - unsaved_unlinked[i]),
            generator_state_bytes=block_ops[i].generator_state_bytes if block_ops else 0,
            fresh_rng=block_ops[i].fresh_rng if block_ops else False,
        )
        for i, bp in enumerate(prof.block_profiles)
    )
    prof = replace(prof, block_profiles=bps, is_chain=chain, trainable_params=trainable_counts(model, block_list))
    note_profiled(model)  # NOTE [ Hooks the profile did not see ] in remat.core.runtime
    # NOTE [ Twin blocks ]: blocks doing the same work share the medians of their times.
    return pool_twins(prof, twin_groups(members, prof))


# NOTE [ What stays alive anyway ]
# A segment drops what autograd saves inside it, but not what the model or the user holds: hidden
# states collected in a list, features a hook keeps, a cache, and what the model's code between blocks
# saves for the backward, which runs outside the checkpoint (NOTE [ Spans ] in ``remat.core.runtime``):
# an MoE router's ``x.gather(1, idx)`` saves the block's hidden state and its int64 index (without
# them, plans over such blocks measured 1.18-1.41x their prediction), a split gated MLP's multiply
# saves ``up``'s output whatever the plan. The profile runs one forward (and the loss) with a
# saved-tensor hook that keeps nothing while a block's member runs and everything the code between
# members saves, under the torch profiler, and reads which allocations made inside each block's
# forward are still alive when the last block's forward ends (so at least through the chain's forward,
# where the peak of a step usually is; the last block's input is alive then anyway, as the model's code
# still refers to it, so it counts when it is still alive at the loss): those are held whatever the
# plan (``pinned_bytes``; ``pinned_out_bytes`` for the block's outputs), so the chain model charges
# them to segments too (NOTE [ Chain cost model ] in ``remat.plan.chain``), and the solvers do not
# join blocks across them (``BlockProfile.chainable``).
# The same run gives ``reused_bytes``: a block's own output still alive when the next block ends,
# other than that block's input (a later block takes it, or the model's code holds it for a sum after
# later blocks, or while the next block runs on another input), which a segment going on past the block
# holds though it is not the segment's output.


# NOTE [ Pinned through the forward only ]
# Of what stays alive at the last block's end in that run, what is freed before the loss is computed is
# held by a segment through the step's forward only, never in the backward: autocast's cached weight casts
# under a region inside the model (freed when it exits; a kept block's matmul saves the cast, which its
# ``keep_bytes`` counts, while under a checkpoint only the cache holds it), a list of hidden states the
# model drops when it returns. A replay re-enters autocast per block call (``remat.core.runtime``), so
# its casts are the replayed blocks' saved tensors or die with the call. Charged through the backward
# (``pinned_bytes`` alone), full() on a 6-layer MLP under an autocast region was predicted 1.08x its
# measured peak, HF Llama's and BERT's split layers 1.17x (helper-73): ``pinned_fwd_bytes`` is that part,
# which the simulator drops from the level at the head (``remat.plan.solver``; the solvers keep it, on
# the safe side).


# NOTE [ Held through the last block, freed as it returns ]
# NOTE [ Alive after the call returns ] reads what the caller still holds at the first allocation after the
# last block returns, which is right for the outputs the caller rebinds, not for what an earlier block left
# alive through the whole of the last block's forward: autocast's cached weight casts under a region the
# model enters itself (``with torch.autocast(...)`` around its loop of layers) are all freed as that region
# exits, right after the last block, before the code allocates again. Read there, they were never pinned, so
# a segment's no-save forward was charged none of them while the cache held every one until the region's
# end: the smallest plan of 4 such layers (3 segments, then a kept block) peaked in the kept block's forward
# at 185,792 B, predicted 164,928 B there (helper-124). So a block's own allocation other than its outputs,
# alive at the last block's end, counts as pinned whenever the caller frees it (through the forward only
# when that is before the loss); the last block's own, at their peak there anyway, as before.


# NOTE [ Forward hooks run outside the block ]
# A replay (and an op-level policy's recomputation) runs a member's own ``forward``, never its module hooks
# (NOTE [ Spans ] in ``remat.core.runtime``): a forward hook of the model's (``relu(out) + x``, registered
# before the profile's) runs after the member's forward, as the code between blocks does, and what it saves
# (relu's output) is held whatever the plan. The pinned run's ``leave`` hook ran after the model's hooks,
# so it dropped their saves as the member's own, and the per-op profile counted their ops among the
# block's: plans with such a hook on two of six blocks measured 1.12-1.15x their prediction and budget,
# and an op-level policy cached the hook's relu, which its recomputation never runs (1.05x, and a
# warning). Both hooks are now the first of the member's forward hooks (``prepend=True``); the hook's
# allocations still fall inside the block's span (its ``p{i}`` marker comes after them), so they count
# as pinned by that block (helper-114).


def _pinned(
    model: nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    block_list: Sequence[Block],
    dev: torch.device,
    editing: Collection[int] = (),
    code_held: list[LateInput] | None = None,
    side_frees: list[list[tuple[int, int, int]]] | None = None,
) -> list[tuple[int, int, int, int, int]]:
    members = resolve(model, block_list)
    params = set(storages(list(model.parameters()), set()))
    outs: list[set[int]] = [set() for _ in block_list]
    handles = []
    last_inputs: set[int] = set()  # alive at the end of the last block because it is running on them
    ins: list[set[int]] = [set() for _ in block_list]  # each block's tensor arguments (alive at its call)

    depth = [0]  # member calls running: autograd saves nothing inside them, as under a span

    def pre(_m: nn.Module, args: Any, kwargs: dict[str, Any], i: int) -> None:
        ins[i].update(storages((args, kwargs), params))
        if i == len(members) - 1:
            last_inputs.update(storages((args, kwargs), params))
        mark(f"P{i}")

    def enter(*_: Any) -> None:
        depth[0] += 1

    def leave(*_: Any) -> None:
        depth[0] -= 1

    def pack(t: torch.Tensor) -> torch.Tensor | None:
        return None if depth[0] else t.detach()  # NOTE [ Saved outputs make cycles ] in remat.core.probe

    def unpack(t: Any) -> Any:
        if t is None:  # the loss differentiates through the blocks itself
            raise RematError(
                "profile: loss_fn differentiates through the model's blocks (torch.autograd.grad inside it: a "
                "gradient penalty, a double backward), which remat's profile cannot measure; profile with the loss "
                "without that term and plan with room for it, or apply a strategy without a profile "
                "(remat.apply(model, remat.every_nth(2)); its gradients stay exact)"
            )
        return t

    for i, mods in enumerate(members):
        handles.append(mods[0].register_forward_pre_hook(lambda _m, a, k, i=i: pre(_m, a, k, i), with_kwargs=True))

        def post(_m: nn.Module, _a: Any, out: Any, i: int = i) -> None:
            outs[i].update(storages(out, params, out=True))
            mark(f"p{i}")

        handles.append(mods[-1].register_forward_hook(post))
        for m in mods:
            handles.append(m.register_forward_pre_hook(enter))
            # First of its forward hooks: NOTE [ Forward hooks run outside the block ].
            handles.append(m.register_forward_hook(leave, prepend=True))

    def forward() -> None:
        # NOTE [ What stays alive anyway ]: what the members save is dropped, what the code between them
        # saves is kept (a span records only its members' calls).
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = call_model(model, inputs, "profile")
            loss = loss_fn(out)
            mark("loss")
            del out, loss

    try:
        allocs, times = allocation_lifetimes(forward, dev)
    finally:
        for h in handles:
            h.remove()
    n = len(block_list)
    end_key = f"p{n - 1}"
    if end_key not in times:
        raise RematError(
            f"measure: the profiler lost remat's {end_key!r} marker: a block ran on another thread than the one that "
            "runs the step (the profiler records that thread only; run the blocks on it), or another profiler is "
            "active (run with none)"
        )
    t_end = times[end_key]
    t_loss = times.get("loss", t_end)

    def alive_at(t_alloc: int, t_free: int | None, t: int) -> bool:
        return t_alloc <= t and (t_free is None or t_free > t)

    # NOTE [ Alive after the call returns ]: a block's post hook runs inside its call, before the caller
    # rebinds what it returned: `outputs = layer(h); h = outputs[0]` frees the previous layer's side outputs
    # (HF attention weights the model discards) only once this call has returned. What the caller still
    # holds is read at the first allocation after the marker (the code that goes on), else at the loss:
    # a tensor freed by that rebinding lived while the next block ran, not past it (every layer returning
    # such an output made each one reused and the last but one pinned: not a chain, segments charged with
    # a side output they never held, full() predicted 2.4x its measured peak).
    alloc_times = sorted(a[2] for a in allocs)

    def returned(t: int) -> int:
        k = bisect_right(alloc_times, t)
        return min(alloc_times[k], t_loss) if k < len(alloc_times) else t_loss

    t_after_end = returned(t_end)
    spans = [(times.get(f"P{i}", -1), times.get(f"p{i}", -1)) for i in range(n)]
    result = [[0, 0, 0, 0, 0] for _ in block_list]
    for ptr, size, t, t_free in allocs:
        owner = next((i for i, (a, b) in enumerate(spans) if a <= t <= b), None)
        if owner is None:
            continue
        if (
            owner + 1 < n
            and ptr in outs[owner]
            and t_free is not None
            # One of its outputs (alive when it returns), not a temporary of its forward whose address the
            # output took over; no later block takes it while it lives (an address a later input reuses
            # after the free does not count).
            and alive_at(t, t_free, spans[owner][1])
            and t_free < t_loss
            and not any(ptr in ins[j] and alive_at(t, t_free, spans[j][0]) for j in range(owner + 1, n))
            and not (owner + 1 in editing and ptr in outs[owner + 1])
        ):
            # NOTE [ Side outputs of a segment's last block ]: its own output that no later block takes, freed
            # by the model's code in the forward (BlockProfile.side_output_bytes), in the code after block
            # `after` (BlockProfile.side_output_frees); with the rise of that code before the free where it
            # is the head's and allocates first (_side_output_frees decides against the head's peak).
            result[owner][4] += size
            if side_frees is not None:
                after = bisect_left([a for a, _ in spans], t_free) - 1
                first = t_free <= returned(spans[after][1])
                if first or after == n - 1:
                    side_frees[owner].append((after, int(size), 0 if first else _rise(allocs, t_end, t_free)))
                else:  # the code after that block allocates first: gone after the next block's peak
                    side_frees[owner].append((after + 1, int(size), 0))
        # NOTE [ Held through the last block, freed as it returns ]
        through_last = owner + 1 < n and ptr not in outs[owner] and alive_at(t, t_free, t_end)
        if (alive_at(t, t_free, t_after_end) or through_last) and (
            ptr not in last_inputs or alive_at(t, t_free, t_loss)
        ):
            # Alive at the end of the last block's forward: held at least through the chain's forward,
            # where its peak usually is (a list of hidden states freed when the model returns counts).
            # The last block's input is alive then anyway (the model's code still refers to it): it
            # counts when it is alive at the loss too (the model's code between blocks saved it).
            result[owner][1 if ptr in outs[owner] else 0] += size
            if ptr not in outs[owner] and t_free is not None and t_free <= t_loss:
                result[owner][3] += size  # NOTE [ Pinned through the forward only ]
        elif (
            owner + 1 < n
            and ptr in outs[owner]
            and alive_at(t, t_free, spans[owner][1])
            and alive_at(t, t_free, returned(spans[owner + 1][1]))
            and (
                ptr not in ins[owner + 1]
                or any(ptr in ins[j] and alive_at(t, t_free, spans[j][0]) for j in range(owner + 2, n))
            )
            # The next block edits it in place and returns it (a ReLU(inplace=True)): it is that block's
            # output, which the blocks after it take.
            and not (owner + 1 in editing and ptr in outs[owner + 1])
        ):
            # The block's own output, still alive when the next block ends (BlockProfile.reused_bytes):
            # a later block takes it (a U-Net's skip), or the model's code holds it and frees it later
            # (GPT-NeoX's attn_output, the attention dropout's output summed into the residual after the
            # MLP). A segment that goes on past the block holds it too, though it is not its output. Not
            # the next block's input that only the calling code still refers to (an nn.Sequential of
            # Sequentials holds one inner Sequential's output while the next runs): the next block holds
            # that as its input (workload B's split plans were predicted 1.45x what they measured).
            # Allocation lifetimes in this run, not data pointers across runs: a freed output's address
            # that a later tensor reuses does not count.
            result[owner][2] += size
        elif code_held is not None and owner + 1 < n and ptr in outs[owner] and t_free is not None:
            # NOTE [ Outputs the model's code holds past their saving taker ]
            users = [j for j in range(owner + 1, n) if ptr in ins[j] and alive_at(t, t_free, spans[j][0])]
            if users and alive_at(t, t_free, returned(spans[users[-1]][1])) and t_free < t_loss:
                freed_after = bisect_left([a for a, _ in spans], t_free) - 1
                first = t_free <= returned(spans[freed_after][1])  # before the code after the block allocates
                code_held.append(
                    LateInput(
                        nbytes=int(size), producer=owner, freed_after=freed_after, users=tuple(users), freed_first=first
                    )
                )
    return [(a, b, c, d, e) for a, b, c, d, e in result]


# NOTE [ Side outputs of a segment's last block ]
# A layer may return more than the next layer takes: HF's GPT-Neo returns its attention weights
# (``outputs = (hidden_states,) + attn_outputs[1:]``), which the model's loop drops when it rebinds
# ``outputs`` at the next layer's call. Kept, the layer saves them (the matmul with the values), so its
# ``keep_bytes`` holds them to its backward and ``dropped_output_frees`` sees no free. Under a checkpoint
# ending with that layer nothing saves them: ``x_bytes`` (the block's own outputs) charges them to the
# segment from its end, on the safe side through the forward (they live while the next block runs), but
# when the segment replays they are long gone, while the replayed layer's ``S'`` (less ``out_free_bytes``,
# its unsaved outputs only) holds its recomputed copy: charged twice through the replay and its backward,
# GPT-Neo's smallest plans (one layer per segment, its attention checkpointed inside) measured 0.90-0.92x
# their prediction (4 layers, d=128, 128 tokens: 0.982x with it; one-layer segments of plain layers 1.000x,
# 0.94x before), tests/plan/test_side_outputs.py's 0.931x (1.000x with it). Here, with the members saving
# nothing, they show: the block's own outputs (alive when it returns: not a temporary of its forward whose
# address the output took over) that no later block takes while they live (a later input at the same
# address after the free does not count: HF BLOOM's first attention's probabilities were missed in some
# profiles by that reuse) nor the one after it edits in place and returns, freed by the model's code before
# the loss (the last layer's when the model returns: alive at the last block's end, also pinned above).
# ``chain_of`` keeps the part that is neither dropped already (``dropped_output_frees``) nor among the
# outputs the block does not save (``out_free_bytes`` takes those off the replay), and
# ``Chain.replay_hold_bytes`` takes it off the level the replay of a segment ending with the block runs
# above. Where the code drops them is recorded too (``BlockProfile.side_output_frees``, by allocation
# lifetimes as ``code_held`` below: after block ``after``'s forward when freed before the code after it
# allocates, else after the next block's; in the head, before its peak where the head's code rises no
# higher before the free than the head's measured peak less them, ``_side_output_frees``): the simulator
# takes them off the level there for a segment at the top level of a plan (``Chain.side_output_after``,
# as it takes off ``Chain.code_held_frees``), and gives them back at the replay, which nets them already.
# Not where the plain step frees one of them in the forward too (a storage of its size made in the block's
# forward, alive at its end, freed before the loss: ``_plain_forward_frees``, by lifetimes within the plain
# step's own trace): a gap of the plain step nets that free already. Fuzz seed 0's split ``y = fc(x); y += x``
# (counted as saved because the model's code edits it in place, dropped when the layer returns) got a second
# free, and ``full()`` measured 1.081x its prediction; address-based tests of the plain free against the
# probe's pointers missed it in some runs.
# Charged to the replay instead, they stayed on the level through the blocks after it, the head and
# the backward down to the replay: HF BLOOM's split layers (each ``self_attention`` returns its
# probabilities, the layer returns them, the loop drops them after the next layer's call) measured
# 0.77-0.89x their prediction, its smallest feasible peak was stated at 0.644 of the plain peak where that
# plan measured 0.542, and 60% was refused; 0.96-1.00x now (Falcon's, OPT's, Llama's and GPT-2's split
# layers, whose attention returns its weights too: 0.80-0.96x before, 0.96-1.00x). The solvers' tables
# still charge them from the segment's end to its replay, on the safe side of the simulation (a charge
# through a later range's forward only does not fit the program's one headroom per range), so a budget
# between the two is planned by the lowest-peak plan, which the planner judges by the simulation. A
# segment inside a replay holds them to its own replay (the outer replay keeps its calls' outputs). The
# last block's are the head's input (``x_bytes[n]``): left alone.


# NOTE [ Outputs the model's code holds past their saving taker ]
# A block's output that the model's Python code keeps alive after the last block that takes it (fuzz's
# residual ``h = ln(x); x = x + down(act(up(h)))``: ``h`` lives until the residual's forward returns; a skip
# dict ``saved[0] = h`` kept to a later sum between blocks) is saved by that taker in the plain step, so
# no free there shows it (``_late_inputs`` finds none). Under a checkpoint over the taker that saves
# nothing, the code still holds it from the segment's end to where the code drops it: a segment making
# and taking it charged nothing for it (fuzz seed 172 split/min measured 1.072x its budget, 2082 1.109x).
# Here, with the members saving nothing, it shows: alive past its last taker's call (read as for
# ``returned``), freed before the loss (alive at the last block's end: pinned above). Recorded in
# ``Profile.code_held_inputs``, which ``Chain.late_made_bytes`` charges as a late input made inside a
# segment (NOTE [ Late inputs made inside a segment ] in ``remat.plan.chain``), and nothing else: a
# checkpoint taking it from before holds it as the plain step's saving taker does. Unlike a plain late input,
# no kept block's ``gap_bytes`` credits its free (the plain step never frees it in the forward): the
# simulator takes it off the level itself (``Chain.code_held_frees``), after block ``freed_after``'s forward
# when the code frees it before it allocates again (``freed_first``: ``h`` above, dropped as the block
# returns), else after the next block's forward peak (the sum's rise, with the summand alive), at the top
# level only (a later segment freeing it inside: at that segment's end); the solvers' tables hold it to the
# segment's backward, on the safe side. Measured: seed 172's ``K0 K1 R[2:5](K2 K3 K4) K5 K6 K7`` 324736 =
# predicted (305384 before); ``R[2:4]``, ``R[3:5]``, ``R[4:5]`` stay exact.


# NOTE [ Code-held frees the plain step nets ]
# NOTE [ Outputs the model's code holds past their saving taker ] assumes the taker saves the tensor in the
# plain step, so no measured number nets its free and the simulator takes it off itself. A taker may save a
# copy instead: fuzz seed 836 (split) runs ``x = bn0(x.transpose(1, 2)).transpose(1, 2)`` then ``aux_head(x)``,
# a Linear whose matmul saves a contiguous copy of the non-contiguous view (an unlinked input, left out of
# ``late_inputs`` as charged by ``unlinked_bytes``). The plain step then frees ``bn0``'s output where the code
# drops it (the model's ``h`` rebound after ``blocks.1`` returns: in the head), and the head's measured peak
# nets that free already. The simulator took it off too: freed twice, and ``R[0:2](K0 K1) K2 K3`` measured
# 88456 B against 84096 predicted (1.052x; the fuzz cell split/sqrt). Such an entry is marked
# ``LateInput.netted`` (``_late_inputs`` names every input the plain step frees in the forward, as ``code_held``
# names them: the allocating block and the takers). How much of the free a measured number nets depends on
# how the plan runs block ``freed_after``: all of it where the block is kept (its signed ``gap_bytes`` is on
# the level; fuzz seed 808 split) or is the last (the head's peak); where a segment runs it, what its
# ``segment_bytes`` nets of that gap (rises only, ``max(0, g + gf)``, and ``released_bytes`` where the block is
# the segment's last: ``Chain.gap_netted_bytes``). ``Chain.code_held_frees`` names ``freed_after`` for such an
# entry, and the simulator takes off the rest only (``_Simulator._code_free``); a replay, where the code
# between blocks does not run, still drops it whole at once. Its ``late_made_bytes`` charge stays: the segment
# holds the view as its block's argument (``unlinked_bytes``) and the code holds the storage once more in the
# plain accounting, which the measured free takes off; from the segment's end to that free it is charged twice
# (safe side). Measured (tests/plan/test_code_held_unlinked.py, 64x16x4 floats): ``R[0:2](K0 K1) K2 K3``
# 220124 B for 219604 predicted (203220 before, 1.083x); with a block after the free, the free after a kept
# block 1.002x (1.067x), at the end of a segment ``R[2:4]`` 1.002x (1.066x), inside ``R[3:5]`` 1.002x (as
# before). Seed 836's cell: 88192 B predicted for 88456 (0.997x).


# NOTE [ Inputs held to the sub-module's backward end ]
# A sub-module checkpointed alone holds its inputs (as ``_SaveInputs`` in ``remat.core.runtime``) until
# its recording is dropped, when the last op of its backward has run. The profile counts an input the
# block saves as free to hold (``held_inputs`` charges only the others), but the plain step may free it
# earlier, inside the sub-module's backward: SpeechT5's relative position bias (made once from a learned
# embedding and passed to every encoder layer's attention) is saved by each attention's ``matmul`` and
# freed when the last layer's one runs backward, before its gradient and the other layers' are summed
# (a third bias-sized tensor): the block's backward peak. Checkpointed, the attention held the bias
# there too: measured 1.205x the budget, the excess exactly one bias (79*79*16*4 bytes). So each input
# that the plain step frees in the block's backward before the sub-module's saved tensors are all
# freed (where its recording would drop it) is added to the sub-module's backward peak from where the
# plain step freed it. The inputs its own first ops save (an attention's hidden states, saved by the
# projections) are freed with them, not before, and charge nothing. A segment over the whole block holds
# them the same way (R[0:1] over that layer measured the same 1.2x): ``BlockProfile.held_input_bwd_bytes``
# is how much higher the block's backward peaks so, and a segment's inner plan runs that much higher
# (``Chain.replay_hold_bytes``; on the safe side, its replayed forwards too). Measured per block: an input
# that a later block of a multi-block segment frees is counted to that block's own recording's end only.


def _rise(allocs: Sequence[tuple[int, int, int, int | None]], t0: int, t1: int) -> int:
    """The highest the level goes above its value at ``t0`` before ``t1`` (what is allocated in ``[t0, t1)`` less
    what is freed there), bytes."""
    deltas = sorted(
        [(t, size) for _, size, t, _ in allocs if t0 <= t < t1]
        + [(tf, -size) for _, size, _, tf in allocs if tf is not None and t0 <= tf < t1]
    )
    level = top = 0
    for _, size in deltas:
        level += size
        top = max(top, level)
    return top


def _side_output_frees(
    frees: Sequence[tuple[int, int, int]], n: int, head_peak_bytes: int, plain: Collection[int] | None = None
) -> tuple[tuple[int, int], ...]:
    """``BlockProfile.side_output_frees`` from ``(after, bytes, rise)`` of ``_pinned``: one the head's code frees
    after allocating (``rise`` > 0 above the level at the last block's end) is gone before the head's peak when
    that code rises no higher than the head's measured peak less it (the head runs the same code with the side
    output saved in the plain step: its peak comes after the free, and is that much lower), else after it
    (``n``; NOTE [ Side outputs of a segment's last block ]). Not one of a size the plain step frees in the
    forward too (``plain``, :func:`_plain_forward_frees`; all where not known): a gap of the plain step nets that
    free already (``chain_of`` gives no free to a block whose recorded frees do not cover its side outputs)."""
    if plain is None:
        return ()
    out = []
    for after, size, rise in frees:
        if size in plain:
            continue
        if rise > 0 and after == n - 1 and rise > head_peak_bytes - size:
            after = n
        out.append((after, size))
    return tuple(out)


def _plain_forward_frees(trace: MemoryTrace, n: int) -> list[set[int] | None]:
    """Per block, the sizes of the storages the plain step makes in its forward, still alive at its end, and frees
    before the loss (by allocation lifetimes and times, not addresses across runs); ``None`` where the trace lacks a
    marker."""
    marks = {name: ts[0] for name, ts in trace.mark_times().items()}
    starts = [marks.get(f"{Event.FORWARD}{i}") for i in range(n)]
    ends = [marks.get(f"{Event.FORWARD_END}{i}") for i in range(n)]
    if not trace.ptrs or "loss" not in marks or any(t is None for t in (*starts, *ends)):
        return [None] * n
    loss = marks["loss"]
    spans = sorted((int(a), int(b), k) for k, (a, b) in enumerate(zip(starts, ends)))  # type: ignore[arg-type]
    firsts = [a for a, _, _ in spans]
    out: list[set[int] | None] = [set() for _ in range(n)]
    born: dict[int, tuple[int, int]] = {}
    for when, ptr, delta in zip(trace.t_ns, trace.ptrs, trace.deltas):
        if delta > 0:
            born[ptr] = (when, delta)
        elif ptr in born:
            t0, size = born.pop(ptr)
            j = bisect_right(firsts, t0) - 1
            if when <= loss and j >= 0 and t0 <= spans[j][1] < when:
                freed = out[spans[j][2]]
                if freed is not None:
                    freed.add(size)
    return out


def _late_freed_inputs(
    lives: dict[int, list[tuple[int, int]]],
    tracked: Probe,
    block: int,
    slot: int,
    unsaved: dict[int, int],
    saved: dict[int, int],
    s0: int,
    s1: int,
    b0: int,
    b1: int,
) -> tuple[list[tuple[int, int]], int]:
    """``(freed, bytes)`` of each input of sub-module ``slot`` (of ``block``) that the block saves and the
    plain step frees in the block's backward ``[b0, b1]`` before the sub-module's recording would be dropped
    (NOTE [ Inputs held to the sub-module's backward end ]), in the order freed; and where it is dropped."""

    def freed(ptr: int, t: int) -> int | None:
        span = next((lt for lt in lives.get(ptr, ()) if lt[0] <= t < lt[1]), None)
        return None if span is None else span[1]

    # Where the recording is dropped: the last of the sub-module's own saved tensors is freed (else b1).
    ends = [f for f in (freed(ptr, s1) for ptr in saved) if f is not None and b0 <= f <= b1]
    release = max(ends, default=b1)
    out = []
    for ptr, size in tracked.inputs[slot].items():
        if ptr in unsaved or ptr in tracked._unlinked_storages[block]:
            continue  # charged as held_inputs / unlinked_bytes already
        f = freed(ptr, s0)
        if f is not None and b0 <= f < release:
            out.append((f, size))
    return sorted(out), release


def _forward_freed(
    lives: dict[int, list[tuple[int, int]]],
    tracked: Probe,
    slot: int,
    saved: dict[int, int],
    saved_bytes: int,
    held: dict[int, int],
    end: int,
    f1: int,
) -> int:
    """What checkpointing sub-module ``slot`` frees in its block's forward from its end (``end``) to the
    block's (``f1``), bytes (``SubProfile.fwd_freed_bytes``; NOTE [ Sub-module recomputation peak ]):
    ``saved_bytes`` less the part of its own outputs that it saves (its caller holds them as it holds the
    output), plus the inputs its checkpoint holds (``held``, charged by ``saved_bytes``) that the plain step
    holds past the block's forward end anyway (an attention mask the model passes every layer)."""

    def alive(ptr: int) -> bool:
        return any(lt[0] <= end < lt[1] and lt[1] > f1 for lt in lives.get(ptr, ()))

    outputs = sum(v for k, v in saved.items() if k in tracked.outputs[slot] and k not in tracked.cast_saved[slot])
    return saved_bytes - outputs + sum(v for k, v in held.items() if alive(k))


def _held_own_outputs(
    lives: dict[int, list[tuple[int, int]]],
    tracked: Probe,
    slot: int,
    saved: dict[int, int],
    end: int,
    b1: int,
    duration_ns: int,
) -> int:
    """The bytes of sub-module ``slot``'s own outputs that it saves and that the model's code holds past its
    backward, where its forward ended at ``end`` (``SubProfile.held_output_bytes``; NOTE [ Sub-module outputs
    held past the backward ] in ``remat.profile.types``): freed after every other tensor it saves (its
    backward's end) and after its block's backward end ``b1`` (which for the block whose backward runs last
    is the step's end, ``duration_ns``, where the outputs are dropped before it)."""

    def freed(ptr: int) -> int | None:
        return next((lt[1] for lt in lives.get(ptr, ()) if lt[0] <= end < lt[1]), None)

    outputs = {k: v for k, v in saved.items() if k in tracked.outputs[slot] and k not in tracked.cast_saved[slot]}
    others = [f for k in saved if k not in outputs and (f := freed(k)) is not None]
    if not others:
        return 0
    last = max(others)
    return sum(
        v for k, v in outputs.items() if (f := freed(k)) is not None and f > last and (f > b1 or b1 >= duration_ns)
    )


# NOTE [ Saves the plain step frees before the backward ]
# A sub-module's saves are what checkpointing it frees from its forward to its backward only where the plain
# step holds them that long. Under FSDP2 (``fully_shard`` on each layer) a Linear saves its all-gathered
# weight, a fresh storage each step (not a parameter the probe knows), which the layer's reshard after its
# forward frees (``resize_(0)``) whatever autograd holds, and its backward all-gathers again. Counted as freed,
# an MoE layer's experts checkpointed (``S0{layers.0.moe}``) on one FSDP2 rank were credited their weights'
# 64.5 KiB twice and measured 1.06x their prediction, the smallest plan 1.075-1.087x its budget. A saved
# storage alive at the sub-module's forward end that the plain step frees before the block's backward starts
# is left out of its ``saved`` (and so of ``saved_bytes``, the bytes freed).


def _held_to_backward(
    lives: dict[int, list[tuple[int, int]]], saved: dict[int, int], end: int | None, b0: int
) -> dict[int, int]:
    """``saved`` (storage address -> bytes) less the storages alive at ``end`` (the sub-module's forward end; all
    kept where it was not seen) that the plain step frees before ``b0``, the block's backward start (NOTE [ Saves
    the plain step frees before the backward ])."""
    if end is None:
        return saved
    out = {}
    for ptr, size in saved.items():
        span = next((lt for lt in lives.get(ptr, ()) if lt[0] <= end < lt[1]), None)
        if span is None or span[1] >= b0:
            out[ptr] = size
    return out


# NOTE [ Unsaved inputs held through the sub-module's backward ]
# An input of a sub-module that the block does not save (``held_inputs``, in ``SubProfile.held_inputs``) is
# charged by the level from the block's forward to its backward (``saved_bytes`` is net of it), but the plain
# step may free it long before: ``nn.MultiheadAttention(q, kv, kv)`` with ``batch_first=True`` projects a
# transposed view of ``kv = norm(data)``, so its matmul saves a contiguous copy and ``kv`` itself dies with the
# block's forward. Checkpointed, the attention's recording holds ``kv`` until its backward's last op, above
# everything that backward allocates; the sub-module's backward peak was taken from the plain curve there
# (``trace.peak_between(t, b1)``), which has no ``kv``. A Perceiver's smallest plan measured 1.068x its budget,
# three cross-attention layers with one checkpointed 1.08x and 1.12x (``kv`` and a clone of it as ``v``), by
# exactly those inputs. Each one the plain step has freed before the recording is dropped is added from the
# sub-module's backward start (or its free, if later) to that drop, as the late inputs above are.


def _unsaved_freed_inputs(
    lives: dict[int, list[tuple[int, int]]], unsaved: dict[int, int], s0: int, t: int, release: int
) -> list[tuple[int, int]]:
    """``(from, bytes)`` of each input of a sub-module that its block does not save (``unsaved``, alive at its
    forward ``s0``) and the plain step frees before ``release``, where its checkpoint's recording is dropped:
    held from its backward start ``t`` or from that free, whichever is later (NOTE [ Unsaved inputs held
    through the sub-module's backward ])."""
    out = []
    for ptr, size in unsaved.items():
        span = next((lt for lt in lives.get(ptr, ()) if lt[0] <= s0 < lt[1]), None)
        if span is not None and span[1] < release:
            out.append((max(span[1], t), size))
    return out


def _held_windows(late: list[tuple[int, int]], release: int) -> Iterator[tuple[int, int, int]]:
    """``(start, end, bytes held)`` from each free of ``late`` on, to ``release``: the bytes the checkpoint
    holds there that the plain step had freed."""
    held = 0
    for k, (f, size) in enumerate(late):
        held += size
        yield f, late[k + 1][0] if k + 1 < len(late) else release, held


def _held_input_bwd(
    trace: MemoryTrace,
    lives: dict[int, list[tuple[int, int]]],
    tracked: Probe,
    block: int,
    f0: int,
    f1: int,
    b0: int,
    b1: int,
) -> int:
    """How much higher block ``block``'s backward peaks when a checkpoint over it holds its inputs until its
    recording is dropped (``BlockProfile.held_input_bwd_bytes``; NOTE [ Inputs held to the sub-module's
    backward end ]): the inputs the plain step frees before that, held from where it frees them."""
    saved = {k: v for k, v in tracked.saved[block].items() if k not in tracked.inputs[block]}
    late, release = _late_freed_inputs(lives, tracked, block, block, {}, saved, f0, f1, b0, b1)
    held = [trace.peak_between(a, b) + extra for a, b, extra in _held_windows(late, release)]
    return max(0, max(held, default=0) - trace.peak_between(b0, b1))


def _gaps_of(
    trace: MemoryTrace, n: int
) -> Iterator[tuple[int, tuple[int, int, int], dict[int, list[tuple[int, int]]]]]:
    """Per block but the last, ``(i, (its forward's start, its end, the next block's start), lifetimes)``
    (the trace's allocation lifetimes by pointer), where all three marks were recorded."""
    marks = {name: ts[0] for name, ts in trace.mark_times().items()}
    lives = trace.lifetimes()
    for i in range(n - 1):
        start = marks.get(f"{Event.FORWARD}{i}")
        end = marks.get(f"{Event.FORWARD_END}{i}")
        after = marks.get(f"{Event.FORWARD}{i + 1}")
        if start is not None and end is not None and after is not None:
            yield i, (start, end, after), lives


def _unlinked_made(trace: MemoryTrace, tracked: Probe, n: int) -> list[int]:
    """Per block, the bytes of its inputs made between blocks (``unlinked_bytes``) whose storages the code after
    the previous block allocated, alive when the block starts (``BlockProfile.unlinked_made_bytes``; 0 for the
    first block). By allocation lifetimes: a view of the previous block's output is no allocation of the gap."""
    marks = {name: ts[0] for name, ts in trace.mark_times().items()}
    # Where the head runs: a storage freed there is left out (NOTE [ Unlinked inputs made in the gap ]).
    head = (marks.get(f"{Event.FORWARD_END}{n - 1}"), marks.get(f"{Event.BACKWARD}{n - 1}"))
    out = [0] * n
    for i, (_start, end, after), lives in _gaps_of(trace, n):
        for ptr, size in tracked._unlinked_storages[i + 1].items():
            span = next((lt for lt in lives.get(ptr, ()) if end <= lt[0] < after < lt[1]), None)
            if span is None or head[0] is None or head[1] is None or head[0] <= span[1] <= head[1]:
                continue
            out[i + 1] += size
    return out


def _gap_freed_inputs(trace: MemoryTrace, tracked: Probe, n: int, unlinked: bool = False) -> list[int]:
    """Per block, the bytes of its inputs that the code after it frees before the next block starts
    (``BlockProfile.gap_freed_input_bytes``; 0 for the last block, whose gap is the head's); with
    ``unlinked``, of its inputs made between blocks only (``BlockProfile.gap_freed_unlinked_bytes``).

    By allocation lifetimes, not by the level: a gap that frees the block's input and allocates as much
    nets to nothing (GPT-NeoX's ``a = drop(attn(h))`` drops the attention output as ``x + a`` is made, for
    the sum after the MLP), while a segment over the block holds its input or never had it, and holds
    what the gap allocates (NOTE [ Chain cost model ]).
    """
    out = [0] * n
    for i, (start, end, after), lives in _gaps_of(trace, n):
        for ptr, size in tracked.inputs[i].items():
            if (ptr in tracked._unlinked_storages[i]) != unlinked:
                continue  # made between blocks: unsaved_input_bytes holds it for a segment starting here
            span = next((lt for lt in lives.get(ptr, ()) if lt[0] <= start < lt[1]), None)
            if span is not None and end < span[1] <= after:
                out[i] += size
    return out


def _unsaved_unlinked_bytes(trace: MemoryTrace, tracked: Probe, n: int) -> list[int]:
    """Per block, the bytes of its inputs made between blocks that its forward does not save, less those the code
    right before it made and the plain step keeps into the backward (``BlockProfile.unsaved_input_bytes``; NOTE
    [ Unsaved inputs alive into the backward ]); all of those it does not save where the trace lacks the marks."""
    marks = {name: ts[0] for name, ts in trace.mark_times().items()}
    loss = marks.get("loss")
    lives = trace.lifetimes()
    out = []
    for i in range(n):
        start = marks.get(f"{Event.FORWARD}{i}")
        gap = marks.get(f"{Event.FORWARD_END}{i - 1}") if i else None
        if loss is None or start is None or gap is None:
            out.append(tracked.unsaved_unlinked(i))
            continue
        total = 0
        for ptr, size in tracked._unlinked_storages[i].items():
            if ptr in tracked.saved[i]:
                continue
            span = next((lt for lt in lives.get(ptr, ()) if lt[0] <= start < lt[1]), None)
            # Not charged: made by the code right before the block and alive into the backward. Charged: freed
            # in the forward, made earlier (inside a block, which a plan may recompute: a dict it writes into),
            # or not found (the safe side).
            if span is None or span[1] <= loss or span[0] < gap:
                total += size
        out.append(total)
    return out


# NOTE [ Unsaved inputs alive into the backward ]
# A segment starting at a block holds the block's inputs to its backward; of those made between blocks
# (``unlinked_bytes``) and not saved by the block itself, the chain charges ``unsaved_input_bytes`` on top of
# the level (``Chain.first_input_bytes``), for the plain step may free them in the forward (``x = f(y)``
# rebinding ``x``) where the segment does not. One the plain step keeps into the backward (saved by the code or
# a later block) is on the level already: the gap that made it charged it, and the chain releases it only at
# the backward of the block before, after this block's. Charged again, it was counted twice from the block's
# forward to its backward: a ResNet block split into its children, whose ``nn.Dropout(0.0)`` (diffusers'
# ``ResnetBlock2D``) or ``nn.Identity`` returns the ``silu`` output the code made before it and the next conv
# saves, put ``full()`` on a split diffusers ``UNet2DModel`` at 0.875 of its prediction (one activation per
# layer too many; ``tests/plan/test_unsaved_input_kept.py``). So, by allocation lifetimes in the traced step,
# one made by the code right before the block (after the previous block's forward ended) and freed only after
# the loss is not charged: whatever keeps it (the code's own saves, a later block's saves or, under a plan, that
# block's checkpoint holding its input) keeps it under every plan. One made inside an earlier block and handed
# on another way (written into a dict the blocks share) is still charged: what kept it may be that block's
# saved tensors, which a plan recomputing the block drops (tests/profile/test_argument_state.py).
# Nor is such an input what a negative gap after the block frees (``BlockProfile.code_kept_input_bytes``, taken
# off the inputs ``remat.plan.chain._released`` keeps): PyG's ``GINEConv`` splits into the edge ``Linear`` and
# the aggregation module, which takes the messages ``relu(x_j + lin(edge_attr))`` (kept by the relu) and saves
# none of them; the gap after it frees the gathered ``x_j`` instead, under a segment too, which the chain held
# to the segment's backward as if it were the messages: ``full()`` on such split layers measured 0.745 of its
# prediction after the fix above, 1.000 with this one (h132, tests/plan/test_code_kept_input_released.py).


def _gap_freed_outputs(trace: MemoryTrace, tracked: Probe, n: int) -> list[int]:
    """Per block, the bytes of its own outputs that the code after it frees before the next block starts
    (``BlockProfile.gap_freed_output_bytes``; 0 for the last block, whose gap is the head's).

    Never the next block's input (it is alive when that block starts), so 0 along an ordinary chain. Where the
    next block does not take it (``l(x, x)`` split into ``fc`` and ``g``: ``g`` takes ``x``, and the model's
    ``tanh(fc(x))``, which saves its result, frees ``fc``'s output), ``gap_bytes`` nets its free against what
    the gap allocates, while a segment going on past the block charges that output nothing already (made
    inside, dropped with it): it holds ``gap_bytes + gap_freed_output_bytes`` of the gap (NOTE [ Chain cost
    model ]).
    """
    out = [0] * n
    for i, (start, end, after), lives in _gaps_of(trace, n):
        for ptr, size in tracked.outputs[i].items():
            if ptr in tracked.inputs[i]:
                continue  # passed through: not its own output
            span = next((lt for lt in lives.get(ptr, ()) if start <= lt[0] <= end < lt[1]), None)
            if span is not None and span[1] <= after:
                out[i] += size
    return out


def _gap_freed_older_outputs(
    trace: MemoryTrace, tracked: Probe, n: int, dropped: list[tuple[tuple[int, int], ...]]
) -> list[tuple[tuple[int, int], ...]]:
    """Per block ``k``, ``(p, bytes)`` of the own outputs of each earlier block ``p`` that the code after ``k``
    frees before the next block starts (``BlockProfile.gap_freed_older_outputs``): a split layer's ``h = a(x)``
    that the model's code holds until ``b(h * 2 + 1)`` returns. By allocation lifetimes: made in ``p``'s forward,
    alive at its end. Not a block's outputs that ``dropped_output_frees`` books (the chain frees those right
    after their block)."""
    out: list[dict[int, int]] = [{} for _ in range(n)]
    gaps = {i: (start, end, after) for i, (start, end, after), _lives in _gaps_of(trace, n)}
    lives = trace.lifetimes() if gaps else {}
    for p, (p0, p1, _) in gaps.items():
        if dropped[p]:
            continue
        for ptr, size in tracked.outputs[p].items():
            if ptr in tracked.inputs[p]:
                continue  # passed through: not its own output
            span = next((lt for lt in lives.get(ptr, ()) if p0 <= lt[0] <= p1 < lt[1]), None)
            if span is None:
                continue
            for k in range(p + 1, n - 1):
                if k in gaps and gaps[k][1] < span[1] <= gaps[k][2]:
                    # Not an input of a block up to k: gap_freed_input_bytes and the late inputs count those.
                    if not any(ptr in tracked.inputs[j] for j in range(p + 1, k + 1)):
                        out[k][p] = out[k].get(p, 0) + size
                    break
    return [tuple(sorted(d.items())) for d in out]


def _loss_marked(loss_fn: Callable[[Any], torch.Tensor]) -> Callable[[Any], torch.Tensor]:
    """``loss_fn`` with a ``"loss"`` mark once the loss is made: the backward starts there."""

    def marked(out: Any) -> torch.Tensor:
        loss = loss_fn(out)
        mark("loss")
        return loss

    return marked


def _freed_after(t_free: int, k: int, starts: Sequence[Any], ends: Sequence[Any], backward: int) -> int | None:
    """The block ``j > k`` in the code after which (from its forward's end to the next block's start; the
    head's, ``n - 1``, to the backward) a storage block ``k`` made is freed at ``t_free``; ``None``: elsewhere."""
    n = len(starts)
    for j in range(k + 1, n):
        if int(ends[j]) < t_free <= (int(starts[j + 1]) if j + 1 < n else backward):
            return j
    return n - 1 if k == n - 1 and int(ends[k]) < t_free <= backward else None


def _taken_later(ptr: int, end: int, later: dict[int, list[int]], lives: dict[int, list[tuple[int, int]]]) -> bool:
    """Whether the storage at ``ptr`` alive at ``end`` (a block's forward end) is still that allocation when a later
    block taking ``ptr`` starts (``later``: address -> those blocks' start times); by address alone where the trace
    has no lifetime for it (NOTE [ A later block's input is an allocation, not an address ])."""
    if ptr not in later:
        return False
    span = next((lt for lt in lives.get(ptr, ()) if lt[0] <= end < lt[1]), None)
    return span is None or any(span[0] <= t < span[1] for t in later[ptr])


def _dropped_outputs(trace: MemoryTrace, tracked: Probe, n: int) -> list[tuple[tuple[int, int], ...]]:
    """Per block, ``(after, bytes)`` of its own outputs that no later block takes and that the forward frees in
    the code after a later block ``after`` (its gap; the head's, ``n - 1``, for the last blocks), before the
    backward starts (``BlockProfile.dropped_output_frees``; those its own gap frees are
    ``gap_freed_output_bytes``).

    HF layers return ``(hidden, attn_weights)`` and the model keeps the tuple in ``outputs`` until the next
    layer's call rebinds it: the side output lives through the next block's forward and is freed in its gap,
    never reaching the backward. The chain charged it as the segment's output, held to its backward (full()
    on four such layers predicted 2.4x its measured peak; BudgetInfeasibleError stated a smallest feasible
    peak above what full() reached). By allocation lifetimes: made in the block's forward, alive at its end.
    """
    marks = {name: ts[0] for name, ts in trace.mark_times().items()}
    starts = [marks.get(f"{Event.FORWARD}{i}") for i in range(n)]
    ends = [marks.get(f"{Event.FORWARD_END}{i}") for i in range(n)]
    if not trace.ptrs or any(t is None for t in (*starts, *ends)):
        return [()] * n
    if "loss" not in marks:
        return [()] * n
    backward = marks["loss"]  # not the last block's backward: the head's own backward frees what it saved first
    lives = trace.lifetimes()
    out: list[tuple[tuple[int, int], ...]] = []
    for k in range(n):
        f0, f1 = int(starts[k]), int(ends[k])  # type: ignore[arg-type]
        # NOTE [ A later block's input is an allocation, not an address ]: block j's inputs are addresses taken
        # at its start; one of them is this block's output only if that output's allocation is still alive
        # then. The allocator hands a dropped output's address to a later tensor (``x, attn = layer(x)``: the
        # previous ``attn``, freed as the name is rebound, becomes the next layer's hidden state), which by
        # address alone read as taken by a later block: the side output was charged as held to its backward
        # (full() over six such layers 0.86x its measured peak, and which side outputs were missed changed
        # from one profile to the next with the allocator's reuse).
        later: dict[int, list[int]] = {}
        for j in range(k + 1, n):
            for ptr in tracked.inputs[j]:
                later.setdefault(ptr, []).append(int(starts[j]))  # type: ignore[arg-type]
        frees: dict[int, int] = {}
        if k + 1 < n and not any(_taken_later(ptr, f1, later, lives) for ptr in tracked.outputs[k]):
            # No output the next blocks take: what it returns is the model code's to use (a split layer's
            # dropout output held across the next children for `x + a + mlp(...)`), not a side output
            # dropped next to the hidden state the chain goes on with.
            out.append(())
            continue
        for ptr, size in tracked.outputs[k].items():
            if ptr in tracked.inputs[k] or _taken_later(ptr, f1, later, lives):
                continue  # passed through, or a later block's input (x_bytes of the chain)
            span = next((lt for lt in lives.get(ptr, ()) if f0 <= lt[0] <= f1 < lt[1]), None)
            if span is None or span[1] > backward:
                continue
            after = _freed_after(span[1], k, starts, ends, backward)
            if after is not None:
                frees[after] = frees.get(after, 0) + size
        out.append(tuple(sorted(frees.items())))
    return out


def _dead_saved(trace: MemoryTrace, tracked: Probe, n: int) -> tuple[list[tuple[tuple[int, int], ...]], list[int]]:
    """Per block, ``(after, bytes)`` of what autograd saved in its forward (not its inputs or outputs) that the
    forward frees in the code after a later block ``after`` (its gap; the head's, ``n - 1``, for the last
    blocks), not in the block's own gap (``BlockProfile.dead_saved_frees``).

    A block returning ``(h, aux)`` whose ``aux`` the model's code drops (``h, aux = layer(h)``, ``aux`` unused)
    keeps what the aux branch saved until the next call rebinds ``aux``: the plain step frees it in the next
    block's gap, whose ``gap_bytes`` nets the free, while a plan recomputing the block never saved it, and a
    kept later block credited that free once more (h72's dead-output repro: 1.15x its budget). The branch's
    output itself is ``dropped_output_frees``. By allocation lifetimes, as :func:`_dropped_outputs`.

    Also, per block, the part of what the head frees (``after = n - 1``) that it frees once its peak is
    reached (``BlockProfile.dead_head_late_bytes``): ``head_peak_bytes`` nets the free of the rest, which
    happens under a plan recomputing the block no more (the head then peaks that much higher above what is
    left), while for this part the head peaks above the level as measured (``Chain.dead_branches``).
    """
    marks = {name: ts[0] for name, ts in trace.mark_times().items()}
    starts = [marks.get(f"{Event.FORWARD}{i}") for i in range(n)]
    ends = [marks.get(f"{Event.FORWARD_END}{i}") for i in range(n)]
    if not trace.ptrs or any(t is None for t in (*starts, *ends)) or "loss" not in marks:
        return [()] * n, [0] * n
    backward = marks["loss"]
    lives = trace.lifetimes()
    # When the head first reaches its peak (head_peak_bytes: from the last block's end to its backward).
    last_end = int(ends[-1])  # type: ignore[arg-type]
    last_bwd = marks.get(f"{Event.BACKWARD}{n - 1}", trace.duration_ns)
    head_top = trace.peak_between(last_end, last_bwd)
    lo, hi = bisect_right(trace.t_ns, last_end), bisect_right(trace.t_ns, last_bwd)
    head_peak_t = next((trace.t_ns[i] for i in range(lo, hi) if trace.level_bytes[i] == head_top), last_end)
    out: list[tuple[tuple[int, int], ...]] = []
    late = [0] * n
    for k in range(n):
        f0, f1 = int(starts[k]), int(ends[k])  # type: ignore[arg-type]
        frees: dict[int, int] = {}
        for ptr, size in tracked.saved[k].items():
            if ptr in tracked.outputs[k] or ptr in tracked.inputs[k]:
                continue
            span = next((lt for lt in lives.get(ptr, ()) if f0 <= lt[0] <= f1 < lt[1]), None)
            if span is None or span[1] > backward:
                continue
            after = _freed_after(span[1], k, starts, ends, backward)
            if after is not None:
                frees[after] = frees.get(after, 0) + size
                if after == n - 1 and span[1] > head_peak_t:
                    late[k] += size
        out.append(tuple(sorted(frees.items())))
    return out, late


def _late_inputs(
    trace: MemoryTrace,
    tracked: Probe,
    n: int,
    netted: set[tuple[int, int, tuple[int, ...]]] | None = None,
    later: list[tuple[tuple[int, int, tuple[int, ...]], LateInput]] | None = None,
) -> tuple[LateInput, ...]:
    """The block inputs that the plain step frees in the forward after the block that takes them last
    (``Profile.late_inputs``; NOTE [ Chain cost model ]): T5's position bias, made by a stack's first layer,
    taken by every layer and saved by none, is dropped when the stack returns (in a gap, or in the head
    for the last stack), while a checkpoint over layers that take it holds it to its backward.

    ``netted`` receives ``(bytes, producer, users)`` of every block input the plain step frees in the forward,
    the unlinked ones left out of the result included, named as ``Profile.code_held_inputs`` are (the block
    that allocated it, the blocks that take it): NOTE [ Code-held frees the plain step nets ]. ``later``
    receives that name and the entry of each unlinked input taken by one block that the plain step frees after
    a later block (NOTE [ Held inputs freed in a later gap ] in ``remat.plan.chain``), left out of the result.


    A storage is named by its address and a time (the allocator reuses addresses): the allocation live
    at that address when a block that takes it starts. Inputs the step did not allocate (held before it),
    inputs freed in the backward and inputs made between blocks (``unlinked_bytes``, charged as such) are
    left out; one made between blocks that a later block takes again is kept from the last block it is
    unlinked for (NOTE [ Unlinked inputs taken again later ]).
    """
    marks = {name: ts[0] for name, ts in trace.mark_times().items()}
    starts = [marks.get(f"{Event.FORWARD}{i}") for i in range(n)]
    if not trace.ptrs or any(t is None for t in starts) or f"{Event.FORWARD_END}{n - 1}" not in marks:
        return ()
    begin: list[int] = [int(t) for t in starts if t is not None]
    last_end = marks[f"{Event.FORWARD_END}{n - 1}"]
    backward = min([t for name, t in marks.items() if name[:1] == str(Event.BACKWARD)], default=trace.duration_ns)
    lives = trace.lifetimes()

    def live(ptr: int, t: int) -> tuple[int, int] | None:
        return next((lt for lt in lives.get(ptr, ()) if lt[0] <= t < lt[1]), None)

    # NOTE [ Unlinked inputs are allocations, not addresses ]
    unlinked: dict[tuple[int, int], int] = {}  # (ptr, born) -> the last block it is an unlinked input of
    for j in range(n):
        for ptr in tracked._unlinked_storages[j]:
            if (span := live(ptr, begin[j])) is not None:
                unlinked[(ptr, span[0])] = j
    found: dict[tuple[int, int], tuple[int, int, list[int]]] = {}  # (ptr, born) -> (bytes, freed, users)
    for j in range(n):
        for ptr, size in tracked.inputs[j].items():
            span = live(ptr, begin[j])
            if span is None:
                continue
            found.setdefault((ptr, span[0]), (size, span[1], []))[2].append(j)
    out = []
    for (ptr, born), (size, freed, users) in sorted(found.items(), key=lambda kv: kv[0][1]):
        if freed >= backward:
            continue  # freed in the backward (saved, or held by the model): the plain step holds it as long
        producer = bisect_right(begin, born) - 1
        if netted is not None:
            netted.add((int(size), producer, tuple(users)))
        # NOTE [ Unlinked inputs taken again later ]
        maker = unlinked.get((ptr, born))
        freed_after = n if freed >= last_end else bisect_right(begin, freed) - 1
        if maker is not None:
            key = (int(size), producer, tuple(users))
            users = [maker, *(u for u in users if u > maker)]
            if len(users) == 1:
                # Charged as unlinked_bytes / unsaved_input_bytes of its blocks, as made between them; freed
                # after a later block than its taker, also as held to there (NOTE [ Held inputs freed in a later
                # gap ] in remat.plan.chain), where the caller does not know it as code-held already.
                if later is not None and freed_after > maker:
                    later.append(
                        (key, LateInput(nbytes=int(size), producer=maker, freed_after=freed_after, users=(maker,)))
                    )
                continue
            producer = maker
        out.append(LateInput(nbytes=int(size), producer=producer, freed_after=freed_after, users=tuple(users)))
    return tuple(out)


# NOTE [ Unlinked inputs taken again later ]
# An input the model's code makes between blocks (``unlinked_bytes``) is charged as such by a segment that
# goes on through the block it is made for (``un``) or starts there (``us``), so ``_late_inputs`` left it
# out. A later block may take it again: fuzz seed 361 (split) makes ``x = flip(..)`` before
# ``blocks.2.aux_head`` (block 7, whose unlinked input it is), ``blocks.3.linear0`` (block 8) takes it too,
# neither saves it (a linear layer saves a contiguous copy of a non-contiguous input), and the model's ``h``
# holds it until ``blocks.3`` returns: the plain step frees it in the head, whose measured rise nets that
# free. A checkpoint over block 8 holds it to its backward, and nothing charged it: ``K0 .. K7 R[8:9](K8)
# K9 ..`` measured 1.048x its prediction, the fuzz cell's smallest plan ``R[0:2](K0 K1) K2 .. K7 R[8:10](K8
# K9) K10 K11`` 7882624 B against its budget of 7489408 B (1.053x). So it is a late input from the last block
# it is an unlinked input of: ``producer`` is that block (for the chain it is made there: a segment reaching
# it charges it as unlinked, and ``Chain.late_records`` / ``_late_tables`` skip it as made inside), and
# ``users`` starts with that block, then the later ones that take it. ``producer in users`` marks such an
# entry: ``Chain.late_made_bytes`` (first user after the producer), ``Chain.code_held_frees``,
# ``Chain.late_netted_bytes`` and ``Chain.head_freed_bytes`` (a tensor a segment from ``producer`` on does not
# hold otherwise) leave it to ``un`` / ``us``. Measured on seed 361, every single-segment plan: R[8:9] and
# R[8:10] exact (1.048x, 1.050x before), the fuzz cell's plan exact (7882624 B); R[8:11] 0.952x (exact before
# by a cancellation: the gap after block 10 frees the segment's own output, an in-place activation's, which
# ``gap_freed_input_bytes`` charges as held); the rest unchanged.


# NOTE [ Unlinked inputs are allocations, not addresses ]
# ``_late_inputs`` leaves out the inputs made between blocks (``Probe._unlinked_storages``, by address, of
# each block's call). The allocator hands a freed block's address to a later allocation, so an address
# alone named another tensor: fuzz seed 361 (split) frees the chain's input ``h`` after block 3, and the
# sum ``x + aux_in`` that the model's code makes before block 4 (block 4's unlinked input) got its address
# in some runs and not in others (the heap as the process had used it before; block 6's input too): ``h``
# was left out of ``late_inputs``, one run's smallest plan had 7096192 B as its budget and the next
# 7489408 B, and the same plan measured 7882624 B in both. An unlinked input is the allocation live at
# that address when its block starts, as the late inputs themselves are named: ``(ptr, born)``.


def _drop(_t: Any) -> Any:
    return None


# NOTE [ Gradients in the backward ]
# With grads="none" every parameter gradient is allocated during the iteration's backward and stays to
# its end (NOTE [ What a step's peak means ]). The profile hooks each parameter that has no gradient
# when the profiled iteration starts (``register_post_accumulate_grad_hook``) and marks when its
# gradient is first accumulated; the gradient's bytes (its storage, once) then belong to the window
# the mark falls in: the head's backward (before the last block's backward starts), block k's (from
# the start of its backward to the start of block k-1's: code between two blocks counts with the
# block after it, whose backward has ended by then), or the tail (after block 0's backward:
# embeddings). The chain model adds them to the level where they appear (``BlockProfile.grad_bytes``,
# ``Profile.head_grad_bytes``; the tail's are inside ``tail_peak_bytes``), and each block's backward
# peak is measured above the gradients allocated before it started. A gradient accumulated into again
# (tied weights) counts once, where it first appeared. With grads="held" no gradient is allocated.


@contextlib.contextmanager
def _grad_marks(model: nn.Module) -> Iterator[list[nn.Parameter]]:
    """Mark ``g<j>`` each time the ``j``-th parameter without a gradient gets one accumulated."""
    fresh = [p for p in model.parameters() if p.requires_grad and p.grad is None]
    handles = [p.register_post_accumulate_grad_hook(lambda _p, j=j: mark(f"g{j}")) for j, p in enumerate(fresh)]
    try:
        yield fresh
    finally:
        for h in handles:
            h.remove()


def _grad_events(trace: MemoryTrace, fresh: list[nn.Parameter]) -> list[tuple[int, int]]:
    """``(time first accumulated, bytes)`` of every gradient the traced iteration allocated, one per storage."""
    times = trace.mark_times()
    seen: set[int] = set()
    out = []
    for j, p in enumerate(fresh):
        if f"g{j}" not in times or p.grad is None:
            continue
        try:
            st = p.grad.untyped_storage()
            ptr = st.data_ptr()
        except (RuntimeError, NotImplementedError):
            continue
        if ptr not in seen:
            seen.add(ptr)
            out.append((times[f"g{j}"][0], st.nbytes()))
    return sorted(out)


def _grad_owners(
    grad_events: list[tuple[int, int]], bwd_start: list[int], tail_start: int
) -> tuple[list[int], int, int]:
    """Gradient bytes first allocated in each block's backward, the head's and the tail's
    (NOTE [ Gradients in the backward ])."""
    n = len(bwd_start)
    per_block, head, tail = [0] * n, 0, 0
    for t, size in grad_events:
        owner = min((k for k in range(n) if bwd_start[k] <= t), default=None)
        if owner is None:
            head += size
        elif owner == 0 and t > tail_start:
            tail += size
        else:
            per_block[owner] += size
    return per_block, head, tail


def _gaps(trace: MemoryTrace, n: int) -> list[int]:
    """Level change from the end of each block's forward to the start of the next (0 for the last)."""
    marks = {name: ts[0] for name, ts in trace.mark_times().items()}
    out = []
    for i in range(n):
        if i + 1 < n and f"{Event.FORWARD_END}{i}" in marks and f"{Event.FORWARD}{i + 1}" in marks:
            out.append(
                trace.level_at(marks[f"{Event.FORWARD}{i + 1}"]) - trace.level_at(marks[f"{Event.FORWARD_END}{i}"])
            )
        else:
            out.append(0)
    return out


def _count_flops(
    it: Iteration, model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor], block_list: Sequence[Block]
) -> list[tuple[str, int, int]]:
    """One iteration (forward, backward, the optimizer's step) counting FLOPs: the total at each block boundary."""
    flop_events: list[tuple[str, int, int]] = []
    counter = _FlopCount()
    with probe(model, block_list, lambda kind, i: flop_events.append((kind, i, counter.total))):
        it.reset()
        with (
            higher_order_refused(
                "profile: the model",
                "remat cannot profile this model: apply a strategy to the blocks that do not call it, without a profile (remat.apply(model, remat.selective([...])))",
            ),
            counter,
        ):
            train_step(model, inputs, loss_fn, where="profile")
        flop_events.append(("end", 0, counter.total))
    it.optimizer_step()
    return flop_events


def _check_order(
    calls: list[int],
    order: list[int],
    block_list: Sequence[Block],
    backward_calls: list[int],
    no_grad: list[bool],
    model: nn.Module | None = None,
) -> None:
    again = [block_list[i].name for i, c in enumerate(backward_calls) if c]
    if again:
        raise BlockSelectionError(
            f"profile: block {again[0]!r} ran again in the backward ({len(again)} of {len(block_list)} blocks did): the model "
            "recomputes it itself (torch.utils.checkpoint in its forward, HF's gradient_checkpointing_enable() or "
            "TrainingArguments(gradient_checkpointing=True), reversible layers as HF Reformer's); turn that off "
            "(model.gradient_checkpointing_disable()) and let remat plan the recomputation"
        )
    off = [block_list[i].name for i, flag in enumerate(no_grad) if flag]
    if off:
        raise BlockSelectionError(
            f"profile: block {off[0]!r} ran with gradients off ({len(off)} of {len(block_list)} blocks did: under torch.no_grad, or "
            "inside a custom autograd Function, as HF Reformer's reversible layers, which recompute themselves): it saves nothing for the "
            "backward, so checkpointing it cannot lower the peak and its backward cannot be measured; choose "
            "blocks that run with gradients (include=..., named=...)"
        )
    bad = [(block_list[i].name, c) for i, c in enumerate(calls) if c != 1]
    if bad:
        name, runs = bad[0]
        why = (
            f"{name!r} ran {runs} times: a module called more than once per step (one dropout shared by two "
            "sub-layers, one layer applied n times as in ALBERT) cannot be a block of its own; with "
            "remat.blocks(model, split=True) keep such layers whole (split=False, or named=[...] groups), "
            "otherwise choose the module that calls it"
            if runs > 1
            else f"{name!r} did not run through its __call__: "
            f"{looped_hint(model, block_list[calls.index(0)]) if model is not None else ''}a model that calls a block's forward directly "
            "(layer.forward(x), as HF SqueezeBERT's encoder does) bypasses the module hooks the profile times it "
            "with: choose the module that calls it (include=...) or apply a strategy that needs no profile "
            "(remat.apply(model, remat.sqrt())); a model that skips layers at random (LayerDrop: HF's layerdrop / "
            "encoder_layerdrop) cannot be profiled: set that probability to 0 to profile and plan, or apply such "
            "a strategy; with split=True, a child the forward never calls cannot be a block (split=False)"
        )
        raise BlockSelectionError(
            f"profile: blocks must run exactly once per step, but {bad[:3]} (name, runs) did not; {why}"
        )
    if order != sorted(order):
        names = [block_list[i].name for i in order]
        raise BlockSelectionError(
            f"profile: blocks ran in the order {names[:6]}..., not in their listed order; "
            "list blocks in forward order (named=... or include=...)"
        )


def _assemble(
    model: nn.Module,
    block_list: Sequence[Block],
    tracked: Probe,
    trace: MemoryTrace,
    runs: dict[str, list[list[tuple[str, int, int]]]],
    step_ms: list[float],
    flops: dict[tuple[str, int], int],
    held: int,
    dev: torch.device,
    n: int,
    grad_events: list[tuple[int, int]],
    selective: Sequence[bool],
    stop_share: Sequence[float],
    call_ms: float,
) -> Profile:
    marks = {name: ts[0] for name, ts in trace.mark_times().items()}
    # The backward ends where the optimizer's step starts (or the iteration ends).
    end = marks.get("optimizer_start", trace.duration_ns)

    def mt(kind: Event, i: int, default: int | None = None) -> int:
        key = f"{kind}{i}"
        if key in marks:
            return marks[key]
        if default is not None:
            return default
        raise RematError(f"profile: no {kind}{i} boundary was recorded; the block's output must require grad")

    timings = {name: [_times(events) for events in config_runs] for name, config_runs in runs.items()}

    def ms(a: tuple[str, int], b: tuple[str, int], config: str = "plain") -> float:
        # NOTE [ Learning calls are not timed ]: the iterations whose first calls learned, only if no other;
        # NOTE [ Disturbed iterations ]: the disturbed ones, only if no other.
        every = timings.get(config, [])
        runs = [t for t in every if ("learning", 0) not in t and ("disturbed", 0) not in t] or [
            t for t in every if ("disturbed", 0) not in t
        ]
        # Every iteration disturbed (after the retimes): the fastest, which the disturbance slowed least.
        pick = median if runs else min
        runs = runs or [t for t in every if ("learning", 0) not in t] or every
        vals = [(t.get(b, t[("backward_end", 0)]) - t[a]) / 1e6 for t in runs if a in t]
        return max(0.0, pick(vals)) if vals else 0.0

    def block_ms(i: int, config: str) -> float:
        # Forward plus backward of block i in a configuration (recomputation included).
        return ms((Event.FORWARD, i), (Event.FORWARD_END, i), config) + ms(
            (Event.BACKWARD, i), (Event.BACKWARD_END, i), config
        )

    def fl(a: tuple[str, int], b: tuple[str, int]) -> int:
        return max(0, flops.get(b, flops.get(("end", 0), 0)) - flops.get(a, 0))

    # The per-op profile runs under a dispatch mode: its shares, not its times, apply to the plain forward.
    stop_ms = [share * ms((Event.FORWARD, i), (Event.FORWARD_END, i)) for i, share in enumerate(stop_share)]

    # A block whose output needs no gradient (frozen, LoRA-style) has no backward: a zero-length
    # one where the next block's backward ends (or the backward ends).
    bwd_start = [
        mt(
            Event.BACKWARD,
            i,
            next((marks[k] for k in (f"{Event.BACKWARD_END}{j}" for j in range(i + 1, n)) if k in marks), end),
        )
        for i in range(n)
    ]
    bwd_end = [
        mt(Event.BACKWARD_END, i, bwd_start[i] if f"{Event.BACKWARD}{i}" not in marks else end) for i in range(n)
    ]
    # Where the backward of the code after each block starts: the next block's backward has ended (the
    # last block's: its own backward start, after the head's, which head_peak_bytes covers).
    bwd_after = [bwd_end[i + 1] if i + 1 < n else bwd_start[i] for i in range(n)]
    # NOTE [ Replay level ]: where the backward first unpacked what each block saved, inside its backward.
    unpack_at = [
        u if bwd_start[i] <= (u := mt(Event.UNPACK, i, bwd_start[i])) <= bwd_end[i] else bwd_start[i] for i in range(n)
    ]
    gap_after = _gaps(trace, n)
    tail_start = mt(Event.BACKWARD_END, 0, end)
    grads, head_grads, tail_grads = _grad_owners(grad_events, bwd_start, tail_start)
    sub_index = 0
    lives = trace.lifetimes()
    profiles = []
    for i, b in enumerate(block_list):
        f0, f1 = mt(Event.FORWARD, i), mt(Event.FORWARD_END, i)
        b0 = bwd_start[i]
        b1 = bwd_end[i]
        # NOTE [ Gradients in the backward ]: the gradients allocated before this backward started.
        grads_before = sum(size for t, size in grad_events if t < b0)
        l_f0 = trace.level_at(f0)
        plain_ms = block_ms(i, "plain")
        # NOTE [ Sub-module recomputation peak ]: where each sub-module's backward starts, and the order.
        first_sub = sub_index
        # NOTE [ A sub-module returning the block's output ]: a sub-module whose output is the block's own
        # (performer-pytorch's PreLayerNorm returns its attention's output) has its backward hook on the same
        # tensor, registered first (its forward returned first), so it fires just before the block's: with no
        # allocation between the two, its backward starts with the block's. Left out as not seen, the last
        # PerformerLM layer's attention was charged ``bp + saved``, below its recomputation's rise (measured
        # 169,544 B over its prediction, the smallest plan 1.045x its budget).
        sub_bwd = {
            j: max(t, b0)
            for j in range(first_sub, first_sub + len(b.attention_fqns) + len(b.ffn_fqns))
            if (t := marks.get(f"{Event.SUB_BACKWARD}{j}")) is not None
            and (b0 <= t <= b1 or (t < b0 and bisect_right(trace.t_ns, t) == bisect_right(trace.t_ns, b0)))
        }
        bwd_rank = {j: r for r, j in enumerate(sorted(sub_bwd, key=lambda j: (sub_bwd[j], j)))}
        bwd_level = trace.level_at(f1) + grads_before  # the reference of bwd_peak_bytes below
        subs = []
        for fqn in (*b.attention_fqns, *b.ffn_fqns):
            slot = n + sub_index
            if tracked.edits_input[slot] or tracked.stateful[slot]:
                # It edits its input in place (Mixtral's router jitter), or changes a mutable argument (an
                # attention appending to the KV cache it is passed): checkpointing it alone is refused
                # by apply, so it gets no profile and the planner no sub-module variant for it.
                sub_index += 1
                continue
            saved = {k: v for k, v in tracked.saved[slot].items() if k not in tracked.inputs[slot]}
            # NOTE [ Saves the plain step frees before the backward ]: what it saves that is gone before the
            # block's backward (FSDP2's all-gathered weights) is not what checkpointing it frees.
            saved = _held_to_backward(lives, saved, marks.get(f"{Event.SUB_END}{sub_index}"), bwd_start[i])
            # Checkpointing the sub-module holds its inputs (and an RNG state): free where the block saves
            # them anyway, a cost where it does not (a frozen layer with LoRA adapters saves no input).
            # By storage (NOTE [ Inputs a block saves are storages, not addresses ] in remat.core.probe): an
            # input freed in the block's forward, whose address a tensor the block saves later takes, is not saved.
            unsaved_inputs = {
                k: v for k, v in tracked.inputs[slot].items() if k not in tracked.inputs_saved_by_block[slot]
            }
            held_inputs = sum(unsaved_inputs.values())
            rng_bytes = int(torch.get_rng_state().nbytes) if dev.type == "cpu" else 0
            # The casts of the parameters in autocast's cache that it saves, made in this iteration: the cache
            # holds them to its region's end (the step's forward at least) whatever the checkpoint, so
            # checkpointing it does not free them there (counted freed, a T5 plan with attentions checkpointed
            # under an autocast region inside the model measured 1.066x its budget, 0.917x its prediction).
            # In the backward the region has exited and it does free them: left out, on the safe side.
            casts = sum(v for k, v in tracked.cast_saved[slot].items() if k in saved)
            saved_bytes = sum(saved.values()) - held_inputs - rng_bytes - casts
            sub_peak = None
            if sub_index in sub_bwd:
                t = sub_bwd[sub_index]
                s0, s1 = mt(Event.SUB, sub_index), mt(Event.SUB_END, sub_index)
                # Its recomputation there rises as its forward did at most, above the RNG state it stashes,
                # and leaves saved_bytes of it; the RNG state its checkpoint holds (out of saved_bytes) is
                # held to the block's backward end.
                rise = trace.peak_between(s0, s1) - trace.level_at(s0) + rng_bytes
                # NOTE [ Inputs held to the sub-module's backward end ]: the inputs the plain step frees
                # inside the sub-module's backward, counted from where it frees them.
                late, release = _late_freed_inputs(lives, tracked, i, slot, unsaved_inputs, saved, s0, s1, b0, b1)
                held_at_t = sum(size for f, size in late if f <= t)
                # NOTE [ Unsaved inputs held through the sub-module's backward ]: and those the block does not
                # save, which the level after its recomputation holds (not in saved_bytes), from t on.
                gone = _unsaved_freed_inputs(lives, unsaved_inputs, s0, t, release)
                windows = _held_windows(sorted(late + gone), release)
                sub_peak = (
                    max(
                        trace.peak_between(t, b1),
                        trace.level_at(t) + held_at_t + rise - saved_bytes,
                        *(trace.peak_between(f0_, f1_) + extra for f0_, f1_, extra in windows),
                    )
                    + rng_bytes
                    - bwd_level
                )
            # And the block's forward, from the sub-module's forward end on, runs without what it saved.
            sub_end = marks.get(f"{Event.SUB_END}{sub_index}")
            fwd_split = fwd_freed = None
            held_outputs = 0
            if sub_end is not None and f0 <= sub_end <= f1:
                # NOTE [ Sub-module outputs held past the backward ] in remat.profile.types.
                held_outputs = _held_own_outputs(lives, tracked, slot, saved, sub_end, b1, trace.duration_ns)
                fwd_split = (trace.peak_between(f0, sub_end) - l_f0, trace.peak_between(sub_end, f1) - l_f0)
                fwd_freed = _forward_freed(lives, tracked, slot, saved, saved_bytes, unsaved_inputs, sub_end, f1)
            subs.append(
                SubProfile(
                    fqn=fqn,
                    saved_bytes=saved_bytes,
                    output_bytes=sum(tracked.outputs[slot].values()),
                    fwd_ms=ms((Event.SUB, sub_index), (Event.SUB_END, sub_index)),
                    # NOTE [ Measured checkpoint costs ]: its forward once more, and one checkpoint call.
                    extra_ms=ms((Event.SUB, sub_index), (Event.SUB_END, sub_index)) + call_ms,
                    bwd_peak_bytes=sub_peak,
                    bwd_index=bwd_rank.get(sub_index),
                    fwd_split_bytes=fwd_split,
                    held_inputs=tuple((tracked.input_ids[slot][k], v) for k, v in unsaved_inputs.items()),
                    fwd_freed_bytes=fwd_freed,
                    held_output_bytes=held_outputs,
                )
            )
            sub_index += 1
        profiles.append(
            BlockProfile(
                input_bytes=sum(tracked.inputs[i].values()),
                output_bytes=sum(tracked.outputs[i].values()),
                saved_bytes=sum(tracked.saved[i].values()),
                keep_bytes=trace.level_at(f1) - l_f0,
                fwd_peak_bytes=trace.peak_between(f0, f1) - l_f0,
                # The code between this block and the next (ProphetNet's decoder preamble) may rise above
                # both levels and fall again: its peak above the level at this block's forward end.
                gap_peak_bytes=(
                    max(0, trace.peak_between(f1, mt(Event.FORWARD, i + 1, f1)) - trace.level_at(f1))
                    if i + 1 < n
                    else 0
                ),
                # Against the level after this block's forward and the parameter gradients allocated before
                # its backward: what NOTE [ Chain cost model ] assumes at the start of its backward; the
                # rest of the difference (the gradient of its output) is then charged to every block's
                # backward, where it is really held.
                # And from the end of the next block's backward: the backward of the code between the two (a
                # gated MLP's multiply) runs there, above the level the chain model tracks, which holds what
                # that code left (gap_bytes, when it rose; NOTE [ Chain cost model ]).
                bwd_peak_bytes=max(
                    trace.peak_between(b0, b1),
                    trace.peak_between(min(b0, bwd_after[i]), b0) - max(0, gap_after[i]),
                )
                - trace.level_at(f1)
                - grads_before,
                # The same reference at the start of its backward: the activation gradients pending then.
                # A segment ending with the block replays above the level at its first unpack (NOTE [ Replay level ]).
                pending_grad_bytes=max(
                    0, max(trace.level_at(b0), trace.level_at(unpack_at[i])) - trace.level_at(f1) - grads_before
                ),
                bwd_level_bytes=trace.level_at(b0) - trace.level_at(f1) - grads_before,
                # NOTE [ The gap's backward runs before the replay ] in remat.plan.solver: the two windows apart.
                bwd_own_peak_bytes=trace.peak_between(b0, b1)
                - max(0, gap_after[i])
                - trace.level_at(f1)
                - grads_before,
                bwd_code_peak_bytes=trace.peak_between(min(b0, bwd_after[i]), b0)
                - max(0, gap_after[i])
                - trace.level_at(f1)
                - grads_before,
                held_input_bwd_bytes=_held_input_bwd(trace, lives, tracked, i, f0, f1, b0, b1),
                fwd_ms=ms((Event.FORWARD, i), (Event.FORWARD_END, i)),
                bwd_ms=ms((Event.BACKWARD, i), (Event.BACKWARD_END, i)),
                # NOTE [ Measured checkpoint costs ]: what checkpointing the block adds beyond its plain
                # forward + backward, at least one more forward.
                ckpt_fwd_ms=max(
                    ms((Event.FORWARD, i), (Event.FORWARD_END, i)),
                    block_ms(i, "full") - plain_ms - call_ms + stop_ms[i],
                ),
                stop_ms=stop_ms[i],
                # NOTE [ Op-level policy costs ]
                selective_ms=block_ms(i, "selective") - plain_ms if selective[i] else None,
                fwd_flops=fl((Event.FORWARD, i), (Event.FORWARD_END, i)),
                bwd_flops=fl((Event.BACKWARD, i), (Event.BACKWARD_END, i)),
                subs=tuple(subs),
                # Saved by the block, or edited in place after it was made: a replay ending with the block
                # makes it before it stops (NOTE [ Chain cost model ]: out_free_bytes).
                output_saved_bytes=sum(
                    v for k, v in tracked.outputs[i].items() if k in tracked.saved[i] or k in tracked.edited_outputs[i]
                ),
                own_output_bytes=sum(v for k, v in tracked.outputs[i].items() if k not in tracked.inputs[i]),
                linked=tracked.linked[i],
                stateful=tracked.stateful[i],
                edits_input=tracked.edits_input[i],
                edits_own_link=tracked.edits_input[i] and tracked.edits_own_link[i],
                grad_bytes=grads[i],
                backward=not tracked.unreached(i),
                output_grad=tracked.out_grad[i],
            )
        )
    start0, last_end = mt(Event.FORWARD, 0), mt(Event.FORWARD_END, n - 1)
    last_bwd = mt(Event.BACKWARD, n - 1, mt(Event.BACKWARD_END, n - 1, end))
    base = trace.level_at(start0)
    optimizer_ms = median([(t[("end", 0)] - t[("backward_end", 0)]) / 1e6 for t in timings.get("plain", [])])
    return Profile(
        model=type(model).__name__,
        device=dev.type,
        blocks=tuple(block_list),
        block_profiles=tuple(profiles),
        fingerprint=fingerprint(model, block_list),
        is_chain=True,  # set by profile() from the links, gaps and pinned bytes
        held_bytes=held,
        peak_bytes=trace.peak_bytes,
        step_ms=median(step_ms),
        base_bytes=base,
        pre_peak_bytes=trace.peak_between(0, start0),
        head_input_bytes=profiles[-1].own_output_bytes,
        head_peak_bytes=trace.peak_between(last_end, last_bwd) - trace.level_at(last_end),
        head_ms=ms((Event.FORWARD_END, n - 1), (Event.BACKWARD, n - 1)),
        tail_peak_bytes=max(0, trace.peak_between(tail_start, end) - base),
        head_grad_bytes=head_grads,
        tail_grad_bytes=tail_grads,
        optimizer_peak_bytes=trace.peak_between(end, trace.duration_ns) if "optimizer_start" in marks else 0,
        optimizer_ms=optimizer_ms if "optimizer_start" in marks else 0.0,
        ckpt_call_ms=call_ms,
        # preserve_rng_state=True keeps torch.get_rng_state() per checkpoint (host memory).
        ckpt_state_bytes=int(torch.get_rng_state().nbytes) if dev.type == "cpu" else 0,
    )
