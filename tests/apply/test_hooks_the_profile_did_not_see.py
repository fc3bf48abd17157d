"""Forward hooks the plan's profile did not see (NOTE [ Hooks the profile did not see ] in remat/core/runtime.py):
global hooks, hooks registered between remat.profile and remat.apply, and hooks on sub-modules of a planned
block. One that saves tensors for the backward peaked at 1.06-1.66x the plan's budget on the built-in GPT and a
Llama, gradients exact, silently (helper-127); now the planned model warns once (remat.RematWarning). A global
hook, or one registered before apply, that returns other tensors where a segment's next member takes them is
refused as NOTE [ Hooks added after apply ] refuses a hook registered after apply. Hooks that save nothing new,
and hooks the profile saw, stay quiet."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_globals

import remat
from tests.apply.residual_net import ResidualNet, squared_loss


def _gated(out: torch.Tensor) -> torch.Tensor:
    return out * torch.sigmoid(out)  # saves the sigmoid, a new tensor, for the backward


Add = Callable[[ResidualNet], list[Any]]


def _on_layers(fn: Callable[[torch.Tensor], torch.Tensor]) -> Add:
    return lambda m: [layer.register_forward_hook(lambda _m, _a, out: fn(out)) for layer in m.layers]


def _on_fc2(fn: Callable[[torch.Tensor], torch.Tensor]) -> Add:  # sub-modules of the planned layers
    return lambda m: [
        m.get_submodule(f"layers.{i}.fc2").register_forward_hook(lambda _m, _a, out: fn(out))
        for i in range(len(m.layers))
    ]


def _global(fn: Callable[[torch.Tensor], torch.Tensor]) -> Add:
    def add(m: ResidualNet) -> list[Any]:
        layers = {id(layer) for layer in m.layers}

        def hook(mod: nn.Module, _args: Any, out: torch.Tensor) -> Any:
            return fn(out) if id(mod) in layers else None

        return [module_globals.register_module_forward_hook(hook)]

    return add


def _plan(model: ResidualNet, x: torch.Tensor, strategy: remat.Strategy) -> remat.Plan:
    prof = remat.profile(model, x, squared_loss, repeats=1, ops=False, progress=False)
    return remat.plan(prof, strategy=strategy)


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    squared_loss(model(x)).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _run(model: ResidualNet, plain: ResidualNet, x: torch.Tensor) -> tuple[int, list[str]]:
    """Gradients bitwise equal to the plain model's with the same hooks; the measured peak and the warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert all(torch.equal(a, b) for a, b in zip(_grads(model, x), _grads(plain, x), strict=True))
        peak = remat.measure(model, x, squared_loss, steps=1, progress=False).peak_bytes
        model(x)
    return peak, [str(w.message) for w in caught if issubclass(w.category, remat.RematWarning)]


# Layers 0, 2, 4 recomputed alone, 1, 3, 5 kept (the hooks' saves on kept layers last to the backward).
_KEPT_HALF = remat.selective([0, 2, 4])


@pytest.mark.parametrize(
    ("when", "add"),
    [
        ("after apply, global", _global(_gated)),
        ("between profile and apply, on the layers", _on_layers(_gated)),
        ("after apply, on sub-modules", _on_fc2(_gated)),
        ("between profile and apply, on sub-modules", _on_fc2(_gated)),
    ],
)
def test_a_hook_saving_tensors_the_profile_did_not_see_warns_once(when: str, add: Add) -> None:
    torch.manual_seed(0)
    model, x = ResidualNet(), torch.randn(512, 8)
    plain = copy.deepcopy(model)
    plan = _plan(model, x, _KEPT_HALF)
    assert plan.predicted_peak_bytes is not None
    handles = add(model) if when.startswith("between") else []
    remat.apply(model, plan)
    handles += [] if when.startswith("between") else add(model)
    handles += add(plain)
    try:
        peak, warned = _run(model, plain, x)
    finally:
        for h in handles:
            h.remove()
    # The oracle: the step really peaks above the plan's prediction, so the warning is due.
    assert peak > plan.predicted_peak_bytes * 1.05, (when, peak, plan.predicted_peak_bytes)
    assert len(warned) == 1, (when, warned)
    assert "registered after the plan's profile" in warned[0] and "register the hook before remat.profile" in warned[0]


