"""Timeouts a DBA sets on the toko role or database, which toko never sets itself
(`ALTER DATABASE toko SET idle_session_timeout = '2s'`, as managed servers do).

Each test sets one on a fresh database, then measures what an admin or a
client sees: connections kept or lost, log lines, exit codes and messages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

from service.store.base import StoreError
from service.store.postgres import PostgresStore
from service.store.postgres.migrations import LATEST_VERSION as PG_LATEST
from service.store.postgres.migrations import MIGRATION_LOCK
from tests.conftest import ServiceFactory
from tests.support.api import create_product
from tests.support.postgres import PostgresCluster, fetch, pg_env
from tests.support.tools import run_tool

# Where the sweep would find a job the LISTEN connection missed: after up to 1 s.
WOKEN_WITHIN_SECONDS = 0.5


async def set_for_database(cluster: PostgresCluster, url: str, **settings: str) -> None:
    """``ALTER DATABASE … SET``: every session that starts afterwards has them."""
    name = url.rsplit("/", 1)[1]
    conn = await cluster.connect(name)
    try:
        for setting, value in settings.items():
            await conn.execute(f"ALTER DATABASE \"{name}\" SET {setting} = '{value}'")
    finally:
        await conn.close()


async def until(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:  # noqa: ASYNC109
    """Poll the database (pg_stat_activity has no event to await) until ``check``."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.05)


async def test_idle_session_timeout_leaves_toko_api_listening(
    service_factory: ServiceFactory, pg_cluster: PostgresCluster, pg_url: str
) -> None:
    # The server closed the LISTEN connection after each second idle: a
    # warning every 2 s, and jobs other processes enqueued meanwhile waited
    # for the sweep.
    await set_for_database(pg_cluster, pg_url, idle_session_timeout="1s")
    api = service_factory(pg_env(pg_cluster, pg_url)).start()
    await api.async_wait_ready(timeout=30)
    assert api.find_logs(
        "the database's idle_session_timeout is 1s: toko's own sessions use 0 (none),"
        " since its LISTEN and pooled connections wait idle by design"
    )

    async def listen_idle_for_3_seconds() -> bool:
        assert api.returncode is None, api.output_tail()
        rows = await fetch(
            pg_cluster,
            pg_url,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = 'toko-api' AND query LIKE 'LISTEN%' AND state = 'idle'"
            " AND now() - state_change > interval '3 s'",
        )
        return bool(rows[0][0])

    await until(listen_idle_for_3_seconds, 15, "the LISTEN connection idle for 3 s")
    assert not api.find_logs("the LISTEN connection closed; reconnecting")
    # A job another process enqueues (toko-queue retry, toko-alert, another
    # host) starts at once: the NOTIFY reached the idle connection.
    enqueued_at = time.time()
    [(job_id,)] = await fetch(
        pg_cluster,
        pg_url,
        "INSERT INTO jobs (kind, payload, max_attempts, run_at, created_at, updated_at)"
        " VALUES ('product_email', $2::jsonb, 3, $1, $1, $1) RETURNING id",
        enqueued_at,
        '{"product_id": 1, "nama": "x", "harga": 1}',
    )

    async def started() -> bool:
        rows = await fetch(pg_cluster, pg_url, "SELECT attempts FROM jobs WHERE id = $1", job_id)
        return bool(rows[0][0])

    await until(started, WOKEN_WITHIN_SECONDS, "the job started by its NOTIFY")
    async with aiohttp.ClientSession() as session:  # pooled connections idle as long
        await create_product(session, api.base_url, "after a quiet while", 1)
    assert not [r for r in api.logs.snapshot() if r.get("level") in ("WARNING", "ERROR")][1:], (
        api.output_tail()
    )  # the one warning is about the API token
    api.terminate()
    assert await api.async_wait_exit(timeout=30) == 0


@pytest.mark.parametrize("setting", ["lock_timeout", "statement_timeout"])
async def test_start_up_waits_for_the_migration_lock_past_the_databases_timeout(
    service_factory: ServiceFactory, pg_cluster: PostgresCluster, pg_url: str, setting: str
) -> None:
    # toko-backup --restore holds this lock for the whole restore, and an
    # instance upgrading the schema for its upgrade: toko-api exited at
    # start ("canceling statement due to lock timeout") instead of waiting.
    await set_for_database(pg_cluster, pg_url, **{setting: "200ms"})
    holder = await pg_cluster.connect(pg_url.rsplit("/", 1)[1])
    try:
        await holder.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK)
        api = service_factory(pg_env(pg_cluster, pg_url)).start()

        async def waited_a_second() -> bool:
            assert api.returncode is None, api.output_tail()
            return bool(
                await holder.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'toko-api'"
                    " AND wait_event_type = 'Lock' AND now() - query_start > interval '1 s'"
                )
            )

        await until(waited_a_second, 15, "toko-api waiting for the migration lock for 1 s")
        await holder.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK)
    finally:
        await holder.close()
    await api.async_wait_ready(timeout=30)
    api.wait_log(f"database schema created at version {PG_LATEST}")
    api.terminate()
    assert await api.async_wait_exit(timeout=30) == 0


