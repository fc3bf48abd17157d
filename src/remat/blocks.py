"""Finding the checkpointable blocks of any ``nn.Module``.

A *block* is the unit remat keeps or recomputes: one module (a transformer layer, a ResNet stage)
or, as NNTrainer's ``addCheckpointBlock``, a named group of consecutive sibling modules whose input
and output are kept and whose inside is recomputed.
"""

from __future__ import annotations

import difflib
import fnmatch
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from torch import nn

from remat.errors import BlockSelectionError

__all__ = ["LayerType", "Block", "blocks", "fingerprint", "resolve"]

ModuleFilter = Callable[[nn.Module, str], bool]


class LayerType(str, Enum):
    """A block's layer-type hint, inferred from its modules' classes and names."""

    ATTENTION = "attention"
    FFN = "ffn"
    EMBEDDING = "embedding"
    NORM = "norm"
    OTHER = "other"


@dataclass(frozen=True)
class Block:
    """One checkpointable unit of a model.

    Attributes:
        index: Position in forward order, from 0.
        fqns: Fully qualified names of its member modules: one, or a group of consecutive siblings.
        type_hint: Attention, FFN, Embedding, Norm or Other (a block mixing attention and FFN is Other).
        class_name: The member modules' class names joined by ``+``.
        attention_fqns: Sub-modules inside the block that are attention (for ``attention_only``).
        ffn_fqns: Sub-modules inside the block that are feed-forward (for ``ffn_only``).
        param_bytes: Bytes of the block's parameters.
    """

    index: int
    fqns: tuple[str, ...]
    type_hint: LayerType
    class_name: str
    attention_fqns: tuple[str, ...] = ()
    ffn_fqns: tuple[str, ...] = ()
    param_bytes: int = 0

    @property
    def name(self) -> str:
        """The block's display name: its FQN, or ``first..last`` for a named group."""
        return self.fqns[0] if len(self.fqns) == 1 else f"{self.fqns[0]}..{self.fqns[-1]}"


_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
_PLAIN_FFN = (nn.Linear, nn.Dropout, nn.Identity, *_NORMS)
_ATTN_WORDS = ("attention", "attn")
_FFN_WORDS = ("mlp", "ffn", "feedforward", "feed_forward")


def _local(fqn: str) -> str:
    return fqn.rsplit(".", 1)[-1].lower()


def _is_attention(module: nn.Module, fqn: str) -> bool:
    cls = type(module).__name__.lower()
    return isinstance(module, nn.MultiheadAttention) or any(w in cls or w in _local(fqn) for w in _ATTN_WORDS)


def _is_ffn(module: nn.Module, fqn: str) -> bool:
    cls = type(module).__name__.lower()
    return any(w in cls or w in _local(fqn) for w in _FFN_WORDS)


def _is_activation(module: nn.Module) -> bool:
    return type(module).__module__ == "torch.nn.modules.activation" and not isinstance(module, nn.MultiheadAttention)


def _outermost(matches: list[str]) -> tuple[str, ...]:
    out: list[str] = []
    for fqn in matches:
        if not any(fqn.startswith(m + ".") for m in out):
            out.append(fqn)
    return tuple(out)


def _infer(model: nn.Module, fqns: tuple[str, ...]) -> tuple[LayerType, tuple[str, ...], tuple[str, ...]]:
    attn: list[str] = []
    ffn: list[str] = []
    leaves: list[nn.Module] = []
    for top in fqns:
        member = model.get_submodule(top)
        for sub_name, sub in member.named_modules():
            fqn = f"{top}.{sub_name}" if sub_name else top
            if sub_name and _is_attention(sub, fqn):
                attn.append(fqn)
            elif sub_name and _is_ffn(sub, fqn):
                ffn.append(fqn)
            if not list(sub.children()):
                leaves.append(sub)
    attn_t, ffn_t = _outermost(attn), _outermost(ffn)
    attn_t = tuple(a for a in attn_t if not any(a.startswith(f + ".") for f in ffn_t))
    ffn_t = tuple(f for f in ffn_t if not any(f.startswith(a + ".") for a in attn_t))
    if len(fqns) == 1 and _is_attention(model.get_submodule(fqns[0]), fqns[0]):
        return LayerType.ATTENTION, (), ()
    if len(fqns) == 1 and _is_ffn(model.get_submodule(fqns[0]), fqns[0]):
        return LayerType.FFN, (), ()
    if attn_t and ffn_t:
        return LayerType.OTHER, attn_t, ffn_t
    if attn_t:
        return LayerType.ATTENTION, attn_t, ()
    if ffn_t:
        return LayerType.FFN, (), ffn_t
    if leaves and all(isinstance(m, _EMBEDDINGS) or isinstance(m, nn.Dropout) for m in leaves):
        return LayerType.EMBEDDING, (), ()
    if leaves and all(isinstance(m, _NORMS) for m in leaves):
        return LayerType.NORM, (), ()
    if leaves and any(isinstance(m, nn.Linear) for m in leaves) and all(
        isinstance(m, _PLAIN_FFN) or _is_activation(m) for m in leaves
    ):
        return LayerType.FFN, (), ()
    return LayerType.OTHER, (), ()


