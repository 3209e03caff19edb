"""The README table bench.report writes from a results file (pure; no processes)."""

from __future__ import annotations

from typing import Any

from bench.report import markdown
from bench.stats import spread


def _round(which: str, rps: float, server_pct: float) -> dict[str, Any]:
    return {which: {"rps": rps, "cpu": {"server_pct": server_pct, "others_pct": 1.0}}}


def test_throughput_table_gives_cpu_per_request() -> None:
    rounds = [
        _round("toko", 5000.0, 100.0) | _round("baseline", 10000.0, 100.0),
        _round("toko", 4000.0, 80.0) | _round("baseline", 12500.0, 100.0),
    ]
    server = {"rps": spread([5000.0, 4000.0]), "p50_ms": spread([3.0]), "p99_ms": spread([5.0])}
    results = {
        "meta": {"started": "now", "command": "python -m bench", "machine": "m", "git": "abc"},
        "throughput": {
            "config": {"connections": 16, "runs": 2, "duration_s": 10.0},
            "rounds": rounds,
            "summary": {
                "toko": server | {"errors": 0},
                "baseline": server | {"errors": 0},
                "ratio_per_round": spread([0.5, 0.32]),
                "target_ratio": 0.6,
                "met": False,
            },
        },
    }
    lines = markdown(results).splitlines()
    assert lines[4].endswith("| server CPU | CPU per request |")
    # 100 % of a core at 5000 req/s is 200 µs a request; 80 % at 4000 req/s too.
    assert lines[6].startswith("| toko-api (SQLite") and lines[6].endswith("| 200 µs (200-200) |")
    assert lines[7].endswith("| 90 µs (80-100) |")


def test_the_header_gives_the_cpu_probe_before_and_after() -> None:
    meta = {"started": "now", "command": "python -m bench", "machine": "m", "git": "abc"}
    before_only = meta | {"cpu_probe_before": {"median_us": 4.21, "min_us": 4.0, "max_us": 5.0}}
    assert "CPU probe 4.2 µs per iteration" in markdown({"meta": before_only}).splitlines()[0]
    both = before_only | {"cpu_probe_after": {"median_us": 6.04, "min_us": 6.0, "max_us": 7.0}}
    assert "CPU probe 4.2 then 6.0 µs per iteration" in markdown({"meta": both}).splitlines()[0]
    assert "CPU probe not run" in markdown({"meta": meta}).splitlines()[0]


META = {"started": "now", "command": "python -m bench -s c", "machine": "m", "git": "abc"}


def _startup(ready_ms: float, rss_mib: float) -> dict[str, Any]:
    return {"ready_ms": spread([ready_ms]), "rss_mib": spread([rss_mib])}


def test_startup_holds_only_the_package_style_install_to_the_targets() -> None:
    packaged, dev = _startup(250.0, 41.0), _startup(400.0, 39.0)
    results = {
        "meta": META,
        "startup": {
            "config": {"starts": 1, "idle_s": 2.0},
            "summary": packaged,
            "installs": [
                {"label": "installed as the package does", "summary": packaged},
                {"label": "developers' venv (editable)", "summary": dev},
            ],
            "targets": {"ready_ms": 300.0, "rss_mib": 40.0},
            "checks": {"ready_ms": True, "rss_mib": False},
        },
    }
    lines = [line for line in markdown(results).splitlines() if line.startswith("| (c)")]
    assert len(lines) == 4, lines
    assert "250 ms" in lines[0] and "✅" in lines[0]
    assert "41.0 MiB" in lines[1] and "❌" in lines[1]
    assert all("✅" not in line and "❌" not in line for line in lines[2:])


def test_startup_results_from_before_installs_still_render() -> None:
    old = {"config": {"starts": 1, "idle_s": 2.0}, "summary": _startup(227, 43.4)}
    results = {"meta": META, "startup": old}
    lines = [line for line in markdown(results).splitlines() if line.startswith("| (c)")]
    assert lines[0].startswith("| (c) start to READY=1 |") and "227 ms" in lines[0]
