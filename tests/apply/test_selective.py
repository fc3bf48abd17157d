"""remat.core.selective: every menu policy gives the plain model's gradients bitwise, and holds what the menu says."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.blocks import resolve
from remat.core.ops import Keep, Recompute, RecomputeOps
from remat.core.selective import run_selective
from remat.core.trace import record_memory
from remat.errors import RematError
from remat.models import Workload, workload
from remat.plan.policies import OpPolicy, make_policy, policy_menu, validate_policy
from remat.plan.types import Plan
from remat.profile.ops import BlockOps, profile_ops


@contextlib.contextmanager
def selective(model: nn.Module, saves: Sequence[frozenset[str] | None]) -> Iterator[None]:
    """Run block ``i`` of ``model`` through run_selective with ``saves[i]`` (``None``: plain)."""
    members = [m[0] for m in resolve(model, remat.blocks(model))]
    patched = []
    for module, save in zip(members, saves):
        if save is None:
            continue
        forward = module.forward

        def wrapped(
            *args: Any, forward: Callable[..., Any] = forward, save: frozenset[str] = save, **kwargs: Any
        ) -> Any:
            return run_selective(forward, args, kwargs, save)

        module.forward = wrapped  # type: ignore[method-assign]
        patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def step_grads(
    model: nn.Module, x: Any, loss_fn: Callable[[Any], torch.Tensor], seed: int = 0
) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_fn(model(x))
    loss.backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    out["loss"] = loss.detach().clone()
    model.zero_grad(set_to_none=True)
    return out


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"gradients differ: {bad[:5]}"


def menus(w: Workload) -> tuple[tuple[BlockOps, ...], list[tuple[OpPolicy, ...]]]:
    ops = profile_ops(w.model, w.inputs, w.loss_fn, remat.blocks(w.model), rounds=1)
    return ops, [policy_menu(b) for b in ops]


def small_gpt() -> Workload:
    return workload("gpt", n_layers=2, d_model=64, n_heads=2, seq_len=32, batch=2, vocab_size=128, dropout=0.1)


def test_every_menu_policy_of_the_gpt_gives_the_plain_gradients() -> None:
    w = small_gpt()
    ops, per_block = menus(w)
    assert all(len(m) >= 3 for m in per_block)
    plain = step_grads(w.model, w.inputs, w.loss_fn)
    n = len(ops)
    for i, menu in enumerate(per_block):
        for policy in (*menu, make_policy(ops[i], ())):  # and caching nothing: plain checkpointing
            saves: list[frozenset[str] | None] = [None] * n
            saves[i] = frozenset(policy.save)
            with selective(w.model, saves):
                assert_bitwise_equal(step_grads(w.model, w.inputs, w.loss_fn), plain)
    # Every block under a policy at once, the k-th option of each.
    for k in range(min(len(m) for m in per_block)):
        with selective(w.model, [frozenset(m[k].save) for m in per_block]):
            assert_bitwise_equal(step_grads(w.model, w.inputs, w.loss_fn), plain)


class ConvBlock(nn.Module):
    """A ResNet basic block: conv, BatchNorm, in-place ReLU, conv, BatchNorm, residual, ReLU."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))))


