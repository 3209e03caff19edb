"""The application factory: routes, middleware and resources in dependency order."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from aiohttp import web

from service.auth import bearer_auth
from service.errors import close_after, json_errors, json_router_errors
from service.expect import close_if_body_withheld
from service.health import HealthReads
from service.keys import (
    HEALTH,
    HTTP_STATE,
    METRICS,
    NOTIFIER,
    POOL,
    REQUESTS_FIRST,
    SETTINGS,
    STORE,
    HttpState,
)
from service.mail import LogMailer, Mailer, SmtpMailer
from service.metrics import Metrics
from service.requests_first import RequestsFirst
from service.routes import routes
from service.settings import Settings
from service.store import open_store
from service.systemd import Notifier
from service.tasks import HANDLERS, JobContext
from service.workers import PoolConfig, WorkerPool

log = logging.getLogger("toko.app")

# How much longer systemd should wait each time we report stop progress.
EXTEND_STOP_SECONDS = 3.0
# ... and for the store's close: PostgreSQL gives up on a silent database after
# 5 s; SQLite waits up to its 10 s busy timeout for another process's lock.
EXTEND_CLOSE_SECONDS = 15.0


def make_mailer(settings: Settings) -> Mailer:
    if settings.mail.smtp is None:
        return LogMailer()
    # The SMTP timeout stays inside the job timeout so a hung server fails the attempt.
    return SmtpMailer(settings.mail.smtp, timeout=settings.pool.timeout)


def create_app(settings: Settings, notifier: Notifier | None = None) -> web.Application:
    metrics = Metrics(kinds=HANDLERS)
    # Outermost first: metrics see every answer, including the JSON errors and 401s.
    requests_first = RequestsFirst()
    middlewares = [requests_first.middleware, metrics.middleware, json_errors]
    auth = bearer_auth(settings.http.api_token)
    if auth is not None:
        middlewares.append(auth)
    app = web.Application(
        client_max_size=settings.http.max_body_bytes,
        middlewares=middlewares,
        # Compressed bodies are decoded by the handler (routes.decoded_body):
        # aiohttp does not check that a gzip body ends (its CRC-32 and length),
        # so one cut short was taken whole.
        handler_args={"auto_decompress": False},
    )
    app[SETTINGS] = settings
    app[METRICS] = metrics
    app[REQUESTS_FIRST] = requests_first
    app[HTTP_STATE] = HttpState()
    app.on_response_prepare.append(before_each_answer)
    app[NOTIFIER] = notifier or Notifier(None)
    app.add_routes(routes)
    app.cleanup_ctx.append(_store_ctx)
    app.cleanup_ctx.append(_pool_ctx)
    return app


async def before_each_answer(request: web.Request, response: web.StreamResponse) -> None:
    """The app's one on_response_prepare hook: each hook costs a coroutine per answer."""
    if request.app[HTTP_STATE].draining:
        close_after(response)
    json_router_errors(request, response)
    close_if_body_withheld(request, response)


async def _store_ctx(app: web.Application) -> AsyncIterator[None]:
    store = open_store(app[SETTINGS])
    await store.open()
    app[STORE] = store
    app[HEALTH] = HealthReads(store)
    yield
    await app[HEALTH].close()
    # Closing waits for the last writes, up to the store's own limits.
    app[NOTIFIER].extend_timeout(EXTEND_CLOSE_SECONDS, "stopping: closing the store")
    await store.close()
    batches, writes = store.writer_stats
    # writes/batches is the group-commit factor: how many writes shared an fsync.
    log.info("store closed", extra={"COMMITS": batches, "WRITES": writes})


async def _pool_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    mailer = make_mailer(settings)
    context = JobContext(mailer, settings.mail.sender, settings.mail.admin_emails)
    config = PoolConfig(
        workers=settings.pool.workers,
        job_timeout=settings.pool.timeout,
        backoff_base=settings.pool.backoff,
    )
    pool = WorkerPool(
        app[STORE],
        context,
        HANDLERS,
        config,
        observer=app[METRICS],
        turn=app[REQUESTS_FIRST].turn,
    )
    app[STORE].add_wakeup_listener(pool.notify)
    await pool.start()
    app[POOL] = pool
    yield
    notifier = app[NOTIFIER]

    def still_stopping(status: str) -> None:
        notifier.extend_timeout(EXTEND_STOP_SECONDS, status)

    left = await pool.stop(settings.pool.drain_timeout, still_stopping)
    await mailer.close()  # after the last job: a QUIT to each idle SMTP connection
    if left:
        log.warning(
            "drain timeout reached; unfinished jobs run again at the next start",
            extra={"JOBS_RUNNING": left},
        )
    else:
        log.info("workers drained")
