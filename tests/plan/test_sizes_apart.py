"""Messages that compare two sizes tell them apart (NOTE [ Sizes a message compares ] in ``remat.units``):
a budget one byte below the smallest feasible peak, and a batch a few percent larger than the profiled
one, used to read "budget 1.6MiB is below the smallest feasible peak 1.6MiB"."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import remat
from remat.errors import BudgetInfeasibleError, RematWarning
from remat.units import parse_bytes

ROWS, WIDTH = 1024, 256  # block 0 takes 1.0MiB: format_bytes' one decimal is 10% of it
SIZE = r"(\S+(?: \(\d+B\))?)"  # "1.0MiB", or "1.0MiB (1090519B)" where two sizes read alike


def chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)))


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


@pytest.fixture(scope="module")
def prof() -> remat.Profile:
    return remat.profile(chain(), torch.randn(ROWS, WIDTH), loss_fn, repeats=1, ops=False, progress=False)


def sizes_in(message: str, pattern: str) -> tuple[str, str]:
    found = re.search(pattern, message)
    assert found is not None, message
    return found.group(1), found.group(2)


def exact(text: str) -> int:
    """The byte count a size's text states: its exact count where it gives one, else the rounded size."""
    inner = re.search(r"\((\d+)B\)", text)
    return int(inner.group(1)) if inner else parse_bytes(text)


def test_a_budget_one_byte_below_the_smallest_peak_states_two_different_sizes(prof: remat.Profile) -> None:
    with pytest.raises(BudgetInfeasibleError) as first:
        remat.plan(prof, "1KiB")
    smallest = first.value.min_peak_bytes
    assert smallest is not None
    with pytest.raises(BudgetInfeasibleError) as err:
        remat.plan(prof, smallest - 1)
    assert err.value.budget_bytes == smallest - 1
    budget_text, peak_text = sizes_in(str(err.value), rf"budget {SIZE} is below the smallest (?:feasible )?peak {SIZE}")
    assert budget_text != peak_text, str(err.value)
    # What it states is what the error carries, in a form --budget reads back.
    assert exact(budget_text) == err.value.budget_bytes and exact(peak_text) == err.value.min_peak_bytes


def test_a_batch_a_few_percent_larger_names_two_different_input_sizes(prof: remat.Profile) -> None:
    plan = remat.plan(prof, strategy=remat.full())
    assert plan.input_bytes is not None and plan.input_bytes[0] == ROWS * WIDTH * 4
    model = chain()
    remat.apply(model, plan)
    x = torch.randn(ROWS + ROWS // 25, WIDTH)  # 4% more rows: above the warning's slack, 1.0MiB as well
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss_fn(model(x)).backward()
    messages = [str(w.message) for w in caught if issubclass(w.category, RematWarning)]
    assert len(messages) == 1, messages
    found_text, profiled_text = sizes_in(messages[0], rf"takes {SIZE} of tensor inputs, more than the {SIZE} it took")
    assert found_text != profiled_text, messages[0]
    assert exact(found_text) == x.numel() * 4 and exact(profiled_text) == plan.input_bytes[0]