def _make(model: nn.Module, groups: Sequence[tuple[str, ...]]) -> tuple[Block, ...]:
    out = []
    for i, fqns in enumerate(groups):
        hint, attn, ffn = _infer(model, fqns)
        members = [model.get_submodule(f) for f in fqns]
        seen: set[int] = set()
        pbytes = 0
        for m in members:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    pbytes += p.numel() * p.element_size()
        out.append(
            Block(
                index=i,
                fqns=fqns,
                type_hint=hint,
                class_name="+".join(type(m).__name__ for m in members),
                attention_fqns=attn,
                ffn_fqns=ffn,
                param_bytes=pbytes,
            )
        )
    return tuple(out)


def _run_key(module: nn.Module) -> tuple[type, frozenset[type]]:
    # Same class and the same kinds of children: ResNet stages (Sequentials of blocks) match each
    # other but not the stem (a Sequential of conv, norm, activation).
    return type(module), frozenset(type(c) for c in module.children())


def _param_count(modules: Sequence[nn.Module]) -> int:
    seen: dict[int, int] = {}
    for m in modules:
        for p in m.parameters():
            seen[id(p)] = p.numel()
    return sum(seen.values())


def _default_groups(model: nn.Module) -> list[tuple[str, ...]]:
    # A run of consecutive children sharing a class (transformer layers, ResNet stages, Sequential
    # children). Runs of composite modules beat runs of leaves (two embeddings are not layers); then the
    # run with the most blocks weighted by the share of the model's parameters it covers (ResNet-50's
    # four stages, not five bottlenecks inside one stage); then the longer run; then the shallower.
    total = _param_count([model]) or 1
    best: tuple[tuple[int, float, int, int], list[str]] = ((0, 0.0, 0, 0), [])
    for prefix, container in model.named_modules():
        depth = prefix.count(".") + 1 if prefix else 0
        children = list(container.named_children())
        i = 0
        while i < len(children):
            j = i
            while j + 1 < len(children) and _run_key(children[j + 1][1]) == _run_key(children[i][1]):
                j += 1
            run = [f"{prefix}.{n}" if prefix else n for n, _ in children[i : j + 1]]
            composite = int(any(True for _ in children[i][1].children()))
            coverage = _param_count([m for _, m in children[i : j + 1]]) / total
            score = (composite, round(len(run) * coverage, 9), len(run), -depth) if len(run) >= 2 else (0, 0.0, 0, 0)
            if score > best[0]:
                best = (score, run)
            i = j + 1
    if best[1]:
        return [(f,) for f in best[1]]
    roots = [n for n, _ in model.named_children()]
    if len(roots) >= 2:
        return [(n,) for n in roots]
    raise BlockSelectionError(
        f"blocks: found no repeated children in {type(model).__name__} to use as blocks; "
        "choose them with include='layers.*', types=..., filter=... or named=[[...]]"
    )


def _suggest(model: nn.Module, fqn: str) -> str:
    names = [n for n, _ in model.named_modules() if n]
    close = difflib.get_close_matches(fqn, names, n=3)
    return f" (did you mean {', '.join(map(repr, close))}?)" if close else ""


