"""Retention: toko-recap prunes done jobs older than TOKO_JOB_RETENTION, nothing else."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from service.models import NewJob
from service.settings import ConfigError, Settings
from service.store.sqlite import SqliteStore
from tests.operability.cli import run
from tests.support import db

DAY = 86400.0


class Clock:
    """A settable clock, so rows are written with the times a test needs."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def job_in_state(store: SqliteStore, clock: Clock, at: float, state: str, kind: str) -> int:
    """A job that reached ``state`` at time ``at``, written through the store itself."""
    clock.now = at
    job_id = await store.enqueue(NewJob(kind, {"n": 1}, max_attempts=1))
    if state == "pending":
        return job_id
    (claimed,) = await store.claim(1, 60)
    assert claimed.id == job_id
    if state == "done":
        await store.complete([claimed])
    elif state == "failed":
        await store.fail(claimed, "boom")
    return job_id


async def test_recap_prunes_only_old_done_jobs(tmp_path: Path) -> None:
    database = tmp_path / "toko.db"
    now = time.time()
    clock = Clock(now)
    store = SqliteStore(str(database), clock=clock)
    await store.open()
    try:
        old_done = [
            await job_in_state(store, clock, now - 8 * DAY, "done", "product_email")
            for _ in range(3)
        ]
        recent_done = await job_in_state(store, clock, now - 6 * DAY, "done", "product_email")
        old_failed = await job_in_state(store, clock, now - 30 * DAY, "failed", "product_email")
        # An old recap whose email went out: its recap row must survive the prune.
        clock.now = now - 9 * DAY
        recap_job = await store.record_recap(
            "2020-01-01", 0, 0, NewJob("recap_email", {}, max_attempts=1)
        )
        assert recap_job is not None
        (claimed,) = await store.claim(1, 60)
        assert claimed.id == recap_job
        await store.complete([claimed])
        # Last: a pending job would be the first one claimed above.
        old_pending = await job_in_state(store, clock, now - 30 * DAY, "pending", "product_email")
    finally:
        await store.close()

    result = await run(
        "toko-recap",
        "--period",
        "2026-01-01",
        env={"TOKO_DATABASE": str(database), "TOKO_JOB_RETENTION": "7d"},
    )
    assert result.returncode == 0, result
    (pruned,) = [r for r in result.log_records() if r.get("message") == "done jobs pruned"]
    assert pruned["PRUNED"] == 4 and pruned["RETENTION"] == "7d", pruned

    remaining = {job["id"]: job["state"] for job in db.jobs(database)}
    for job_id in [*old_done, recap_job]:
        assert job_id not in remaining
    assert remaining[recent_done] == "done"
    assert remaining[old_failed] == "failed"
    assert remaining[old_pending] == "pending"
    # The new recap's own email job (pending) is there too.
    assert sorted(remaining.values()).count("pending") == 2
    recaps = db.query(database, "SELECT period, job_id FROM recaps ORDER BY period")
    assert recaps[0] == {"period": "2020-01-01", "job_id": None}
    assert recaps[1]["period"] == "2026-01-01" and recaps[1]["job_id"] in remaining


async def test_purge_works_in_chunks(tmp_path: Path) -> None:
    clock = Clock(1_000_000.0)
    store = SqliteStore(str(tmp_path / "toko.db"), clock=clock)
    await store.open()
    try:
        for _ in range(7):
            await job_in_state(store, clock, 1_000_000.0, "done", "k")
        assert await store.purge_done(1_000_000.0, chunk=3) == 0  # not older than the cut
        assert await store.purge_done(1_000_001.0, chunk=3) == 6
        assert (await store.counts()).done == 1  # the newest (next test)
    finally:
        await store.close()


async def test_retention_counts_from_when_a_job_was_done_not_queued(tmp_path: Path) -> None:
    # A job queued long ago and done lately (an admin's retry of a failed one)
    # is a recent delivery: its row is what an admin looks for this week.
    clock = Clock(1_000_000.0)
    store = SqliteStore(str(tmp_path / "toko.db"), clock=clock)
    await store.open()
    try:
        late = await store.enqueue(NewJob("k", {}, max_attempts=1))
        await job_in_state(store, clock, 1_000_000.0, "pending", "k")  # the newest, kept anyway
        clock.now = 1_000_000.0 + 30 * DAY
        (claimed, _) = await store.claim(2, 60)
        assert claimed.id == late
        await store.complete([claimed])
        assert await store.purge_done(clock.now - 7 * DAY) == 0
        assert await store.purge_done(clock.now + 1) == 1
        assert await store.get_job(late) is None
    finally:
        await store.close()


async def test_purge_keeps_the_newest_job_so_no_id_is_given_twice(tmp_path: Path) -> None:
    # A job's id makes its email's Message-ID; SQLite numbers a new row one
    # past the largest id, so purging the newest would hand its id on.
    clock = Clock(1_000_000.0)
    store = SqliteStore(str(tmp_path / "toko.db"), clock=clock)
    await store.open()
    try:
        first = await job_in_state(store, clock, 1_000_000.0, "done", "k")
        assert await store.purge_done(2_000_000.0, chunk=3) == 0
        second = await job_in_state(store, clock, 1_000_000.0, "done", "k")
        assert second == first + 1
        assert await store.purge_done(2_000_000.0, chunk=3) == 1
        assert await store.get_job(first) is None and await store.get_job(second) is not None
    finally:
        await store.close()


@pytest.mark.parametrize(
    ("raw", "seconds"), [("7d", 7 * DAY), ("36h", 36 * 3600.0), ("36500d", 36500 * DAY)]
)
def test_retention_setting(raw: str, seconds: float) -> None:
    assert Settings.from_env({"TOKO_JOB_RETENTION": raw}).jobs.retention == seconds


@pytest.mark.parametrize("raw", ["7", "7x", "30m", "-1d", "36501d", "99999999999999999999d"])
def test_bad_retention_names_the_variable(raw: str) -> None:
    with pytest.raises(ConfigError, match="TOKO_JOB_RETENTION"):
        Settings.from_env({"TOKO_JOB_RETENTION": raw})
