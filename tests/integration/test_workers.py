from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from typing import Any

import pytest

from service import workers
from service.mail_message import Email
from service.models import Job, NewJob
from service.settings import Settings
from service.store import postgres
from service.store.base import StoreError
from service.store.roles import Store
from service.tasks import JobContext
from service.workers import PoolConfig, WorkerPool, backoff_delay
from tests.support.backends import Backend, FakeClock


class NoMail:
    async def send(self, email: Email) -> None:
        raise AssertionError("these tests do not send mail")


CONTEXT = JobContext(NoMail(), "toko@localhost", ("admin@toko.com",))
HandlerFn = Callable[[Job, JobContext], Awaitable[None]]


@pytest.fixture
async def make_pool(store: Store) -> AsyncIterator[Callable[..., WorkerPool]]:
    pools: list[WorkerPool] = []

    def make(
        handler: HandlerFn,
        clock: Callable[[], float] = time.time,
        turn: Callable[[], Awaitable[None]] | None = None,
        **config: float,
    ) -> WorkerPool:
        cfg = PoolConfig(
            workers=int(config.get("workers", 2)),
            job_timeout=config.get("job_timeout", 5.0),
            backoff_base=config.get("backoff_base", 0.01),
        )
        pool = WorkerPool(
            store, CONTEXT, {"k": handler}, cfg, clock=clock, rng=random.Random(7), turn=turn
        )
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        await pool.stop(0.5, lambda status: None)


async def wait_state(store: Store, job_id: int, state: str) -> Job:
    async with asyncio.timeout(10):
        while True:
            job = await store.get_job(job_id)
            if job is not None and job.state == state:
                return job
            await asyncio.sleep(0.01)  # no event for a row change; poll with a deadline


async def enqueue_stored(store: Store, job: NewJob) -> Job:
    """Enqueue ``job`` and read it back: the Job a write for enqueue_here returns."""
    stored = await store.get_job(await store.enqueue(job))
    assert stored is not None
    return stored


def signalling_handler() -> tuple[asyncio.Event, HandlerFn]:
    """A handler that sets the returned event when it runs."""
    ran = asyncio.Event()

    async def handler(job: Job, ctx: JobContext) -> None:
        ran.set()

    return ran, handler


def held_handler() -> tuple[asyncio.Event, asyncio.Event, HandlerFn]:
    """A handler that sets ``started`` when it runs, then waits for ``release``."""
    started, release = asyncio.Event(), asyncio.Event()

    async def handler(job: Job, ctx: JobContext) -> None:
        started.set()
        await release.wait()

    return started, release, handler


