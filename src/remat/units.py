"""Sizes and shares in one place: parse ``"1.5GiB"``, ``"500M"``, ``"40%"`` and print bytes back."""

from __future__ import annotations

import re
from dataclasses import dataclass

from remat.errors import RematError

__all__ = ["Budget", "parse_bytes", "parse_budget", "format_bytes", "format_ms"]

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
            valid = ", ".join(sorted({u for u in _UNITS if u}, key=lambda u: (len(u), u)))
            raise RematError(
                f"size: cannot read {value!r}; write a number with an optional unit ({valid}), e.g. '1.5GiB'"
            )
        number = float(match.group(1)) * _UNITS[unit]
    if number < 0 or number != number or number == float("inf"):
        raise RematError(f"size: {value!r} is negative, infinite or not a number; a size must be a finite number >= 0 bytes")
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
            raise RematError(f"budget: give exactly one of bytes or fraction, got bytes={self.bytes!r}, fraction={self.fraction!r}")
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


def parse_budget(value: int | float | str | Budget) -> Budget:
    """Parse a memory budget.

    Args:
        value: Bytes (an int, or a size string such as ``"1.5GiB"``) or a share of the unplanned
            peak as a percentage string (``"40%"``, in (0, 100]).

    Returns:
        The parsed :class:`Budget`.

    Raises:
        RematError: If the value cannot be read or the share is outside (0%, 100%].
    """
    if isinstance(value, Budget):
        return value
    if isinstance(value, str) and value.strip().endswith("%"):
        text = value.strip()[:-1]
        try:
            pct = float(text)
        except ValueError:
            raise RematError(f"budget: cannot read {value!r}; write a share like '40%' or a size like '1.5GiB'") from None
        if not 0 < pct <= 100:
            raise RematError(f"budget: share {value!r} is outside (0%, 100%]; give e.g. '40%'")
        return Budget(fraction=pct / 100)
    return Budget(bytes=parse_bytes(value))


def format_bytes(n: int | float) -> str:
    """Format bytes with binary units: ``format_bytes(1536) == '1.5KiB'``."""
    sign = "-" if n < 0 else ""
    v = float(abs(n))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if v < 1024 or unit == "GiB":
            return f"{sign}{v:.0f}{unit}" if unit == "B" else f"{sign}{v:.1f}{unit}"
        v /= 1024
    return f"{sign}{v:.1f}TiB"  # pragma: no cover


def format_ms(ms: float) -> str:
    """Format a duration in milliseconds as ``'12.3ms'`` or ``'1.25s'``."""
    return f"{ms / 1000:.2f}s" if ms >= 1000 else f"{ms:.1f}ms"
