"""Pure statistics helpers (unit-tested in bench/tests/test_helpers.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypedDict


def percentile(values: Sequence[float], pct: float) -> float:
    """The ``pct`` percentile (0-100) of ``values``, linearly interpolated.

    Same definition as numpy's default ("linear"): the rank is
    ``pct/100 * (n-1)`` over the sorted values. Raises ValueError when
    ``values`` is empty or ``pct`` is outside 0-100, because a silent 0 in a
    latency report would look like good news.
    """
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= pct <= 100.0 or math.isnan(pct):
        raise ValueError(f"percentile must be within 0..100, got {pct}")
    ordered = sorted(values)
    rank = pct / 100.0 * (len(ordered) - 1)
    low = math.floor(rank)
    high = math.ceil(rank)
    if low == high:
        return float(ordered[low])
    frac = rank - low
    return float(ordered[low] + (ordered[high] - ordered[low]) * frac)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


class Spread(TypedDict):
    median: float
    min: float
    max: float
    n: int


def spread(values: Sequence[float]) -> Spread:
    """Median with min and max, how repeated runs are reported."""
    if not values:
        raise ValueError("spread of an empty sequence")
    return {"median": median(values), "min": min(values), "max": max(values), "n": len(values)}


def fmt_spread(s: Spread, fmt: str = "{:.0f}", unit: str = "") -> str:
    """``median (min-max)``, or just the value when there was one run."""
    med = fmt.format(s["median"]) + unit
    if s["n"] == 1:
        return med
    return f"{med} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"
