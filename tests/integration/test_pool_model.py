"""A seeded random walk of the worker pool over a real store and a real SMTP server.

Each step is one thing that happens to a running toko-api: a product whose
job is handed straight to the pool (the path POST /produk takes), a job
another process enqueues (toko-recap, toko-alert), the mail server changing
its mind (accept, delay, 4xx, 5xx, a connection dropped mid-DATA), a job
whose handler raises or hangs past the job timeout, a worker task killed, the
clock stepping past backoffs and leases, an admin's ``retry_now``, and the
pool stopped cleanly or "crashed" (its tasks gone without a word, a new pool
opened on the same database, as after ``kill -9`` and a restart).

What must hold, checked as it happens, at quiet points and at the end:

- every job ends done or failed once the clock has moved on far enough and
  the mail server is healthy;
- a job whose attempt succeeded never runs again, and its email is delivered
  once, except around a crash (its ack not yet written) or an attempt cut off
  mid-send (a timeout, a kill, a drain that ran out);
- an attempt never starts before its job is due (the backoff's run_at);
- attempts never exceed max_attempts, but for the one more try a job gets
  after the process (or worker) running its last attempt died (README, "Jobs
  a killed process left running run again ... even when that was their last
  attempt");
- a failed job has used its attempts and says why (last_error);
- after a clean stop whose drain finished, no job is left running but those
  whose worker was killed mid-job (left to their lease, see WorkerPool._work_loop);
- killed workers are replaced (alive == configured), nothing escapes the pool
  (the loop's exception handler hears nothing; the journal shows no error but
  the expected ones).

The walk is deterministic in what it does (fixed seeds, a fake clock); the
tasks and the SMTP thread interleave as they will, which the invariants allow
for. Run more with ``TOKO_POOL_MODEL_SEEDS=20 TOKO_POOL_MODEL_STEPS=200``.

Allowed for, as documented or not toko's: a worker killed (or cut off by the
drain) while it writes an attempt's outcome leaves its job to the lease like
one killed mid-job; on Python 3.11 a cancel can be lost in aiosmtplib's
``asyncio.wait_for`` (the worker then finishes its job); asyncpg leaves an
unretrieved future behind when a cancel catches its pool opening a connection.
"""

from __future__ import annotations

import asyncio
import gc
import io
import logging
import os
import random
import re
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from service import workers
from service.mail import SmtpMailer
from service.mail_ehlo import EhloName
from service.models import Job, NewJob, Product, stored_job
from service.settings import SmtpTarget
from service.store.base import ABANDONED_ERROR
from service.store.roles import QueueAdmin, Store
from service.tasks import (
    HANDLERS,
    Handler,
    JobContext,
    UnitFailure,
    alert_email_job,
    product_email_job,
    recap_email_job,
)
from service.workers import PoolConfig, WorkerPool
from tests.support.backends import Backend, FakeClock
from tests.support.smtp import SmtpServer

SEEDS = range(int(os.environ.get("TOKO_POOL_MODEL_SEEDS", "3")))
STEPS = int(os.environ.get("TOKO_POOL_MODEL_STEPS", "60"))
WORKERS = 2
MAX_ATTEMPTS = 3
JOB_TIMEOUT = 0.3  # real seconds: a hang costs this much
BACKOFF = 10.0  # fake seconds: 5-10, 10-20, ...
CONFIG = PoolConfig(workers=WORKERS, job_timeout=JOB_TIMEOUT, backoff_base=BACKOFF)
FAR = CONFIG.lease_seconds + BACKOFF * 2**MAX_ATTEMPTS + 1  # past every lease and backoff
MAIL_FROM = "toko@toko.test"
QUIET_SECONDS = 10.0  # the deadline of a wait for the pool to settle
STEP_SECONDS = 30.0  # no step takes this long (a stop waits 2 s at most for its drain)

# What a job's handler does, named in its payload (a product's name, a
# recap's period, an alert's unit): the mail server is left to do the rest.
BEHAVIOURS = ("plain", "raises-once", "raises", "hangs-once")
# An attempt that ended with one of these was cut off: its email may have
# gone out without the pool knowing. "SMTP delivery failed" is an error with
# no reply from the server (aiosmtplib's own timeout, a connection lost): the
# server may have taken the message as the client gave up on its answer.
CUT_OFF = ("CancelledError", "TimeoutError", "crashed", "MailError: SMTP delivery failed")

