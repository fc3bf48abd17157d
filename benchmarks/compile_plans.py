"""torch.compile over planned models: peaks against the budget, compiled against eager step times.

For the built-in GPT and a Llama built from config, at each budget: plan with ``solver="compile"``
(NOTE [ Under torch.compile ] in ``remat/core/runtime.py``), then measure in one interleaved run the
plain model eager and compiled and the planned model eager and compiled: exact peaks (torch profiler
memory events), median step times, the graph breaks dynamo reports and the calls that reach remat's
eager runtime from the compiled model.

    python benchmarks/compile_plans.py [--rounds 7] [--budgets 60%,50%,40%]
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


def _llama() -> tuple[str, nn.Module, Any, Callable[[Any], torch.Tensor]]:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 512, (4, 256))
    return (
        "llama 6x(d=128), 4x256 tokens",
        model,
        {"input_ids": ids, "labels": ids, "use_cache": False},
        (lambda out: out.loss),
    )


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
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; rounds {args.rounds}")
    for make in (_gpt, _llama):
        name, model, inputs, loss_fn = make()
        prof = remat.profile(model, inputs, loss_fn, progress=False, ops=False)
        print(f"\n### {name}: plain peak {prof.peak_bytes / 2**20:.1f} MiB\n")
        print("| budget | plan | eager peak / budget | compiled peak / budget | graph breaks (plain) | eager calls "
              "| eager ms | compiled ms | compiled / eager |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|")
        torch._dynamo.reset()
        plain_breaks = torch._dynamo.explain(model)(**inputs) if isinstance(inputs, dict) else None
        plain_breaks_n = (
            plain_breaks.graph_break_count if plain_breaks else torch._dynamo.explain(model)(inputs).graph_break_count
        )
        for budget in args.budgets.split(","):
            plan = remat.plan(prof, budget, solver="compile")
            eager = copy.deepcopy(model)
            remat.apply(eager, plan)
            torch._dynamo.reset()
            e = (
                torch._dynamo.explain(eager)(**inputs)
                if isinstance(inputs, dict)
                else torch._dynamo.explain(eager)(inputs)
            )
            torch._dynamo.reset()
            compiled = torch.compile(eager)
            _call(compiled, inputs)  # compile
            calls = _eager_calls(compiled, inputs)
            m_eager = remat.measure(eager, inputs, loss_fn, steps=1)
            m_comp = remat.measure(compiled, inputs, loss_fn, steps=1, blocks=())
            params = list(eager.parameters())
            times: dict[str, list[float]] = {"eager": [], "compiled": []}
            for r in range(args.rounds + 1):
                order = ("eager", "compiled") if r % 2 else ("compiled", "eager")
                for which in order:
                    ms = _step(eager if which == "eager" else compiled, params, inputs, loss_fn)
                    if r:
                        times[which].append(ms)
            te, tc = statistics.median(times["eager"]), statistics.median(times["compiled"])
            assert plan.budget_bytes is not None
            print(
                f"| {budget} | `{plan.describe()}` | {m_eager.peak_bytes / plan.budget_bytes:.3f} | "
                f"{m_comp.peak_bytes / plan.budget_bytes:.3f} | {e.graph_break_count} ({plain_breaks_n}) | {calls} | "
                f"{te:.1f} | {tc:.1f} | {tc / te:.3f} |"
            )
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
