"""The plan: which blocks are kept and which recomputed (with nesting), and what that is predicted to cost."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from remat._json import Reader, load
from remat.blocks import Block
from remat.plan.chain import Keep, Op, Recompute, RecomputeSub, ops_from_json, ops_repr, ops_to_json, validate_ops
from remat.units import format_bytes, format_ms

__all__ = ["Plan", "block_to_json", "block_from_json"]


def block_to_json(b: Block) -> dict[str, Any]:
    """A block as plain JSON values."""
    d = asdict(b)
    d["type_hint"] = b.type_hint.value
    return d


def block_from_json(d: dict[str, Any], reader: Reader | None = None, path: str = "block") -> Block:
    """Inverse of :func:`block_to_json`.

    Raises:
        RematError: If a field is missing or of the wrong type (``reader`` names the file, ``path`` the block).
    """
    return (reader or Reader("block")).build(Block, d, path)


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

    @property
    def checkpointed(self) -> tuple[int, ...]:
        """Indices of blocks under a top-level checkpoint (whole blocks, or sub-modules inside them)."""
        out: list[int] = []
        for op in self.ops:
            if isinstance(op, Recompute):
                out.extend(range(op.start, op.stop))
            elif isinstance(op, RecomputeSub):
                out.append(op.index)
        return tuple(out)

    @property
    def depth(self) -> int:
        """Nesting depth: 0 keeps everything, 1 is single-level checkpointing, 2+ is nested."""

        def d(ops: tuple[Op, ...]) -> int:
            return max((1 + d(op.inner) if isinstance(op, Recompute) else int(isinstance(op, RecomputeSub)) for op in ops), default=0)

        return d(self.ops)

    def should_checkpoint(self, index: int) -> bool:
        """Whether block ``index`` is (partly) recomputed."""
        return index in self.checkpointed

    def describe(self) -> str:
        """The operations in compact form, e.g. ``'K0 R[1:4](K1 R[2:3](K2) K3) K4'``."""
        return ops_repr(self.ops)

    def summary(self) -> str:
        """A few human lines: strategy, checkpointed blocks and predicted figures."""
        lines = [f"plan {self.strategy}: {len(self.checkpointed)}/{len(self.blocks)} blocks checkpointed, depth {self.depth}"]
        lines.append(f"  ops: {self.describe()}")
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
            ratio = f" (+{self.predicted_extra_ms / self.baseline_step_ms:.0%} of a step)" if self.baseline_step_ms else ""
            lines.append(f"  predicted recompute: {format_ms(self.predicted_extra_ms)}{ratio}")
        return "\n".join(lines)

    def to_json(self) -> str:
        """Serialise to a JSON string (with ``schema_version``)."""
        data = {
            "schema_version": self.schema_version,
            "strategy": self.strategy,
            "blocks": [block_to_json(b) for b in self.blocks],
            "ops": ops_to_json(self.ops),
            "fingerprint": self.fingerprint,
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_extra_ms": self.predicted_extra_ms,
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "baseline_step_ms": self.baseline_step_ms,
        }
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read a plan written by :meth:`to_json` (NOTE [ One loading policy ] in ``remat._json``).

        Raises:
            RematError: If the text is not a plan of this schema version, lacks or mistypes a field,
                lists its blocks out of order, or its operations do not cover every block once, in
                order (``remat.plan.chain.validate_ops``).
        """
        reader = Reader("plan", "make the plan again with remat.plan(...).to_json() or `remat plan MODEL --out plan.json`")
        data = load(text, reader, cls.schema_version)
        plan = reader.build(cls, data, convert={"ops": lambda r, v, at: ops_from_json(v, r, at)})
        for i, b in enumerate(plan.blocks):
            if b.index != i:
                raise reader.error(f"blocks[{i}].index", f"is {b.index}, expected {i} (blocks are listed in forward order from 0)")
        validate_ops(plan.ops, len(plan.blocks), block_fqns=[b.fqns for b in plan.blocks], source="plan json: ops")
        return plan


def single_level_ops(n: int, checkpointed: set[int] | frozenset[int]) -> tuple[Op, ...]:
    """Operations checkpointing each block in ``checkpointed`` on its own and keeping the rest."""
    return tuple(Recompute(i, i + 1, (Keep(i),)) if i in checkpointed else Keep(i) for i in range(n))