def _named_groups(model: nn.Module, named: Sequence[Sequence[str] | str]) -> list[tuple[str, ...]]:
    modules = dict(model.named_modules())
    groups: list[tuple[str, ...]] = []
    owner: dict[str, int] = {}
    for gi, group in enumerate(named):
        names = (group,) if isinstance(group, str) else tuple(group)
        if not names:
            raise BlockSelectionError(f"blocks: named block #{gi} is empty; give at least one module name")
        for fqn in names:
            if fqn not in modules or fqn == "":
                raise BlockSelectionError(
                    f"blocks: named block #{gi} lists {fqn!r}, which is not a module of "
                    f"{type(model).__name__}{_suggest(model, fqn)}; names are FQNs as in model.named_modules()"
                )
        parents = {n.rsplit(".", 1)[0] if "." in n else "" for n in names}
        if len(names) > 1:
            if len(parents) != 1:
                raise BlockSelectionError(
                    f"blocks: named block #{gi} {list(names)} mixes modules of different parents {sorted(parents)}; "
                    "a block's modules must be consecutive siblings"
                )
            parent = modules[parents.pop()]
            prefix = names[0].rsplit(".", 1)[0] + "." if "." in names[0] else ""
            order = [prefix + n for n, _ in parent.named_children()]
            for a, b in zip(names, names[1:]):
                ia, ib = order.index(a), order.index(b)
                if ib != ia + 1:
                    gap = order[ia + 1 : ib] if ib > ia else []
                    detail = f"{gap} lie between them" if gap else f"{b!r} comes before {a!r}"
                    raise BlockSelectionError(
                        f"blocks: named block #{gi} is not consecutive in forward order: {b!r} does not follow "
                        f"{a!r} ({detail}); list consecutive sibling modules in order"
                    )
        for fqn in names:
            for other, oi in owner.items():
                if fqn == other or fqn.startswith(other + ".") or other.startswith(fqn + "."):
                    raise BlockSelectionError(
                        f"blocks: named block #{gi} ({fqn!r}) overlaps named block #{oi} ({other!r}); "
                        "each module may belong to one block only"
                    )
        for fqn in names:
            owner[fqn] = gi
        groups.append(names)
    return groups


def blocks(
    model: nn.Module,
    *,
    include: str | Sequence[str] | None = None,
    types: type[nn.Module] | tuple[type[nn.Module], ...] | None = None,
    filter: ModuleFilter | None = None,
    named: Sequence[Sequence[str] | str] | None = None,
) -> tuple[Block, ...]:
    """Find the checkpointable blocks of a model.

    With no selector, the blocks are the longest run of repeated children (the layers of a
    transformer, the stages of a ResNet, the children of a Sequential): consecutive siblings of one
    class with the same kinds of children, runs of composite modules before runs of leaves, longer
    runs first, then the shallower. ``include``, ``types`` and
    ``filter`` may be combined (a module must satisfy all given); only the outermost matching modules
    become blocks. ``named`` groups consecutive sibling modules into blocks, as NNTrainer's
    ``addCheckpointBlock``.

    Args:
        model: Any module.
        include: FQN glob pattern(s), e.g. ``"layers.*"`` (``fnmatch`` syntax: ``*`` also matches dots).
        types: Module class(es) to select.
        filter: ``(module, fqn) -> bool`` choosing modules.
        named: Groups of module FQNs; each group is one block (a single name is a one-module block).

    Returns:
        The blocks in forward (registration) order, indexed from 0.

    Raises:
        BlockSelectionError: If nothing matches, a name does not exist, a group is not consecutive,
            or groups overlap.
    """
    if named is not None:
        if include is not None or types is not None or filter is not None:
            raise BlockSelectionError("blocks: named=... cannot be combined with include/types/filter; use one of them")
        return _make(model, _named_groups(model, named))
    if include is None and types is None and filter is None:
        return _make(model, _default_groups(model))
    patterns = (include,) if isinstance(include, str) else tuple(include or ())
    matches = []
    for fqn, module in model.named_modules():
        if not fqn:
            continue
        if patterns and not any(fnmatch.fnmatchcase(fqn, p) for p in patterns):
            continue
        if types is not None and not isinstance(module, types):
            continue
        if filter is not None and not filter(module, fqn):
            continue
        matches.append(fqn)
    chosen = _outermost(matches)
    if not chosen:
        what = ", ".join(
            s for s in (patterns and f"include={list(patterns)}", types and f"types={types}", filter and "filter") if s
        )
        raise BlockSelectionError(
            f"blocks: no module of {type(model).__name__} matches {what}; module names look like "
            f"{[n for n, _ in model.named_modules() if n][:5]}"
        )
    return _make(model, [(f,) for f in chosen])


def resolve(model: nn.Module, block_list: Sequence[Block]) -> list[list[nn.Module]]:
    """The member modules of each block, looked up by FQN in ``model``.

    Raises:
        BlockSelectionError: If a block's module is not in the model.
    """
    out = []
    for b in block_list:
        try:
            out.append([model.get_submodule(f) for f in b.fqns])
        except AttributeError:
            raise BlockSelectionError(
                f"blocks: block {b.name!r} is not in {type(model).__name__}; select blocks on this model"
            ) from None
    return out


def fingerprint(model: nn.Module, block_list: Sequence[Block]) -> str:
    """A short hash of the blocks' names, classes and parameter shapes (to match plans to models)."""
    h = hashlib.sha1()
    for b, members in zip(block_list, resolve(model, block_list)):
        h.update(repr(b.fqns).encode())
        for m in members:
            h.update(type(m).__name__.encode())
            for name, p in m.named_parameters():
                h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
    return h.hexdigest()[:16]
