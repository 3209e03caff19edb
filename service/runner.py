"""The process lifecycle under systemd: start, READY, watchdog, drain, exit.

Order matters and is the contract: READY=1 only once the store is open, the
pool runs and the socket accepts; WATCHDOG=1 only while every worker lives;
on SIGTERM, STOPPING=1, stop accepting, finish requests, drain jobs, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import time
from collections.abc import Callable

from aiohttp import web

from service.app import create_app
from service.errors import ClientProtocolErrors, JsonErrorsRunner
from service.keys import HEALTH, POOL, STORE
from service.listener import (
    listening_sockets,
    raise_open_files_limit,
    start_serving,
    stop_accepting,
)
from service.logs import LoopErrorThrottle, Throttle
from service.settings import Settings
from service.store import StoreError
from service.systemd import Notifier
from service.workers import WorkerPool

log = logging.getLogger("toko.runner")

STATUS_SECONDS = 5.0
# In-flight HTTP requests get this long after the socket closes.
REQUEST_GRACE_SECONDS = 5.0


class SideTaskDied(RuntimeError):
    pass


def _not_asked() -> bool:
    return False


async def serve(settings: Settings, stop_asked: Callable[[], bool] = _not_asked) -> None:
    """Run toko-api until SIGTERM or SIGINT; ``stop_asked()`` tells whether one
    came already, before the event loop's handlers were in place."""
    notifier = Notifier(settings.systemd.notify_socket)
    app = create_app(settings, notifier)
    # aiohttp's keep-alive timer also closes a connection that has not sent a
    # whole request in that time (nothing, or headers trickled a byte at a
    # time); its own default is an hour, so a few thousand idle sockets could
    # pin the process's open files.
    runner = JsonErrorsRunner(
        app,
        handle_signals=False,
        access_log=None,
        shutdown_timeout=REQUEST_GRACE_SECONDS,
        keepalive_timeout=settings.http.client_timeout,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(LoopErrorThrottle())
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if stop_asked():
        stop.set()
    loop.add_signal_handler(signal.SIGHUP, _ignore_hangup)
    started = time.monotonic()
    open_files = raise_open_files_limit()
    logging.getLogger("aiohttp.server").addFilter(ClientProtocolErrors())
    if not await _set_up_unless_stopped(runner, stop):
        notifier.stopping("stopping: asked to stop during start-up")
        await notifier.aclose()
        log.info("start-up stopped: asked to stop before ready")
        return
    side_tasks: list[asyncio.Task[None]] = []
    sockets: list[socket.socket] = []
    try:
        sockets, address = listening_sockets(settings)
        await start_serving(runner, sockets)
        pool = app[POOL]
        if settings.faults.injection:
            _install_fault_injection(loop, pool, settings)
        # Figures the store cannot give now do not undo a start-up that
        # opened it: ready, saying so, as the status loop would.
        status_failures = Throttle()  # a store that is down fails every update alike
        status = await _status_or_unavailable(app, status_failures)
        notifier.ready(status)
        log.info(
            "ready",
            extra={
                "LISTEN": address,
                "WORKERS": settings.pool.workers,
                "STARTUP_MS": round((time.monotonic() - started) * 1000, 1),
                "MAILER": "smtp" if settings.mail.smtp else "log",
                "OPEN_FILES_LIMIT": open_files,
            },
        )
        # What start-up made (modules, the app, the settings) lives as long as
        # the process: out of the collector's sight, a full collection under
        # load walks only what came since, about 1 ms instead of 30.
        gc.freeze()
        side_tasks = [
            asyncio.create_task(_status_loop(app, notifier, status_failures), name="toko-status"),
            # A store that broke for good (its writer died) fails every write:
            # better a restart by systemd than a service stuck answering 503.
            asyncio.create_task(app[STORE].wait_broken(), name="toko-store"),
        ]
        if settings.systemd.watchdog_interval:
            side_tasks.append(
                asyncio.create_task(
                    _watchdog_loop(pool, notifier, settings.systemd.watchdog_interval),
                    name="toko-watchdog",
                )
            )
        try:
            await _wait_for_stop(stop, [*pool.side_tasks, *side_tasks])
        except SideTaskDied as died:
            notifier.stopping(f"stopping after a failure: {died}")
            raise
        notifier.stopping("stopping: finishing requests and running jobs")
        log.info("stopping", extra={"JOBS_RUNNING": pool.busy})
    finally:
        for task in side_tasks:
            task.cancel()
        await asyncio.gather(*side_tasks, return_exceptions=True)
        await stop_accepting(app, runner, sockets)
        await runner.cleanup()  # drains requests, then jobs, then closes the store
        await notifier.aclose()
    log.info("stopped")


async def _set_up_unless_stopped(runner: web.AppRunner, stop: asyncio.Event) -> bool:
    """Open the store and start the pool (cleanup_ctx); False if asked to stop first.

    Start-up can wait a long time (PostgreSQL not reachable yet, a migration
    lock held by a restore): a SIGTERM then must end it, not wait for it, or
    `systemctl stop` hangs until TimeoutStopSec= and systemd's SIGKILL. What
    was opened already (the store) is closed again.
    """
    setup = asyncio.create_task(runner.setup(), name="toko-setup")
    stop_wait = asyncio.create_task(stop.wait(), name="toko-stop")
    await asyncio.wait([setup, stop_wait], return_when=asyncio.FIRST_COMPLETED)
    if not stop.is_set():
        stop_wait.cancel()
        await setup  # its failure (a StoreError, say) is start-up's failure
        return True
    setup.cancel()
    try:
        with contextlib.suppress(asyncio.CancelledError):
            await setup
    finally:
        await runner.cleanup()
    return False


async def _wait_for_stop(stop: asyncio.Event, supervised: list[asyncio.Task[None]]) -> None:
    stop_wait = asyncio.create_task(stop.wait(), name="toko-stop")
    done, _ = await asyncio.wait([stop_wait, *supervised], return_when=asyncio.FIRST_COMPLETED)
    if stop_wait in done:
        return
    stop_wait.cancel()
    task = done.pop()
    reason = "cancelled" if task.cancelled() else repr(task.exception())
    log.critical("side task died; stopping", extra={"TASK": task.get_name(), "REASON": reason})
    raise SideTaskDied(f"{task.get_name()} died: {reason}")


def _ignore_hangup() -> None:
    # SIGHUP's default would end the process without a drain, and systemd
    # counts a death by SIGHUP as a clean exit, so Restart=on-failure would
    # leave the API down. Nothing is re-read while running: say so instead.
    log.warning(
        "SIGHUP ignored: settings are read only at start; restart toko-api to apply changes"
    )


async def _status_line(app: web.Application) -> str:
    pool = app[POOL]
    counts = await app[HEALTH].counts()
    line = (
        f"pending={counts.pending} running={counts.running} failed={counts.failed} "
        f"workers={pool.alive}/{pool.configured}"
    )
    # Also the one prober that runs when nobody asks /healthz.
    cannot_write = await app[HEALTH].write_error()
    return line if cannot_write is None else f"{line}; cannot write: {cannot_write}"


async def _status_or_unavailable(app: web.Application, failures: Throttle) -> str:
    try:
        return await _status_line(app)
    except StoreError as exc:
        # Say so in `systemctl status` rather than leave the last figures there.
        failures.log(log, logging.ERROR, "status update failed: %s", exc)
        return f"store unavailable: {exc}"


async def _status_loop(app: web.Application, notifier: Notifier, failures: Throttle) -> None:
    while True:
        await asyncio.sleep(STATUS_SECONDS)
        try:
            status = await _status_or_unavailable(app, failures)
        except Exception as exc:  # a long-lived loop logs and keeps going
            failures.log(log, logging.ERROR, "status update failed: %s", exc)
            continue
        notifier.status(status)


async def _watchdog_loop(pool: WorkerPool, notifier: Notifier, interval: float) -> None:
    # Runs on the event loop on purpose: a blocked loop stops the pings.
    complained = False
    while True:
        if pool.healthy():
            notifier.watchdog()
            complained = False
        elif not complained:
            log.error(
                "withholding watchdog ping: worker pool unhealthy",
                extra={"WORKERS_ALIVE": pool.alive, "WORKERS": pool.configured},
            )
            complained = True
        await asyncio.sleep(interval)


def _install_fault_injection(
    loop: asyncio.AbstractEventLoop, pool: WorkerPool, settings: Settings
) -> None:
    log.warning("fault injection enabled (testing only): SIGUSR1 kills a worker, SIGUSR2 blocks")

    def block() -> None:
        log.warning(
            "fault injection: blocking the event loop",
            extra={"SECONDS": settings.faults.block_seconds},
        )
        time.sleep(settings.faults.block_seconds)

    loop.add_signal_handler(signal.SIGUSR1, pool.kill_one_worker)
    loop.add_signal_handler(signal.SIGUSR2, block)


def run(settings: Settings, stop_asked: Callable[[], bool] = _not_asked) -> int:
    # The GIL switch interval stays at Python's 5 ms. A shorter one (0.5 ms was
    # tried) makes the event loop hand the GIL to the SQLite writer thread far
    # more often, and the hand-offs cost more than the writer gains: about 20 %
    # fewer POSTs per second at 16 connections, no gain at 1 or 4.
    with contextlib.suppress(KeyboardInterrupt):
        try:
            asyncio.run(serve(settings, stop_asked))
        except SideTaskDied:
            return 1
    return 0
