"""remat against the field's own checkpointing, on the same seeded model and batch, in the same run.

Four workloads, each in its own subprocess (peaks, allocator state and compile caches do not leak
from one to the next):

  * ``A``: a GPT decoder built here (12 layers, d=256, 4 heads, T=256, batch 8, vocab 1000, pre-LayerNorm,
    causal ``F.scaled_dot_product_attention``, GELU MLP 4x, learned positions, no dropout). The built-in
    ``remat.models.workload("gpt")`` is not used: it writes attention out (``q @ k^T``, mask, softmax) so that
    its ``[B, h, T, T]`` scores are saved, which is not SDPA's memory.
  * ``B``: ``nn.Sequential`` of 8 ``nn.Sequential(Linear, GELU, LayerNorm)`` (widths
    256-1024-512-2048-384-1536-768-1024-256), 2048 rows, loss ``out.pow(2).mean()``.
  * ``gpt2`` and ``llama``: transformers models built from small configs (6 layers, hidden 256, T=256,
    vocab 1000, batch 4, SDPA attention, no dropout; nothing downloaded), loss: the model's LM loss.

Rows of each workload: ``none``; the peers (``torch per-block``: ``torch.utils.checkpoint.checkpoint``
around every layer, non-reentrant; ``checkpoint_sequential`` over the layer stack with round(sqrt(n))
segments; HF ``gradient_checkpointing_enable`` (non-reentrant) on the transformers models, which is
torch per-block for them; ``torch.compile`` of the whole model with
``torch._functorch.config.activation_memory_budget`` 0.5 and 0.1); and remat
(``remat.profile`` / ``remat.plan`` / ``remat.apply``) at 50% and 20% of none's measured peak and at every
peer's measured peak; and, at each compiled peer's peak, remat under torch.compile
(``remat.plan_compiled``: inductor with the default partitioner, the plan re-made until the compiled
step's measured peak fits).

Peak: ``remat.measure`` (the torch profiler's allocation events of one forward + backward, gradients
set to ``None`` before it, above the memory held before it; exact on CPU), compiled models included.
Step time: medians over interleaved rounds (each round runs every row once, in an order rotated by one
row per round; round 0 is an untimed warm-up), and the median of each round's ratio to none's step of
the same round ("paired overhead", which a drift of the machine over the run does not move); issue
#9's targets are met only where both say so. Gradients: ``torch.equal`` of every parameter gradient
against ``none`` (and the largest absolute difference, the only figure that makes sense for compiled
rows, whose kernels differ). Prints ratios measured in the same run; nothing is asserted.

Run with the environment the Makefile's bench target sets, e.g.::

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=17179869184 MALLOC_TOP_PAD_=0 \\
    OMP_WAIT_POLICY=PASSIVE python benchmarks/peers.py --json peers.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import remat
from remat.models import Workload

# Budgets of the compiled rows: torch._functorch.config.activation_memory_budget (1.0: the default partitioner).
COMPILE_BUDGETS: tuple[float, ...] = (0.5, 0.1)
# remat's budgets as shares of none's measured peak (besides every peer's measured peak).
REMAT_SHARES: tuple[float, ...] = (0.5, 0.2)
BENCH_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "OMP_WAIT_POLICY")
MIB = 2**20


# ---------------------------------------------------------------------------------------------- workloads


class Attention(nn.Module):
    """Causal multi-head self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for y in self.qkv(x).split(c, dim=2))
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))


class Layer(nn.Module):
    """A pre-LayerNorm decoder layer: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))`` (GELU, 4x)."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    """Workload A's GPT: token and learned position embeddings, ``layers`` (an ``nn.Sequential``), LayerNorm, head."""

    def __init__(self, *, vocab: int, d_model: int, n_heads: int, n_layers: int, seq: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(seq, d_model)
        self.layers = nn.Sequential(*(Layer(d_model, n_heads) for _ in range(n_layers)))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.size(1), device=idx.device))
        return self.head(self.ln_f(self.layers(x)))


def decoder(small: bool) -> Workload:
    """Workload A (``small``: 2 layers, d=64, T=32, batch 2, vocab 100)."""
    vocab, d, heads, layers, seq, batch = (100, 64, 4, 2, 32, 2) if small else (1000, 256, 4, 12, 256, 8)
    model = Decoder(vocab=vocab, d_model=d, n_heads=heads, n_layers=layers, seq=seq)
    idx, targets = torch.randint(vocab, (batch, seq)), torch.randint(vocab, (batch, seq))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))

    return Workload(
        "A", model, idx, loss_fn, f"GPT decoder {layers}x(d={d}, h={heads}, SDPA), batch {batch}x{seq}, vocab {vocab}"
    )


