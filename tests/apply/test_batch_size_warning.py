"""A plan from a profile is for the profiled batch (NOTE [ Batches larger than the profiled one ] in
``remat.core.runtime``): a block that takes more input bytes than there warns once per applied plan, and
the measured peak of that step is above the plan's budget (the oracle that the warning is warranted)."""

from __future__ import annotations

import copy
import io
import json
import pickle
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

import remat
from remat.errors import RematError, RematWarning
from remat.models import Workload, workload
from remat.plan.planner import plan_from_ops
from remat.plan.types import Plan, ops_from_text
from remat.profile import Profile
from remat.units import format_bytes

# Block 0 recomputed by remat's runtime (its role checks), block 0 kept with a sub-module recomputed and
# block 0 kept (remat runs no call of it: a forward pre-hook checks).
PLANS = (
    "R[0:1](K0) R[1:2](K1) R[2:3](K2) R[3:4](K3)",
    "S0{blocks.0.mlp} S1{blocks.1.mlp} K2 K3",
    "K0 R[1:3](K1 K2) K3",
)


def gpt(seq_len: int = 16, batch: int = 2) -> Workload:
    return workload("gpt", n_layers=4, d_model=32, n_heads=2, seq_len=seq_len, batch=batch, vocab_size=64, dropout=0.1)


@pytest.fixture(scope="module")
def prof() -> Profile:
    w = gpt()
    return remat.profile(w.model, w.inputs, w.loss_fn, repeats=1, progress=False)


def plan_of(prof: Profile, text: str) -> Plan:
    ops = ops_from_text(text)
    predicted = plan_from_ops(prof, ops, "fixed").predicted_peak_bytes
    return plan_from_ops(prof, ops, "fixed", predicted)  # the budget: the plan's predicted peak


@contextmanager
def caught() -> Iterator[list[str]]:
    """The messages of the RematWarnings raised inside, every one (no deduplication by location)."""
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        got: list[str] = []
        yield got
    got.extend(str(w.message) for w in found if issubclass(w.category, RematWarning))


def steps(model: torch.nn.Module, w: Workload, n: int = 2) -> None:
    for _ in range(n):
        model.zero_grad(set_to_none=True)
        w.loss_fn(model(w.inputs)).backward()


@pytest.mark.parametrize("text", PLANS)
def test_a_longer_sequence_warns_once_and_peaks_above_the_budget(prof: Profile, text: str) -> None:
    plan = plan_of(prof, text)
    assert plan.input_bytes is not None and plan.budget_bytes is not None
    for w in (gpt(), gpt(batch=1), gpt(seq_len=8)):  # the profiled batch, and smaller ones: quiet
        with caught() as got:
            remat.apply(w.model, plan)
            steps(w.model, w)
        assert got == []
    longer = gpt(seq_len=32)
    with caught():
        check = remat.check_gradients(longer.model, plan, longer.inputs, longer.loss_fn)
    assert check.equal and check.exact, check.mismatched  # the gradients stay exact: only the budget fails
    with caught() as got:
        remat.apply(longer.model, plan)
        peak = remat.measure(longer.model, longer.inputs, longer.loss_fn, steps=1).peak_bytes
        steps(longer.model, longer)
    assert peak > 1.05 * plan.budget_bytes, (peak, plan.budget_bytes)  # the warning is warranted
    assert len(got) == 1, got
    assert "module 'blocks.0' (block 0 of the plan fixed)" in got[0]
    assert "re-profile and re-plan on the largest batch you train with" in got[0]
    # Both sizes: the profiled one, and what block 0 takes here (read by a hook on the plain model).
    taken: list[int] = []
    plain = gpt(seq_len=32).model
    plain.get_submodule("blocks.0").register_forward_pre_hook(lambda _m, args: taken.append(args[0].nbytes))
    plain(longer.inputs)
    assert f"takes {format_bytes(taken[0])} of tensor inputs" in got[0]
    assert f"more than the {format_bytes(plan.input_bytes[0])} it took" in got[0]


def _deepcopy(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def _pickle(model: torch.nn.Module) -> torch.nn.Module:
    return pickle.loads(pickle.dumps(model))


def _torch_save(model: torch.nn.Module) -> torch.nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("text", PLANS[:2])
@pytest.mark.parametrize("copied", [_deepcopy, _pickle, _torch_save], ids=["deepcopy", "pickle", "torch_save"])
def test_the_check_travels_with_copies(
    prof: Profile, text: str, copied: Callable[[torch.nn.Module], torch.nn.Module]
) -> None:
    plan = plan_of(prof, text)
    short, longer = gpt(), gpt(seq_len=32)  # the model of the longer one takes both
    model = longer.model
    plain = copy.deepcopy(model)
    with caught() as got:
        remat.apply(model, plan)
        steps(model, short)
    assert got == []
    twin = copied(model)  # copied before any warning: warns on its own, once
    with caught() as got:
        steps(twin, longer)
    assert len(got) == 1, got
    warned = copied(twin)  # copied after its warning: stays quiet
    with caught() as got:
        steps(warned, longer)
    assert got == []
    # The copies still run the plan, bitwise as the plain model.
    for m in (plain, twin, warned):
        torch.manual_seed(1)
        steps(m, longer, n=1)
    for m in (twin, warned):
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), m.parameters()))
    assert remat.remove(twin) is not None
    assert all(not m._forward_pre_hooks for m in twin.modules())


