"""A block that did not run: the refusal says whether anything inside it ran (NOTE [ Why a block did not run ])."""

import pytest
import torch
from torch import nn

import remat
from remat.errors import BlockSelectionError


class UnusedStack(nn.Module):
    """Holds a second stack its forward never calls (as reformer-pytorch's irrev_blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2)])
        self.spare = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.used:
            x = b(x)
        return x


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(x)


class MethodCalled(nn.Module):
    """Calls a method of each layer other than forward (as vit-pytorch's hyper-connections)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Mixer() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer.mix(x)
        return x


def _refusal(model: nn.Module, blocks: list[remat.Block] | None = None) -> str:
    with pytest.raises(BlockSelectionError) as info:
        remat.profile(model, torch.randn(4, 8), lambda y: y.pow(2).mean(), blocks=blocks, progress=False)
    return str(info.value)


def test_a_stack_the_forward_never_calls_is_named_as_such() -> None:
    model = UnusedStack()
    assert [b.name for b in remat.blocks(model)][2:] == ["spare.0", "spare.1", "spare.2"]
    msg = _refusal(model)
    assert "'spare.0' did not run" in msg
    assert "neither 'spare.0' nor any module inside it ran" in msg
    assert "nn.Sequential: a model that loops" not in msg  # its layers did not run either


def test_a_block_whose_method_runs_names_the_modules_that_did() -> None:
    model = MethodCalled()
    msg = _refusal(model)
    assert "modules inside 'layers.0' ran ('layers.0.lin')" in msg
    assert "include='layers.0.*'" in msg


def test_blocks_that_ran_profile_as_before() -> None:
    model = UnusedStack()
    blocks = [b for b in remat.blocks(model) if b.name.startswith("used")]
    prof = remat.profile(model, torch.randn(4, 8), lambda y: y.pow(2).mean(), blocks=blocks, progress=False)
    assert [b.name for b in prof.blocks] == ["used.0", "used.1"]
