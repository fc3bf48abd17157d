"""A unitless budget like ``1.5`` suggests a size too, not only ``'1.5%'`` (helper-110's first hour)."""

from __future__ import annotations

import pytest

from remat.errors import RematError
from remat.units import parse_budget


@pytest.mark.parametrize("value", [1.5, "1.5", "2.5", 99.9])
def test_a_unitless_fraction_above_one_suggests_a_share_and_a_size(value: object) -> None:
    shown = f"{float(value):g}"  # type: ignore[arg-type]
    with pytest.raises(RematError, match=rf"did you mean '{shown}%' or '{shown}GiB'\? write a share with '%'"):
        parse_budget(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "share"), [("40", "40%"), (40, "40%"), (2.0, "2%"), ("0.4", "40%")])
def test_a_whole_or_small_unitless_number_still_suggests_the_share_alone(value: object, share: str) -> None:
    with pytest.raises(RematError, match=rf"did you mean '{share}'\? write a share"):
        parse_budget(value)  # type: ignore[arg-type]
