"""What the code around a step does between the forward and the backward, and the context the backward
runs in: fast weights and buffers of ``torch.func.functional_call``, parameters replaced or made buffers,
a backward under ``torch.inference_mode()`` or under vmap (``is_grads_batched``). Every plan kind, the
op-level policies too, replays as the plain model computes, or raises a RematError (helper-61)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import Keep, Recompute, RecomputeOps
from remat.models import Workload, workload
from remat.plan.planner import plan_from_ops, variant_costs


def _gpt(dropout: float = 0.0, n_layers: int = 2) -> Workload:
    torch.manual_seed(0)
    return workload(
        "gpt", n_layers=n_layers, d_model=64, n_heads=4, seq_len=64, batch=4, vocab_size=64, dropout=dropout
    )


def _plans(w: Workload) -> dict[str, remat.Plan]:
    prof = remat.profile(copy.deepcopy(w.model), w.inputs, w.loss_fn, repeats=1, progress=False)
    n = len(prof.blocks)
    policies = {k: op for (k, op) in variant_costs(prof, subs=False) if isinstance(op, RecomputeOps)}
    assert policies, "the profile offers op-level policies"
    return {
        "full": plan_from_ops(prof, tuple(Recompute(i, i + 1, (Keep(i),)) for i in range(n)), "full"),
        "segment": plan_from_ops(prof, (Recompute(0, n, tuple(Keep(i) for i in range(n))),), "segment"),
        "policy": plan_from_ops(prof, tuple(policies.get(i, Keep(i)) for i in range(n)), "policy"),
    }


W = _gpt()
PLANS = _plans(W)


def _grads(model: nn.Module, params: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    return [p.grad if p.grad is not None else torch.zeros(()) for p in (params or list(model.parameters()))]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _both(step: Callable[[nn.Module], list[torch.Tensor]], plan: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    plain = step(copy.deepcopy(W.model))
    model = copy.deepcopy(W.model)
    remat.apply(model, PLANS[plan])
    return plain, step(model)


@pytest.mark.parametrize("plan", list(PLANS))
def test_functional_call_fast_weights_and_buffers_are_what_the_replay_uses(plan: str) -> None:
    def step(model: nn.Module) -> list[torch.Tensor]:
        fast = {k: (v.detach() * 1.01).requires_grad_(True) for k, v in model.named_parameters()}
        mask = {"blocks.1.attn.mask": torch.ones_like(dict(model.named_buffers())["blocks.1.attn.mask"])}
        out = torch.func.functional_call(model, {**fast, **mask}, (W.inputs,), strict=False)
        return list(torch.autograd.grad(W.loss_fn(out), list(fast.values())))

    plain, got = _both(step, plan)
    assert _equal(plain, got)


@pytest.mark.parametrize("plan", list(PLANS))
def test_a_parameter_replaced_or_made_a_buffer_before_the_backward(plan: str) -> None:
    def step(model: nn.Module) -> list[torch.Tensor]:
        loss = W.loss_fn(model(W.inputs))
        fc = model.blocks[1].mlp.fc  # type: ignore[index]
        fc.weight = nn.Parameter(fc.weight.detach() * 2)  # a new parameter in the slot
        lin = next(c for c in model.blocks[0].modules() if isinstance(c, nn.Linear))  # type: ignore[index]
        weight = lin.weight
        del lin.weight
        lin.register_buffer("weight", weight.detach() * 3)  # the slot deleted, a buffer in its place
        loss.backward()
        assert "weight" not in lin._parameters and tuple(lin.weight.shape) == tuple(weight.shape)
        return [weight.grad, *_grads(model)]

    plain, got = _both(step, plan)
    assert _equal(plain, got)


@pytest.mark.parametrize("plan", list(PLANS))
def test_a_parameter_edited_in_place_before_the_backward_is_refused(plan: str) -> None:
    model = copy.deepcopy(W.model)
    remat.apply(model, PLANS[plan])
    loss = W.loss_fn(model(W.inputs))
    with torch.no_grad():
        model.blocks[1].mlp.fc.bias.add_(1.0)  # type: ignore[index]
    with pytest.raises(remat.RematError, match="was changed in place after the forward and before the backward"):
        loss.backward()


def test_a_backward_under_inference_mode_replays_as_the_plain_one_runs() -> None:
    w = _gpt(dropout=0.1, n_layers=4)
    prof = remat.profile(copy.deepcopy(w.model), w.inputs, w.loss_fn, repeats=1, ops=False, progress=False)
    nested = (Recompute(0, 4, (Keep(0), Recompute(1, 3, (Keep(1), Keep(2))), Keep(3))),)
    plans = [plan_from_ops(prof, nested, "nested"), remat.plan(prof, strategy=remat.full())]

    def step(model: nn.Module) -> list[torch.Tensor]:
        torch.manual_seed(1)
        loss = w.loss_fn(model(w.inputs))
        with torch.inference_mode():
            loss.backward()
        return _grads(model)

    plain = step(copy.deepcopy(w.model))
    for plan in plans:
        model = copy.deepcopy(w.model)
        remat.apply(model, plan)
        assert _equal(plain, step(model)), plan.describe()


@pytest.mark.parametrize("plan", ["full", "segment"])
def test_a_batched_backward_through_random_ops_is_a_remat_error(plan: str) -> None:
    w = _gpt(dropout=0.1)
    model = copy.deepcopy(w.model)
    remat.apply(model, PLANS[plan])  # planned on the same architecture without dropout
    loss = w.loss_fn(model(w.inputs))
    params = list(model.parameters())
    with pytest.raises(remat.RematError, match=r"batched backward \(torch.autograd.grad with is_grads_batched=True"):
        torch.autograd.grad(loss, params, torch.ones(2), is_grads_batched=True)


def _compress(t: torch.Tensor) -> tuple[torch.dtype, torch.Tensor]:
    return t.dtype, t.to(torch.bfloat16) if t.is_floating_point() else t  # lossy


def _decompress(packed: tuple[torch.dtype, torch.Tensor]) -> torch.Tensor:
    return packed[1].to(packed[0])


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.clone()  # lossless, like an offload and back


def _step_under(model: nn.Module, hooks: Callable[[], contextlib.AbstractContextManager[object]]) -> list[torch.Tensor]:
    with hooks():
        loss = W.loss_fn(model(W.inputs))
    loss.backward()
    return _grads(model)


@pytest.mark.parametrize("plan", list(PLANS))
def test_a_recomputed_block_under_the_callers_saved_tensor_hooks_is_a_remat_error(plan: str) -> None:
    model = copy.deepcopy(W.model)
    remat.apply(model, PLANS[plan])
    with pytest.raises(remat.RematError, match=r"saved-tensor hooks of the caller's .*allow_saved_tensor_hooks=True"):
        _step_under(model, lambda: torch.autograd.graph.saved_tensors_hooks(_compress, _decompress))


@pytest.mark.parametrize("plan", list(PLANS))
def test_lossless_saved_tensor_hooks_run_with_save_on_cpu_or_when_allowed(plan: str) -> None:
    plain = _step_under(copy.deepcopy(W.model), lambda: torch.autograd.graph.saved_tensors_hooks(_copy, _copy))
    model = copy.deepcopy(W.model)
    remat.apply(model, PLANS[plan])
    assert _equal(plain, _step_under(model, lambda: torch.autograd.graph.save_on_cpu()))
    model.zero_grad(set_to_none=True)
    remat.apply(model, PLANS[plan], allow_saved_tensor_hooks=True)
    assert _equal(plain, _step_under(model, lambda: torch.autograd.graph.saved_tensors_hooks(_copy, _copy)))
    # Kept blocks save through the hooks as in the plain model: nothing to refuse.
    remat.apply(model, remat.plan(model, strategy=remat.none()))
    model.zero_grad(set_to_none=True)
    assert _equal(plain, _step_under(model, lambda: torch.autograd.graph.saved_tensors_hooks(_copy, _copy)))


D = 16


class LazyScale(nn.Module):
    """A statistic in a buffer slot that holds None until the first forward fills it, then an EMA."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.register_buffer("scale", None)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(h))
        m = h.detach().abs().mean(0) + 1
        self.scale = m if self.scale is None else 0.5 * self.scale + 0.25 * m
        return h * self.scale