async def start_parked(pool: WorkerPool, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Start ``pool`` and return once its claimer's first claim (of an empty queue) is done
    and it has asked when to look again: that claim's slots are free again, and with
    nothing waiting in the store, reservations are handed out until its next sweep,
    a minute away here (a slow machine must not close them mid-test)."""
    monkeypatch.setattr(workers, "SWEEP_SECONDS", 60.0)
    parked = asyncio.Event()
    real_next_due_at = store.next_due_at

    async def signalling_next_due_at(held: Collection[int] = ()) -> float | None:
        due = await real_next_due_at(held)
        parked.set()  # the claimer takes it in before this test runs on
        return due

    monkeypatch.setattr(store, "next_due_at", signalling_next_due_at)
    await pool.start()
    await parked.wait()


async def test_a_committed_job_wakes_the_pool_without_waiting_for_a_sweep(
    store: Store, make_pool: Callable[..., WorkerPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(workers, "SWEEP_SECONDS", 60.0)
    ran, handler = signalling_handler()
    pool = make_pool(handler)
    await start_parked(pool, store, monkeypatch)  # the claimer found nothing and waits
    await store.enqueue(NewJob("k", {}, 3))
    pool.notify()
    async with asyncio.timeout(5):  # far below the 60 s sweep
        await ran.wait()


async def test_a_reserved_job_runs_without_a_claim(
    store: Store, make_pool: Callable[..., WorkerPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(workers, "SWEEP_SECONDS", 60.0)
    ran, handler = signalling_handler()
    pool = make_pool(handler)
    await start_parked(pool, store, monkeypatch)
    claimed: list[int] = []
    real_claim = store.claim

    async def recording_claim(
        limit: int, lease_seconds: float, held: Collection[int] = ()
    ) -> list[Job]:
        jobs = await real_claim(limit, lease_seconds, held)
        claimed.extend(job.id for job in jobs)
        return jobs

    monkeypatch.setattr(store, "claim", recording_claim)

    async def write(leased_for: float | None) -> tuple[None, Job]:
        assert leased_for == pool._config.lease_seconds  # a slot is free
        return None, await enqueue_stored(store, NewJob("k", {}, 3, leased_for=leased_for))

    _, job_id = await pool.enqueue_here(write)
    async with asyncio.timeout(5):
        await ran.wait()
    assert (await wait_state(store, job_id, "done")).attempts == 1
    assert claimed == []  # it never went through a claim


async def test_a_clock_step_does_not_make_the_pool_retake_its_running_job(
    store: Store,
    clock: FakeClock,
    make_pool: Callable[..., WorkerPool],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(workers, "SWEEP_SECONDS", 60.0)
    attempts: list[int] = []
    started, release = asyncio.Event(), asyncio.Event()

    async def handler(job: Job, ctx: JobContext) -> None:
        attempts.append(job.attempts)
        started.set()
        await release.wait()

    pool = make_pool(handler)
    await start_parked(pool, store, monkeypatch)
    job_id = await store.enqueue(NewJob("k", {}, 3))
    pool.notify()
    await started.wait()

    # NTP steps the wall clock an hour ahead: the running job's lease looks
    # expired, and the claimer is woken (a new job, or its sweep).
    clock.now += 3600
    claimed = asyncio.Event()
    real_claim = store.claim
    retaken: list[int] = []

    async def recording_claim(
        limit: int, lease_seconds: float, held: Collection[int] = ()
    ) -> list[Job]:
        jobs = await real_claim(limit, lease_seconds, held)
        retaken.extend(job.id for job in jobs)
        claimed.set()
        return jobs

    monkeypatch.setattr(store, "claim", recording_claim)
    # After that claim the claimer asks when to look again: not "now", which
    # would make it claim in a loop for as long as the job runs.
    asked = asyncio.Event()
    real_next_due_at = store.next_due_at
    next_due: list[float | None] = []

    async def recording_next_due_at(held: Collection[int] = ()) -> float | None:
        due = await real_next_due_at(held)
        next_due.append(due)
        asked.set()
        return due

    monkeypatch.setattr(store, "next_due_at", recording_next_due_at)
    pool.notify()
    await claimed.wait()
    await asked.wait()
    assert retaken == []
    assert next_due == [None]
    release.set()
    assert (await wait_state(store, job_id, "done")).attempts == 1
    assert attempts == [1]


async def test_the_job_of_a_worker_that_dies_mid_job_runs_again_after_its_lease(
    store: Store,
    clock: FakeClock,
    make_pool: Callable[..., WorkerPool],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(workers, "SWEEP_SECONDS", 60.0)
    attempts: list[int] = []
    started = asyncio.Event()

    async def handler(job: Job, ctx: JobContext) -> None:
        attempts.append(job.attempts)
        if job.attempts == 1:
            started.set()
            await asyncio.Event().wait()  # until its worker is killed

    pool = make_pool(handler, workers=1)
    await start_parked(pool, store, monkeypatch)
    job_id = await store.enqueue(NewJob("k", {}, 3))
    pool.notify()
    await started.wait()
    pool.kill_one_worker()
    await asyncio.sleep(0)  # the cancellation lands
    await asyncio.sleep(0)  # the done callback runs
    assert pool.alive == 1
    # Its job stays running on its lease, then the replacement takes it.
    clock.now += pool._config.lease_seconds + 1
    pool.notify()
    job = await wait_state(store, job_id, "done")
    assert job.attempts == 2 and attempts == [1, 2]


async def test_a_write_that_stored_no_job_gives_its_slot_back(
    store: Store, make_pool: Callable[..., WorkerPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A repeated POST (its Idempotency-Key's product exists) stores nothing.
    monkeypatch.setattr(workers, "SWEEP_SECONDS", 60.0)
    _, handler = signalling_handler()
    pool = make_pool(handler, workers=1)
    await start_parked(pool, store, monkeypatch)

    async def write_nothing(leased_for: float | None) -> tuple[str, None]:
        return "answered", None

    for _ in range(5):  # more than the pool's two slots
        assert await pool.enqueue_here(write_nothing) == ("answered", None)
    assert pool.reserve() is not None, "every slot came back"
    pool.dispatch(None)


async def test_a_post_cancelled_after_its_leased_job_committed_frees_its_slot(
    store: Store,
    clock: FakeClock,
    make_pool: Callable[..., WorkerPool],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # aiohttp cancels handlers still running at shutdown, and SQLite's writer
    # commits a cancelled write all the same: the job is stored leased to a
    # pool that never heard of it. Its slot must come back, and the job must
    # run once its lease is up (the claimer does not hold it; with SQLite, at
    # the next start already), not be lost.
    ran, handler = signalling_handler()
    pool = make_pool(handler, clock=clock, workers=1)
    await start_parked(pool, store, monkeypatch)
    committed: list[int] = []
    both_committed = asyncio.Event()

    async def write_then_get_cancelled(leased_for: float | None) -> tuple[None, Job]:
        assert leased_for is not None  # a slot was promised
        committed.append(await store.enqueue(NewJob("k", {}, 3, leased_for=leased_for)))
        if len(committed) == 2:
            both_committed.set()
        await asyncio.Event().wait()  # the handler is cancelled before it answers
        raise AssertionError("not reached")

    posts = [asyncio.create_task(pool.enqueue_here(write_then_get_cancelled)) for _ in range(2)]
    async with asyncio.timeout(5):
        await both_committed.wait()
    for post in posts:
        post.cancel()
    for post in posts:
        with pytest.raises(asyncio.CancelledError):
            await post
    assert [pool.reserve(), pool.reserve()] == [pool._config.lease_seconds] * 2, (
        "both slots came back"
    )
    pool.dispatch(None)
    pool.dispatch(None)
    assert not ran.is_set() and not pool._held
    clock.now += pool._config.lease_seconds + 1
    pool.notify()
    for job_id in committed:
        assert (await wait_state(store, job_id, "done")).attempts == 2


async def test_a_store_that_stays_down_is_logged_once_per_interval_by_the_claimer(
    store: Store,
    make_pool: Callable[..., WorkerPool],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(workers, "STORE_RETRY_SECONDS", 0.001)
    attempts = 0
    enough = asyncio.Event()

    async def failing_claim(
        limit: int, lease_seconds: float, held: Collection[int] = ()
    ) -> list[Job]:
        nonlocal attempts
        attempts += 1
        if attempts == 50:
            enough.set()
        raise StoreError("database call failed: connection refused")

    monkeypatch.setattr(store, "claim", failing_claim)
    _, handler = signalling_handler()
    pool = make_pool(handler)
    with caplog.at_level(logging.ERROR, logger="toko.worker"):
        await pool.start()
        async with asyncio.timeout(10):
            await enough.wait()
    lines = [r for r in caplog.records if r.getMessage().startswith("claiming jobs failed")]
    assert len(lines) == 1, "50 failures within the 10 s interval: one line"


async def test_without_a_free_slot_the_job_waits_pending_for_the_claimer(
    store: Store, make_pool: Callable[..., WorkerPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    release = asyncio.Event()

    async def handler(job: Job, ctx: JobContext) -> None:
        await release.wait()

    pool = make_pool(handler, workers=1)
    await start_parked(pool, store, monkeypatch)

    async def write(leased_for: float | None) -> tuple[None, Job]:
        return None, await enqueue_stored(store, NewJob("k", {}, 3, leased_for=leased_for))

    ids = [(await pool.enqueue_here(write))[1] for _ in range(3)]
    states = [(await store.get_job(i)).state for i in ids]  # type: ignore[union-attr]
    assert states == ["running", "running", "pending"]  # one worker + one prefetch
    release.set()
    for job_id in ids:
        await wait_state(store, job_id, "done")


async def test_a_claim_in_flight_holds_its_slots_against_reservations(
    store: Store, make_pool: Callable[..., WorkerPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def handler(job: Job, ctx: JobContext) -> None:
        pass

    in_claim = asyncio.Event()
    finish_claim = asyncio.Event()
    real_claim = store.claim

    async def slow_claim(limit: int, lease_seconds: float, held: Collection[int] = ()) -> list[Job]:
        in_claim.set()
        await finish_claim.wait()
        return await real_claim(limit, lease_seconds, held)

    monkeypatch.setattr(store, "claim", slow_claim)
    pool = make_pool(handler, workers=1)
    await pool.start()
    await in_claim.wait()
    assert pool.reserve() is None  # both slots may be filled by that claim
    finish_claim.set()


async def test_reservations_stop_at_the_pool_capacity(
    store: Store, make_pool: Callable[..., WorkerPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def handler(job: Job, ctx: JobContext) -> None:
        pass

    pool = make_pool(handler, workers=1)
    await start_parked(pool, store, monkeypatch)
    # One worker plus one job of prefetch, as for claims.
    assert pool.reserve() is not None and pool.reserve() is not None
    assert pool.reserve() is None
    pool.dispatch(None)  # that write failed: its slot is free again
    assert pool.reserve() is not None


async def test_stop_puts_back_a_leased_job_that_never_started(
    store: Store, make_pool: Callable[..., WorkerPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    started, release, handler = held_handler()
    pool = make_pool(handler, workers=1)
    await start_parked(pool, store, monkeypatch)
    ids = []
    for _ in range(2):
        job = await enqueue_stored(store, NewJob("k", {}, 3, leased_for=pool.reserve()))
        ids.append(job.id)
        pool.dispatch(job)
    await started.wait()

    def on_wait(status: str) -> None:
        release.set()  # the first job finishes while the pool drains

    assert await pool.stop(5.0, on_wait) == 0
    first, second = [await store.get_job(i) for i in ids]
    assert first is not None and first.state == "done"
    assert second is not None and second.state == "pending" and second.attempts == 0


async def test_outcomes_stop_gave_up_on_are_recorded_once_the_store_answers(
    store: Store,
    backend: Backend,
    make_pool: Callable[..., WorkerPool],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The jobs table stays locked past the stop (maintenance; on SQLite another
    # process's write lock), so stop() gives up on its writes. It withdrew them
    # (PostgreSQL cancelled the statement its server held) and left unsent the
    # ones queued behind (an ack behind the ack in flight, the jobs to put
    # back): jobs whose emails had gone out ran again once the lock was gone.
    monkeypatch.setattr(workers, "STOP_WRITE_SECONDS", 0.2)
    monkeypatch.setattr(workers, "STOP_TICK_SECONDS", 0.05)
    monkeypatch.setattr(postgres, "CLOSE_SECONDS", 0.2)
    started = {name: asyncio.Event() for name in "abcz"}
    finish = {name: asyncio.Event() for name in "abc"}

    async def handler(job: Job, ctx: JobContext) -> None:
        started[job.payload["name"]].set()
        if job.payload["name"] != "z":
            await finish[job.payload["name"]].wait()

    pool = make_pool(handler, workers=2)
    await start_parked(pool, store, monkeypatch)

    async def enqueue_here(name: str) -> int:
        job = await enqueue_stored(store, NewJob("k", {"name": name}, 3, leased_for=pool.reserve()))
        pool.dispatch(job)
        return job.id

    # A job acked before: the acker's connection knows its statement, as in
    # a service that has run for a while.
    await wait_state(store, await enqueue_here("z"), "done")
    acking = asyncio.Event()
    real_complete = store.complete

    async def signalling_complete(jobs: Sequence[Job]) -> None:
        acking.set()
        await real_complete(jobs)

    monkeypatch.setattr(store, "complete", signalling_complete)
    ids = {name: await enqueue_here(name) for name in "abc"}  # c waits for a worker
    await started["a"].wait()
    await started["b"].wait()

    def on_wait(status: str) -> None:
        if status.startswith("draining"):
            finish["a"].set()
            if acking.is_set():  # a's ack waits for the lock: b's comes behind it
                finish["b"].set()

    async with backend.jobs_locked():
        assert await pool.stop(5.0, on_wait) == 0
        closing = asyncio.create_task(store.close())
        if backend.name == "postgres":
            await closing  # it gave up on the server and dropped the connections
    await closing  # SQLite commits what it was given once the lock is gone
    expected = {"a": ("done", 1)}
    if backend.name == "sqlite":
        expected |= {"b": ("done", 1), "c": ("pending", 0)}  # c: put back, unstarted
    # PostgreSQL records the statements its server held; b's ack (behind a's
    # on the acker's connection) and c's release (parsed only once the lock
    # is gone) had not reached it: they run again when their leases expire,
    # as after a kill.
    assert await settled_states(backend, {name: ids[name] for name in expected}) == expected


async def settled_states(backend: Backend, ids: dict[str, int]) -> dict[str, tuple[str, int]]:
    """Each job's (state, attempts) once none is running, or as it is after 5 s."""
    names = {job_id: name for name, job_id in ids.items()}
    listed = ", ".join(str(job_id) for job_id in ids.values())
    sql = f"SELECT id, state, attempts FROM jobs WHERE id IN ({listed})"
    rows: list[tuple[Any, ...]] = []
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(5):
            while True:
                rows = await backend.rows(sql)
                if all(state != "running" for _, state, _ in rows):
                    break
                await asyncio.sleep(0.01)  # a server commits them as it gets the lock: poll
    return {names[job_id]: (state, attempts) for job_id, state, attempts in rows}


async def test_exceptions_are_retried_then_kept_as_failed(
    store: Store, make_pool: Callable[..., WorkerPool]
) -> None:
    attempts: list[int] = []

    async def handler(job: Job, ctx: JobContext) -> None:
        attempts.append(job.attempts)
        raise RuntimeError("smtp said no")

    pool = make_pool(handler)
    job_id = await store.enqueue(NewJob("k", {}, 3))
    await pool.start()
    job = await wait_state(store, job_id, "failed")
    assert attempts == [1, 2, 3]
    assert job.last_error == "RuntimeError: smtp said no"
    assert pool.healthy(), "a failing job must not hurt the workers"
    assert (pool.retried, pool.failed) == (2, 1)


async def test_a_job_that_fails_once_then_succeeds(
    store: Store, make_pool: Callable[..., WorkerPool]
) -> None:
    async def handler(job: Job, ctx: JobContext) -> None:
        if job.attempts == 1:
            raise ConnectionError("temporary")

    pool = make_pool(handler)
    job_id = await store.enqueue(NewJob("k", {}, 3))
    await pool.start()
    done = await wait_state(store, job_id, "done")
    assert done.attempts == 2


async def test_a_hanging_job_times_out(store: Store, make_pool: Callable[..., WorkerPool]) -> None:
    async def handler(job: Job, ctx: JobContext) -> None:
        await asyncio.Event().wait()

    pool = make_pool(handler, job_timeout=0.1)
    job_id = await store.enqueue(NewJob("k", {}, 1))
    await pool.start()
    job = await wait_state(store, job_id, "failed")
    assert job.last_error == "timed out"


async def test_unknown_kind_fails_without_killing_a_worker(
    store: Store, make_pool: Callable[..., WorkerPool]
) -> None:
    async def handler(job: Job, ctx: JobContext) -> None:
        pass

    pool = make_pool(handler)
    job_id = await store.enqueue(NewJob("nonexistent", {}, 1))
    await pool.start()
    job = await wait_state(store, job_id, "failed")
    assert "no handler" in (job.last_error or "")
    assert pool.alive == 2


async def test_an_error_text_no_database_takes_fails_the_attempt_not_the_worker(
    store: Store, make_pool: Callable[..., WorkerPool]
) -> None:
    # A mail server answering in Latin-1: aiosmtplib hands over its bytes as
    # surrogate escapes, which no UTF-8 database stores.
    async def handler(job: Job, ctx: JobContext) -> None:
        raise RuntimeError("550 Empf\udce4nger unbekannt")

    pool = make_pool(handler, workers=1)
    job_id = await store.enqueue(NewJob("k", {}, 1))
    await pool.start()
    job = await wait_state(store, job_id, "failed")
    assert job.last_error == "RuntimeError: 550 Empf\\xe4nger unbekannt"
    assert pool.alive == 1 and pool.healthy()


async def test_a_dead_worker_is_replaced(
    store: Store, make_pool: Callable[..., WorkerPool]
) -> None:
    async def handler(job: Job, ctx: JobContext) -> None:
        pass

    pool = make_pool(handler)
    await pool.start()
    pool.kill_one_worker()
    await asyncio.sleep(0)  # the cancellation lands
    await asyncio.sleep(0)  # the done callback runs
    assert pool.alive == 2 and pool.healthy()
    job_id = await store.enqueue(NewJob("k", {}, 1))
    pool.notify()
    await wait_state(store, job_id, "done")


async def test_a_pool_that_keeps_dying_reports_itself_unhealthy(
    store: Store, make_pool: Callable[..., WorkerPool]
) -> None:
    async def handler(job: Job, ctx: JobContext) -> None:
        pass

    pool = make_pool(handler, workers=1)
    await pool.start()
    for _ in range(workers.DEATH_BUDGET + 1):
        pool.kill_one_worker()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    assert pool.alive == 0
    assert not pool.healthy()


async def test_stop_drains_the_running_job_and_releases_unstarted_ones(
    store: Store, make_pool: Callable[..., WorkerPool]
) -> None:
    started, release, handler = held_handler()
    pool = make_pool(handler, workers=1)
    first = await store.enqueue(NewJob("k", {}, 3))
    second = await store.enqueue(NewJob("k", {}, 3))
    await pool.start()
    await started.wait()
    said: list[str] = []

    def on_wait(status: str) -> None:
        said.append(status)
        release.set()  # the job finishes while the pool drains

    left = await pool.stop(5.0, on_wait)
    assert left == 0 and "draining: 1 job(s) still running" in said
    assert (await store.get_job(first)).state == "done"  # type: ignore[union-attr]
    unstarted = await store.get_job(second)
    assert unstarted is not None and unstarted.state == "pending" and unstarted.attempts == 0


async def test_a_job_starts_only_once_the_pool_is_given_its_turn(
    store: Store, make_pool: Callable[..., WorkerPool]
) -> None:
    asked = asyncio.Event()
    go = asyncio.Event()

    async def turn() -> None:  # requests_first.RequestsFirst.turn in toko-api
        asked.set()
        await go.wait()

    ran, handler = signalling_handler()
    pool = make_pool(handler, turn=turn, workers=1)
    job_id = await store.enqueue(NewJob("k", {}, 3))
    await pool.start()
    async with asyncio.timeout(5):
        await asked.wait()
    assert not ran.is_set() and pool.busy == 1  # held, and counted as taken
    go.set()
    async with asyncio.timeout(5):
        await ran.wait()
    await wait_state(store, job_id, "done")


async def test_drain_timeout_leaves_the_job_for_the_next_start(
    store: Store, backend: Backend, make_pool: Callable[..., WorkerPool]
) -> None:
    started, _never, handler = held_handler()
    pool = make_pool(handler, workers=1)
    job_id = await store.enqueue(NewJob("k", {}, 3))
    await pool.start()
    await started.wait()
    assert await pool.stop(0.05, lambda status: None) == 1
    assert (await store.get_job(job_id)).state == "running"  # type: ignore[union-attr]
    # SQLite: the next start re-queues it; PostgreSQL: its lease expiring does
    # (another instance may hold running jobs, so nothing is re-queued blindly).
    assert await store.recover_abandoned() == (1 if backend.name == "sqlite" else 0)


def test_backoff_grows_exponentially_with_jitter() -> None:
    rng = random.Random(1)
    for attempt, base in [(1, 2.0), (2, 4.0), (3, 8.0), (20, 3600.0)]:
        delays = [backoff_delay(attempt, 2.0, 3600.0, rng) for _ in range(200)]
        assert all(base / 2 <= d <= base for d in delays)
        assert max(delays) - min(delays) > base / 4, "no jitter"


class LowestJitter(random.Random):
    """Every jitter at its low end: the shortest schedule the retries can take."""

    def uniform(self, a: float, b: float) -> float:
        return a


def test_default_retries_outlast_a_mail_outage_of_hours() -> None:
    # The settings toko-api starts with when nothing is configured.
    settings = Settings.from_env({})
    shortest = sum(
        backoff_delay(attempt, settings.pool.backoff, workers.MAX_BACKOFF_SECONDS, LowestJitter())
        for attempt in range(1, settings.jobs.max_attempts)  # the delays between attempts
    )
    assert shortest > 4 * 3600, shortest


def test_a_lease_is_twice_the_job_timeout_and_30_s_90_s_by_default() -> None:
    # Another PostgreSQL host takes over a dead host's job once its lease is
    # over: the README tells admins how long that is.
    settings = Settings.from_env({})
    config = PoolConfig(workers=settings.pool.workers, job_timeout=settings.pool.timeout)
    assert config.lease_seconds == 90
    assert PoolConfig(workers=1, job_timeout=5.0).lease_seconds == 40


class PausedClaims:
    """The real store, with each claim held at a gate: stop() must come mid-claim."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.claiming = asyncio.Event()
        self.gate = asyncio.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    async def claim(
        self, limit: int, lease_seconds: float, held: Collection[int] = ()
    ) -> list[Job]:
        write = asyncio.ensure_future(self._store.claim(limit, lease_seconds, held))
        self.claiming.set()
        await self.gate.wait()
        return await write


async def test_stop_during_a_claim_leaves_no_job_running(store: Store) -> None:
    # A claim cut off by cancellation still commits in the writer, leaving
    # "running" rows that nobody holds until the next start or lease expiry.
    async def handler(job: Job, ctx: JobContext) -> None:
        pass

    for i in range(5):
        await store.enqueue(NewJob("k", {"i": i}, 3))
    paused = PausedClaims(store)
    pool = WorkerPool(paused, CONTEXT, {"k": handler}, PoolConfig(workers=1, job_timeout=5))  # type: ignore[arg-type]
    await pool.start()
    await paused.claiming.wait()
    stopping = asyncio.create_task(pool.stop(5.0, lambda status: None))
    await asyncio.sleep(0)  # stop() is now waiting on the claim in flight
    paused.gate.set()
    await stopping
    counts = await store.counts()
    assert counts.running == 0, counts
    assert counts.pending + counts.done == 5


class SteadyArrivals:
    """One worker kept full: as each job ends, a new one is enqueued here through
    ``enqueue_here``, as POST /produk does near capacity. The test lets the
    running job end (``finish_next``) and reads the order jobs started in."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.pool: WorkerPool | None = None
        self.started: list[int] = []
        self.arrived: list[int] = []
        self.arrivals_left = 0
        self._start: asyncio.Queue[int] = asyncio.Queue()
        self._finish: asyncio.Queue[None] = asyncio.Queue()
        self._arrivals: list[asyncio.Task[None]] = []

    async def handler(self, job: Job, ctx: JobContext) -> None:
        if job.payload.get("fails_once") and job.attempts == 1:
            raise ConnectionError("the mail server is away")
        self._start.put_nowait(job.id)
        await self._finish.get()
        if self.arrivals_left > 0:
            # Started before this worker frees its slot, so it reaches reserve()
            # before the claimer wakes: the race a POST wins under load.
            self.arrivals_left -= 1
            self._arrivals.append(asyncio.create_task(self._arrive()))

    async def enqueue(self, payload: dict[str, object] | None = None) -> int:
        assert self.pool is not None

        async def write(leased_for: float | None) -> tuple[None, Job]:
            job = NewJob("k", dict(payload or {}), 3, leased_for=leased_for)
            return None, await enqueue_stored(self.store, job)

        _, job_id = await self.pool.enqueue_here(write)
        assert job_id is not None
        return job_id

    async def _arrive(self) -> None:
        self.arrived.append(await self.enqueue())

    async def next_start(self) -> int:
        job_id = await self._start.get()
        self.started.append(job_id)
        return job_id

    def finish_next(self) -> None:
        self._finish.put_nowait(None)

    async def run(self, jobs: int) -> None:
        """Let ``jobs`` jobs start and end, one at a time, in the order the pool picks."""
        for _ in range(jobs):
            await self.next_start()
            self.finish_next()

    async def stop_arrivals(self) -> None:
        self.arrivals_left = 0
        await asyncio.gather(*self._arrivals)
        for _ in range(len(self.arrived) + 10):
            self.finish_next()  # whatever is still queued ends at once


async def test_jobs_already_waiting_run_before_jobs_enqueued_after_them(
    store: Store, make_pool: Callable[..., WorkerPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Near capacity, each slot that frees was taken by the next POST before the
    # claimer's claim got it: the jobs waiting in the store waited for the rush to end.
    load = SteadyArrivals(store)
    pool = load.pool = make_pool(load.handler, workers=1)
    await start_parked(pool, store, monkeypatch)
    in_slots = [await load.enqueue() for _ in range(2)]  # one running, one prefetched
    waiting = [await load.enqueue() for _ in range(3)]  # no slot free: pending
    assert [(await store.get_job(i)).state for i in waiting] == ["pending"] * 3  # type: ignore[union-attr]
    load.arrivals_left = 6
    await load.run(len(in_slots) + len(waiting) + 2)
    await load.stop_arrivals()
    assert load.started == in_slots + waiting + sorted(load.arrived)[:2]


async def test_a_retry_falling_due_runs_before_jobs_enqueued_after_it(
    store: Store,
    clock: FakeClock,
    make_pool: Callable[..., WorkerPool],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    load = SteadyArrivals(store)
    # The pool's retry times on the store's clock, which this test moves.
    pool = load.pool = make_pool(load.handler, clock=clock, workers=1, backoff_base=10.0)
    await start_parked(pool, store, monkeypatch)
    retried = await load.enqueue({"fails_once": True})
    await wait_state(store, retried, "pending")  # its retry is 5-10 s away
    in_slots = [await load.enqueue() for _ in range(2)]
    assert await load.next_start() == in_slots[0]
    await wait_state(store, in_slots[1], "running")  # both slots are taken
    clock.now += 10.0  # the retry falls due while the workers are busy
    load.arrivals_left = 6
    load.finish_next()
    await load.run(3)
    await load.stop_arrivals()
    assert load.started == [*in_slots, retried, min(load.arrived)]


async def test_a_job_committed_while_the_claimer_looks_goes_before_new_ones(
    store: Store, make_pool: Callable[..., WorkerPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The claimer's look at the store read it empty, then a job was committed
    # pending: that look must not let the next new job skip ahead of it.
    _, handler = signalling_handler()
    pool = make_pool(handler, workers=1)
    await start_parked(pool, store, monkeypatch)
    looked, answer = asyncio.Event(), asyncio.Event()
    right_after: asyncio.Future[float | None] = asyncio.get_running_loop().create_future()
    real_next_due_at = store.next_due_at

    async def slow_next_due_at(held: Collection[int] = ()) -> float | None:
        due = await real_next_due_at(held)  # read before the commit below
        if not looked.is_set():
            looked.set()
            await answer.wait()

            def reserve_now() -> None:
                right_after.set_result(pool.reserve())

            # Runs once the claimer has taken in this answer and waits again
            # (a moment: the job's wake-up has it claim at once).
            asyncio.get_running_loop().call_soon(reserve_now)
        return due

    monkeypatch.setattr(store, "next_due_at", slow_next_due_at)
    pool.notify()  # as the sweep does: the claimer claims (nothing), then looks
    await looked.wait()
    job_id = await store.enqueue(NewJob("k", {}, 3))  # a job that found no slot free
    pool.notify()
    answer.set()
    reserved = await right_after
    if reserved is not None:
        pool.dispatch(None)
    assert reserved is None, "a new job would have gone ahead of the waiting one"
    await wait_state(store, job_id, "done")
