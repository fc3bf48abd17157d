import pytest
import torch
import torch.nn as nn

import remat


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.fc(x)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _step(do_apply: bool, backend: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(8, 32)
    if do_apply:
        remat.apply(model, remat.full())
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    torch.manual_seed(1)
    compiled(x).square().mean().backward()
    return [p.grad for p in model.parameters()], torch.get_rng_state()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_dropout_under_compile_is_bitwise_on_every_backend(backend: str) -> None:
    plain, plain_rng = _step(False, backend)
    planned, planned_rng = _step(True, backend)
    assert all(torch.equal(a, b) for a, b in zip(plain, planned))
    assert torch.equal(plain_rng, planned_rng)


class _RReLULayer(nn.Module):
    """RReLU saves its ``noise`` before the kernel fills it (NOTE [ Ops that fill a saved argument ] in remat.core.runtime)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.act = nn.RReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(x))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_rrelu_compile_plan_under_compile_is_bitwise(backend: str) -> None:
    # A plan of solver="compile" recomputes each block through torch's checkpoint under dynamo, whose eager
    # replay stops before RReLU's kernel fills its noise: traced, the replay is the whole region.
    def step(do_apply: bool) -> list[torch.Tensor | None]:
        torch.manual_seed(0)
        model = nn.Sequential(*[_RReLULayer() for _ in range(3)])
        x = torch.randn(64, 32)
        if do_apply:
            prof = remat.profile(model, x, lambda o: o.square().mean(), repeats=1, progress=False, ops=False)
            plan = remat.plan(prof, strategy=remat.full(), solver="compile")
            assert plan.describe() == "R[0:1](K0) R[1:2](K1) R[2:3](K2)", plan.describe()
            remat.apply(model, plan)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        torch.manual_seed(1)
        compiled(x).square().mean().backward()
        return [p.grad for p in model.parameters()]

    plain, planned = step(False), step(True)
    assert all(a is not None and b is not None and torch.equal(a, b) for a, b in zip(plain, planned))
