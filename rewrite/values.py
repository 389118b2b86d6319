"""Plain values checked alike everywhere: whole numbers that are not bools (`True` is an `int` to Python;
no plan, layer or planner argument means it as one), and counts."""

from __future__ import annotations

from typing import Any

__all__ = ["is_int", "is_count", "check_count"]


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_count(value: Any, least: int = 1) -> bool:
    """An int (not a bool) of at least `least`."""
    return is_int(value) and value >= least


def check_count(owner: str, name: str, value: Any, least: int = 1) -> None:
    """Raise TypeError unless `value` is an int (not a bool), ValueError when it is below `least`.

    Example:
        >>> check_count("RowParallelLinear", "in_features", 0)
        Traceback (most recent call last):
        ValueError: RowParallelLinear: in_features must be >= 1, got 0
    """
    if not is_int(value):
        raise TypeError(f"{owner}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < least:
        raise ValueError(f"{owner}: {name} must be >= {least}, got {value}")
