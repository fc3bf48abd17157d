"""Tests for fix_frozen_inplace.patch (NOTE [ In-place edits of a member's output ] with node-less outputs)."""

import copy

import pytest
import torch
from torch import nn

import remat


def _vgg(frozen: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(16, 16), nn.ReLU(inplace=True))])
    if frozen:
        for p in model[0].parameters():
            p.requires_grad_(False)
    return model


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(1)
    model(x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("k", [2, 4])  # 3 starts a segment at a ReLU: refused, rightly
def test_an_inplace_activation_after_a_frozen_layer_recomputes_exactly(k: int) -> None:
    # The frozen Linear's output on an input that needs no grad has no autograd node: it counted as not
    # made by the call, and ReLU(inplace=True) after it was refused in every segment (torch's
    # checkpoint_sequential recomputes it exactly).
    x = torch.randn(8, 16)
    reference = _grads(_vgg(), x)
    model = _vgg()
    remat.apply(model, remat.segments(k))
    assert all(torch.equal(a, b) for a, b in zip(reference, _grads(model, x), strict=True))


def test_an_inplace_activation_after_a_frozen_layer_is_planned() -> None:
    x = torch.randn(8, 16)
    reference = _grads(_vgg(), x)
    model = _vgg()
    prof = remat.profile(model, (x,), lambda out: out.pow(2).sum(), progress=False, ops=False)
    assert prof.block_profiles[1].edits_own_link
    with pytest.raises(remat.BudgetInfeasibleError) as info:
        remat.plan(prof, "1KiB")
    plan = remat.plan(prof, info.value.min_peak_bytes)
    planned = copy.deepcopy(model)
    remat.apply(planned, plan)
    assert all(torch.equal(a, b) for a, b in zip(reference, _grads(planned, x), strict=True)), plan.describe()


class _NoGradCached(nn.Module):
    """Returns a tensor it keeps (a plain attribute), with no autograd node, and its input."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = torch.ones(8, 16)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache, h


class _Global(nn.Module):
    """Returns a tensor held where remat cannot see it (a closure), created lazily."""

    def __init__(self) -> None:
        super().__init__()
        box: list[torch.Tensor] = []
        self.get = lambda: box[0] if box else box.append(torch.ones(8, 16)) or box[0]

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get(), h


class _EditsFirst(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, h = pair
        a.add_(1)
        return a * h


@pytest.mark.parametrize("state", [_NoGradCached, _Global])
def test_an_edit_of_a_nodeless_tensor_a_member_returns_from_state_is_refused_not_replayed(state: type) -> None:
    # A node-less output counts as made by the call only if it is none of what the call holds; one held
    # where remat cannot look (a closure) is caught in the replay: it returns the forward's very storage.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), state(), _EditsFirst(), nn.Linear(16, 16))
    x = torch.randn(8, 16, requires_grad=True)
    remat.apply(model, remat.full(), blocks=remat.blocks(model, named=[["0"], ["1", "2", "3"], ["4"]]))
    with pytest.raises(remat.RematError, match=r"edits its tensor argument #0 in place|returned the same tensor"):
        model(x).pow(2).sum().backward()
    if state is _NoGradCached:  # refused in the forward, which puts the argument back
        assert torch.equal(model[2].cache, torch.ones(8, 16))
    else:  # refused in the replay: edited once, by the forward, as the plain model does
        assert torch.equal(model[2].get(), torch.full((8, 16), 2.0))


class _Layer(nn.Module):
    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 16)
        self.fc1.requires_grad_(not frozen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("strategy", [remat.segments(2), remat.segments(4)])  # boundaries at an fc1
def test_split_blocks_with_frozen_first_layers_recompute_exactly(strategy: remat.Strategy) -> None:
    # Fine-tuning with the first layers frozen, split into their children: each frozen layer's fc1 output has
    # no autograd node, so its ReLU(inplace=True) was refused in every segment.
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[_Layer(i < 2) for i in range(4)])

    x = torch.randn(8, 16)
    reference = _grads(make(), x)
    model = make()
    remat.apply(model, strategy, blocks=remat.blocks(model, split=True))
    assert all(torch.equal(a, b) for a, b in zip(reference, _grads(model, x), strict=True))
