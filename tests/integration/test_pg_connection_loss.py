"""The database drops every toko-api connection (failover, restart, admin kill):
toko-api keeps running, reconnects, and loses nothing it acknowledged."""

from __future__ import annotations

import aiohttp

from tests.conftest import ServiceFactory
from tests.support.api import create_products, wait_healthy
from tests.support.postgres import PostgresCluster, fetch, pg_env


async def test_toko_api_survives_its_connections_being_killed(
    service_factory: ServiceFactory, pg_cluster: PostgresCluster, pg_url: str
) -> None:
    # A short job timeout keeps the lease short (2 x 1 + 30 s): a claim whose
    # answer the kill swallowed leaves its jobs leased until then.
    api = service_factory(pg_env(pg_cluster, pg_url, TOKO_JOB_TIMEOUT="1")).start()
    await api.async_wait_ready(timeout=30)
    async with aiohttp.ClientSession() as session:
        before = await create_products(session, api.base_url, [f"before {i}" for i in range(5)])
        killed = await fetch(
            pg_cluster,
            pg_url,
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name = 'toko-api'",
        )
        assert killed[0][0] >= 2  # the pool and the LISTEN connection at least
        # Requests after the loss may get a 503 ("try again") until the pool
        # has reconnected; never a 500, and the service comes back by itself.
        statuses = []
        for i in range(10):
            async with session.post(
                api.base_url + "/produk", json={"nama": f"during {i}", "harga": 1}
            ) as resp:
                statuses.append(resp.status)
        assert set(statuses) <= {201, 503}, statuses
        await wait_healthy(session, api.base_url, 15)
        after = await create_products(session, api.base_url, [f"after {i}" for i in range(5)])
        # Every product acknowledged is stored with its job, and the jobs run.
        await wait_healthy(
            session,
            api.base_url,
            60,
            check=lambda b: b["queue"]["pending"] + b["queue"]["running"] == 0,
        )
    stored = {pid for (pid,) in await fetch(pg_cluster, pg_url, "SELECT id FROM products")}
    assert {p["id"] for p in before + after} <= stored
    assert len(stored) == len(before) + len(after) + statuses.count(201)
    done = await fetch(pg_cluster, pg_url, "SELECT count(*) FROM jobs WHERE state = 'done'")
    assert done == [(len(stored),)]
    # The LISTEN connection noticed and came back (wake-ups work again).
    await api.async_wait_log("the LISTEN connection closed; reconnecting", timeout=10)
    print(f"connection loss: statuses right after the kill {statuses}")
    api.terminate()
    assert await api.async_wait_exit(timeout=30) == 0
