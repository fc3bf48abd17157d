"""Sizes and shares in one place: parse ``"1.5GiB"``, ``"500M"``, ``"40%"`` and print bytes back."""

from __future__ import annotations

import re
from dataclasses import dataclass

from remat.errors import RematError

__all__ = ["Budget", "parse_bytes", "parse_budget", "format_bytes", "format_bytes_apart", "format_ms"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
# The spellings messages offer (the others in _UNITS are accepted, not advertised).
_SHOWN_UNITS = ("KiB", "MiB", "GiB", "KB", "MB", "GB")
_SIZE_RE = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """Parse a size into bytes.

    Args:
        value: An int or float of bytes, or a string such as ``"512"``, ``"500M"`` (10**6),
            ``"1.5GiB"`` (2**30). Unit letters are case-insensitive.

    Returns:
        The size in bytes, rounded down to an int.

    Raises:
        RematError: If the value is negative, not a number, or has an unknown unit.
    """
    if isinstance(value, bool):
        raise RematError(f"size: {value!r} is not a size; give bytes as an int or a string like '1.5GiB'")
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        match = _SIZE_RE.match(str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            valid = ", ".join(u for u in _SHOWN_UNITS if u.lower() in _UNITS)
            raise RematError(
                f"size: cannot read {value!r}; write a number with an optional unit ({valid}), e.g. '1.5GiB'"
            )
        number = float(match.group(1)) * _UNITS[unit]
    if number < 0 or number != number or number == float("inf"):
        raise RematError(
            f"size: {value!r} is negative, infinite or not a number; a size must be a finite number >= 0 bytes"
        )
    return int(number)


@dataclass(frozen=True)
class Budget:
    """A memory budget: either absolute bytes or a share of the unplanned peak.

    Attributes:
        bytes: The budget in bytes, or ``None`` when it is a share.
        fraction: The share of the unplanned peak (0.4 for ``"40%"``), or ``None`` when absolute.
    """

    bytes: int | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        if (self.bytes is None) == (self.fraction is None):
            raise RematError(
                f"budget: give exactly one of bytes or fraction, got bytes={self.bytes!r}, fraction={self.fraction!r}"
            )
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise RematError(f"budget: fraction={self.fraction!r} is outside (0, 1]; give e.g. 0.4 for 40%")
        if self.bytes is not None and self.bytes < 0:
            raise RematError(f"budget: bytes={self.bytes!r} is negative; give bytes >= 0")

    def resolve(self, unplanned_peak_bytes: int) -> int:
        """The budget in bytes, given the peak of a step with nothing checkpointed (bytes)."""
        if self.fraction is not None:
            return int(self.fraction * unplanned_peak_bytes)
        return int(self.bytes or 0)

    def __str__(self) -> str:
        if self.bytes is not None:
            return format_bytes(self.bytes)
        return f"{self.fraction * 100:g}%" if self.fraction is not None else "?"


# A unitless budget below this is read as a forgotten percent sign, not as bytes: no training step
# fits in 100 bytes, so "--budget 40" almost surely meant "40%".
_SMALLEST_BYTES_BUDGET = 101


def parse_budget(value: int | float | str | Budget) -> Budget:
    """Parse a memory budget.

    Args:
        value: Bytes (an int, a whole float such as ``2e9``, or a size string such as ``"1.5GiB"``)
            or a share of the unplanned peak as a percentage string (``"40%"``, in (0, 100]).

    Returns:
        The parsed :class:`Budget`.

    Raises:
        RematError: If the value cannot be read, is negative, the share is outside (0%, 100%], a
            unitless number is below 101 (``"40"``: "did you mean '40%'?"; ``1.5``: "did you mean
            '1.5%' or '1.5GiB'?"), or a float is in (0, 1] (``0.4``: "did you mean '40%'?"). A larger
            float is rounded down to whole bytes (``0.8 * total_bytes``).
    """
    if isinstance(value, Budget):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise RematError(f"budget: {value!r} is not a budget; give a share such as '40%' or bytes such as '1.5GiB'")
    if isinstance(value, str) and value.strip().endswith("%"):
        text = value.strip()[:-1]
        try:
            pct = float(text)
        except ValueError:
            raise RematError(
                f"budget: cannot read {value!r}; write a share like '40%' or a size like '1.5GiB'"
            ) from None
        if not 0 < pct <= 100:
            raise RematError(
                f"budget: share {value!r} is outside (0%, 100%]; 100% is the unplanned peak itself, give e.g. '40%'"
            )
        return Budget(fraction=pct / 100)
    if isinstance(value, float) and 0 < value <= 1:
        raise RematError(
            f"budget: {value!r} is a float, read as {int(value)} bytes; did you mean {_pct(value * 100)!r}? "
            "give a share as a string ('40%') or bytes as an int or a size ('1.5GiB')"
        )
    match = _SIZE_RE.match(value) if isinstance(value, str) else None
    number = float(match.group(1)) if match is not None else float(value) if not isinstance(value, str) else None
    if number is not None and number < 0:
        raise RematError(f"budget: {value!r} is negative; give a size >= 0 such as '1.5GiB' or a share such as '40%'")
    unitless = match is None or match.group(2) == ""
    if number is not None and unitless and 0 < number < _SMALLEST_BYTES_BUDGET:
        # 0.4 reads as a fraction (40%), 40 as a percentage with its sign forgotten.
        share = number * 100 if number < 1 else number
        # 1.5 is no whole number of bytes and no usual percentage: as likely a size with its unit forgotten.
        size = f" or '{number:g}GiB'" if number >= 1 and not number.is_integer() else ""
        raise RematError(
            f"budget: {value!r} has no unit, so it means {int(number)} bytes; did you mean {_pct(share)!r}{size}? "
            "write a share with '%' or a size with a unit ('40MiB')"
        )
    try:
        return Budget(bytes=parse_bytes(value))
    except RematError as e:  # the size's own message, in the budget's words
        raise RematError(f"budget: {str(e).removeprefix('size: ')}; or give a share such as '40%'") from None


def _pct(value: float) -> str:
    return f"{value:.4g}%"


def format_bytes(n: int | float) -> str:
    """Format bytes with binary units: ``format_bytes(1536) == '1.5KiB'``."""
    sign = "-" if n < 0 else ""
    v = float(abs(n))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if v < 1024 or unit == "GiB":
            return f"{sign}{v:.0f}{unit}" if unit == "B" else f"{sign}{v:.1f}{unit}"
        v /= 1024
    return f"{sign}{v:.1f}TiB"  # pragma: no cover


def format_bytes_apart(a: int | float, b: int | float) -> tuple[str, str]:
    """Format two sizes a message compares, so that different sizes never read alike.

    NOTE [ Sizes a message compares ]: ``format_bytes`` keeps one decimal, 10% of the value between 1.0
    and 9.9 of a unit, so "budget 1.6MiB is below the smallest feasible peak 1.6MiB" said nothing of how
    far apart the two were. Where the two read alike, each gets its exact byte count, in a form
    ``parse_bytes`` (and so ``--budget``) reads back: ``'1.6MiB (1677721B)'``.

    Args:
        a: The first size, in bytes.
        b: The second size, in bytes.

    Returns:
        Both sizes formatted, ``format_bytes``'s text where that tells them apart.
    """
    fa, fb = format_bytes(a), format_bytes(b)
    if fa != fb or round(a) == round(b):
        return fa, fb
    return f"{fa} ({round(a)}B)", f"{fb} ({round(b)}B)"


def format_ms(ms: float) -> str:
    """Format a duration in milliseconds as ``'12.3ms'`` or ``'1.25s'``."""
    return f"{ms / 1000:.2f}s" if ms >= 1000 else f"{ms:.1f}ms"
