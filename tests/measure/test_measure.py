"""remat.measure and remat.check_gradients against oracles that can fail."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.errors import RematError
from remat.measure import Measurement

from ..conftest import Tally


class SinChain(nn.Module):
    """h0 = x * w, then L sin() steps: each sin keeps its input (N floats) for the backward."""

    def __init__(self, n: int, length: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))
        self.length = length

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.w
        for _ in range(self.length):
            h = torch.sin(h)
        return h


def test_peak_matches_the_bytes_autograd_must_hold() -> None:
    n, length = 1 << 16, 10
    size = n * 4
    model = nn.Sequential(SinChain(n, length), SinChain(n, length))
    x = torch.randn(n)
    m = remat.measure(model, x, lambda out: out.sum(), steps=1)
    # Forward keeps h0..h9 of both chains (20 tensors) plus the output; the backward then needs at
    # most a few gradient-sized buffers on top: between 21 and 24 tensors of N floats.
    assert 21 * size <= m.peak_bytes <= 24 * size + 64  # + the scalar loss
    remat.apply(model, remat.full())
    ckpt = remat.measure(model, x, lambda out: out.sum(), steps=1)
    # Checkpointed: one chain's 10 tensors while it is recomputed, plus the chains' inputs and output.
    assert 11 * size <= ckpt.peak_bytes <= 16 * size
    assert ckpt.forward_counts == {"0": 2, "1": 2}
    assert m.step_ms > 0 and len(m.step_ms_all) == 1


def test_measure_leaves_model_as_it_was_and_round_trips() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    x = torch.randn(16, 4)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    m = remat.measure(model, x, lambda y: y.sum(), steps=2)
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert Measurement.from_json(m.to_json()) == m
    with pytest.raises(RematError, match="steps=0 and warmup=1 must both be >= 1"):
        remat.measure(model, x, lambda y: y.sum(), steps=0)


class Drifting(nn.Module):
    """Its output depends on how often it ran: a recomputation sees different values.

    The count is in an object, which remat does not see (a plain int attribute, or a list of them, it
    sets back for a replay).
    """

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.runs = Tally()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs.n += 1
        return torch.tanh(self.lin(x) * self.runs.n)


def test_check_gradients_detects_a_recomputation_that_differs() -> None:
    model = nn.Sequential(Drifting(), Drifting(), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    # torch's own check would raise on mismatched metadata only; values differ silently.
    result = remat.check_gradients(model, remat.selective([0]), x, lambda y: y.sum())
    assert not result.equal and result.exact
    assert "param:0.lin.weight" in result.mismatched and result.max_abs_diff > 0
    assert result.plain_repeatable is False  # its plain steps differ from each other too


class PerStep(nn.Module):
    """Counts its calls in a step (the model resets the count): a replay is a second call and differs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = Tally()  # remat does not see it (a plain int it would set back for a replay)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.n += 1
        return torch.tanh(self.lin(x) * self.calls.n)


class Reseeding(nn.Module):
    """Reseeds the generator at random before its dropout, as HF's Reformer does in training."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.seed()
        return nn.functional.dropout(self.lin(x), 0.5)


def test_check_gradients_tells_a_model_that_differs_from_itself() -> None:
    x = torch.randn(3, 4)
    blocks = nn.Sequential(PerStep(), PerStep())

    class Resets(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = blocks

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                b.calls.n = 0
            return self.blocks(x)

    model = Resets()
    result = remat.check_gradients(model, remat.full(), x, lambda y: y.sum())
    assert not result.equal and result.plain_repeatable is True  # the plan's difference
    model2 = nn.Sequential(Reseeding(), Reseeding())
    rng = torch.get_rng_state()
    try:
        result2 = remat.check_gradients(model2, remat.full(), x, lambda y: y.sum())
    finally:
        torch.set_rng_state(rng)
    assert not result2.equal and result2.plain_repeatable is False  # the model's own
    same = remat.check_gradients(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), remat.full(), x, lambda y: y.sum())
    assert same.equal and same.plain_repeatable is None  # not checked


def test_check_gradients_compares_sparse_gradients() -> None:
    # nn.Embedding(sparse=True) gives sparse gradients, which have no max(): compared dense, and a
    # changed row is still seen.
    class Bag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4, sparse=True)
            self.layers = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.layers(self.embed(ids))

    model, ids = Bag(), torch.tensor([[1, 2, 3], [3, 4, 9]])
    assert model.embed.weight.grad is None
    result = remat.check_gradients(model, remat.full(), ids, lambda y: y.square().sum())
    assert result.equal and result.compared == 6  # the loss and five parameters
    from remat.measure import _compare_grads

    grad = torch.sparse_coo_tensor([[1, 3]], torch.ones(2, 4), (10, 4), check_invariants=True)
    other = torch.sparse_coo_tensor([[1, 4]], torch.ones(2, 4), (10, 4), check_invariants=True)
    assert _compare_grads({"g": grad}, {"g": grad.clone()}, exact=True, atol=0).equal
    changed = _compare_grads({"g": grad}, {"g": other}, exact=True, atol=0)
    assert changed.mismatched == ("g",) and changed.max_abs_diff == 1.0


def test_check_gradients_of_a_stateful_model_with_allow_stateful() -> None:
    from ..zoo.models import ZOO

    case = ZOO["stateful_buffer"]()
    with pytest.raises(RematError, match="allow_stateful=True"):
        remat.check_gradients(case.model, remat.full(), case.inputs, case.loss_fn)
    result = remat.check_gradients(case.model, remat.full(), case.inputs, case.loss_fn, allow_stateful=True)
    assert result.equal and result.exact