def mlp(small: bool) -> Workload:
    """Workload B (``small``: widths / 8, 64 rows)."""
    widths = [256, 1024, 512, 2048, 384, 1536, 768, 1024, 256]
    rows = 2048
    if small:
        widths, rows = [w // 8 for w in widths], 64
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(a, b), nn.GELU(), nn.LayerNorm(b)) for a, b in zip(widths, widths[1:]))
    )
    x = torch.randn(rows, widths[0])

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.pow(2).mean()

    return Workload(
        "B", model, x, loss_fn, f"Sequential 8x[Linear, GELU, LayerNorm] {'-'.join(map(str, widths))}, {rows} rows"
    )


# No special tokens outside the vocabulary; no KV cache in training (HF's checkpointing forces that anyway).
_HF_COMMON: dict[str, Any] = {
    "use_cache": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "attn_implementation": "sdpa",
}


def _hf_sizes(small: bool) -> tuple[int, int, int, int, int]:
    """vocab, hidden, layers, seq, batch."""
    return (100, 64, 2, 32, 2) if small else (1000, 256, 6, 256, 4)


def _hf_workload(name: str, model: nn.Module, vocab: int, seq: int, batch: int, what: str) -> Workload:
    model.train()
    ids = torch.randint(3, vocab, (batch, seq))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    return Workload(name, model, inputs, _lm_loss, f"{what}, batch {batch}x{seq}, vocab {vocab}")


def _lm_loss(out: Any) -> torch.Tensor:
    return out.loss  # type: ignore[no-any-return]


def gpt2(small: bool) -> Workload:
    """GPT-2 from a small config."""
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab, hidden, layers, seq, batch = _hf_sizes(small)
    config = GPT2Config(
        vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **_HF_COMMON,
    )  # fmt: skip
    return _hf_workload("gpt2", GPT2LMHeadModel(config), vocab, seq, batch, f"GPT-2 {layers}x(d={hidden}, h=4, sdpa)")


