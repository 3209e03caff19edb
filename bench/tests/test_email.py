"""(j) email drain: the verdict and the report row."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.scenario_email import EmailConfig, _pinned, report_rows, summarise
from bench.toko import Target, TokoCommand


def _result(rates: list[float], all_done: bool = True) -> dict[str, Any]:
    cfg = EmailConfig(toko=TokoCommand(["toko-api"]))
    drains = [{"emails_per_s": r, "cpu_ms_per_email": 0.4, "all_done": all_done} for r in rates]
    summary = summarise(drains, cfg.target_per_s)
    return {
        "config": {
            "jobs": cfg.jobs,
            "workers": cfg.workers,
            "reps": len(rates),
            "target_per_s": cfg.target_per_s,
        },
        "drains": drains,
        "summary": summary,
        "met": summary["met"],
    }


def test_the_row_gives_the_median_and_the_target_counts_the_slowest_drain() -> None:
    (row,) = report_rows(_result([2300.0, 2100.0, 2450.0]))
    assert row[2].startswith("2300 (2100-2450) · 0.400")
    assert row[3] == "≥ 2000/s ✅ met"
    (row,) = report_rows(_result([2300.0, 1900.0, 2450.0]))
    assert row[3] == "≥ 2000/s ❌ missed"


def test_a_drain_that_left_a_job_undone_misses() -> None:
    result = _result([2300.0], all_done=False)
    (row,) = report_rows(result)
    assert "every job done: NO" in row[2] and "missed" in row[3]


def test_toko_api_is_pinned_with_every_thread_it_starts() -> None:
    target = Target("toko-api", ["/venv/bin/toko-api"], {}, 8080, Path("/"))
    assert _pinned(target, 1).cmd == ["taskset", "-c", "1", "/venv/bin/toko-api"]
