"""/metrics on a real toko-api: the figures move as requests come and jobs run."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, ProcessCollector

from service import __version__
from service.app import create_app
from service.keys import METRICS
from service.metrics import OUTCOMES, Metrics, _ProcessCollector
from service.models import QueueCounts
from service.settings import Settings
from service.tasks import HANDLERS
from tests.conftest import ServiceFactory
from tests.support.api import create_products
from tests.support.scrape import scrape, scrape_until
from tests.support.smtp import SmtpServer

KIND = "product_email"


async def test_metrics_move_as_jobs_run(service_factory: ServiceFactory, smtp: SmtpServer) -> None:
    smtp.refuse_subject("Ditolak")  # 550: this one fails both of its attempts
    svc = service_factory(
        {
            "TOKO_SMTP_URL": smtp.url,
            "TOKO_WORKERS": "2",
            "TOKO_JOB_MAX_ATTEMPTS": "2",
            "TOKO_JOB_BACKOFF": "0.05",
        }
    ).start()
    await svc.async_wait_ready(timeout=20)
    async with aiohttp.ClientSession() as session:
        before = await scrape(session, svc.base_url)
        assert before.content_type.startswith("text/plain; version=0.0.4")
        assert before.value("toko_workers_alive") == 2
        assert before.value("toko_workers_configured") == 2
        assert before.value("toko_store_up") == 1
        assert before.value("toko_queue_jobs", state="done") == 0
        assert before.value("toko_jobs_enqueued_total", kind=KIND) == 0
        assert before.samples[("toko_queue_oldest_due_age_seconds", frozenset())] == 0
        assert before.value("toko_build_info", version=__version__) == 1
        # Exported at 0 before the first job, not first seen at 1: increase()
        # and rate() over a series that appears at 1 see no change.
        for kind in HANDLERS:
            assert ("toko_jobs_enqueued_total", frozenset({("kind", kind)})) in before.samples
            for outcome in OUTCOMES:
                labels = frozenset({("kind", kind), ("outcome", outcome)})
                for name in ("toko_job_attempts_total", "toko_job_duration_seconds_count"):
                    assert before.samples.get((name, labels)) == 0, (name, labels)

        products = await create_products(
            session, svc.base_url, ["Kopi 1", "Kopi 2", "Kopi 3", "Ditolak 4"]
        )
        async with session.get(svc.url(f"/produk/{products[0]['id']}")) as resp:
            assert resp.status == 200
        async with session.get(svc.url("/tidak-ada")) as resp:
            assert resp.status == 404
        await smtp.async_wait_delivered(3, timeout=20)

        def failed_for_good(records: Sequence[dict[str, Any]]) -> bool:
            return any(r.get("message") == "job failed permanently" for r in records)

        await svc.logs.async_wait_for(failed_for_good, timeout=20, what="the permanent failure")
        after = await scrape_until(
            session,
            svc.base_url,
            lambda m: m.value("toko_queue_jobs", state="done") == 3,
        )

    def grew(name: str, **labels: str) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    assert grew("toko_http_requests_total", route="/produk", method="POST", status="201") == 4
    # The route template, not the raw path: label values stay bounded.
    assert grew("toko_http_requests_total", route="/produk/{id}", method="GET", status="200") == 1
    assert grew("toko_http_requests_total", route="unmatched", method="GET", status="404") == 1
    assert grew("toko_http_request_duration_seconds_count", route="/produk", method="POST") == 4
    assert grew("toko_jobs_enqueued_total", kind=KIND) == 4
    assert grew("toko_job_attempts_total", kind=KIND, outcome="succeeded") == 3
    assert grew("toko_job_attempts_total", kind=KIND, outcome="retried") == 1
    assert grew("toko_job_attempts_total", kind=KIND, outcome="failed") == 1
    assert grew("toko_job_duration_seconds_count", kind=KIND, outcome="succeeded") == 3
    assert grew("toko_job_duration_seconds_count", kind=KIND, outcome="failed") == 1
    assert after.value("toko_job_duration_seconds_sum", kind=KIND, outcome="succeeded") > 0
    assert after.value("toko_queue_jobs", state="failed") == 1
    assert after.value("toko_queue_jobs", state="pending") == 0
    assert after.value("toko_workers_alive") == 2
    assert after.value("toko_queue_oldest_due_age_seconds") == 0
    # The process collector, of toko-api's own process.
    assert after.value("process_resident_memory_bytes") > 10_000_000
    assert after.value("process_open_fds") > 3
    assert after.value("process_cpu_seconds_total") > 0
    assert time.time() - 120 < after.value("process_start_time_seconds") <= time.time()
    routes = {dict(labels).get("route") for _, labels in after.samples}
    assert "/tidak-ada" not in routes
    # Only the series the README lists: no *_created beside each counter.
    assert not [name for name, _ in after.samples if name.endswith("_created")]


def test_each_app_has_its_own_registry() -> None:
    # A second app in one process must not collide in a global registry.
    first, second = create_app(Settings()), create_app(Settings())
    first[METRICS].job_finished(KIND, "succeeded", 0.01)
    assert first[METRICS].registry is not second[METRICS].registry
    labels = {"kind": KIND, "outcome": "succeeded"}
    assert first[METRICS].registry.get_sample_value("toko_job_attempts_total", labels) == 1
    assert second[METRICS].registry.get_sample_value("toko_job_attempts_total", labels) == 0


async def test_the_oldest_due_job_ages_while_every_worker_is_busy(
    service_factory: ServiceFactory, smtp: SmtpServer
) -> None:
    smtp.set_delay(2.0)  # one worker, each email 2 s: the others wait, due
    svc = service_factory({"TOKO_SMTP_URL": smtp.url, "TOKO_WORKERS": "1"}).start()
    await svc.async_wait_ready(timeout=20)
    async with aiohttp.ClientSession() as session:
        await create_products(session, svc.base_url, ["Kopi 1", "Kopi 2", "Kopi 3"])
        waiting = await scrape_until(
            session, svc.base_url, lambda m: m.value("toko_queue_oldest_due_age_seconds") >= 1.0
        )
        assert waiting.value("toko_queue_jobs", state="pending") >= 1
        await smtp.async_wait_delivered(3, timeout=30)
        await scrape_until(
            session,
            svc.base_url,
            lambda m: (
                m.value("toko_queue_jobs", state="done") == 3
                and m.value("toko_queue_oldest_due_age_seconds") == 0
            ),
        )


def test_the_queue_figures_are_absent_when_the_store_did_not_answer() -> None:
    # Not the last figures: an alert on them would neither fire nor resolve.
    metrics = Metrics()
    metrics.set_queue(QueueCounts(pending=2, oldest_due_seconds=7.5))
    assert metrics.registry.get_sample_value("toko_queue_oldest_due_age_seconds") == 7.5
    metrics.set_queue(None)
    assert metrics.registry.get_sample_value("toko_queue_oldest_due_age_seconds") is None
    assert metrics.registry.get_sample_value("toko_queue_jobs", {"state": "pending"}) is None
    assert metrics.registry.get_sample_value("toko_store_up") == 0
    metrics.set_queue(QueueCounts())
    assert metrics.registry.get_sample_value("toko_queue_oldest_due_age_seconds") == 0


def test_process_metrics_without_proc_stat(tmp_path: Path) -> None:
    # The units' ProcSubset=pid leaves /proc/<pid> and hides /proc/stat, where
    # the stock collector reads the boot time: without it, it exports nothing.
    (tmp_path / "self").symlink_to(f"/proc/{os.getpid()}")

    def samples(collector: ProcessCollector) -> dict[str, float]:
        registry = CollectorRegistry()
        registry.register(collector)
        return {s.name: s.value for family in registry.collect() for s in family.samples}

    assert samples(ProcessCollector(proc=str(tmp_path), registry=None)) == {}
    ours = samples(_ProcessCollector(proc=str(tmp_path), registry=None))
    stock = samples(ProcessCollector(registry=None))  # the real /proc, /proc/stat there
    assert set(ours) == set(stock) >= {"process_start_time_seconds", "process_open_fds"}
    assert abs(ours["process_start_time_seconds"] - stock["process_start_time_seconds"]) < 1.5


def histogram_quantile(q: float, metrics: Metrics, route: str, method: str) -> float:
    """What Prometheus' histogram_quantile() makes of one series' buckets."""
    buckets = sorted(
        (float(s.labels["le"]), s.value)
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name == "toko_http_request_duration_seconds_bucket"
        and (s.labels["route"], s.labels["method"]) == (route, method)
    )
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank:
            return lower + (upper - lower) * (rank - below) / (cumulative - below)
        lower, below = upper, cumulative
    raise AssertionError("unreachable: the +Inf bucket holds every sample")


@pytest.mark.parametrize(
    ("latencies", "meets_target"),
    [
        ([0.012] * 100, True),
        ([0.018] * 99 + [0.3], True),
        ([0.012] * 98 + [0.022] * 2, False),
    ],
)
def test_the_p99_target_of_20_ms_can_be_read_from_the_histogram(
    latencies: list[float], meets_target: bool
) -> None:
    # With no bucket edge at 20 ms, requests that all took 12 ms came out of
    # histogram_quantile(0.99, ...) as 24.9 ms: a met target looked missed.
    metrics = Metrics()
    for seconds in latencies:
        metrics.request_seconds.labels("/produk", "POST").observe(seconds)
    assert (histogram_quantile(0.99, metrics, "/produk", "POST") <= 0.020) is meets_target
