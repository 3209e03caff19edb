"""Model-based differential test of the store: a seeded random walk.

Each step (enqueue, claim, ack, retry, fail, release, recovery, a clock
step, the admin's retry and purge, products...) is applied both to the store
(on each backend, see conftest) and to :class:`Model`, a small in-memory
version of what design.md, the README and the docstrings of ``Store`` and
``QueueAdmin`` promise. After every step everything a caller can see is
compared: return values, and every job as ``list_jobs`` shows it (state,
attempts, run_at, last_error, lease, updated_at; and the order it lists them in).

What the model holds to: a claim takes due pending jobs in the order they
fell due (run_at, then id), then expired leases; an outcome is written only
by the claim that still holds the job (the model numbers claims, the store
must tell them apart); the documented differences between the backends
(recover_abandoned, and the newest job a purge keeps on SQLite) and nothing
else. Where the store may choose (which of more expired leases than a claim
takes), the model checks that the choice was one it allows and follows it.

The walk is deterministic (fixed seeds, a fake clock); run more seeds with
``TOKO_MODEL_SEEDS=100 TOKO_MODEL_STEPS=1000``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from service.models import JOB_STATES, Job, JobState, NewJob, Product, QueueCounts
from service.store.admin import JobDetails, Retryable
from service.store.base import ABANDONED_ERROR
from service.store.roles import QueueAdmin, Store
from service.tasks import product_email_job
from tests.support.backends import Backend, FakeClock

SEEDS = range(int(os.environ.get("TOKO_MODEL_SEEDS", "3")))
STEPS = int(os.environ.get("TOKO_MODEL_STEPS", "250"))
KINDS = ("product_email", "recap_email", "alert_email")
KEYS = ("order-1", "order-2", "order-3", "order-4")
NAMES = ("Kopi", "Teh Hijau", "Gula Aren", "Kue Lapis", "Durian Musang", "Sate ñ 🍢")


@dataclass
class MJob:
    """A job as the model keeps it: what ``JobDetails`` shows, and whose claim it is."""

    id: int
    kind: str
    payload: dict[str, Any]
    state: JobState
    attempts: int
    max_attempts: int
    run_at: float
    created_at: float
    updated_at: float
    lease_until: float | None = None
    last_error: str | None = None
    claim: int = 0  # which claim holds it (while running); 0: none yet

    def details(self) -> JobDetails:
        job = Job(
            self.id,
            self.kind,
            self.payload,
            self.state,
            self.attempts,
            self.max_attempts,
            self.run_at,
            self.created_at,
            self.last_error,
        )
        return JobDetails(job, self.updated_at, self.lease_until)


@dataclass(frozen=True)
class Claim:
    """A claim as its worker holds it: the job it was handed, and which claim it is."""

    job: Job
    serial: int


@dataclass
class Model:
    """What the store promises, kept the obvious way."""

    backend: str
    jobs: dict[int, MJob] = field(default_factory=dict)
    products: dict[int, Product] = field(default_factory=dict)
    keys: dict[str, int] = field(default_factory=dict)
    next_job_id: int = 1
    next_product_id: int = 1
    claims: int = 0

    def _new_claim(self, job: MJob) -> Claim:
        self.claims += 1
        job.claim = self.claims
        return Claim(job.details().job, self.claims)

    # products -----------------------------------------------------------------
    def create_product(
        self, nama: str, harga: int, make_job: Any, key: str | None, now: float
    ) -> tuple[Product, int | None, Claim | None]:
        if key is not None and key in self.keys:
            return self.products[self.keys[key]], None, None
        product = Product(self.next_product_id, nama, harga, now)
        self.next_product_id += 1
        self.products[product.id] = product
        if key is not None:
            self.keys[key] = product.id
        job_id, claim = self.enqueue(make_job(product), now)
        return product, job_id, claim

    def list_products(self, after_id: int, limit: int) -> list[Product]:
        return [self.products[i] for i in sorted(self.products) if i > after_id][:limit]

    def product_counts(self, start: float, end: float) -> tuple[int, int]:
        times = [p.created_at for p in self.products.values()]
        return sum(t < end for t in times), sum(start <= t < end for t in times)

    # queue --------------------------------------------------------------------
    def enqueue(self, new: NewJob, now: float) -> tuple[int, Claim | None]:
        job = MJob(
            self.next_job_id,
            new.kind,
            new.payload,
            "pending",
            0,
            new.max_attempts,
            run_at=now,
            created_at=now,
            updated_at=now,
        )
        self.next_job_id += 1
        self.jobs[job.id] = job
        if new.leased_for is None:
            return job.id, None
        job.state, job.attempts, job.lease_until = "running", 1, now + new.leased_for
        return job.id, self._new_claim(job)

    def due(self, now: float, limit: int) -> list[MJob]:
        """Pending jobs a claim takes first: due ones, in the order they fell due."""
        due = [j for j in self.jobs.values() if j.state == "pending" and j.run_at <= now]
        return sorted(due, key=lambda j: (j.run_at, j.id))[:limit]

    def expired(self, now: float, held: Sequence[int]) -> list[MJob]:
        return [
            j
            for j in self.jobs.values()
            if j.state == "running"
            and j.lease_until is not None
            and j.lease_until < now
            and j.id not in held
        ]

    def claim(
        self, picked: list[MJob], now: float, lease_seconds: float
    ) -> tuple[list[Job], list[Claim]]:
        """Lease ``picked``; those beyond their last attempt become failed instead."""
        claims: list[Claim] = []
        for job in picked:
            job.updated_at = now
            if job.state == "running" and job.attempts > job.max_attempts:
                job.state, job.lease_until, job.last_error = "failed", None, ABANDONED_ERROR
                job.claim = 0
                continue
            job.state, job.attempts = "running", job.attempts + 1
            job.lease_until = now + lease_seconds
            claims.append(self._new_claim(job))
        claims.sort(key=lambda c: c.job.id)
        return [c.job for c in claims], claims

    def _held(self, claim: Claim) -> MJob | None:
        """The job, if ``claim`` still holds it: an outcome writes only then."""
        job = self.jobs.get(claim.job.id)
        if job is None or job.state != "running" or job.claim != claim.serial:
            return None
        return job

    def complete(self, claims: Sequence[Claim], now: float) -> None:
        for claim in claims:
            if job := self._held(claim):
                job.state, job.lease_until, job.updated_at, job.claim = "done", None, now, 0

    def set_state(
        self,
        claim: Claim,
        state: JobState,
        error: str,
        run_at: float | None,
        payload: dict[str, Any] | None,
        now: float,
    ) -> None:
        if job := self._held(claim):
            job.state, job.last_error, job.lease_until, job.updated_at = state, error, None, now
            job.claim = 0
            if run_at is not None:
                job.run_at = run_at
            if payload is not None:
                job.payload = payload

    def release(self, claims: Sequence[Claim], now: float) -> None:
        for claim in claims:
            if job := self._held(claim):
                job.state, job.attempts = "pending", max(job.attempts - 1, 0)
                job.lease_until, job.updated_at, job.claim = None, now, 0

    def recover_abandoned(self, now: float) -> int:
        # Documented: SQLite (one toko-api per file) re-queues every running
        # job; a shared PostgreSQL leaves them to their leases.
        if self.backend != "sqlite":
            return 0
        recovered = 0
        for job in self.jobs.values():
            if job.state != "running":
                continue
            if job.attempts > job.max_attempts:
                job.state, job.last_error = "failed", ABANDONED_ERROR
            else:
                job.state = "pending"
                recovered += 1
            job.lease_until, job.updated_at, job.claim = None, now, 0
        return recovered

    def next_due_at(self, held: Sequence[int]) -> float | None:
        times = [j.run_at for j in self.jobs.values() if j.state == "pending"]
        times += [
            j.lease_until
            for j in self.jobs.values()
            if j.state == "running" and j.lease_until is not None and j.id not in held
        ]
        return min(times) if times else None

    def counts(self, now: float) -> QueueCounts:
        figures = dict.fromkeys(JOB_STATES, 0)
        for job in self.jobs.values():
            figures[job.state] += 1
        due = [j.run_at for j in self.jobs.values() if j.state == "pending" and j.run_at <= now]
        return QueueCounts(**figures, oldest_due_seconds=now - min(due) if due else 0.0)

    def by_kind(self) -> dict[str, dict[str, int]]:
        kinds: dict[str, dict[str, int]] = {}
        for job in self.jobs.values():
            kinds.setdefault(job.kind, dict.fromkeys(JOB_STATES, 0))[job.state] += 1
        return kinds

    def list_jobs(self, state: JobState, limit: int) -> list[JobDetails]:
        jobs = [j for j in self.jobs.values() if j.state == state]
        jobs.sort(key=lambda j: (j.updated_at, j.id), reverse=True)
        return [j.details() for j in jobs[:limit]]

    # administration -------------------------------------------------------------
    def retryable(self, job: MJob, which: Retryable) -> bool:
        if which == "failed":
            return job.state == "failed"
        return job.state == "pending" and job.attempts > 0

    def retry_now(self, ids: Sequence[int] | None, which: Retryable, now: float) -> list[int]:
        chosen = self.jobs.keys() if ids is None else {i for i in ids if i in self.jobs}
        retried = []
        for job_id in sorted(chosen):
            job = self.jobs[job_id]
            if self.retryable(job, which):
                job.state, job.attempts, job.run_at = "pending", 0, now
                job.lease_until, job.updated_at, job.claim = None, now, 0
                retried.append(job_id)
        return retried

    def purge_done(self, older_than: float) -> int:
        doomed = [
            j.id for j in self.jobs.values() if j.state == "done" and j.updated_at < older_than
        ]
        if self.backend == "sqlite":
            # Documented (README, Retention): the newest job stays, so that
            # SQLite does not hand its id out again.
            doomed = [i for i in doomed if i != max(self.jobs)]
        for job_id in doomed:
            del self.jobs[job_id]
        return len(doomed)


class Walk:
    """One seeded random walk over a store and its model."""

    def __init__(self, store: Store, backend: Backend, clock: FakeClock, seed: int) -> None:
        assert isinstance(store, QueueAdmin)
        self.store = store
        self.admin: QueueAdmin = store
        self.clock = clock
        self.rng = random.Random(seed)
        self.model = Model(backend.name)
        self.hand: list[Claim] = []  # claims this walk's worker holds (some stale)
        self.log: list[str] = []
        # Start at a time with a fraction, as real clocks have.
        clock.now = 1_800_000_000.0 + self.rng.random()

    @property
    def now(self) -> float:
        return self.clock.now

    def note(self, text: str) -> None:
        self.log.append(f"t={self.now!r}: {text}")

    def where(self) -> str:
        return "\n".join(self.log[-15:])

    def check(self, what: str, got: object, want: object) -> None:
        assert got == want, f"{what}: store {got!r} != model {want!r}\nlast steps:\n{self.where()}"

    # steps ----------------------------------------------------------------------
    async def step(self) -> None:
        steps = [
            (self.enqueue, 10),
            (self.create_product, 8),
            (self.create_products_at_once, 2),
            (self.claim, 12),
            (self.complete, 7),
            (self.retry, 7),
            (self.fail, 3),
            (self.release, 3),
            (self.recover_abandoned, 1),
            (self.advance, 12),
            (self.retry_now, 4),
            (self.purge_done, 3),
            (self.stats, 2),
            (self.look_at_a_job, 3),
            (self.list_a_few_jobs, 1),
            (self.next_due_at, 3),
            (self.list_products, 2),
        ]
        action = self.rng.choices([s for s, _ in steps], [w for _, w in steps])[0]
        await action()
        await self.compare_jobs()

    async def enqueue(self) -> None:
        leased = self.rng.random() < 0.2
        new = NewJob(
            self.rng.choice(KINDS),
            {"n": self.rng.randrange(1000), "note": self.rng.choice(NAMES)},
            max_attempts=self.rng.randint(1, 4),
            leased_for=self.rng.choice([30.0, 90.0, 0.25]) if leased else None,
        )
        self.note(f"enqueue {new}")
        job_id = await self.store.enqueue(new)
        want, claim = self.model.enqueue(new, self.now)
        self.check("enqueued id", job_id, want)
        if claim is not None:
            self.hand.append(claim)

    async def create_product(self) -> None:
        key = self.rng.choice(KEYS) if self.rng.random() < 0.4 else None
        nama = self.rng.choice(NAMES)
        harga = self.rng.choice([0, 1, 15000, 10**12, self.rng.randrange(10**9)])
        max_attempts = self.rng.randint(1, 4)
        leased_for = 90.0 if self.rng.random() < 0.3 else None

        def make_job(product: Product) -> NewJob:
            return product_email_job(product, max_attempts, leased_for)

        self.note(f"create_product {nama!r} {harga} key={key} leased={leased_for}")
        product, job_id = await self.store.create_product(nama, harga, make_job, key)
        want, want_job, claim = self.model.create_product(nama, harga, make_job, key, self.now)
        self.check("created product", (product, job_id), (want, want_job))
        self.check("get_product", await self.store.get_product(product.id), want)
        if claim is not None:
            self.hand.append(claim)

    async def create_products_at_once(self) -> None:
        # Requests arriving together: the writer stores them in one batch, a
        # key twice in it included; each answers as if it came alone, in turn.
        writes = [
            (self.rng.choice(NAMES), self.rng.randrange(100), self.rng.choice((*KEYS, None)))
            for _ in range(self.rng.randint(2, 5))
        ]

        def make_job(product: Product) -> NewJob:
            return product_email_job(product, 3)

        self.note(f"create_products_at_once {writes}")
        got = await asyncio.gather(
            *(self.store.create_product(nama, harga, make_job, key) for nama, harga, key in writes)
        )
        for (nama, harga, key), answer in zip(writes, got, strict=True):
            product, job_id, _ = self.model.create_product(nama, harga, make_job, key, self.now)
            self.check("created product (at once)", answer, (product, job_id))

    def held_ids(self) -> list[int]:
        # Sometimes the claimer is this worker's process (it passes the jobs it
        # holds), sometimes another instance, which knows nothing of them.
        if self.rng.random() < 0.5:
            return [c.job.id for c in self.hand]
        return []

    async def claim(self) -> None:
        limit = self.rng.randint(1, 4)
        lease = self.rng.choice([30.0, 90.0, 0.5])
        held = self.held_ids()
        before = {j.id: dataclasses.replace(j) for j in self.model.jobs.values()}
        self.note(f"claim limit={limit} lease={lease} held={held}")
        jobs = await self.store.claim(limit, lease, held)
        due = self.model.due(self.now, limit)
        expired = self.model.expired(self.now, held)
        room = limit - len(due)
        if len(expired) <= room:
            taken = expired
        else:
            # Which expired leases a claim takes first is not promised: any
            # ``room`` of them; follow the store's choice.
            after = {d.job.id: d for state in JOB_STATES for d in await self.listed(state)}
            taken = [j for j in expired if _was_claimed(before[j.id], after.get(j.id), self.now)]
            self.check("expired leases taken", len(taken), room)
        want, claims = self.model.claim(due + taken, self.now, lease)
        self.check("claimed jobs", jobs, want)
        self.hand += claims

    def take_claims(self, most: int) -> list[Claim]:
        self.rng.shuffle(self.hand)
        taken, self.hand = self.hand[:most], self.hand[most:]
        return taken

    async def complete(self) -> None:
        claims = self.take_claims(self.rng.randint(1, 3))
        self.note(f"complete {[(c.job.id, c.job.attempts) for c in claims]}")
        await self.store.complete([c.job for c in claims])
        self.model.complete(claims, self.now)

    async def retry(self) -> None:
        for claim in self.take_claims(1):
            error = self.rng.choice(["421 try later", "connection refused", ""])
            run_at = self.now + self.rng.choice([0.0, 1.5, 2.0, 60.0, 3600.0])
            payload = {"left": ["a@toko.com"]} if self.rng.random() < 0.3 else None
            self.note(f"retry {claim.job.id}/{claim.job.attempts} run_at={run_at!r}")
            await self.store.retry(claim.job, error, run_at, payload)
            self.model.set_state(claim, "pending", error, run_at, payload, self.now)

    async def fail(self) -> None:
        for claim in self.take_claims(1):
            payload = {"left": []} if self.rng.random() < 0.3 else None
            self.note(f"fail {claim.job.id}/{claim.job.attempts}")
            await self.store.fail(claim.job, "550 no such user", payload)
            self.model.set_state(claim, "failed", "550 no such user", None, payload, self.now)

    async def release(self) -> None:
        claims = self.take_claims(self.rng.randint(1, 3))
        self.note(f"release {[(c.job.id, c.job.attempts) for c in claims]}")
        await self.store.release([c.job for c in claims])
        self.model.release(claims, self.now)

    async def recover_abandoned(self) -> None:
        # What a restart does: the dead process's claims are gone with it.
        self.note("recover_abandoned")
        self.hand.clear()
        self.check(
            "recovered",
            await self.store.recover_abandoned(),
            self.model.recover_abandoned(self.now),
        )

    async def advance(self) -> None:
        times = [j.run_at for j in self.model.jobs.values() if j.state == "pending"]
        times += [j.lease_until for j in self.model.jobs.values() if j.lease_until is not None]
        choice = self.rng.random()
        if times and choice < 0.3:
            # Exactly onto a due time or a lease's end: the boundaries.
            target = self.rng.choice(times)
            self.clock.now = max(self.now, target)
        elif choice < 0.4:
            self.clock.now = self.now  # no time passes: steps at the same instant
        else:
            self.clock.now = self.now + self.rng.choice([0.001, 0.3, 1.0, 31.0, 95.0, 4000.0])
        self.note("advance")

    async def retry_now(self) -> None:
        which: Retryable = self.rng.choice(["failed", "waiting"])
        ids: list[int] | None = None
        if self.rng.random() < 0.6 and self.model.jobs:
            known = sorted(self.model.jobs)
            ids = self.rng.sample(known, min(len(known), self.rng.randint(1, 4)))
            ids.append(self.model.next_job_id + 5)  # no such job
            ids.append(ids[0])  # one twice
        self.note(f"retry_now {ids} {which}")
        got = await self.admin.retry_now(ids, which)
        self.check("retried", got, self.model.retry_now(ids, which, self.now))

    async def purge_done(self) -> None:
        done = [j.updated_at for j in self.model.jobs.values() if j.state == "done"]
        if done and self.rng.random() < 0.6:
            older_than = self.rng.choice(done)  # the boundary: not older than itself
        else:
            older_than = self.now + self.rng.choice([-100.0, 0.0, 1.0])
        chunk = self.rng.choice([1, 2, 1000])
        self.note(f"purge_done {older_than!r} chunk={chunk}")
        got = await self.admin.purge_done(older_than, chunk)
        self.check("purged", got, self.model.purge_done(older_than))

    async def stats(self) -> None:
        self.check("counts", await self.store.counts(), self.model.counts(self.now))
        stats = await self.admin.queue_stats()
        self.check("queue_stats counts", stats.counts, self.model.counts(self.now))
        self.check("queue_stats by_kind", stats.by_kind, self.model.by_kind())
        pending = [j.run_at for j in self.model.jobs.values() if j.state == "pending"]
        self.check("oldest pending", stats.oldest_pending_run_at, min(pending, default=None))

    async def list_a_few_jobs(self) -> None:
        state = self.rng.choice(JOB_STATES)
        limit = self.rng.randint(1, 3)
        got = await self.admin.list_jobs(state, limit)
        self.check(f"list_jobs({state}, {limit})", got, self.model.list_jobs(state, limit))

    async def look_at_a_job(self) -> None:
        job_id = self.rng.randint(0, self.model.next_job_id)
        job = self.model.jobs.get(job_id)
        want = job.details() if job else None
        self.check(f"job_details({job_id})", await self.admin.job_details(job_id), want)
        self.check(f"get_job({job_id})", await self.store.get_job(job_id), want and want.job)

    async def next_due_at(self) -> None:
        held = self.held_ids()
        got = await self.store.next_due_at(held)
        self.check(f"next_due_at(held={held})", got, self.model.next_due_at(held))

    async def list_products(self) -> None:
        after = self.rng.randint(0, self.model.next_product_id)
        limit = self.rng.randint(1, 5)
        got = await self.store.list_products(after, limit)
        self.check("list_products", got, self.model.list_products(after, limit))
        start = self.now - self.rng.choice([0.0, 10.0, 1000.0])
        end = self.now + self.rng.choice([0.0, 1.0])
        got_counts = await self.store.product_counts(start, end)
        self.check("product_counts", got_counts, self.model.product_counts(start, end))

    # comparison -----------------------------------------------------------------
    async def listed(self, state: JobState) -> list[JobDetails]:
        return await self.admin.list_jobs(state, 10_000)

    async def compare_jobs(self) -> None:
        """Every job, as ``list_jobs`` shows it per state (in its promised order)."""
        for state in JOB_STATES:
            self.check(
                f"list_jobs({state})", await self.listed(state), self.model.list_jobs(state, 10_000)
            )


def _was_claimed(before: MJob, after: JobDetails | None, now: float) -> bool:
    """Whether a claim at ``now`` took this job, whose lease had expired."""
    if after is None:
        return False
    if after.job.state == "failed":
        return True
    return after.job.attempts == before.attempts + 1 and after.updated_at == now


@pytest.mark.parametrize("seed", SEEDS)
async def test_the_store_behaves_as_its_model(
    store: Store, backend: Backend, clock: FakeClock, seed: int
) -> None:
    walk = Walk(store, backend, clock, seed)
    for _ in range(STEPS):
        await walk.step()
    await walk.stats()
