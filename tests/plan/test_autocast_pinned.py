"""Under an autocast region inside the model, the bf16 casts of the weights that autocast caches are held by a
segment through the forward only (the region exits before the loss), and a sub-module checkpoint does not free
them there (NOTE [ Pinned through the forward only ] in remat.profile.profiler). Charged as pinned through the
backward, full() was predicted 1.08x its measured peak here (HF Llama/BERT split layers 1.17x); counted as freed
by a sub-module checkpoint, a T5 plan measured 1.066x its budget once the first was fixed."""

import copy

import torch
from torch import nn

import remat
from remat.core.ops import Keep, Recompute
from remat.plan.chain import Chain
from remat.plan.solver import simulate

D, N, L = 128, 64, 6


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(D, D)
        self.mlp = Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x).float()
        return x + self.mlp(x).float()


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(L)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for layer in self.layers:
                x = layer(x)
        return x


def loss_fn(o: torch.Tensor) -> torch.Tensor:
    return (o.float() ** 2).mean()


def _check(model: nn.Module, x: torch.Tensor, plan: remat.Plan, plain: dict[str, torch.Tensor]) -> int:
    m = copy.deepcopy(model)
    m.zero_grad(set_to_none=True)
    remat.apply(m, plan)
    loss_fn(m(x)).backward()
    for n, p in m.named_parameters():
        assert torch.equal(p.grad, plain[n]), n
    m.zero_grad(set_to_none=True)
    return remat.measure(m, x, loss_fn, steps=1, progress=False).peak_bytes


def test_autocast_casts_are_held_through_the_forward_only() -> None:
    torch.manual_seed(0)
    model, x = Model(), torch.randn(N, D)
    loss_fn(model(x)).backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    prof = remat.profile(model, x, loss_fn, repeats=1, progress=False)
    plans = [remat.plan(prof, strategy=s) for s in ("full()", "every_nth(2)")]
    for plan in plans:
        measured = _check(model, x, plan, plain)
        assert abs(measured / plan.predicted_peak_bytes - 1) <= 0.05, (plan.describe(), plan.predicted_peak_bytes)
        if plan.budget_bytes is not None:
            assert measured <= plan.budget_bytes * 1.05


def _t5() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.T5Config(
        num_layers=3,
        num_decoder_layers=3,
        d_model=64,
        d_ff=128,
        num_heads=2,
        d_kv=32,
        decoder_start_token_id=0,
        vocab_size=100,
        use_cache=False,
    )
    t5 = transformers.T5ForConditionalGeneration(cfg).train()
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(3, 99, (2, 64), generator=g), torch.randint(3, 99, (2, 32), generator=g)

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = t5

        def forward(self, i: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.m(input_ids=i, labels=lab).loss.float()

    return Wrapped(), (ids, labels)


def test_t5_split_with_sub_module_checkpoints_under_autocast_stays_within_budget() -> None:
    # The sub-module checkpoints' saved_bytes leave out the casts autocast's cache holds through the forward.
    model, x = _t5()
    loss = lambda o: o  # noqa: E731
    torch.manual_seed(1)  # T5's dropout: the same draws in both runs
    loss(model(*x)).backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    prof = remat.profile(model, x, loss, repeats=1, progress=False, blocks=remat.blocks(model, split=True))
    for budget in ("50%", "60%"):
        plan = remat.plan(prof, budget=budget)
        m = copy.deepcopy(model)
        m.zero_grad(set_to_none=True)
        remat.apply(m, plan)
        torch.manual_seed(1)
        loss(m(*x)).backward()
        for n, p in m.named_parameters():
            assert torch.equal(p.grad, plain[n]), n
        m.zero_grad(set_to_none=True)
        measured = remat.measure(m, x, loss, steps=1, progress=False).peak_bytes
        assert measured <= plan.budget_bytes * 1.05, (budget, measured, plan.budget_bytes)  # 1.066x before
        assert abs(measured / plan.predicted_peak_bytes - 1) <= 0.05, (budget, measured, plan.predicted_peak_bytes)


def test_simulate_drops_forward_only_pins_at_the_head_and_in_replays() -> None:
    n = 2
    base = dict(
        fwd_ms=(1.0,) * 3,
        bwd_ms=(1.0,) * 3,
        x_bytes=(10, 10, 10),
        keep_bytes=(50, 50, 0),
        fwd_peak_bytes=(60, 60, 5),
        bwd_peak_bytes=(20, 20, 0),
        base_bytes=10,
        pre_peak_bytes=0,
        tail_peak_bytes=0,
        pinned_bytes=(40, 40, 0),
    )
    held = Chain(**base)
    fwd_only = Chain(**base, pinned_fwd_bytes=(40, 40, 0))
    plan = (Recompute(0, 1, (Keep(0),)), Recompute(1, 2, (Keep(1),)))
    # The forward peaks as before (the casts are alive to the head), the backward 80 lower at most.
    assert simulate(fwd_only, plan).peak_bytes <= simulate(held, plan).peak_bytes
    nested = (Recompute(0, 2, (Recompute(0, 1, (Keep(0),)), Keep(1))),)
    assert simulate(fwd_only, nested).peak_bytes <= simulate(held, nested).peak_bytes
    assert n == 2
