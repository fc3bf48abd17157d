"""remat against HF's own checkpointing at the same peak: step times measured in the same run.

For GPT-2 and Llama built from small configs (nothing downloaded), with and without LoRA adapters:
measure the peak of HF's ``activation_checkpointing_enable()`` (``gradient_checkpointing_enable`` before
transformers 5: every layer, non-reentrant), plan remat with ``hf.enable`` for a budget equal to that
measured peak (or, where remat predicts no plan that low, for its smallest feasible peak: the budget
column says which), and time the plain model, HF's checkpointing and remat's plan interleaved round
by round (medians). Gradients of both are compared bitwise with the plain model's. Prints ratios
measured in this run; nothing is asserted.

Run with the environment the Makefile's bench target sets, e.g.::

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=17179869184 MALLOC_TOP_PAD_=0 \\
    OMP_WAIT_POLICY=PASSIVE python benchmarks/hf_vs_gradient_checkpointing.py
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import remat
from remat.core.trace import train_step, zero_grads
from remat.errors import BudgetInfeasibleError
from remat.integrations import hf

# No special tokens outside the vocabulary; no KV cache in training (HF's checkpointing forces that).
_COMMON: dict[str, Any] = {"use_cache": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def gpt2(args: argparse.Namespace) -> nn.Module:
    config = GPT2Config(
        vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, **_COMMON,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def llama(args: argparse.Namespace) -> nn.Module:
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(2.75 * args.hidden),
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
        max_position_embeddings=args.seq, attention_dropout=0.1, **_COMMON,
    )  # fmt: skip
    return LlamaForCausalLM(config)


MODELS: dict[str, tuple[Callable[[argparse.Namespace], nn.Module], list[str]]] = {
    "gpt2": (gpt2, ["c_attn", "c_fc"]),
    "llama": (llama, ["q_proj", "v_proj", "up_proj"]),
}


def _loss(out: Any) -> torch.Tensor:
    return out.loss  # type: ignore[no-any-return]


def _enable_hf_checkpointing(model: Any) -> None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT: the transformers model
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5
        base.activation_checkpointing_enable()
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _grads(model: nn.Module, batch: dict[str, torch.Tensor]) -> list[torch.Tensor | None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        zero_grads(model)
        for p in model.parameters():
            p.grad = None
        train_step(model, batch, _loss)
    out = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return out


def _same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in zip(a, b)
    )


def run(name: str, lora: bool, args: argparse.Namespace) -> dict[str, Any]:
    build, targets = MODELS[name]
    torch.manual_seed(0)
    plain = build(args)
    if lora:
        plain = get_peft_model(plain, LoraConfig(r=8, target_modules=targets, lora_dropout=0.1))
    plain.train()
    ids = torch.randint(3, args.vocab, (args.batch, args.seq))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    hf_model, remat_model = copy.deepcopy(plain), copy.deepcopy(plain)
    _enable_hf_checkpointing(hf_model)
    peaks = {
        label: remat.measure(m, batch, _loss, steps=1).peak_bytes for label, m in (("plain", plain), ("hf", hf_model))
    }
    try:
        plan = hf.enable(remat_model, batch, budget=peaks["hf"], repeats=args.profile_repeats)
    except BudgetInfeasibleError as e:  # remat predicts no plan at HF's peak: take its lowest-peak plan
        plan = hf.enable(remat_model, batch, budget=e.min_peak_bytes, repeats=args.profile_repeats)
    peaks["remat"] = remat.measure(remat_model, batch, _loss, steps=1).peak_bytes
    reference = _grads(plain, batch)
    equal = {"hf": _same(reference, _grads(hf_model, batch)), "remat": _same(reference, _grads(remat_model, batch))}
    models = {"plain": plain, "hf": hf_model, "remat": remat_model}
    times: dict[str, list[float]] = {label: [] for label in models}
    for r in range(args.rounds + 1):  # round 0 warms every model up
        for label, m in models.items():
            zero_grads(m)
            t0 = time.perf_counter()
            train_step(m, batch, _loss)
            if r:
                times[label].append((time.perf_counter() - t0) * 1000)
    step_ms = {label: statistics.median(ts) for label, ts in times.items()}
    spread = {
        label: (statistics.quantiles(ts, n=4)[2] - statistics.quantiles(ts, n=4)[0]) / step_ms[label]
        for label, ts in times.items()
    }
    return {
        "model": f"{name}{' + LoRA' if lora else ''}",
        "peaks": peaks,
        "step_ms": step_ms,
        "spread": spread,
        "equal": equal,
        "plan": plan,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--profile-repeats", type=int, default=3)
    args = parser.parse_args()
    rows = [run(name, lora, args) for name in args.models for lora in (False, True)]
    print(
        f"\n{args.layers} layers, hidden {args.hidden}, batch {args.batch}x{args.seq} tokens; "
        f"{args.rounds} interleaved rounds, medians; remat's budget: HF checkpointing's measured peak, "
        "or (min) remat's smallest feasible peak"
    )
    print(
        f"{'model':<13} {'plain MiB':>9} {'HF MiB':>7} {'budget':>6} {'remat MiB':>9} {'remat/HF peak':>13} {'plain ms':>8} "
        f"{'HF ms':>7} {'remat ms':>8} {'remat/HF time':>13} {'spread':>6} {'grads HF/remat':>14}  plan"
    )
    for row in rows:
        pk, ms = row["peaks"], row["step_ms"]
        print(
            f"{row['model']:<13} {pk['plain'] / 2**20:>9.2f} {pk['hf'] / 2**20:>7.2f} "
            f"{'HF' if row['plan'].budget_bytes == pk['hf'] else 'min':>6} {pk['remat'] / 2**20:>9.2f} "
            f"{pk['remat'] / pk['hf']:>13.3f} {ms['plain']:>8.1f} {ms['hf']:>7.1f} {ms['remat']:>8.1f} "
            f"{ms['remat'] / ms['hf']:>13.3f} {max(row['spread'].values()):>6.1%} "
            f"{'yes' if row['equal']['hf'] else 'NO':>6}/{'yes' if row['equal']['remat'] else 'NO':<7}  {row['plan'].describe()}"
        )


if __name__ == "__main__":
    main()
