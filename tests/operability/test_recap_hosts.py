"""toko-recap started on three "hosts" at the same moment for the same period.

The timers stay enabled everywhere; the database decides: an advisory lock on
the period plus the period's unique row. One row, one email job, one email.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, date, datetime, time, timedelta
from pathlib import Path
from unittest.mock import ANY

import pytest

from jobs import recap
from jobs.common import JobFailed
from service.mail_message import message_id
from service.models import Product
from service.settings import Settings, StoreSettings
from service.store.postgres import PostgresStore
from service.tasks import product_email_job
from tests.conftest import ServiceFactory
from tests.support.postgres import PostgresCluster, fetch, pg_env
from tests.support.smtp import SmtpServer
from tests.support.tools import clean_env, tool_command

HOSTS = 3
PRODUCTS = 7


def _job(product: Product) -> object:
    return product_email_job(product, 3)


def _messages(stdout: str) -> list[str]:
    return [json.loads(line)["message"] for line in stdout.splitlines() if line.startswith("{")]


async def test_three_hosts_one_recap_row_one_email(
    tmp_path: Path,
    pg_cluster: PostgresCluster,
    pg_url: str,
    smtp: SmtpServer,
    service_factory: ServiceFactory,
) -> None:
    # Products made yesterday noon (UTC, the hosts' zone below): a recap is of a day that is over.
    yesterday = datetime.now(UTC).date() - timedelta(days=1)
    noon = datetime.combine(yesterday, time(12), UTC).timestamp()
    store = PostgresStore(pg_url, password=pg_cluster.password, clock=lambda: noon)
    await store.open()
    try:
        await asyncio.gather(*(store.create_product(f"p{i}", i, _job) for i in range(PRODUCTS)))
    finally:
        await store.close()
    period = yesterday.isoformat()
    env = pg_env(pg_cluster, pg_url, TZ="UTC")
    command = tool_command("toko-recap", "--period", period)
    procs = [
        await asyncio.create_subprocess_exec(
            *command,
            env=clean_env(tmp_path, env),
            cwd=tmp_path,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for _ in range(HOSTS)
    ]
    async with asyncio.timeout(60):
        results = await asyncio.gather(*(proc.communicate() for proc in procs))
    outputs = [(out.decode(), err.decode()) for out, err in results]
    assert [proc.returncode for proc in procs] == [0] * HOSTS, outputs
    said = [_messages(out) for out, _ in outputs]
    recorded = [m for m in said if "recap recorded" in m]
    skipped = [m for m in said if "recap already recorded for this period; nothing to do" in m]
    assert (len(recorded), len(skipped)) == (1, HOSTS - 1), said

    assert await fetch(
        pg_cluster, pg_url, "SELECT period, products_total, products_new FROM recaps"
    ) == [(period, PRODUCTS, PRODUCTS)]
    (job,) = await fetch(
        pg_cluster, pg_url, "SELECT id, created_at FROM jobs WHERE kind = 'recap_email'"
    )
    names = await fetch(
        pg_cluster,
        pg_url,
        "SELECT DISTINCT application_name FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name LIKE 'toko-%'",
    )
    assert names == [], f"a toko-recap left a connection open: {names}"

    # Two API instances (two hosts) drain the queue: still one recap email.
    apis = [service_factory({**env, "TOKO_SMTP_URL": smtp.url}).start() for _ in range(2)]
    await asyncio.gather(*(api.async_wait_ready(timeout=30) for api in apis))
    delivered = await smtp.async_wait_delivered(PRODUCTS + 1, timeout=30)
    assert message_id(*job, "localhost") in delivered
    recaps = [m for m in smtp.delivered() if m.subject == f"Rekap produk {period}"]
    assert len(recaps) == 1, recaps
    for api in apis:
        api.terminate()
    for api in apis:
        assert await api.async_wait_exit(timeout=30) == 0
    assert len([m for m in smtp.delivered() if "Rekap produk" in m.subject]) == 1


async def _local_today() -> date:
    """Today here, far enough from midnight for the test's runs to see the same day."""
    now = datetime.now().astimezone()
    midnight = datetime.combine(now.date() + timedelta(days=1), time(), now.tzinfo)
    if midnight - now < timedelta(seconds=20):
        await asyncio.sleep((midnight - now).total_seconds() + 0.5)
    return datetime.now().astimezone().date()


async def test_a_host_whose_clock_runs_ahead_recaps_no_day_that_is_not_over(
    pg_cluster: PostgresCluster, pg_url: str
) -> None:
    # A host a day ahead (or 15 minutes ahead at 23:55, its timer firing
    # "at 00:10"): its today is not the database server's. Recording today's
    # figures now would keep them partial for good: the real run on the next
    # day finds the day recorded, and today's later products are in no recap.
    today = await _local_today()
    settings = Settings(store=StoreSettings(database=pg_url, database_password=pg_cluster.password))
    yesterday = today - timedelta(days=1)
    assert await recap.record(settings, None, today) == {yesterday: ANY}
    ahead = today + timedelta(days=1)
    assert await recap.record(settings, None, ahead) == {yesterday: None}
    with pytest.raises(JobFailed, match=f"{today} has not ended yet"):
        await recap.record(settings, today, ahead)
    periods = await fetch(pg_cluster, pg_url, "SELECT period FROM recaps")
    assert periods == [(yesterday.isoformat(),)]
