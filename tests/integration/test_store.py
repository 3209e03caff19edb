"""The store contract, on both backends (see conftest: ``store`` is parametrised)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import re
import sqlite3
import traceback
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from service.mail import LogMailer
from service.models import (
    JOB_STATES,
    Job,
    JobState,
    NewJob,
    Product,
    ProductWritten,
    VersionMismatch,
    stored_job,
)
from service.store.admin import RETRYABLE_WHERE, Retryable
from service.store.base import ABANDONED_ERROR, StoreError
from service.store.postgres import PostgresStore
from service.store.postgres.migrations import LATEST_VERSION as PG_LATEST_VERSION
from service.store.roles import QueueAdmin, Store
from service.store.sqlite import SqliteStore, connect
from service.store.sqlite.admin import PURGE_DONE_SQL, list_jobs_sql, retry_by_id_sql
from service.store.sqlite.migrations import LATEST_VERSION, migrate
from service.store.sqlite.products import ProductEdit, create_products, edit_products
from service.store.sqlite.writer import GroupCommitWriter
from service.tasks import HANDLERS, JobContext, price_email_job, product_email_job
from tests.support.backends import Backend, FakeClock


def email_job(product: Product) -> NewJob:
    return product_email_job(product, max_attempts=3)


def rows(path: str, sql: str) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


async def test_product_and_job_commit_together(store: Store, backend: Backend) -> None:
    product, job_id = await store.create_product("Teh Hijau", 45000, email_job)
    assert product.id == 1 and product.nama == "Teh Hijau"
    # Visible to a separate connection: it is committed, not just buffered.
    assert await backend.rows("SELECT nama, harga FROM products") == [("Teh Hijau", 45000)]
    job = await store.get_job(job_id)
    assert job is not None and job.state == "pending"
    assert job.payload == {"product_id": 1, "nama": "Teh Hijau", "harga": 45000}


async def test_a_failing_job_build_rolls_back_the_product(store: Store, backend: Backend) -> None:
    def broken(product: Product) -> NewJob:
        raise ValueError("no job for you")

    with pytest.raises(ValueError):
        await store.create_product("Kopi", 1, broken)
    assert await backend.rows("SELECT count(*) FROM products") == [(0,)]
    assert await backend.rows("SELECT count(*) FROM jobs") == [(0,)]


async def test_one_failed_write_does_not_undo_its_batch_neighbours(
    store: Store, backend: Backend
) -> None:
    def broken(product: Product) -> NewJob:
        raise ValueError("boom")

    results = await asyncio.gather(
        store.create_product("a", 1, email_job),
        store.create_product("b", 2, broken),
        store.create_product("c", 3, email_job),
        return_exceptions=True,
    )
    assert isinstance(results[1], ValueError)
    assert await backend.rows("SELECT nama FROM products ORDER BY nama") == [("a",), ("c",)]
    assert await backend.rows("SELECT count(*) FROM jobs") == [(2,)]


async def test_a_stored_idempotency_key_returns_its_product(store: Store, backend: Backend) -> None:
    first, job_id = await store.create_product("Kopi", 1, email_job, "order-1")
    assert job_id is not None
    # Even with other fields: the caller tells a replay from a misuse.
    again, no_job = await store.create_product("Teh", 2, email_job, "order-1")
    assert (again, no_job) == (first, None)
    other, other_job = await store.create_product("Kopi", 1, email_job, "order-2")
    assert other.id != first.id and other_job is not None
    assert await backend.rows("SELECT count(*) FROM products") == [(2,)]
    assert await backend.rows("SELECT count(*) FROM jobs") == [(2,)]


async def test_one_key_twice_in_a_batch_stores_one_product(store: Store, backend: Backend) -> None:
    results = await asyncio.gather(
        store.create_product("Kopi", 1, email_job, "order-1"),
        store.create_product("Susu", 3, email_job),
        store.create_product("Kopi", 1, email_job, "order-1"),
        store.create_product("Kopi", 1, email_job, "order-1"),
    )
    keyed = [results[0], results[2], results[3]]
    assert len({product.id for product, _ in keyed}) == 1
    assert sum(job_id is not None for _, job_id in keyed) == 1
    assert results[1][1] is not None
    assert await backend.rows("SELECT nama FROM products ORDER BY id") == [("Kopi",), ("Susu",)]
    assert await backend.rows("SELECT count(*) FROM jobs") == [(2,)]


def test_sqlite_batch_with_one_key_twice_inserts_it_once(tmp_path: Path) -> None:
    # The writer thread may or may not have put the gather above in one batch;
    # here the batch function gets exactly that batch.
    conn = connect(str(tmp_path / "toko.db"))
    migrate(conn)
    items = [
        ("Kopi", 1, 1.0, email_job, "k"),
        ("Susu", 2, 1.0, email_job, None),
        ("Kopi", 1, 1.0, email_job, "k"),
    ]
    conn.execute("BEGIN IMMEDIATE")
    (kopi, kopi_job), (susu, susu_job), (again, no_job) = create_products(conn, items)
    conn.execute("COMMIT")
    assert (again, no_job) == (kopi, None)
    assert kopi_job is not None and susu_job is not None and susu.id != kopi.id
    assert conn.execute("SELECT count(*) FROM products").fetchone() == (2,)
    conn.close()


async def test_a_failed_verify_refuses_its_batch_and_every_later_one(tmp_path: Path) -> None:
    path = str(tmp_path / "w.db")
    verified: list[int] = []

    def verify(conn: sqlite3.Connection) -> None:
        verified.append(1)
        if len(verified) >= 2:
            raise sqlite3.OperationalError("the file is gone")

    _table_t(path)
    writer = GroupCommitWriter(lambda: connect(path), verify)
    writer.start()
    try:
        await writer.run(_insert_t, 1)
        with pytest.raises(sqlite3.OperationalError, match="the file is gone"):
            await writer.run(_insert_t, 2)  # committed, then verified: not durable after all
        with pytest.raises(sqlite3.OperationalError, match="the file is gone"):
            await writer.run(_insert_t, 3)  # refused without being written
    finally:
        writer.stop()
    assert rows(path, "SELECT x FROM t ORDER BY x") == [(1,), (2,)]
    assert len(verified) == 2, "once refused, for good: not asked again"


class _Arg:
    """A write's argument, which a weak reference can watch."""


def _ignore_args(conn: sqlite3.Connection, items: list[_Arg]) -> list[None]:
    return [None] * len(items)


