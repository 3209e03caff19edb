"""(a) over concurrency: per-level figures, each server's peak, the ratio of peaks (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.report import markdown, rows
from bench.scenario_throughput import ThroughputConfig, levels, sweep_summary
from bench.stats import spread
from bench.toko import TokoCommand


def _entry(rps: float, server_pct: float = 100.0) -> dict[str, Any]:
    return {
        "rps": rps,
        "latency_ms": {"p50": 1000 / rps, "p99": 3000 / rps},
        "error_count": 0,
        "cpu": {"server_pct": server_pct, "others_pct": 0.0},
    }


def _round(main: int, by_level: dict[int, tuple[float, float]]) -> dict[str, Any]:
    rnd: dict[str, Any] = {"sweep": {}}
    for conns, (toko, baseline) in by_level.items():
        pair = {"toko": _entry(toko), "baseline": _entry(baseline)}
        if conns == main:
            rnd |= pair
        else:
            rnd["sweep"][str(conns)] = pair
    return rnd


ROUNDS = [
    # toko peaks at 256, the baseline at 64: the ratio of peaks is not any level's ratio.
    _round(16, {1: (500, 3000), 16: (3600, 9600), 64: (4000, 12000), 256: (4400, 11000)}),
    _round(16, {1: (520, 3100), 16: (3400, 10000), 64: (4100, 12400), 256: (4600, 11600)}),
]


def test_levels_always_hold_the_main_one() -> None:
    cfg = ThroughputConfig(toko=TokoCommand(["toko-api"]), connections=32, sweep=(256, 1))
    assert levels(cfg) == [1, 32, 256]


def test_peaks_are_each_servers_best_median_level() -> None:
    s = sweep_summary(ROUNDS, 16, [1, 16, 64, 256])
    assert list(s["levels"]) == ["1", "16", "64", "256"]
    assert s["levels"]["16"]["toko"]["rps"]["median"] == 3500
    assert s["levels"]["1"]["ratio_per_round"]["median"] == pytest.approx(
        (500 / 3000 + 520 / 3100) / 2
    )
    # 100 % of a core at 4000 req/s: 250 µs a request.
    assert s["levels"]["64"]["toko"]["cpu_us_per_request"]["max"] == pytest.approx(250)
    peak = s["peak"]
    assert peak["toko"]["connections"] == 256 and peak["toko"]["rps"]["median"] == 4500
    assert peak["baseline"]["connections"] == 64 and peak["baseline"]["rps"]["median"] == 12200
    assert peak["ratio_of_peaks"] == pytest.approx(4500 / 12200)
    assert peak["ratio_of_peaks_per_round"]["min"] == pytest.approx(4400 / 12000)


def test_report_shows_levels_and_peaks_beside_the_main_ratio() -> None:
    server = {"rps": spread([3500.0]), "p50_ms": spread([1.0]), "p99_ms": spread([2.0])}
    summary = {
        "toko": server | {"errors": 0},
        "baseline": server | {"errors": 0},
        "ratio_per_round": spread([3600 / 9600, 3400 / 10000]),
        "sweep": sweep_summary(ROUNDS, 16, [1, 16, 64, 256]),
    }
    results = {
        "meta": {"started": "now", "command": "python -m bench", "machine": "m", "git": "abc"},
        "throughput": {
            "config": {"connections": 16, "runs": 2, "duration_s": 10.0},
            "rounds": ROUNDS,
            "summary": summary,
        },
    }
    md = markdown(results)
    assert "target" not in md.split("**(a) over concurrency**")[0]
    assert "| 256 | 4500 (4400-4600) |" in md
    assert "Ratio of peaks: **0.37**" in md and "At 16 connections: **0.36 (0.34-0.38)**" in md
    labels = [r[0] for r in rows(results)]
    assert labels[-1] == "(a) peaks" and "(a) 64 connections" in labels
