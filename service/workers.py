"""The worker pool: claim due jobs, run them, ack or retry; never die silently.

One claimer task leases due jobs for the idle workers plus one job of
prefetch per worker (one round trip for several jobs) and hands them over;
a job enqueued by this process while a slot is free skips the claimer: it is
written already leased and handed over directly (``reserve``/``dispatch``),
but only while the claimer's last look found nothing more due in the store:
otherwise it is written pending and queues behind the jobs already waiting,
which are claimed in due order (a freed slot would go to the next new job
before the claimer's claim, so under load the waiting ones would wait for
the load to end);
``TOKO_WORKERS`` worker tasks run them; one acker task marks finished jobs
done in batches. A committed job wakes the claimer at once (``notify``); a
slow sweep catches jobs enqueued by other processes and retries falling due.
Prefetch stays at one job per worker so a queued job never waits longer than
one attempt's timeout, which the lease outlasts. The claimer never takes back
a job the pool still holds, whatever the wall clock did to its lease.

An exception in a job fails that attempt only. A worker task that dies anyway
is logged and replaced, up to a budget: a pool that keeps dying is reported
dead, so /healthz turns 503 and the watchdog lets systemd restart us.

One concern, kept in one module though past 500 lines: the claimer, the
workers, the acker and stop share the pool's slots and the jobs it holds
(``_held``), and each step of a job's life here hands it from one to the
next; split, that state would travel between modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from service.logs import Throttle
from service.models import Job, PartlyDone, job_fields, printable_text
from service.store.base import StoreError
from service.store.roles import Store
from service.tasks import Handler, JobContext

log = logging.getLogger("toko.worker")

# How long the claimer sleeps when nothing is due and nobody wakes it.
SWEEP_SECONDS = 1.0
# Backing off when the store itself fails, so a broken disk is not hammered.
STORE_RETRY_SECONDS = 1.0
# How long stop() waits for a claim in flight before cancelling it.
CLAIMER_STOP_SECONDS = 5.0
# How long stop() waits for each of its own writes: putting back unstarted
# jobs, then marking the last ones done. A store that hangs (a locked table, a
# silent database host) would otherwise hold the exit for its command timeout
# per write, past systemd's TimeoutStopSec=. A write given up on is left to
# the store, not withdrawn: it is recorded if the store takes it after all (a
# lock let go of); if not, those jobs run again (at the next start, or when
# their lease expires).
STOP_WRITE_SECONDS = 5.0
# stop() reports that it still waits this often (EXTEND_TIMEOUT_USEC).
STOP_TICK_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 3600.0
# More deaths than this within the window and the pool gives up replacing.
DEATH_BUDGET = 5
DEATH_WINDOW_SECONDS = 60.0


JobOutcome = Literal["succeeded", "retried", "failed"]
T = TypeVar("T")


class JobObserver(Protocol):
    """Told about every finished attempt (metrics). Called on the hot path: be quick."""

    def job_finished(self, kind: str, outcome: JobOutcome, seconds: float) -> None: ...


@dataclass(frozen=True)
class PoolConfig:
    workers: int
    job_timeout: float
    max_backoff: float = MAX_BACKOFF_SECONDS
    backoff_base: float = 2.0

    @property
    def lease_seconds(self) -> float:
        # Longer than any attempt may take, so a live worker never loses its lease.
        return self.job_timeout * 2 + 30.0


def backoff_delay(attempt: int, base: float, cap: float, rng: random.Random) -> float:
    """Exponential backoff with equal jitter: half fixed, half random."""
    delay = min(cap, base * 2.0 ** max(attempt - 1, 0))
    return delay / 2 + rng.uniform(0, delay / 2)


class WorkerPool:
    def __init__(
        self,
        store: Store,
        context: JobContext,
        handlers: dict[str, Handler],
        config: PoolConfig,
        *,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        observer: JobObserver | None = None,
        turn: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._store = store
        self._turn = turn  # awaited before each job: requests go first (requests_first)
        self._context = context
        self._handlers = handlers
        self._config = config
        self._clock = clock
        self._rng = rng or random.Random()
        self._observer = observer
        self._handoff: asyncio.Queue[Job | None] = asyncio.Queue()
        self._wakeup = asyncio.Event()
        self._capacity = asyncio.Event()
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._claimer: asyncio.Task[None] | None = None
        self._acker: asyncio.Task[None] | None = None
        self._acks: list[Job] = []
        self._acks_in_flight = 0  # taken from _acks by the writes in flight
        self._left_to_store: set[asyncio.Future[None]] = set()  # writes stop() gave up on
        self._late: list[Job] = []  # leased jobs dispatched after stop() began
        # Leased to us and not yet acked, retried or failed in the store: never
        # claimed again by us, even if a clock step makes their leases look expired.
        self._held: set[int] = set()
        self._ack_wakeup = asyncio.Event()
        self._busy = 0
        self._reserved = 0  # slots promised to jobs being enqueued here (reserve())
        self._claiming = 0  # slots the claim in flight may fill
        # Until then (self._clock) the store holds no due job the claimer has
        # not seen, so a job enqueued here may skip the queue (reserve()).
        self._direct_until = 0.0
        self._stopping = False
        self._deaths: list[float] = []
        # A store that is down fails the claim every STORE_RETRY_SECONDS.
        self._claim_failures = Throttle()
        self._gave_up = False
        self.succeeded = 0
        self.retried = 0
        self.failed = 0

    # public ----------------------------------------------------------------------
    @property
    def configured(self) -> int:
        return self._config.workers

    @property
    def alive(self) -> int:
        return sum(1 for task in self._workers.values() if not task.done())

    @property
    def busy(self) -> int:
        return self._busy

    def healthy(self) -> bool:
        side_ok = all(not task.done() for task in self.side_tasks)
        return bool(self.side_tasks) and side_ok and self.alive == self.configured

    @property
    def side_tasks(self) -> list[asyncio.Task[None]]:
        """The claimer and the acker: if either ends, the pool is broken."""
        return [task for task in (self._claimer, self._acker) if task is not None]

    def notify(self) -> None:
        """A job was committed: look for work now rather than at the next sweep."""
        # It waits in the store: jobs enqueued here from now on queue behind it.
        self._direct_until = 0.0
        self._wakeup.set()

    def reserve(self) -> float | None:
        """Promise a slot to a job this process is about to enqueue.

        Returns the lease (seconds) to enqueue it with (``NewJob.leased_for``),
        or None when no slot is free, or when jobs may be waiting in the store
        (they go first): then enqueue it pending and ``notify()``.
        Every reservation must end in ``dispatch()``; ``enqueue_here`` does
        all of it. A job enqueued leased
        skips the claim, a second write and a hop through the store, which is
        most of what stands between a commit and its job starting.
        """
        if self._stopping or self._gave_up or self._free_slots() <= 0:
            return None
        if self._clock() >= self._direct_until:
            return None
        self._reserved += 1
        return self._config.lease_seconds

    async def enqueue_here(
        self, write: Callable[[float | None], Awaitable[tuple[T, Job | None]]]
    ) -> tuple[T, int | None]:
        """Enqueue a job through ``write`` and run it here if a slot is free.

        ``write(leased_for)`` stores the job (``NewJob.leased_for=leased_for``)
        and returns (its own result, the job as stored: ``stored_job()``), or
        (result, None) when it stored none. With a slot free the job is
        written already leased and handed over; otherwise it is written
        pending and the claimer is woken. Returns (result, job id).
        """
        leased_for = self.reserve()
        try:
            result, job = await write(leased_for)
        except BaseException:
            if leased_for is not None:
                self.dispatch(None)
            raise
        if job is None:
            if leased_for is not None:
                self.dispatch(None)
        elif leased_for is None:
            self.notify()
        else:
            self.dispatch(job)
        return result, None if job is None else job.id

    def dispatch(self, job: Job | None) -> None:
        """End a reservation: run ``job`` (enqueued leased), or None if it was not stored."""
        self._reserved -= 1
        if job is None:
            self._capacity.set()
        elif self._stopping:
            # Too late to run: put it back for the next start, like an unstarted claim.
            self._late.append(job)
        else:
            self._held.add(job.id)
            self._handoff.put_nowait(job)

    async def start(self) -> None:
        recovered = await self._store.recover_abandoned()
        if recovered:
            log.warning(
                "re-queued jobs left running by a previous process",
                extra={"JOBS": recovered},
            )
        for index in range(1, self._config.workers + 1):
            self._spawn(f"worker-{index}")
        self._claimer = asyncio.create_task(self._claim_loop(), name="toko-claimer")
        self._acker = asyncio.create_task(self._ack_loop(), name="toko-acker")

    def kill_one_worker(self) -> None:
        """Fault injection: end a worker task the way a bug would."""
        for task in self._workers.values():
            if not task.done():
                task.cancel("fault injection")
                return

    async def stop(self, drain_timeout: float, on_wait: Callable[[str], None]) -> int:
        """Stop claiming, let running jobs finish for up to ``drain_timeout``.

        Jobs claimed but not started go back to pending. ``on_wait(status)`` is
        called about every second while stop() waits (for running jobs, or for
        the store). Returns how many jobs were still running at the deadline
        (they run again at the next start).
        """
        self._stopping = True
        await self._stop_claimer()
        unstarted: list[Job] = []
        while not self._handoff.empty():
            job = self._handoff.get_nowait()
            if job is not None:
                unstarted.append(job)
        await self._write_at_stop(
            self._release(unstarted), "putting back unstarted jobs", len(unstarted), on_wait
        )
        for _ in self._workers:
            self._handoff.put_nowait(None)  # each idle worker exits on its None
        deadline = time.monotonic() + drain_timeout
        pending = {task for task in self._workers.values() if not task.done()}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            log.info("draining", extra={"JOBS_RUNNING": self._busy})
            on_wait(f"draining: {self._busy} job(s) still running")
            _, pending = await asyncio.wait(pending, timeout=min(STOP_TICK_SECONDS, remaining))
        left = self._busy
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        unsaved = len(self._acks) + len(self._late) + self._acks_in_flight
        await self._write_at_stop(
            self._save_last_outcomes(), "marking the last jobs done", unsaved, on_wait
        )
        return left

    async def _save_last_outcomes(self) -> None:
        # All at once, not each behind the last: behind a store that hangs (a
        # locked table) the later ones would never be sent before the exit,
        # though the store would have recorded them as soon as it could.
        writes: list[Awaitable[None]] = [self._flush_acks(), self._release(self._late)]
        if self._acker is not None and not self._acker.done():
            self._ack_wakeup.set()  # it ends after its write in flight
            writes.append(self._acker)
        await asyncio.gather(*writes)

    async def _write_at_stop(
        self, write: Awaitable[None], what: str, jobs: int, on_wait: Callable[[str], None]
    ) -> None:
        """Await ``write`` for at most STOP_WRITE_SECONDS, reporting each second."""
        task = asyncio.ensure_future(write)
        deadline = time.monotonic() + STOP_WRITE_SECONDS
        while True:
            remaining = deadline - time.monotonic()
            done, _ = await asyncio.wait([task], timeout=min(STOP_TICK_SECONDS, remaining))
            if done:
                task.result()
                return
            if time.monotonic() >= deadline:
                break
            on_wait(f"stopping: {what}")
        # Not cancelled, and not awaited: the store may still record it, where
        # a cancel would withdraw it and its jobs would run again. SQLite commits
        # what it was given as it closes; a PostgreSQL server that holds the
        # statement, waiting on a lock, commits it even after close() dropped
        # the connection. A silent host ignores a cancel anyway.
        self._left_to_store.add(task)
        task.add_done_callback(self._left_to_store.discard)
        task.add_done_callback(_outcome_seen)
        log.error(
            "the store did not answer within %g s while stopping (%s); those jobs may run again",
            STOP_WRITE_SECONDS,
            what,
            extra={"JOBS": jobs},
        )

    async def _release(self, jobs: list[Job]) -> None:
        if not jobs:
            return
        try:
            await self._store.release(jobs)
        except StoreError as exc:
            log.error("could not release unstarted jobs: %s", exc, extra={"JOBS": len(jobs)})
        finally:
            self._held.difference_update(job.id for job in jobs)

    # claimer ---------------------------------------------------------------------
    async def _stop_claimer(self) -> None:
        """Let the claimer finish a claim in flight rather than cancel it.

        A cancelled claim still commits in the writer thread; its jobs would be
        left "running" with nobody holding them until the next start (or, on a
        shared database, until their lease expires).
        """
        if self._claimer is None or self._claimer.done():
            return
        self._wakeup.set()
        self._capacity.set()
        done, _ = await asyncio.wait([self._claimer], timeout=CLAIMER_STOP_SECONDS)
        if not done:  # the store hangs: give up on the claim
            self._claimer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._claimer

    async def _claim_loop(self) -> None:
        while not self._stopping:
            free = self._free_slots()
            if free <= 0:
                self._capacity.clear()
                await self._capacity.wait()
                continue  # (re-checks _stopping: stop() sets _capacity)
            # Clear before claiming: a job committed during the claim sets it
            # again, so no wake-up is lost between the claim and the wait.
            self._wakeup.clear()
            try:
                self._claiming = free
                try:
                    jobs = await self._store.claim(free, self._config.lease_seconds, self._held)
                finally:
                    self._claiming = 0
                for job in jobs:
                    self._held.add(job.id)
                    self._handoff.put_nowait(job)
                if len(jobs) == free:
                    # More may be due: new jobs queue behind them until a
                    # claim comes back short.
                    self._direct_until = 0.0
                    continue
                wait = await self._seconds_until_due()
                if not self._wakeup.is_set():  # (a job committed meanwhile waits)
                    # Nothing else is due until then; the sweep bounds it, for
                    # jobs other processes enqueue without a word.
                    self._direct_until = self._clock() + wait
            except StoreError as exc:
                self._claim_failures.log(
                    log, logging.ERROR, "claiming jobs failed, retrying: %s", exc
                )
                wait = STORE_RETRY_SECONDS
            if self._stopping:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), wait)

    def _free_slots(self) -> int:
        # A job for every live worker plus one of prefetch each; a claim in
        # flight may fill its share, so reserve() must not promise it again.
        taken = self._busy + self._handoff.qsize() + self._reserved + self._claiming
        return self.alive + self._config.workers - taken

    async def _seconds_until_due(self) -> float:
        due = await self._store.next_due_at(self._held)
        if due is None:
            return SWEEP_SECONDS
        return min(SWEEP_SECONDS, max(0.0, due - self._clock()))

    # workers ---------------------------------------------------------------------
    def _spawn(self, name: str) -> None:
        task = asyncio.create_task(self._work_loop(name), name=f"toko-{name}")
        self._workers[name] = task
        task.add_done_callback(functools.partial(self._on_worker_exit, name))

    def _on_worker_exit(self, name: str, task: asyncio.Task[None]) -> None:
        if self._stopping:
            return
        reason = "cancelled" if task.cancelled() else repr(task.exception())
        log.error("worker died", extra={"WORKER": name, "REASON": reason})
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < DEATH_WINDOW_SECONDS] + [now]
        if len(self._deaths) > DEATH_BUDGET:
            self._gave_up = True
            log.critical(
                "workers keep dying; not replacing any more (the watchdog will restart us)",
                extra={"WORKER": name},
            )
            return
        self._spawn(name)
        self._capacity.set()
        log.warning("worker replaced", extra={"WORKER": name})

    async def _work_loop(self, name: str) -> None:
        while True:
            job = await self._handoff.get()
            if job is None:
                return
            self._busy += 1
            try:
                if self._turn is not None:
                    await self._turn()  # counted busy meanwhile: stop() drains it
                await self._run(job, name)
            except BaseException:
                # This worker dies mid-job (a bug, or a cancel). Let go of the
                # job: its lease runs out and the claimer takes it again.
                self._held.discard(job.id)
                raise
            finally:
                self._busy -= 1
                self._capacity.set()

    async def _run(self, job: Job, worker: str) -> None:
        handler = self._handlers.get(job.kind)
        started = time.monotonic()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("job started", extra={**job_fields(job), "WORKER": worker})
        try:
            if handler is None:
                raise LookupError(f"no handler for job kind {job.kind!r}")
            async with asyncio.timeout(self._config.job_timeout):
                await handler(job, self._context)
        except Exception as exc:
            elapsed = time.monotonic() - started  # the attempt, not the store write after it
            fields = {**job_fields(job), "WORKER": worker}
            left = exc.payload if isinstance(exc, PartlyDone) else None
            outcome = await self._record_failure(
                job, _describe(exc), fields, left, hopeless=getattr(exc, "permanent", False)
            )
            if self._observer is not None and outcome is not None:
                self._observer.job_finished(job.kind, outcome, elapsed)
            return
        elapsed = time.monotonic() - started
        self._acks.append(job)
        self._ack_wakeup.set()
        self.succeeded += 1
        if self._observer is not None:
            self._observer.job_finished(job.kind, "succeeded", elapsed)
        # DEBUG: the job's own line ("email sent") already tells the journal;
        # and the fields are only built when someone reads them (hot path).
        if log.isEnabledFor(logging.DEBUG):
            fields = {**job_fields(job), "WORKER": worker}
            log.debug("job succeeded", extra={**fields, "DURATION_MS": round(elapsed * 1000, 1)})

    # acker -----------------------------------------------------------------------
    async def _ack_loop(self) -> None:
        while not self._stopping:
            await self._ack_wakeup.wait()
            self._ack_wakeup.clear()
            # Acks arriving while this write is in flight form the next batch.
            await self._flush_acks()
        await self._flush_acks()

    async def _flush_acks(self) -> None:
        jobs, self._acks = self._acks, []
        if not jobs:
            return
        self._acks_in_flight += len(jobs)
        try:
            await self._store.complete(jobs)
        except StoreError as exc:
            # Those jobs ran but are not marked done: they run again later
            # (delivery is at-least-once; the Message-ID tells duplicates apart).
            log.error("could not mark jobs done: %s", exc, extra={"JOBS": len(jobs)})
        finally:
            self._acks_in_flight -= len(jobs)
            self._held.difference_update(job.id for job in jobs)

    async def _record_failure(
        self,
        job: Job,
        error: str,
        fields: dict[str, object],
        left: dict[str, Any] | None,
        *,
        hopeless: bool = False,
    ) -> JobOutcome | None:
        """Fail or reschedule the job; the outcome, or None if the store could not say.

        ``left``: the payload of what the attempt left undone (PartlyDone); a
        failed job keeps it too, for an admin's retry. ``hopeless``: the error
        says a retry will not fix it (MailError.permanent: a 5xx, a wrong
        password). The job is retried all the same, as the admin may fix the
        cause meanwhile, but the retry is logged as an error: `journalctl -p
        err` shows it now, not when the last attempt fails hours later.
        """
        fields = {**fields, "ERROR": error}
        try:
            if job.attempts >= job.max_attempts:
                await self._store.fail(job, error, left)
                self.failed += 1
                log.error("job failed permanently", extra=fields)
                return "failed"
            delay = backoff_delay(
                job.attempts, self._config.backoff_base, self._config.max_backoff, self._rng
            )
            await self._store.retry(job, error, self._clock() + delay, left)
        except StoreError as exc:
            log.error("could not record job failure: %s", exc, extra=fields)
            return None
        finally:
            # Stored as pending or failed, or left to its lease: ours no more.
            self._held.discard(job.id)
        self.retried += 1
        level = logging.ERROR if hopeless else logging.WARNING
        log.log(level, "job failed, will retry", extra={**fields, "RETRY_IN_S": round(delay, 3)})
        self.notify()  # the claimer recomputes when the next job falls due
        return "retried"


def _outcome_seen(task: asyncio.Future[None]) -> None:
    # Whatever it ended with was logged where it happened, or is moot.
    if not task.cancelled():
        task.exception()


def _describe(exc: Exception) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    # printable: a mail server's reply is its own bytes (Latin-1, escapes), and
    # a store write that refuses them would end the worker, not the attempt.
    return printable_text(f"{type(exc).__name__}: {exc}")[:1000]
