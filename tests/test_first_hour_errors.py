"""A new user's first mistakes are RematErrors naming the value and the fix (helper-110's first hour).

Each of these was a raw TypeError or a torch RuntimeError from inside the model before: a loss_fn that is
not a function, a batch of another dtype or on another device than the model, and block selectors of
the wrong kind (``types="Block"``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.train import accumulate, split_batch


class Layer(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, d: int = 16, n: int = 4, cast: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.layers = nn.ModuleList(Layer(d) for _ in range(n))
        self.head = nn.Linear(d, 4)
        self.cast = cast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x.float() if self.cast else x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class KwNet(Net):
    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x) * scale


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    return Net()


@pytest.mark.parametrize("bad", [None, "mse", torch.tensor(1.0)])
def test_a_loss_fn_that_is_no_function_is_named(net: Net, bad: object) -> None:
    x = torch.randn(6, 8)
    for call in (
        lambda: remat.profile(net, x, bad, ops=False),  # type: ignore[arg-type]
        lambda: remat.measure(net, x, bad),  # type: ignore[arg-type]
        lambda: remat.check_gradients(net, remat.full(), x, bad),  # type: ignore[arg-type]
        lambda: remat.timeline(net, x, bad),  # type: ignore[arg-type]
    ):
        with pytest.raises(remat.RematError, match=r"loss_fn is .*, not a function; pass one that maps"):
            call()


def test_a_float64_batch_on_a_float32_model_is_named_with_the_fix(net: Net) -> None:
    x = torch.randn(6, 8, dtype=torch.float64)
    with pytest.raises(
        remat.RematError,
        match=r"profile: the model's forward failed on the batch \(RuntimeError: .*\); inputs is torch.float64 but "
        r"the model's parameters are torch.float32; cast the batch \(x.to\(torch.float32\)\)",
    ) as caught:
        remat.profile(net, x, _loss, ops=False)
    assert isinstance(caught.value.__cause__, RuntimeError)  # torch's own error stays chained
    with pytest.raises(remat.RematError, match=r"measure: .*inputs is torch.float64"):
        remat.measure(net, x, _loss)
    with pytest.raises(remat.RematError, match=r"check_gradients: .*inputs is torch.float64"):
        remat.check_gradients(net, remat.full(), x, _loss)
    with pytest.raises(remat.RematError, match=r"accumulate: .*inputs is torch.float64"):
        accumulate(net, split_batch(x, 2), _loss)


def test_the_mismatched_tensor_is_named_by_its_place_in_the_batch() -> None:
    torch.manual_seed(0)
    model = KwNet()
    batch = {"x": torch.randn(6, 8, dtype=torch.float64), "scale": 0.5}
    with pytest.raises(remat.RematError, match=r"inputs\['x'\] is torch.float64"):
        remat.profile(model, batch, _loss, ops=False)


def test_a_batch_on_another_device_is_named_with_the_fix(net: Net) -> None:
    # No second device on a CPU machine: the meta device stands for one (the forward fails the same way).
    x = torch.empty(6, 8, device="meta")
    with pytest.raises(
        remat.RematError, match=r"inputs is on meta but the model's parameters are on cpu; move the batch"
    ):
        remat.profile(net, x, _loss, ops=False)


def test_a_model_that_casts_its_batch_itself_is_not_refused() -> None:
    # The check runs only once the forward failed: a model that casts its input runs as before.
    torch.manual_seed(0)
    model = Net(cast=True)
    x = torch.randn(6, 8, dtype=torch.float64)
    prof = remat.profile(model, x, _loss, ops=False)
    check = remat.check_gradients(model, remat.plan(prof, strategy=remat.full()), x, _loss)
    assert check.equal and check.exact


def test_a_model_failing_for_its_own_reason_propagates_its_error(net: Net) -> None:
    x = torch.randn(6, 7)  # wrong width, right dtype and device: the model's own error, unchanged
    with pytest.raises(RuntimeError, match="cannot be multiplied") as caught:
        remat.profile(net, x, _loss, ops=False)
    assert not isinstance(caught.value, remat.RematError)


def test_block_selectors_of_the_wrong_kind_are_named(net: Net) -> None:
    with pytest.raises(
        remat.BlockSelectionError,
        match=r"types='Layer' is not a module class .*types=nn.TransformerEncoderLayer; to choose by module name, use include=",
    ):
        remat.blocks(net, types="Layer")  # type: ignore[arg-type]
    with pytest.raises(remat.BlockSelectionError, match=r"filter='layers\.\*' is not callable"):
        remat.blocks(net, filter="layers.*")  # type: ignore[arg-type]
    with pytest.raises(remat.BlockSelectionError, match=r"include=3 is not an FQN glob"):
        remat.blocks(net, include=3)  # type: ignore[arg-type]
    # The right kinds still select the layers.
    assert [b.name for b in remat.blocks(net, types=Layer)] == [f"layers.{i}" for i in range(4)]
    assert len(remat.blocks(net, include=["layers.*"], types=(Layer,), filter=lambda m, fqn: True)) == 4


def test_any_iterable_of_globs_still_selects(net: Net) -> None:
    # As before the check: a set or a generator of patterns is taken as it was.
    assert len(remat.blocks(net, include={"layers.*"})) == 4
    assert len(remat.blocks(net, include=(p for p in ["layers.*"]))) == 4
    with pytest.raises(remat.BlockSelectionError, match=r"include=\['layers\.\*', 3\] is not an FQN glob"):
        remat.blocks(net, include=["layers.*", 3])  # type: ignore[list-item]