async def test_refused_writes_leave_nothing_of_theirs_alive(tmp_path: Path) -> None:
    path = str(tmp_path / "w.db")

    def verify(conn: sqlite3.Connection) -> None:
        raise sqlite3.OperationalError("the file is gone")

    writer = GroupCommitWriter(lambda: connect(path), verify)
    writer.start()
    try:
        # The write whose commit found the file gone: the refusal kept for good
        # must not hold it (its traceback reached into the batch's frames).
        first = _Arg()
        watched = [weakref.ref(first)]
        with pytest.raises(sqlite3.OperationalError):
            await writer.run(_ignore_args, first)
        del first
        refusals = []
        for _ in range(20):  # each refused a file gone, as every POST is until a restart
            arg = _Arg()
            watched.append(weakref.ref(arg))
            with pytest.raises(sqlite3.OperationalError) as refused:
                await writer.run(_ignore_args, arg)
            refusals.append(len(traceback.extract_tb(refused.value.__traceback__)))
            del arg, refused
        with pytest.raises(sqlite3.OperationalError):  # the writer's hands let go of the last
            await writer.run(_ignore_args, _Arg())
    finally:
        writer.stop()
    gc.collect()
    # Before, they shared one exception, whose traceback grew by each raise and
    # kept each refused write's frames, arguments included, alive for good.
    assert len(set(refusals)) == 1, refusals
    assert [ref() for ref in watched] == [None] * 21


def _table_t(path: str) -> None:
    setup = connect(path)
    setup.execute("CREATE TABLE t (x INTEGER)")
    setup.close()


def _insert_t(conn: sqlite3.Connection, items: list[int]) -> list[None]:
    conn.executemany("INSERT INTO t VALUES (?)", [(item,) for item in items])
    return [None] * len(items)


async def test_a_fault_in_the_writer_fails_its_batch_and_the_writer_carries_on(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "w.db")
    _table_t(path)
    faults = [ValueError("a bug")]

    def verify(conn: sqlite3.Connection) -> None:
        if faults:
            raise faults.pop()  # not a database error: a fault of ours

    writer = GroupCommitWriter(lambda: connect(path), verify)
    writer.start()
    try:
        async with asyncio.timeout(10):  # before, the caller waited forever
            with pytest.raises(RuntimeError, match="the SQLite writer failed: ValueError"):
                await writer.run(_insert_t, 1)
            await writer.run(_insert_t, 2)  # the next batch is written as usual
    finally:
        writer.stop()
    assert rows(path, "SELECT x FROM t ORDER BY x") == [(1,), (2,)]


class _Fatal(BaseException):
    """Ends the writer thread, as nothing in toko should."""


async def test_writes_fail_rather_than_wait_forever_once_the_writer_thread_ended(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "w.db")
    _table_t(path)

    def fatal(conn: sqlite3.Connection, items: list[int]) -> list[None]:
        raise _Fatal

    writer = GroupCommitWriter(lambda: connect(path))
    writer.start()
    try:
        waiting = [asyncio.ensure_future(writer.run(_insert_t, n)) for n in range(20)]
        async with asyncio.timeout(10):  # before, the callers waited forever
            with pytest.raises(RuntimeError, match="the SQLite writer has stopped"):
                await writer.run(fatal, 0)
            # Each write queued with it was either committed before or is now refused.
            outcomes = await asyncio.gather(*waiting, return_exceptions=True)
        refused = [o for o in outcomes if isinstance(o, RuntimeError)]
        assert all(o is None or isinstance(o, RuntimeError) for o in outcomes), outcomes
        with pytest.raises(RuntimeError, match="not running"):
            await writer.run(_insert_t, 99)
    finally:
        writer.stop()
    assert len(rows(path, "SELECT x FROM t")) == len(outcomes) - len(refused)


async def test_wait_broken_ends_once_the_writer_is_gone(store: Store) -> None:
    # What toko-api supervises: it waits while the store works...
    watch = asyncio.ensure_future(store.wait_broken())
    await store.create_product("Teh Hijau", 45000, email_job)
    assert not watch.done()
    # ...and raises once its writer has died, as nothing in toko should make it.
    if isinstance(store, SqliteStore):

        def fatal(conn: sqlite3.Connection, items: list[int]) -> list[None]:
            raise _Fatal

        with pytest.raises(RuntimeError, match="the SQLite writer has stopped"):
            await store._writer.run(fatal, 0)
        expected = "the SQLite writer thread died: _Fatal()"
    else:
        assert isinstance(store, PostgresStore) and store._writer is not None
        store._writer.cancel()
        expected = "toko-pg-writer ended: cancelled"
    async with asyncio.timeout(10):
        with pytest.raises(StoreError, match=re.escape(expected)):
            await watch


# Every older schema version of each backend: one a toko shipped with, or (SQLite
# version 1) that the first toko's step-by-step upgrade could leave behind.
OLDER_SCHEMAS = [("sqlite", v) for v in range(1, LATEST_VERSION)] + [
    ("postgres", v) for v in range(1, PG_LATEST_VERSION)
]
NOW = FakeClock().now  # the clock fixture's
LEASE_EXPIRED, LEASE_LIVE = NOW - 60, NOW + 3600
REFUSED = "MailError: SMTP 550: 5.7.1 refused"
# A product and its job in each state an older toko could leave it in; jobs
# are due (run_at in the past) and share the jobs table every version has.
OLD_ROWS = [
    (1, "Selesai", "done", 1, None, None),
    (2, "Tunda", "pending", 0, None, None),
    (3, "Gagal", "failed", 3, None, REFUSED),
    (4, "Putus", "running", 1, LEASE_EXPIRED, None),  # its process died
    # Maybe another PostgreSQL host's still; on SQLite, its process is gone all the same.
    (5, "Jalan", "running", 1, LEASE_LIVE, None),
]


def _sql(value: object) -> str:
    return "NULL" if value is None else repr(value)


def old_inserts() -> list[str]:
    made = NOW - 7200
    statements = []
    # Ids as the old toko got them, from each table's own counter: 1, 2, ...
    for pid, nama, state, attempts, lease, error in OLD_ROWS:
        payload = json.dumps({"product_id": pid, "nama": nama, "harga": 1000 + pid})
        statements += [
            "INSERT INTO products (nama, harga, created_at)"
            f" VALUES ('{nama}', {1000 + pid}, {made})",
            "INSERT INTO jobs (kind, payload, state, attempts, max_attempts, run_at,"
            " lease_until, last_error, created_at, updated_at) VALUES"
            f" ('product_email', '{payload}', '{state}', {attempts}, 3, {made},"
            f" {_sql(lease)}, {_sql(error)}, {made}, {made})",
        ]
    return statements


async def _start_as_toko_api(backend: Backend, clock: FakeClock) -> Store:
    """Open the store and recover abandoned jobs, as toko-api does at start."""
    store = backend.make_store(clock)
    await store.open()
    await store.recover_abandoned()
    return store


async def _contents(backend: Backend) -> list[list[tuple[object, ...]]]:
    return [
        [(await backend.schema_version(),)],
        await backend.rows("SELECT * FROM products ORDER BY id"),
        await backend.rows("SELECT * FROM jobs ORDER BY id"),
    ]


