"""What a profile holds: measured per-block bytes, times and FLOPs of one model on one batch."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import ClassVar, NamedTuple

from remat._json import Reader, load
from remat.blocks import Block
from remat.core.trace import Grads, Loop
from remat.profile.ops import BlockOps

__all__ = ["BlockProfile", "LateInput", "SubProfile", "Profile"]


class LateInput(NamedTuple):
    """A tensor blocks take as input that the plain step frees in the forward after the block that takes
    it last: T5's position bias, made by a stack's first layer, taken by every layer, saved by none, and
    dropped when the stack returns. A checkpoint over blocks that take it holds it to its backward
    (``Chain.late_inputs``).

    Attributes:
        nbytes: Its storage's bytes.
        producer: The block whose forward (or the code after it, before the next block) allocated it;
            -1 before block 0. For an input made between blocks (an unlinked input) that a later block
            takes again: the last block it is an unlinked input of, which is then also its first user
            (NOTE [ Unlinked inputs taken again later ] in ``remat.profile.profiler``).
        freed_after: The block after whose forward the plain step frees it: in the code before the next
            block, or in that block's forward; ``n`` (the number of blocks) for the head.
        users: The blocks that take it, in order.
        freed_first: Freed before the code after ``freed_after`` allocates anything (the model's code returns
            before it goes on); recorded for ``Profile.code_held_inputs`` only.
        netted: The plain step frees it in the forward too (its taker saves a copy, not it), so the gap after
            ``freed_after`` (or the head's peak) nets that free already (NOTE [ Code-held frees the plain step
            nets ] in ``remat.profile.profiler``); recorded for ``Profile.code_held_inputs`` only.
    """

    nbytes: int
    producer: int
    freed_after: int
    users: tuple[int, ...]
    freed_first: bool = False
    netted: bool = False


@dataclass(frozen=True)
class SubProfile:
    """A sub-module inside a block that ``attention_only``/``ffn_only`` may checkpoint on its own.

    Attributes:
        fqn: The sub-module's name.
        saved_bytes: What checkpointing it frees, bytes: what autograd saves inside it, its input excluded,
            less the inputs and RNG state its checkpoint holds where the block does not save them anyway
            (a frozen layer with LoRA adapters); negative when checkpointing it costs memory.
        output_bytes: Bytes of its output.
        fwd_ms: Its forward time, milliseconds.
        extra_ms: Measured extra time of its block's step when it is checkpointed (recomputation and
            checkpoint overhead), milliseconds.
        bwd_peak_bytes: Peak of its block's plain backward from where its own backward starts (its
            recomputation when checkpointed alone, whose rise its forward bounds, less ``saved_bytes``)
            to the block's backward end, above the same level as ``BlockProfile.bwd_peak_bytes``, bytes;
            None where its backward was not seen (NOTE [ Sub-module recomputation peak ]).
        bwd_index: Its place among its block's sub-modules in the backward (0: the first to run), or None.
        fwd_split_bytes: Peaks of its block's plain forward up to its own forward end and from there to the
            block's forward end, above the level at the block's start (as ``BlockProfile.fwd_peak_bytes``),
            bytes; None where not seen (NOTE [ Sub-module recomputation peak ]).
        held_inputs: ``(number, bytes)`` of each input its checkpoint holds that its block does not save
            (counted in ``saved_bytes``); the same number in every sub-module that takes the same tensor
            (T5's position bias), which checkpoints open at once hold once (NOTE [ Inputs held once ]).
        fwd_freed_bytes: What checkpointing it frees in its block's forward, from its forward end to the
            block's, bytes: ``saved_bytes`` less its own outputs that it saves (HF's attention weights, a view
            of the softmax its matmul saves, which the layer holds as it holds the output), plus the inputs
            its checkpoint holds that the plain step holds past the block's forward anyway (an attention
            mask); None where its forward was not seen (``saved_bytes``; NOTE [ Sub-module recomputation peak ]).
        held_output_bytes: The part of ``saved_bytes`` that is its own outputs which the model's code holds past
            its block's backward (attention weights ``need_weights=True`` that the model collects for its
            loss), bytes: checkpointing it does not free them, and its recomputation makes them again
            (NOTE [ Sub-module outputs held past the backward ]).
    """

    fqn: str
    saved_bytes: int
    output_bytes: int
    fwd_ms: float
    extra_ms: float = 0.0
    bwd_peak_bytes: int | None = None
    bwd_index: int | None = None
    fwd_split_bytes: tuple[int, int] | None = None
    held_inputs: tuple[tuple[int, int], ...] = ()
    fwd_freed_bytes: int | None = None
    held_output_bytes: int = 0


@dataclass(frozen=True)
class BlockProfile:
    """Measured figures of one block in a plain training step.

    Attributes:
        input_bytes: Bytes of the block's tensor inputs (unique storages, parameters excluded).
        output_bytes: Bytes of its tensor outputs.
        saved_bytes: Bytes autograd saves for the block's backward, counted once per storage,
            parameters excluded (through saved-tensor hooks).
        keep_bytes: How much memory the forward leaves allocated when the block is kept, bytes.
        fwd_peak_bytes: Peak rise during its forward above the level at its start, bytes.
        bwd_peak_bytes: Peak rise during its backward, and the backward of the code after it (which runs
            just before), above the level at its start, bytes.
        fwd_ms: Median forward time, milliseconds.
        bwd_ms: Median backward time, milliseconds.
        pending_grad_bytes: How far the level is above the level after its forward (and the parameter
            gradients allocated before its backward) when its backward starts: the gradient of its output
            and any other activation gradient pending then. A segment ending with this block replays
            above them (``bwd_peak_bytes`` includes them for a kept block).
        dead_head_late_bytes: The part of ``dead_saved_frees`` that the head frees (``after`` the last block)
            once it has reached its peak (``Profile.head_peak_bytes`` does not net its free), bytes.
        bwd_level_bytes: The same difference unclipped (negative where the code after the block frees more
            before its backward than is pending then), or ``None`` (profiles written before the field existed).
            ``chain_of`` adds back what it books as freed right after the block that the plain step frees later
            (``dropped_output_frees``, ``dead_saved_frees``): the level it tracks lacks those, the real one at
            the backward's start holds what the head keeps above it.
        unlinked_made_bytes: The part of ``unlinked_bytes`` that the code after the previous block allocated
            (by allocation lifetimes: made in that gap and alive when the block starts), which the previous
            block's ``gap_bytes`` counts too (NOTE [ Unlinked inputs made in the gap ] in ``remat.plan.chain``;
            0 for the first block, and for a view the code takes of the previous block's output).
        gap_freed_older_outputs: ``(p, bytes)`` of the own outputs of each earlier block ``p`` that the code after
            this block frees before the next block starts (``h = a(x); h = b(h * 2 + 1)`` frees ``a``'s output
            after ``b``), by allocation lifetimes; not an input of a block up to this one, nor outputs that
            ``dropped_output_frees`` books (NOTE [ Unlinked inputs made in the gap ] in ``remat.plan.chain``).
        bwd_own_peak_bytes: The part of ``bwd_peak_bytes`` from its own backward's start to its end, above
            that level and what the code after the block left (``max(0, gap_bytes)``, which the chain model
            holds there), bytes; ``None`` in profiles written before the field existed (NOTE [ The gap's
            backward runs before the replay ] in ``remat.plan.solver``).
        bwd_code_peak_bytes: The other part: from the end of the next block's backward to the start of its
            own (the backward of the code after it), above the same level, bytes (``None`` as above).
        fwd_flops: Forward FLOPs (``torch.utils.flop_counter``).
        bwd_flops: Backward FLOPs.
        subs: Attention / FFN sub-modules of a mixed block.
        held_input_bwd_bytes: How much higher its backward peaks when a checkpoint over it holds its inputs to
            its backward's end: the plain step frees some in its backward (SpeechT5's position bias, freed
            once the last layer's attention has run backward), bytes (NOTE [ Inputs held to the sub-module's
            backward end ] in ``remat.profile.profiler``).
        output_saved_bytes: Bytes of its outputs that the block itself saves for backward (e.g. a
            final ReLU's result), or edits in place after making them (a final ``SiLU(inplace=True)``,
            which saves a copy of its input: the output exists before the replay can stop); the rest is
            not held when the block ends a recomputed region.
        ckpt_fwd_ms: Measured cost of its no-save forward under a checkpoint, every overhead of
            checkpointing it included, the replay run to its end (so checkpointing it on its own costs
            this less ``stop_ms`` on top of a plain step), ms.
        stop_ms: Time of its forward's ops after the last one whose tensors autograd saves (inputs are
            saved before an op runs, outputs after), milliseconds: a replay that ends with this block
            stops before them (torch's early stop), e.g. a closing Linear's matmul (from the per-op
            profile; 0 with ``ops=False``).
        own_output_bytes: Bytes of its outputs that are not its inputs passed through (what a segment
            ending with it leaves for the blocks after it).
        gap_bytes: Level change after its forward and before the next block starts (code between
            blocks), bytes; 0 for the last block.
        gap_freed_input_bytes: Bytes of its inputs, other than those made between blocks (``unlinked_bytes``),
            that the code after it frees before the next block starts (by allocation lifetimes; 0 for the
            last block). ``gap_bytes`` nets them against what
            that code allocates (GPT-NeoX's ``x + a``, made as the attention output is dropped): a segment
            over the block never frees them there (it holds its first block's input, and never had a later
            block's), so it holds ``gap_bytes + gap_freed_input_bytes`` of the gap's allocations.
        gap_freed_output_bytes: Bytes of its own outputs that the code after it frees before the next block
            starts (by allocation lifetimes; 0 for the last block, and where the next block takes them): a
            segment going on past the block never held them, so it holds that much more of the gap.
        gap_freed_unlinked_bytes: Bytes of its inputs made between blocks (``unlinked_bytes``) that the code
            after it frees before the next block starts (by allocation lifetimes; 0 for the last block): a
            segment going on through the block holds them as recorded arguments (NOTE [ Unlinked inputs freed
            in the gap ] in ``remat.plan.chain``).
        dropped_output_frees: ``(after, bytes)`` of its own outputs that no later block takes and that the
            model's code drops later in the forward (HF's ``outputs = layer(h); h = outputs[0]``: the attention
            weights live until the next call rebinds ``outputs``): freed in the code after block ``after``'s
            forward (a later block's gap; the head's, ``after`` the last block), before the backward. Never held
            to the backward, by a segment either (``chain_of`` charges them to the forwards they span).
        dead_saved_frees: ``(after, bytes)`` of what its forward saves for a branch whose output the model's
            code drops later in the forward (``h, aux = layer(h)``, ``aux`` unused until the next call rebinds
            it): freed with that output in the code after block ``after``'s forward (a later block's gap; the
            head's for ``after`` the last block), not in its own gap. A plan recomputing the block never
            saves it, so that later gap frees nothing of it (``chain_of`` charges the free to the block).
        pinned_bytes: Bytes allocated in its forward, its outputs excluded, that stay alive when
            autograd saves nothing inside the blocks (held by the model or a hook), bytes.
        pinned_fwd_bytes: The part of ``pinned_bytes`` freed before the loss (NOTE [ Pinned through the forward
            only ] in ``remat.profile.profiler``: autocast's cached weight casts, freed when a region inside the
            model exits), held by a segment through the step's forward only, bytes.
        pinned_out_bytes: Bytes of its outputs that stay alive when autograd saves nothing inside blocks
            (hidden states the model collects; an output the code between blocks saves: a gated MLP's
            multiply, ``x.gather(1, idx)`` on an MoE router's hidden state and index), bytes.
        reused_bytes: Bytes of its own output, other than the next block's input, still alive when the
            next block ends, in a run where blocks save nothing: a later block takes it (a U-Net's skip)
            or the model's code holds it (GPT-NeoX's attention output, summed after the MLP; a layer's
            first child's output while the next child runs on another input); a segment going on past
            this block holds it too, though it is not the segment's output.
        side_output_bytes: Bytes of its own outputs that no later block takes, freed by the model's code
            before the last block's forward ends, in a run where blocks save nothing (HF's attention weights,
            dropped when the loop rebinds ``outputs``): gone when a segment ending with the block replays
            (NOTE [ Side outputs of a segment's last block ] in ``remat.profile.profiler``), bytes.
        side_output_frees: ``(after, bytes)`` of each of those side outputs: gone once block ``after``'s forward
            has peaked (freed in the code after it, before that code allocates; else counted as gone one block
            later, the head's for ``after`` = the number of blocks), in a run where blocks save nothing (empty:
            not known, profiles written before the field existed).
        unlinked_bytes: Bytes of its inputs that are neither the previous block's outputs nor older
            tensors (``x + stage(x)`` made between blocks): a segment going on through it holds them.
        unsaved_input_bytes: The part of ``unlinked_bytes`` that its own forward does not save: the
            plain step may free it after the block (``x = 2 * y`` rebinding ``x``), but a segment
            starting at this block holds it to its backward. Not what the code made right before the block
            and the plain step keeps into the backward, which the level holds anyway (NOTE [ Unsaved inputs
            alive into the backward ] in ``remat.profile.profiler``).
        code_kept_input_bytes: The other part of its inputs made between blocks that its forward does not save:
            those the plain step keeps into the backward (NOTE [ Unsaved inputs alive into the backward ] in
            ``remat.profile.profiler``), which the gap after it therefore does not free (``Chain.released_bytes``).
        generator_state_bytes: Bytes of the states of the generators of its own that its forward draws
            from (``torch.bernoulli(p, generator=self.g)``): a segment keeps a copy per call of it, to
            draw the same numbers in the replay (found by the per-op profile: 0 with ``ops=False``).
        fresh_rng: Whether the CPU RNG state at its call differs from where the previous block's forward
            left it (the model's code between them drew random numbers: a dropout between blocks): a
            segment going on through this block keeps another copy of the state for its call
            (``ckpt_state_bytes``); otherwise its replay goes on from the previous call's.
        linked: Whether its tensor inputs are the previous block's outputs or tensors that existed
            before the previous block started (then a segment across the boundary holds nothing
            more; always ``True`` for block 0).
        stateful: Buffers its forward updates in place, other than BatchNorm's running statistics
            (a stateful forward: the planner keeps such a block; NOTE [ State under recomputation ]).
        edits_input: Whether its forward edits one of its tensor arguments in place (its recomputation
            would edit it again: the planner keeps such a block, as ``apply`` refuses to recompute it).
        edits_own_link: With ``edits_input``, whether every argument it edits is an output of the block
            before it, as that block returned it (a ``ReLU(inplace=True)`` after a Linear in a
            Sequential): recomputed in a segment that also recomputes that block, it edits the output
            the replay made again, so the planner puts it in segments but never at their start (NOTE [
            In-place edits of a member's output ] in ``remat.core.runtime``).
        grad_bytes: Bytes of parameter gradients first allocated in its backward (its own parameters,
            and those of code between it and the previous block), held to the end of the iteration;
            0 with gradients held (NOTE [ Gradients in the backward ] in ``remat.profile.profiler``).
        selective_ms: What its forward + backward took beyond the plain ones under torch's selective
            checkpoint caching nothing (every op recomputed, the policy machinery's own cost included),
            milliseconds; ``None`` where not measured (op-level policies then are not offered for it;
            NOTE [ Op-level policy costs ] in ``remat.profile.profiler``).
        backward: Whether the step's backward reached it (its output's gradient was computed). ``False``
            for a block whose output reaches the loss only through operations without a gradient (HF
            Encodec's encoder before its quantizer's ``argmin``, LLaVA's last vision layer when the
            features come from the one before): what it saves is freed when the forward drops its graph,
            or held to the end of the step, never by its backward, so recomputing it saves nothing the
            chain model can count: the planner keeps it (plans recomputing such blocks measured 1.10-1.84x
            their budget, helper-45).
        output_grad: Whether any tensor it returned requires a gradient (``False``: a frozen block taking no
            gradient, whose checkpoint holds nothing: NOTE [ Blocks whose outputs need no gradient ] in
            ``remat.core.probe``).
    """

    input_bytes: int
    output_bytes: int
    saved_bytes: int
    keep_bytes: int
    fwd_peak_bytes: int
    bwd_peak_bytes: int
    fwd_ms: float
    bwd_ms: float
    fwd_flops: int
    bwd_flops: int
    subs: tuple[SubProfile, ...] = ()
    output_saved_bytes: int = 0
    ckpt_fwd_ms: float = 0.0
    stop_ms: float = 0.0
    own_output_bytes: int = -1
    gap_bytes: int = 0
    pinned_bytes: int = 0
    pinned_out_bytes: int = 0
    pinned_fwd_bytes: int = 0
    reused_bytes: int = 0
    side_output_bytes: int = 0
    side_output_frees: tuple[tuple[int, int], ...] = ()
    unlinked_bytes: int = 0
    unsaved_input_bytes: int = 0
    code_kept_input_bytes: int = 0
    generator_state_bytes: int = 0
    linked: bool = True
    fresh_rng: bool = False
    stateful: tuple[str, ...] = ()
    edits_input: bool = False
    edits_own_link: bool = False
    grad_bytes: int = 0
    selective_ms: float | None = None
    pending_grad_bytes: int = 0
    gap_freed_input_bytes: int = 0
    gap_freed_output_bytes: int = 0
    gap_freed_unlinked_bytes: int = 0
    backward: bool = True
    output_grad: bool = True
    held_input_bwd_bytes: int = 0
    gap_peak_bytes: int = 0
    dropped_output_frees: tuple[tuple[int, int], ...] = ()
    dead_saved_frees: tuple[tuple[int, int], ...] = ()
    bwd_level_bytes: int | None = None
    dead_head_late_bytes: int = 0
    bwd_own_peak_bytes: int | None = None
    bwd_code_peak_bytes: int | None = None
    unlinked_made_bytes: int = 0
    gap_freed_older_outputs: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.own_output_bytes < 0:  # profiles written before the field existed
            object.__setattr__(self, "own_output_bytes", self.output_bytes)

    @property
    def chainable(self) -> bool:
        """Whether a segment may go on past this block to the next one holding nothing more."""
        slack = max(1024, self.output_bytes // 100)  # a cached scalar does not count
        return max(0, self.gap_bytes) + self.pinned_bytes + self.pinned_out_bytes <= slack

    @property
    def fwd_transient_bytes(self) -> int:
        """Memory used during the forward and freed by its end, bytes."""
        return max(0, self.fwd_peak_bytes - self.keep_bytes)


@dataclass(frozen=True)
class Profile:
    """Per-block measurements of a model on a batch (``remat.profile``).

    Attributes:
        model: The model's class name.
        device: ``"cpu"`` or ``"cuda"``.
        blocks: The blocks measured.
        block_profiles: Their figures, one per block.
        fingerprint: Hash of the blocks' names, classes and parameter shapes.
        is_chain: Whether a segment of several blocks holds nothing beyond its input and output: every
            block's inputs are linked to the previous block (``BlockProfile.linked``) and nothing is
            added or kept alive between blocks (``BlockProfile.chainable``). Segments run correctly on
            any model (NOTE [ Spans ]); this only tells the solvers where they cost what the chain model
            says, so they plan multi-block segments only then.
        held_bytes: Memory held before the iteration (parameters, buffers, inputs, optimizer state, and
            gradients when held), bytes.
        peak_bytes: Peak of the plain iteration above the held memory, bytes (the unplanned peak;
            ``loop.describe()`` says which iteration, in words).
        step_ms: Median time of a plain iteration (the optimizer's step included), milliseconds.
        base_bytes: Level when block 0 starts, bytes above the held memory.
        pre_peak_bytes: Peak before block 0 starts, bytes above the held memory.
        head_input_bytes: Bytes of the last block's output (the head's input).
        head_peak_bytes: Peak rise from the end of the last block's forward to the start of its backward, bytes.
        head_ms: Time from the end of the last block's forward to the start of its backward, milliseconds.
        tail_peak_bytes: Peak after block 0's backward to the end of the backward, above ``base_bytes``.
        ckpt_call_ms: Measured fixed cost of one checkpoint call, milliseconds.
        ckpt_state_bytes: Memory each checkpoint holds on the profiled device besides its output: the
            CPU RNG state it preserves (on CUDA that state lives in host memory: 0), bytes.
        loop: The iteration measured: how gradients start, which optimizer steps (NOTE [ What a step's
            peak means ]; profiles written before loops existed measured ``grads="held"``).
        head_grad_bytes: Bytes of parameter gradients first allocated in the head's backward, bytes.
        tail_grad_bytes: Bytes of parameter gradients first allocated after block 0's backward
            (embeddings; inside ``tail_peak_bytes``), bytes.
        optimizer_peak_bytes: Peak during the optimizer's step above the held memory, bytes (0 without one).
        optimizer_ms: Median time of the optimizer's step, milliseconds.
        block_ops: Per block, every op of its forward with what autograd saves (``remat.profile.ops``),
            for op-level policies; empty when profiled with ``ops=False``.
        late_inputs: Block inputs the plain step frees in the forward after the block that takes them
            last (:class:`LateInput`; inputs made between blocks excepted: ``unlinked_bytes``).
        code_held_inputs: Block outputs that the model's code holds after the last block that takes them, which
            saves them in the plain step (:class:`LateInput`, measured with the blocks saving nothing;
            NOTE [ Outputs the model's code holds past their saving taker ] in ``remat.profile.profiler``), or
            saves a copy of them (``netted``: the plain step frees them where the code drops them).
        trainable_params: Per block, how many of its modules' parameters required grad, then how many of the
            other modules' did (NOTE [ Parameters unfrozen after planning ] in ``remat.blocks``; empty in
            profiles written before it was recorded).
    """

    schema_version: ClassVar[int] = 1

    model: str
    device: str
    blocks: tuple[Block, ...]
    block_profiles: tuple[BlockProfile, ...]
    fingerprint: str
    is_chain: bool
    held_bytes: int
    peak_bytes: int
    step_ms: float
    base_bytes: int
    pre_peak_bytes: int
    head_input_bytes: int
    head_peak_bytes: int
    head_ms: float
    tail_peak_bytes: int
    ckpt_call_ms: float = 0.0
    ckpt_state_bytes: int = 0
    loop: Loop = Loop(Grads.HELD)
    head_grad_bytes: int = 0
    tail_grad_bytes: int = 0
    optimizer_peak_bytes: int = 0
    optimizer_ms: float = 0.0
    block_ops: tuple[BlockOps, ...] = ()
    late_inputs: tuple[LateInput, ...] = ()
    code_held_inputs: tuple[LateInput, ...] = ()
    trainable_params: tuple[int, ...] = ()

    def sub_costs(self) -> dict[tuple[int, tuple[str, ...]], tuple[int, float, int, int]]:
        """For ``RecomputeSub``: (bytes freed, recompute ms, bytes its backward peak moves by beyond the
        bytes freed, bytes its forward peak drops by; NOTE [ Sub-module recomputation peak ]) of
        checkpointing each block's attention / FFN subs."""
        out: dict[tuple[int, tuple[str, ...]], tuple[int, float, int, int]] = {}
        for i, (b, bp) in enumerate(zip(self.blocks, self.block_profiles)):
            by_fqn = {s.fqn: s for s in bp.subs}
            for group in (b.attention_fqns, b.ffn_fqns):
                if group and all(f in by_fqn for f in group):
                    subs = [by_fqn[f] for f in group]
                    # NOTE [ Sub-module outputs held past the backward ]: what the model holds is not freed.
                    saved = sum(s.saved_bytes - s.held_output_bytes for s in subs)
                    out[(i, group)] = (
                        saved,
                        sum(max(s.extra_ms, s.fwd_ms) for s in subs),
                        _recompute_peak(bp.bwd_peak_bytes, subs) - bp.bwd_peak_bytes - saved,
                        bp.fwd_peak_bytes - _forward_peak(bp.fwd_peak_bytes, subs),
                    )
        return out

    def sub_held_inputs(self) -> dict[tuple[int, tuple[str, ...]], tuple[tuple[int, int], ...]]:
        """For each ``RecomputeSub`` of :meth:`sub_costs`: ``(number, bytes)`` of the inputs its checkpoints
        hold that the block does not save, for the simulation to charge once (NOTE [ Inputs held once ])."""
        out: dict[tuple[int, tuple[str, ...]], tuple[tuple[int, int], ...]] = {}
        for i, (b, bp) in enumerate(zip(self.blocks, self.block_profiles)):
            by_fqn = {s.fqn: s for s in bp.subs}
            for group in (b.attention_fqns, b.ffn_fqns):
                if group and all(f in by_fqn for f in group):
                    # A tensor two sub-modules of the group take is held by both their checkpoints.
                    out[(i, group)] = tuple(held for f in group for held in by_fqn[f].held_inputs)
        return out

    def to_json(self) -> str:
        """Serialise to a JSON string (with ``schema_version``)."""
        data = asdict(self)
        data["schema_version"] = self.schema_version
        data["blocks"] = [b.to_json() for b in self.blocks]
        data["block_ops"] = [b.to_json() for b in self.block_ops]
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        """Read a profile written by :meth:`to_json` (NOTE [ One loading policy ] in ``remat._json``).

        Built from the dataclasses' own fields: a field with a default that the file lacks takes the
        default (files written before it was added still load); unknown keys are ignored with a warning.

        Raises:
            RematError: If the text is not a profile of this schema version, lacks a required field,
                mistypes one, or its blocks and block figures do not match one to one, in order.
        """
        reader = Reader(
            "profile",
            "profile the model again: remat.profile(...).to_json() or `remat profile MODEL --out profile.json`",
        )
        prof = reader.build(cls, load(text, reader, cls.schema_version))
        if len(prof.block_profiles) != len(prof.blocks):
            raise reader.error(
                "block_profiles",
                f"has {len(prof.block_profiles)} entries for {len(prof.blocks)} blocks, expected one per block",
            )
        for i, b in enumerate(prof.blocks):
            if b.index != i:
                raise reader.error(
                    f"blocks[{i}].index", f"is {b.index}, expected {i} (blocks are listed in forward order from 0)"
                )
        return prof

    def summary(self) -> str:
        """A quick look at what was measured, in a few lines: the model and device, its blocks, the plain
        step's peak and time, the blocks that save the most for backward, whether the blocks form a chain
        (and which blocks break it), the blocks with attention / MLP sub-modules, and stateful blocks."""
        from remat.units import format_bytes, format_ms

        n = len(self.blocks)
        span = f" ({self.blocks[0].name} to {self.blocks[-1].name})" if n else ""
        lines = [
            f"{self.model} on {self.device}: {n} blocks{span}",
            f"  plain step: peak {format_bytes(self.peak_bytes)} above the {format_bytes(self.held_bytes)} held before it, "
            f"{format_ms(self.step_ms)}",
        ]
        by_saved = sorted(zip(self.blocks, self.block_profiles), key=lambda b: -b[1].saved_bytes)
        total = sum(bp.saved_bytes for bp in self.block_profiles)
        largest = ", ".join(f"{b.name} {format_bytes(bp.saved_bytes)}" for b, bp in by_saved[:3])
        lines.append(f"  saved for backward: {format_bytes(total)} over all blocks; the most: {largest}")
        if self.is_chain:
            lines.append("  the blocks form a chain: the solvers may recompute several together as one segment")
        else:
            breaks = []
            cut: set[int] = set()  # boundaries (k: between blocks k and k + 1) no segment goes on across
            for b, bp in zip(self.blocks, self.block_profiles):
                last = b.index == n - 1
                if not bp.linked:
                    breaks.append(f"{b.name} takes inputs made between blocks")
                    cut.add(b.index - 1)
                elif bp.reused_bytes and not last:
                    breaks.append(f"a later block reuses the output of {b.name}")
                    cut.add(b.index)
                elif not bp.chainable and not last:
                    breaks.append(f"memory stays allocated after {b.name}")
                    cut.add(b.index)
            cut.discard(-1)
            more = f" and {len(breaks) - 3} more" if len(breaks) > 3 else ""
            why = f": {', '.join(breaks[:3])}{more}" if breaks else ""
            # The solvers join blocks wherever the boundary allows (plan.chain's ``joinable``), so a
            # break at one boundary does not make them recompute every block alone.
            where = (
                f"no segment goes on across {len(cut)} of {n - 1} block boundaries"
                if 0 < len(cut) < n - 1
                else "the solvers recompute blocks one at a time"
            )
            lines.append(f"  the blocks do not form a chain ({where}){why}")
        with_subs = [b.name for b, bp in zip(self.blocks, self.block_profiles) if bp.subs]
        if with_subs:
            lines.append(f"  attention / MLP found in {len(with_subs)} of {n} blocks (they may be recomputed alone)")
        stateful = [
            f"{b.name} ({', '.join(bp.stateful)})" for b, bp in zip(self.blocks, self.block_profiles) if bp.stateful
        ]
        if stateful:
            lines.append(f"  stateful blocks, always kept: {', '.join(stateful)}")
        unreached = [b.name for b, bp in zip(self.blocks, self.block_profiles) if not bp.backward]
        if unreached:
            shown = ", ".join(unreached[:4]) + (f" and {len(unreached) - 4} more" if len(unreached) > 4 else "")
            lines.append(
                f"  blocks the backward does not reach (no gradient flows to their output), always kept: {shown}"
            )
        return "\n".join(lines)


# NOTE [ Sub-module recomputation peak ]
# A block kept with sub-modules checkpointed inside it (RecomputeSub) holds ``saved`` bytes less from its
# forward to its backward, and each sub-module's activations come back only when the backward reaches
# that sub-module (torch's non-reentrant checkpoint recomputes on the first unpack), by which time the
# backward of what ran after it in the forward (the MLP after an attention, the cross-attention after a
# self-attention) has freed what it saved. So the block's backward runs on the plain step's curve less
# the ``saved_bytes`` of the sub-modules not yet recomputed: above the lowered level after its forward,
# its peak is
#   max(bp, max over the sub-modules j in backward order of bwd_peak_bytes[j] + saved[j'] summed over j' <= j)
# where ``bwd_peak_bytes[j]`` is the plain backward's peak from j's backward start to the block's, or j's
# recomputation there (at most its forward's rise above the RNG state it stashes, less what stays saved),
# whichever is higher, plus the RNG state its checkpoint holds to the end of the block's backward.
# The chain model charged ``bp + saved`` before: too high where the block's backward peaks before a
# sub-module is recomputed (whisper's decoder layer peaks at the start of its backward, in its MLP's,
# before either attention is recomputed: ``bp + saved`` was 363,080 bytes too high), too low where the
# recomputation itself peaks above the block's plain backward (T5's cross-attention as a block of its own).
# Where a sub-module's backward was not seen, ``bp + saved``.
# In the forward, the block's peak after a sub-module's end is the plain one less what checkpointing it frees
# there (``SubProfile.fwd_freed_bytes``), which is not ``saved``: HF's attention returns ``(out, weights)``,
# ``weights`` the softmax (or a view of it) that its matmul saves, and the layer binds it to ``_`` through
# its MLP, so checkpointed, the attention no longer saves the softmax but the layer still holds it where the
# block peaks; and of the inputs its checkpoint holds, which ``saved`` charges from the block's end to its
# backward, those the plain step holds past the block's forward anyway (the attention mask every layer is
# passed) cost the forward nothing. Credited as freed, the weights left a nested plan recomputing such a
# layer with its attention checkpointed inside the replay (R[0:1](S0{self_attn}) ...) 1.04x its prediction,
# the smallest plan on transformers' OpenAIPrivacyFilterModel 1.06x its budget; charged, the mask left
# Mixtral's 0.94x. The plain step does not show when the caller drops the output: held to the block's
# forward end (on the safe side).

# NOTE [ Sub-module outputs held past the backward ]
# A sub-module's own output that it saves (``nn.MultiheadAttention(need_weights=True)`` returns the
# post-dropout attention weights its ``bmm`` saves) and that the model's code keeps to the end of the step
# (weights collected in a list the loss or the caller reads) is one storage in the plain step. Checkpointed,
# the sub-module saves nothing, but the model still holds that output: nothing of it is freed between the
# forward and the backward, and its recomputation makes a second copy for the backward. So the bytes freed
# are ``saved_bytes - held_output_bytes``, while the recomputation still rises by the whole ``saved_bytes``
# (``_recompute_peak``). Counted as freed, four MHA layers whose per-head weights the loss reads planned
# ``S0{layers.0.attn} S1{layers.1.attn} S2{layers.2.attn} K3`` at their smallest feasible peak and measured
# 1.15x the budget. The profile sees it from the output's lifetime: still alive after the block's backward.


def _recompute_peak(bwd_peak_bytes: int, subs: list[SubProfile]) -> int:
    """The backward peak of a block with ``subs`` checkpointed, above the lowered level after its forward,
    bytes (NOTE [ Sub-module recomputation peak ])."""
    seen = [(s.bwd_index, s.bwd_peak_bytes, s.saved_bytes) for s in subs]
    peaks = [(i, p, saved) for i, p, saved in seen if i is not None and p is not None]
    if len(peaks) < len(subs):
        return bwd_peak_bytes + sum(s.saved_bytes for s in subs)
    peak, recomputed = bwd_peak_bytes, 0
    for _, after, saved in sorted(peaks):
        recomputed += saved
        peak = max(peak, after + recomputed)
    return peak


def _forward_peak(fwd_peak_bytes: int, subs: list[SubProfile]) -> int:
    """The forward peak of a block with ``subs`` checkpointed, above the level at its start, bytes: the
    plain forward's, less what checkpointing the sub-modules that have returned frees there
    (``SubProfile.fwd_freed_bytes``, NOTE [ Sub-module recomputation peak ]); where a sub-module's forward
    was not seen, the plain one."""
    splits = [
        (s.fwd_split_bytes, s.saved_bytes if s.fwd_freed_bytes is None else s.fwd_freed_bytes)
        for s in subs
        if s.fwd_split_bytes is not None
    ]
    if len(splits) < len(subs):
        return fwd_peak_bytes
    # In forward order: a later end has a peak before it no lower and a peak after it no higher.
    order = sorted(((before, -after, saved) for (before, after), saved in splits))
    # Up to the first sub-module's end, the plain forward; between two ends, the lower of the two bounds.
    peak, done = order[0][0], 0
    for pos, (_, neg_after, saved) in enumerate(order):
        done += saved
        after = -neg_after if pos + 1 == len(order) else min(-neg_after, order[pos + 1][0])
        peak = max(peak, after - done)
    return min(peak, fwd_peak_bytes)
