"""Prometheus metrics for one application: HTTP requests, jobs, queue and workers,
the build and the process.

Each app has its own CollectorRegistry (never the process-global one), so two
apps in one process (tests) do not collide and nothing from imported
libraries leaks into /metrics. Label values are bounded: routes are the
matched resource's canonical path or "unmatched", methods outside the usual
set become "OTHER", job kinds are the handlers' kinds.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service import __version__
from service.models import JOB_STATES, QueueCounts
from service.workers import JobOutcome

KNOWN_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "POST", "PUT", "PATCH", "DELETE"})
UNMATCHED = "unmatched"
OUTCOMES: tuple[JobOutcome, ...] = ("succeeded", "retried", "failed")
# Requests are quick (a group commit is a few ms); jobs are SMTP round trips.
# 0.02 (not the usual 0.025) is the p99 target of a POST (README, Benchmarks):
# with an edge there, the share of requests that met it is a count, and
# histogram_quantile's p99 is at most 20 ms exactly when 99 % met it.
REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# The classic text format every Prometheus (and prometheus-client >= 0.17) speaks;
# our metric names need nothing newer.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
JOB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# Without this, every counter and histogram also exports a *_created series
# (its creation time): twice the series to store, none that toko's alerts or
# the README's table use. Process-wide, as prometheus-client has it.
disable_created_metrics()  # type: ignore[no-untyped-call]  # the library has no annotation here


class _ProcessCollector(ProcessCollector):
    """process_* (CPU, memory, file descriptors, start time) of this process.

    The stock collector reads the boot time from /proc/stat and exports
    nothing without it; the units' ProcSubset=pid hides /proc/stat (only
    /proc/<pid> is left), so under systemd it exported nothing at all. The
    boot time is also the wall clock less the time since boot (CLOCK_BOOTTIME,
    the clock /proc/<pid>/stat counts a start time in).
    """

    def _boot_time(self) -> float:
        try:
            btime: float | None = super()._boot_time()  # type: ignore[no-untyped-call]
        except OSError:
            btime = None
        if btime is None:
            btime = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        return btime


class _OldestDue(Collector):
    """toko_queue_oldest_due_age_seconds: set at each scrape, absent when the
    store did not answer (as toko_queue_jobs is: see Metrics.set_queue)."""

    NAME = "toko_queue_oldest_due_age_seconds"
    HELP = (
        "Seconds the oldest due job (pending, its run time passed) has waited unclaimed;"
        " 0 when none is due. Read at scrape time."
    )

    def __init__(self) -> None:
        self.seconds: float | None = None

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.NAME, self.HELP)

    def collect(self) -> Iterator[Metric]:
        if self.seconds is not None:
            yield GaugeMetricFamily(self.NAME, self.HELP, value=self.seconds)


def route_label(request: web.Request) -> str:
    """The matched route's template (``/produk/{id}``), never the raw path."""
    resource = request.match_info.route.resource
    if resource is None or request.match_info.http_exception is not None:
        return UNMATCHED
    return resource.canonical