# The journal lines a walk may write at WARNING or above; any other is a finding.
EXPECTED_LINES = (
    "job failed, will retry",
    "job failed permanently",
    "worker died",
    "worker replaced",
    "re-queued jobs left running by a previous process",
    "draining",
    # The fake clock is months from the database server's (PostgreSQL).
    "this host's clock is",
)


@dataclass
class Attempt:
    job_id: int
    attempt: int
    epoch: int  # which pool ran it (a new one after each stop or crash)
    outcome: str = ""  # "ok", an exception's name, or "crashed"


@dataclass
class Walk:
    """The pool under test, the world around it, and what it was seen doing."""

    backend: Backend
    clock: FakeClock
    smtp: SmtpServer
    rng: random.Random
    store: Store | None = None
    pool: WorkerPool | None = None
    mailer: SmtpMailer | None = None
    epoch: int = 0
    kills: int = 0  # in this pool: its replacements are budgeted (DEATH_BUDGET)
    attempts: list[Attempt] = field(default_factory=list)
    running: dict[int, Attempt] = field(default_factory=dict)
    succeeded: set[int] = field(default_factory=set)
    # May run again though an attempt succeeded: a crash came before its ack.
    unacked_at_crash: Counter[int] = field(default_factory=Counter)
    # Left running by a killed worker, a drain that ran out or a crash.
    orphans: set[int] = field(default_factory=set)
    # Given one more try after their last attempt was cut off (README: "run
    # again at the next start, even when that was their last attempt").
    one_more_try: set[int] = field(default_factory=set)
    jobs: set[int] = field(default_factory=set)
    # The job each worker task started last (kill_worker's victim may still be at it).
    last_job_of: dict[asyncio.Task[Any], int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    products: int = 0
    trace: list[str] = field(default_factory=list)  # the steps taken, for a failure's message

    # the pool's life --------------------------------------------------------------
    async def open(self) -> None:
        self.epoch += 1
        self.kills = 0
        self.store = self.backend.make_store(self.clock)
        await self.store.open()
        target = SmtpTarget("127.0.0.1", self.smtp.port, None, None, use_tls=False)
        self.mailer = SmtpMailer(
            target, timeout=JOB_TIMEOUT, ehlo_name=EhloName(lambda: "toko.test")
        )
        context = JobContext(self.mailer, MAIL_FROM, ("admin@toko.test",))
        handlers: dict[str, Handler] = {kind: self.handler for kind in HANDLERS}
        rng = random.Random(self.rng.random())
        self.pool = WorkerPool(self.store, context, handlers, CONFIG, clock=self.clock, rng=rng)
        self.store.add_wakeup_listener(self.pool.notify)
        await self.pool.start()

    async def stop(self, drain_timeout: float) -> int:
        store, pool, mailer = self.store, self.pool, self.mailer
        assert store is not None and pool is not None and mailer is not None
        left = await pool.stop(drain_timeout, lambda status: None)
        await mailer.close()
        for task in pool.side_tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                self.violations.append(f"pool task {task.get_name()} ended: {task.exception()!r}")
        if left == 0:
            running = await self.job_ids("state = 'running'")
            if running - self.orphans:
                self.violations.append(
                    f"jobs left running after a clean stop: {sorted(running - self.orphans)}"
                )
        else:
            self.orphans |= await self.job_ids("state = 'running'")
        await store.close()
        self.store = self.pool = self.mailer = None
        return left

    async def crash(self) -> None:
        """What kill -9 does to the pool: its tasks end where they stand, nothing more."""
        store, pool, mailer = self.store, self.pool, self.mailer
        assert store is not None and pool is not None and mailer is not None
        pool._stopping = True  # no worker is replaced as it goes
        pending = {*pool._workers.values(), *pool.side_tasks}
        while pending:
            for task in pending:
                # Again if need be: on Python 3.11, asyncio.wait_for (in
                # aiosmtplib) drops a cancel that comes as its reply does.
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.1)
        for attempt in self.running.values():
            attempt.outcome = "crashed"
        self.running.clear()
        await mailer.close()  # the connections drop with the process
        await store.close()  # SQLite commits what it was given; PostgreSQL drops
        self.store = self.pool = self.mailer = None
        done = await self.job_ids("state = 'done'")
        for job_id in self.succeeded - done:
            self.unacked_at_crash[job_id] += 1
        self.orphans |= await self.job_ids("state = 'running'")

    # the handler every job kind runs -----------------------------------------------
    async def handler(self, job: Job, ctx: JobContext) -> None:
        attempt = Attempt(job.id, job.attempts, self.epoch)
        self.check_start(job)
        self.attempts.append(attempt)
        self.running[job.id] = attempt
        self.last_job_of[asyncio.current_task()] = job.id  # type: ignore[index]
        self.orphans.discard(job.id)
        behaviour = behaviour_of(job)
        try:
            if behaviour == "raises" or (behaviour == "raises-once" and job.attempts == 1):
                raise RuntimeError("the handler raised (the test)")
            if behaviour == "hangs-once" and job.attempts == 1:
                await asyncio.Event().wait()  # until the job timeout
            await HANDLERS[job.kind](job, ctx)
        except BaseException as exc:
            attempt.outcome = attempt.outcome or f"{type(exc).__name__}: {exc}"[:120]
            if isinstance(exc, asyncio.CancelledError):
                self.orphans.add(job.id)  # a kill or a drain: left to its lease
            raise
        finally:
            self.running.pop(job.id, None)
        attempt.outcome = "ok"
        self.succeeded.add(job.id)

    def check_start(self, job: Job) -> None:
        """What must hold as an attempt starts (recorded, not raised: the pool
        would take an assertion for the attempt's failure)."""
        now = self.clock()
        if now < job.run_at:
            self.violations.append(f"job {job.id} started at {now} before its run_at {job.run_at}")
        if job.id in self.running:
            self.violations.append(f"job {job.id} started while an attempt of it runs")
        earlier = [a for a in self.attempts if a.job_id == job.id]
        if job.id in self.succeeded and self.unacked_at_crash[job.id] == 0:
            self.violations.append(f"job {job.id} runs again after it succeeded: {earlier}")
        if job.attempts > job.max_attempts:
            last = earlier[-1].outcome if earlier else "none"
            cut_off = last == "" or last.startswith(CUT_OFF)  # "": it runs on, left behind
            if job.attempts > job.max_attempts + 1 or not (cut_off or job.id in self.orphans):
                self.violations.append(
                    f"job {job.id} attempt {job.attempts} of {job.max_attempts}: {earlier}"
                )
            self.one_more_try.add(job.id)

    # looking at the store --------------------------------------------------------
    async def job_ids(self, where: str) -> set[int]:
        return {row[0] for row in await self.backend.rows(f"SELECT id FROM jobs WHERE {where}")}

    async def quiet(self) -> None:
        """Wait until the pool has nothing to do: nothing due in the store,
        nothing held, no ack unwritten. No event says so: poll, with a deadline."""
        pool = self.pool
        assert pool is not None
        now = self.clock()
        due = (
            f"(state = 'pending' AND run_at <= {now!r})"
            f" OR (state = 'running' AND lease_until < {now!r})"
        )
        try:
            async with asyncio.timeout(QUIET_SECONDS):
                while True:
                    idle = not (pool.busy or pool._held or pool._acks or pool._acks_in_flight)
                    if idle and pool._handoff.empty() and not await self.job_ids(due):
                        return
                    await asyncio.sleep(0.005)
        except TimeoutError:
            rows = await self.backend.rows(
                "SELECT id, state, attempts, run_at, lease_until FROM jobs"
            )
            self.violations.append(
                f"the pool did not settle within {QUIET_SECONDS} s (now {now}): busy {pool.busy},"
                f" held {sorted(pool._held)}, alive {pool.alive}, rows {rows}"
            )

    def check_workers(self) -> None:
        pool = self.pool
        assert pool is not None
        if pool.alive != pool.configured or not pool.healthy():
            self.violations.append(f"{pool.alive} of {pool.configured} workers alive")

    # the steps -------------------------------------------------------------------
    async def new_product(self) -> None:
        """A POST /produk: the product and its job in one write, handed to the pool."""
        store, pool = self.store, self.pool
        assert store is not None and pool is not None
        self.products += 1
        nama = f"P{self.products} {self.rng.choice(BEHAVIOURS)}"
        key = f"order-{self.rng.randrange(self.products + 3)}" if self.rng.random() < 0.2 else None

        async def write(leased_for: float | None) -> tuple[Product, Job | None]:
            def make_job(product: Product) -> NewJob:
                return product_email_job(product, MAX_ATTEMPTS, leased_for)

            product, job_id = await store.create_product(nama, 1000, make_job, key)
            if job_id is None:
                return product, None
            return product, stored_job(job_id, make_job(product), product.created_at)

        _, job_id = await pool.enqueue_here(write)
        if job_id is not None:
            self.jobs.add(job_id)

    async def enqueue_elsewhere(self) -> None:
        """A job toko-recap or toko-alert enqueues: pending, heard by LISTEN or the sweep."""
        store = self.store
        assert store is not None
        behaviour = self.rng.choice(BEHAVIOURS)
        n = len(self.jobs)
        if self.rng.random() < 0.5:
            job = recap_email_job(f"2027-01-{n:02d} {behaviour}", n, 1, MAX_ATTEMPTS)
        else:
            failure = UnitFailure(f"toko-backup-{n}.service {behaviour}", "host", "2027-01-01")
            job = alert_email_job(failure, MAX_ATTEMPTS)
        self.jobs.add(await store.enqueue(job))

    def mail_server(self) -> None:
        choice = self.rng.randrange(6)
        if choice == 0:
            self.smtp.reset()
        elif choice == 1:
            self.smtp.set_delay(self.rng.choice((0.01, 0.05, JOB_TIMEOUT * 1.5)))
        elif choice == 2:
            self.smtp.fail_next(self.rng.randrange(1, 4))
        elif choice == 3:
            self.smtp.refuse_subject(self.rng.choice(("Produk baru", "Rekap", "failed")))
        elif choice == 4:
            self.smtp.drop_connections()  # mid-DATA when a reply is delayed
        else:
            self.smtp.limit_per_connection(self.rng.randrange(1, 3))

    def kill_worker(self) -> None:
        pool = self.pool
        assert pool is not None
        if self.kills < workers.DEATH_BUDGET:  # beyond it the pool is meant to give up
            self.kills += 1
            victim = next(task for task in pool._workers.values() if not task.done())
            # Its last job, if it is still at it (running it, or writing how it
            # went), is left to its lease.
            if victim in self.last_job_of:
                self.orphans.add(self.last_job_of.pop(victim))
            pool.kill_one_worker()

    async def retry_now(self) -> None:
        store = self.store
        assert isinstance(store, QueueAdmin)
        which = self.rng.choice(("failed", "waiting"))
        everyone = self.rng.random() < 0.5 or not self.jobs
        ids = None if everyone else [self.rng.choice(sorted(self.jobs))]
        await store.retry_now(ids, which)

    async def step(self) -> None:
        roll = self.rng.random()
        self.trace.append(f"{roll:.2f}@{self.clock.now - 1_800_000_000.0:g}")
        if roll < 0.30:
            await self.new_product()
        elif roll < 0.42:
            await self.enqueue_elsewhere()
        elif roll < 0.55:
            self.mail_server()
        elif roll < 0.62:
            self.kill_worker()
        elif roll < 0.74:
            self.clock.now += self.rng.choice((1.0, 6.0, 25.0, CONFIG.lease_seconds + 1, FAR))
        elif roll < 0.80:
            await self.retry_now()
        elif roll < 0.90:
            await self.quiet()
            self.check_workers()
        elif roll < 0.95:
            await self.stop(self.rng.choice((0.0, 0.05, 2.0)))
            await self.open()
        else:
            await self.crash()
            await self.open()

    async def settle(self) -> None:
        """A healthy mail server and time enough: every job ends done or failed."""
        self.smtp.reset()
        for _ in range(3 * MAX_ATTEMPTS + 3):
            await self.quiet()
            open_jobs = await self.job_ids("state NOT IN ('done', 'failed')")
            if not open_jobs or self.violations:
                return
            self.clock.now += FAR  # the sweep takes the retries and expired leases
        self.violations.append(f"jobs never ended: {sorted(open_jobs)}")

    async def within_deadline(self, step: Awaitable[None]) -> None:
        """``step``, which must not hang: if it does, say where every task waits."""
        try:
            async with asyncio.timeout(STEP_SECONDS):
                await step
        except TimeoutError:
            stacks = io.StringIO()
            for task in asyncio.all_tasks():
                task.print_stack(limit=8, file=stacks)
            pytest.fail(f"a step hung: {self.trace[-20:]}\n{stacks.getvalue()}")

    # the end ----------------------------------------------------------------------
    async def check_end(self) -> None:
        rows = await self.backend.rows(
            "SELECT id, state, attempts, max_attempts, last_error FROM jobs ORDER BY id"
        )
        for job_id, state, attempts, max_attempts, last_error in rows:
            if state not in ("done", "failed"):
                self.violations.append(f"job {job_id} ended {state}")
            if state == "failed":
                # One more try, which failed too, or was cut off once more.
                extra = job_id in self.one_more_try or last_error == ABANDONED_ERROR
                allowed = {max_attempts, max_attempts + 1} if extra else {max_attempts}
                if attempts not in allowed or not last_error:
                    self.violations.append(
                        f"job {job_id} failed after {attempts} of {max_attempts}: {last_error!r}"
                    )
        self.check_deliveries()

    def check_deliveries(self) -> None:
        """An email goes out once, but around a crash or an attempt cut off mid-send."""
        delivered = Counter(
            int(re.match(r"<job-(\d+)\.", m.message_id).group(1))  # type: ignore[union-attr]
            for m in self.smtp.delivered()
        )
        for job_id, times in delivered.items():
            cut_off = sum(
                1 for a in self.attempts if a.job_id == job_id and a.outcome.startswith(CUT_OFF)
            )
            if times > 1 + cut_off + self.unacked_at_crash[job_id]:
                mine = [a for a in self.attempts if a.job_id == job_id]
                self.violations.append(f"job {job_id}'s email delivered {times} times: {mine}")


