"""The queue bench's pure helpers (bench/queue_common.py, bench/scenario_queue.py).

No Redis or PostgreSQL here: those run only under ``python -m bench``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from bench.queue_common import (
    Recorder,
    due_times,
    job_bodies,
    jobs_per_second,
    parse_args,
    produce,
    status_kib,
)
from bench.queue_settings import ARQ_TUNED, PROCRASTINATE_TUNED, settings_for
from bench.redis_server import redis_command
from bench.scenario_queue import (
    ALL_SYSTEMS,
    QueueConfig,
    Targets,
    figures,
    latency_summary,
    markdown,
    measures_of,
    meets,
    needs,
    partial,
    ratios,
    rep_metrics,
    report_rows,
    shape,
)


def test_recorder_counts_jobs_latency_and_calls_back_once_complete() -> None:
    completed: list[bool] = []
    rec = Recorder(expect=2, on_complete=lambda: completed.append(True))
    rec.start({"t": 99.998}, now=100.0)
    rec.end(now=100.5)
    assert not completed
    rec.start({"i": 1}, now=101.0)  # a drain job: no enqueue time, no latency sample
    rec.end(now=102.0)
    assert completed == [True]
    result = rec.result()
    assert result["complete"] and result["started"] == result["finished"] == 2
    assert result["first_start"] == 100.0 and result["last_end"] == 102.0
    assert result["jobs_per_s"] == 1.0  # 2 jobs from first start to last end (2 s)
    assert result["latencies_ms"] == [pytest.approx(2.0, abs=1e-3)]
    json.dumps(result)


def test_jobs_per_second_needs_an_interval() -> None:
    assert jobs_per_second(10, 5.0, 7.0) == 5.0
    assert jobs_per_second(0, 5.0, 7.0) is None
    assert jobs_per_second(1, 5.0, 5.0) is None
    assert jobs_per_second(3, None, 7.0) is None


def test_job_bodies_record_start_and_end_around_the_work() -> None:
    now = iter([1.0, 1.25, 2.0, 2.5])
    rec = Recorder(expect=2)
    bodies = job_bodies(rec, clock=lambda: next(now))

    async def both() -> None:
        await bodies["noop"]({"t": 0.5})
        await bodies["sleep"]({})

    asyncio.run(both())
    assert rec.finished == 2 and rec.first_start == 1.0 and rec.last_end == 2.5
    assert rec.latencies_ms == [500.0]


def test_due_times_are_an_open_loop_schedule() -> None:
    due = due_times(10.0, 200.0, 10.0)
    assert len(due) == 2000
    assert due[0] == 10.0 and due[1] == pytest.approx(10.005) and due[-1] == pytest.approx(19.995)
    assert len(due_times(0.0, 3.0, 1.0)) == 3
    with pytest.raises(ValueError):
        due_times(0.0, 0.0, 1.0)


def test_status_kib_reads_peak_rss() -> None:
    text = "Name:\tpython\nVmHWM:\t  45680 kB\nVmRSS:\t  40000 kB\nThreads:\t3\nVmPeak:\t1 kB\n"
    assert status_kib(text) == {"VmHWM": 45680, "VmRSS": 40000, "Threads": 3}


class _FakeProducer:
    def __init__(self) -> None:
        self.payloads: list[dict[str, Any]] = []

    async def enqueue(self, kind: str, payload: dict[str, Any]) -> None:
        self.payloads.append(payload)
        if len(self.payloads) == 3:
            raise OSError("connection lost")

    async def close(self) -> None:
        pass


def test_produce_sends_every_scheduled_job_and_counts_failures() -> None:
    producer = _FakeProducer()
    result = asyncio.run(produce(producer, "noop", rate=500.0, seconds=0.04, limit_s=5.0))
    assert result["scheduled"] == result["sent"] == 20
    assert result["enqueued"] == 19 and result["errors"] == 1
    assert "connection lost" in result["first_error"]
    times = [p["t"] for p in producer.payloads]
    assert times == sorted(times)
    json.dumps(result)


def test_worker_command_line() -> None:
    argv = ["worker", "--target", "{}", "--expect", "5", "--out", "o", "--ready", "r"]
    args = parse_args([*argv, "--kind", "sleep"])
    assert args.command == "worker" and args.kind == "sleep" and args.produce_rate == 0.0
    assert args.out == Path("o")


def test_redis_runs_without_persistence_on_loopback() -> None:
    cmd = redis_command("/usr/bin/redis-server", 6390, Path("/tmp/x"))
    assert cmd[cmd.index("--save") + 1] == ""
    assert cmd[cmd.index("--appendonly") + 1] == "no"
    assert cmd[cmd.index("--bind") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--port") + 1] == "6390"


def test_settings_defaults_are_empty_and_the_10ms_drain_runs_at_the_concurrency() -> None:
    assert settings_for("arq-default", "noop", 10) == {}
    assert settings_for("procrastinate-default", "noop", 10) == {}
    assert settings_for("procrastinate-default", "sleep", 10) == {"worker": {"concurrency": 10}}
    assert settings_for("arq-tuned", "noop", 10) == ARQ_TUNED
    assert settings_for("arq-tuned", "sleep", 10)["max_jobs"] == 10
    tuned = settings_for("procrastinate-tuned", "sleep", 10)
    assert tuned["worker"]["concurrency"] == 10 and tuned["pool"]["max_size"] >= 11
    # The module's own settings are not modified by the override.
    assert PROCRASTINATE_TUNED["worker"]["concurrency"] != 10
    assert settings_for("toko-sqlite", "latency", 10) == {"workers": 10}
    with pytest.raises(ValueError):
        settings_for("celery", "noop", 10)


def test_needs_starts_only_the_servers_in_use() -> None:
    assert needs(ALL_SYSTEMS) == (True, True)
    assert needs(("toko-sqlite",)) == (False, False)
    assert needs(("toko-sqlite", "arq-tuned")) == (False, True)
    assert needs(("procrastinate-default",)) == (True, False)


def _run(rate: float, p50: float, p99: float, hwm: int, complete: bool = True) -> dict[str, Any]:
    drain = {"complete": complete, "jobs_per_s": rate, "memory_kib": {"VmHWM": hwm}}
    return {
        "noop": drain,
        "sleep": {"complete": True, "jobs_per_s": rate / 10},
        "latency": {"complete": True, "latency_ms": {"p50": p50, "p99": p99}},
    }


def test_rep_metrics_leave_out_an_unfinished_drain_and_a_failed_measurement() -> None:
    m = rep_metrics(_run(1000.0, 1.0, 2.0, 2048, complete=False))
    assert m["noop_jobs_per_s"] is None and m["sleep_jobs_per_s"] == 100.0
    assert m["peak_rss_mib"] == 2.0 and m["latency_p99_ms"] == 2.0
    failed = rep_metrics({"noop": {"error": "boom"}})
    assert all(v is None for v in failed.values())


def test_latency_summary() -> None:
    assert latency_summary([]) is None
    s = latency_summary([1.0, 2.0, 3.0])
    assert s is not None and s["p50"] == 2.0 and s["max"] == 3.0 and s["n"] == 3


def test_figures_ratios_and_targets() -> None:
    toko = [rep_metrics(_run(r, 0.5, 2.0, 40 * 1024)) for r in (6000.0, 8000.0, 7000.0)]
    peer = [rep_metrics(_run(r, 5.0, 10.0, 20 * 1024)) for r in (3000.0, 2000.0, 3500.0)]
    f = figures(toko)
    assert f["noop_jobs_per_s"] == {"median": 7000.0, "min": 6000.0, "max": 8000.0, "n": 3}
    r = ratios(toko, peer)
    # Paired within each repetition: 2.0, 4.0, 2.0.
    assert r["noop_jobs_per_s"] == {"median": 2.0, "min": 2.0, "max": 4.0, "n": 3}
    assert r["latency_p50_ms"] is not None and r["latency_p50_ms"]["median"] == 0.1
    assert r["peak_rss_mib"] is not None and r["peak_rss_mib"]["median"] == 2.0
    assert all(meets(f, Targets()).values())
    assert meets(f, Targets(latency_p99_ms=1.0)) == {
        "noop_jobs_per_s": True,
        "latency_p50_ms": True,
        "latency_p99_ms": False,
    }
    assert not any(meets(figures([]), Targets()).values())


def test_shape_and_report_rows() -> None:
    cfg = QueueConfig(reps=2, systems=("toko-sqlite", "arq-tuned"))
    runs = {
        "toko-sqlite": [_run(7000.0, 0.5, 2.0, 46080), _run(6500.0, 0.6, 2.5, 46080)],
        "arq-tuned": [_run(3000.0, 7.0, 13.0, 30720), {"noop": {"error": "boom"}}],
    }
    result = shape(cfg, runs, {"fsync_probe_ms": {"p50_ms": 0.3}})
    json.dumps(result)
    assert result["met"] is True and result["met_by"]["toko-sqlite"]["noop_jobs_per_s"]
    assert result["systems"]["arq-tuned"]["settings"]["noop"] == ARQ_TUNED
    ratio = result["ratios"]["toko-sqlite"]["arq-tuned"]
    assert ratio["noop_jobs_per_s"]["n"] == 1  # the failed repetition has no pair
    rows = report_rows(result)
    assert len(rows) == 3 and all(len(row) == 4 for row in rows)
    toko_row, arq_row, ratio_row = rows
    assert toko_row[0] == "(e) queue, toko, SQLite" and toko_row[3].endswith("✅ met")
    assert toko_row[2].startswith("6750 (6500-7000) · 675 (650-700) · 0.55 ms (0.50-0.60)")
    assert arq_row[3] == "" and arq_row[2].startswith("3000 · 300 · 7.00 ms")
    assert ratio_row[0] == "(e) ratio toko, SQLite ÷ arq (Redis), tuned"
    assert ratio_row[2].startswith("2.33 · 2.33 · 0.0714")
    md = markdown(result)
    assert "| toko, SQLite | 6750 (6500-7000) | 675 (650-700) | 0.55 ms (0.50-0.60)" in md[4]
    assert md[4].endswith("| ✅ all met |")
    assert md[5].startswith("| arq (Redis), tuned | 3000 |") and md[5].endswith("|  |")
    assert md[-2].startswith("| toko, SQLite ÷ arq (Redis), tuned | 2.33 | 2.33 | 0.0714")


def test_a_missed_target_fails_the_scenario() -> None:
    cfg = QueueConfig(reps=1, systems=("toko-sqlite", "toko-postgres"))
    runs = {"toko-sqlite": [_run(7000.0, 0.5, 2.0, 1)], "toko-postgres": [_run(900.0, 4, 9, 1)]}
    result = shape(cfg, runs)
    assert result["met"] is False and not result["met_by"]["toko-postgres"]["noop_jobs_per_s"]
    assert report_rows(result)[1][3].endswith("❌ missed")


def test_the_remote_row_measures_latency_only_and_is_not_held_to_the_targets() -> None:
    assert measures_of("toko-postgres-remote") == ("latency",)
    assert measures_of("toko-postgres") == ("noop", "sleep", "latency")
    assert needs(("toko-postgres-remote",)) == (True, False)
    systems = ("toko-sqlite", "toko-postgres-remote", "arq-tuned")
    remote = {"latency": _run(1.0, 1.5, 2.5, 1)["latency"]}
    runs = {
        "toko-sqlite": [_run(7000.0, 0.5, 2.0, 1)],
        "toko-postgres-remote": [remote],
        "arq-tuned": [_run(3000.0, 7.0, 13.0, 1)],
    }
    result = shape(QueueConfig(reps=1, systems=systems), runs)
    # Slower than p50 <= 1 ms and without drains, yet the scenario is met.
    assert result["met"] is True and "toko-postgres-remote" not in result["met_by"]
    assert list(result["systems"]["toko-postgres-remote"]["settings"]) == ["latency"]
    assert result["ratios"]["toko-postgres-remote"]["arq-tuned"]["latency_p50_ms"] is not None
    md = markdown(result)
    row = next(line for line in md if line.startswith("| toko, PostgreSQL, enqueued by"))
    assert "| n/a | n/a | 1.50 ms |" in row and row.endswith("| diagnostic ‡ |")
    assert any(line.startswith("‡ A job another toko-api instance") for line in md)


def test_smoke_config_is_smaller() -> None:
    smoke = QueueConfig().smoke()
    assert (smoke.jobs, smoke.reps, smoke.latency_seconds) == (1000, 1, 3.0)
    assert QueueConfig().jobs == 10_000 and QueueConfig().reps >= 3


def test_a_drain_cut_at_the_time_limit_keeps_its_rate_and_is_marked() -> None:
    cut = _run(25.0, 400.0, 500.0, 1024)
    cut["sleep"] = {"complete": False, "finished": 2000, "expect": 10000, "jobs_per_s": 25.0}
    barely = {"complete": False, "finished": 10, "expect": 10000, "jobs_per_s": 1.0}
    assert rep_metrics(cut)["sleep_jobs_per_s"] == 25.0
    assert rep_metrics({"noop": barely})["noop_jobs_per_s"] is None
    assert partial([cut]) == ["sleep"] and partial([_run(1.0, 1.0, 1.0, 1)]) == []
    cfg = QueueConfig(reps=1, systems=("toko-sqlite", "arq-default"))
    result = shape(cfg, {"toko-sqlite": [_run(7000.0, 0.5, 2.0, 1)], "arq-default": [cut]})
    assert result["partial"] == {"arq-default": ["sleep"]}
    toko_row, arq_row, _ = report_rows(result)
    assert "†" not in toko_row[2] and arq_row[2].startswith("25 · 25 † · 400.00 ms")
    assert "† drain cut at 90.0 s" in arq_row[1]