def conv_net() -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(ConvBlock(8), ConvBlock(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    x = torch.randn(4, 8, 12, 12)
    target = torch.randint(0, 3, (4,))
    return Workload("conv", model, x, lambda out: nn.functional.cross_entropy(out, target), "ConvNet")


def test_every_menu_policy_of_a_batchnorm_conv_block_gives_the_plain_gradients() -> None:
    w = conv_net()
    ops, per_block = menus(w)
    assert [len(m) for m in per_block] and all(len(m) >= 1 for m in per_block)
    reference = copy.deepcopy(w.model)  # BatchNorm statistics move with every step: start each from the same
    plain = step_grads(copy.deepcopy(reference), w.inputs, w.loss_fn)
    for i, menu in enumerate(per_block):
        for policy in (*menu, make_policy(ops[i], ())):
            model = copy.deepcopy(reference)
            saves: list[frozenset[str] | None] = [None, None]
            saves[i] = frozenset(policy.save)
            with selective(model, saves):
                assert_bitwise_equal(step_grads(model, w.inputs, w.loss_fn), plain)


def test_torch_refuses_a_cached_output_that_a_later_op_mutates() -> None:
    # The rule validate_policy enforces is torch's: the in-place ReLU changes BatchNorm's output.
    w = conv_net()
    ops, _ = menus(w)
    bn = next(op.key for op in ops[0].ops if "batch_norm" in op.name and op.out_bytes > 0)
    with pytest.raises(RematError, match=f"cached op '{bn}' .* mutated in place"):
        validate_policy(ops[0], make_policy(ops[0], [bn]))
    with selective(w.model, [frozenset({bn}), None]), pytest.raises(RuntimeError, match="mutated"):
        step_grads(w.model, w.inputs, w.loss_fn)


def test_held_bytes_between_forward_and_backward_are_the_predicted_ones() -> None:
    w = workload("gpt", n_layers=2, d_model=128, n_heads=4, seq_len=128, batch=4, vocab_size=128, dropout=0.1)
    ops = profile_ops(w.model, w.inputs, w.loss_fn, remat.blocks(w.model), rounds=1)
    block = resolve(w.model, remat.blocks(w.model))[1][0]
    x = torch.randn(4, 128, 128, requires_grad=True)

    def held(save: frozenset[str] | None) -> int:
        """Bytes the block's forward leaves allocated, its output excluded (CPU: the profiler's allocations)."""
        kept: list[torch.Tensor] = []

        def forward() -> None:
            kept.append(block(x) if save is None else run_selective(block, (x,), {}, save))

        level = record_memory(forward, torch.device("cpu")).level_bytes[-1]
        return level - kept[0].untyped_storage().nbytes()

    b = ops[1]
    # Kept plain, the block holds what autograd saves of its own storages (its input is x's).
    assert held(None) == pytest.approx(b.own_saved_bytes, rel=0.01)
    base = held(frozenset())  # caching nothing still holds the checkpoint's RNG state
    assert base < 16 * 1024
    menu = policy_menu(b)
    assert len(menu) >= 4 and menu[-1].held_bytes < b.own_saved_bytes / 4
    for policy in menu:
        assert held(frozenset(policy.save)) - base == pytest.approx(policy.held_bytes, rel=0.02), policy.describe()


def test_keyword_arguments_reach_the_block_even_with_checkpoint_names() -> None:
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)

    def fn(x: torch.Tensor, *, debug: float, context_fn: float) -> torch.Tensor:
        return torch.tanh(lin(x)) * debug + context_fn

    out = run_selective(fn, (x,), {"debug": 2.0, "context_fn": 1.0}, frozenset({"addmm#0"}))
    assert torch.equal(out, fn(x, debug=2.0, context_fn=1.0))
    out.sum().backward()
    assert x.grad is not None


def test_a_policy_for_ops_that_do_not_run_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    with caplog.at_level("WARNING", logger="remat.core.selective"):
        run_selective(lambda x: torch.tanh(lin(x)), (x,), {}, frozenset({"addmm#0", "tanh#0"}))
    assert not caplog.records
    with caplog.at_level("WARNING", logger="remat.core.selective"):
        run_selective(lambda x: torch.tanh(lin(x)), (x,), {}, frozenset({"addmm#1", "gelu#0", "tanh#0"}))
    assert "cached ops addmm#1, gelu#0 did not run in this forward" in caplog.text


def test_a_policy_on_a_block_that_updates_buffers_is_refused_before_the_backward() -> None:
    # BatchNorm's running statistics: the policy's recomputation would update them a second time.
    from remat.core.ops import Keep, RecomputeOps
    from remat.plan.types import Plan

    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)), nn.Linear(8, 1))
    blocks = remat.blocks(model)
    plan = Plan(strategy="by hand", blocks=tuple(blocks), ops=(RecomputeOps(0, ()), Keep(1)))
    remat.apply(model, plan)
    with pytest.raises(remat.RematError, match=r"updates buffer\(s\) \['1.num_batches_tracked'.*op-level policy"):
        model(torch.randn(4, 8))
    bn = model[0][1]
    assert isinstance(bn, nn.BatchNorm1d) and int(bn.num_batches_tracked) == 1  # updated once, as plainly


