"""The one rule for a duration option (every ``*_secs`` argument of the CLI, the integrations and
the job): a finite real number of seconds, ``>= 0`` or ``> 0``.

``float("nan")`` passes every ``< 0`` check (each comparison with NaN is false), and a NaN or
infinite timeout reaches ``threading`` or ``socket`` as a wait that never ends or an error far from
the option that caused it: both are refused where the option is given.
"""

from __future__ import annotations

import math
from typing import Any


def secs_problem(value: Any, *, positive: bool = False) -> str | None:
    """Why ``value`` is not a duration (``"must be a finite number of seconds >= 0, got nan"``), or
    ``None`` when it is one; ``positive`` also refuses 0."""
    bound = "> 0" if positive else ">= 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"must be a finite number of seconds {bound}, got {value!r} ({type(value).__name__})"
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        return f"must be a finite number of seconds {bound}, got {value!r}"
    return None


def check_secs(value: Any, name: str, *, positive: bool = False) -> float:
    """``value`` as float seconds.

    Raises:
        TypeError: ``value`` is not an int or float (a bool neither), naming ``name``.
        ValueError: NaN, infinite, negative, or with ``positive`` zero, naming ``name`` and the value.
    """
    problem = secs_problem(value, positive=positive)
    if problem is None:
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} {problem}")
    raise ValueError(f"{name} {problem}")


__all__ = ["check_secs", "secs_problem"]
