"""torch.compile over planned models: compiled peaks against the budget, compiled against eager step times.

For the built-in GPT and a Llama built from config, at each budget (a share of the compiled plain step's
peak): ``remat.plan_compiled`` with inductor (plans of ``solver="compile"``, NOTE [ Under torch.compile ]
in ``remat/core/runtime.py``, lowered until the compiled step's measured peak fits), then the planned
model eager and compiled in one interleaved run: exact peaks (torch profiler memory events), median step
times, the graph breaks dynamo reports and the calls that reach remat's eager runtime from the compiled
model.

    python benchmarks/compile_plans.py [--rounds 7] [--budgets 60%,50%,40%] [--models gpt,llama,llama4]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import remat
from remat.core import runtime
from remat.models import workload


def _gpt() -> tuple[str, nn.Module, Any, Callable[[Any], torch.Tensor]]:
    w = workload("gpt", n_layers=8, d_model=128, n_heads=4, seq_len=256, batch=4, vocab_size=512, dropout=0.0)
    return "gpt 8x(d=128), 4x256 tokens", w.model, w.inputs, w.loss_fn


def _llama(
    layers: int = 6, d: int = 128, vocab: int = 512, seq: int = 256
) -> tuple[str, nn.Module, Any, Callable[[Any], torch.Tensor]]:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=2 * d,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, vocab, (4, seq))
    return (
        f"llama {layers}x(d={d}), 4x{seq} tokens",
        model,
        {"input_ids": ids, "labels": ids, "use_cache": False},
        (lambda out: out.loss),
    )


def _llama4() -> tuple[str, nn.Module, Any, Callable[[Any], torch.Tensor]]:
    # The model of tests/apply/test_compile_regions.py, whose plan for 40% peaked at 1.19x it compiled.
    return _llama(layers=4, d=64, vocab=128, seq=128)


def _call(model: nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def _step(model: nn.Module, params: list[nn.Parameter], inputs: Any, loss_fn: Callable[[Any], torch.Tensor]) -> float:
    for p in params:
        p.grad = None
    t = time.perf_counter()
    loss_fn(_call(model, inputs)).backward()
    return (time.perf_counter() - t) * 1e3


def _eager_calls(compiled: nn.Module, inputs: Any) -> int:
    calls = [0]
    invoke = runtime._invoke

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return invoke(*args, **kwargs)

    runtime._invoke = counted  # type: ignore[assignment]
    try:
        _call(compiled, inputs)
    finally:
        runtime._invoke = invoke  # type: ignore[assignment]
    return calls[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--budgets", default="60%,50%,40%")
    parser.add_argument("--models", default="gpt,llama,llama4")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; rounds {args.rounds}")
    makers = {"gpt": _gpt, "llama": _llama, "llama4": _llama4}
    for key in args.models.split(","):
        name, model, inputs, loss_fn = makers[key]()
        plain_eager = remat.measure(model, inputs, loss_fn, steps=1, blocks=()).peak_bytes
        print(f"\n### {name}: plain peak {plain_eager / 2**20:.1f} MiB eager\n")
        print("| budget | plan | attempts (compiled peak / budget) | compiled peak / budget | eager peak / budget "
              "| graph breaks (plain) | eager calls | eager ms | compiled ms | compiled / eager |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|")
        torch._dynamo.reset()
        plain_breaks = (
            torch._dynamo.explain(model)(**inputs) if isinstance(inputs, dict) else torch._dynamo.explain(model)(inputs)
        ).graph_break_count
        for budget in args.budgets.split(","):
            work = copy.deepcopy(model)
            try:
                result = remat.plan_compiled(work, inputs, loss_fn, budget, progress=False)
            except remat.BudgetInfeasibleError as err:
                print(f"| {budget} | infeasible: {str(err).splitlines()[0]} | | | | | | | | |")
                continue
            tries = ", ".join(f"{a.peak_bytes / result.budget_bytes:.3f}" for a in result.attempts)
            m_eager = remat.measure(work, inputs, loss_fn, steps=1)
            torch._dynamo.reset()
            e = (
                torch._dynamo.explain(work)(**inputs)
                if isinstance(inputs, dict)
                else torch._dynamo.explain(work)(inputs)
            )
            torch._dynamo.reset()
            compiled = torch.compile(work)
            _call(compiled, inputs)  # compile
            calls = _eager_calls(compiled, inputs)
            params = list(work.parameters())
            times: dict[str, list[float]] = {"eager": [], "compiled": []}
            for r in range(args.rounds + 1):
                order = ("eager", "compiled") if r % 2 else ("compiled", "eager")
                for which in order:
                    ms = _step(work if which == "eager" else compiled, params, inputs, loss_fn)
                    if r:
                        times[which].append(ms)
            te, tc = statistics.median(times["eager"]), statistics.median(times["compiled"])
            print(
                f"| {budget} of {result.plain_peak_bytes / 2**20:.1f} MiB compiled | `{result.plan.describe()}` | {tries} | "
                f"{result.peak_bytes / result.budget_bytes:.3f} | {m_eager.peak_bytes / result.budget_bytes:.3f} | "
                f"{e.graph_break_count} ({plain_breaks}) | {calls} | {te:.1f} | {tc:.1f} | {tc / te:.3f} |"
            )
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
