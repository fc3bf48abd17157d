"""Tests for fix_inplace_strategies.patch: fixed strategies on split blocks never recompute an in-place
activation alone or at a segment's start (NOTE [ Strategies and in-place blocks ] in remat.plan.strategies)."""

import copy

import pytest
import torch
from torch import nn

import remat
from remat.core.ops import Recompute


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.ReLU(inplace=True),
        nn.Linear(32, 32),
        nn.SiLU(inplace=True),
        nn.Dropout(0.1),
        nn.Linear(32, 32),
        nn.ReLU(inplace=True),
        nn.Linear(32, 4),
    )


def _cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 4),
    )


CASES = {"mlp": (_mlp, (8, 16)), "cnn": (_cnn, (2, 3, 8, 8))}
STRATEGIES = [remat.full(), remat.sqrt(), remat.segments(3), remat.every_nth(2)]


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum()


def _step(model: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    _loss(model(x)).backward()
    return [p.grad.clone() for p in model.parameters()], {k: v.clone() for k, v in model.state_dict().items()}


def _same(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True)) and all(
        torch.equal(a[1][k], b[1][k]) for k in a[1]
    )


def _no_inplace_start(model: nn.Module, plan: remat.Plan) -> bool:
    starts = [op.start for op in plan.ops if isinstance(op, Recompute)]
    return not any(getattr(model.get_submodule(plan.blocks[i].fqns[0]), "inplace", False) for i in starts)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.label)
@pytest.mark.parametrize("source", ["model", "profile"])
def test_fixed_strategies_on_split_inplace_blocks_run_and_are_exact(case: str, strategy, source: str) -> None:
    make, shape = CASES[case]
    torch.manual_seed(2)
    x = torch.randn(*shape)
    reference = _step(make(), x)
    model = make()
    blocks = remat.blocks(model, split=True)
    if source == "profile":
        prof = remat.profile(copy.deepcopy(model), (x,), _loss, blocks=blocks, progress=False, ops=False)
        plan = remat.apply(model, remat.plan(prof, strategy=strategy))
    else:
        plan = remat.apply(model, strategy, blocks=blocks)
    assert _no_inplace_start(model, plan), plan.ops
    assert plan.checkpointed, plan.ops
    assert _same(reference, _step(model, x)), plan.describe()


def test_full_checkpoints_an_inplace_activation_with_the_block_before_it() -> None:
    model = _mlp()
    plan = remat.apply(model, remat.full(), blocks=remat.blocks(model, split=True))
    # Every block is still recomputed: the ReLU / SiLU join the Linear before them.
    assert plan.ops[0] == Recompute(0, 2, plan.ops[0].inner) and plan.ops[1] == Recompute(2, 4, plan.ops[1].inner)
    assert sorted(plan.checkpointed) == list(range(8))


def test_a_plan_on_bare_blocks_starting_at_an_inplace_block_is_refused_up_front() -> None:
    model = _mlp()
    plan = remat.plan(remat.blocks(model, split=True), strategy=remat.full())  # no model: nothing tells
    with pytest.raises(remat.RematError, match=r"block 1 .*ReLU\(inplace=True\)"):
        remat.apply(model, plan)
    assert remat.applied(model) is None


def test_selective_refuses_an_inplace_block_instead_of_changing_the_choice() -> None:
    model = _mlp()
    with pytest.raises(remat.RematError, match="block 1 .*edits its tensor argument in place"):
        remat.apply(model, remat.selective([0, 1]), blocks=remat.blocks(model, split=True))


def test_checkpointed_sequential_moves_a_cut_after_an_inplace_child() -> None:
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Linear(16, 16), nn.ReLU(inplace=True))]
    x = torch.randn(8, 16)
    reference = _step(nn.Sequential(*copy.deepcopy(layers)), x)
    model = remat.CheckpointedSequential(*copy.deepcopy(layers), segments=3)  # cuts before 3 and 6: ReLUs
    plan = remat.applied(model)
    assert plan is not None and plan == remat.plan(model, strategy=remat.segments(3))
    assert _no_inplace_start(model, plan), plan.ops
    assert _same(reference, _step(model, x))
