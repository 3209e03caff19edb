"""The database turns read-only under toko-api (a failover that lands on a
standby, an admin's ``default_transaction_read_only``): writes get a 503,
reads go on, /healthz says the store cannot write, and it says so until
writes work again, which it notices by itself with nobody writing."""

from __future__ import annotations

import aiohttp

from tests.conftest import ServiceFactory
from tests.support.api import create_products, healthz, wait_healthy
from tests.support.postgres import PostgresCluster, fetch, pg_env
from tests.support.scrape import scrape

STORE_DOWN = {"error": "storage is unavailable; try again shortly"}


async def fail_over(cluster: PostgresCluster, url: str, *, read_only: bool) -> None:
    """Make new sessions read-only (or not), then drop toko-api's current ones,
    as a failover would: every connection it makes next lands on the new side."""
    name = url.rsplit("/", 1)[1]
    setting = "SET default_transaction_read_only = on" if read_only else "RESET ALL"
    # From another database: a read-only one refuses ALTER DATABASE too.
    conn = await cluster.connect()
    try:
        await conn.execute(f'ALTER DATABASE "{name}" {setting}')
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = $1 AND application_name = 'toko-api'",
            name,
        )
    finally:
        await conn.close()


async def test_a_read_only_database_is_unhealthy_until_writes_work_again(
    service_factory: ServiceFactory, pg_cluster: PostgresCluster, pg_url: str
) -> None:
    api = service_factory(pg_env(pg_cluster, pg_url)).start()
    await api.async_wait_ready(timeout=30)
    async with aiohttp.ClientSession() as session:
        [before] = await create_products(session, api.base_url, ["before"])
        await fail_over(pg_cluster, pg_url, read_only=True)

        # The first writes may meet a connection the failover cut (also a
        # 503); within a few, the database itself refuses them.
        health: dict[str, object] = {}
        for i in range(10):
            async with session.post(
                f"{api.base_url}/produk", json={"nama": f"during {i}", "harga": 1}
            ) as resp:
                assert (resp.status, await resp.json()) == (503, STORE_DOWN)
            status, health = await healthz(session, api.base_url)
            assert status == 503, health
            if "read-only transaction" in str(health["error"]):
                break
        assert str(health["error"]).startswith("storage cannot write: "), health
        assert "read-only transaction" in str(health["error"]), health
        assert "queue" in health, "reads still answer"
        async with session.get(f"{api.base_url}/produk/{before['id']}") as resp:
            assert resp.status == 200
        assert (await scrape(session, api.base_url)).value("toko_store_writable") == 0

        await fail_over(pg_cluster, pg_url, read_only=False)
        # No POST in between: /healthz's own probe finds writes work again.
        await wait_healthy(session, api.base_url, 15)
        assert (await scrape(session, api.base_url)).value("toko_store_writable") == 1
        [after] = await create_products(session, api.base_url, ["after"])

    stored = await fetch(pg_cluster, pg_url, "SELECT id FROM products ORDER BY id")
    assert stored == [(before["id"],), (after["id"],)]
    assert await fetch(pg_cluster, pg_url, "SELECT count(*) FROM jobs") == [(2,)]
    api.terminate()
    assert await api.async_wait_exit(timeout=30) == 0