def test_hooks_the_profile_saw_or_that_save_nothing_new_are_quiet_and_remove_puts_hooks_back() -> None:
    torch.manual_seed(0)
    model, x = ResidualNet(), torch.randn(512, 8)
    quiet: dict[str, Add] = {
        "none": lambda m: [],
        "logging, global": lambda m: [module_globals.register_module_forward_hook(lambda _m, _a, _o: None)],
        "a product with a number, on the layers": _on_layers(lambda o: o * 0.5),
        "returning the output, on sub-modules": _on_fc2(lambda o: o),
    }
    plan = _plan(copy.deepcopy(model), x, _KEPT_HALF)
    assert plan.predicted_peak_bytes is not None
    for name, add in quiet.items():
        planned, plain = copy.deepcopy(model), copy.deepcopy(model)
        remat.apply(planned, plan)
        handles = add(planned) + add(plain)
        before = dict(module_globals._global_forward_hooks)
        try:
            peak, warned = _run(planned, plain, x)
            assert warned == [], (name, warned)
            assert peak <= plan.predicted_peak_bytes * 1.05, (name, peak, plan.predicted_peak_bytes)
            remat.remove(planned)
            assert module_globals._global_forward_hooks == before  # the user's hook objects, unwrapped
            assert all(
                type(h).__module__ != "remat.core.runtime" for m in planned.modules() for h in m._forward_hooks.values()
            )
        finally:
            for h in handles:
                h.remove()
    # A saving hook registered before the profile is the plan's: quiet, within the prediction.
    planned, plain = copy.deepcopy(model), copy.deepcopy(model)
    handles = _on_layers(_gated)(planned) + _on_layers(_gated)(plain)
    plan = _plan(planned, x, _KEPT_HALF)
    assert plan.predicted_peak_bytes is not None
    remat.apply(planned, plan)
    peak, warned = _run(planned, plain, x)
    assert warned == [] and peak <= plan.predicted_peak_bytes * 1.05, (warned, peak, plan.predicted_peak_bytes)
    # The same hook on the sub-modules, registered after apply, is one the profile did not see: one warning.
    handles += _on_fc2(_gated)(planned) + _on_fc2(_gated)(plain)
    try:
        _, warned = _run(planned, plain, x)
        assert len(warned) == 1 and ".fc2'" in warned[0], warned
        assert _run(planned, plain, x)[1] == []  # once per applied plan
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("when", ["global, after apply", "on the layer, between profile and apply"])
def test_a_hook_returning_another_tensor_at_a_link_is_refused_or_fits(when: str) -> None:
    # segments(3): R[0:2] R[2:4] R[4:6]: layers.2's output is layers.3's input inside one segment (a link).
    torch.manual_seed(0)
    model, x = ResidualNet(), torch.randn(512, 8)
    plan = _plan(model, x, remat.segments(3))
    assert plan.predicted_peak_bytes is not None
    target = model.layers[2]
    if when.startswith("global"):
        remat.apply(model, plan)

        def halve(m: nn.Module, _args: Any, out: torch.Tensor) -> Any:
            return out * 0.5 if m is target else None

        handle = module_globals.register_module_forward_hook(halve)
    else:
        handle = target.register_forward_hook(lambda _m, _a, out: out * 0.5)
        remat.apply(model, plan)
    try:
        try:
            peak = remat.measure(model, x, squared_loss, steps=1, progress=False).peak_bytes
        except remat.RematError as e:  # refused in the forward, naming the module
            assert "'layers.2'" in str(e) and "register the hook before remat.profile" in str(e), str(e)
        else:  # or planned with it: the oracle is the prediction
            assert peak <= plan.predicted_peak_bytes * 1.05, (when, peak, plan.predicted_peak_bytes)
    finally:
        handle.remove()


def test_a_global_hook_two_planned_models_ran_is_checked_for_the_other_once_one_is_removed() -> None:
    # The first model to run after the hook was registered wraps it for itself; the second skips it as wrapped.
    # Removing the first puts the hook back: the second must then wrap and count it (it went unchecked before).
    x = torch.randn(16, 8)
    torch.manual_seed(0)
    first = ResidualNet()
    second = copy.deepcopy(first)
    for model in (first, second):
        remat.apply(model, _plan(model, x, _KEPT_HALF))
    layers = {id(layer) for model in (first, second) for layer in model.layers}
    handle = module_globals.register_module_forward_hook(
        lambda mod, _args, out: _gated(out) if id(mod) in layers else None
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", remat.RematWarning)
            for model in (first, second):
                _grads(model, x)
        remat.remove(first)
        with pytest.warns(remat.RematWarning, match="registered after the plan's profile"):
            _grads(second, x)
    finally:
        handle.remove()
        remat.remove(second)
