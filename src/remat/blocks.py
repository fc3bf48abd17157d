"""Finding the checkpointable blocks of any ``nn.Module``.

A *block* is the unit remat keeps or recomputes: one module (a transformer layer, a ResNet stage)
or, as NNTrainer's ``addCheckpointBlock``, a named group of consecutive sibling modules whose input
and output are kept and whose inside is recomputed.
"""

from __future__ import annotations

import ast
import difflib
import fnmatch
import hashlib
import inspect
import itertools
import textwrap
import types
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from remat._json import Reader
from remat.errors import BlockSelectionError

__all__ = ["LayerType", "Block", "blocks", "fingerprint", "resolve"]

ModuleFilter = Callable[[nn.Module, str], bool]


class LayerType(str, Enum):
    """A block's layer-type hint, inferred from its modules' structure (not their names)."""

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
        attention_fqns: Sub-modules inside the block that are attention (for ``attention_only``), found
            by structure (NOTE [ Attention and FFN by structure ]).
        ffn_fqns: Sub-modules inside the block that are feed-forward (for ``ffn_only``); several when
            the FFN is split over consecutive siblings (BERT's ``intermediate`` and ``output``).
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

    def to_json(self) -> dict[str, Any]:
        """The block as plain JSON values."""
        d = asdict(self)
        d["type_hint"] = self.type_hint.value
        return d

    @classmethod
    def from_json(cls, data: Any, reader: Reader | None = None, path: str = "block") -> Block:
        """Inverse of :meth:`to_json`.

        Raises:
            RematError: If a field is missing or of the wrong type (``reader`` names the file, ``path`` the block).
        """
        return (reader or Reader("block")).build(cls, data, path)


_NORMS = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.LocalResponseNorm,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
)
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # no forward of their own: never a block or a sub-module
_SOFTMAX = (nn.Softmax, nn.Softmin, nn.Softmax2d, nn.LogSoftmax)
_PLAIN_FFN = (nn.Linear, nn.Dropout, nn.Identity, *_NORMS)
# A block holding these besides its FFN is not only an FFN (ConvNeXt: a depthwise conv, then an MLP).
_MIXERS = (nn.modules.conv._ConvNd, *_EMBEDDINGS)

# Functional activations (F.gelu, torch.tanh ...): the torch.nn.functional names of torch's activation
# modules, softmax and attention excepted.
_ACTIVATION_CALLS = frozenset(
    name
    for name in dir(F)
    if name.replace("_", "") in {c.lower() for c in nn.modules.activation.__all__}
    and name.replace("_", "") not in {"multiheadattention", "softmax", "softmin", "softmax2d", "logsoftmax"}
)
# Parts of a name that say it applies an activation (GeLUFunction, quick_gelu): whole words only for the
# short and the generic ones.
_ACTIVATION_WORDS = frozenset(n for n in _ACTIVATION_CALLS if len(n) >= 4 and "_" not in n) - {"threshold"}
# What an attention forward calls or looks up for its core (HF transformers dispatches through
# ALL_ATTENTION_FUNCTIONS, with eager_attention_forward as the fallback).
_ATTENTION_CALLS = frozenset(
    {
        "softmax",
        "scaled_dot_product_attention",
        "flex_attention",
        "flash_attn_func",
        "flash_attn_varlen_func",
        "ALL_ATTENTION_FUNCTIONS",
        "eager_attention_forward",
    }
)


def _has_children(module: nn.Module) -> bool:
    return next(module.children(), None) is not None


def _is_activation(module: nn.Module) -> bool:
    """A leaf activation: from torch's or a library's activation module (nn.GELU, HF's SiLUActivation), or a
    parameter-free leaf whose forward applies one (BLOOM's BloomGelu calls ``GeLUFunction.apply``)."""
    if isinstance(module, (nn.MultiheadAttention, *_SOFTMAX, nn.Dropout, nn.Identity)) or _has_children(module):
        return False
    where = type(module).__module__
    if where == "torch.nn.modules.activation" or where.rsplit(".", 1)[-1] in ("activation", "activations"):
        return True
    return next(module.parameters(recurse=False), None) is None and any(
        word in name.lower() for name in _source(type(module)).names for word in _ACTIVATION_WORDS
    )


def _calls_activation(cls: type) -> bool:
    """Whether ``cls.forward`` calls an activation function (``F.gelu``, ``torch.tanh``, ``bloom_gelu_forward``)."""
    return any(
        name in _ACTIVATION_CALLS or _ACTIVATION_CALLS.intersection(name.split("_")) for name in _source(cls).calls
    )


def _expert_bank(module: nn.Module) -> bool:
    """A mixture of experts' stacked weights: two or more 3-D parameters of one module, one slice per expert."""
    if isinstance(module, nn.modules.conv._ConvNd):
        return False
    experts = [p.shape[0] for p in module.parameters(recurse=False) if p.dim() == 3]
    return len(experts) >= 2 and len(set(experts)) == 1


def _weight_shape(module: nn.Module) -> tuple[int, ...] | None:
    """The shape of ``module.weight`` without computing it: a parametrized weight (spectral norm) is read
    from its original, as evaluating the parametrization runs its forward (spectral norm's power iteration
    updates its ``_u`` and ``_v`` in training mode), which finding blocks must not do."""
    if parametrize.is_parametrized(module, "weight"):
        plists: Any = module.parametrizations  # a ModuleDict of ParametrizationList
        plist = plists["weight"]
        original = getattr(plist, "original", None)
        if isinstance(original, torch.Tensor) and not plist.unsafe:
            return tuple(original.shape)  # a safe parametrization keeps the shape of its one original
        # Several originals (weight_norm's g and v) or an unsafe one: computed, its state put back.
        state = [(b, b.detach().clone()) for b in plist.buffers()]
        with torch.no_grad():
            weight = getattr(module, "weight", None)
            for b, value in state:
                if not torch.equal(b, value):
                    b.copy_(value)
        return tuple(weight.shape) if isinstance(weight, torch.Tensor) else None
    weight = getattr(module, "weight", None)
    return tuple(weight.shape) if isinstance(weight, torch.Tensor) else None


def _widths(module: nn.Module) -> tuple[int, int] | None:
    """(input, output) features of a linear projection, or None.

    nn.Linear (and its subclasses), HF's ``Conv1D`` (a Linear with its weight transposed), or a
    wrapper around one that keeps its widths (a PEFT LoRA layer around its ``base_layer``).
    """
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    nx, nf = getattr(module, "nx", None), getattr(module, "nf", None)
    if isinstance(nx, int) and isinstance(nf, int) and _weight_shape(module) == (nx, nf):
        return nx, nf
    fi, fo = getattr(module, "in_features", None), getattr(module, "out_features", None)
    if (
        isinstance(fi, int)
        and isinstance(fo, int)
        and any(_widths(c) == (fi, fo) for c in module.children())
        and not any(_is_activation(m) for m in module.modules())
    ):
        return fi, fo
    return None


def _is_norm(module: nn.Module) -> bool:
    """torch's norm layers, or a leaf holding only one or two per-channel vectors (RMSNorm, T5LayerNorm)."""
    if isinstance(module, _NORMS):
        return True
    if _has_children(module) or _is_activation(module) or _widths(module) is not None:
        return False
    params = list(module.parameters(recurse=False))
    return 1 <= len(params) <= 2 and all(p.dim() == 1 and p.numel() == params[0].numel() for p in params)


