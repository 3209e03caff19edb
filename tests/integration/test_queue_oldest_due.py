"""The age of the oldest due job, read with the queue counts (toko_queue_oldest_due_age_seconds),
on both backends."""

from __future__ import annotations

from service.models import NewJob
from service.store.roles import QueueAdmin, Store
from tests.support.backends import FakeClock


async def test_no_job_is_no_age(store: Store) -> None:
    assert (await store.counts()).oldest_due_seconds == 0


async def test_the_oldest_due_job_ages_until_it_is_claimed(store: Store, clock: FakeClock) -> None:
    await store.enqueue(NewJob("k", {}, 3))
    clock.now += 40
    await store.enqueue(NewJob("k", {}, 3))
    clock.now += 2.5
    counts = await store.counts()
    assert (counts.pending, counts.oldest_due_seconds) == (2, 42.5)
    await store.claim(1, 60)  # the oldest goes: the next one is the oldest due now
    assert (await store.counts()).oldest_due_seconds == 2.5
    await store.claim(1, 60)
    assert (await store.counts()).oldest_due_seconds == 0
    assert isinstance(store, QueueAdmin)
    assert (await store.queue_stats()).counts == await store.counts()


async def test_a_retry_waiting_for_its_backoff_is_not_late(store: Store, clock: FakeClock) -> None:
    await store.enqueue(NewJob("k", {}, 3))
    (job,) = await store.claim(1, 60)
    await store.retry(job, "SMTP 451", clock.now + 30)
    clock.now += 29
    counts = await store.counts()
    assert (counts.pending, counts.oldest_due_seconds) == (1, 0)
    clock.now += 5  # due 4 s ago, and nobody took it
    assert (await store.counts()).oldest_due_seconds == 4
    assert isinstance(store, QueueAdmin)
    assert (await store.queue_stats()).counts.oldest_due_seconds == 4
