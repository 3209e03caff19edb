"""Durations written the way admins write them: ``90s``, ``15m``, ``12h``, ``7d``.

Shared by TOKO_JOB_RETENTION and ``toko-queue purge --done-older-than``.
"""

from __future__ import annotations

import re

UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd])")
# A century keeps jobs for good in effect. Far longer ones put the cutoff
# before the first year a date can hold: toko-recap and toko-queue purge
# ended in a traceback naming it, the recaps already recorded.
MAX_DAYS = 36500


def parse_duration(text: str) -> float:
    """Seconds in ``text`` (a number and one unit of s, m, h, d); ValueError otherwise."""
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None:
        raise ValueError("must be a duration like 90s, 15m, 12h or 7d")
    seconds = float(match.group(1)) * UNIT_SECONDS[match.group(2)]
    if seconds > MAX_DAYS * UNIT_SECONDS["d"]:
        raise ValueError(f"must be a duration of at most {MAX_DAYS}d (a century)")
    return seconds


def format_duration(seconds: float) -> str:
    """The largest whole unit that fits, e.g. 604800 -> '7d', 90 -> '90s'."""
    for unit in ("d", "h", "m"):
        size = UNIT_SECONDS[unit]
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