def _schema_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "toko.store.schema"]


@pytest.mark.parametrize(
    ("backend", "version"),
    OLDER_SCHEMAS,
    indirect=["backend"],
    ids=[f"{name}-v{version}" for name, version in OLDER_SCHEMAS],
)
async def test_every_older_schema_upgrades_with_its_products_and_jobs(
    backend: Backend, version: int, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    await backend.make_old_schema(version, *old_inserts())
    caplog.set_level(logging.INFO, logger="toko.store.schema")
    store = await _start_as_toko_api(backend, clock)
    await store.close()

    latest = backend.latest_version
    assert _schema_lines(caplog) == [f"database schema upgraded from version {version} to {latest}"]
    assert await backend.schema_version() == latest
    assert await backend.rows("SELECT id, nama, harga, created_at FROM products ORDER BY id") == [
        (pid, nama, 1000 + pid, NOW - 7200) for pid, nama, *_ in OLD_ROWS
    ]
    jobs = await backend.rows(
        "SELECT id, state, attempts, lease_until, last_error FROM jobs ORDER BY id"
    )
    if backend.name == "sqlite":
        # One toko-api per file: both running jobs were its dead process's.
        running = [(4, "pending", 1, None, None), (5, "pending", 1, None, None)]
        claimable = [2, 4, 5]
    else:
        # A shared database: only an expired lease brings a job back, at a claim.
        running = [(4, "running", 1, LEASE_EXPIRED, None), (5, "running", 1, LEASE_LIVE, None)]
        claimable = [2, 4]
    assert jobs == [
        (1, "done", 1, None, None),
        (2, "pending", 0, None, None),
        (3, "failed", 3, None, REFUSED),
        *running,
    ]

    # Started again: nothing left to migrate, so nothing changes and nothing is said.
    upgraded = await _contents(backend)
    caplog.clear()
    store = await _start_as_toko_api(backend, clock)
    try:
        assert await _contents(backend) == upgraded
        assert _schema_lines(caplog) == []
        # The figures a new schema step keeps start from the old rows.
        figures, counted = await _figures_and_full_count(store, backend)
        by_state = {state: sum(1 for job in jobs if job[1] == state) for state in JOB_STATES}
        assert figures == counted == by_state
        claimed = await store.claim(10, 60)
        assert [job.id for job in claimed] == claimable
        assert claimed[0].payload == {"product_id": 2, "nama": "Tunda", "harga": 1002}
        # Idempotency keys (a later step than some) work, and ids go on from the old rows'.
        new, job_id = await store.create_product("Baru", 8, email_job, "k")
        assert (new.id, job_id) == (6, 6)
        assert (await store.create_product("Baru", 8, email_job, "k")) == (new, None)
    finally:
        await store.close()


async def test_a_new_database_says_its_schema_was_created(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="toko.store.schema")
    store = backend.make_store()
    await store.open()
    await store.close()
    assert _schema_lines(caplog) == [f"database schema created at version {backend.latest_version}"]


async def test_concurrent_writes_share_commits(store: Store, backend: Backend) -> None:
    await asyncio.gather(*(store.create_product(f"p{i}", i, email_job) for i in range(200)))
    # Both backends group-commit (see their writers); not part of the Protocol.
    batches, ops = getattr(store, "writer_stats")  # noqa: B009
    assert ops == 200
    assert batches < ops / 4, f"{ops} writes took {batches} commits: no group commit"
    assert await backend.rows("SELECT count(*) FROM products") == [(200,)]


async def test_durability_settings(sqlite_store: SqliteStore) -> None:
    # SQLite only: PostgreSQL's durability is the server's (fsync, synchronous_commit).
    assert rows(sqlite_store.path, "PRAGMA journal_mode") == [("wal",)]
    assert rows(sqlite_store.path, "PRAGMA user_version") == [(LATEST_VERSION,)]


async def test_reads_after_the_file_is_deleted_create_nothing_at_its_path(
    sqlite_store: SqliteStore,
) -> None:
    # A reader connection opened by path now would create an empty database
    # there, which the next start would take for the shop's (see file_guard).
    made = [(await sqlite_store.create_product(f"p{i}", i, email_job))[0] for i in range(2)]
    database = Path(sqlite_store.path)
    for path in database.parent.glob(database.name + "*"):
        path.unlink()
    # Many at once, so that every reader thread there is takes part.
    listed = await asyncio.gather(*(sqlite_store.list_products(0, 10) for _ in range(20)))
    assert listed == [made] * 20
    assert sorted(database.parent.iterdir()) == [], "nothing was created at the path"


async def test_a_file_deleted_after_the_last_write_is_saved_when_the_store_closes(
    tmp_path: Path, clock: FakeClock
) -> None:
    # The writer checks the file after each commit; a stop with no write
    # since the rm must not end the only copy of what was stored.
    database = tmp_path / "toko.db"
    store = SqliteStore(str(database), clock=clock)
    await store.open()
    product, _ = await store.create_product("Kopi", 1, email_job)
    for path in database.parent.glob("toko.db*"):
        path.unlink()
    await store.close()
    (rescued,) = database.parent.glob("toko.db.rescued-*")
    assert rows(str(rescued), "SELECT id, nama FROM products") == [(product.id, "Kopi")]


async def test_migrations_are_idempotent(backend: Backend) -> None:
    for _ in range(2):
        s = backend.make_store()
        await s.open()
        await s.close()
    assert await backend.schema_version() == backend.latest_version


async def test_a_newer_schema_is_refused(backend: Backend) -> None:
    await backend.make_future_schema()
    with pytest.raises(StoreError, match="newer than this toko"):
        await backend.make_store().open()


async def test_unopenable_database_is_a_store_error(backend: Backend) -> None:
    store, message = backend.unopenable_store()
    with pytest.raises(StoreError, match=message):
        await store.open()


async def test_pagination(store: Store) -> None:
    for i in range(5):
        await store.create_product(f"p{i}", i, email_job)
    first = await store.list_products(0, 2)
    second = await store.list_products(first[-1].id, 2)
    assert [p.id for p in first + second] == [1, 2, 3, 4]
    assert await store.get_product(99) is None


async def test_claim_leases_due_jobs_once(store: Store, clock: FakeClock) -> None:
    for i in range(3):
        await store.enqueue(NewJob("k", {"i": i}, 3))
    claimed = await store.claim(2, lease_seconds=60)
    assert [j.id for j in claimed] == [1, 2]
    assert all(j.state == "running" and j.attempts == 1 for j in claimed)
    assert [j.id for j in await store.claim(5, 60)] == [3]
    assert await store.claim(5, 60) == []
    counts = await store.counts()
    assert (counts.pending, counts.running) == (0, 3)


async def test_expired_lease_is_claimed_again(store: Store, clock: FakeClock) -> None:
    await store.enqueue(NewJob("k", {}, 3))
    (job,) = await store.claim(1, lease_seconds=60)
    clock.now += 59
    assert await store.claim(1, 60) == []
    clock.now += 2
    (again,) = await store.claim(1, 60)
    assert again.id == job.id and again.attempts == 2


async def test_a_held_job_is_not_claimed_again_after_a_clock_step(
    store: Store, clock: FakeClock
) -> None:
    await store.enqueue(NewJob("k", {}, 3))
    (job,) = await store.claim(1, lease_seconds=60)
    lease_until = clock.now + 60
    clock.now += 3600  # NTP steps the wall clock: the lease looks expired
    assert await store.claim(5, 60, held={job.id}) == []  # its holder never retakes it
    # Nor does its lease count as due for it: its claimer would wake at once, forever.
    assert await store.next_due_at(held={job.id}) is None
    assert await store.next_due_at() == lease_until
    (again,) = await store.claim(5, 60, held={job.id + 1})  # anyone else may
    assert (again.id, again.attempts) == (job.id, 2)


async def test_a_job_whose_process_dies_beyond_its_last_attempt_is_kept_failed(
    store: Store, clock: FakeClock
) -> None:
    # A job that takes its process down each time: its lease runs out, and
    # it is claimed again, once past its last attempt (that one may never
    # have started), and then kept as failed, not claimed forever.
    job_id = await store.enqueue(NewJob("k", {}, 2))
    for attempt in (1, 2, 3):
        (job,) = await store.claim(5, 60)
        assert (job.id, job.attempts) == (job_id, attempt)
        clock.now += 61  # the process died: nobody acks, the lease runs out
    assert await store.claim(5, 60) == []
    failed = await store.get_job(job_id)
    assert failed is not None and (failed.state, failed.attempts) == ("failed", 3)
    assert failed.last_error == ABANDONED_ERROR
    assert await store.next_due_at() is None


async def test_recovery_at_start_keeps_a_job_failed_beyond_its_last_attempt(
    sqlite_store: SqliteStore,
) -> None:
    job_id = await sqlite_store.enqueue(NewJob("k", {}, 1))
    await sqlite_store.claim(1, 3600)
    assert await sqlite_store.recover_abandoned() == 1  # its last attempt: once more
    (job,) = await sqlite_store.claim(1, 3600)
    assert job.attempts == 2
    assert await sqlite_store.recover_abandoned() == 0  # died again: failed
    failed = await sqlite_store.get_job(job_id)
    assert failed is not None and failed.state == "failed"
    assert failed.last_error == ABANDONED_ERROR


async def test_a_job_enqueued_leased_is_already_claimed(store: Store, clock: FakeClock) -> None:
    # Both ways in: a lone enqueue and a product's job, as POST /produk writes it.
    lone = await store.enqueue(NewJob("k", {}, 3, leased_for=60))
    _, with_product = await store.create_product(
        "Kopi", 1, lambda p: product_email_job(p, 3, leased_for=60)
    )
    for job_id in (lone, with_product):
        job = await store.get_job(job_id)
        assert job is not None and job.state == "running" and job.attempts == 1
    assert await store.claim(5, 60) == []  # leased: nobody else takes it
    clock.now += 61
    # A process that dies with it leased loses it to the next claim, as with any claim.
    again = await store.claim(5, 60)
    assert sorted(j.id for j in again) == sorted([lone, with_product])
    assert all(j.attempts == 2 for j in again)


async def _message_id_of(job: Job, caplog: pytest.LogCaptureFixture) -> str:
    """The Message-ID of the email the job's handler sends (to the log)."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="toko.mail"):
        await HANDLERS[job.kind](job, JobContext(LogMailer(), "toko@toko.test", ("bos@toko.test",)))
    (logged,) = [r for r in caplog.records if r.getMessage() == "email logged"]
    return str(logged.MESSAGE_ID)


async def test_every_read_of_a_job_gives_the_enqueue_time_it_was_stored_with(
    store: Store, clock: FakeClock
) -> None:
    # Its email's Message-ID is made of it, on every attempt, by any process.
    clock.now = 1_764_520_000.123456
    product, job_id = await store.create_product(
        "Kopi", 1, lambda p: product_email_job(p, 3, leased_for=60)
    )
    assert job_id is not None
    # POST /produk runs a leased job without reading it: it builds it so.
    built = stored_job(job_id, product_email_job(product, 3, leased_for=60), product.created_at)
    assert await store.get_job(job_id) == built
    clock.now += 61  # the lease runs out: claimed again, later
    (claimed,) = await store.claim(5, 60)
    await store.retry(claimed, "SMTP 451: try later", clock.now + 10)
    clock.now += 11
    (retried,) = await store.claim(5, 60)
    assert claimed.created_at == retried.created_at == built.created_at == 1_764_520_000.123456
    assert retried.run_at != built.run_at
    lone_id = await store.enqueue(NewJob("k", {}, 3))
    (lone,) = await store.claim(5, 60)
    assert lone.id == lone_id and lone.created_at == clock.now


async def test_a_job_id_handed_out_again_after_a_restore_gets_another_message_id(
    store: Store, backend: Backend, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    await store.create_product("Kopi", 1, email_job)  # in the backup
    product, job_id = await store.create_product("Teh", 1, email_job)
    (_, teh) = await store.claim(5, 86400)  # Kopi's job stays out of the way
    assert teh.id == job_id
    teh_mid = await _message_id_of(teh, caplog)

    await backend.forget_since(product.id, job_id)  # a restore of that backup
    clock.now += 3600
    _, again = await store.create_product("Susu", 1, email_job)
    assert again == job_id  # the restore gave Teh's job id to Susu's job
    (susu,) = await store.claim(5, 60)
    assert susu.payload["nama"] == "Susu"
    susu_mid = await _message_id_of(susu, caplog)
    assert susu_mid != teh_mid
    # And it keeps that one on its next attempt.
    clock.now += 61
    (susu_again,) = await store.claim(5, 60)
    assert susu_again.attempts == 2
    assert await _message_id_of(susu_again, caplog) == susu_mid


async def test_retry_waits_until_due(store: Store, clock: FakeClock) -> None:
    await store.enqueue(NewJob("k", {}, 3))
    (job,) = await store.claim(1, 60)
    await store.retry(job, "SMTP 451: try later", clock.now + 10)
    assert await store.claim(1, 60) == []
    assert await store.next_due_at() == clock.now + 10
    clock.now += 10
    (again,) = await store.claim(1, 60)
    assert again.attempts == 2 and again.last_error == "SMTP 451: try later"


async def test_an_admin_sends_jobs_waiting_to_retry_now(store: Store, clock: FakeClock) -> None:
    assert isinstance(store, QueueAdmin)
    waiting = await store.enqueue(NewJob("k", {}, 20))
    (job,) = await store.claim(1, 60)
    await store.retry(job, "SMTP 535: bad password", clock.now + 3600)
    fresh = await store.enqueue(NewJob("k", {}, 20))  # never tried: not "waiting"
    failed = await store.enqueue(NewJob("k", {}, 1))
    claimed = {job.id: job for job in await store.claim(5, 60)}  # the two due ones
    await store.fail(claimed[failed], "SMTP 550: no such user")
    await store.release([claimed[fresh]])

    assert await store.retry_now([waiting, fresh, failed], "waiting") == [waiting]
    assert await store.retry_now(None, "waiting") == []
    # Due now, not in an hour, with a fresh attempt budget (fresh was released).
    due = {job.id: job for job in await store.claim(5, 60)}
    assert sorted(due) == sorted([waiting, fresh])
    assert due[waiting].attempts == 1 and due[waiting].last_error == "SMTP 535: bad password"
    assert (await store.get_job(failed)).state == "failed"  # type: ignore[union-attr]


class LockWatch:
    """Stands in for the pause between two chunks of an admin write, and
    checks there that another process could take SQLite's write lock at once."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.pauses = 0

    async def __call__(self) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=0)
        try:
            conn.execute("BEGIN IMMEDIATE")  # "database is locked" if held
            conn.execute("ROLLBACK")
        finally:
            conn.close()
        self.pauses += 1


