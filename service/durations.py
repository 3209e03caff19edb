"""Durations written the way admins write them: ``90s``, ``15m``, ``12h``, ``7d``.

Shared by TOKO_JOB_RETENTION and ``toko-queue purge --done-older-than``.
"""

from __future__ import annotations

import re

UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd])")


def parse_duration(text: str) -> float:
    """Seconds in ``text`` (a number and one unit of s, m, h, d); ValueError otherwise."""
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None:
        raise ValueError("must be a duration like 90s, 15m, 12h or 7d")
    return float(match.group(1)) * UNIT_SECONDS[match.group(2)]


def format_duration(seconds: float) -> str:
    """The largest whole unit that fits, e.g. 604800 -> '7d', 90 -> '90s'."""
    for unit in ("d", "h", "m"):
        size = UNIT_SECONDS[unit]
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
