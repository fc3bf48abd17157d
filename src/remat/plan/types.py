"""The plan: which blocks are kept and which recomputed (with nesting), and what that is predicted to cost.

# NOTE [ Plan vocabulary ]
One set of words says what a plan does with a block, everywhere a plan is shown (``Plan.summary``,
``Plan.explain``, ``remat plan``, the bench tables, the report and its heatmap):
  kept                        the block runs normally and autograd keeps what it saves (``Keep``);
  recomputed                  the block runs under its own checkpoint and runs again in the backward
                              (``Recompute`` of one block);
  kept, attention recomputed  the block runs normally except its attention (or MLP, or the named
                              sub-modules), which is checkpointed and runs again (``RecomputeSub``);
  kept, selected operations   the block runs under an op-level policy: the outputs of some of its
  recomputed                  operations are cached, the others run again (``RecomputeOps``);
  in a recomputed segment     consecutive blocks run under one checkpoint and run again, together, in
                              the backward (``Recompute`` of several blocks). While a segment runs
                              again its blocks keep what they save, except where the plan nests a
                              further segment inside it: those blocks run once more ("recomputed twice").
A block's ``times`` counts how often its forward runs again in one step. The compact form of
``Plan.describe`` (``K0 R[1:3](K1 K2) S3{blocks.3.mlp}``) is for logs; wherever it is shown to a person,
``LEGEND`` is shown with it. ``Plan.lines`` is the one walk of the plan tree that the terminal tree, the
HTML and the Markdown render; it groups consecutive blocks with the same fate (``full`` on 48 blocks
is one line), and lists what happens inside a segment only when it is more than "recomputed once".
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar, NamedTuple

from remat._json import Reader, load
from remat.blocks import Block
from remat.core.ops import (
    Keep,
    Op,
    Recompute,
    RecomputeOps,
    RecomputeSub,
    ops_from_json,
    ops_repr,
    ops_to_json,
    validate_ops,
)
from remat.core.selective import ops_in_words
from remat.core.trace import Loop
from remat.errors import RematError
from remat.units import format_bytes, format_ms

__all__ = [
    "Plan",
    "Fate",
    "BlockFate",
    "PlanLine",
    "LEGEND",
    "block_fates",
    "ops_from_text",
    "part_kind",
    "sub_kind",
    "times_in_words",
    "SELECTED_OPS",
]

LEGEND = (
    "K3: block 3 kept; R[1:4](...): blocks 1 to 3 recomputed as one segment, the brackets saying what "
    "happens inside it when it runs again (a nested R runs once more); S3{...}: block 3 kept, the named "
    "sub-modules (its attention or MLP) recomputed; O3{a|b}: block 3 kept under an op-level policy, the "
    "outputs of operations b cached and the others run again (a: those whose saved outputs that frees)"
)
"""How to read the compact form of :meth:`Plan.describe` (NOTE [ Plan vocabulary ])."""


class Fate(Enum):
    """What a plan does with a block (NOTE [ Plan vocabulary ])."""

    KEPT = "kept"
    RECOMPUTED = "recomputed"
    PART = "kept, part recomputed"
    SEGMENT = "in a recomputed segment"


@dataclass(frozen=True)
class BlockFate:
    """What a plan does with one block.

    Attributes:
        fate: Kept, recomputed on its own, kept with a sub-module recomputed, or in a recomputed segment.
        times: How often the block's forward runs again in one step (0: kept, or only a sub-module
            recomputed; 2 and more: nested segments).
        subs: The sub-modules recomputed inside it (``Fate.PART``, or a sub-module checkpointed again
            inside a segment), by name.
        op: Position in ``Plan.ops`` of the top-level operation that covers the block: blocks sharing
            it run under one checkpoint (a segment), or it is their own.
        op_level: Whether it runs under an op-level policy (``RecomputeOps``, ``Fate.PART``).
    """

    fate: Fate
    times: int = 0
    subs: tuple[str, ...] = ()
    op: int = 0
    op_level: bool = False


class PlanLine(NamedTuple):
    """One line of a plan in words (:meth:`Plan.lines`).

    Attributes:
        depth: 0 for the plan's own operations, 1 and more for what happens inside a recomputed segment.
        fate: The fate of the blocks on the line.
        what: What happens to them, e.g. ``"recomputed as one segment"``, ``"kept, MLP recomputed"``.
        blocks: Their indices, consecutive.
    """

    depth: int
    fate: Fate
    what: str
    blocks: tuple[int, ...]


def block_fates(ops: Sequence[Op]) -> tuple[BlockFate, ...]:
    """What ``ops`` does with each block, in block order (NOTE [ Plan vocabulary ]).

    This is the one walk of the plan tree that classifies blocks: ``Plan.checkpointed``, ``Plan.depth``,
    ``Plan.headline``, the tables' counts and the heatmap read it; ``Plan.lines`` is the one that renders.

    Args:
        ops: A plan's operations (``Plan.ops``), covering every block once.

    Returns:
        One :class:`BlockFate` per block covered.
    """
    fates = _fates(ops)
    return tuple(fates[i] for i in sorted(fates))


def _fates(ops: Sequence[Op]) -> dict[int, BlockFate]:
    """Block index -> its fate, for the blocks ``ops`` covers (see :func:`block_fates`)."""
    out: dict[int, BlockFate] = {}

    def walk(inner: Sequence[Op], depth: int, fate: Fate, top: int) -> None:
        for pos, op in enumerate(inner):
            at = top if depth else pos
            if isinstance(op, Keep):
                out[op.index] = BlockFate(fate, depth, (), at)
            elif isinstance(op, RecomputeSub):
                out[op.index] = BlockFate(fate if depth else Fate.PART, depth, op.fqns, at)
            elif isinstance(op, RecomputeOps):
                out[op.index] = BlockFate(fate if depth else Fate.PART, depth, (), at, op_level=True)
            else:
                outer = fate if depth else Fate.SEGMENT if op.stop - op.start > 1 else Fate.RECOMPUTED
                walk(op.inner, depth + 1, outer, at)

    walk(ops, 0, Fate.KEPT, 0)
    return out


_TOKEN = re.compile(r"K(\d+)|S(\d+)\{([^}]*)\}|R\[(\d+):(\d+)\]\(|(\))|O(\d+)\{([^}|]*)\|([^}]*)\}")


def ops_from_text(text: str) -> tuple[Op, ...]:
    """Read the compact form of :meth:`Plan.describe` back into operations (e.g. a frontier point's ``ops``).

    Only the form is checked; :func:`remat.plan.chain.validate_ops` checks that every block is covered once.

    Raises:
        RematError: If ``text`` is not in the compact form (``LEGEND``), naming the position.
    """
    current: list[Op] = []
    open_segments: list[tuple[int, int, list[Op]]] = []
    pos = 0
    while text[pos:].strip():
        pos += len(text[pos:]) - len(text[pos:].lstrip())
        m = _TOKEN.match(text, pos)
        if m is None:
            raise RematError(
                f"plan text: cannot read {text[pos : pos + 24]!r} at position {pos} of {text!r}; "
                f"expected K<i>, S<i>{{...}}, O<i>{{...|...}}, R[a:b](...) or ')' ({LEGEND})"
            )
        pos = m.end()
        if m[1] is not None:
            current.append(Keep(int(m[1])))
        elif m[2] is not None:
            current.append(RecomputeSub(int(m[2]), tuple(f for f in m[3].split(",") if f)))
        elif m[4] is not None:
            open_segments.append((int(m[4]), int(m[5]), current))
            current = []
        elif m[7] is not None:
            current.append(RecomputeOps(int(m[7]), _keys(m[9]), _keys(m[8])))
        else:
            if not open_segments:
                raise RematError(f"plan text: ')' at position {pos - 1} of {text!r} closes no R[a:b](...)")
            start, stop, outer = open_segments.pop()
            outer.append(Recompute(start, stop, tuple(current)))
            current = outer
    if open_segments:
        raise RematError(f"plan text: {text!r} leaves R[{open_segments[-1][0]}:{open_segments[-1][1]}]( unclosed")
    return tuple(current)


def _keys(text: str) -> tuple[str, ...]:
    return tuple(k for k in text.split(",") if k)


def times_in_words(n: int) -> str:
    """``1`` -> ``"once"``, ``2`` -> ``"twice"``, else ``"3 times"``."""
    return {1: "once", 2: "twice"}.get(n, f"{n} times")


SELECTED_OPS = "selected operations"
"""What an op-level policy (``RecomputeOps``) recomputes of a block, in the words of NOTE [ Plan vocabulary ]."""


def part_kind(block: Block, fate: BlockFate) -> str:
    """What of a block kept in part (``Fate.PART``) is recomputed, in words: its sub-modules
    (:func:`sub_kind`), or :data:`SELECTED_OPS` under an op-level policy."""
    return SELECTED_OPS if fate.op_level else sub_kind(block, fate.subs)


def sub_kind(block: Block, fqns: Sequence[str]) -> str:
    """The sub-modules ``fqns`` of ``block`` in words: ``"attention"``, ``"MLP"``, ``"attention and MLP"``, else their names."""
    chosen, attn, ffn = set(fqns), set(block.attention_fqns), set(block.ffn_fqns)
    if attn and chosen == attn:
        return "attention"
    if ffn and chosen == ffn:
        return "MLP"
    if attn and ffn and chosen == attn | ffn:
        return "attention and MLP"
    return ", ".join(fqns)


@dataclass
class _Run:
    """Consecutive blocks that one line of the plan describes (see ``Plan.lines``)."""

    fate: Fate
    what: str
    start: int
    stop: int
    inner: tuple[Op, ...] = ()  # shown below the line: a segment with more inside it than "recomputed once"
    groups: bool = True  # may take in the next run with the same words
    own: bool = False  # each block under its own checkpoint ("each on its own" once grouped)


@dataclass(frozen=True)
class Plan:
    """Decisions for every block of a model, and their predicted cost.

    Attributes:
        strategy: What produced it, e.g. ``"optimal"``, ``"every_nth(n=2)"``.
        blocks: The blocks the plan is for.
        ops: Top-level operations over the blocks (see NOTE [ Chain cost model ] in ``remat.plan.chain``).
        fingerprint: Hash of the blocks' names, classes and parameter shapes (``None``: not checked).
        budget_bytes: The budget it was solved for, bytes (``None`` for rule-of-thumb strategies).
        predicted_peak_bytes: Predicted peak of a step above the memory held before it, bytes.
        predicted_extra_ms: Predicted recomputation time per step, milliseconds.
        baseline_peak_bytes: The measured peak with nothing checkpointed, bytes.
        baseline_step_ms: The measured step time with nothing checkpointed, milliseconds.
        loop: The training-loop iteration its profile measured, which its predicted figures are for
            (``None``: planned without a profile, or written before plans recorded it).
        input_bytes: Bytes of each block's tensor inputs in the batch its profile ran
            (``BlockProfile.input_bytes``), which its budget and predicted figures are for: the applied
            model warns once when a block takes more (NOTE [ Batches larger than the profiled one ] in
            ``remat.core.runtime``; ``None``: planned without a profile, or written before plans recorded it).
        trainable_params: Per block, how many of its modules' parameters required grad when its profile ran,
            then how many of the other modules' did: the applied model warns once when more do (NOTE
            [ Parameters unfrozen after planning ] in ``remat.blocks``; ``None``: not recorded).
    """

    schema_version: ClassVar[int] = 1

    strategy: str
    blocks: tuple[Block, ...]
    ops: tuple[Op, ...]
    fingerprint: str | None = None
    budget_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    predicted_extra_ms: float | None = None
    baseline_peak_bytes: int | None = None
    baseline_step_ms: float | None = None
    loop: Loop | None = None
    input_bytes: tuple[int, ...] | None = None
    trainable_params: tuple[int, ...] | None = None

    @property
    def checkpointed(self) -> tuple[int, ...]:
        """Indices of blocks under a top-level checkpoint (whole blocks, or sub-modules inside them)."""
        return tuple(i for i, f in sorted(_fates(self.ops).items()) if f.fate is not Fate.KEPT)

    @property
    def depth(self) -> int:
        """Nesting depth: 0 keeps everything, 1 is single-level checkpointing, 2+ is nested."""
        # A block recomputed n times sits under n checkpoints; a sub-module or op-level policy in it, under one more.
        return max((f.times + bool(f.subs or f.op_level) for f in self.fates()), default=0)

    def should_checkpoint(self, index: int) -> bool:
        """Whether block ``index`` is (partly) recomputed."""
        return index in self.checkpointed

    def describe(self) -> str:
        """The operations in compact form for logs, e.g. ``'K0 R[1:4](K1 R[2:3](K2) K3) K4'``.

        ``K3``: block 3 kept; ``R[1:4](...)``: blocks 1 to 3 recomputed as one segment, the brackets
        saying what happens inside it when it runs again (a nested ``R`` runs once more); ``S3{...}``:
        block 3 kept, the named sub-modules recomputed (``LEGEND``). :meth:`explain` says it in words.
        """
        return ops_repr(self.ops)

    def fates(self) -> tuple[BlockFate, ...]:
        """What the plan does with each block, in block order (NOTE [ Plan vocabulary ])."""
        return block_fates(self.ops)

    def span(self, blocks: Sequence[int]) -> str:
        """The names of consecutive blocks: ``'blocks.3'``, ``'blocks.3–5'``, or ``'first – last'``."""
        first, last = self.blocks[blocks[0]].name, self.blocks[blocks[-1]].name
        if len(blocks) == 1:
            return first
        a, b = re.fullmatch(r"(.*?)(\d+)", first), re.fullmatch(r"(.*?)(\d+)", last)
        if a and b and a[1] == b[1]:
            return f"{first}–{b[2]}"
        return f"{first} – {last}"

    def lines(self) -> Iterator[PlanLine]:
        """The plan in words, one line per run of consecutive blocks with the same fate, nested lines
        for what happens inside a segment (NOTE [ Plan vocabulary ]); every rendering reads this walk.

        Yields:
            ``PlanLine(depth, fate, what, blocks)``, in block order, a segment before what is inside it.
        """
        yield from self._lines(self.ops, 0, Fate.KEPT)

    def _lines(self, ops: Sequence[Op], depth: int, fate: Fate) -> Iterator[PlanLine]:
        runs: list[_Run] = []
        for op in ops:
            run = self._run(op, depth, fate)
            prev = runs[-1] if runs else None
            if prev is not None and prev.groups and run.groups and (prev.fate, prev.what) == (run.fate, run.what):
                prev.stop = run.stop
            else:
                runs.append(run)
        for run in runs:
            what = run.what + (", each on its own" if run.own and run.stop - run.start > 1 else "")
            yield PlanLine(depth, run.fate, what, tuple(range(run.start, run.stop)))
            if run.inner:
                yield from self._lines(run.inner, depth + 1, run.fate)

    def _run(self, op: Op, depth: int, fate: Fate) -> _Run:
        """One operation in words; ``depth`` counts the segments around it, ``fate`` that of the outermost."""
        if isinstance(op, Keep):
            return _Run(fate, f"recomputed {times_in_words(depth)}" if depth else "kept", op.index, op.index + 1)
        if isinstance(op, RecomputeSub):
            kind = sub_kind(self.blocks[op.index], op.fqns)
            if depth:
                what = f"recomputed {times_in_words(depth)}, its {kind} {times_in_words(depth + 1)}"
                return _Run(fate, what, op.index, op.index + 1)
            return _Run(Fate.PART, f"kept, {kind} recomputed", op.index, op.index + 1)
        if isinstance(op, RecomputeOps):
            if depth:
                what = f"recomputed {times_in_words(depth)}, its {SELECTED_OPS} {times_in_words(depth + 1)}"
                return _Run(fate, what, op.index, op.index + 1)
            ops = (
                f"{SELECTED_OPS} recomputed ({ops_in_words(op.recompute)})"
                if op.recompute
                else f"{SELECTED_OPS} recomputed"
            )
            return _Run(Fate.PART, f"kept, {ops}", op.index, op.index + 1, groups=False)
        several = op.stop - op.start > 1
        plain_inside = all(isinstance(o, Keep) for o in op.inner)  # recomputed once, keeping what each block saves
        if depth:
            what = f"recomputed {times_in_words(depth + 1)}" + (", as one nested segment" if several else "")
        else:
            fate = Fate.SEGMENT if several else Fate.RECOMPUTED
            what = "recomputed as one segment" if several else "recomputed"
        inner = () if plain_inside else op.inner
        return _Run(fate, what, op.start, op.stop, inner, groups=plain_inside and not several, own=not several)

    def headline(self) -> str:
        """How many blocks are kept, recomputed, kept with a sub-module recomputed or in segments, in one line,
        e.g. ``'8 blocks: 1 recomputed, 4 in 2 recomputed segments, 1 kept with its MLP recomputed, 2 kept'``."""
        fates = self.fates()
        n = len(fates)
        count = Counter(f.fate for f in fates)
        segments = len({f.op for f in fates if f.fate is Fate.SEGMENT})
        kinds = {part_kind(self.blocks[i], f) for i, f in enumerate(fates) if f.fate is Fate.PART}
        if len(kinds) == 1:
            kind = kinds.pop()
        elif kinds <= {"attention", "MLP", "attention and MLP"}:
            kind = "attention or MLP"
        else:
            kind = "parts" if SELECTED_OPS in kinds else "sub-modules"

        def phrase(fate: Fate, c: int) -> str:
            its = "its" if c == 1 else "their"
            return {
                Fate.RECOMPUTED: "recomputed" if c < n else "recomputed, each on its own",
                Fate.SEGMENT: f"in {segments} recomputed segment{'s' if segments > 1 else ''}",
                Fate.PART: f"kept with {its} {kind} recomputed",
                Fate.KEPT: "kept",
            }[fate]

        present = [f for f in (Fate.RECOMPUTED, Fate.SEGMENT, Fate.PART, Fate.KEPT) if count[f]]
        if len(present) == 1:
            nothing = " (nothing recomputed)" if present[0] is Fate.KEPT else ""
            text = f"{n} blocks, all {phrase(present[0], n)}{nothing}"
        else:
            text = f"{n} blocks: " + ", ".join(f"{count[f]} {phrase(f, count[f])}" for f in present)
        nested = [f.times for f in fates if f.times > 1]
        if nested:
            up_to = "" if len(set(nested)) == 1 else "up to "
            text += f"; {len(nested)} of them recomputed {up_to}{times_in_words(max(nested))} (nested)"
        return text

    def recomputes(self) -> str:
        """What the plan recomputes, in words, one clause per line of :meth:`lines` at the top level,
        kept blocks left out: ``'blocks.0: kept, MLP recomputed; blocks.1–2: recomputed as one segment'``."""
        lines = list(self.lines())
        nested = {i for line in lines if line.depth > 0 for i in line.blocks}
        clauses = [
            f"{self.span(line.blocks)}: {line.what}"
            + (", with more recomputation nested inside" if nested & set(line.blocks) else "")
            for line in lines
            if line.depth == 0 and line.fate is not Fate.KEPT
        ]
        return "; ".join(clauses) or "nothing (every block kept)"

    def explain(self) -> str:
        """The plan in words: the :meth:`headline`, then one line per run of blocks (:meth:`lines`), nested
        lines indented, e.g.::

            optimal: 8 blocks: 2 recomputed, 6 kept
              blocks.0–1   recomputed, each on its own
              blocks.2–7   kept
        """
        rows = [("  " * line.depth + self.span(line.blocks), line.what) for line in self.lines()]
        width = max((len(name) for name, _ in rows), default=0)
        body = [f"  {name:<{width}}   {what}" for name, what in rows]
        return "\n".join([f"{self.strategy}: {self.headline()}", *body])

    def summary(self) -> str:
        """A few human lines: the plan in words (:meth:`explain`), its compact form with a legend, and
        the budget and predicted figures."""
        lines = [f"plan {self.explain()}"]
        lines.append(f"  compact: {self.describe()}")
        lines.append(f"    ({LEGEND})")
        if self.budget_bytes is not None:
            lines.append(f"  budget: {format_bytes(self.budget_bytes)}")
        if self.predicted_peak_bytes is not None:
            ratio = (
                f" ({self.predicted_peak_bytes / self.baseline_peak_bytes:.0%} of unplanned {format_bytes(self.baseline_peak_bytes)})"
                if self.baseline_peak_bytes
                else ""
            )
            lines.append(f"  predicted peak: {format_bytes(self.predicted_peak_bytes)}{ratio}")
        if self.predicted_extra_ms is not None:
            ratio = (
                f" (+{self.predicted_extra_ms / self.baseline_step_ms:.0%} of a step)" if self.baseline_step_ms else ""
            )
            lines.append(f"  predicted recompute: {format_ms(self.predicted_extra_ms)}{ratio}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The plan as values for ``json.dumps``, without ``schema_version`` (for a plan inside another
        file, e.g. a bench row's); :meth:`from_dict` reads back what ``json.loads`` makes of them."""
        return {
            "strategy": self.strategy,
            "blocks": [b.to_json() for b in self.blocks],
            "ops": ops_to_json(self.ops),
            "fingerprint": self.fingerprint,
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_extra_ms": self.predicted_extra_ms,
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "baseline_step_ms": self.baseline_step_ms,
            "loop": None if self.loop is None else {"grads": self.loop.grads.value, "optimizer": self.loop.optimizer},
            "input_bytes": None if self.input_bytes is None else list(self.input_bytes),
            "trainable_params": None if self.trainable_params is None else list(self.trainable_params),
        }

    def to_json(self) -> str:
        """Serialise to a JSON string (with ``schema_version``)."""
        return json.dumps({"schema_version": self.schema_version, **self.to_dict()}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read a plan written by :meth:`to_json` (NOTE [ One loading policy ] in ``remat._json``).

        Raises:
            RematError: If the text is not a plan of this schema version, lacks or mistypes a field,
                lists its blocks out of order, or its operations do not cover every block once, in
                order (``remat.plan.chain.validate_ops``).
        """
        return cls.from_dict(load(text, _READER, cls.schema_version))

    @classmethod
    def from_dict(cls, data: Any, reader: Reader | None = None, path: str = "") -> Plan:
        """Read a plan written by :meth:`to_dict`, checked as :meth:`from_json` checks a plan file.

        Args:
            data: The JSON object.
            reader: The reader of the file that holds it (default: a plan file's), for messages.
            path: Where the plan is in that file (``""``: the top level), e.g. ``"rows[2].plan"``.

        Raises:
            RematError: As :meth:`from_json`, naming the field by its path in the file.
        """
        reader = reader or _READER
        at = f"{path}." if path else ""
        plan = reader.build(cls, data, path, convert={"ops": lambda r, v, where: ops_from_json(v, r, where)})
        for i, b in enumerate(plan.blocks):
            if b.index != i:
                raise reader.error(
                    f"{at}blocks[{i}].index", f"is {b.index}, expected {i} (blocks are listed in forward order from 0)"
                )
        validate_ops(
            plan.ops, len(plan.blocks), block_fqns=[b.fqns for b in plan.blocks], source=f"{reader.kind} json: {at}ops"
        )
        if plan.input_bytes is not None and len(plan.input_bytes) != len(plan.blocks):
            raise reader.error(
                f"{at}input_bytes",
                f"has {len(plan.input_bytes)} entries, expected one per block ({len(plan.blocks)})",
            )
        if plan.trainable_params is not None and len(plan.trainable_params) != len(plan.blocks) + 1:
            raise reader.error(
                f"{at}trainable_params",
                f"has {len(plan.trainable_params)} entries, expected one per block and one for the other modules "
                f"({len(plan.blocks) + 1})",
            )
        return plan


_READER = Reader("plan", "make the plan again with remat.plan(...).to_json() or `remat plan MODEL --out plan.json`")


def single_level_ops(n: int, checkpointed: set[int] | frozenset[int]) -> tuple[Op, ...]:
    """Operations checkpointing each block in ``checkpointed`` on its own and keeping the rest."""
    return tuple(Recompute(i, i + 1, (Keep(i),)) if i in checkpointed else Keep(i) for i in range(n))
