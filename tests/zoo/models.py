"""A zoo of small models that call their blocks in every pattern seen in the wild, and the oracle.

Each zoo entry is a function returning a :class:`Case` (model, inputs, loss_fn), built from a fixed
seed inside ``torch.random.fork_rng`` so every call gives the same weights and batch and leaves the
caller's RNG alone. Every model keeps its repeated blocks in ``model.layers`` (at least four), which
``remat.blocks`` finds.

The oracle (:class:`ZooRun`) judges one cell, a model under one plan: it runs one training step of
the plain model and one of a fresh copy with the plan applied, from the same RNG state, and requires
the loss, every output, every parameter and input gradient and every buffer after the step to be
``torch.equal``, or a ``RematError`` whose message says where it comes from and why, raised without
changing the parameters or buffers. Anything else is a failure: a silent difference, a refusal that
changed the model or gives no reason, or a crash with another exception.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.blocks import Block
from remat.errors import BudgetInfeasibleError, RematError
from remat.plan import Plan, Strategy
from remat.profile import Profile

__all__ = [
    "Case",
    "seeded",
    "ZOO",
    "Cell",
    "CELLS",
    "STRATEGY_CELLS",
    "BUDGET_CELLS",
    "Verdict",
    "Outcome",
    "ZooRun",
    "run_step",
    "compare_steps",
]

# Sizes: activations well above the fixed costs of a checkpoint (a copy of the RNG state, about 5 KiB
# each), so that the planner has something to save, yet a profile takes a fraction of a second.
D = 32  # width
N = 256  # rows of the flat models' batch
B, T = 16, 16  # batch and sequence length of the sequence models
L = 8  # blocks, unless a pattern needs another number


class Case(NamedTuple):
    """One training step's ingredients: ``loss_fn(model(inputs))`` (inputs as remat takes them)."""

    model: nn.Module
    inputs: Any  # a tensor, a tuple of positional arguments or a dict of keyword arguments
    loss_fn: Callable[[Any], torch.Tensor]


def seeded(fn: Callable[[], Case]) -> Callable[[], Case]:
    """``fn`` built from seed 0 without touching the caller's RNG, the model in train mode."""

    @functools.wraps(fn)
    def build() -> Case:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            case = fn()
        case.model.train()
        return case

    return build


ZOO: dict[str, Callable[[], Case]] = {}


def _zoo(fn: Callable[[], Case]) -> Callable[[], Case]:
    ZOO[fn.__name__] = seeded(fn)
    return ZOO[fn.__name__]


# ----------------------------------------------------------------------------------------------------
# Building blocks


class MLPBlock(nn.Module):
    """``x + fc2(drop(gelu(fc1(x))))``: a residual MLP block (dropout ``p`` inside)."""

    def __init__(self, d: int = D, p: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.act = nn.GELU()
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(self.act(self.fc1(x))))