class _OwnGenerator(nn.Module):
    """Draws its mask from a generator of its own, which torch's selective checkpoint does not restore."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.generator = torch.Generator().manual_seed(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) * torch.bernoulli(torch.full_like(x, 0.5), generator=self.generator)


def test_a_block_with_its_own_generator_gets_no_policy_and_a_forced_one_is_refused() -> None:
    from remat.core.ops import Keep, RecomputeOps
    from remat.plan.types import Plan
    from remat.profile.ops import EXTERNAL

    torch.manual_seed(0)
    model = nn.Sequential(_OwnGenerator(), _OwnGenerator(), nn.Linear(8, 1))
    x = torch.randn(16, 8)
    before = model[0].generator.get_state()
    prof = remat.profile(model, x, lambda y: y.sum(), repeats=1)
    assert torch.equal(model[0].generator.get_state(), before)  # the profile puts it back too
    # Its bernoulli writes state the block did not allocate, so the profile offers no policy for it
    # (no selective timing), and the optimal plan never keeps it under one.
    assert all(any(EXTERNAL in op.writes for op in ops.ops if op.name == "bernoulli") for ops in prof.block_ops[:2])
    assert [b.selective_ms for b in prof.block_profiles[:2]] == [None, None]
    assert all(not isinstance(op, RecomputeOps) for op in remat.plan(prof, "1GiB").ops)
    assert [b.generator_state_bytes for b in prof.block_profiles] == [5056, 5056]  # a CPU generator state
    # A policy forced by hand: refused on its first forward, with the generator put back.
    plan = Plan(strategy="by hand", blocks=prof.blocks, ops=(RecomputeOps(0, ()), Keep(1)))
    remat.apply(model, plan)
    state = model[0].generator.get_state()
    with pytest.raises(RematError, match="generator of its own.*op-level policy"):
        model(x)
    assert torch.equal(model[0].generator.get_state(), state)


class _DropMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(32, 64), nn.Dropout(0.1), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(torch.nn.functional.gelu(self.fc1(x))))


def _policy_model() -> nn.Module:
    from remat.core.ops import Keep, RecomputeOps
    from remat.plan.types import Plan

    torch.manual_seed(0)
    model = nn.Sequential(_DropMLP(), _DropMLP(), nn.Linear(32, 1))
    ops = (RecomputeOps(0, save=("gelu#0",), recompute=("addmm#0",)), Keep(1))
    remat.apply(model, Plan(strategy="by hand", blocks=tuple(remat.blocks(model)), ops=ops))
    return model


@pytest.mark.parametrize("how", ["retain_graph", "create_graph"])
def test_a_second_backward_through_a_policy_block_is_a_remat_error(how: str) -> None:
    # torch's selective checkpoint consumes its cache in the first backward; the plain model (and a
    # whole-block plan) runs both of these steps.
    model = _policy_model()
    loss = model(torch.randn(16, 32)).square().mean()
    with pytest.raises(RematError, match=r"'0' runs under an op-level policy.*one backward only.*ops=False"):
        if how == "retain_graph":
            loss.backward(retain_graph=True)
            loss.backward()
        else:
            grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
            (loss + sum(g.square().sum() for g in grads)).backward()


@pytest.mark.parametrize("flip", ["eval", "requires_grad"])
def test_a_mode_changed_between_forward_and_backward_of_a_policy_block_is_a_remat_error(flip: str) -> None:
    model = _policy_model()
    loss = model(torch.randn(16, 32)).square().mean()
    if flip == "eval":
        model.eval()
    else:
        model[0].fc2.bias.requires_grad_(False)
    with pytest.raises(RematError, match=r"'0' runs under an op-level policy.*changed since its forward"):
        loss.backward()


class _StateInDict(nn.Module):
    """Reads its state from a dict argument and writes its new state back into it (an RNN context)."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.fc, self.key = nn.Linear(16, 16), key

    def forward(self, x: torch.Tensor, ctx: dict[str, torch.Tensor]) -> torch.Tensor:
        y = x + torch.tanh(self.fc(x)) * torch.sigmoid(ctx[self.key])
        ctx[self.key] = y
        return y


class _DictNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_StateInDict(f"k{i}") for i in range(2))

    def forward(self, x: torch.Tensor, s0: torch.Tensor) -> torch.Tensor:
        ctx = {f"k{i}": s0 for i in range(2)}
        for b in self.blocks:
            x = b(x, ctx=ctx)
        return x


