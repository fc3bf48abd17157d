"""remat.units: sizes and budgets."""

from __future__ import annotations

from typing import cast

import pytest

import remat
from remat.errors import RematError
from remat.profile import Profile
from remat.units import Budget, format_bytes, parse_budget, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512", 512),
        (1024, 1024),
        ("500M", 500_000_000),
        ("1.5GiB", 3 * 2**29),
        ("2kib", 2048),
        ("1e3", 1000),
        ("7 MiB", 7 * 2**20),
    ],
)
def test_parse_bytes(text: object, expected: int) -> None:
    assert parse_bytes(text) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "match"), [("-1", "negative"), ("12 parsecs", "cannot read"), (True, "not a size"), ("", "cannot read")]
)
def test_parse_bytes_rejects(text: object, match: str) -> None:
    with pytest.raises(RematError, match=match):
        parse_bytes(text)  # type: ignore[arg-type]


def test_budget_share_and_bytes() -> None:
    assert parse_budget("40%").resolve(1000) == 400
    assert parse_budget("1KiB").resolve(10**9) == 1024
    assert parse_budget(Budget(bytes=5)) == Budget(bytes=5)
    assert str(parse_budget("40%")) == "40%"


@pytest.mark.parametrize("text", ["0%", "120%", "abc%"])
def test_budget_rejects_bad_shares(text: str) -> None:
    with pytest.raises(RematError, match="budget"):
        parse_budget(text)


def test_format_bytes() -> None:
    assert format_bytes(1536) == "1.5KiB"
    assert format_bytes(3 * 2**20) == "3.0MiB"
    assert format_bytes(12) == "12B"


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("150%", r"budget: share '150%' is outside \(0%, 100%\]; 100% is the unplanned peak itself, give e.g. '40%'"),
        ("-1GiB", r"budget: '-1GiB' is negative; give a size >= 0 such as '1.5GiB' or a share such as '40%'"),
        ("40", r"budget: '40' has no unit, so it means 40 bytes; did you mean '40%'\?"),
        ("100", r"budget: '100' has no unit, so it means 100 bytes; did you mean '100%'\?"),
        (40, r"budget: 40 has no unit, so it means 40 bytes; did you mean '40%'\?"),
        ("0.4", r"budget: '0.4' has no unit, so it means 0 bytes; did you mean '40%'\?"),
        (0.4, r"budget: 0.4 is a float, read as 0 bytes; did you mean '40%'\? give a share as a string \('40%'\)"),
        (0.05, r"budget: 0.05 is a float, read as 0 bytes; did you mean '5%'\?"),
        ("lots", r"budget: cannot read 'lots'; write a number with an optional unit .*; or give a share such as '40%'"),
        (None, r"budget: None is not a budget; give a share such as '40%' or bytes such as '1.5GiB'"),
    ],
)
def test_budget_mistakes_name_the_value_and_the_fix(value: object, match: str) -> None:
    with pytest.raises(RematError, match=f"^{match}"):
        parse_budget(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "expected"), [("101", 101), (2e9, 2_000_000_000), ("40MiB", 40 * 2**20), ("0", 0)])
def test_budget_bytes_from_101_up_or_with_a_unit(value: object, expected: int) -> None:
    assert parse_budget(value).resolve(10**12) == expected  # type: ignore[arg-type]


def test_python_api_float_budget_suggests_the_percent_string() -> None:
    # remat.plan reads its budget through parse_budget before it looks at the profile.
    with pytest.raises(RematError, match=r"^budget: 0\.4 is a float, read as 0 bytes; did you mean '40%'\?"):
        remat.plan(cast(Profile, object()), 0.4)  # type: ignore[arg-type]


def test_unit_errors_list_the_canonical_units_only() -> None:
    with pytest.raises(RematError, match=r"optional unit \(KiB, MiB, GiB, KB, MB, GB\), e.g. '1.5GiB'") as e:
        parse_bytes("12 parsecs")
    assert " gi," not in str(e.value) and "ki" not in str(e.value)
    assert parse_bytes("1gi") == parse_bytes("1GiB")  # the short spellings are still read