def behaviour_of(job: Job) -> str:
    text = str(job.payload.get("nama") or job.payload.get("period") or job.payload.get("unit"))
    return text.rsplit(" ", 1)[-1]


class JournalWatch(logging.Handler):
    """toko's log lines at WARNING and above that no step explains."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.unexpected: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if not message.startswith(EXPECTED_LINES):
            self.unexpected.append(f"{record.name} {record.levelname}: {message}")


@pytest.fixture
def journal() -> Iterator[JournalWatch]:
    watch = JournalWatch()
    logger = logging.getLogger("toko")
    logger.addHandler(watch)
    try:
        yield watch
    finally:
        logger.removeHandler(watch)


@pytest.fixture
async def escaped() -> AsyncIterator[list[str]]:
    """Whatever reaches the event loop's exception handler (a task's exception
    nobody retrieved, a callback that raised)."""
    loop = asyncio.get_running_loop()
    seen: list[str] = []

    def record(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        # asyncpg's own: a store call cancelled (a killed worker's, a crash's)
        # while its pool opens a new connection leaves the SSL negotiation's
        # future behind, failed once the socket closes. Nothing toko holds.
        if str(context.get("exception")) != "unexpected connection_lost() call":
            seen.append(str(context))

    loop.set_exception_handler(record)
    yield seen
    gc.collect()  # a future nobody retrieved is reported as it is collected
    loop.set_exception_handler(None)


@pytest.fixture
async def smtp() -> AsyncIterator[SmtpServer]:
    with SmtpServer() as server:
        yield server


@pytest.mark.parametrize("seed", SEEDS)
async def test_the_pool_keeps_its_promises_through_a_random_walk(
    seed: int,
    backend: Backend,
    clock: FakeClock,
    smtp: SmtpServer,
    journal: JournalWatch,
    escaped: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Jobs other processes enqueue on SQLite, retries falling due and leases
    # running out are found by the sweep: a short one keeps the walk quick.
    monkeypatch.setattr(workers, "SWEEP_SECONDS", 0.02)
    walk = Walk(backend, clock, smtp, random.Random(seed))
    await walk.open()
    try:
        for _ in range(STEPS):
            await walk.within_deadline(walk.step())
            assert not walk.violations, (walk.violations, walk.trace)
        await walk.within_deadline(walk.settle())
        walk.check_workers()
        await walk.check_end()
        await walk.stop(5.0)
    finally:
        if walk.pool is not None:
            await walk.stop(1.0)
    assert not walk.violations, walk.violations
    assert not journal.unexpected, journal.unexpected
    assert not escaped, escaped