def _expands(units: Sequence[tuple[int, int]]) -> bool:
    """Whether the projections hold a feed-forward's shape: ``d -> h`` with ``h > d``, and ``h -> d``; or
    a fused gate and up projection ``d -> 2h`` with ``h -> d`` (Phi-3's ``gate_up_proj``)."""
    have = set(units)
    return any(o > i and ((o, i) in have or (o % 2 == 0 and o // 2 > i and (o // 2, i) in have)) for i, o in have)


@dataclass(frozen=True)
class _Source:
    """What a class's ``forward`` (with the methods of its own that it calls) refers to."""

    attributes: tuple[str, ...]  # ``self.<name>`` in the order they first run (see _when); no comparisons
    names: frozenset[str]  # every identifier and attribute name
    calls: frozenset[str]  # names of the functions and methods it calls
    called: frozenset[str] = frozenset()  # ``self.<name>`` it calls itself (``self.<name>(x)``)
    called_again: frozenset[str] = frozenset()  # ``self.<name>`` it calls at two places or more
    # ``self.<name>`` it calls at two places under the same conditions (both run whenever one does: _branches)
    called_twice: frozenset[str] = frozenset()


_HELPER_DEPTH = 3  # how deep forward -> self.helper() -> ... is followed


def _parse(fn: object) -> ast.Module | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(fn)))  # type: ignore[arg-type]
    except (OSError, TypeError, SyntaxError):
        return None


def _own_method(cls: type, name: str) -> types.FunctionType | None:
    for klass in cls.__mro__:
        if name in vars(klass):
            value = vars(klass)[name]
            if klass in (nn.Module, object) or not isinstance(value, types.FunctionType):
                return None
            return value
    return None


_SOURCES: dict[type, _Source] = {}


def _source(cls: type) -> _Source:
    """What ``cls.forward`` refers to (read once per class)."""
    if cls not in _SOURCES:
        _SOURCES[cls] = _read_source(cls)
    return _SOURCES[cls]


def _read_source(cls: type) -> _Source:
    order: dict[str, None] = {}
    names: set[str] = set()
    calls: set[str] = set()
    called: set[str] = set()
    called_again: set[str] = set()
    called_twice: set[str] = set()

    def visit(fn: object, depth: int, seen: frozenset[str]) -> None:
        tree = _parse(fn)
        if tree is None:
            return
        parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        uses: list[tuple[tuple[int, int], str]] = []  # (when it runs, self.<name>)
        sites: dict[str, list[dict[str, bool]]] = {}  # self.<name> -> the branches of each call of it here
        top = tree.body[0] if tree.body else None
        me = top.args.args[0].arg if isinstance(top, ast.FunctionDef) and top.args.args else "self"
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
                calls.add(node.func.id if isinstance(node.func, ast.Name) else node.func.attr)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
                # `self.x is None` runs nothing: not a use.
                if isinstance(node.value, ast.Name) and node.value.id == me:
                    if not isinstance(parents.get(id(node)), ast.Compare):
                        uses.append((_when(node, parents), node.attr))
                    call = parents.get(id(node))
                    if isinstance(call, ast.Call) and call.func is node:
                        if node.attr in called:
                            called_again.add(node.attr)
                        called.add(node.attr)
                        path = _branches(node, parents)
                        earlier = sites.setdefault(node.attr, [])
                        if path in earlier:
                            called_twice.add(node.attr)
                        earlier.append(path)
        for _, name in sorted(uses):
            method = _own_method(cls, name)
            if method is not None:
                if depth < _HELPER_DEPTH and name not in seen:
                    visit(method, depth + 1, seen | {name})
            else:
                order.setdefault(name)

    visit(getattr(cls, "forward", None), 0, frozenset({"forward"}))
    return _Source(
        tuple(order),
        frozenset(names),
        frozenset(calls),
        frozenset(called),
        frozenset(called_again),
        frozenset(called_twice),
    )


def _branches(node: ast.AST, parents: dict[int, ast.AST]) -> dict[str, bool]:
    """The conditions of the ``if`` statements and expressions around ``node``: condition -> whether
    ``node`` runs when it holds (``if not c:`` is ``c`` false, its ``else`` ``c`` true)."""
    out: dict[str, bool] = {}
    child, parent = node, parents.get(id(node))
    while parent is not None:
        if isinstance(parent, (ast.If, ast.IfExp)) and child is not parent.test:
            orelse = parent.orelse if isinstance(parent, ast.If) else [parent.orelse]
            holds, test = not any(child is c for c in orelse), parent.test
            if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
                holds, test = not holds, test.operand
            out.setdefault(ast.dump(test), holds)
        child, parent = parent, parents.get(id(parent))
    return out


def _when(node: ast.Attribute, parents: dict[int, ast.AST]) -> tuple[int, int]:
    """Where ``self.<name>`` takes effect: a call of it (or of its method) runs after its arguments, at
    the call's end (``self.decoder(self.encoder(x))`` runs the encoder first); any other use, where it is."""
    parent = parents.get(id(node))
    if isinstance(parent, ast.Attribute):
        node, parent = parent, parents.get(id(parent))
    if isinstance(parent, ast.Call) and parent.func is node:
        return (parent.end_lineno or parent.lineno, parent.end_col_offset or parent.col_offset)
    return (node.lineno, node.col_offset)


class _Anatomy:
    """Which sub-modules are attention and which feed-forward, read from structure (memoised per call).

    NOTE [ Attention and FFN by structure ]
    Names are not read: Llama's ``post_attention_layernorm`` is a norm, BERT's FFN is called
    ``intermediate`` + ``output``, T5's ``DenseReluDense``. Instead:

    * a *norm* (torch's norm layers, or a leaf holding one or two per-channel vectors) is never
      attention or FFN;
    * *attention* is nn.MultiheadAttention, or a module whose own children hold at least three
      projections of one input width (q, k, v), or one fused ``d -> 3d`` projection, or at least two
      projections and whose forward calls an attention kernel (softmax, scaled_dot_product_attention,
      HF's ALL_ATTENTION_FUNCTIONS) or holds a softmax module; it has no activation child and is not
      FFN-shaped. The smallest such module is reported (BERT's ``attention.self``, without the
      ``attention.output`` projection and norm; T5's ``layer.0.SelfAttention``);
    * an *FFN* is FFN-shaped: an up projection ``d -> h`` (``h > d``) with the matching down projection
      ``h -> d``, or a bank of experts (3-D weights, one slice per expert), and an activation (a module,
      or a call such as ``F.gelu`` in a forward); it holds no attention. The smallest module holding it
      is reported (T5's ``layer.1.DenseReluDense``, not ``layer.1`` with its norm; a MoE block whole,
      with its router). When no single module holds it, consecutive sibling modules that together do
      are reported together (BERT's ``intermediate`` and ``output``); runtime checkpoints each of them
      as a whole module. Projections that are direct leaves of the layer (nn.TransformerEncoderLayer's
      ``linear1``/``linear2``, BART's ``fc1``/``fc2``) are not reported: checkpointing leaf modules one
      by one frees nothing. Such a layer is still a mixed one (``LayerType.OTHER``).

    Projections are nn.Linear, HF's Conv1D, or wrappers that keep a Linear's widths (PEFT LoRA).
    """

    def __init__(self) -> None:
        self._units: dict[int, list[tuple[int, int]]] = {}
        self._attention: dict[int, bool] = {}
        self._holds_attention: dict[int, bool] = {}
        self._activation: dict[int, bool] = {}

    def units(self, module: nn.Module) -> list[tuple[int, int]]:
        """The widths of the outermost projections in ``module`` (itself included)."""
        key = id(module)
        if key not in self._units:
            w = _widths(module)
            self._units[key] = [w] if w is not None else [u for c in module.children() for u in self.units(c)]
        return self._units[key]

    def has_activation(self, module: nn.Module) -> bool:
        key = id(module)
        if key not in self._activation:
            self._activation[key] = (
                _is_activation(module)
                or (_has_children(module) and _calls_activation(type(module)))
                or any(self.has_activation(c) for c in module.children())
            )
        return self._activation[key]

    def ffn_shaped(self, modules: Sequence[nn.Module]) -> bool:
        """An expanding and contracting pair of projections (or a bank of experts), and an activation."""
        shaped = _expands([u for m in modules for u in self.units(m)]) or any(
            _expert_bank(d) for m in modules for d in m.modules()
        )
        return shaped and any(self.has_activation(m) for m in modules)

    def ffn_shaped_outside(self, fqns: Sequence[str], members: Sequence[nn.Module], attention: Sequence[str]) -> bool:
        """Whether the projections of ``members`` outside their attention sub-modules expand and contract."""
        skip = {
            id(m) for top, member in zip(fqns, members) for n, m in member.named_modules() if _join(top, n) in attention
        }

        def units(module: nn.Module) -> list[tuple[int, int]]:
            if id(module) in skip:
                return []
            w = _widths(module)
            return [w] if w is not None else [u for c in module.children() for u in units(c)]

        return _expands([u for m in members for u in units(m)])

    def is_attention(self, module: nn.Module) -> bool:
        key = id(module)
        if key not in self._attention:
            self._attention[key] = self._attention_rule(module)
        return self._attention[key]

    def _attention_rule(self, module: nn.Module) -> bool:
        if isinstance(module, nn.MultiheadAttention):
            return True
        if isinstance(module, (*_CONTAINERS, nn.Sequential)) or _is_norm(module) or _widths(module) is not None:
            return False
        children = list(module.children())
        if any(_is_activation(c) for c in children) or self.ffn_shaped([module]):
            return False
        projections = [w for c in children if (w := _widths(c)) is not None]
        same_input = max(Counter(i for i, _ in projections).values(), default=0)
        if same_input >= 3 or any(o == 3 * i for i, o in projections):
            return True
        core = any(isinstance(c, _SOFTMAX) for c in children) or bool(_source(type(module)).names & _ATTENTION_CALLS)
        return len(projections) >= 2 and core

    def holds_attention(self, module: nn.Module) -> bool:
        key = id(module)
        if key not in self._holds_attention:
            self._holds_attention[key] = self.is_attention(module) or any(
                self.holds_attention(c) for c in module.children()
            )
        return self._holds_attention[key]

    def is_ffn(self, module: nn.Module) -> bool:
        if isinstance(module, _CONTAINERS) or _is_norm(module) or _widths(module) is not None:
            return False
        return self.ffn_shaped([module]) and not self.holds_attention(module)

    def _narrow(self, module: nn.Module, fqn: str) -> str:
        # The smallest module holding the FFN: step into the one FFN child while its siblings are norms,
        # dropout and other parameter-free modules (T5's layer.1 -> layer.1.DenseReluDense; a MoE block
        # stays whole with its router).
        while True:
            children = list(module.named_children())
            inner = [(n, c) for n, c in children if self.is_ffn(c)]
            if len(inner) != 1 or any(
                not _is_norm(c) and any(True for _ in c.parameters()) for _, c in children if c is not inner[0][1]
            ):
                return fqn
            module, fqn = inner[0][1], f"{fqn}.{inner[0][0]}"

    def find(self, module: nn.Module, fqn: str, attn: list[str], ffn: list[str]) -> None:
        """Append the attention and FFN sub-modules below ``module`` (NOTE [ Attention and FFN by structure ])."""
        run: list[tuple[str, nn.Module]] = []  # consecutive composite siblings that may form an FFN together

        def close() -> None:
            start = 0
            while start < len(run):
                for stop in range(start + 2, len(run) + 1):
                    if self.ffn_shaped([m for _, m in run[start:stop]]):
                        ffn.extend(n for n, _ in run[start:stop])
                        start = stop
                        break
                else:
                    start += 1
            run.clear()

        for name, child in module.named_children():
            sub = f"{fqn}.{name}"
            if self.is_attention(child):
                close()
                attn.append(sub)
            elif isinstance(child, _CONTAINERS) or self.holds_attention(child):
                close()
                self.find(child, sub, attn, ffn)
            elif self.is_ffn(child):
                close()
                ffn.append(self._narrow(child, sub))
            elif _has_children(child) and _widths(child) is None and self.units(child):
                run.append((sub, child))
            elif any(True for _ in child.parameters()):
                close()  # a norm or a bare projection between them: not one FFN
        close()


def _outermost(matches: list[str]) -> tuple[str, ...]:
    out: list[str] = []
    for fqn in matches:
        if not any(fqn.startswith(m + ".") for m in out):
            out.append(fqn)
    return tuple(out)


def _infer(
    model: nn.Module, fqns: tuple[str, ...], anatomy: _Anatomy
) -> tuple[LayerType, tuple[str, ...], tuple[str, ...]]:
    members = [model.get_submodule(f) for f in fqns]
    if len(members) == 1 and anatomy.is_attention(members[0]):
        return LayerType.ATTENTION, (), ()
    if (
        len(members) == 1
        and anatomy.is_ffn(members[0])
        and not any(isinstance(m, _MIXERS) for m in members[0].modules())
    ):
        return LayerType.FFN, (), ()
    attn: list[str] = []
    ffn: list[str] = []
    for top, member in zip(fqns, members):
        anatomy.find(member, top, attn, ffn)
    if attn and ffn:
        return LayerType.OTHER, tuple(attn), tuple(ffn)
    if attn and anatomy.ffn_shaped_outside(fqns, members, attn):
        # A transformer layer whose FFN is no module of its own (nn.TransformerEncoderLayer): still a
        # mixed layer, so attention_only checkpoints its attention, not the whole layer.
        return LayerType.OTHER, tuple(attn), ()
    if attn:
        return LayerType.ATTENTION, tuple(attn), ()
    if ffn:
        return LayerType.FFN, (), tuple(ffn)
    leaves = [m for member in members for m in member.modules() if not _has_children(m)]
    if leaves and all(isinstance(m, (*_EMBEDDINGS, nn.Dropout)) for m in leaves):
        return LayerType.EMBEDDING, (), ()
    if leaves and all(_is_norm(m) for m in leaves):
        return LayerType.NORM, (), ()
    if (
        leaves
        and any(_widths(m) is not None for m in leaves)
        and all(isinstance(m, _PLAIN_FFN) or _widths(m) is not None or _is_activation(m) for m in leaves)
    ):
        return LayerType.FFN, (), ()
    return LayerType.OTHER, (), ()


def _make(model: nn.Module, groups: Sequence[tuple[str, ...]]) -> tuple[Block, ...]:
    anatomy = _Anatomy()
    out = []
    for fqns in groups:
        for fqn in fqns:
            if isinstance(model.get_submodule(fqn), _CONTAINERS):
                kind = type(model.get_submodule(fqn)).__name__
                raise BlockSelectionError(
                    f"blocks: {fqn!r} is a {kind}, which has no forward of its own (the model calls the modules "
                    f"in it), so as a block it would never run; choose its modules, e.g. include='{fqn}.*'"
                )
    for i, fqns in enumerate(groups):
        hint, attn, ffn = _infer(model, fqns, anatomy)
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


def _class(module: nn.Module) -> type:
    # torch.nn.utils.parametrize gives every parametrized module a class of its own
    # (ParametrizedLinear, one per instance); its layers are still of the class it was made from.
    cls = type(module)
    if getattr(module, "parametrizations", None) is not None and cls.__name__.startswith("Parametrized"):
        return cls.__bases__[0]
    return cls


def _run_key(module: nn.Module) -> tuple[type, frozenset[type]]:
    # Same class and the same kinds of children: ResNet stages (Sequentials of blocks) match each
    # other but not the stem (a Sequential of conv, norm, activation). Children without parameters or
    # buffers do not count: stochastic depth gives the first layer an Identity where the others have a
    # DropPath (BEiT, ConvNeXt, Swin).
    weighted = (c for c in module.children() if any(True for _ in itertools.chain(c.parameters(), c.buffers())))
    return _class(module), frozenset(_class(c) for c in weighted)


# NOTE [ Layers of one class in a ModuleList ]
# MoE decoders make their first k layers dense (DeepSeek-V2/V3, Kimi K2, dots1, GLM-4.5-Air, AFMoE:
# ``first_k_dense_replace=1``): every layer is one class (Dots1DecoderLayer) in one ModuleList, but the
# first holds an MLP where the others hold a MoE, so their children differ in kind. By _run_key alone the
# dense layer was no member of the stack: it was never a block (its activations could not be recomputed),
# and a model of two such layers had no stack at all, so the blocks fell back to the root's children (the
# whole decoder as one block). Hybrid decoders are the same case the other way round (Qwen3.5 and
# Qwen3-Next: three Gated DeltaNet layers, then one attention layer; LFM3: short convolutions with attention
# layers between; MiMo-V2-Flash: sliding and full attention): their attention layers, the ones with the
# largest activations, were no block. Members of an nn.ModuleList of one class, other than Sequentials, are one
# stack whatever their children: a ModuleList of layers is what the forward loops over. Sequentials keep
# the children rule (a ResNet's stem beside its stages); layers of different classes stay apart.


def _alike(parent: nn.Module, child: nn.Module, last: nn.Module) -> bool:
    """Whether ``child`` continues the run that ``last`` ends (NOTE [ Layers of one class in a ModuleList ])."""
    if _run_key(child) == _run_key(last):
        return True
    return isinstance(parent, nn.ModuleList) and _class(child) is _class(last) and not isinstance(child, nn.Sequential)


def _param_count(modules: Sequence[nn.Module]) -> int:
    seen: dict[int, int] = {}
    for m in modules:
        for p in m.parameters():
            seen[id(p)] = p.numel()
    return sum(seen.values())


# NOTE [ Every stack ]
# The default blocks are every stack of repeated layers in the model, as one list: a *stack* is a run
# of two or more consecutive sibling modules of one class with the same kinds of children, each with
# children and parameters (transformer layers, ResNet stages, U-Net down stages). The tree is walked
# from the root:
# * A stack whose members hold stacks of their own (T5's encoder and decoder T5Stacks, two
#   TransformerEncoders) is replaced by those inner stacks when they hold at least _SPLIT_COVERAGE of
#   its non-embedding parameters; otherwise its members are the blocks (ResNet-50: four stages, not the
#   look-alike bottlenecks after each stage's first). Nothing inside a chosen block is taken again.
# * Next to a chosen stack, siblings are layers too and are not searched for stacks (a MoE layer's
#   experts beside a run of dense layers); elsewhere every child is searched (a U-Net's downs and ups).
# * Stacks under _TINY_STACK of the model's non-embedding parameters are left out (the vision tower
#   of a large vision-language model is about 1%; two small heads are far below).
# * Order: runs are in registration order (the order of `for layer in self.layers`). Stacks under
#   different children of one module are ordered by where its forward (and the methods of its own it
#   calls) first uses those children, a call counting at its end, after its arguments (CLIP runs
#   vision_model before text_model, which it registers second; `self.decoder(self.encoder(x))` runs
#   the encoder first), when it uses them all; otherwise registration order. This reads the source,
#   it does not run the model (blocks() has no inputs): `remat.profile` checks the real order and
#   raises BlockSelectionError if the blocks ran in another.
_SPLIT_COVERAGE = 0.9
_TINY_STACK = 0.005

# NOTE [ A stack beside a list of layers ]
# A run of two like layers can sit beside an nn.ModuleList of layers: Conditional DETR's decoder holds
# `layers` (six decoder layers) and two small heads of one class, `query_scale` and `ref_point_head`. The
# run made the heads a stack, and a chosen stack's siblings are not searched (NOTE [ Every stack ]), so the
# six decoder layers (36% of a Conditional DETR with a ResNet-18 backbone) were no blocks; and as
# `query_scale` runs once per decoder layer after the first, the profile refused the model ("blocks must
# run exactly once per step"). A ModuleList or ModuleDict has no forward of its own, so it is no layer
# beside the run: when the stacks inside such siblings hold more weights than the runs chosen beside them,
# those runs are dropped and every child is searched as where no stack was found; otherwise as before.


class _Stacks:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._weights: dict[int, dict[int, int]] = {}
        self.total = self.weight([model])

    def _own_weights(self, module: nn.Module) -> dict[int, int]:
        key = id(module)
        if key not in self._weights:
            # Embedding tables hold parameters, not activations: they would make T5's embedding
            # outweigh its layers.
            own = [] if isinstance(module, _EMBEDDINGS) else module.parameters(recurse=False)
            self._weights[key] = {id(p): p.numel() for p in own}
            for child in module.children():
                self._weights[key].update(self._own_weights(child))
        return self._weights[key]

    def weight(self, modules: Sequence[nn.Module]) -> int:
        """Non-embedding parameters of ``modules`` (shared ones counted once)."""
        seen: dict[int, int] = {}
        for m in modules:
            seen.update(self._own_weights(m))
        return sum(seen.values())

    def _chain(
        self, module: nn.Module, children: list[tuple[str, nn.Module]], runs: list[list[tuple[str, nn.Module]]]
    ) -> bool:
        """Whether ``module`` is an nn.Sequential with a stretch of children repeating a pattern of two or
        more (NOTE [ Repeating patterns ]) that holds at least two layers, is longer than every run of like
        layers and holds at least _TINY_STACK of the weights."""
        if not isinstance(module, nn.Sequential):
            return False
        longest = max((len(run) for run in runs), default=0)
        for i, j, period in _periodic_runs([_run_key(child) for _, child in children]):
            members = [child for _, child in children[i : j + 1]]
            if period >= 2 and j - i + 1 > longest and sum(_is_layer(m) for m in members) >= 2:
                if self.weight(members) >= _TINY_STACK * self.total:
                    return True
        return False

    def _outweighed(
        self, stacked: list[tuple[str, list[str]]], lists: list[tuple[str, nn.Module]], prefix: str
    ) -> bool:
        """Whether the stacks inside the ModuleList / ModuleDict siblings ``lists`` hold more weights than the
        runs of layers ``stacked`` chosen beside them (NOTE [ A stack beside a list of layers ])."""
        if not lists:
            return False
        inner = [f for name, child in lists for f in self.cover(child, _join(prefix, name))]
        mine = [f for _, fqns in stacked for f in fqns]
        get = self.model.get_submodule
        return self.weight([get(f) for f in inner]) > self.weight([get(f) for f in mine])

    def cover(self, module: nn.Module, prefix: str) -> list[str]:
        """The FQNs of the blocks below ``module``, in forward order (NOTE [ Every stack ])."""
        children = list(module.named_children())
        # A MoE's experts are no stack: a router (a Linear with one output per expert) beside them sends each
        # token to some of them, so an expert runs on a part of the batch, or not at all (the profile refused
        # such blocks; the layers holding them are the blocks).
        routers = _router_widths(children) if prefix else set()  # not the root's: a head with n classes
        children = [(name, child) for name, child in children if not _experts(child, routers)]
        runs: list[list[tuple[str, nn.Module]]] = []
        for name, child in children:
            last = runs[-1][-1][1] if runs else None
            if last is not None and _is_layer(child) and _is_layer(last) and _alike(module, child, last):
                runs[-1].append((name, child))
            else:
                runs.append([(name, child)])
        pieces: list[tuple[str, list[str]]] = []
        stacked: list[tuple[str, list[str]]] = []  # runs of layers chosen here, each member a block
        singles: list[tuple[str, nn.Module]] = []
        layered = False
        if self._chain(module, children, runs):
            # Layers alternating with other modules in a chain (e3nn's (o3.Linear, Gate) pairs): each link a block.
            pieces += [(name, [_join(prefix, name)]) for name, _ in children]
            layered = True
            runs = []
        for run in runs:
            if len(run) >= 3 and len(run) in routers:
                continue  # experts registered directly beside their router
            if len(run) < 2:
                singles.append(run[0])
                continue
            inner = [(name, self.cover(child, _join(prefix, name))) for name, child in run]
            whole = self.weight([child for _, child in run])
            split = self.weight([self.model.get_submodule(f) for _, fqns in inner for f in fqns])
            if isinstance(run[0][1], _CONTAINERS) or split >= _SPLIT_COVERAGE * whole:
                pieces += inner
            elif whole >= _TINY_STACK * self.total:
                # A Sequential member the forward loops over never runs itself: its children (NOTE [ A Sequential looped over ]).
                stacked += [
                    (name, _callable_children(child, fqn) if _looped_over(module, name, child) else [fqn])
                    for name, child in run
                    for fqn in [_join(prefix, name)]
                ]
                layered = True
        if stacked and self._outweighed(stacked, [(n, c) for n, c in singles if isinstance(c, _CONTAINERS)], prefix):
            stacked, layered = [], False  # NOTE [ A stack beside a list of layers ]
        pieces += stacked
        if not layered:
            pieces += [(name, self.cover(child, _join(prefix, name))) for name, child in singles]
        position = {name: i for i, (name, _) in enumerate(children)}
        pieces = sorted((p for p in pieces if p[1]), key=lambda p: position[p[0]])
        mentioned = _source(type(module)).attributes
        if len(pieces) > 1 and all(name in mentioned for name, _ in pieces):
            pieces.sort(key=lambda p: mentioned.index(p[0]))
        return [f for _, fqns in pieces for f in fqns]


def _router_widths(children: list[tuple[str, nn.Module]]) -> set[int]:
    """Output widths of the Linears among ``children`` and inside them one level down (a router module's
    classifier, NLLB-MoE's ``router.classifier``): a container of that many modules beside one is a
    MoE's experts."""
    out: set[int] = set()
    for _, child in children:
        if isinstance(child, _CONTAINERS):
            continue
        for m in (child, *child.children()):
            if isinstance(m, nn.Linear):
                out.add(m.out_features)
    return out


def _experts(module: nn.Module, routers: set[int]) -> bool:
    """Whether ``module`` holds three or more modules of one kind, as many as a router beside it has outputs
    (a ModuleList of experts, or a module of its own holding them: NLLB-MoE's ``NllbMoeExperts``)."""
    members = [m for m in module.children() if any(True for _ in m.parameters())]  # a dropout beside them
    return (
        len(members) >= 3 and len(members) in routers and all(_run_key(m) == _run_key(members[0]) for m in members[1:])
    )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _is_layer(module: nn.Module) -> bool:
    # A projection wrapped with children of its own (a PEFT LoRA layer) is one projection, not a layer.
    return _has_children(module) and any(True for _ in module.parameters()) and _widths(module) is None


def _best_run(model: nn.Module) -> list[str]:
    # Without a stack of composite layers: the longest run of repeated children of an nn.Sequential (which
    # calls them as a chain; the q, k, v projections of a layer that a model reuses, as ALBERT, are not
    # blocks), weighted by the share of the model's parameters it covers. A run repeats a pattern of one or
    # more children (NOTE [ Repeating patterns ]): identical leaves, or (Linear, GELU) pairs; each of its
    # children is a block.
    total = _param_count([model]) or 1
    best: tuple[tuple[float, int, int], list[str]] = ((0.0, 0, 0), [])
    for prefix, container in model.named_modules():
        if not isinstance(container, nn.Sequential):
            continue
        depth = prefix.count(".") + 1 if prefix else 0
        children = list(container.named_children())
        for i, j, period in _periodic_runs([_run_key(m) for _, m in children]):
            if period > 1:
                i, j = 0, len(children) - 1  # a chain of unlike links: all of them (NOTE [ Repeating patterns ])
            coverage = _param_count([m for _, m in children[i : j + 1]]) / total
            score = (round((j - i + 1) * coverage, 9), j - i + 1, -depth)
            if score > best[0]:
                best = (score, [_join(prefix, n) for n, _ in children[i : j + 1]])
    return best[1]


# NOTE [ Repeating patterns ]
# A plain MLP is often one flat nn.Sequential: [Linear, (Linear, GELU) x k, Linear], or e3nn's
# [o3.Linear, (o3.Linear, Gate) x k, o3.Linear]. No two consecutive children are alike, so a run of
# identical children finds only the first two Linears, and every plan covers 2 of its 2k + 2 layers
# (a 50% budget was refused as infeasible). A run of period p is a stretch i..j of the children where
# each child is like the one p places before it (key[t] == key[t - p] for t in i + p..j), holding the
# pattern at least twice (j - i + 1 >= 2p); p = 1 is the run of identical children. A run of period 1
# gives its children (as before: a stem or head beside the run is left out). A run of period p >= 2 shows
# the Sequential is a chain of unlike links (not a layer's q, k, v): all its children are the blocks, one
# each (as split=True gives a layer's children), the stem and head too (e3nn's chain: the smallest
# feasible peak 69% of the plain one with them, 79% without). The planner groups consecutive blocks into
# segments, so a segment may end after a projection and recompute only the activation. Periods up to
# half the children are tried; a stretch found with several periods counts with the shortest. In
# _Stacks.cover, a Sequential whose stretch of period >= 2 holds two or more layers (children with
# parameters and children of their own: e3nn's o3.Linear) and is longer than every run of like layers
# gives all its children the same way (e3nn's stem and first o3.Linear were taken as a stack of two).


def _periodic_runs(keys: Sequence[object]) -> list[tuple[int, int, int]]:
    """The maximal runs ``(i, j, period)`` (``i..j`` inclusive) of ``keys`` that repeat a pattern of ``period``
    keys at least twice; a stretch found with several periods, with the shortest."""
    runs: list[tuple[int, int, int]] = []
    seen: set[tuple[int, int]] = set()
    for period in range(1, len(keys) // 2 + 1):
        t = period
        while t < len(keys):
            if keys[t] != keys[t - period]:
                t += 1
                continue
            start = t - period
            while t + 1 < len(keys) and keys[t + 1] == keys[t + 1 - period]:
                t += 1
            if t - start + 1 >= 2 * period and (start, t) not in seen:
                seen.add((start, t))
                runs.append((start, t, period))
            t += 1
    return runs


def _default_groups(model: nn.Module) -> list[tuple[str, ...]]:
    found = _canonical(model, _Stacks(model).cover(model, "") or _best_run(model) or _layer_list(model))
    if found:
        return [(f,) for f in found]
    roots = _canonical(model, _callable_children(model, "", looped=True))
    if len(roots) >= 2:
        return [(n,) for n in roots]
    raise BlockSelectionError(
        f"blocks: found no repeated children in {type(model).__name__} to use as blocks; "
        "choose them with include='layers.*', types=..., filter=... or named=[[...]]"
    )


# NOTE [ One module, two names ]
# A module registered under two names (performer-pytorch's ProjectionUpdater keeps ``instance = self.net``
# beside ``self.net``; any back-reference to a sub-stack) is reached twice by the walk over children: its
# layers came out twice, once per name, and the profile refused the second copy as a block that "did not
# run". Each module is a block once, under the name ``model.named_modules()`` gives it (the one ``include=``
# matches and ``state_dict`` uses); the order is that of its first occurrence.


def _canonical(model: nn.Module, fqns: Sequence[str]) -> list[str]:
    names = {id(m): n for n, m in model.named_modules()}
    out: list[str] = []
    for f in fqns:
        name = names.get(id(model.get_submodule(f)), f)
        if name not in out:
            out.append(name)
    return out


def _layer_list(model: nn.Module) -> list[str]:
    # No repeated layers, but a ModuleList of layers of several classes that holds most of the weights
    # (Jamba's Mamba and attention decoder layers, an RNN of GRU and LSTM layers): its modules.
    total = sum(p.numel() for p in model.parameters())
    best: tuple[int, list[str]] = (0, [])
    for fqn, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            weight = sum(p.numel() for p in module.parameters())
            if weight > best[0] and 2 * weight >= total:
                # A ModuleList of ModuleLists (HF Funnel's blocks of one layer each): the modules inside.
                best = (weight, _callable_children(module, fqn))
    return best[1]


def _callable_children(module: nn.Module, prefix: str, looped: bool = False) -> list[str]:
    # The children of a module, with a ModuleList / ModuleDict (no forward of its own) replaced by its own;
    # with ``looped``, also a plain nn.Sequential that the module's forward loops over or indexes instead of
    # calling (NOTE [ A Sequential looped over ]).
    out: list[str] = []
    for name, child in module.named_children():
        fqn = _join(prefix, name)
        if isinstance(child, _CONTAINERS) or (looped and _looped_over(module, name, child)):
            out += _callable_children(child, fqn)
        else:
            out.append(fqn)
    return out


# NOTE [ A Sequential looped over ]
# A model may keep its layers in an nn.Sequential and still run them one by one (``for b in self.blocks:
# x = b(x)``, ``self.blocks[i](x)``), as with a ModuleList, to pass each extra arguments or collect their
# outputs. The Sequential's own forward then never runs: as a block, the profile refused it ("did not run in
# the forward"). Its children run either way (nn.Sequential's forward calls each once, in order), so where
# the parent's forward (and the methods of its own it calls) names the Sequential but never calls it
# (``self.blocks(x)``), its children are the blocks, as a ModuleList's. This reads the source, as the
# forward order does; a Sequential reached otherwise (a forward that cannot be read, an alias) is left as
# it is, and ``remat.profile`` names the children to choose when it does not run.


def looped_hint(model: nn.Module, block: Block) -> str:
    """For a block that did not run through its ``__call__``: a note when it is an nn.Sequential, whose
    layers a model may loop over or index (NOTE [ A Sequential looped over ]), else ``""``."""
    if len(block.fqns) != 1:
        return ""
    try:
        module = model.get_submodule(block.fqns[0])
    except AttributeError:
        return ""
    if not isinstance(module, nn.Sequential) or not len(module):
        return ""
    return (
        f"{block.name!r} is an nn.Sequential: a model that loops over its layers or indexes them "
        f"(for b in self.{block.fqns[0].rsplit('.', 1)[-1]}: x = b(x)) runs them, never the Sequential itself; if so, choose its "
        f"layers as blocks (include='{block.fqns[0]}.*', with the other blocks); otherwise, "
    )


# NOTE [ Why a block did not run ]
# A block the forward never calls gets one refusal whatever the cause, so its message says which cause
# it was. The op profile's forward records every module called (a global forward pre-hook, for that one
# forward): where no module inside the block ran either, the forward never uses it (reformer-pytorch keeps
# an ``irrev_blocks`` stack beside the reversible blocks it runs); where modules inside it ran, the model
# called its children or its methods without its ``__call__`` (a loop over an nn.Sequential's layers,
# ``layer.forward(x)``, vit-pytorch's hyper-connections, whose methods the forward calls).


def unrun_hint(model: nn.Module, block: Block, called: Collection[int]) -> str:
    """Why ``block`` did not run through its ``__call__`` when ``called`` holds the ``id`` of every module
    the forward called (NOTE [ Why a block did not run ]): a sentence ending in ``"otherwise, "``, or
    ``""`` when its modules cannot be found."""
    try:
        roots = [model.get_submodule(f) for f in block.fqns]
    except AttributeError:
        return ""
    ran = [
        f"{f}.{n}" if n else f for f, root in zip(block.fqns, roots) for n, m in root.named_modules() if id(m) in called
    ]
    if not ran:
        return (
            f"neither {block.name!r} nor any module inside it ran in this forward; if the forward never uses it (a "
            "model may hold a stack it does not call, as reformer-pytorch's irrev_blocks beside the reversible "
            "blocks it runs), choose blocks the forward calls (include=..., named=...); otherwise, "
        )
    return looped_hint(model, block) or (
        f"modules inside {block.name!r} ran ({', '.join(map(repr, ran[:3]))}) but not {block.name!r} itself: "
        "the model calls its children or its methods without its __call__; choose modules it calls as blocks "
        f"(include='{block.fqns[0]}.*'); otherwise, "
    )


def _looped_over(module: nn.Module, name: str, child: nn.Module) -> bool:
    """Whether ``child`` (``module.<name>``) is a plain non-empty nn.Sequential that ``module``'s forward
    names but never calls."""
    if type(child) is not nn.Sequential or not len(child):
        return False
    source = _source(_class(module))
    return name in source.attributes and name not in source.called


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


def _check_selectors(include: Any, types: Any, filter: Any) -> None:
    """A BlockSelectionError naming the value for an ``include``, ``types`` or ``filter`` of another kind
    than :func:`blocks` takes (a class name as a string in ``types``, a pattern in ``filter``)."""
    # Any iterable of globs is taken, as before; only what cannot be one (an int, a class, a list holding
    # a non-string) is refused, and a one-shot iterable (a generator) is left unread.
    patterns = (include,) if isinstance(include, str) else include
    if include is not None and (
        not isinstance(patterns, Iterable)
        or (isinstance(patterns, (list, tuple, set, frozenset)) and not all(isinstance(p, str) for p in patterns))
    ):
        raise BlockSelectionError(
            f"blocks: include={include!r} is not an FQN glob or a list of them; give e.g. include='layers.*'"
        )
    classes = types if isinstance(types, tuple) else (types,)
    if types is not None and not all(isinstance(c, type) for c in classes):
        hint = "; to choose by module name, use include= with FQN globs ('layers.*')" if isinstance(types, str) else ""
        raise BlockSelectionError(
            f"blocks: types={types!r} is not a module class or a tuple of them; pass the class itself, e.g. "
            f"types=nn.TransformerEncoderLayer{hint}"
        )
    if filter is not None and not callable(filter):
        raise BlockSelectionError(
            f"blocks: filter={filter!r} is not callable; give a function (module, fqn) -> bool, e.g. "
            "filter=lambda module, fqn: fqn.startswith('layers.')"
        )


def blocks(
    model: nn.Module,
    *,
    include: str | Sequence[str] | None = None,
    types: type[nn.Module] | tuple[type[nn.Module], ...] | None = None,
    filter: ModuleFilter | None = None,
    named: Sequence[Sequence[str] | str] | None = None,
    split: bool = False,
) -> tuple[Block, ...]:
    """Find the checkpointable blocks of a model.

    With no selector, the blocks are every stack of repeated layers in the model, as one list
    (NOTE [ Every stack ]). A stack is a run of two or more consecutive sibling modules of one class
    with the same kinds of children, each with children and parameters: transformer layers, ResNet
    stages, the layers of a Sequential. All stacks are taken: a T5's encoder blocks then its decoder
    blocks, a U-Net's down stages then its up stages, a vision-text model's two towers. A stack whose
    members hold stacks of their own is replaced by those when they hold at least 90% of its
    non-embedding parameters (two towers of layers: the layers; ResNet-50: its four stages). Not
    taken: runs of leaves (two embeddings), stacks under 0.5% of the model's non-embedding parameters,
    and stacks inside a chosen block or inside a layer beside a chosen stack (a MoE layer's experts).
    Without any stack, the longest run of an ``nn.Sequential``'s children that repeats a pattern
    (identical leaves, or ``(Linear, GELU)`` pairs: NOTE [ Repeating patterns ]), each child a block;
    else the root's children.

    Order: a stack's blocks in registration order (``for layer in self.layers``); stacks under
    different children of a module in the order its ``forward`` (and the methods of its own it calls)
    calls those children, read from the source without running the model (CLIP runs its vision tower
    first though it registers it second); registration order when the source does not name them all.
    :func:`remat.profile` runs the model and profiles the blocks in the order they run.

    A plain ``nn.Sequential`` that a module's forward loops over or indexes (``for b in self.blocks``)
    instead of calling never runs itself: in a stack and among the root's children, its children take its
    place (NOTE [ A Sequential looped over ]).

    Each block's attention and feed-forward sub-modules (``attention_fqns``, ``ffn_fqns``, which
    ``attention_only`` and ``ffn_only`` checkpoint one by one as whole modules) are found by structure,
    not by name (NOTE [ Attention and FFN by structure ]): attention holds q, k, v projections of one
    width (or a fused one, or calls softmax / scaled_dot_product_attention), an FFN an expanding and a
    contracting projection (or a bank of experts) and an activation; a norm is neither. A layer whose
    FFN is no module of its own (``nn.TransformerEncoderLayer``) reports none.

    ``include``, ``types`` and ``filter`` may be combined (a module must satisfy all given); only the
    outermost matching modules become blocks. ``named`` groups consecutive sibling modules into
    blocks, as NNTrainer's ``addCheckpointBlock``.

    Args:
        model: Any module.
        include: FQN glob pattern(s), e.g. ``"layers.*"`` (``fnmatch`` syntax: ``*`` also matches dots).
        types: Module class(es) to select.
        filter: ``(module, fqn) -> bool`` choosing modules.
        named: Groups of module FQNs; each group is one block (a single name is a one-module block).
        split: Each block found (by default or by the selectors) replaced by its child modules, in the
            order its ``forward`` calls them, a plain ``nn.Sequential`` child by its own children,
            children its ``forward`` never names left out (NOTE [ Split blocks ]); a block without
            children stays.

    Returns:
        The blocks in forward order (as above for the default; as selected or registered otherwise),
        indexed from 0.

    Raises:
        BlockSelectionError: If nothing matches, a name does not exist, a group is not consecutive,
            or groups overlap; or if ``include`` is not a string or strings, ``types`` not a class or a
            tuple of classes, or ``filter`` not callable.
    """
    _check_selectors(include, types, filter)
    lazy = next((n for n, p in model.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)), None)
    if lazy is not None:
        raise BlockSelectionError(
            f"blocks: parameter {lazy!r} of {type(model).__name__} is not initialized yet (a lazy module: "
            "nn.LazyLinear ...); run one forward on a real batch first, then profile, plan and apply"
        )
    if named is not None:
        if include is not None or types is not None or filter is not None:
            raise BlockSelectionError("blocks: named=... cannot be combined with include/types/filter; use one of them")
        return _make(model, _split(model, _named_groups(model, named)) if split else _named_groups(model, named))
    if include is None and types is None and filter is None:
        groups = _default_groups(model)
        return _make(model, _split(model, groups) if split else groups)
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
    groups = [(f,) for f in chosen]
    return _make(model, _split(model, groups) if split else groups)


# NOTE [ Split blocks ]
# ``blocks(model, split=True)`` puts each child of a block in a block of its own: a transformer layer's
# norms, attention and MLP; a Sequential's Linear, activation and norm. Plans on such blocks can end a
# segment right after a projection: the replay stops once its input is saved again, before its matmul
# runs (torch's early stop; ``BlockProfile.stop_ms``), so a segment that starts after one layer's
# projection and ends with the next one's recomputes only the cheap ops between them (activation,
# norm) and holds only the projection's output, where a whole layer would run its matmuls again.
# Measured on the peers benchmark's workload B (8 x [Linear, GELU, LayerNorm]): at 50% of the plain
# peak, +7.4% step time split, +19.1% on the 8 layers (README, the peers table). The children come in the order the block's
# ``forward`` calls them (its source, as for stacks; registration order for an nn.Sequential or where
# the source does not name them all); ``remat.profile`` checks that order when it runs the model. A
# child that is a plain nn.Sequential (a GPT's ``mlp = Sequential(Linear, GELU, Linear)``) is split
# too, so a segment can hold the expanding projection's output and recompute only the activation.


def _split(model: nn.Module, groups: Sequence[tuple[str, ...]]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for fqns in groups:
        for fqn in fqns:
            children = _children_in_call_order(model.get_submodule(fqn), fqn)
            out += [(c,) for c in children] if children else [(fqn,)]
    return out


def _children_in_call_order(module: nn.Module, prefix: str) -> list[str]:
    names = [name for name, _ in module.named_children()]
    # One stateless module at two places of a Sequential (diffusers' AutoencoderTiny: get_activation() hands
    # out one shared ReLU) runs twice per step, and named_children() names it once: code between blocks.
    slots = [id(child) for child in module._modules.values() if child is not None]
    shared = {s for s in slots if slots.count(s) > 1}
    names = [
        n for n in names if not (id(module.get_submodule(n)) in shared and _stateless(module.get_submodule(n)))
    ] or names
    if not isinstance(module, nn.Sequential):
        source = _source(_class(module))
        # A child its forward never names (XLNet's spare dropout) is not called by it: no block.
        names = [n for n in names if n in source.names] or names
        # A stateless child it calls at two places (one DropPath for both residual branches, CCT's; an
        # activation or einops layer used twice) would run twice per step, which no block may: it stays
        # code between blocks, as the residual adds do (NOTE [ Split blocks ]).
        names = [n for n in names if not (n in source.called_again and _stateless(module.get_submodule(n)))] or names
        if any(n in source.called_twice for n in names):
            # NOTE [ Split blocks ]: a child with weights it calls at two places under the same conditions
            # (Pegasus-X's encoder layer runs final_layer_norm, fc1 and fc2 on the tokens, then on the global
            # tokens) runs twice per step, and the profile refused the whole split model: the layer stays one
            # block. Calls in two branches (OPT's ``if self.do_layer_norm_before:`` and ``if not ...:``) or
            # under a condition of their own (PatchTST's channel attention) are left to the profile to check.
            return []
        order = [a for a in source.attributes if a in names]
        if set(order) == set(names):
            names = order
    out: list[str] = []
    for name in names:
        child, fqn = module.get_submodule(name), _join(prefix, name)
        if isinstance(child, _CONTAINERS):
            out += _callable_children(child, fqn)
        elif type(child) is nn.Sequential and len(child):
            out += _children_in_call_order(child, fqn)  # runs its children in order: split it too
        else:
            out.append(fqn)
    return out


def _stateless(module: nn.Module) -> bool:
    return not any(True for _ in module.parameters()) and not any(True for _ in module.buffers())


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


# NOTE [ Parameters unfrozen after planning ]
# What a block saves for its backward depends on which of its parameters require grad: a frozen Linear whose
# input needs no grad saves nothing, a trainable one saves its input. A plan made on a half-frozen model (PEFT,
# staged fine-tuning) and trained after ``requires_grad_(True)`` saves more than profiled: 1.21-1.30x the
# budget on the built-in GPT and a Llama, gradients exact (helper-122). The profile records, per block, how
# many of its modules' parameters require grad, and one more figure for the modules in no block (an
# embedding unfrozen makes block 0's input need grad); the planned model compares once per forward
# (``remat.core.runtime``). Counted over the modules' own ``_parameters`` (each module once, a parameter two
# modules share counted by both, alike at both ends): the planned model keeps the module lists, not the
# parameters, so a parameter a wrapper replaces (FSDP2) is read where it is now.
def param_modules(model: nn.Module, groups: Sequence[Sequence[nn.Module]]) -> list[list[nn.Module]]:
    """The modules of each group's members and their sub-modules (each once), and last the model's modules in
    no group: what :func:`trainable_counts` counts (NOTE [ Parameters unfrozen after planning ])."""
    seen: set[int] = set()
    out: list[list[nn.Module]] = []
    for members in groups:
        mods: list[nn.Module] = []
        for member in members:
            for m in member.modules():
                if id(m) not in seen and m._parameters:
                    seen.add(id(m))
                    mods.append(m)
        out.append(mods)
    out.append([m for m in model.modules() if id(m) not in seen and m._parameters])
    return out


def count_trainable(modules: Sequence[Sequence[nn.Module]]) -> tuple[int, ...]:
    """Per group of :func:`param_modules`, how many parameters require grad."""
    return tuple(
        sum(1 for m in mods for p in m._parameters.values() if p is not None and p.requires_grad) for mods in modules
    )


def trainable_counts(model: nn.Module, block_list: Sequence[Block]) -> tuple[int, ...]:
    """Per block, how many of its modules' parameters require grad, then how many of the other modules' do
    (NOTE [ Parameters unfrozen after planning ])."""
    return count_trainable(param_modules(model, resolve(model, block_list)))


def _unwrapped_class_name(module: nn.Module) -> str:
    # FSDP2's fully_shard (and replicate) swap a module's class for a subclass "FSDP<Name>" of
    # (FSDPModule, <Name>); hash the class it wraps, so a plan made before sharding fits the sharded model.
    cls = type(module)
    while len(cls.__bases__) == 2 and cls.__bases__[0].__module__.startswith("torch.distributed."):
        cls = cls.__bases__[1]
    return cls.__name__


def fingerprint(model: nn.Module, block_list: Sequence[Block]) -> str:
    """A short hash to match plans to models: ``"<blocks>.<run>"``.

    ``<blocks>`` hashes the blocks' names, classes and parameter shapes; ``<run>`` hashes, in each
    module that holds a block, the names of its children of the blocks' classes, so a plan for the
    4 layers of a model does not silently cover only part of a 6-layer one (plans written before
    ``<run>`` existed have only ``<blocks>``; see ``apply`` in the ``remat.apply`` module). Classes are those before
    FSDP2's ``fully_shard``, and parameter shapes a DTensor's global ones, so a model hashes the same
    sharded or not.
    """
    h = hashlib.sha1()
    containers: dict[str, set[str]] = {}
    for b, members in zip(block_list, resolve(model, block_list)):
        h.update(repr(b.fqns).encode())
        for fqn, m in zip(b.fqns, members):
            h.update(_unwrapped_class_name(m).encode())
            containers.setdefault(fqn.rpartition(".")[0], set()).add(_unwrapped_class_name(m))
            for name, p in m.named_parameters():
                h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
    run = hashlib.sha1()
    for parent, classes in containers.items():
        children = [n for n, c in model.get_submodule(parent).named_children() if _unwrapped_class_name(c) in classes]
        run.update(f"{parent}:{children}".encode())
    return f"{h.hexdigest()[:16]}.{run.hexdigest()[:8]}"