def test_the_plan_json_keeps_the_input_bytes_and_an_old_file_loads(prof: Profile) -> None:
    plan = plan_of(prof, PLANS[1])
    again = Plan.from_json(plan.to_json())
    assert again.input_bytes == plan.input_bytes == tuple(bp.input_bytes for bp in prof.block_profiles)
    assert again == plan
    data = json.loads(plan.to_json())
    del data["input_bytes"]  # a plan file written before plans recorded it
    old = Plan.from_json(json.dumps(data))
    assert old.input_bytes is None
    longer = gpt(seq_len=32)
    with caught() as got:
        remat.apply(longer.model, old)
        steps(longer.model, longer)
    assert got == []  # nothing to compare with: no warning
    with caught() as got:
        remat.apply(longer.model, again)
        steps(longer.model, longer)
    assert len(got) == 1
    data["input_bytes"] = [1, 2]
    with pytest.raises(RematError, match=r"field 'input_bytes' has 2 entries, expected one per block \(4\)"):
        Plan.from_json(json.dumps(data))


def test_a_strategy_without_a_profile_has_no_size_and_profiling_an_applied_model_is_quiet(prof: Profile) -> None:
    longer = gpt(seq_len=32)
    with caught() as got:
        remat.apply(longer.model, remat.full())  # planned on the model: nothing measured, nothing to compare
        steps(longer.model, longer)
    assert got == []
    plan = plan_of(prof, PLANS[1])
    with caught() as got:
        remat.apply(longer.model, plan)
        # Profiling the applied model on the longer batch runs it plain: quiet, and the plan's check stays.
        remat.profile(longer.model, longer.inputs, longer.loss_fn, repeats=1, progress=False, ops=False)
    assert got == []
    with caught() as got:
        steps(longer.model, longer)
    assert len(got) == 1
    remat.remove(longer.model)
    assert all(not m._forward_pre_hooks for m in longer.model.modules())


def test_no_grad_forwards_of_a_longer_batch_are_quiet(prof: Profile) -> None:
    plan = plan_of(prof, PLANS[0])
    longer = gpt(seq_len=32)
    remat.apply(longer.model, plan)
    with caught() as got:
        with torch.no_grad():
            longer.model(longer.inputs)  # inference holds no activations for a backward: no budget to exceed
    assert got == []
    with caught() as got:
        steps(longer.model, longer, n=1)
    assert len(got) == 1


class _Layer(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor, table: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return x + torch.tanh(self.fc(x) + table) * (1.0 if scale is None else scale)


class _Rotary(torch.nn.Module):
    """Layers that each take a slice of a large buffer (a rotary cache): the profile does not count it."""

    def __init__(self, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer(d) for _ in range(n))
        self.register_buffer("table", torch.randn(4096, d))

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, table=self.table[: x.shape[1]], scale=scale)
        return x


@pytest.mark.parametrize("text", ["R[0:1](K0) R[1:2](K1) R[2:3](K2) R[3:4](K3)", "K0 R[1:3](K1 K2) K3"])
def test_a_buffer_passed_to_every_layer_and_a_scalar_are_no_larger_batch(text: str) -> None:
    torch.manual_seed(0)
    model = _Rotary()
    x = torch.randn(4, 8, 16)
    prof = remat.profile(model, x, lambda out: out.square().mean(), repeats=1, progress=False, ops=False)
    plan = plan_from_ops(prof, ops_from_text(text), "fixed")
    assert plan.input_bytes == (x.nbytes,) * 4  # the buffer's 256 KiB storage is left out
    with caught() as got:
        remat.apply(model, plan)
        for _ in range(3):
            model(x).square().mean().backward()
        model(torch.randn(2, 8, 16)).square().mean().backward()
        # A scalar tensor the profiled call did not take (the HF Trainer's num_items_in_batch): within the slack.
        model(x, scale=torch.tensor(0.5)).square().mean().backward()
    assert got == []  # the buffer's storage, far above the profiled bytes, is no input of the batch
    longer = torch.randn(4, 12, 16)
    with caught() as got:
        for _ in range(2):
            model(longer).square().mean().backward()
    assert len(got) == 1, got
    assert f"takes {format_bytes(longer.nbytes)} of tensor inputs, more than the {format_bytes(x.nbytes)}" in got[0]