@pytest.mark.parametrize("which", ["failed", "waiting"])
async def test_retrying_every_job_commits_in_chunks(
    sqlite_store: SqliteStore, clock: FakeClock, which: Retryable, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SQLite has one write lock: `toko-queue retry --all-waiting` on 667,000
    # jobs held it for 3.7 s in one transaction, and every POST waited; in
    # chunks back to back, POSTs still waited up to 1.5 s.
    max_attempts = 1 if which == "failed" else 5
    ids = [await sqlite_store.enqueue(NewJob("k", {}, max_attempts)) for _ in range(25)]
    for job in await sqlite_store.claim(25, 60):
        if which == "failed":
            await sqlite_store.fail(job, "SMTP 550")
        else:
            await sqlite_store.retry(job, "SMTP 451", clock.now + 3600)
    watch = LockWatch(sqlite_store.path)
    monkeypatch.setattr("service.store.sqlite.admin._let_others_write", watch)
    batches, writes = sqlite_store.writer_stats

    assert await sqlite_store.retry_now(None, which, chunk=10) == ids
    # One commit per 10 jobs, and the lock left free between them.
    assert sqlite_store.writer_stats == (batches + 3, writes + 3)
    assert watch.pauses == 2
    assert await sqlite_store.retry_now(None, which, chunk=10) == []
    assert [job.id for job in await sqlite_store.claim(30, 60)] == ids


async def test_a_purge_leaves_the_write_lock_free_between_chunks(
    sqlite_store: SqliteStore, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    for _ in range(8):
        await sqlite_store.enqueue(NewJob("k", {}, 1))
    await sqlite_store.complete(await sqlite_store.claim(8, 60))
    watch = LockWatch(sqlite_store.path)
    monkeypatch.setattr("service.store.sqlite.admin._let_others_write", watch)

    assert await sqlite_store.purge_done(clock.now + 1, chunk=3) == 7  # the newest stays
    assert watch.pauses == 2  # after the two full chunks; the third was the last


@pytest.mark.parametrize("which", sorted(RETRYABLE_WHERE))
async def test_a_retry_finds_its_jobs_by_id(sqlite_store: SqliteStore, which: Retryable) -> None:
    # Through the state index, each chunk of 500 ids walked every job in that
    # state: `toko-queue retry --all-waiting` took 2 min 53 s for 667,000 jobs.
    sql = retry_by_id_sql(RETRYABLE_WHERE[which], 500)
    plan = rows(sqlite_store.path, f"EXPLAIN QUERY PLAN {sql}".replace("?", "1"))
    assert [row[3] for row in plan] == ["SEARCH jobs USING INTEGER PRIMARY KEY (rowid=?)"]


def _plan(path: str, sql: str) -> list[str]:
    return [str(row[3]) for row in rows(path, f"EXPLAIN QUERY PLAN {sql}".replace("?", "1"))]


@pytest.mark.parametrize("state", ["done", "failed"])
async def test_done_and_failed_jobs_are_listed_in_order_from_their_own_index(
    sqlite_store: SqliteStore, state: JobState
) -> None:
    # Through the state index, `toko-queue list --state done` read and sorted
    # every done job: 1.4 s for 1.65 million of them.
    plan = _plan(sqlite_store.path, list_jobs_sql(state))
    assert plan == [f"SEARCH jobs USING INDEX jobs_{state}_updated_at (state=?)"]  # no sort


async def test_a_purge_finds_old_done_jobs_by_their_own_index(sqlite_store: SqliteStore) -> None:
    # Through the state index, the last chunk of a purge, which finds few or
    # none, read every done job: 0.5 s for 1.65 million, at every run.
    plan = _plan(sqlite_store.path, PURGE_DONE_SQL)
    index = "COVERING INDEX jobs_done_updated_at (state=? AND updated_at<?)"
    assert plan[0] == f"SEARCH jobs USING {index}"


async def test_an_attempt_that_did_part_of_the_job_leaves_the_rest(
    store: Store, clock: FakeClock
) -> None:
    await store.enqueue(NewJob("k", {"to": ["bos", "kasir"]}, 3))
    (job,) = await store.claim(1, 60)
    await store.retry(job, "deferred", clock.now, {"to": ["bos", "kasir"], "resend_to": ["kasir"]})
    (again,) = await store.claim(1, 60)
    assert again.payload == {"to": ["bos", "kasir"], "resend_to": ["kasir"]}
    # A plain failure keeps what is left; a failed job keeps it for an admin's retry.
    await store.retry(again, "SMTP 451", clock.now)
    (third,) = await store.claim(1, 60)
    assert third.payload == again.payload
    await store.fail(third, "deferred again", {"resend_to": []})
    failed = await store.get_job(job.id)
    assert failed is not None and failed.state == "failed"
    assert failed.payload == {"resend_to": []}


async def test_a_late_outcome_of_a_claim_no_longer_held_changes_nothing(
    store: Store, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    # Host A's write arrives after its lease ran out and host B claimed the job
    # again (a stalled network): it must neither hand the job to a third
    # worker while B runs it, nor undo B's result.
    job_id = await store.enqueue(NewJob("k", {}, 5))
    (as_a,) = await store.claim(1, 60)
    clock.now += 61
    (as_b,) = await store.claim(1, 60)
    assert (as_b.id, as_b.attempts) == (job_id, 2)
    with caplog.at_level(logging.WARNING, logger="toko.store"):
        await store.retry(as_a, "late", clock.now)
        await store.fail(as_a, "late")
        await store.release([as_a])
        assert await store.claim(5, 60) == []  # still B's
        await store.complete([as_b])
        await store.complete([as_a])
        await store.retry(as_a, "later still", clock.now)
    job = await store.get_job(job_id)
    assert job is not None and (job.state, job.attempts, job.last_error) == ("done", 2, None)
    assert sum("not recorded" in r.getMessage() for r in caplog.records) == 4


async def test_a_late_outcome_changes_nothing_after_an_admin_retry_reset_the_attempts(
    store: Store, clock: FakeClock
) -> None:
    # Host A stalls past its lease; B claims the job again and it fails for
    # good; an admin retries it (attempts back to 0) and C claims it: attempt
    # 1 again, as A's was. A's late outcome must still be refused, not taken
    # for C's (a retry would hand the job to a fourth worker while C runs it).
    assert isinstance(store, QueueAdmin)
    job_id = await store.enqueue(NewJob("k", {}, 2))
    (as_a,) = await store.claim(1, 60)
    clock.now += 61
    (as_b,) = await store.claim(1, 60)
    await store.fail(as_b, "SMTP 550")
    assert await store.retry_now([job_id], "failed") == [job_id]
    (as_c,) = await store.claim(1, 60)
    assert (as_a.id, as_a.attempts) == (as_c.id, as_c.attempts) == (job_id, 1)

    await store.retry(as_a, "late", clock.now)
    await store.release([as_a])
    await store.complete([as_a])
    assert await store.claim(5, 60) == []  # still C's
    job = await store.get_job(job_id)
    assert job is not None and (job.state, job.attempts) == ("running", 1)
    assert job.last_error == "SMTP 550"  # not A's "late"
    await store.complete([as_c])
    assert (await store.counts()).done == 1


async def test_fail_keeps_a_dead_letter(store: Store) -> None:
    await store.enqueue(NewJob("k", {}, 1))
    (job,) = await store.claim(1, 60)
    await store.fail(job, "SMTP 550: no such user")
    failed = await store.get_job(job.id)
    assert failed is not None and failed.state == "failed"
    assert failed.last_error == "SMTP 550: no such user"
    assert (await store.counts()).failed == 1


async def _figures_and_full_count(
    store: Store, backend: Backend
) -> tuple[dict[str, int], dict[str, int]]:
    counts = await store.counts()
    figures = {state: getattr(counts, state) for state in JOB_STATES}
    counted = dict.fromkeys(JOB_STATES, 0)
    counted.update(await backend.rows("SELECT state, count(*) FROM jobs GROUP BY state"))
    return figures, counted


async def test_counts_follow_every_kind_of_change_to_the_jobs(
    store: Store, backend: Backend, clock: FakeClock
) -> None:
    """What /healthz, /metrics and the status line read matches a count of
    every job after each change. On SQLite, triggers keep the done and failed
    figures (counting them took 82 ms at a million); a change a trigger
    missed shows here."""

    async def check(step: str) -> None:
        figures, counted = await _figures_and_full_count(store, backend)
        assert figures == counted, step

    await check("empty")
    product, _ = await store.create_product("Kopi", 5000, email_job, None)
    for _ in range(6):
        await store.enqueue(NewJob("k", {}, 2))
    await check("created and enqueued")
    first, second, third, fourth = await store.claim(4, 60)
    await check("claimed")
    await store.complete([first])
    await store.retry(second, "SMTP 451", clock.now - 1)
    await store.fail(third, "SMTP 550")
    await store.release([fourth])
    await check("completed, retried, failed, released")
    assert await store.retry_now(None, "failed") == [third.id]
    await check("a failed job retried by an admin")
    await store.complete(await store.claim(10, 60))
    await check("all done")
    clock.now += 3600
    await store.enqueue(NewJob("k", {}, 2))
    await store.claim(1, 3600)
    assert await store.purge_done(clock.now - 1) == 7
    await check("done jobs purged, one running")
    await store.recover_abandoned()
    await check("abandoned jobs recovered")
    await store.enqueue(NewJob("k", {}, 2))
    last = await store.enqueue(NewJob("k", {}, 2))
    # A row deleted beside toko, as restoring an older backup does.
    await backend.forget_since(product.id + 1, last)
    await check("a row deleted by another connection")
    figures, _ = await _figures_and_full_count(store, backend)
    assert sum(figures.values()) == 2


async def test_release_returns_unstarted_jobs_without_an_attempt(store: Store) -> None:
    await store.enqueue(NewJob("k", {}, 3))
    (job,) = await store.claim(1, 60)
    await store.release([job])
    (again,) = await store.claim(1, 60)
    assert again.attempts == 1


async def test_recover_abandoned_requeues_running_jobs(store: Store, backend: Backend) -> None:
    await store.enqueue(NewJob("k", {}, 3))
    await store.claim(1, 3600)
    if backend.name == "sqlite":
        # One toko-api per file: whatever is running belongs to a dead process.
        assert await store.recover_abandoned() == 1
        assert (await store.counts()).pending == 1
    else:
        # Shared database: the running job may be a live instance's; only its
        # lease expiring brings it back (test_expired_lease_is_claimed_again).
        assert await store.recover_abandoned() == 0
        assert (await store.counts()).running == 1


async def test_recap_is_recorded_once_per_period(store: Store, backend: Backend) -> None:
    first = await store.record_recap("2026-11-28", 10, 2, NewJob("recap_email", {}, 3))
    second = await store.record_recap("2026-11-28", 11, 3, NewJob("recap_email", {}, 3))
    assert first is not None and second is None
    assert await backend.rows("SELECT period, products_total FROM recaps") == [("2026-11-28", 10)]
    assert await backend.rows("SELECT count(*) FROM jobs WHERE kind = 'recap_email'") == [(1,)]


async def test_last_recap_before_a_day(store: Store) -> None:
    assert await store.last_recap_before("2026-11-30") is None
    for period in ("2026-11-27", "2026-11-26", "2026-11-30", "2026-12-05"):
        await store.record_recap(period, 0, 0, NewJob("recap_email", {}, 3))
    # Rows for that day or later (a clock that ran ahead) do not count.
    assert await store.last_recap_before("2026-11-30") == "2026-11-27"
    assert await store.last_recap_before("2026-11-27") == "2026-11-26"
    assert await store.last_recap_before("2026-11-26") is None


async def test_closed_store_raises_store_error(backend: Backend) -> None:
    s = backend.make_store()
    await s.open()
    await s.close()
    with pytest.raises(StoreError):
        await s.enqueue(NewJob("k", {}, 1))
    with pytest.raises(StoreError):
        await s.counts()
    with pytest.raises(StoreError):
        await s.create_product("late", 1, email_job)


def test_concurrent_first_opens_migrate_once(tmp_path: Path) -> None:
    # toko-api and toko-recap may open a brand-new file at the same moment.
    # One race in a few dozen used to end in "database is locked" (the switch
    # to WAL): 300 fresh files make that failure all but certain.
    for attempt in range(300):
        path = str(tmp_path / f"fresh-{attempt}.db")

        def open_and_migrate(_: int, path: str = path) -> int:
            conn = connect(path)
            try:
                return migrate(conn)
            finally:
                conn.close()

        with ThreadPoolExecutor(6) as pool:
            befores = list(pool.map(open_and_migrate, range(6)))
        assert sorted(befores) == [0] + [LATEST_VERSION] * 5, "one opener created the schema"


# changes and deletes (PATCH, DELETE /produk/{id}) --------------------------------------


def price_job(before: Product, after: Product) -> NewJob | None:
    return price_email_job(before, after, max_attempts=3)


async def test_a_change_moves_the_version_and_commits_with_its_price_email(
    store: Store, backend: Backend, clock: FakeClock
) -> None:
    product, _ = await store.create_product("Kopi", 1000, email_job)
    assert product.version == 1 and product.etag == '"1"'
    clock.now += 60
    outcome = await store.update_product(product.id, None, 1500, {1}, price_job)
    assert isinstance(outcome, ProductWritten)
    assert outcome.before == product
    assert outcome.after == replace(product, harga=1500, version=2)
    assert outcome.fields == ("harga",) and outcome.at == clock.now
    assert outcome.job_id is not None
    assert await store.get_product(product.id) == outcome.after
    # Visible to another connection: committed, the job with it.
    assert await backend.rows("SELECT nama, harga, version FROM products") == [("Kopi", 1500, 2)]
    job = await store.get_job(outcome.job_id)
    assert job is not None and (job.kind, job.state, job.created_at) == (
        "price_email",
        "pending",
        clock.now,
    )
    assert job.payload == {
        "product_id": product.id,
        "version": 2,
        "nama": "Kopi",
        "harga_lama": 1000,
        "harga": 1500,
    }


async def test_a_rename_alone_queues_no_email(store: Store, backend: Backend) -> None:
    product, _ = await store.create_product("Kopi", 1000, email_job)
    outcome = await store.update_product(product.id, "Kopi Susu", None, {1}, price_job)
    assert isinstance(outcome, ProductWritten) and outcome.job_id is None
    assert outcome.fields == ("nama",) and outcome.after.version == 2
    assert await backend.rows("SELECT count(*) FROM jobs") == [(1,)]  # the product's own


async def test_a_change_of_both_fields_names_the_old_name_in_its_email(store: Store) -> None:
    product, _ = await store.create_product("Kopi", 1000, email_job)
    outcome = await store.update_product(product.id, "Teh", 900, None, price_job)
    assert isinstance(outcome, ProductWritten) and outcome.job_id is not None
    assert outcome.fields == ("nama", "harga")
    job = await store.get_job(outcome.job_id)
    assert job is not None and job.payload["nama"] == "Teh" and job.payload["nama_lama"] == "Kopi"


async def test_values_it_has_already_write_nothing(store: Store, backend: Backend) -> None:
    product, _ = await store.create_product("Kopi", 1000, email_job)
    outcome = await store.update_product(product.id, "Kopi", 1000, {1}, price_job)
    assert isinstance(outcome, ProductWritten)
    assert (outcome.before, outcome.after, outcome.fields, outcome.job_id) == (
        product,
        product,
        (),
        None,
    )
    assert await backend.rows("SELECT version FROM products") == [(1,)]
    assert await backend.rows("SELECT count(*) FROM jobs") == [(1,)]


async def test_a_version_the_product_is_not_at_changes_nothing(
    store: Store, backend: Backend
) -> None:
    product, _ = await store.create_product("Kopi", 1000, email_job)
    for versions in ({2}, {0, 7}, set()):
        assert await store.update_product(product.id, None, 5, versions, price_job) == (
            VersionMismatch(product)
        )
        assert await store.delete_product(product.id, versions) == VersionMismatch(product)
    assert await store.get_product(product.id) == product
    assert await backend.rows("SELECT harga, version, deleted_at FROM products") == [
        (1000, 1, None)
    ]
    assert await backend.rows("SELECT count(*) FROM jobs") == [(1,)]
    # Any of several versions will do; None (If-Match: *) takes whatever it is at.
    changed = await store.update_product(product.id, None, 5, {7, 1}, price_job)
    assert isinstance(changed, ProductWritten) and changed.after.version == 2
    changed = await store.update_product(product.id, None, 6, None, price_job)
    assert isinstance(changed, ProductWritten) and changed.after.version == 3


async def test_no_such_product_is_none(store: Store) -> None:
    assert await store.update_product(404, "x", None, None, price_job) is None
    assert await store.delete_product(404, None) is None
    assert await store.delete_product(404, {1}) is None


async def test_a_deleted_product_is_gone_from_the_api_but_its_row_stays(
    store: Store, backend: Backend, clock: FakeClock
) -> None:
    kopi, _ = await store.create_product("Kopi", 1000, email_job)
    teh, _ = await store.create_product("Teh", 500, email_job)
    susu, _ = await store.create_product("Susu", 700, email_job)
    clock.now += 60
    outcome = await store.delete_product(teh.id, {1})
    assert outcome == ProductWritten(teh, replace(teh, version=2), clock.now)
    assert await store.get_product(teh.id) is None
    assert await store.list_products(0, 10) == [kopi, susu]
    assert await store.list_products(kopi.id, 1) == [susu]
    assert await backend.rows(
        f"SELECT nama, harga, version, deleted_at FROM products WHERE id = {teh.id}"
    ) == [("Teh", 500, 2, clock.now)]
    # Gone: whatever version a client names, even the one the delete gave it.
    assert await store.update_product(teh.id, "Teh Baru", None, {2}, price_job) is None
    assert await store.update_product(teh.id, "Teh Baru", None, None, price_job) is None
    assert await store.delete_product(teh.id, None) is None
    assert await backend.rows(f"SELECT version FROM products WHERE id = {teh.id}") == [(2,)]


async def test_recaps_of_past_days_stay_as_they_were_after_changes_and_deletes(
    store: Store, clock: FakeClock
) -> None:
    day = (clock.now, clock.now + 86400)
    made = [(await store.create_product(f"p{i}", i, email_job))[0] for i in range(3)]
    before = await store.product_counts(*day)
    assert before == (3, 3)
    clock.now += 2 * 86400  # two days on: that day is long over
    await store.update_product(made[0].id, "p0 baru", 99, None, price_job)
    await store.delete_product(made[1].id, None)
    assert await store.product_counts(*day) == before
    # The day of the changes: nothing new, and the total counts every product made.
    assert await store.product_counts(clock.now - 1, clock.now + 1) == (3, 0)


async def test_a_pending_email_of_a_deleted_product_runs_with_what_it_was_queued_with(
    store: Store,
) -> None:
    product, job_id = await store.create_product("Kopi", 1000, email_job)
    changed = await store.update_product(product.id, "Teh", 2000, None, price_job)
    assert isinstance(changed, ProductWritten) and changed.job_id is not None
    await store.delete_product(product.id, None)
    claimed = {job.id: job for job in await store.claim(10, 60)}
    assert set(claimed) == {job_id, changed.job_id}
    assert claimed[job_id].payload == {"product_id": product.id, "nama": "Kopi", "harga": 1000}
    assert claimed[changed.job_id].payload["harga_lama"] == 1000
    context = JobContext(LogMailer(), "toko@toko.test", ("bos@toko.test",))
    for job in claimed.values():
        await HANDLERS[job.kind](job, context)  # nothing reads the product again
    await store.complete(list(claimed.values()))
    assert (await store.counts()).done == 2


async def test_writes_racing_with_one_version_let_exactly_one_through(
    store: Store, backend: Backend
) -> None:
    product, _ = await store.create_product("Kopi", 1000, email_job)
    for version in (1, 2, 3):
        outcomes = await asyncio.gather(
            *(
                store.update_product(product.id, None, 100 * version + i, {version}, price_job)
                for i in range(8)
            )
        )
        won = [o for o in outcomes if isinstance(o, ProductWritten)]
        lost = [o for o in outcomes if isinstance(o, VersionMismatch)]
        assert len(won) == 1 and len(lost) == 7, outcomes
        assert all(o.current == won[0].after for o in lost)
        assert await backend.rows("SELECT version FROM products") == [(version + 1,)]
    assert await backend.rows("SELECT count(*) FROM jobs WHERE kind = 'price_email'") == [(3,)]
    # A change and a delete racing: one of them.
    outcomes = await asyncio.gather(
        store.update_product(product.id, "Teh", None, {4}, price_job),
        store.delete_product(product.id, {4}),
        store.delete_product(product.id, {4}),
    )
    assert sum(isinstance(o, ProductWritten) for o in outcomes) == 1, outcomes
    assert await backend.rows("SELECT version FROM products") == [(5,)]


async def test_a_failing_job_build_rolls_back_the_change_alone(
    store: Store, backend: Backend
) -> None:
    kopi, _ = await store.create_product("Kopi", 1000, email_job)
    teh, _ = await store.create_product("Teh", 500, email_job)

    def broken(before: Product, after: Product) -> NewJob | None:
        raise ValueError("no job for you")

    results = await asyncio.gather(
        store.update_product(kopi.id, "Kopi Baru", 1100, {1}, broken),
        store.update_product(teh.id, None, 600, {1}, price_job),
        store.delete_product(kopi.id, {2}),  # the version the broken change never made
        return_exceptions=True,
    )
    assert isinstance(results[0], ValueError)
    assert isinstance(results[1], ProductWritten)
    assert results[2] == VersionMismatch(kopi)
    assert await backend.rows("SELECT nama, harga, version FROM products ORDER BY id") == [
        ("Kopi", 1000, 1),
        ("Teh", 600, 2),
    ]
    assert await backend.rows("SELECT count(*) FROM jobs WHERE kind = 'price_email'") == [(1,)]


async def test_a_key_answers_with_the_product_as_created_after_changes_and_a_delete(
    store: Store, backend: Backend
) -> None:
    first, _ = await store.create_product("Kopi", 1000, email_job, "order-1")
    await store.update_product(first.id, "Teh", 2000, None, price_job)
    await store.update_product(first.id, "Susu", 3000, None, price_job)
    # A retried POST gets the first answer: the product as it was created.
    assert await store.create_product("Kopi", 1000, email_job, "order-1") == (first, None)
    await store.delete_product(first.id, None)
    assert await store.create_product("Kopi", 1000, email_job, "order-1") == (first, None)
    assert await backend.rows("SELECT count(*) FROM products") == [(1,)]


def test_sqlite_batch_with_two_edits_of_one_version_lets_the_first_through(
    tmp_path: Path,
) -> None:
    # The writer may or may not batch the gathers above; this batch has both.
    conn = connect(str(tmp_path / "toko.db"))
    migrate(conn)
    conn.execute("BEGIN IMMEDIATE")
    ((kopi, _),) = create_products(conn, [("Kopi", 1000, 1.0, email_job, None)])
    edits = [
        ProductEdit(kopi.id, frozenset({1}), 2.0, harga=1500, make_job=price_job),
        ProductEdit(kopi.id, frozenset({1}), 2.0, delete=True),
        ProductEdit(kopi.id, frozenset({2}), 2.0, delete=True),
        ProductEdit(kopi.id, None, 2.0, nama="Teh", make_job=price_job),
    ]
    changed, stale, deleted, gone = edit_products(conn, edits)
    conn.execute("COMMIT")
    assert isinstance(changed, ProductWritten) and changed.after.version == 2
    assert stale == VersionMismatch(changed.after)
    assert isinstance(deleted, ProductWritten) and deleted.after.version == 3
    assert gone is None
    assert conn.execute("SELECT harga, version, deleted_at FROM products").fetchall() == [
        (1500, 3, 2.0)
    ]
    conn.close()


@pytest.mark.parametrize(
    ("backend", "version"),
    OLDER_SCHEMAS,
    indirect=["backend"],
    ids=[f"{name}-v{version}" for name, version in OLDER_SCHEMAS],
)
async def test_products_of_every_older_schema_can_be_changed_and_deleted(
    backend: Backend, version: int, clock: FakeClock
) -> None:
    await backend.make_old_schema(version, *old_inserts())
    store = await _start_as_toko_api(backend, clock)
    try:
        selesai = await store.get_product(1)
        assert selesai == Product(1, "Selesai", 1001, NOW - 7200, version=1)
        assert [p.id for p in await store.list_products(0, 10)] == [1, 2, 3, 4, 5]
        changed = await store.update_product(1, "Selesai Baru", 2001, {1}, price_job)
        assert isinstance(changed, ProductWritten) and changed.after.version == 2
        assert changed.job_id == 6  # ids go on from the old rows'
        assert await store.delete_product(2, {1}) == ProductWritten(
            Product(2, "Tunda", 1002, NOW - 7200), Product(2, "Tunda", 1002, NOW - 7200, 2), NOW
        )
        assert [p.id for p in await store.list_products(0, 10)] == [1, 3, 4, 5]
        # The pending email of the product deleted still has what it was made with.
        job = await store.get_job(2)
        assert job is not None and job.payload["nama"] == "Tunda"
    finally:
        await store.close()
