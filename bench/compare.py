"""Compare two saved bench runs figure by figure: ``python -m bench --compare OLD.json NEW.json``.

Each run's JSON holds its figures as medians with min-max (``{"median", "min",
"max", "n"}``) or as plain numbers. This pairs every figure present in both
runs by its path (``queue.figures.toko-sqlite.noop_jobs_per_s``) and prints
old, new and new ÷ old. Settings, raw samples and per-run detail are left
out: only summaries are compared. Absolute figures from different runs move
with the machine's load, so the ratios *within* each run (also listed) are
the fairer comparison; this table says what changed and by how much.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Keys whose subtrees are settings, raw samples or per-repetition detail.
SKIPPED_KEYS = frozenset(
    {"meta", "config", "rounds", "runs", "requests_detail", "samples", "systems", "build"}
)
SPREAD_KEYS = frozenset({"median", "min", "max", "n"})


def figures(tree: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """(path, value) for every summary figure: a spread's median, or a plain number."""
    if isinstance(tree, dict):
        if tree.keys() >= SPREAD_KEYS:
            median = tree["median"]
            if isinstance(median, int | float) and not isinstance(median, bool):
                yield path, float(median)
            return
        for key, value in tree.items():
            if key in SKIPPED_KEYS:
                continue
            yield from figures(value, f"{path}.{key}" if path else str(key))
    elif isinstance(tree, int | float) and not isinstance(tree, bool) and math.isfinite(tree):
        yield path, float(tree)


def compare(old: dict[str, Any], new: dict[str, Any], match: str = "") -> list[tuple[str, ...]]:
    """Rows (figure, old, new, new ÷ old) for the figures both runs have."""
    before = dict(figures(old))
    rows = []
    for path, value in figures(new):
        if match not in path or path not in before:
            continue
        was = before[path]
        ratio = f"{value / was:.2f}" if was else "-"
        rows.append((path, f"{was:.4g}", f"{value:.4g}", ratio))
    return rows


def render(old_path: Path, new_path: Path, match: str = "") -> str:
    old = json.loads(old_path.read_text())
    new = json.loads(new_path.read_text())
    header = [
        f"old: {old_path} ({old['meta'].get('started')}, toko {old['meta'].get('git')})",
        f"new: {new_path} ({new['meta'].get('started')}, toko {new['meta'].get('git')})",
        "",
    ]
    data = [("figure", "old", "new", "new ÷ old"), *compare(old, new, match)]
    if len(data) == 1:
        return "\n".join([*header, "no figure in common"])
    widths = [max(len(r[i]) for r in data) for i in range(4)]
    lines = ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in data]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(header + lines)