def test_a_policy_recomputes_with_the_arguments_of_the_call_not_the_containers_changed_since() -> None:
    # torch's selective checkpoint calls the forward again on the dict it was given, which the block
    # had updated: sigmoid recomputed from the new state, gradients off by up to 128, silently.
    from remat.core.ops import Keep, RecomputeOps
    from remat.plan.types import Plan

    torch.manual_seed(0)
    model = _DictNet()
    x, s0 = torch.randn(8, 16), torch.randn(8, 16, requires_grad=True)

    def grads() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        s0.grad = None
        model(x, s0).square().sum().backward()
        return [p.grad.clone() for p in model.parameters()] + [s0.grad.clone()]

    plain = grads()
    ops = (Keep(0), RecomputeOps(1, save=("addmm#0",), recompute=("sigmoid#0", "tanh#0")))
    remat.apply(model, Plan(strategy="by hand", blocks=tuple(remat.blocks(model)), ops=ops))
    got = grads()
    assert all(torch.equal(a, b) for a, b in zip(plain, got))

    # An object argument changed between the call and the backward: refused.
    class Ctx:
        def __init__(self, state: torch.Tensor) -> None:
            self.state = state

        def __getitem__(self, key: str) -> torch.Tensor:
            return self.state

        def __setitem__(self, key: str, value: torch.Tensor) -> None:
            pass

    ctx = Ctx(torch.randn(8, 16, requires_grad=True))
    loss = model.blocks[1](x, ctx=ctx).square().sum()
    ctx.state = torch.zeros(8, 16)
    with pytest.raises(RematError, match=r"argument of module 'blocks.1' \(Ctx\), which runs under an op-level"):
        loss.backward()
    remat.remove(model)


class _TanhFirst(nn.Module):
    """``x + fc2(gelu(fc1(tanh(x))))``: tanh saves its output, the add nothing, so ``x`` is not saved."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(torch.tanh(x))))


class _Autocast(nn.Module):
    """``x + fc2(gelu(fc1(x)).float())`` with fc1 and GELU under bfloat16 autocast: its first op is a cast,
    so it does not save its input either."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.nn.functional.gelu(self.fc1(x))
        return x + self.fc2(h.float())


def _chain_of(layer: type[nn.Module]) -> Any:
    # The plain step frees each block's input after it; a policy's checkpoint holds it.
    from ..zoo.models import Stack, _mse_case, seeded

    return seeded(lambda: _mse_case(Stack([layer() for _ in range(6)]), 256, 32))()


@pytest.mark.parametrize("model", ["chain", "tanh_chain", "autocast_chain"])
def test_a_plan_of_policies_measures_what_it_predicts(model: str) -> None:
    # Every block under the policy of its menu that frees the most: the checkpoint's RNG state (5 KiB a
    # block) and the inputs it holds that the plain step frees, to the end of the block's backward, are
    # charged by op_costs, so the measured peak is not above the prediction (1.041x, 1.319x and 1.29x
    # before). A recomputation is charged its block's forward peak above the pending gradients (split
    # BERT's attention policy peaked 14 KB above its prediction there); under autocast that peak counts
    # casts the recomputation's early stop leaves out: 0.94-0.95 of the prediction, on the safe side.
    from remat.core.ops import RecomputeOps
    from remat.plan.planner import plan_from_ops, variant_costs

    from ..zoo.models import ZOO

    case = ZOO["chain"]() if model == "chain" else _chain_of(_TanhFirst if model == "tanh_chain" else _Autocast)
    prof = remat.profile(case.model, case.inputs, case.loss_fn, repeats=1)
    best: dict[int, tuple[int, RecomputeOps]] = {}
    for (k, op), (freed, *_) in variant_costs(prof, subs=False).items():
        if isinstance(op, RecomputeOps) and freed > best.get(k, (-1, op))[0]:
            best[k] = (freed, op)
    assert sorted(best) == list(range(len(prof.blocks)))
    plan = plan_from_ops(prof, tuple(op for _, (_, op) in sorted(best.items())), "every block under a policy")
    remat.apply(case.model, plan)
    measured = remat.measure(case.model, case.inputs, case.loss_fn, steps=1).peak_bytes
    remat.remove(case.model)
    assert plan.predicted_peak_bytes is not None
    low = 0.94 if model == "autocast_chain" else 0.97
    assert low <= measured / plan.predicted_peak_bytes <= 1.005, (plan.describe(), measured, plan.predicted_peak_bytes)


