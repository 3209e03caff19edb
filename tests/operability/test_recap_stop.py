"""toko-recap stopped by SIGTERM (systemctl stop, a shutdown) ends cleanly between days.

Its default action ended the run on the spot: systemd saw a run killed, and
nothing said which days were recorded. A day's recap is one transaction, so
the day under way commits and the run ends before the next one; while it
only waits for the database, it ends at once. Real processes, a real
PostgreSQL and real signals: an advisory lock on the first day's period
holds the run inside that day's transaction, and SIGSTOP freezes it while
the lock is let go, so the SIGTERM lands mid-day however fast the machine is.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import asyncpg  # type: ignore[import-untyped]  # no stubs shipped
import pytest

from service.models import NewJob
from service.store.postgres import PostgresStore
from service.store.postgres.migrations import RECAP_LOCK_CLASS
from service.store.postgres.transport import OPEN_RETRY_SECONDS
from tests.operability.cli import utc_today
from tests.support.postgres import PostgresCluster, fetch, pg_env
from tests.support.service import free_port
from tests.support.tools import clean_env, run_tool, tool_command

STOPPED = "toko-recap: stopped by SIGTERM before it finished"


async def start_recap(tmp_path: Path, env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *tool_command("toko-recap"),
        env=clean_env(tmp_path, env),
        cwd=tmp_path,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


@pytest.fixture
async def started() -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """Runs a test starts; any still there at the end (frozen, say) are killed."""
    procs: list[asyncio.subprocess.Process] = []
    yield procs
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
        await proc.communicate()


async def wait_for_lock_wait(cluster: PostgresCluster, url: str) -> None:
    """Until toko-recap's session waits for a lock (the period's advisory lock)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        waiting = await fetch(
            cluster,
            url,
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'toko-recap'"
            " AND wait_event_type = 'Lock'",
        )
        if waiting == [(1,)]:
            return
        await asyncio.sleep(0.01)
    pytest.fail("toko-recap never waited for the period's lock")


async def test_sigterm_mid_day_records_that_day_and_not_the_next(
    tmp_path: Path,
    pg_cluster: PostgresCluster,
    pg_url: str,
    started: list[asyncio.subprocess.Process],
) -> None:
    today = await utc_today()
    recorded_before, first, second = (today - timedelta(days=n) for n in (3, 2, 1))
    store = PostgresStore(pg_url, password=pg_cluster.password)
    await store.open()
    try:  # the last recap three days ago: the run catches up two days
        await store.record_recap(recorded_before.isoformat(), 0, 0, NewJob("recap_email", {}, 1))
    finally:
        await store.close()
    holder: asyncpg.Connection = await pg_cluster.connect(pg_url.rsplit("/", 1)[1])
    try:
        lock = holder.transaction()
        await lock.start()
        await holder.execute(
            "SELECT pg_advisory_xact_lock($1, hashtext($2))", RECAP_LOCK_CLASS, first.isoformat()
        )
        env = pg_env(pg_cluster, pg_url, TZ="UTC")
        proc = await start_recap(tmp_path, env)
        started.append(proc)
        await wait_for_lock_wait(pg_cluster, pg_url)
        # Frozen inside the first day's transaction; the signal waits for SIGCONT.
        proc.send_signal(signal.SIGSTOP)
        await lock.commit()
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGCONT)
        async with asyncio.timeout(60):
            out, err = await proc.communicate()
    finally:
        await holder.close()

    # Non-zero, as toko-backup's stop: systemd counts the run as failed and alerts.
    assert proc.returncode == 128 + signal.SIGTERM, (out, err)
    assert err.decode().splitlines() == [f"{STOPPED}; recorded: {first}; not recorded: {second}"]
    periods = await fetch(pg_cluster, pg_url, "SELECT period FROM recaps ORDER BY period")
    assert periods == [(recorded_before.isoformat(),), (first.isoformat(),)]
    left = await fetch(
        pg_cluster,
        pg_url,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'toko-recap'",
    )
    assert left == [(0,)], "the stopped run left a connection open"

    # The next run (the timer's next day, or a manual start) records the rest.
    result = run_tool("toko-recap", tmp_path, env)
    assert result.returncode == 0, result
    periods = await fetch(pg_cluster, pg_url, "SELECT period FROM recaps ORDER BY period")
    assert periods == [(day.isoformat(),) for day in (recorded_before, first, second)]


async def test_sigterm_while_the_database_is_not_reachable_ends_the_run_at_once(
    tmp_path: Path, started: list[asyncio.subprocess.Process]
) -> None:
    # At boot the database may come up after us: the run retries for 20 s.
    env = {"TOKO_DATABASE": f"postgresql://toko@127.0.0.1:{free_port()}/toko"}
    proc = await start_recap(tmp_path, env)
    started.append(proc)
    assert proc.stdout is not None
    async with asyncio.timeout(30):
        async for line in proc.stdout:
            if b"database not reachable yet, retrying" in line:
                break
        else:
            pytest.fail(f"the run did not retry (exit code {await proc.wait()})")
    stopped_at = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, (out, err)
    assert err.decode().splitlines() == [f"{STOPPED}; nothing recorded"]
    # Not after the rest of its retries (20 s of them, up to 5 s apart). The
    # bound is far from both that and a loaded machine's exit (4 s was close).
    assert time.monotonic() - stopped_at < OPEN_RETRY_SECONDS / 2
