"""remat.units: sizes and budgets."""

from __future__ import annotations

import pytest

from remat.errors import RematError
from remat.units import Budget, format_bytes, parse_budget, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [("512", 512), (1024, 1024), ("500M", 500_000_000), ("1.5GiB", 3 * 2**29), ("2kib", 2048), ("1e3", 1000), ("7 MiB", 7 * 2**20)],
)
def test_parse_bytes(text: object, expected: int) -> None:
    assert parse_bytes(text) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "match"), [("-1", "negative"), ("12 parsecs", "cannot read"), (True, "not a size"), ("", "cannot read")])
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
