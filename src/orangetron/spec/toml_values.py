"""A TOML value checked against the type its key takes, so that a quoted `"false"` is refused rather than read
as true (a non-empty string is truthy) and a quoted `"64"` is refused rather than failing later in arithmetic."""

from __future__ import annotations

from typing import Any


def check_scalar(where: str, value: Any, kind: type) -> None:
    """Raise unless TOML's `value` is a `kind`: bool (true or false), int (an integer, not a bool), float (a
    number) or str (a string)."""
    if kind is bool and not isinstance(value, bool):
        raise ValueError(f"{where}: must be true or false")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{where}: must be an integer")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"{where}: must be a number")
    if kind is str and not isinstance(value, str):
        raise ValueError(f"{where}: must be a string")