class Metrics:
    """The instruments of one app; also the worker pool's job observer."""

    def __init__(self, kinds: Iterable[str] = ()) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "toko_http_requests",
            "HTTP requests answered, by route template, method and status.",
            ["route", "method", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "toko_http_request_duration_seconds",
            "Time to answer an HTTP request, by route template and method.",
            ["route", "method"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.replays = Counter(
            "toko_idempotent_replays",
            "POST /produk answered from an earlier request with the same Idempotency-Key:"
            " how often clients retry.",
            registry=r,
        )
        self.jobs_enqueued = Counter(
            "toko_jobs_enqueued",
            "Jobs this toko-api enqueued (jobs from toko-recap and toko-alert show in the "
            "queue gauge and the outcome counters).",
            ["kind"],
            registry=r,
        )
        # One counter with an outcome label, not one per outcome (the naming
        # guide: a sum over a metric's labels must mean something, here every
        # attempt): sum without (outcome) is the attempts made.
        self.job_attempts = Counter(
            "toko_job_attempts",
            "Job attempts finished, by kind and outcome: succeeded; retried (failed, another"
            " attempt comes); failed (the last attempt failed, the job is kept as failed).",
            ["kind", "outcome"],
            registry=r,
        )
        self.job_seconds = Histogram(
            "toko_job_duration_seconds",
            "Time one job attempt took, by kind and outcome (succeeded, retried, failed).",
            ["kind", "outcome"],
            buckets=JOB_BUCKETS,
            registry=r,
        )
        self.queue_jobs = Gauge(
            "toko_queue_jobs",
            "Jobs in the store by state, read at scrape time.",
            ["state"],
            registry=r,
        )
        self.store_up = Gauge(
            "toko_store_up", "1 if the store answered the last scrape's queue query.", registry=r
        )
        self.store_writable = Gauge(
            "toko_store_writable",
            "0 from a failed write until a product is stored or a write probe succeeds:"
            " a full disk, a read-only database.",
            registry=r,
        )
        self.workers_alive = Gauge("toko_workers_alive", "Worker tasks alive.", registry=r)
        self.workers_configured = Gauge(
            "toko_workers_configured", "Worker tasks configured (TOKO_WORKERS).", registry=r
        )
        self.oldest_due = _OldestDue()
        r.register(self.oldest_due)
        # The version as a label of a constant 1 (the naming guide's *_info):
        # joined onto other series, or counted by version during a rollout.
        Gauge(
            "toko_build_info",
            "The toko version running, as the version label.",
            ["version"],
            registry=r,
        ).labels(__version__).set(1)
        _ProcessCollector(registry=r)
        # Labelled children cached per (kind, outcome): the pool reports
        # thousands of jobs a second and .labels() costs a lock and a lookup.
        self._job_children: dict[tuple[str, JobOutcome], tuple[Counter, Histogram]] = {}
        self._enqueued_children: dict[str, Counter] = {}
        # The same for every request: one dict lookup instead of two .labels().
        self._request_children: dict[tuple[str, str, int], tuple[Counter, Histogram]] = {}
        for kind in kinds:
            self._export_zeros(kind)

    def _export_zeros(self, kind: str) -> None:
        """Every series of a job kind, at 0 from the start.

        A series that first appears at 1 has no earlier sample, so Prometheus'
        increase() and rate() see no change: the first failed email after a
        start would never fire an alert on toko_job_attempts_total{outcome="failed"}.
        """
        for outcome in OUTCOMES:
            self._job_children[(kind, outcome)] = (
                self.job_attempts.labels(kind, outcome),
                self.job_seconds.labels(kind, outcome),
            )
        self._enqueued_children[kind] = self.jobs_enqueued.labels(kind)

    # the worker pool's observer (hot path: keep it to two cached calls) ------------
    def job_finished(self, kind: str, outcome: JobOutcome, seconds: float) -> None:
        children = self._job_children.get((kind, outcome))
        if children is None:
            children = (
                self.job_attempts.labels(kind, outcome),
                self.job_seconds.labels(kind, outcome),
            )
            self._job_children[(kind, outcome)] = children
        counter, histogram = children
        counter.inc()
        histogram.observe(seconds)

    def job_enqueued(self, kind: str) -> None:
        child = self._enqueued_children.get(kind)
        if child is None:
            child = self._enqueued_children[kind] = self.jobs_enqueued.labels(kind)
        child.inc()

    # scrape ----------------------------------------------------------------------
    def set_queue(self, counts: QueueCounts | None) -> None:
        """Queue figures from the store; None when the store did not answer."""
        self.store_up.set(0 if counts is None else 1)
        if counts is None:
            # No figures rather than the last ones: a scrape must not report
            # as current a queue nobody could read (alerts on it would neither
            # fire nor resolve while the store is down).
            self.queue_jobs.clear()
            self.oldest_due.seconds = None
            return
        for state in JOB_STATES:
            self.queue_jobs.labels(state).set(getattr(counts, state))
        self.oldest_due.seconds = counts.oldest_due_seconds

    def set_writable(self, writable: bool) -> None:
        self.store_writable.set(1 if writable else 0)

    def set_workers(self, alive: int, configured: int) -> None:
        self.workers_alive.set(alive)
        self.workers_configured.set(configured)

    def render(self) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE}
        )

    # HTTP ------------------------------------------------------------------------
    def observe_request(self, request: web.Request, status: int, seconds: float) -> None:
        route = route_label(request)
        method = request.method if request.method in KNOWN_METHODS else "OTHER"
        key = (route, method, status)
        children = self._request_children.get(key)
        if children is None:
            children = (
                self.requests.labels(route, method, str(status)),
                self.request_seconds.labels(route, method),
            )
            self._request_children[key] = children
        counter, histogram = children
        counter.inc()
        histogram.observe(seconds)

    @property
    def middleware(self) -> Middleware:
        observe = self.observe_request
        clock = time.perf_counter

        @web.middleware
        async def count_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
            started = clock()
            try:
                response = await handler(request)
            except web.HTTPException as exc:  # redirects and the like, re-raised on purpose
                observe(request, exc.status, clock() - started)
                raise
            except Exception:
                # What aiohttp answers for an exception past json_errors.
                observe(request, 500, clock() - started)
                raise
            # A cancelled request (shutdown) answered nobody: it is not counted.
            observe(request, response.status, clock() - started)
            return response

        return count_requests
