"""Random-model fuzzer for remat: ``python benchmarks/fuzz.py FIRST N [--out results.jsonl] [--only CELL] [-v]``.

Each seed builds a random model (chain of blocks with random mini-graphs and random parent forward
patterns), computes reference gradients/buffers with a fixed RNG seed, then for several plans
(budgets 90/60/40%/min feasible, full(), sqrt(); whole and split blocks) applies, steps, compares
with torch.equal, measures the peak against the budget and the prediction, removes and checks the
model is back.  Every cell is classified: ok / refused (RematError) / bug:<kind> (exception, grad,
buffers, state, rng, remove, over_budget: measured > budget x 1.05, prediction: measured outside
+-5% of the prediction). One JSON line per cell goes to ``--out``; each seed prints a line of counts.
Written by helper-72 (stop 27), which found with it the over-budget cases fixed that stop;
``tests/test_fuzz_bench.py`` runs a few seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
import traceback

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.errors import BudgetInfeasibleError, RematError

# ----------------------------------------------------------------------------------------------
# random model
# ----------------------------------------------------------------------------------------------

OPS = [
    "linear",
    "conv",
    "ln",
    "bn",
    "act",
    "act_inplace",
    "dropout",
    "softmax",
    "attn",
    "residual",
    "catsplit",
    "view",
    "transpose",
    "slice",
    "scale",
    "fresh_inplace",
]


class FBlock(nn.Module):
    """A block running a random recipe of ops on x of shape (B, T, d)."""

    def __init__(self, d: int, recipe: list, rng: random.Random, ret_aux: bool, take_aux: bool):
        super().__init__()
        self.d = d
        self.recipe = recipe
        self.ret_aux = ret_aux
        self.take_aux = take_aux
        self.mods = nn.ModuleDict()
        for k, (op, arg) in enumerate(recipe):
            name = f"{op}{k}"
            if op == "linear":
                self.mods[name] = nn.Linear(d, d, bias=arg)
            elif op == "conv":
                self.mods[name] = nn.Conv1d(d, d, kernel_size=arg, padding=arg // 2)
            elif op == "ln":
                self.mods[name] = nn.LayerNorm(d)
            elif op == "bn":
                self.mods[name] = nn.BatchNorm1d(d)
            elif op in ("act", "act_inplace"):
                self.mods[name] = {
                    "gelu": nn.GELU(),
                    "relu": nn.ReLU(inplace=op == "act_inplace"),
                    "silu": nn.SiLU(inplace=op == "act_inplace"),
                }[arg]
            elif op == "dropout":
                self.mods[name] = nn.Dropout(arg)
            elif op == "attn":
                self.mods[name + "_qkv"] = nn.Linear(d, 3 * d)
                self.mods[name + "_o"] = nn.Linear(d, d)
                self.mods[name + "_drop"] = nn.Dropout(0.1)
            elif op == "residual":
                self.mods[name + "_ln"] = nn.LayerNorm(d)
                self.mods[name + "_up"] = nn.Linear(d, 2 * d)
                self.mods[name + "_act"] = nn.GELU()
                self.mods[name + "_down"] = nn.Linear(2 * d, d)
            elif op == "catsplit":
                self.mods[name] = nn.Linear(2 * d, d)
            elif op == "scale":
                self.register_parameter(name, nn.Parameter(torch.tensor(1.0 + rng.random())))
            elif op == "fresh_inplace":
                self.mods[name] = nn.Linear(d, d)
        if ret_aux:
            self.aux_head = nn.Linear(d, 1)

    def forward(self, x, mask=None, scale=None, extra=None, aux_in=None):
        B, T, d = x.shape
        if aux_in is not None:
            x = x + aux_in.unsqueeze(-1)
        if scale is not None:
            x = x * scale
        for k, (op, _arg) in enumerate(self.recipe):
            name = f"{op}{k}"
            if op in ("linear", "ln", "act", "act_inplace", "dropout"):
                x = self.mods[name](x)
            elif op == "conv":
                x = self.mods[name](x.transpose(1, 2))[..., :T].transpose(1, 2)
            elif op == "bn":
                x = self.mods[name](x.transpose(1, 2)).transpose(1, 2)
            elif op == "softmax":
                x = torch.softmax(x, dim=-1) * d
            elif op == "attn":
                q, k_, v = self.mods[name + "_qkv"](x).chunk(3, dim=-1)
                s = q @ k_.transpose(-2, -1) / math.sqrt(d)
                if mask is not None:
                    s = s + mask
                p = self.mods[name + "_drop"](torch.softmax(s, dim=-1))
                x = x + self.mods[name + "_o"](p @ v)
            elif op == "residual":
                h = self.mods[name + "_ln"](x)
                x = x + self.mods[name + "_down"](self.mods[name + "_act"](self.mods[name + "_up"](h)))
            elif op == "catsplit":
                a, b = x.split([d // 2, d - d // 2], dim=-1)
                y = torch.cat([b, a, x], dim=-1)
                x = self.mods[name](y)
            elif op == "view":
                x = x.reshape(B, T * d).view(B, T, d)
            elif op == "transpose":
                x = x.transpose(0, 1).contiguous().transpose(0, 1)
            elif op == "slice":
                x = torch.cat([x[:, :, : d // 2] * 2.0, x[:, :, d // 2 :]], dim=-1)
            elif op == "scale":
                x = x * getattr(self, name)
            elif op == "fresh_inplace":
                y = self.mods[name](x)
                y += x
                y.add_(0.5)
                x = y
        if extra is not None:
            x = x + extra
        if self.ret_aux:
            return x, self.aux_head(x).squeeze(-1)
        return x


class Net(nn.Module):
    def __init__(self, cfg: dict, rng: random.Random):
        super().__init__()
        self.cfg = cfg
        d, n = cfg["d"], cfg["n"]
        if cfg["embed"]:
            self.embed = nn.Embedding(cfg["vocab"], d)
        else:
            self.inp = nn.Linear(cfg["in_dim"], d)
        blocks = [FBlock(d, cfg["recipes"][i], rng, cfg["ret_aux"][i], cfg["take_aux"][i]) for i in range(n)]
        if cfg["container"] == "modulelist":
            self.blocks = nn.ModuleList(blocks)
        elif cfg["container"] == "sequential":
            self.blocks = nn.Sequential(*blocks)
        else:
            for i, b in enumerate(blocks):
                setattr(self, f"layer{i}", b)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, cfg["out"])

    def _block(self, i):
        if self.cfg["container"] in ("modulelist", "sequential"):
            return self.blocks[i]
        return getattr(self, f"layer{i}")

    def forward(self, x, mask=None):
        cfg = self.cfg
        h = self.embed(x) if cfg["embed"] else self.inp(x)
        saved = {}
        aux_total = None
        aux_prev = None
        for i in range(cfg["n"]):
            if i in cfg["skip_src"]:
                saved[i] = h
            kw = {}
            if cfg["kw_mask"] and mask is not None:
                kw["mask"] = mask
            if cfg["kw_scale"] is not None:
                kw["scale"] = cfg["kw_scale"]
            if cfg["kw_none"]:
                kw["extra"] = None
            if cfg["take_aux"][i] and aux_prev is not None:
                kw["aux_in"] = aux_prev
            out = self._block(i)(h, **kw)
            if isinstance(out, tuple):
                h, aux = out
                if cfg["aux_to_loss"]:
                    aux_total = aux.mean() if aux_total is None else aux_total + aux.mean()
                aux_prev = aux
            else:
                h = out
            for src, dst in cfg["skips"]:
                if dst == i:
                    h = h + saved[src]
        y = self.head(self.norm(h))
        if aux_total is not None:
            return y, aux_total
        return y


def make_case(seed: int):
    rng = random.Random(seed)
    d = rng.choice([8, 16, 24, 32, 48, 64, 96])
    n = rng.randint(3, 10)
    T = rng.choice([16, 32, 64, 128])
    B = rng.choice([2, 4, 8, 16])
    recipes = []
    for _ in range(n):
        k = rng.randint(1, 6)
        r = []
        for _ in range(k):
            op = rng.choice(OPS)
            arg = None
            if op == "linear":
                arg = rng.random() < 0.8
            elif op == "conv":
                arg = rng.choice([1, 3])
            elif op in ("act", "act_inplace"):
                arg = rng.choice(["gelu", "relu", "silu"]) if op == "act" else rng.choice(["relu", "silu"])
            elif op == "dropout":
                arg = rng.choice([0.1, 0.3, 0.5])
            if op == "act_inplace" and not r:
                # an in-place activation on the block's own input: sometimes keep it (edge case)
                if rng.random() < 0.7:
                    r.append(("linear", True))
            r.append((op, arg))
        recipes.append(r)
    # same recipe for all blocks sometimes (a "transformer-like" repeated stack)
    if rng.random() < 0.4:
        recipes = [list(recipes[0]) for _ in range(n)]
    ret_aux = [rng.random() < 0.2 for _ in range(n)]
    take_aux = [i > 0 and ret_aux[i - 1] and rng.random() < 0.5 for i in range(n)]
    skips = []
    if rng.random() < 0.5:
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(0, n - 1)
            b = rng.randrange(a + 1, n)
            skips.append((a, b))
    cfg = dict(
        d=d,
        n=n,
        T=T,
        B=B,
        recipes=recipes,
        embed=rng.random() < 0.5,
        vocab=rng.choice([11, 50]),
        in_dim=rng.choice([5, 16]),
        container=rng.choice(["modulelist", "sequential", "attrs"]),
        ret_aux=ret_aux,
        take_aux=take_aux,
        aux_to_loss=rng.random() < 0.7,
        skips=skips,
        skip_src=sorted({a for a, _ in skips}),
        kw_mask=rng.random() < 0.4,
        kw_scale=rng.choice([None, None, 0.5, 1.5]),
        kw_none=rng.random() < 0.3,
        out=rng.choice([1, 7]),
        input_grad=rng.random() < 0.3,
        split=rng.random() < 0.4,
        ops=rng.random() < 0.5,
        grads=rng.choice(["none", "none", "held"]),
    )
    torch.manual_seed(seed)
    model = Net(cfg, rng)
    if cfg["embed"]:
        x = torch.randint(0, cfg["vocab"], (B, T))
    else:
        x = torch.randn(B, T, cfg["in_dim"], requires_grad=cfg["input_grad"])
    if cfg["kw_mask"]:
        mask = torch.triu(torch.full((T, T), -1e4), diagonal=1)
        inputs = (x, mask)
    else:
        inputs = (x,)
    target = torch.randn(B, T, cfg["out"])

    def loss_fn(out):
        if isinstance(out, tuple):
            y, aux = out
            return F.mse_loss(y, target) + 0.1 * aux
        return F.mse_loss(out, target)

    return model, inputs, loss_fn, cfg


# ----------------------------------------------------------------------------------------------
# oracle
# ----------------------------------------------------------------------------------------------


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}


def restore(model, snap):
    with torch.no_grad():
        sd = model.state_dict(keep_vars=True)
        for k, v in snap.items():
            sd[k].copy_(v)


def same_state(a, b):
    bad = []
    for k in a:
        if k not in b or a[k].shape != b[k].shape or not torch.equal(a[k], b[k]):
            bad.append(k)
    bad += [k for k in b if k not in a]
    return bad


def step(model, inputs, loss_fn, seed):
    for p in model.parameters():
        p.grad = None
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.grad = None
    torch.manual_seed(seed + 12345)
    out = model(*inputs)
    loss = loss_fn(out)
    loss.backward()
    g = {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    for i, t in enumerate(inputs):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            g[f"<input{i}>"] = t.grad.clone() if t.grad is not None else None
    bufs = {n: b.clone() for n, b in model.named_buffers()}
    return loss.detach().clone(), g, bufs


def fwd(model, inputs, seed):
    torch.manual_seed(seed + 777)
    with torch.no_grad():
        out = model(*inputs)
    return out if isinstance(out, tuple) else (out,)


def diff_grads(ref, got):
    bad = []
    for k, v in ref.items():
        w = got.get(k)
        if (v is None) != (w is None):
            bad.append(f"{k}: None mismatch")
        elif v is not None and not torch.equal(v, w):
            bad.append(f"{k}: maxdiff {(v - w).abs().max().item():.3g}")
    return bad


# ----------------------------------------------------------------------------------------------
# cells
# ----------------------------------------------------------------------------------------------


def run_seed(seed: int, only: str | None = None, verbose=False):
    model, inputs, loss_fn, cfg = make_case(seed)
    model.train()
    results = []
    snap0 = snapshot(model)
    try:
        ref_loss, ref_g, ref_b = step(model, inputs, loss_fn, seed)
    except Exception as e:  # the generator made a model torch itself cannot train (in-place on a saved tensor)
        return [dict(seed=seed, cell="plain", cls="skip", msg=f"plain model fails: {type(e).__name__}: {e}"[:300])]
    # plain repeatability
    restore(model, snap0)
    l2, g2, b2 = step(model, inputs, loss_fn, seed)
    if diff_grads(ref_g, g2) or not torch.equal(ref_loss, l2):
        return [dict(seed=seed, cell="plain", cls="skip", msg="plain model not repeatable")]
    restore(model, snap0)
    ref_fwd = fwd(model, inputs, seed)
    restore(model, snap0)

    def rec(cell, cls, msg="", **kw):
        r = dict(seed=seed, cell=cell, cls=cls, msg=msg[:600], **kw)
        results.append(r)
        if verbose:
            print(r, flush=True)

    block_sets = [("whole", False)]
    if cfg["split"]:
        block_sets.append(("split", True))
    for bname, split in block_sets:
        cellp = f"{bname}/profile"
        if only and not only.startswith(bname):
            continue
        try:
            blks = remat.blocks(model, split=split)
        except RematError as e:
            rec(cellp, "refused", f"blocks: {e}")
            continue
        except Exception as e:
            rec(cellp, "bug:exception", f"blocks: {type(e).__name__}: {e}", tb=traceback.format_exc()[-1500:])
            continue
        restore(model, snap0)
        try:
            torch.manual_seed(seed + 999)
            rng_before = torch.get_rng_state()
            prof = remat.profile(
                model, inputs, loss_fn, blocks=blks, repeats=1, progress=False, ops=cfg["ops"], grads=cfg["grads"]
            )
        except RematError as e:
            rec(cellp, "refused", str(e))
            continue
        except Exception as e:
            rec(cellp, "bug:exception", f"{type(e).__name__}: {e}", tb=traceback.format_exc()[-1500:])
            continue
        bad = same_state(snap0, snapshot(model))
        if bad:
            rec(cellp, "bug:state", f"profile changed state: {bad[:5]}")
            restore(model, snap0)
        elif not torch.equal(rng_before, torch.get_rng_state()):
            rec(cellp, "bug:rng", "profile changed the RNG state")
        else:
            rec(cellp, "ok")
        # plans
        plans = []
        for b in ["90%", "60%", "40%", "min"]:
            plans.append(("budget", b))
        plans.append(("strategy", "full"))
        plans.append(("strategy", "sqrt"))
        for kind, what in plans:
            cell = f"{bname}/{what}"
            if only and cell != only:
                continue
            restore(model, snap0)
            try:
                if kind == "budget":
                    if what == "min":
                        try:
                            pl = remat.plan(prof, budget="1B")
                            rec(cell, "bug:budget", "budget 1 byte accepted")
                            continue
                        except BudgetInfeasibleError as e:
                            pl = remat.plan(prof, budget=e.min_peak_bytes)
                    else:
                        pl = remat.plan(prof, budget=what)
                else:
                    pl = remat.plan(prof, strategy=what)
            except BudgetInfeasibleError as e:
                rec(cell, "refused", f"infeasible: {e}")
                continue
            except RematError as e:
                rec(cell, "refused", f"plan: {e}")
                continue
            except Exception as e:
                rec(cell, "bug:exception", f"plan: {type(e).__name__}: {e}", tb=traceback.format_exc()[-1500:])
                continue
            desc = ""
            try:
                desc = pl.describe()
            except Exception as e:
                rec(cell, "bug:exception", f"describe: {type(e).__name__}: {e}")
            try:
                remat.apply(model, pl)
            except RematError as e:
                rec(cell, "refused", f"apply: {e}", plan=desc)
                restore(model, snap0)
                continue
            except Exception as e:
                rec(
                    cell,
                    "bug:exception",
                    f"apply: {type(e).__name__}: {e}",
                    plan=desc,
                    tb=traceback.format_exc()[-1500:],
                )
                try:
                    remat.remove(model)
                except Exception:
                    pass
                restore(model, snap0)
                continue
            problems = []
            try:
                try:
                    loss, g, bfs = step(model, inputs, loss_fn, seed)
                except RematError as e:
                    rec(cell, "refused", f"step: {e}", plan=desc)
                    continue
                except Exception as e:
                    rec(
                        cell,
                        "bug:exception",
                        f"step: {type(e).__name__}: {e}",
                        plan=desc,
                        tb=traceback.format_exc()[-1500:],
                    )
                    continue
                bad = diff_grads(ref_g, g)
                if bad:
                    rec(cell, "bug:grad", f"{len(bad)} grads differ: {bad[:4]}", plan=desc)
                    continue
                if not torch.equal(loss, ref_loss):
                    rec(cell, "bug:grad", f"loss differs {loss.item()} vs {ref_loss.item()}", plan=desc)
                    continue
                badb = [k for k in ref_b if not torch.equal(ref_b[k], bfs[k])]
                if badb:
                    rec(cell, "bug:buffers", f"buffers differ: {badb[:4]}", plan=desc)
                    continue
                # measure
                restore(model, snap0)
                before = snapshot(model)
                try:
                    m = remat.measure(model, inputs, loss_fn, steps=1, warmup=1, progress=False, grads=cfg["grads"])
                except RematError as e:
                    rec(cell, "refused", f"measure: {e}", plan=desc)
                    continue
                except Exception as e:
                    rec(
                        cell,
                        "bug:exception",
                        f"measure: {type(e).__name__}: {e}",
                        plan=desc,
                        tb=traceback.format_exc()[-1500:],
                    )
                    continue
                bad = same_state(before, snapshot(model))
                if bad:
                    problems.append(("bug:state", f"measure changed state {bad[:4]}"))
                peak = m.peak_bytes
                bud = pl.budget_bytes
                pred = pl.predicted_peak_bytes
                info = dict(peak=peak, budget=bud, pred=pred, plan=desc)
                if bud is not None and peak > bud * 1.05:
                    problems.append(("bug:over_budget", f"peak {peak} > budget {bud} ({peak / bud:.3f})"))
                if pred is not None and pred > 0 and not (0.95 <= peak / pred <= 1.05):
                    problems.append(("bug:prediction", f"peak {peak} vs predicted {pred} ({peak / pred:.3f})"))
            finally:
                try:
                    remat.remove(model)
                except Exception as e:
                    problems.append(("bug:exception", f"remove: {type(e).__name__}: {e}"))
            restore(model, snap0)
            bad = same_state(snap0, snapshot(model))
            if bad:
                problems.append(("bug:remove", f"state after remove {bad[:4]}"))
            out = fwd(model, inputs, seed)
            restore(model, snap0)
            if len(out) != len(ref_fwd) or not all(torch.equal(a, b) for a, b in zip(out, ref_fwd)):
                problems.append(("bug:remove", "forward after remove differs"))
            if problems:
                for c, msg in problems:
                    rec(cell, c, msg, **info)
            else:
                rec(cell, "ok", **info)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first", type=int, nargs="?", default=0, help="first seed")
    parser.add_argument("n", type=int, nargs="?", default=100, help="number of seeds")
    parser.add_argument("--out", default="results.jsonl", help="JSON lines, appended")
    parser.add_argument("--only", default=None, help="run only cells whose name contains this")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with open(args.out, "a") as f:
        for seed in range(args.first, args.first + args.n):
            t0 = time.time()
            try:
                res = run_seed(seed, args.only, args.verbose)
            except Exception as e:  # a seed the harness itself fails on is reported, the run goes on
                res = [
                    dict(
                        seed=seed,
                        cell="seed",
                        cls="bug:exception",
                        msg=f"{type(e).__name__}: {e}",
                        tb=traceback.format_exc()[-1500:],
                    )
                ]
            counts: dict[str, int] = {}
            for r in res:
                counts[r["cls"]] = counts.get(r["cls"], 0) + 1
                f.write(json.dumps(r) + "\n")
            f.flush()
            bugs = [f"{r['cell']}:{r['cls']}:{r['msg'][:150]}" for r in res if r["cls"].startswith("bug")]
            print(f"seed {seed} {time.time() - t0:.1f}s {counts} {bugs}", flush=True)


if __name__ == "__main__":
    main()
