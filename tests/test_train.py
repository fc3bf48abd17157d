"""Training helpers against the plain model: accumulation, autocast, BatchNorm statistics, dropout.

Every test runs a checkpointed model and an oracle (the same seeded model without remat, or one step
on the whole batch) and compares them; each group also has a test showing the comparison can fail.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import remat
from remat.core.trace import train_step
from remat.errors import RematError
from remat.models import Workload, workload
from remat.plan import Keep, Plan, Recompute
from remat.train import accumulate, autocast_step, split_batch

# Accumulating 4 micro-batches only reorders float32 sums (NOTE [ Accumulated gradients ] in
# remat.train): measured differences are ~2e-8 absolute and ~4e-7 of the largest gradient, i.e. a few
# ulps (float32 eps is 1.2e-7). rtol=1e-5 allows ~100 ulps of reordering per entry and atol=1e-7 covers
# entries that cancel to near zero; a wrong weighting (reduction="sum": 4x) is off by 300%.
RTOL, ATOL = 1e-5, 1e-7

GPT_SIZES: dict[str, Any] = dict(n_layers=4, d_model=32, n_heads=2, seq_len=16, vocab_size=64)


def _nested_plan(model: nn.Module) -> Plan:
    """``R[0:n](R[0:n-1](R[0:1](K0) K1 .. Kn-2) Kn-1)``: three levels; block 0 runs its forward four times."""
    blocks = remat.blocks(model)
    n = len(blocks)
    assert n >= 3, [b.name for b in blocks]
    middle = Recompute(0, n - 1, (Recompute(0, 1, (Keep(0),)), *(Keep(k) for k in range(1, n - 1))))
    plan = Plan(strategy="nested", blocks=blocks, ops=(Recompute(0, n, (middle, Keep(n - 1))),))
    assert plan.depth == 3
    return plan


PLANS: dict[str, Callable[[nn.Module], Plan | remat.Strategy]] = {
    "full": lambda m: remat.full(),
    "nested": _nested_plan,
}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _zero(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _raw_torch_checkpoint(model: nn.Module, **kwargs: Any) -> None:
    """Checkpoint every block of ``model`` with plain ``torch.utils.checkpoint`` (no remat)."""
    for block in remat.blocks(model):
        for fqn in block.fqns:
            module = model.get_submodule(fqn)
            forward = module.forward
            module.forward = lambda *a, _f=forward: torch_checkpoint(_f, *a, use_reentrant=False, **kwargs)  # type: ignore[method-assign]


# --- split_batch ---------------------------------------------------------------------------------


def test_split_batch_keeps_structure_and_concatenates_back() -> None:
    x, m = torch.randn(8, 3), torch.arange(8)
    for batch in (x, (x, m), [x, m], {"x": x, "m": m, "flag": True}):
        pieces = split_batch(batch, 4)
        assert len(pieces) == 4
        assert all(type(p) is type(batch) for p in pieces)
        first = [t for t in tree_leaves(pieces[0]) if isinstance(t, torch.Tensor)]
        assert all(t.size(0) == 2 for t in first)
    xs = split_batch({"x": x, "m": m, "flag": True}, 4)
    assert torch.equal(torch.cat([p["x"] for p in xs]), x)
    assert torch.equal(torch.cat([p["m"] for p in xs]), m)
    assert all(p["flag"] is True for p in xs)


def test_split_batch_errors_name_the_sizes() -> None:
    with pytest.raises(RematError, match=r"batch size 10 is not divisible by n=4; pick n among \[1, 2, 5, 10\]"):
        split_batch(torch.zeros(10, 2), 4)
    with pytest.raises(RematError, match=r"n must be a positive int, got 0"):
        split_batch(torch.zeros(4), 0)
    with pytest.raises(RematError, match=r"tensor 1 of the batch has size 3 in dim 0 but the first tensor has 4"):
        split_batch((torch.zeros(4), torch.zeros(3)), 2)
    with pytest.raises(RematError, match=r"holds no tensor"):
        split_batch({"a": 1}, 2)


# --- accumulation --------------------------------------------------------------------------------


def _mlp_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor, Callable[..., torch.Tensor]]:
    w = workload("mlp", widths=(16, 64, 32, 8), batch=32)
    return w.model, w.inputs, torch.randn(32, 8, generator=torch.Generator().manual_seed(1)), F.mse_loss


def _gpt_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor, Callable[..., torch.Tensor]]:
    # dropout=0: a large batch and its micro-batches would draw different dropout masks.
    w = workload("gpt", **GPT_SIZES, batch=8, dropout=0.0)
    return w.model, w.inputs, torch.randint(64, (8, 16), generator=torch.Generator().manual_seed(1)), _token_loss


CASES = {"mlp": _mlp_case, "gpt": _gpt_case}


def _large_batch_and_accumulated(
    name: str, reduction: str = "mean"
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
    plain, x, y, loss_fn = CASES[name]()
    ckpt = copy.deepcopy(plain)
    remat.apply(ckpt, remat.full())
    big = loss_fn(plain(x), y)
    big.backward()
    acc = accumulate(ckpt, split_batch(x, 4), loss_fn, targets=split_batch(y, 4), reduction=reduction)
    return big.detach(), _grads(plain), acc, _grads(ckpt)


@pytest.mark.parametrize("name", sorted(CASES))
def test_accumulate_four_micro_batches_equals_one_large_batch(name: str) -> None:
    big_loss, big, acc_loss, acc = _large_batch_and_accumulated(name)
    assert big.keys() == acc.keys() and len(big) > 0
    worst = max(float((big[n] - acc[n]).abs().max()) for n in big)
    bad = [n for n in big if not torch.allclose(acc[n], big[n], rtol=RTOL, atol=ATOL)]
    assert not bad, f"{name}: gradients {bad} differ from one large batch (max abs diff {worst:.3g})"
    torch.testing.assert_close(acc_loss, big_loss, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", sorted(CASES))
def test_accumulate_sum_is_four_times_mean_and_fails_the_large_batch_check(name: str) -> None:
    _, big, acc_loss, acc = _large_batch_and_accumulated(name, reduction="sum")
    assert not all(torch.allclose(acc[n], big[n], rtol=RTOL, atol=ATOL) for n in big)
    assert all(torch.allclose(acc[n], 4 * big[n], rtol=RTOL, atol=4 * ATOL) for n in big)


def test_accumulate_with_dropout_is_identical_to_plain_accumulate() -> None:
    w = workload("gpt", **GPT_SIZES, batch=8, dropout=0.1)
    y = torch.randint(64, (8, 16), generator=torch.Generator().manual_seed(1))
    plain, ckpt = w.model, copy.deepcopy(w.model)
    remat.apply(ckpt, _nested_plan(ckpt))
    losses, grads = [], []
    for model in (plain, ckpt):
        torch.manual_seed(7)
        losses.append(accumulate(model, split_batch(w.inputs, 4), _token_loss, targets=split_batch(y, 4)))
        grads.append(_grads(model))
    assert torch.equal(losses[0], losses[1])
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_accumulate_adds_to_existing_gradients() -> None:
    model, x, y, loss_fn = _mlp_case()
    mbs, ts = split_batch(x, 2), split_batch(y, 2)
    accumulate(model, mbs, loss_fn, targets=ts)
    once = _grads(model)
    accumulate(model, mbs, loss_fn, targets=ts)
    # (g1 + g2) + g1 + g2 is 2 (g1 + g2) up to the order of the additions
    assert all(
        p.grad is not None and torch.allclose(p.grad, 2 * once[n], rtol=RTOL, atol=ATOL)
        for n, p in model.named_parameters()
    )


def test_accumulate_errors() -> None:
    model, x, y, loss_fn = _mlp_case()
    with pytest.raises(RematError, match=r"micro-batch sizes \[8, 24\] differ"):
        accumulate(model, [x[:8], x[8:]], loss_fn, targets=[y[:8], y[8:]])
    with pytest.raises(RematError, match=r"unknown reduction 'avg'; valid reductions are 'mean', 'sum'"):
        accumulate(model, [x], loss_fn, targets=[y], reduction="avg")
    with pytest.raises(RematError, match=r"3 targets for 2 micro-batches"):
        accumulate(model, split_batch(x, 2), loss_fn, targets=split_batch(y, 2) + [y])
    with pytest.raises(RematError, match=r"micro_batches is empty"):
        accumulate(model, [], loss_fn)
    with pytest.raises(RematError, match=r"loss_fn returned a tensor of shape \(8, 8\)"):
        accumulate(model, split_batch(x, 4), lambda out: out)
    # unequal sizes are fine when the caller sums
    accumulate(
        model,
        [x[:8], x[8:]],
        lambda out, t: F.mse_loss(out, t, reduction="sum"),
        targets=[y[:8], y[8:]],
        reduction="sum",
    )


# --- autocast ------------------------------------------------------------------------------------


def _autocast_grads(
    model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor], **kwargs: Any
) -> dict[str, torch.Tensor]:
    _zero(model)
    torch.manual_seed(11)
    loss = autocast_step(model, inputs, loss_fn, **kwargs)
    return {"loss": loss, **_grads(model)}


@pytest.fixture
def gpt_dropout() -> Iterator[Workload]:
    yield workload("gpt", **GPT_SIZES, batch=4, dropout=0.1)


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_autocast_bf16_under_a_plan_equals_autocast_without_checkpointing(plan: str, gpt_dropout: Any) -> None:
    w = gpt_dropout
    plain = _autocast_grads(w.model, w.inputs, w.loss_fn)
    applied = remat.apply(w.model, PLANS[plan](w.model))
    assert applied.checkpointed == (0, 1, 2, 3)
    ckpt = _autocast_grads(w.model, w.inputs, w.loss_fn)
    remat.remove(w.model)
    assert plain.keys() == ckpt.keys() and len(plain) > 1
    mismatched = [n for n in plain if not torch.equal(plain[n], ckpt[n])]
    assert not mismatched, f"{plan}: {mismatched}"


def test_autocast_really_casts_so_the_comparison_can_fail(gpt_dropout: Any) -> None:
    w = gpt_dropout
    dtypes: list[torch.dtype] = []

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        dtypes.append(logits.dtype)
        return w.loss_fn(logits)

    remat.apply(w.model, remat.full())
    low = _autocast_grads(w.model, w.inputs, loss_fn)
    assert dtypes == [torch.bfloat16]
    _zero(w.model)
    torch.manual_seed(11)
    full_precision = {"loss": train_step(w.model, w.inputs, w.loss_fn), **_grads(w.model)}
    assert not all(torch.equal(low[n], full_precision[n]) for n in low)


def test_autocast_with_grad_scaler_gives_true_gradients_and_keeps_earlier_ones(gpt_dropout: Any) -> None:
    w = gpt_dropout
    remat.apply(w.model, remat.full())
    unscaled = _autocast_grads(w.model, w.inputs, w.loss_fn)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    scaled = _autocast_grads(w.model, w.inputs, w.loss_fn, scaler=scaler)
    # A power-of-two loss scale commutes with every rounding (no overflow in bf16's range): bitwise equal.
    assert all(torch.equal(unscaled[n], scaled[n]) for n in unscaled)
    assert scaler.get_scale() == 2.0**12  # updated, no overflow, growth_interval not reached
    torch.manual_seed(11)
    autocast_step(w.model, w.inputs, w.loss_fn, scaler=scaler)  # on top of the gradients already there
    assert all(torch.equal(p.grad, 2 * unscaled[n]) for n, p in w.model.named_parameters())


def test_autocast_grad_scaler_backs_off_after_an_overflow(gpt_dropout: Any) -> None:
    w = gpt_dropout
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
    grads = _autocast_grads(w.model, w.inputs, w.loss_fn, scaler=scaler)
    assert scaler.get_scale() == 2.0**126
    assert not all(bool(torch.isfinite(g).all()) for g in grads.values())


def test_autocast_errors(gpt_dropout: Any) -> None:
    w = gpt_dropout
    with pytest.raises(RematError, match=r"does not autocast to torch.float64 on cpu; pass dtype=torch.bfloat16"):
        autocast_step(w.model, w.inputs, w.loss_fn, dtype=torch.float64)
    half = workload("mlp", widths=(4, 8), batch=2, dtype=torch.float16)
    with pytest.raises(RematError, match=r"parameter '0.fc.weight' is float16"):
        autocast_step(half.model, half.inputs, half.loss_fn, scaler=torch.amp.GradScaler("cpu"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_autocast_float16_with_grad_scaler_on_cuda() -> None:
    w = workload("gpt", **GPT_SIZES, batch=4, dropout=0.1, device="cuda")
    plain = _autocast_grads(w.model, w.inputs, w.loss_fn, scaler=torch.amp.GradScaler("cuda"))
    remat.apply(w.model, _nested_plan(w.model))
    ckpt = _autocast_grads(w.model, w.inputs, w.loss_fn, scaler=torch.amp.GradScaler("cuda"))
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], rtol=1e-3, atol=1e-5)


# --- BatchNorm -----------------------------------------------------------------------------------


def _resnet() -> Workload:
    return workload("resnet", layers=(1, 1, 1), width=4, image_size=16, batch=4)


def _bn_stats(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            for buf in ("running_mean", "running_var", "num_batches_tracked"):
                out[f"{name}.{buf}"] = getattr(m, buf).detach().clone()
    return out


def _steps(model: nn.Module, w: Workload, steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(5)
    for _ in range(steps):
        train_step(model, w.inputs, w.loss_fn)
    return _bn_stats(model)


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("plan", sorted(PLANS))
def test_batchnorm_running_stats_end_as_in_the_plain_model(plan: str, steps: int) -> None:
    w = _resnet()
    plain, ckpt = w.model, copy.deepcopy(w.model)
    remat.apply(ckpt, PLANS[plan](ckpt))
    expected, got = _steps(plain, w, steps), _steps(ckpt, w, steps)
    assert len(expected) == 3 * 9  # 9 BatchNorms in this ResNet (stem 1, stages 2 + 3 + 3)
    assert any(
        isinstance(m, nn.BatchNorm2d) for b in remat.blocks(ckpt) for m in ckpt.get_submodule(b.fqns[0]).modules()
    )
    assert all(int(v) == steps for k, v in expected.items() if k.endswith("num_batches_tracked"))
    mismatched = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not mismatched
    grads = _grads(ckpt)
    assert all(torch.equal(g, grads[n]) for n, g in _grads(plain).items())


def test_raw_torch_checkpoint_updates_batchnorm_stats_twice() -> None:
    # What remat fixes: torch's recomputation runs BatchNorm in training mode a second time.
    w = _resnet()
    plain, raw = w.model, copy.deepcopy(w.model)
    _raw_torch_checkpoint(raw)
    expected, got = _steps(plain, w, 1), _steps(raw, w, 1)
    assert [k for k in expected if not torch.equal(expected[k], got[k])]
    inside = tuple(f"{fqn}." for b in remat.blocks(raw) for fqn in b.fqns)
    counts = {k: int(v) for k, v in got.items() if k.endswith("num_batches_tracked")}
    assert counts == {k: 2 if k.startswith(inside) else 1 for k in counts}
    assert any(v == 2 for v in counts.values())


# --- dropout -------------------------------------------------------------------------------------


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_dropout_gradients_are_exactly_the_plain_models(plan: str, gpt_dropout: Any) -> None:
    w = gpt_dropout
    check = remat.check_gradients(w.model, PLANS[plan](w.model), w.inputs, w.loss_fn)
    assert check.exact and check.equal and check.max_abs_diff == 0.0, check.mismatched
    assert check.compared == 1 + len(list(w.model.parameters()))


def test_dropout_without_rng_preservation_differs_so_the_check_can_fail(gpt_dropout: Any) -> None:
    w = gpt_dropout
    plain, raw = w.model, copy.deepcopy(w.model)
    _raw_torch_checkpoint(raw, preserve_rng_state=False)
    grads = []
    for model in (plain, raw):
        torch.manual_seed(3)
        train_step(model, w.inputs, w.loss_fn)
        grads.append(_grads(model))
    assert not all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


class _Keywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.out(torch.tanh(self.emb(input_ids))).flatten(0, 1), labels.flatten())


def test_a_batch_encoding_is_split_and_accumulated_as_its_dict() -> None:
    # What HF tokenizers and collators return: a UserDict, which torch's pytree takes as one leaf.
    from transformers import BatchEncoding

    torch.manual_seed(0)
    ids = torch.randint(0, 16, (4, 6))
    batch = BatchEncoding({"input_ids": ids, "labels": ids.roll(1, 1)})
    pieces = split_batch(batch, 2)
    assert all(isinstance(p, BatchEncoding) and p["input_ids"].shape == (2, 6) for p in pieces)
    grads = []
    for micro in (pieces, split_batch(dict(batch), 2)):
        torch.manual_seed(0)
        model = _Keywords()
        accumulate(model, micro, lambda loss: loss)
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
