"""How long the rotor solver takes on synthetic chains of 25 to 200 blocks.

Each chain is random but shaped like a profile (block inputs of a few MiB, saved activations of
a few tens of MiB, peaks above the level rise). The budget is halfway between the lowest peak
(:func:`remat.plan.solver.min_peak`) and the peak of keeping everything. The knapsack solver
(``nested=False``) runs on the same chain and budget for comparison.

    python benchmarks/solver_speed.py
    python benchmarks/solver_speed.py --blocks 50 400 --repeats 3 --slots 500
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from remat.core.ops import Keep, Op, Recompute
from remat.plan import solver
from remat.plan.chain import Chain

MIB = 1 << 20


def synthetic_chain(blocks: int, seed: int) -> Chain:
    """A random chain of ``blocks`` blocks with profile-like sizes (bytes) and times (ms)."""
    rng = np.random.default_rng(seed)
    n = blocks
    keep = rng.integers(8 * MIB, 48 * MIB, n + 1)
    keep[-1] = 0
    return Chain(
        fwd_ms=tuple(float(v) for v in rng.uniform(0.5, 3.0, n + 1)),
        bwd_ms=tuple(float(v) for v in rng.uniform(1.0, 6.0, n + 1)),
        x_bytes=tuple(int(v) for v in rng.integers(1 * MIB, 4 * MIB, n + 1)),
        keep_bytes=tuple(int(v) for v in keep),
        fwd_peak_bytes=tuple(int(v) for v in keep + rng.integers(0, 16 * MIB, n + 1)),
        bwd_peak_bytes=tuple(int(v) for v in rng.integers(4 * MIB, 64 * MIB, n + 1)),
        base_bytes=int(rng.integers(64 * MIB, 256 * MIB)),
    )


def depth(ops: tuple[Op, ...]) -> int:
    """Nesting depth of a plan: 0 keeps everything, 1 checkpoints without nesting."""
    return max((1 + depth(op.inner) for op in ops if isinstance(op, Recompute)), default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[25, 50, 100, 200], help="chain lengths")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per chain (the median is shown)")
    parser.add_argument("--slots", type=int, default=None, help="memory units (default: the solver's choice)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random chains")
    args = parser.parse_args()

    print(f"{'blocks':>6} {'slots':>6} {'median s':>9} {'depth':>5} {'extra %':>8} {'knapsack extra %':>17}")
    seconds_at: dict[int, float] = {}
    for blocks in args.blocks:
        chain = synthetic_chain(blocks, args.seed + blocks)
        keep_all = solver.simulate(chain, tuple(Keep(k) for k in range(blocks))).peak_bytes
        headroom = (keep_all + solver.min_peak(chain)) // 2 - chain.base_bytes
        slots = args.slots if args.slots is not None else solver._auto_slots(blocks)
        times = []
        plan: tuple[Op, ...] | None = None
        for _ in range(args.repeats):
            start = time.perf_counter()
            plan = solver.solve(chain, headroom, slots=args.slots)
            times.append(time.perf_counter() - start)
        flat = solver.solve(chain, headroom, nested=False, slots=args.slots)
        if plan is None or flat is None:
            print(f"{blocks:>6} {slots:>6} {'no plan fits':>9}")
            continue
        once_ms = sum(chain.fwd_ms) + sum(chain.bwd_ms)
        extra = 100 * solver.simulate(chain, plan).extra_ms / once_ms
        flat_extra = 100 * solver.simulate(chain, flat).extra_ms / once_ms
        seconds_at[blocks] = statistics.median(times)
        print(f"{blocks:>6} {slots:>6} {seconds_at[blocks]:>9.3f} {depth(plan):>5} {extra:>8.1f} {flat_extra:>17.1f}")

    if 200 in seconds_at:
        verdict = "under" if seconds_at[200] < 2.0 else "NOT under"
        print(f"200 blocks: {seconds_at[200]:.2f} s, {verdict} the 2 s target (on this machine).")
    print("extra %: recomputation time of the chosen plan over one plain step; budget halfway between")
    print("the lowest peak and keeping everything.")


if __name__ == "__main__":
    main()
