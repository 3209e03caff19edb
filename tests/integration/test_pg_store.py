"""What only a shared database has: several store instances on one PostgreSQL.

Each ``PostgresStore`` here stands for one toko-api host (its own pool, its
own LISTEN connection); the contract suite itself runs in tests/unit on both
backends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from service import workers
from service.mail_message import Email
from service.models import Job, NewJob, Product
from service.store import postgres
from service.store.base import StoreError
from service.store.postgres import PostgresStore
from service.store.postgres import transport as pg_transport
from service.store.postgres.migrations import LATEST_VERSION
from service.store.postgres.queue import FOLD_CHANGES
from service.tasks import JobContext, product_email_job
from service.workers import PoolConfig, WorkerPool
from tests.support.postgres import PostgresCluster, fetch
from tests.support.service import free_port

HOSTS = 3


class Wakeups:
    """A wake-up callback that can be awaited: counts calls, sets an event."""

    def __init__(self) -> None:
        self.calls = 0
        self.event = asyncio.Event()

    def __call__(self) -> None:
        self.calls += 1
        self.event.set()

    async def next(self, timeout: float = 5.0) -> None:  # noqa: ASYNC109
        async with asyncio.timeout(timeout):
            await self.event.wait()
        self.event.clear()


@pytest.fixture
async def hosts(pg_cluster: PostgresCluster, pg_url: str) -> AsyncIterator[list[PostgresStore]]:
    stores = [PostgresStore(pg_url, password=pg_cluster.password) for _ in range(HOSTS)]
    for s in stores:
        await s.open()
    yield stores
    for s in stores:
        await s.close()


def email_job(product: Product) -> NewJob:
    return product_email_job(product, 3)


def email_job_leased(product: Product) -> NewJob:
    return product_email_job(product, 3, leased_for=60.0)


async def test_concurrent_starts_migrate_once(pg_cluster: PostgresCluster, pg_url: str) -> None:
    stores = [PostgresStore(pg_url, password=pg_cluster.password) for _ in range(5)]
    await asyncio.gather(*(s.open() for s in stores))
    try:
        assert await fetch(pg_cluster, pg_url, "SELECT version FROM toko_schema") == [
            (LATEST_VERSION,)
        ]
        product, _ = await stores[3].create_product("x", 1, email_job)
        assert (await stores[0].get_product(product.id)) == product
    finally:
        await asyncio.gather(*(s.close() for s in stores))


async def test_a_job_committed_anywhere_wakes_listeners_everywhere(
    hosts: list[PostgresStore],
) -> None:
    a, b, c = hosts
    heard_a, heard_c = Wakeups(), Wakeups()
    a.add_wakeup_listener(heard_a)
    c.add_wakeup_listener(heard_c)
    # The first call comes once LISTEN is in place (jobs may have come meanwhile).
    await heard_a.next()
    await heard_c.next()
    await b.enqueue(NewJob("k", {}, 3))
    await heard_a.next()
    await heard_c.next()
    # A product's job notifies in the product's transaction, once per batch.
    await asyncio.gather(*(b.create_product(f"p{i}", i, email_job) for i in range(20)))
    await heard_a.next()
    await heard_c.next()


async def test_only_pending_jobs_notify_a_job_enqueued_leased_is_its_own_instances(
    pg_cluster: PostgresCluster, pg_url: str, hosts: list[PostgresStore]
) -> None:
    store = hosts[0]
    heard: asyncio.Queue[int] = asyncio.Queue()
    conn = await pg_cluster.connect(pg_url.rsplit("/", 1)[1])
    try:
        await conn.add_listener("toko_jobs", lambda *_: heard.put_nowait(1))
        await store.enqueue(NewJob("k", {}, 3, leased_for=60.0))
        await asyncio.gather(
            *(store.create_product(f"p{i}", i, email_job_leased) for i in range(3))
        )
        await store.enqueue(NewJob("k", {}, 3))
        async with asyncio.timeout(5):
            await heard.get()
        # Notifications arrive in commit order: had a leased insert notified,
        # its notification would have come first and still be queued.
        assert heard.empty()
    finally:
        await conn.close()


async def test_an_idle_pool_wakes_at_once_for_another_instances_job(
    hosts: list[PostgresStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sweep would take a minute: only the NOTIFY can be this fast.
    monkeypatch.setattr(workers, "SWEEP_SECONDS", 60.0)
    a, b, _ = hosts
    ran: asyncio.Queue[int] = asyncio.Queue()

    async def handler(job: Job, ctx: JobContext) -> None:
        ran.put_nowait(job.id)

    pool = WorkerPool(a, _context(), {"k": handler}, PoolConfig(workers=2, job_timeout=5.0))
    listening = Wakeups()
    a.add_wakeup_listener(listening)
    a.add_wakeup_listener(pool.notify)
    await pool.start()
    try:
        await listening.next()
        for _ in range(3):
            job_id = await b.enqueue(NewJob("k", {}, 3))
            async with asyncio.timeout(5):
                assert await ran.get() == job_id
    finally:
        await pool.stop(1.0, lambda status: None)


async def test_a_hot_path_connection_cut_off_midway_is_replaced(
    pg_cluster: PostgresCluster, pg_url: str
) -> None:
    # Claims, acks, enqueues and product writes keep one connection each; a
    # call cancelled mid-query must not leave the next one a broken connection,
    # nor keep close() waiting for a connection that never went back.
    store = PostgresStore(pg_url, password=pg_cluster.password)
    await store.open()
    try:
        stuck = asyncio.create_task(
            store._db(lambda conn: conn.execute("SELECT pg_sleep(30)"), lane=store._claims)
        )
        for _ in range(250):  # until the query runs on the server (5 s at most)
            running = await fetch(
                pg_cluster,
                pg_url,
                "SELECT 1 FROM pg_stat_activity"
                " WHERE state = 'active' AND query = 'SELECT pg_sleep(30)'",
            )
            if running:
                break
            await asyncio.sleep(0.02)
        else:
            pytest.fail("the query never started")
        stuck.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stuck
        job_id = await store.enqueue(NewJob("k", {}, 3))
        async with asyncio.timeout(5):
            assert [job.id for job in await store.claim(1, 30.0)] == [job_id]
    finally:
        async with asyncio.timeout(10):
            await store.close()


async def test_the_listener_reconnects_after_losing_its_connection(
    pg_cluster: PostgresCluster, pg_url: str, hosts: list[PostgresStore]
) -> None:
    a, b, _ = hosts
    heard = Wakeups()
    a.add_wakeup_listener(heard)
    await heard.next()
    killed = await fetch(
        pg_cluster,
        pg_url,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE datname = current_database() AND query LIKE 'LISTEN%'",
    )
    assert killed == [(True,)]
    await heard.next(timeout=10)  # listening again (LISTEN_RETRY_SECONDS later)
    await b.enqueue(NewJob("k", {}, 3))
    await heard.next()


async def test_claims_on_several_instances_never_overlap(hosts: list[PostgresStore]) -> None:
    total = 300
    await asyncio.gather(
        *(hosts[i % HOSTS].enqueue(NewJob("k", {"i": i}, 3)) for i in range(total))
    )
    claimers = 3 * HOSTS  # several per instance, as the pools of three hosts would be
    claimed: list[list[int]] = [[] for _ in range(claimers)]

    async def claimer(index: int, store: PostgresStore) -> None:
        rng = random.Random(index)
        while True:
            jobs = await store.claim(rng.randint(1, 9), lease_seconds=600)
            if not jobs:
                return
            claimed[index].extend(job.id for job in jobs)

    await asyncio.gather(*(claimer(i, hosts[i % HOSTS]) for i in range(claimers)))
    every = [job_id for ids in claimed for job_id in ids]
    assert len(every) == len(set(every)) == total, "a job was leased twice"
    per_host = [sum(len(claimed[i]) for i in range(h, claimers, HOSTS)) for h in range(HOSTS)]
    assert all(per_host), f"an instance claimed nothing: {per_host}"
    counts = await hosts[0].counts()
    assert (counts.pending, counts.running) == (0, total)


async def test_done_counts_kept_as_changes_are_folded_by_reads_on_several_hosts(
    pg_cluster: PostgresCluster, pg_url: str, hosts: list[PostgresStore]
) -> None:
    """Each job done adds a change row (no host waits on another's lock); a
    read that finds over a thousand folds them, and reads folding at once on
    every host still leave the sum whole."""
    total = FOLD_CHANGES + 200
    await asyncio.gather(
        *(hosts[i % HOSTS].enqueue(NewJob("k", {"i": i}, 3)) for i in range(total))
    )

    async def finish(store: PostgresStore) -> None:
        while jobs := await store.claim(50, lease_seconds=600):
            await store.complete(jobs)

    await asyncio.gather(*(finish(h) for h in hosts))
    changes = "SELECT count(*), sum(n) FROM job_count_changes WHERE state = 'done'"
    assert await fetch(pg_cluster, pg_url, changes) == [(total, total)]
    read = await asyncio.gather(*(h.counts() for h in hosts))
    assert [(c.done, c.pending, c.running) for c in read] == [(total, 0, 0)] * HOSTS
    ((rows, kept),) = await fetch(pg_cluster, pg_url, changes)
    assert kept == total and rows <= HOSTS, rows
    assert (await hosts[0].counts()).done == total


async def test_racing_recaps_record_one_row_and_one_job(
    pg_cluster: PostgresCluster, pg_url: str, hosts: list[PostgresStore]
) -> None:
    for day in range(1, 11):
        period = f"2026-11-{day:02d}"
        results = await asyncio.gather(
            *(s.record_recap(period, 5, day, NewJob("recap_email", {}, 3)) for s in hosts)
        )
        winners = [r for r in results if r is not None]
        assert len(winners) == 1, (period, results)
    assert await fetch(pg_cluster, pg_url, "SELECT count(*) FROM recaps") == [(10,)]
    assert await fetch(
        pg_cluster, pg_url, "SELECT count(*) FROM jobs WHERE kind = 'recap_email'"
    ) == [(10,)]


async def test_connections_are_labelled_for_restore_checks(
    pg_cluster: PostgresCluster, pg_url: str, hosts: list[PostgresStore]
) -> None:
    names = await fetch(
        pg_cluster,
        pg_url,
        "SELECT DISTINCT application_name FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    assert names == [("toko-api",)]


@pytest.mark.parametrize("default", ["off", "local", "on", "remote_apply"])
async def test_commits_are_flushed_whatever_the_databases_default(
    pg_cluster: PostgresCluster, pg_url: str, caplog: pytest.LogCaptureFixture, default: str
) -> None:
    # A default some servers set for speed: commits return before their WAL is
    # flushed, so a database crash would lose requests already answered 201.
    database = pg_url.rsplit("/", 1)[1]
    await fetch(
        pg_cluster, pg_url, f'ALTER DATABASE "{database}" SET synchronous_commit = {default}'
    )
    store = PostgresStore(pg_url, password=pg_cluster.password)
    with caplog.at_level(logging.INFO, "toko.store"):
        await store.open()
    try:
        # What every pooled session (the writer's included) commits with.
        assert store._pool is not None
        async with store._pool.acquire() as conn:
            used = await conn.fetchval("SHOW synchronous_commit")
    finally:
        await store.close()
    said = [r.getMessage() for r in caplog.records if "synchronous_commit" in r.getMessage()]
    if default == "off":
        assert used == "on"
        assert said == [
            "the database's synchronous_commit is off: toko's own sessions use on,"
            " so that every 201 survives a database crash"
        ]
    else:  # each flushes locally at commit: the admin's choice stands
        assert used == default
        assert said == []


async def test_a_database_not_in_utf8_is_refused_at_open(pg_cluster: PostgresCluster) -> None:
    # `createdb` on a cluster initialised under the C locale (a Debian without
    # locales) makes a SQL_ASCII database. toko-api started on it, and every
    # product whose name went beyond ASCII was then a 503 "try again shortly",
    # for good. It must refuse to start instead, before creating any table.
    name = f"ascii_{secrets.token_hex(4)}"
    admin = await pg_cluster.connect()
    try:
        await admin.execute(
            f"CREATE DATABASE \"{name}\" ENCODING 'SQL_ASCII' LOCALE 'C' TEMPLATE template0"
        )
    finally:
        await admin.close()
    url = pg_cluster.url(name)
    try:
        with pytest.raises(StoreError) as refused:
            await PostgresStore(url, password=pg_cluster.password).open()
        assert str(refused.value) == (
            f"the database {url} is in SQL_ASCII, not UTF8, so names beyond ASCII cannot be"
            " stored: create it with createdb --encoding=UTF8 --template=template0"
        )
        assert await fetch(pg_cluster, url, "SELECT to_regclass('products') IS NULL") == [(True,)]
    finally:
        await pg_cluster.async_drop_database(url)


async def test_a_database_that_went_away_is_a_store_error(
    pg_cluster: PostgresCluster, pg_url: str, hosts: list[PostgresStore]
) -> None:
    await pg_cluster.async_drop_database(pg_url)  # WITH (FORCE): our connections die
    for store in hosts:
        with pytest.raises(StoreError):
            await store.counts()
        with pytest.raises(StoreError):
            await store.create_product("gone", 1, email_job)


class NoMail:
    async def send(self, email: Email) -> None:
        raise AssertionError("these tests send no mail")


def _context() -> JobContext:
    return JobContext(NoMail(), "toko@localhost", ("admin@toko.com",))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


class LogSeen(logging.Handler):
    """Sets an event when a record containing ``text`` is logged (same thread, same loop)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.event = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


async def test_open_waits_for_a_database_that_comes_up_late(
    pg_cluster: PostgresCluster, pg_url: str
) -> None:
    # At boot toko-api may start before the database is reachable. A port
    # with nothing behind it yet; a proxy to the real server opens there later.
    port = free_port()
    late_url = pg_url.replace(f":{pg_cluster.port}/", f":{port}/")
    store = PostgresStore(late_url, password=pg_cluster.password)
    retrying = LogSeen("database not reachable yet")
    logging.getLogger("toko.store").addHandler(retrying)
    try:
        opening = asyncio.create_task(store.open())
        async with asyncio.timeout(10):
            await retrying.event.wait()  # it tried, failed, and waits to try again
    finally:
        logging.getLogger("toko.store").removeHandler(retrying)

    async def forward(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(pg_cluster.host, pg_cluster.port)
        await asyncio.gather(_pipe(client_r, server_w), _pipe(server_r, client_w))

    proxy = await asyncio.start_server(forward, "127.0.0.1", port)
    try:
        async with asyncio.timeout(15):
            await opening
        product, _ = await store.create_product("late", 1, email_job)
        assert (await store.get_product(product.id)) == product
        await store.close()
    finally:
        proxy.close()


async def test_open_gives_up_on_an_unreachable_database(
    pg_cluster: PostgresCluster, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pg_transport, "OPEN_RETRY_SECONDS", 0.6)
    dead = pg_url.replace(f":{pg_cluster.port}/", f":{free_port()}/")
    with pytest.raises(StoreError, match="cannot open database"):
        await PostgresStore(dead, password=pg_cluster.password).open()


async def test_a_call_that_times_out_is_not_tried_again(
    pg_cluster: PostgresCluster,
    pg_url: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A lock held elsewhere: the call waits its full timeout once and fails.
    # Trying again on another connection would wait as long again, up to nine
    # times (4.5 minutes at 30 s), so a late ack would outlive its job's lease.
    monkeypatch.setattr(pg_transport, "COMMAND_TIMEOUT", 0.5)
    store = PostgresStore(pg_url, password=pg_cluster.password)
    await store.open()
    locker = await pg_cluster.connect(pg_url.rsplit("/", 1)[1])
    try:
        tx = locker.transaction()
        await tx.start()
        await locker.execute("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE")
        with (
            caplog.at_level(logging.WARNING, logger="toko.store"),
            pytest.raises(StoreError, match=r"no answer within 0\.5 s"),
        ):
            await store.counts()
        assert not [r for r in caplog.records if "trying again" in r.getMessage()]
        await tx.rollback()
        assert (await store.counts()).pending == 0  # and the next call works
    finally:
        await locker.close()
        await store.close()


@contextlib.asynccontextmanager
async def _key_stored_by_another_host(
    cluster: PostgresCluster, url: str
) -> AsyncIterator[tuple[int, Callable[[], Awaitable[None]]]]:
    """Another host's insert of the key order-9 ('Kopi', 1), not committed yet:
    yields its product id and the commit to call."""
    other = await cluster.connect(url.rsplit("/", 1)[1])
    try:
        tx = other.transaction()
        await tx.start()
        other_id = await other.fetchval(
            "INSERT INTO products (nama, harga, created_at, idempotency_key)"
            " VALUES ('Kopi', 1, 0, 'order-9') RETURNING id"
        )
        yield other_id, tx.commit
    finally:
        await other.close()


async def test_an_idempotency_key_stored_by_another_host_meanwhile_is_answered(
    hosts: list[PostgresStore], pg_cluster: PostgresCluster, pg_url: str
) -> None:
    # Another host's insert of the key is in flight (uncommitted) when this
    # host looks: this host's insert waits on the unique index, then fails as
    # a whole when the other commits. It must look again and answer with the
    # other's product, not refuse the request.
    async with _key_stored_by_another_host(pg_cluster, pg_url) as (other_id, commit):
        write = asyncio.create_task(hosts[0].create_product("Kopi", 1, email_job, "order-9"))
        await waiting_on_a_lock(pg_cluster, pg_url, "INSERT INTO products")
        await commit()
        product, job_id = await write
    assert (product.id, job_id) == (other_id, None)
    assert await fetch(pg_cluster, pg_url, "SELECT count(*) FROM products") == [(1,)]
    assert await fetch(pg_cluster, pg_url, "SELECT count(*) FROM jobs") == [(0,)]
    assert hosts[0].write_error is None


async def test_a_key_stored_meanwhile_leaves_the_rest_of_its_batch_as_it_was(
    hosts: list[PostgresStore], pg_cluster: PostgresCluster, pg_url: str
) -> None:
    # The same race, with more in the batch that waits on the unique index:
    # a write whose job cannot be made (answered already, with its error),
    # a caller that gives up meanwhile, and a plain write. Looking again
    # must not write the first two a second time, and the third is stored.
    def broken_job(product: Product) -> NewJob:
        raise ValueError("no job for this product")

    store = hosts[0]
    async with _key_stored_by_another_host(pg_cluster, pg_url) as (other_id, commit):
        keyed = asyncio.create_task(store.create_product("Kopi", 1, email_job, "order-9"))
        broken = asyncio.create_task(store.create_product("Teh", 2, broken_job))
        gone = asyncio.create_task(store.create_product("Gula", 3, email_job))
        plain = asyncio.create_task(store.create_product("Susu", 4, email_job))
        await waiting_on_a_lock(pg_cluster, pg_url, "INSERT INTO products")
        gone.cancel()
        await commit()
        product, job_id = await keyed
        stored, stored_job_id = await plain
    assert (product.id, job_id) == (other_id, None)
    with pytest.raises(ValueError, match="no job for this product"):
        await broken
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert await fetch(pg_cluster, pg_url, "SELECT nama FROM products ORDER BY id") == [
        ("Kopi",),
        ("Susu",),
    ]
    assert await fetch(pg_cluster, pg_url, "SELECT id FROM jobs") == [(stored_job_id,)]
    assert stored.nama == "Susu"
    assert store.write_error is None


async def waiting_on_a_lock(cluster: PostgresCluster, url: str, statement: str) -> None:
    async with asyncio.timeout(10):
        while True:
            if await fetch(
                cluster,
                url,
                "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND position($1 in query) > 0",
                statement,
            ):
                return
            await asyncio.sleep(0.02)  # a lock wait has no event to await


async def test_a_product_write_given_up_before_it_was_sent_is_not_made(
    hosts: list[PostgresStore], pg_cluster: PostgresCluster, pg_url: str
) -> None:
    # At shutdown aiohttp cancels a POST that outlived its grace (the table
    # locked meanwhile). Its write, still queued, must not be made once the
    # lock goes: its client got no answer, and its job, leased to a process
    # that is stopping, would sit running until the lease ran out.
    locker = await pg_cluster.connect(pg_url.rsplit("/", 1)[1])
    try:
        tx = locker.transaction()
        await tx.start()
        await locker.execute("LOCK TABLE products IN ACCESS EXCLUSIVE MODE")
        sent = asyncio.create_task(hosts[0].create_product("Kopi", 1, email_job_leased))
        await waiting_on_a_lock(pg_cluster, pg_url, "INSERT INTO products")
        queued = asyncio.create_task(hosts[0].create_product("Teh", 1, email_job_leased))
        await asyncio.sleep(0)  # one turn of the loop: the task queues its write
        queued.cancel()
        await tx.rollback()
        _, job_id = await sent
    finally:
        await locker.close()
    with pytest.raises(asyncio.CancelledError):
        await queued
    assert await fetch(pg_cluster, pg_url, "SELECT nama FROM products") == [("Kopi",)]
    assert await fetch(pg_cluster, pg_url, "SELECT id FROM jobs") == [(job_id,)]
    await hosts[0].create_product("Gula", 1, email_job)  # the writer goes on
    assert len(await fetch(pg_cluster, pg_url, "SELECT id FROM products")) == 2


# The server's answer to a release of one job: a row of pg_notify's void, "SELECT 1".
RELEASED_ONE = b"D\x00\x00\x00\x0a\x00\x01\x00\x00\x00\x00C\x00\x00\x00\x0dSELECT 1\x00"


async def test_a_release_whose_answer_was_lost_is_not_made_again_over_a_new_claim(
    hosts: list[PostgresStore], pg_cluster: PostgresCluster, pg_url: str
) -> None:
    # A release commits (its NOTIFY wakes the other hosts), then the
    # connection dies before its answer arrives. Meanwhile another host claims
    # the job: a release puts attempts back, so that claim has the same id,
    # attempts and run_at as the released one. Made again on a new connection,
    # the release would match it and hand a job being run back to the queue,
    # to be run twice at once.
    claimer = hosts[1]
    reclaimed: list[Job] = []
    cut = asyncio.Event()

    async def forward(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(pg_cluster.host, pg_cluster.port)
        releasing = asyncio.Event()

        async def to_server() -> None:
            with contextlib.suppress(ConnectionError):
                while data := await client_r.read(65536):
                    if b"WITH released" in data and armed.is_set():
                        armed.clear()
                        releasing.set()
                    server_w.write(data)
                    await server_w.drain()
            server_w.close()

        async def to_client() -> None:
            with contextlib.suppress(ConnectionError):
                withheld = b""
                while data := await server_r.read(65536):
                    if releasing.is_set() and RELEASED_ONE in withheld + data:
                        withheld += data
                        if not withheld.endswith(b"Z\x00\x00\x00\x05I"):
                            continue  # committed once the server is ready for more
                        # Committed, answer withheld: another host claims, then the cut.
                        reclaimed.extend(await claimer.claim(1, 30.0))
                        cut.set()
                        break
                    client_w.write(data)
                    await client_w.drain()
            client_w.close()
            server_w.close()

        await asyncio.gather(to_server(), to_client())

    armed = asyncio.Event()
    port = free_port()
    proxy = await asyncio.start_server(forward, "127.0.0.1", port)
    store = PostgresStore(
        pg_url.replace(f":{pg_cluster.port}/", f":{port}/"), password=pg_cluster.password
    )
    await store.open()
    try:
        job_id = await store.enqueue(NewJob("k", {}, 3))
        [job] = await store.claim(1, 30.0)
        armed.set()
        with pytest.raises(StoreError, match="connection"):  # its answer was lost
            await store.release([job])
        assert cut.is_set()
        assert [(j.id, j.attempts) for j in reclaimed] == [(job_id, 1)]
        assert await fetch(pg_cluster, pg_url, "SELECT state FROM jobs") == [("running",)]
    finally:
        await store.close()
        proxy.close()


async def test_close_drops_rather_than_cancels_an_ack_still_on_its_connection(
    pg_cluster: PostgresCluster, pg_url: str
) -> None:
    # At a stop behind a locked jobs table, stop gives up waiting for an ack
    # and the store closes. Handing its connection back to the pool made
    # asyncpg cancel the ack on the server: the job stayed running, and its
    # email went out again after the lease. Dropped, as a killed process
    # drops it, the connection leaves the server to commit the ack.
    store = PostgresStore(pg_url, password=pg_cluster.password)
    await store.open()
    await store.enqueue(NewJob("k", {}, 3))
    await store.enqueue(NewJob("k", {}, 3))
    [first, job] = await store.claim(2, 30.0)
    # The acks connection has its statement prepared, as in a service that
    # has run for a while (a statement not yet parsed waits on the lock in
    # its parse and is lost with its connection, as after a kill).
    await store.complete([first])
    locker = await pg_cluster.connect(pg_url.rsplit("/", 1)[1])
    try:
        tx = locker.transaction()
        await tx.start()
        await locker.execute("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE")
        ack = asyncio.create_task(store.complete([job]))
        await waiting_on_a_lock(pg_cluster, pg_url, "UPDATE jobs SET state = 'done'")
        async with asyncio.timeout(postgres.CLOSE_SECONDS):
            await store.close()
        await tx.rollback()
        # The lock goes to the ack, which waited for it first: taken again,
        # it is granted only once the ack's transaction has ended.
        async with asyncio.timeout(5), locker.transaction():
            await locker.execute("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE")
    finally:
        await locker.close()
    with pytest.raises(StoreError):  # its answer is lost with the connection
        await ack
    sql = "SELECT state FROM jobs WHERE id = $1"
    assert await fetch(pg_cluster, pg_url, sql, job.id) == [("done",)]