async def test_retry_all_failed_outlasts_a_statement_timeout(
    pg_cluster: PostgresCluster, pg_url: str, tmp_path: Path
) -> None:
    # One update of the whole backlog took longer than the database allows
    # any statement: `toko-queue retry --all-failed` failed (exit 1) however
    # often it was run. In chunks, each statement takes milliseconds.
    store = PostgresStore(pg_url, password=pg_cluster.password)
    await store.open()  # the schema
    await store.close()
    backlog = 200_000
    await fetch(
        pg_cluster,
        pg_url,
        "INSERT INTO jobs (kind, payload, state, attempts, max_attempts, run_at, created_at,"
        " updated_at, last_error) SELECT 'product_email', '{}', 'failed', 5, 5, 0, 0, 0, 'x'"
        " FROM generate_series(1, $1)",
        backlog,
    )
    await fetch(pg_cluster, pg_url, "ANALYZE jobs")
    await set_for_database(pg_cluster, pg_url, statement_timeout="250ms")
    result = run_tool(
        "toko-queue", tmp_path, pg_env(pg_cluster, pg_url), "retry", "--all-failed", "--json"
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert await fetch(pg_cluster, pg_url, "SELECT state, count(*) FROM jobs GROUP BY 1") == [
        ("pending", backlog)
    ]


@pytest.mark.parametrize("setting", ["lock_timeout", "statement_timeout"])
async def test_a_call_cut_short_by_the_server_names_the_setting(
    pg_cluster: PostgresCluster,
    pg_url: str,
    setting: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The server's message ("canceling statement due to statement timeout")
    # does not name the setting; and asyncpg files the cancel with the lost
    # connections, so each read was made 9 times over, each time logging
    # "database connection lost, trying again".
    await set_for_database(pg_cluster, pg_url, **{setting: "300ms"})
    store = PostgresStore(pg_url, password=pg_cluster.password)
    await store.open()
    blocker = await pg_cluster.connect(pg_url.rsplit("/", 1)[1])
    try:
        async with blocker.transaction():
            await blocker.execute("SET LOCAL lock_timeout = 0; SET LOCAL statement_timeout = 0")
            await blocker.execute("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE")
            server_log_before = pg_cluster.logfile.read_text()
            with (
                caplog.at_level(logging.WARNING, logger="toko.store"),
                pytest.raises(StoreError) as failed,
            ):
                await store.counts()
            # The server logs each cancel before it answers: what it said so far.
            server_log = pg_cluster.logfile.read_text()[len(server_log_before) :]
    finally:
        await blocker.close()
        await store.close()
    words = setting.replace("_", " ")
    assert str(failed.value) == (
        f"database call failed: canceling statement due to {words}"
        f" (the {setting} set for this role or database is too short for it)"
    )
    assert not caplog.records
    # Made once: counted by the server, not by the clock of a busy machine.
    assert server_log.count(f"canceling statement due to {words}") == 1, server_log


async def test_restore_keeps_the_migration_lock_past_an_idle_session_timeout(
    pg_cluster: PostgresCluster, pg_url: str, tmp_path: Path
) -> None:
    # The session holding the lock waits idle while pg_dump and pg_restore
    # run: the server closed it mid-restore, and with it the lock that keeps
    # a starting toko-api out of a half-restored schema. The restore said
    # nothing of it.
    env = pg_env(pg_cluster, pg_url, TOKO_BACKUP_DIR=str(tmp_path / "backups"))
    store = PostgresStore(pg_url, password=pg_cluster.password)
    await store.open()  # the schema
    await store.close()
    # Enough rows that the dump and the restore take longer than the timeout.
    await fetch(
        pg_cluster,
        pg_url,
        "INSERT INTO products (nama, harga, created_at)"
        " SELECT 'p' || n, 1, 0 FROM generate_series(1, 200000) AS n",
    )
    backup = run_tool("toko-backup", tmp_path, env)
    assert backup.returncode == 0, backup.stderr
    await set_for_database(pg_cluster, pg_url, idle_session_timeout="100ms")
    server_log_before = pg_cluster.logfile.read_text()
    archive = backup.stdout.splitlines()[-1]  # after the log line
    restore = run_tool("toko-backup", tmp_path, env, "--restore", archive)
    assert restore.returncode == 0, restore.stderr
    server_log = pg_cluster.logfile.read_text()[len(server_log_before) :]
    assert "idle-session timeout" not in server_log, server_log