class Stack(nn.Module):
    """``head(layers(x))`` with the layers called one after another; subclasses change the forward."""

    def __init__(self, layers: list[nn.Module], d: int = D, out: int = D) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.head = nn.Linear(d, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _mse_case(model: nn.Module, *shape: int) -> Case:
    # The model maps a (..., D) input to a (..., D) output; the loss is the MSE to a random target.
    x = torch.randn(*shape, requires_grad=True)
    target = torch.randn(*shape)
    return Case(model, x, lambda out: F.mse_loss(out, target))


# ----------------------------------------------------------------------------------------------------
# The zoo


@_zoo
def chain() -> Case:
    """Control: a plain chain of residual MLP blocks (every runtime must get this one exact)."""
    return _mse_case(Stack([MLPBlock() for _ in range(L)]), N, D)


class HiddenStates(nn.Module):
    """The issue's minimal case: every block's output is collected in a list and all are used."""

    def __init__(self, d: int = D, n: int = L) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hs = []
        for layer in self.layers:
            x = layer(x)
            hs.append(x)
        return torch.stack(hs).mean(0)


@_zoo
def hidden_states() -> Case:
    """Hidden states collected in a list, all read by the loss (HF ``output_hidden_states``)."""
    return _mse_case(HiddenStates(), N, D)


@_zoo
def forward_hooks() -> Case:
    """Forward hooks append each block's output to a list that the loss reads (feature capture)."""
    model = Stack([MLPBlock() for _ in range(L)])
    feats: list[torch.Tensor] = []
    model.register_forward_pre_hook(lambda _m, _a: feats.clear())
    for layer in model.layers:
        layer.register_forward_hook(lambda _m, _a, out: feats.append(out))
    x = torch.randn(N, D, requires_grad=True)
    target = torch.randn(N, D)
    return Case(model, x, lambda out: F.mse_loss(out, target) + sum(f.square().mean() for f in feats))


class LayerDrop(Stack):
    """Blocks listed in ``skip`` are not called in training (a deterministic LayerDrop)."""

    def __init__(self, n: int = L, skip: frozenset[int] = frozenset({1})) -> None:
        super().__init__([MLPBlock() for _ in range(n)])
        self.skip = skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if self.training and i in self.skip:
                continue
            x = layer(x)
        return self.head(x)


@_zoo
def layerdrop() -> Case:
    """LayerDrop: block 1 is skipped at run time (a flag), inside the first segment of most plans."""
    return _mse_case(LayerDrop(), N, D)


class EarlyExit(Stack):
    """Stops after ``exit_after`` of its blocks; the later blocks never run."""

    def __init__(self, n: int = L, exit_after: int = 2) -> None:
        super().__init__([MLPBlock() for _ in range(n)])
        self.exit_after = exit_after

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 == self.exit_after:
                break
        return self.head(x)


@_zoo
def early_exit() -> Case:
    """Early exit after the first two blocks (the later blocks never run)."""
    return _mse_case(EarlyExit(), N, D)


class ScaledBlock(nn.Module):
    """Takes per-layer keyword arguments: a mask and a scale."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, scale: float) -> torch.Tensor:
        return x + (torch.tanh(self.fc(x)) * scale).masked_fill(~mask, 0.0)


class LayerKwargs(Stack):
    """``layer(x, mask=mask, scale=s_i)`` with a different scale per layer."""

    def __init__(self, n: int = L) -> None:
        super().__init__([ScaledBlock() for _ in range(n)])

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        for i, layer in enumerate(self.layers):
            x = layer(x, mask=mask, scale=0.5 + 0.25 * i)
        return self.head(x)


@_zoo
def layer_kwargs() -> Case:
    """Per-layer keyword arguments (a shared mask, a scale that differs per layer)."""
    model = LayerKwargs()
    x = torch.randn(N, D, requires_grad=True)
    mask = torch.rand(N, D) > 0.3
    target = torch.randn(N, D)
    return Case(model, (x, mask), lambda out: F.mse_loss(out, target))


class AuxBlock(nn.Module):
    """Returns ``(x, aux)``: the new hidden state and an auxiliary loss term."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.fc(x))
        return x + h * mask, h.square().mean()


class TupleOutputs(Stack):
    """Blocks return ``(x, aux)``, the aux terms are summed; each block gets a fresh view of the mask."""

    def __init__(self, n: int = L) -> None:
        super().__init__([AuxBlock() for _ in range(n)])

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        aux = x.new_zeros(())
        for layer in self.layers:
            x, a = layer(x, mask[:, :, None])
            aux = aux + a
        return self.head(x), aux


@_zoo
def tuple_outputs() -> Case:
    """Tuple outputs ``(x, aux)`` with the aux summed into the loss; a fresh mask view per call."""
    model = TupleOutputs()
    x = torch.randn(B, T, D, requires_grad=True)
    mask = torch.rand(B, T) > 0.2
    target = torch.randn(B, T, D)
    return Case(model, (x, mask), lambda out: F.mse_loss(out[0], target) + 0.1 * out[1])


class GatedBlock(nn.Module):
    """Returns a dict: ``{"hidden": ..., "gate": ...}``."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.gate = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        g = torch.sigmoid(self.gate(x))
        return {"hidden": x + g * torch.tanh(self.fc(x)), "gate": g.mean()}


class DictOutputs(Stack):
    """Reads ``out["hidden"]`` and collects every ``out["gate"]``."""

    def __init__(self, n: int = L) -> None:
        super().__init__([GatedBlock() for _ in range(n)])

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        gates = []
        for layer in self.layers:
            out = layer(x)
            x = out["hidden"]
            gates.append(out["gate"])
        return {"last": self.head(x), "gates": torch.stack(gates)}


@_zoo
def dict_outputs() -> Case:
    """Dict outputs; the loss reads the last hidden state and every block's gate."""
    model = DictOutputs()
    x = torch.randn(N, D, requires_grad=True)
    target = torch.randn(N, D)
    return Case(model, x, lambda out: F.mse_loss(out["last"], target) + out["gates"].sum())


class BiasAttention(nn.Module):
    """Single-head attention with a T5-style relative position bias, computed only if none is given."""

    def __init__(self, d: int, t: int, has_bias: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.relative_bias = nn.Embedding(2 * t - 1, 1) if has_bias else None
        self.t = t

    def forward(self, x: torch.Tensor, position_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if position_bias is None:
            if self.relative_bias is None:
                raise ValueError("BiasAttention: the first layer computes the position bias")
            pos = torch.arange(self.t)
            position_bias = self.relative_bias(pos[None, :] - pos[:, None] + self.t - 1).squeeze(-1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + position_bias
        return self.proj(scores.softmax(-1) @ v), position_bias


class T5Block(nn.Module):
    """Attention (with the position bias) and MLP; returns ``(x, position_bias)`` as T5's blocks do."""

    def __init__(self, d: int, t: int, has_bias: bool) -> None:
        super().__init__()
        self.attn = BiasAttention(d, t, has_bias)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor, position_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        a, position_bias = self.attn(x, position_bias)
        x = x + a
        return x + self.mlp(x), position_bias


class PassedValues(Stack):
    """Block 0 computes the position bias and returns it; every later block receives it (T5)."""

    def __init__(self, n: int = L) -> None:
        super().__init__([T5Block(D, T, has_bias=i == 0) for i in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None
        for layer in self.layers:
            x, bias = layer(x, position_bias=bias)
        return self.head(x)


@_zoo
def passed_values() -> Case:
    """Values passed from block to block: block 0's position bias goes to blocks 1..3 (T5-style)."""
    return _mse_case(PassedValues(), B, T, D)


class ResidualStages(Stack):
    """``x = x + stage(x)`` between the blocks: the stages never see each other's outputs directly."""

    def __init__(self, n: int = L) -> None:
        super().__init__([nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D)) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.layers:
            x = x + stage(x)
        return self.head(x)


@_zoo
def residual_between() -> Case:
    """Residuals between blocks: ``x = x + stage(x)``."""
    return _mse_case(ResidualStages(), N, D)


class ContextBlock(nn.Module):
    """Reads a scale and a shift from a context dict that the model updates between layers."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
        return x + torch.tanh(self.fc(x)) * ctx["scale"] + ctx["shift"]


class MutableContext(Stack):
    """One ``ctx`` dict passed to every layer and updated in place between layers."""

    def __init__(self, n: int = L) -> None:
        super().__init__([ContextBlock() for _ in range(n)])
        self.shift = nn.Parameter(torch.randn(D) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx: dict[str, Any] = {"scale": 1.0, "shift": self.shift}
        for layer in self.layers:
            x = layer(x, ctx)
            ctx["scale"] *= 0.7
            ctx["shift"] = ctx["shift"] * 0.5
        return self.head(x)


@_zoo
def mutable_context() -> Case:
    """A mutable context dict argument, updated between layers (same object every call)."""
    return _mse_case(MutableContext(), N, D)


class RunningCenter(nn.Module):
    """Subtracts a running mean of its pre-activation that it updates in its own forward (if ``track``)."""

    def __init__(self, d: int = D, track: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("running", torch.zeros(d))
        self.track = track

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.training and self.track:
            with torch.no_grad():
                self.running.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return x + torch.tanh(h - self.running)


@_zoo
def stateful_buffer() -> Case:
    """A stateful forward: block 1 updates a buffer that it reads (a custom running mean)."""
    return _mse_case(Stack([RunningCenter(track=i == 1) for i in range(L)]), N, D)


class FrozenBottom(nn.Module):
    """Embedding and the first two blocks frozen (partial fine-tuning / LoRA style)."""

    def __init__(self, vocab: int = 32, n: int = L, frozen: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        self.layers = nn.ModuleList(MLPBlock() for _ in range(n))
        self.head = nn.Linear(D, vocab)
        self.emb.requires_grad_(False)
        for layer in self.layers[:frozen]:
            layer.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@_zoo
def frozen_bottom() -> Case:
    """Frozen bottom layers: embedding and blocks 0, 1 with ``requires_grad=False``; integer inputs."""
    model = FrozenBottom()
    ids = torch.randint(0, 32, (B, T))
    target = torch.randint(0, 32, (B, T))
    return Case(model, ids, lambda out: F.cross_entropy(out.flatten(0, 1), target.flatten()))


class ConvBNBlock(nn.Module):
    """A ResNet basic block: conv-BN-ReLU-conv-BN plus the input, ReLU."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class BatchNormNet(nn.Module):
    """Conv stem, four BatchNorm residual blocks, pooled linear head."""

    def __init__(self, c: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.layers = nn.Sequential(*(ConvBNBlock(c) for _ in range(4)))
        self.head = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)).mean((2, 3)))


def _image_case(model: nn.Module) -> Case:
    x = torch.randn(B, 3, 16, 16, requires_grad=True)
    target = torch.randint(0, 5, (B,))
    return Case(model, x, lambda out: F.cross_entropy(out, target))


@_zoo
def batchnorm() -> Case:
    """BatchNorm in train mode (running statistics are buffers compared after the step)."""
    return _image_case(BatchNormNet())


class ResidualBatchNormNet(BatchNormNet):
    """``x = relu(x + stage(x))`` between the blocks, each stage conv-BN-ReLU-conv-BN."""

    def __init__(self, c: int = 8, classes: int = 5) -> None:
        super().__init__(c, classes)
        self.layers = nn.Sequential(
            *(
                nn.Sequential(
                    nn.Conv2d(c, c, 3, padding=1, bias=False),
                    nn.BatchNorm2d(c),
                    nn.ReLU(),
                    nn.Conv2d(c, c, 3, padding=1, bias=False),
                    nn.BatchNorm2d(c),
                )
                for _ in range(4)
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.layers:
            x = F.relu(x + stage(x))
        return self.head(x.mean((2, 3)))


@_zoo
def batchnorm_residual() -> Case:
    """BatchNorm stages with the residual between blocks (a refused segment must not touch the statistics)."""
    return _image_case(ResidualBatchNormNet())


@_zoo
def dropout() -> Case:
    """Dropout p=0.1 inside every block."""
    return _mse_case(Stack([MLPBlock(p=0.1) for _ in range(L)]), N, D)


class DropoutBetween(Stack):
    """Dropout drawn by the model between its blocks (draws that a replay must not shift)."""

    def __init__(self, n: int = L) -> None:
        super().__init__([MLPBlock(p=0.1) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.dropout(layer(x), 0.1, self.training)
        return self.head(x)


@_zoo
def dropout_between() -> Case:
    """Dropout inside the blocks and also between them, in the model's own forward."""
    return _mse_case(DropoutBetween(), N, D)


class TanhBlock(nn.Module):
    """``fc(tanh(x))``: saves tanh's output, not its input."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(x))


class DerivedInputs(Stack):
    """Keeps every block's output and feeds the next block ``2 * output``, a tensor made between blocks
    that the block does not save: the plain step frees it after the block, a segment holds it."""

    def __init__(self, n: int = L) -> None:
        super().__init__([TanhBlock() for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for layer in self.layers:
            y = layer(x)
            outs.append(y)
            x = y * 2
        return self.head(x) + sum(outs)


@_zoo
def derived_inputs() -> Case:
    """Hidden states kept and each next input derived from them (``x = 2 * y``) between blocks."""
    return _mse_case(DerivedInputs(), N, D)


class GeneratorBlock(MLPBlock):
    """An MLP block whose input mask comes from a ``torch.Generator`` of its own, not the default one."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.bernoulli(torch.full_like(x, 0.9), generator=self.generator)
        return super().forward(x * mask)


@_zoo
def own_generator() -> Case:
    """Blocks drawing from generators of their own (a replay must draw the same numbers)."""
    return _mse_case(Stack([GeneratorBlock(seed) for seed in range(L)]), N, D)


# ----------------------------------------------------------------------------------------------------
# One step and its comparison


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _tensors(obj: Any, path: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a nest of mappings (dicts, HF ``ModelOutput``), tuples and lists, by path."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if isinstance(obj, Mapping):
        return [leaf for k in obj for leaf in _tensors(obj[k], f"{path}.{k}")]
    if isinstance(obj, (tuple, list)):
        return [leaf for i, v in enumerate(obj) for leaf in _tensors(v, f"{path}[{i}]")]
    return []


Step = dict[str, torch.Tensor | None]


def run_step(case: Case, seed: int = 0) -> Step:
    """One training step from RNG seed ``seed`` (the caller's RNG is left alone).

    Returns:
        ``loss``, every output tensor (``out...``), every parameter's and input leaf's gradient
        (``grad:...``, ``None`` where there is none) and every buffer after the step (``buffer:...``),
        detached copies.
    """
    model = case.model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = _call(model, case.inputs)
        loss = case.loss_fn(out)
        loss.backward()
    step: Step = {"loss": loss.detach().clone()}
    step.update({p: t.detach().clone() for p, t in _tensors(out, "out")})
    step.update({f"grad:{n}": None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
    leaves = [(p, t) for p, t in _tensors(case.inputs, "input") if t.is_leaf and t.requires_grad]
    step.update({f"grad:{p}": None if t.grad is None else t.grad.clone() for p, t in leaves})
    step.update({f"buffer:{n}": b.detach().clone() for n, b in model.named_buffers()})
    return step


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def compare_steps(plain: Step, other: Step) -> list[str]:
    """Names of the entries that differ (bitwise), are missing or are extra."""
    diffs = [k for k in plain if k not in other or not _same(plain[k], other[k])]
    return diffs + [f"{k} (extra)" for k in other if k not in plain]


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        **{f"param:{n}": p.detach().clone() for n, p in model.named_parameters()},
        **{f"buffer:{n}": b.detach().clone() for n, b in model.named_buffers()},
    }


# ----------------------------------------------------------------------------------------------------
# The plans judged: every registered strategy and the optimal planner at a few budgets


@dataclass(frozen=True)
class Cell:
    """One plan to judge on every model.

    Attributes:
        label: Column label, e.g. ``"segments(2)"`` or ``"optimal 30%"``.
        needs_profile: Whether the plan can only be made from a profile.
        target: ``(blocks, profile or None) -> Plan | Strategy`` to pass to ``remat.apply``.
    """

    label: str
    needs_profile: bool
    target: Callable[[tuple[Block, ...], Profile | None], Plan | Strategy] = field(repr=False)


def _strategy_cell(label: str, make: Callable[[tuple[Block, ...], Profile | None], Strategy], name: str) -> Cell:
    def target(blocks: tuple[Block, ...], prof: Profile | None) -> Plan | Strategy:
        s = make(blocks, prof)
        assert s.name == name, (s.name, name)
        # A named strategy makes its own blocks (the named groups), so it is applied as it is; the
        # others become plans on the profile's blocks, as a user comparing predicted figures would do.
        return s if prof is None or s.name == "named" else remat.plan(prof, strategy=s)

    # Whether it reads measured sizes, asked of an instance made for two stand-in blocks.
    return Cell(label, make(_STAND_IN, None).needs_profile, target)


_STAND_IN = remat.blocks(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)))


def _half_saved(prof: Profile | None) -> int:
    return 0 if prof is None else sum(bp.saved_bytes for bp in prof.block_profiles) // 2


# Registry name -> cell, with parameters that make sense on 4 to 8 blocks.
STRATEGY_CELLS: dict[str, Cell] = {
    name: _strategy_cell(label, make, name)
    for name, label, make in [
        ("none", "none", lambda b, p: remat.none()),
        ("full", "full", lambda b, p: remat.full()),
        ("every_nth", "every_nth(2)", lambda b, p: remat.every_nth(2)),
        ("selective", "selective([0, 2])", lambda b, p: remat.selective([0, 2])),
        ("dynamic", "dynamic(0.5)", lambda b, p: remat.dynamic(0.5)),
        ("ratio", "ratio(0.5)", lambda b, p: remat.ratio(0.5)),
        ("attention_only", "attention_only()", lambda b, p: remat.attention_only()),
        ("ffn_only", "ffn_only()", lambda b, p: remat.ffn_only()),
        ("largest", "largest(2)", lambda b, p: remat.largest(2)),
        ("budget", "budget(saved/2)", lambda b, p: remat.budget(_half_saved(p))),
        ("segments", "segments(2)", lambda b, p: remat.segments(2)),
        ("sqrt", "sqrt()", lambda b, p: remat.sqrt()),
        ("named", "named([[b0, b1]])", lambda b, p: remat.named([[b[0].fqns[0], b[1].fqns[0]]])),
    ]
}


def _smallest_feasible(prof: Profile) -> int:
    """The smallest feasible peak, as ``remat.plan`` states it when asked for the impossible (1 byte)."""
    try:
        remat.plan(prof, budget="1B")
    except BudgetInfeasibleError as e:
        return e.min_peak_bytes
    return 1


def _budget_cell(label: str, budget: str | None) -> Cell:
    def target(blocks: tuple[Block, ...], prof: Profile | None) -> Plan | Strategy:
        assert prof is not None
        return remat.plan(prof, budget=budget if budget is not None else _smallest_feasible(prof))

    return Cell(label, True, target)


BUDGET_CELLS: dict[str, Cell] = {
    c.label: c
    for c in (
        _budget_cell("optimal 30%", "30%"),
        _budget_cell("optimal 50%", "50%"),
        _budget_cell("optimal 70%", "70%"),
        _budget_cell("optimal min", None),
    )
}

CELLS: dict[str, Cell] = {c.label: c for c in (*STRATEGY_CELLS.values(), *BUDGET_CELLS.values())}


# ----------------------------------------------------------------------------------------------------
# Judging a cell


class Verdict(str, Enum):
    """What happened to a model under a plan."""

    EQUAL = "equal"
    REFUSED = "refused"  # a RematError with a reason, model untouched: acceptable
    SILENT_DIFF = "SILENT DIFF"
    BAD_REFUSAL = "BAD REFUSAL"  # a RematError that changed the model or gives no reason
    CRASH = "crash"  # any other exception


# "where: what ...": house style for every remat message (it names the stage it comes from).
_REASON = re.compile(r"^[a-z][\w .()'\[\]-]*: \S.{9,}", re.DOTALL)


@dataclass(frozen=True)
class Outcome:
    """A judged cell.

    Attributes:
        verdict: See :class:`Verdict`.
        detail: The refusal's message, the entries that differ, or the exception.
        case: The planned model after its step (``None`` if no step ran), for further checks.
        plan: The plan applied (``None`` if none was).
        error: The exception that ended the cell, if any.
    """

    verdict: Verdict
    detail: str = ""
    case: Case | None = field(default=None, repr=False, compare=False)
    plan: Plan | None = field(default=None, repr=False, compare=False)
    error: BaseException | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        """Equal, or refused with a reason and the model left as it was."""
        return self.verdict in (Verdict.EQUAL, Verdict.REFUSED)

    @property
    def text(self) -> str:
        """``equal``, ``refused: <reason>``, ``SILENT DIFF: <entries>``, ``crash: <error>`` ..."""
        return self.verdict.value if not self.detail else f"{self.verdict.value}: {self.detail}"


def _error_text(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"


def _diff_text(names: list[str]) -> str:
    shown = ", ".join(names[:6])
    return f"{len(names)} differ: {shown}{', ...' if len(names) > 6 else ''}"


class ZooRun:
    """Judges cells on a set of models, profiling each model once and running its plain step once.

    Args:
        builders: Model name -> function building its :class:`Case` (deterministically).
        repeats: Timed steps per profile (1 is enough: the oracle is about values, not speed).
        seed: RNG seed of the judged steps.
    """

    def __init__(
        self,
        builders: Mapping[str, Callable[[], Case]],
        *,
        repeats: int = 1,
        seed: int = 0,
        grads: str = "none",
        split: bool = False,
    ) -> None:
        self.builders = builders
        self.split = split  # each layer's children as blocks (remat.blocks(model, split=True))
        self.repeats = repeats
        self.seed = seed
        self.grads = grads  # the loop the profile (and so every budget) describes
        self._profiles: dict[str, Profile | BaseException] = {}
        self._plain: dict[str, Step] = {}

    def profile(self, name: str) -> Profile | BaseException:
        """The model's profile, or the exception ``remat.profile`` raised on it."""
        if name not in self._profiles:
            case = self.builders[name]()
            try:
                self._profiles[name] = remat.profile(
                    case.model,
                    case.inputs,
                    case.loss_fn,
                    blocks=remat.blocks(case.model, split=self.split),
                    repeats=self.repeats,
                    grads=self.grads,
                )
            except Exception as e:  # recorded: a RematError refuses the cells that need a profile
                self._profiles[name] = e
        return self._profiles[name]

    def plain(self, name: str) -> Step:
        """The plain model's step (the oracle)."""
        if name not in self._plain:
            self._plain[name] = run_step(self.builders[name](), self.seed)
        return self._plain[name]

    def judge(self, name: str, cell: Cell) -> Outcome:
        """Run ``name`` under ``cell``'s plan and compare it with the plain model."""
        prof = self.profile(name)
        if isinstance(prof, BaseException):
            if cell.needs_profile:
                if isinstance(prof, RematError):
                    return self._refusal(prof, [])
                return Outcome(Verdict.CRASH, f"in remat.profile: {_error_text(prof)}", error=prof)
            prof = None
        plain = self.plain(name)
        case = self.builders[name]()
        before = _state(case.model)
        applied: Plan | None = None
        try:
            blocks = prof.blocks if prof is not None else remat.blocks(case.model, split=self.split)
            target = cell.target(blocks, prof)
            applied = remat.apply(case.model, target)
            step = run_step(case, self.seed)
        except RematError as e:
            after = _state(case.model)
            return self._refusal(e, [k for k in before if not torch.equal(before[k], after[k])])
        except Exception as e:
            return Outcome(Verdict.CRASH, _error_text(e), error=e)
        diffs = compare_steps(plain, step)
        if diffs:
            return Outcome(Verdict.SILENT_DIFF, _diff_text(diffs), case, applied)
        return Outcome(Verdict.EQUAL, "", case, applied)

    @staticmethod
    def _refusal(e: RematError, changed: list[str]) -> Outcome:
        msg = " ".join(str(e).split())
        if changed:
            return Outcome(Verdict.BAD_REFUSAL, f"changed {_diff_text(changed)} before refusing: {msg}", error=e)
        if not _REASON.match(msg):
            return Outcome(Verdict.BAD_REFUSAL, f"no reason given ({type(e).__name__}: {msg!r})", error=e)
        return Outcome(Verdict.REFUSED, msg, error=e)
