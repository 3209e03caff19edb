from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator

import pytest

from bench.pg_autovacuum import Run, by_window, log_every_run, log_size, parse, runs_in_log
from bench.scenario_disk import verdict_lines
from tests.support.postgres import PostgresCluster, acquire_cluster, fetch_sync, release_cluster

# As PostgreSQL 15 logged it in a run of (g).
LOG = """\
2026-12-07 12:45:47.793 UTC [18441] LOG:  checkpoint starting: immediate force wait
2026-12-07 12:46:04.923 UTC [18486] LOG:  automatic vacuum of table "disk_70eeafef.public.jobs": index scans: 0
\tpages: 0 removed, 1570 remain, 1570 scanned (100.00% of total)
\tbuffer usage: 3245 hits, 2 misses, 1572 dirtied
\tsystem usage: CPU: user: 0.01 s, system: 0.00 s, elapsed: 0.37 s
2026-12-07 12:46:05.112 UTC [18486] LOG:  automatic analyze of table "disk_70eeafef.public.jobs"
\tbuffer usage: 2021 hits, 3 misses, 10 dirtied
\tsystem usage: CPU: user: 0.13 s, system: 0.01 s, elapsed: 0.18 s
2026-12-07 12:46:24.582 UTC [18487] LOG:  automatic aggressive vacuum of table "template1.pg_catalog.pg_class": index scans: 0
\tsystem usage: CPU: user: 0.00 s, system: 0.00 s, elapsed: 0.00 s
"""  # noqa: E501


def _epoch(stamp: str) -> float:
    return dt.datetime.fromisoformat(stamp).replace(tzinfo=dt.UTC).timestamp()


def test_each_run_ends_when_logged_and_starts_its_elapsed_time_before() -> None:
    runs = parse(LOG)
    assert [(r.what, r.table) for r in runs] == [
        ("vacuum", "disk_70eeafef.public.jobs"),
        ("analyze", "disk_70eeafef.public.jobs"),
        ("vacuum", "template1.pg_catalog.pg_class"),
    ]
    vacuum = runs[0]
    assert vacuum.end == _epoch("2026-12-07 12:46:04.923")
    assert vacuum.start == pytest.approx(vacuum.end - 0.37)
    assert (vacuum.database, vacuum.relation) == ("disk_70eeafef", "jobs")


def test_runs_fall_in_every_window_they_overlap_and_other_databases_are_named_once() -> None:
    t0 = 1000.0
    runs = [
        Run("vacuum", "mine.public.jobs", t0 + 4.8, t0 + 5.2),  # windows 0 and 1
        Run("analyze", "mine.public.jobs", t0 + 5.2, t0 + 5.3),
        Run("vacuum", "other.public.products", t0 + 11.0, t0 + 11.5),
        Run("analyze", "other.pg_catalog.pg_class", t0 + 11.5, t0 + 11.6),
        Run("vacuum", "mine.public.products", t0 - 3.0, t0 - 1.0),  # before the schedule
        Run("vacuum", "mine.public.products", t0 + 30.0, t0 + 31.0),  # after it
    ]
    windows = by_window(runs, t0=t0, window_s=5.0, count=3, database="mine")
    assert windows == [
        ["vacuum jobs"],
        ["vacuum jobs", "analyze jobs"],
        ["database other"],
    ]


def test_the_run_names_autovacuum_windows_and_those_over_target() -> None:
    run = {
        "label": "postgres-1000",
        "backend": "postgres",
        "checks": {"p99_every_window": False, "max_within_target": True, "all_201": True},
        "windows_over_p99_target": [55.0],
        "worst_window_p99_ms": 15.65,
        "p99_target_ms": 5.0,
        "max_ms": 59.3,
        "max_target_ms": 100.0,
        "non_201": 0,
        "generator_kept_up": True,
        "worst_window_lateness_p99_ms": 1.1,
        "lateness_limit_ms": 2.0,
        "autovacuum": {"10.0": ["analyze jobs"], "55.0": ["vacuum jobs", "vacuum products"]},
    }
    assert verdict_lines(run)[-1] == (
        "info postgres-1000: the server's autovacuum ran in 10 s (analyze jobs);"
        " 55 s (vacuum jobs, vacuum products, over target)"
    )
    run["autovacuum"] = {}
    assert verdict_lines(run)[-1].endswith("ran in no window")
    run["backend"] = "sqlite"
    assert not verdict_lines(run)[-1].startswith("info postgres-1000: the server's")


@pytest.fixture
def quick_autovacuum() -> Iterator[PostgresCluster]:
    """The process's shared cluster, its autovacuum launcher waking every second."""
    cluster = acquire_cluster()
    url = cluster.url()
    fetch_sync(cluster, url, "ALTER SYSTEM SET autovacuum_naptime = 1")
    fetch_sync(cluster, url, "SELECT pg_reload_conf()")
    try:
        yield cluster
    finally:
        fetch_sync(cluster, url, "ALTER SYSTEM RESET autovacuum_naptime")
        fetch_sync(cluster, url, "SELECT pg_reload_conf()")
        release_cluster()


@pytest.mark.postgres
def test_a_real_server_s_autovacuum_is_read_back_from_its_log(
    quick_autovacuum: PostgresCluster,
) -> None:
    cluster = quick_autovacuum
    log_every_run(cluster)
    offset = log_size(cluster)
    url = cluster.create_database("vac")
    database = url.rsplit("/", 1)[1]
    before = time.time()
    fetch_sync(
        cluster,
        url,
        "CREATE TABLE jobs (id int) WITH (autovacuum_vacuum_insert_threshold = 1,"
        " autovacuum_vacuum_insert_scale_factor = 0)",
    )
    fetch_sync(cluster, url, "INSERT INTO jobs SELECT generate_series(1, 1000)")
    # The server tells nobody but its log; look until the launcher's visit shows.
    deadline = time.monotonic() + 60
    while True:
        mine = [r for r in runs_in_log(cluster.logfile, offset) if r.database == database]
        if any(r.what == "vacuum" for r in mine) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    vacuum = next(r for r in mine if r.what == "vacuum")
    assert vacuum.table == f"{database}.public.jobs"
    # Stamped in UTC to the millisecond: within this test's own span.
    assert before - 0.01 <= vacuum.start <= vacuum.end <= time.time() + 0.01
    windows = by_window(mine, t0=before, window_s=60.0, count=2, database=database)
    assert "vacuum jobs" in windows[0]