def llama(small: bool) -> Workload:
    """Llama from a small config (grouped-query attention, 2 KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab, hidden, layers, seq, batch = _hf_sizes(small)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(2.75 * hidden), num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq, attention_dropout=0.0, **_HF_COMMON,
    )  # fmt: skip
    return _hf_workload(
        "llama", LlamaForCausalLM(config), vocab, seq, batch, f"Llama {layers}x(d={hidden}, h=4, kv=2, sdpa)"
    )


WORKLOADS: dict[str, Callable[[bool], Workload]] = {"A": decoder, "B": mlp, "gpt2": gpt2, "llama": llama}


def build(name: str, small: bool, seed: int = 0) -> Workload:
    """The workload ``name``, its weights and batch drawn from ``seed`` (the caller's RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return WORKLOADS[name](small)


# ---------------------------------------------------------------------------------------------- the peers


def _layers(w: Workload, model: nn.Module) -> nn.Sequential | None:
    """The layer stack that checkpoint_sequential and torch per-block wrap (A and B); None for HF models."""
    if w.name == "A":
        return model.layers  # type: ignore[return-value]
    if w.name == "B":
        return model  # type: ignore[return-value]
    return None


def per_block(w: Workload, model: nn.Module) -> nn.Module:
    """``torch.utils.checkpoint.checkpoint(layer.forward, ..., use_reentrant=False)`` around every layer."""
    layers = _layers(w, model)
    assert layers is not None
    for layer in layers:
        inner = layer.forward
        layer.forward = lambda *a, _f=inner, **k: checkpoint(_f, *a, use_reentrant=False, **k)  # type: ignore[method-assign]
    return model


def sequential_segments(n: int) -> int:
    """checkpoint_sequential's segments for ``n`` layers: round(sqrt(n)) (torch has no default)."""
    return max(1, round(math.sqrt(n)))


def sequential(w: Workload, model: nn.Module) -> nn.Module:
    """``checkpoint_sequential`` over the layer stack (it calls the children, not the stack's own forward)."""
    layers = _layers(w, model)
    assert layers is not None
    segments = sequential_segments(len(layers))
    layers.forward = lambda x: checkpoint_sequential(layers, segments, x, use_reentrant=False)  # type: ignore[method-assign]
    return model


def hf_checkpointing(w: Workload, model: nn.Module) -> nn.Module:
    """HF's own checkpointing of every decoder layer, non-reentrant."""
    import warnings

    with warnings.catch_warnings():  # transformers 5 calls it a deprecated alias of activation_checkpointing_enable
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    return model


@dataclass
class CompileCounter:
    """How often each compiled row's backend ran (a compile per graph): after the warm-up it must stay put."""

    calls: dict[float, int] = field(default_factory=dict)

    def backend(self, budget: float) -> Callable[..., Any]:
        """Inductor with ``activation_memory_budget=budget`` in effect while AOTAutograd partitions the graph.

        Each budget gets its own backend object, and dynamo guards every cache entry on the backend
        that made it, so two compiled copies of one model class keep their own graphs in one process
        (a ``torch._dynamo.reset()`` between the two compiles would throw away the first's, which the
        interleaved rounds still run).
        """
        from torch._inductor.compile_fx import compile_fx

        def inductor_at_budget(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
            self.calls[budget] = self.calls.get(budget, 0) + 1
            with torch._functorch.config.patch(activation_memory_budget=budget):
                return compile_fx(gm, example_inputs)

        return inductor_at_budget


# ---------------------------------------------------------------------------------------------- measuring


@dataclass
class Row:
    """One configuration of the workload's model, and what was measured of it."""

    label: str
    kind: str  # "none", "peer", "compiled", "remat", "remat-compiled"
    model: nn.Module | None
    peak_bytes: int | None = None
    held_bytes: int | None = None
    times_ms: list[float] = field(default_factory=list)
    grads_equal: bool | None = None
    grads_max_abs_diff: float | None = None
    budget_bytes: int | None = None
    budget_of: str | None = None  # "50% of none", "peak of <peer>"
    predicted_peak_bytes: int | None = None
    predicted_overhead: float | None = None  # the plan's predicted recompute time over the profiled step
    plan: str | None = None
    infeasible: str | None = None
    min_peak_bytes: int | None = None  # for an infeasible budget: the smallest peak remat predicts any plan reaches
    compile_s: float | None = None


def _call(model: nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def _set_grads_none(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def timed_step(model: nn.Module, w: Workload) -> float:
    """One forward + backward, gradients set to ``None`` before it (outside the clock), milliseconds."""
    _set_grads_none(model)
    t0 = time.perf_counter()
    w.loss_fn(_call(model, w.inputs)).backward()
    ms = (time.perf_counter() - t0) * 1000
    _set_grads_none(model)  # do not hold every row's gradients at once between its steps
    return ms


def gradients(model: nn.Module, w: Workload) -> list[torch.Tensor | None]:
    """Every parameter gradient of one step from a fixed RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        _set_grads_none(model)
        w.loss_fn(_call(model, w.inputs)).backward()
    out = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    _set_grads_none(model)
    return out


def compare(ref: list[torch.Tensor | None], got: list[torch.Tensor | None]) -> tuple[bool, float]:
    """(every gradient bitwise equal, largest absolute difference)."""
    if len(ref) != len(got):
        return False, math.inf
    equal, worst = True, 0.0
    for a, b in zip(ref, got):
        if a is None or b is None:
            equal &= a is None and b is None
            continue
        equal &= torch.equal(a, b)
        if a.numel():
            worst = max(worst, float((a.double() - b.double()).abs().max()))
    return equal, worst


def rotations(n_rows: int, rounds: int) -> Iterator[list[int]]:
    """Row orders of rounds 0..rounds: round r starts at row r mod n_rows."""
    for r in range(rounds + 1):
        yield [(r + i) % n_rows for i in range(n_rows)]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_workload(
    name: str,
    *,
    small: bool,
    rounds: int,
    compile_budgets: tuple[float, ...] = COMPILE_BUDGETS,
    profile_repeats: int = 5,
) -> dict[str, Any]:
    """Build workload ``name``, set up every row, measure peaks and gradients, time interleaved rounds.

    Returns:
        The JSON-ready result: the workload's description and one dict per row.
    """
    if compile_budgets:
        torch._dynamo.reset()  # a fresh process anyway; nothing compiled before this workload is reused
    w = build(name, small)
    plain = w.model
    log(f"{name}: {w.description}")

    rows: list[Row] = [Row("none", "none", plain)]
    peers: list[tuple[str, Callable[[Workload, nn.Module], nn.Module]]] = []
    if _layers(w, plain) is not None:
        n = len(_layers(w, plain))  # type: ignore[arg-type]
        peers += [
            ("torch per-block", per_block),
            (f"checkpoint_sequential ({sequential_segments(n)} of {n})", sequential),
        ]
    else:
        peers.append(("HF gradient_checkpointing", hf_checkpointing))
    for label, make in peers:
        rows.append(Row(label, "peer", make(w, copy.deepcopy(plain))))

    counter = CompileCounter()
    for budget in compile_budgets:
        compiled = cast(nn.Module, torch.compile(copy.deepcopy(plain), backend=counter.backend(budget)))
        t0 = time.perf_counter()
        timed_step(compiled, w)  # compiles the forward and (at the backward) the backward
        rows.append(Row(f"torch.compile budget {budget}", "compiled", compiled, compile_s=time.perf_counter() - t0))
        log(f"{name}: compiled at activation_memory_budget {budget} in {rows[-1].compile_s:.1f}s")

    for row in rows:
        # blocks=(): count no forwards; a hook on a compiled model's blocks would make it recompile.
        m = remat.measure(row.model, w.inputs, w.loss_fn, steps=1, blocks=(), progress=False)  # type: ignore[arg-type]
        row.peak_bytes, row.held_bytes = m.peak_bytes, m.held_bytes
        log(f"{name}: {row.label}: peak {m.peak_bytes / MIB:.2f} MiB")
    none_peak = rows[0].peak_bytes
    assert none_peak is not None

    prof = remat.profile(plain, w.inputs, w.loss_fn, repeats=profile_repeats, progress=False)
    log(f"{name}: profiled {len(prof.blocks)} blocks, profile peak {prof.peak_bytes / MIB:.2f} MiB")
    # The same budgets on each block's children as blocks (NOTE [ Split blocks ] in remat.blocks).
    split = remat.profile(
        plain, w.inputs, w.loss_fn, blocks=remat.blocks(plain, split=True), repeats=profile_repeats, progress=False
    )
    log(f"{name}: profiled {len(split.blocks)} split blocks, profile peak {split.peak_bytes / MIB:.2f} MiB")
    budgets = [(int(share * none_peak), f"{share:.0%} of none") for share in REMAT_SHARES]
    budgets += [(cast(int, r.peak_bytes), f"peak of {r.label}") for r in rows if r.kind in ("peer", "compiled")]
    for tag, source in (("remat", prof), ("remat split", split)):
        for budget_bytes, of in budgets:
            row = Row(f"{tag} @ {of}", "remat", None, budget_bytes=budget_bytes, budget_of=of)
            try:
                plan = remat.plan(source, budget_bytes)
            except remat.BudgetInfeasibleError as e:
                row.infeasible, row.min_peak_bytes = str(e), e.min_peak_bytes
                rows.append(row)
                log(f"{name}: {row.label}: infeasible ({e.min_peak_bytes / MIB:.2f} MiB is the least)")
                continue
            row.model = copy.deepcopy(plain)
            remat.apply(row.model, plan)
            row.plan, row.predicted_peak_bytes = plan.describe(), plan.predicted_peak_bytes
            if plan.predicted_extra_ms is not None and plan.baseline_step_ms:
                row.predicted_overhead = plan.predicted_extra_ms / plan.baseline_step_ms
            m = remat.measure(row.model, w.inputs, w.loss_fn, steps=1, progress=False)
            row.peak_bytes, row.held_bytes = m.peak_bytes, m.held_bytes
            rows.append(row)
            log(f"{name}: {row.label}: peak {m.peak_bytes / MIB:.2f} MiB, plan {row.plan}")

    # remat under torch.compile at each compiled peer's peak: remat.plan_compiled (inductor, the default
    # partitioner) measures the compiled step and re-plans until it fits. It resets dynamo before each
    # compile, so the rows compiled before recompile in the gradient check below, before the timed rounds.
    for peer in [r for r in rows if r.kind == "compiled"]:
        of = f"peak of {peer.label}"
        row = Row(f"remat compiled @ {of}", "remat-compiled", None, budget_bytes=peer.peak_bytes, budget_of=of)
        model = copy.deepcopy(plain)
        t0 = time.perf_counter()
        try:
            fit = remat.plan_compiled(
                model, w.inputs, w.loss_fn, cast(int, peer.peak_bytes), repeats=profile_repeats, progress=False
            )
        except remat.BudgetInfeasibleError as e:
            row.infeasible, row.min_peak_bytes = str(e), e.min_peak_bytes
            rows.append(row)
            log(f"{name}: {row.label}: infeasible: {e}")
            continue
        row.model, row.peak_bytes, row.compile_s = fit.model, fit.peak_bytes, time.perf_counter() - t0
        tries = ", ".join(f"{a.peak_bytes / fit.budget_bytes:.3f}" for a in fit.attempts)
        row.plan = f"{fit.plan.describe()} (compiled peak / budget of each attempt: {tries})"
        rows.append(row)
        log(f"{name}: {row.label}: peak {fit.peak_bytes / MIB:.2f} MiB in {row.compile_s:.0f}s, plan {row.plan}")

    live = [r for r in rows if r.model is not None]
    reference = gradients(plain, w)
    for row in live:
        row.grads_equal, row.grads_max_abs_diff = compare(reference, gradients(row.model, w))  # type: ignore[arg-type]

    compiles_before = dict(counter.calls)
    for r, order in enumerate(rotations(len(live), rounds)):
        for i in order:
            ms = timed_step(live[i].model, w)  # type: ignore[arg-type]
            if r:  # round 0 warms every row up
                live[i].times_ms.append(ms)
        log(f"{name}: round {r}/{rounds}" + (" (warm-up)" if r == 0 else ""))
    recompiles = {b: counter.calls.get(b, 0) - compiles_before.get(b, 0) for b in compile_budgets}

    for row in rows:
        if row.kind == "remat" and row.model is not None:
            remat.remove(row.model)
    return {
        "workload": name,
        "description": w.description,
        "profile_peak_bytes": prof.peak_bytes,
        "profile_blocks": [b.name for b in prof.blocks],
        "split_blocks": len(split.blocks),
        "compiled_graphs": dict(counter.calls),
        "recompiles_in_rounds": recompiles,
        "rows": [_row_json(row, rows[0]) for row in rows],
    }


def _paired(times: list[float], reference: list[float]) -> float | None:
    """The median over rounds of ``times[r] / reference[r]``, less 1 (``None`` without times)."""
    if not times or len(times) != len(reference):
        return None
    return statistics.median(a / b for a, b in zip(times, reference, strict=True)) - 1


def _row_json(row: Row, none: Row) -> dict[str, Any]:
    med = statistics.median(row.times_ms) if row.times_ms else None
    none_med = statistics.median(none.times_ms) if none.times_ms else None
    spread = None
    if len(row.times_ms) >= 2 and med:
        q = statistics.quantiles(row.times_ms, n=4)
        spread = (q[2] - q[0]) / med
    out: dict[str, Any] = {
        "row": row.label,
        "kind": row.kind,
        "peak_bytes": row.peak_bytes,
        "held_bytes": row.held_bytes,
        "peak_vs_none": None if row.peak_bytes is None else row.peak_bytes / none.peak_bytes,  # type: ignore[operator]
        "step_ms_median": med,
        "step_ms_min": min(row.times_ms) if row.times_ms else None,
        "step_ms_all": row.times_ms,
        "overhead_vs_none": None if med is None or not none_med else med / none_med - 1,
        # The median of each round's step over none's step of the same round: a drift of the machine
        # over the run cancels out (a ratio of medians taken over different rounds carries it).
        "paired_overhead_vs_none": _paired(row.times_ms, none.times_ms),
        "spread_iqr_over_median": spread,
        "grads_equal": row.grads_equal,
        "grads_max_abs_diff": row.grads_max_abs_diff,
        "compile_s": row.compile_s,
    }
    if row.kind in ("remat", "remat-compiled"):
        out.update(
            budget_bytes=row.budget_bytes,
            budget_of=row.budget_of,
            infeasible=row.infeasible,
            min_peak_bytes=row.min_peak_bytes,
            plan=row.plan,
            predicted_peak_bytes=row.predicted_peak_bytes,
            predicted_overhead=row.predicted_overhead,
            measured_over_predicted=None
            if row.peak_bytes is None or not row.predicted_peak_bytes
            else row.peak_bytes / row.predicted_peak_bytes,
            measured_over_budget=None if row.peak_bytes is None else row.peak_bytes / row.budget_bytes,  # type: ignore[operator]
        )
    return out


# ---------------------------------------------------------------------------------------------- reporting


def _pct(x: float | None, signed: bool = False) -> str:
    return "-" if x is None else f"{x:+.1%}" if signed else f"{x:.1%}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _grads_cell(row: dict[str, Any]) -> str:
    if row["grads_equal"] is None:
        return "-"
    if row["kind"] in ("compiled", "remat-compiled"):
        return f"max diff {row['grads_max_abs_diff']:.1e}"
    return "equal" if row["grads_equal"] else f"DIFFER (max {row['grads_max_abs_diff']:.1e})"


def table(result: dict[str, Any]) -> str:
    """One workload's rows as a Markdown table."""
    by_label = {r["row"]: r for r in result["rows"]}
    lines = [
        f"### {result['workload']}: {result['description']}",
        "",
        "| row | peak MiB | peak / none | step ms (median) | overhead vs none | paired overhead | spread | step ms (min) | grads | remat: budget MiB | measured / predicted | measured / budget | time vs that peer |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        if r.get("infeasible"):
            lines.append(f"| {r['row']} | infeasible | | | | | | | | {r['budget_bytes'] / MIB:.2f} | | | |")
            continue
        remat_cells = ["", "", "", ""]
        if r["kind"] in ("remat", "remat-compiled"):
            peer = by_label.get(r["budget_of"].removeprefix("peak of "))
            vs_peer = (
                f"{r['step_ms_median'] / peer['step_ms_median']:.3f}x"
                if peer is not None and peer["step_ms_median"] and r["step_ms_median"]
                else ""
            )
            remat_cells = [
                f"{r['budget_bytes'] / MIB:.2f}",
                f"{r['measured_over_predicted']:.3f}" if r["measured_over_predicted"] is not None else "-",
                f"{r['measured_over_budget']:.3f}",
                vs_peer,
            ]
        med = r["step_ms_median"]
        lines.append(
            f"| {r['row']} | {r['peak_bytes'] / MIB:.2f} | {r['peak_vs_none']:.3f} | "
            f"{_ms(med)} | {_pct(r['overhead_vs_none'], signed=True)} | "
            f"{_pct(r.get('paired_overhead_vs_none'), signed=True)} | "
            f"{_pct(r['spread_iqr_over_median'])} | {_ms(r['step_ms_min'])} | {_grads_cell(r)} | "
            + " | ".join(remat_cells)
            + " |"
        )
    notes = [r for r in result["rows"] if r.get("infeasible")]
    for r in notes:
        lines.append(f"\n{r['row']}: {r['infeasible']}")
    plans = [r for r in result["rows"] if r.get("plan")]
    if plans:
        lines.append("")
        lines += [f"- {r['row']}: {r['plan']}" for r in plans]
    lines.append(
        f"\ncompiled graphs per budget {result['compiled_graphs']}, recompiles during the timed rounds "
        f"{result['recompiles_in_rounds']}; profile peak {result['profile_peak_bytes'] / MIB:.2f} MiB"
    )
    return "\n".join(lines)


def targets(result: dict[str, Any]) -> list[str]:
    """Issue 9's targets, checked against this run's figures (nothing asserted)."""
    name, rows = result["workload"], result["rows"]
    remat_rows = [r for r in rows if r["kind"] == "remat" and not r.get("infeasible")]
    out = []

    def worse(r: dict[str, Any]) -> float:
        # Met only where both the ratio of medians and the paired median say so.
        return max(r["overhead_vs_none"], r.get("paired_overhead_vs_none") or r["overhead_vs_none"])

    def best_under(share: float, overhead: float) -> str:
        fits = [r for r in remat_rows if r["peak_vs_none"] <= share and r["step_ms_median"] is not None]
        ok = [r for r in fits if worse(r) <= overhead]
        if ok:
            r = min(ok, key=worse)
            return f"met by {r['row']} (peak {r['peak_vs_none']:.3f} of none, {worse(r):+.1%})"
        if fits:
            r = min(fits, key=worse)
            return f"NOT met: least overhead at <= {share:.0%} is {r['row']} ({r['peak_vs_none']:.3f}, {worse(r):+.1%})"
        return f"NOT met: no remat row measured <= {share:.0%} of none's peak"

    if name in ("A", "B"):
        out.append(f"{name}: <= 50% of none's peak with <= 5% overhead: {best_under(0.5, 0.05)}")
    if name == "A":
        out.append(f"{name}: <= 20% of none's peak with <= 15% overhead: {best_under(0.2, 0.15)}")
    by_label = {r["row"]: r for r in rows}
    for r in rows:
        if r["kind"] not in ("remat", "remat-compiled") or not r["budget_of"].startswith("peak of "):
            continue
        peer = by_label[r["budget_of"].removeprefix("peak of ")]
        which = r["row"].split(" @ ")[0]
        if r.get("infeasible"):
            out.append(f"{name}: at {peer['row']}'s peak: NOT met by {which} (no plan: infeasible)")
            continue
        paired = _paired(r["step_ms_all"], peer["step_ms_all"])
        ratio = max(r["step_ms_median"] / peer["step_ms_median"], 1 + paired if paired is not None else 0.0)
        out.append(
            f"{name}: at {peer['row']}'s peak {which} at least as fast: {'met' if ratio <= 1 else 'NOT met'} "
            f"({which}/peer time {ratio:.3f}, peak {r['peak_bytes'] / peer['peak_bytes']:.3f})"
        )
    over = [
        r["row"] for r in rows if r["kind"] == "remat-compiled" and r["peak_bytes"] and r["measured_over_budget"] > 1
    ]
    if any(r["kind"] == "remat-compiled" for r in rows):
        out.append(
            f"{name}: every compiled remat plan <= budget: " + ("met" if not over else f"NOT met by {', '.join(over)}")
        )
    bad = [
        r["row"]
        for r in remat_rows
        if r["measured_over_budget"] > 1.05
        or r["measured_over_predicted"] is None
        or abs(r["measured_over_predicted"] - 1) > 0.05
    ]
    out.append(
        f"{name}: every remat plan <= budget + 5% and within +-5% of predicted: "
        + ("met" if not bad else f"NOT met by {', '.join(bad)}")
    )
    return out


def environment() -> str:
    env = " ".join(f"{k}={os.environ.get(k, '(unset)')}" for k in BENCH_ENV)
    import transformers

    return (
        f"torch {torch.__version__}, transformers {transformers.__version__}, remat {remat.__version__}, "
        f"python {platform.python_version()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()} "
        f"(interop {torch.get_num_interop_threads()}); {env}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--rounds", type=int, default=7, help="timed interleaved rounds (after one warm-up round)")
    parser.add_argument("--small", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    parser.add_argument("--child-out", help=argparse.SUPPRESS)  # internal: run one workload, write its result here
    args = parser.parse_args()
    names = [n for n in args.workloads.split(",") if n]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload {', '.join(unknown)}; valid: {', '.join(WORKLOADS)}")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")

    if args.child_out:
        result = run_workload(names[0], small=args.small, rounds=args.rounds)
        with open(args.child_out, "w") as f:
            json.dump(result, f)
        return

    command = shlex.join([os.path.relpath(sys.executable), *sys.argv])
    print(f"environment: {environment()}")
    print(f"command: {command}")
    print(
        f"{args.rounds} timed interleaved rounds per workload (medians, and the fastest round; spread: interquartile range / median); "
        "peaks from remat.measure (torch profiler allocation events, forward + backward, gradients None before)\n"
    )
    results, notes = [], []
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            cmd = [sys.executable, __file__, "--workloads", name, "--rounds", str(args.rounds), "--child-out", out]
            t0 = time.perf_counter()
            proc = subprocess.run([*cmd, *(["--small"] if args.small else [])], check=False)
            if proc.returncode:
                print(
                    f"{name}: the subprocess failed with exit status {proc.returncode}; see its standard error above\n"
                )
                continue
            with open(out) as f:
                result = json.load(f)
        result["wall_s"] = time.perf_counter() - t0
        results.append(result)
        print(table(result) + f"\n\n({result['wall_s']:.0f}s for this workload)\n", flush=True)
        notes += targets(result)
    print("targets of issue 9 (this run):")
    for line in notes:
        print(f"- {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"environment": environment(), "command": command, "rounds": args.rounds, "workloads": results},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