class RegisteredScale(nn.Module):
    """The same statistic registered as a buffer inside the first forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(h))
        m = h.detach().abs().mean(0) + 1
        if "scale" not in self._buffers:
            self.register_buffer("scale", m)
        else:
            self.scale = 0.5 * self.scale + 0.25 * m
        return h * self.scale


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.register_buffer("s", torch.full((D,), 2.0))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(h)) * self.s


class Stack(nn.Module):
    def __init__(self, kind: type[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([kind() for _ in range(3)])
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).sum()


def _made_a_parameter(model: nn.Module) -> None:
    block = model.blocks[1]  # type: ignore[index]
    value = block._buffers.pop("s")
    block.s = nn.Parameter(value * 3)


@pytest.mark.parametrize(
    ("kind", "between"),
    [(LazyScale, None), (RegisteredScale, None), (Scaled, _made_a_parameter)],
    ids=["buffer slot None at the call", "buffer registered in the forward", "buffer made a parameter"],
)
def test_a_replay_finds_the_buffer_slots_as_they_were_at_the_call(
    kind: type[nn.Module], between: Callable[[nn.Module], None] | None
) -> None:
    def step(model: nn.Module) -> list[torch.Tensor]:
        loss = model(torch.randn(8, D, generator=torch.Generator().manual_seed(1)))
        if between is not None:
            between(model)
        loss.backward()
        return [p.grad for n, p in model.named_parameters() if n != "blocks.1.s"] + list(model.buffers())

    torch.manual_seed(0)
    plain = Stack(kind)
    applied = copy.deepcopy(plain)
    remat.apply(applied, remat.full())
    assert _equal(step(plain), step(applied))


def test_a_forward_where_saved_tensor_hooks_are_disabled_is_a_remat_error() -> None:
    model = copy.deepcopy(W.model)
    remat.apply(model, PLANS["full"])
    with (
        pytest.raises(remat.RematError, match=r"saved-tensor hooks are disabled \(.*'no hooks here'\)"),
        torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"),
    ):
        model(W.inputs)


def test_parameters_on_the_meta_device_between_calls_are_no_edit() -> None:
    import accelerate  # installed with peft (the dev extra)

    def step(applied: bool) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        model = Stack(Scaled)
        accelerate.cpu_offload(model, execution_device=torch.device("cpu"))  # weights on meta between calls
        if applied:
            remat.apply(model, remat.full())
        x = torch.randn(8, D, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        loss = model(x)
        loss.backward()
        assert x.grad is not None
        return loss.detach(), x.grad

    plain, got = step(False), step(True)  # a raw NotImplementedError (aten::equal on meta) before
    assert torch.equal(plain[0], got[0]) and torch.equal(plain[1], got[1])


def test_a_compiled_applied_model_traced_under_lossy_hooks_is_a_remat_error() -> None:
    torch._dynamo.reset()
    model = copy.deepcopy(W.model)
    remat.apply(model, remat.full())
    compiled = torch.compile(model, backend="eager")
    with (
        pytest.raises(remat.RematError, match="saved-tensor hooks of the caller's"),
        torch.autograd.graph.saved_tensors_hooks(_compress, _decompress),
    ):
        compiled(W.inputs)
    torch._dynamo.reset()


class Jagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_nested:
            x = torch.cat(x.unbind(), 0)
        h = torch.tanh(self.fc(x))
        return torch.nested.as_nested_tensor([h[:4], h[4:]], layout=torch.jagged)


class JaggedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Jagged() for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return torch.cat(x.unbind(), 0)


def test_a_segment_over_jagged_nested_tensors_says_so() -> None:
    torch.manual_seed(0)
    model = JaggedStack()
    blocks = remat.blocks(model)
    remat.apply(model, remat.plan(blocks, strategy=remat.segments(2)))  # R[0:2](K0 K1): two blocks in one segment
    loss = model(torch.randn(8, D)).pow(2).mean()
    with pytest.raises(remat.RematError, match="a jagged nested tensor, whose ragged size is a new symbol"):
        loss.backward()
