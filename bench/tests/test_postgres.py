from __future__ import annotations

from bench.scenario_postgres import drain_rate, report_rows


def test_drain_rate_ignores_start_up_and_the_tail() -> None:
    # Nothing for 2 s (start-up), then 100 jobs/s, then a slow tail.
    samples = [(0.0, 0), (2.0, 0), (3.0, 100), (10.0, 800), (11.0, 900), (20.0, 1000)]
    assert drain_rate(samples, 1000) == 100.0


def test_drain_rate_is_none_without_enough_progress() -> None:
    assert drain_rate([(0.0, 0), (5.0, 50)], 1000) is None
    assert drain_rate([(0.0, 1000)], 1000) is None  # one sample: no interval


def test_report_rows_flag_an_unfinished_drain() -> None:
    result = {
        "config": {"connections": 16, "duration_s": 10},
        "post": {
            "postgres-1": {
                "rps": 900.0,
                "p50_ms": 15.0,
                "p99_ms": 40.0,
                "errors": 0,
                "durable": True,
            }
        },
        "drain": {
            "postgres-2": {"jobs_per_s": None, "jobs": 10, "done": 9, "workers_each": 16},
        },
    }
    (post, drain) = report_rows(result)
    assert post[2].startswith("900 · 15.00 ms · 40.00 ms")
    assert drain[2] == "n/a (9/10 done)" and drain[3].endswith("❌")
