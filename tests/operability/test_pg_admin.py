"""Queue administration (toko-queue, retention) on PostgreSQL: the QueueAdmin protocol."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from jobs import queue_admin
from service.models import JobState, NewJob
from service.store.postgres import PostgresStore
from service.store.postgres.admin import PURGE_DONE_SQL, list_jobs_sql
from service.store.roles import QueueAdmin
from tests.support.backends import FakeClock
from tests.support.postgres import PostgresCluster, fetch
from tests.support.service import free_port
from tests.support.tools import run_tool


@pytest.fixture
async def store(pg_cluster: PostgresCluster, pg_url: str) -> AsyncIterator[PostgresStore]:
    s = PostgresStore(pg_url, password=pg_cluster.password, clock=FakeClock())
    await s.open()
    yield s
    await s.close()


def clock_of(store: PostgresStore) -> FakeClock:
    clock = store._clock
    assert isinstance(clock, FakeClock)
    return clock


async def test_the_postgres_store_is_a_queue_admin(store: PostgresStore) -> None:
    # toko-recap prunes only when the store is one (isinstance on the protocol).
    assert isinstance(store, QueueAdmin)


async def test_stats_list_details_and_retry_of_failed_jobs(
    pg_cluster: PostgresCluster, pg_url: str, store: PostgresStore
) -> None:
    clock = clock_of(store)
    ids = [await store.enqueue(NewJob(kind, {}, 1)) for kind in ("a", "a", "b")]
    for _ in ids:
        (job,) = await store.claim(1, 60)
        await store.fail(job, f"broken {job.id}")
        clock.now += 1
    stats = await store.queue_stats()
    assert stats.counts.failed == 3 and stats.oldest_pending_run_at is None
    assert stats.by_kind["a"]["failed"] == 2 and stats.by_kind["b"]["failed"] == 1
    listed = await store.list_jobs("failed", 10)
    assert [d.job.id for d in listed] == list(reversed(ids))  # most recently updated first
    details = await store.job_details(ids[0])
    assert details is not None and details.job.last_error == f"broken {ids[0]}"
    assert await store.job_details(10_000) is None

    other = PostgresStore(pg_url, password=pg_cluster.password)
    await other.open()
    heard = asyncio.Event()
    other.add_wakeup_listener(heard.set)
    try:
        async with asyncio.timeout(5):
            await heard.wait()  # listening
        heard.clear()
        assert await store.retry_now([ids[1], 99_999], "failed") == [ids[1]]
        async with asyncio.timeout(5):
            await heard.wait()  # another instance hears that a job is due
        assert sorted(await store.retry_now(None, "failed")) == [ids[0], ids[2]]
        assert await store.retry_now(None, "failed") == []
    finally:
        await other.close()
    rows = await fetch(
        pg_cluster, pg_url, "SELECT state, attempts, last_error FROM jobs ORDER BY id"
    )
    assert rows == [("pending", 0, f"broken {i}") for i in ids]
    assert (await store.queue_stats()).oldest_pending_run_at == clock.now


async def test_purge_deletes_old_done_jobs_in_chunks_and_keeps_recaps(
    pg_cluster: PostgresCluster, pg_url: str, store: PostgresStore
) -> None:
    clock = clock_of(store)
    recap_job = await store.record_recap("2026-11-01", 1, 1, NewJob("recap_email", {}, 1))
    old = [await store.enqueue(NewJob("k", {}, 1)) for _ in range(7)]
    jobs = await store.claim(100, 60)
    await store.complete(jobs)
    clock.now += 1000
    new = await store.enqueue(NewJob("k", {}, 1))
    (job,) = await store.claim(1, 60)
    await store.complete([job])
    pending = await store.enqueue(NewJob("k", {}, 1))

    assert await store.purge_done(clock.now - 500, chunk=3) == len(old) + 1
    left = await fetch(pg_cluster, pg_url, "SELECT id FROM jobs ORDER BY id")
    assert left == [(new,), (pending,)]
    assert await fetch(pg_cluster, pg_url, "SELECT period, job_id FROM recaps") == [
        ("2026-11-01", None)
    ]
    assert recap_job is not None
    # The period stays recorded: a second run is still a no-op.
    assert await store.record_recap("2026-11-01", 1, 1, NewJob("recap_email", {}, 1)) is None


async def generic_plan(
    pg_cluster: PostgresCluster, pg_url: str, sql: str, parameters: str
) -> list[str]:
    """The plan of ``sql`` whatever its parameters, as PostgreSQL may settle on
    for a statement prepared once and run again and again (asyncpg does)."""
    conn = await pg_cluster.connect(pg_url.rsplit("/", 1)[1])
    try:
        await conn.execute("SET plan_cache_mode = force_generic_plan")
        # An empty table is cheapest read whole: plan as for a big one.
        await conn.execute("SET enable_seqscan = off")
        await conn.execute(f"PREPARE planned AS {sql}")
        plan = await conn.fetch(f"EXPLAIN (COSTS OFF) EXECUTE planned({parameters})")
        return [str(row[0]) for row in plan]
    finally:
        await conn.close()


@pytest.mark.parametrize("state", ["done", "failed"])
async def test_done_and_failed_jobs_are_listed_in_order_from_their_own_index(
    pg_cluster: PostgresCluster, pg_url: str, store: PostgresStore, state: JobState
) -> None:
    # `toko-queue list --state failed` read the whole table: 0.12 s for
    # 2 million jobs. With the state a parameter, a generic plan could use
    # no partial index, done jobs' included.
    plan = await generic_plan(pg_cluster, pg_url, list_jobs_sql(state), "50")
    scans = [line.split("->")[-1].strip() for line in plan if "Scan" in line]
    # Done jobs with the same time then sort by id: an incremental sort, of ties only.
    assert scans == [f"Index Scan Backward using jobs_{state}_updated_at on jobs"], plan


async def test_a_purge_finds_old_done_jobs_by_their_own_index(
    pg_cluster: PostgresCluster, pg_url: str, store: PostgresStore
) -> None:
    plan = await generic_plan(pg_cluster, pg_url, PURGE_DONE_SQL, "1.0, 1000")
    assert any("Index Scan using jobs_done_updated_at on jobs" in line for line in plan), plan


def test_toko_queue_without_the_password_says_how_to_give_it(
    pg_cluster: PostgresCluster, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The password file is root's: `sudo -u toko toko-queue`, which the hint
    # used to suggest, gets no password either.
    for name in ("TOKO_DATABASE_PASSWORD_FILE", "CREDENTIALS_DIRECTORY", "PGPASSWORD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TOKO_DATABASE", pg_cluster.url())
    assert queue_admin.main(["stats"]) == 1
    err = capsys.readouterr().err
    assert "LoadCredential=db-password:/etc/toko/db-password" in err, err
    assert "sudo -u toko" not in err, err

    # Given a wrong password, the error says so and no hint about users follows.
    wrong = pg_cluster.folder / "wrong-password"
    wrong.write_text("not it\n")
    monkeypatch.setenv("TOKO_DATABASE_PASSWORD_FILE", str(wrong))
    assert queue_admin.main(["stats"]) == 1
    err = capsys.readouterr().err
    assert "password authentication failed" in err, err
    assert "sudo" not in err, err


def test_toko_queue_on_a_server_that_is_down_says_so_in_its_own_lines(tmp_path: Path) -> None:
    # No server on the port: while the store retries, its warnings came out
    # bare, and the last line blamed the missing password (a password brings
    # no server up). A real process: in pytest's, logging is set up already.
    url = f"postgresql://toko@127.0.0.1:{free_port()}/toko"
    result = run_tool("toko-queue", tmp_path, {"TOKO_DATABASE": url}, "--no-env-file", "stats")
    assert result.returncode == 1, result
    lines = result.stderr.splitlines()
    assert any("database not reachable yet, retrying" in line for line in lines), lines
    assert all(line.startswith("toko-queue: ") for line in lines), lines
    assert lines[-1].startswith(f"toko-queue: cannot open database {url}: "), lines
    assert "no database password" not in result.stderr, lines