@pytest.mark.parametrize("model", ["tanh_chain", "autocast_chain"])
def test_plans_on_blocks_that_do_not_save_their_input_hold_their_prediction(model: str) -> None:
    # The plain step frees such a block's input right after it, but its backward peak was measured with
    # the input still there, and a checkpoint starting at it holds the input through its replay and
    # backward: both are charged (Chain.freed_input_bytes), so no plan measures above its prediction
    # (up to 1.04x the budget and 36 KB above the prediction before).
    case = _chain_of(_TanhFirst if model == "tanh_chain" else _Autocast)
    prof = remat.profile(case.model, case.inputs, case.loss_fn, repeats=1)
    assert any(b.gap_bytes < 0 for b in prof.block_profiles)
    checked = 0
    for share in (50, 55, 60, 65, 70, 75, 80):
        for solver in ("optimal", "knapsack"):
            try:
                plan = remat.plan(prof, f"{share}%", solver=solver)
            except remat.BudgetInfeasibleError:
                continue
            remat.apply(case.model, plan)
            measured = remat.measure(case.model, case.inputs, case.loss_fn, steps=1).peak_bytes
            remat.remove(case.model)
            assert plan.predicted_peak_bytes is not None and plan.budget_bytes is not None
            assert measured <= plan.budget_bytes, (share, plan.describe(), measured, plan.budget_bytes)
            # Never above the prediction; below it by at most 10%: a replay runs above the gradients pending
            # at its block's backward and the input the checkpoint holds, which overlap on these blocks
            # (knapsack at 65% on the autocast chain: 0.922; left on the safe side). A nested plan whose inner
            # segment starts at the same block counts that input twice (README, known limits): 15%
            # (R[0:2](R[0:1](K0) K1) at 55% on the autocast chain, 0.868, chosen when its timings say so).
            nested = any(
                isinstance(op, Recompute) and any(isinstance(i, Recompute) for i in op.inner) for op in plan.ops
            )
            low = 0.85 if nested else 0.90
            assert low * plan.predicted_peak_bytes <= measured <= plan.predicted_peak_bytes, (
                share,
                plan.describe(),
                measured,
                plan.predicted_peak_bytes,
            )
            checked += 1
    assert checked >= 6


class _EditsInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x).mul_(2.0))  # addmm#0's output, edited by mul_#0


def test_a_policy_caching_an_op_edited_in_place_later_is_a_remat_error_and_an_in_place_op_is_refused() -> None:
    # Plans from remat.plan never do either; hand-written ones reached torch's raw errors.
    from remat.core.ops import Keep, RecomputeOps
    from remat.plan.types import Plan

    torch.manual_seed(0)
    model = nn.Sequential(_EditsInPlace(), _EditsInPlace())
    x = torch.randn(4, 16)
    blocks = tuple(remat.blocks(model))
    cached = Plan(strategy="by hand", blocks=blocks, ops=(RecomputeOps(0, save=("addmm#0",)), Keep(1)))
    m = copy.deepcopy(model)
    remat.apply(m, cached)
    with pytest.raises(RematError, match="edits in place, which torch's selective checkpoint refuses"):
        m(x).sum().backward()
    in_place = Plan(strategy="by hand", blocks=blocks, ops=(RecomputeOps(0, save=("mul_#0",)), Keep(1)))
    with pytest.raises(RematError, match=r"caches the in-place op\(s\) \['mul_#0'\]"):
        remat.apply(copy.deepcopy(model), in_place)


def test_a_policy_block_under_a_torch_func_transform_is_refused_clearly() -> None:
    model = _policy_model()
    x = torch.randn(8, 32)
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(model, p, (x,)).square().mean()

    with pytest.raises(RematError, match="runs under a torch.func transform"):
        torch.func.grad(loss)(params)


class _CountingBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        count.add_(1)  # a step counter passed in: the policy's recomputation would add again
        return torch.tanh(self.fc(x)) + count.sum() * 0.01


class _CountingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_CountingBlock() for _ in range(2)])

    def forward(self, x: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, count)
        return x


def test_a_policy_on_a_block_that_edits_its_tensor_argument_is_refused_on_the_call() -> None:
    torch.manual_seed(0)
    model = _CountingNet()
    plan = Plan(strategy="hand", blocks=remat.blocks(model), ops=(RecomputeOps(0, ("addmm#0",)), Keep(1)))
    remat.apply(model, plan)
    count = torch.zeros(3)
    with pytest.raises(RematError, match=r"edits its tensor argument #1 in place, so an op-level policy"):
        model(torch.randn(8, 16), count)
    assert count.tolist() == [1.0, 1.0, 1.0]  # the call ran once, as the plain model's
