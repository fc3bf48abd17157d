"""Does a budget hold in the user's own training loop, with gradients set to None or held and an AdamW step?

For each model and loop style: profile with that loop (``grads=``, ``optimizer=``), plan at 30/50/70% of
the plain peak, apply, and measure the peak of the user's own iteration (``opt.zero_grad()``, forward,
backward, ``opt.step()``; torch profiler events cumulated over the whole iteration, above the level
right after ``zero_grad``). Prints measured / budget and measured / predicted; nothing is asserted.

Run with the environment the Makefile's bench target sets, e.g.::

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=17179869184 MALLOC_TOP_PAD_=0 \\
    OMP_WAIT_POLICY=PASSIVE python benchmarks/budget_loops.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

import remat
from remat.models import Workload, workload

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# The user's own loop and the conv net are the ones the tests pin (tests/measure/test_iteration.py).
from tests.measure.test_iteration import ConvBN, user_loop_peak  # noqa: E402

MIB = 2**20


def bn_conv(n: int = 8, channels: int = 16, size: int = 32, batch: int = 32) -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1),
        *(ConvBN(channels) for _ in range(n)),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(channels, 10),
    )
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
    return Workload(
        "bnconv",
        model,
        x,
        lambda out: nn.functional.cross_entropy(out, y),
        f"conv-BN chain {n}x3 layers, {channels}ch {size}px, batch {batch}",
    )


MODELS = {
    "mlp": lambda: workload("mlp", widths=(256,) + (1024, 384, 768, 256, 1024, 512, 768, 384) * 2, batch=4096),
    "gpt": lambda: workload("gpt"),
    "bnconv": bn_conv,
    "resnet": lambda: workload("resnet", layers=(4, 4, 4, 4)),
}
# ResNet: every BasicBlock is a block (the four stages alone leave no plan below ~80%).
BLOCKS = {"resnet": {"include": "layer?.?"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--shares", nargs="+", type=float, default=[0.3, 0.5, 0.7])
    args = parser.parse_args()
    print(
        f"{'model':>7} {'grads':>5} {'budget':>6} {'MiB':>8} {'measured':>9} {'predicted':>9} {'meas/budget':>11} {'meas/pred':>9}  plan"
    )
    for name in args.models:
        for grads in ("none", "held"):
            w = MODELS[name]()
            opt = torch.optim.AdamW(w.model.parameters())
            blocks = remat.blocks(w.model, **BLOCKS[name]) if name in BLOCKS else None
            prof = remat.profile(w.model, w.inputs, w.loss_fn, blocks=blocks, grads=grads, optimizer=opt)
            plain = user_loop_peak(w, opt, grads)
            print(
                f"{name:>7} {grads:>5} {'plain':>6} {prof.peak_bytes / MIB:>8.1f} {plain / MIB:>9.1f}  ({prof.loop.describe()})"
            )
            for share in args.shares:
                budget = int(share * prof.peak_bytes)
                try:
                    plan = remat.plan(prof, budget)
                except remat.BudgetInfeasibleError as err:
                    print(
                        f"{name:>7} {grads:>5} {share:>6.0%} {budget / MIB:>8.1f}  infeasible: smallest peak {err.min_peak_bytes / MIB:.1f} MiB"
                    )
                    continue
                assert plan.predicted_peak_bytes is not None
                remat.apply(w.model, plan)
                measured = user_loop_peak(w, opt, grads)
                remat.remove(w.model)
                print(
                    f"{name:>7} {grads:>5} {share:>6.0%} {budget / MIB:>8.1f} {measured / MIB:>9.1f} {plan.predicted_peak_bytes / MIB:>9.1f} "
                    f"{measured / budget:>11.3f} {measured / plan.predicted_peak_bytes:>9.3f}  {plan.describe()[:60]}"
                )
        if name == "mlp":
            # The issue this fixes: a plan for held gradients, run in a loop that sets them to None.
            w = MODELS[name]()
            opt = torch.optim.AdamW(w.model.parameters())
            held = remat.profile(w.model, w.inputs, w.loss_fn, grads="held", optimizer=opt)
            plan = remat.plan(held, int(0.3 * held.peak_bytes))
            remat.apply(w.model, plan)
            measured = user_loop_peak(w, opt, "none")
            remat.remove(w.model)
            print(
                f"{name:>7} planned for held gradients at 30%, run with gradients set to None: measured / budget {measured / plan.budget_bytes:.3f}"
            )  # type: ignore[operator]


if __name__ == "__main__":
    main()
