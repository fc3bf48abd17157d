import copy

import pytest
import torch
import torch.nn as nn

import remat


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn(self.conv(x)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.utils.parametrizations.spectral_norm(nn.Conv2d(3, 8, 3, padding=1))
        self.blocks = nn.Sequential(*[_Block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.stem(x)).mean()


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "call",
    [
        lambda m, x: remat.blocks(m),
        lambda m, x: remat.plan(m, strategy=remat.full()),
        lambda m, x: remat.apply(m, remat.full()),
        lambda m, x: remat.profile(m, x, lambda y: y, repeats=1, progress=False),
        lambda m, x: remat.measure(m, x, lambda y: y),
    ],
    ids=["blocks", "plan", "apply", "profile", "measure"],
)
def test_finding_blocks_does_not_run_a_parametrization(call) -> None:
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(4, 3, 8, 8)
    before = _state(model)
    call(model, x)
    after = _state(model)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)  # spectral norm's _u and _v included


def test_spectral_norm_outside_the_blocks_trains_bitwise_after_apply() -> None:
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(4, 3, 8, 8)
    plain, planned = copy.deepcopy(model), copy.deepcopy(model)
    remat.apply(planned, remat.full())
    for m in (plain, planned):
        torch.manual_seed(1)
        for _ in range(2):
            m(x).backward()
    for (name, a), b in zip(plain.named_parameters(), planned.parameters()):
        assert torch.equal(a.grad, b.grad), name
    for (name, a), b in zip(plain.named_buffers(), planned.buffers()):
        assert torch.equal(a, b), name
