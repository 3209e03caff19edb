"""toko-api's life as systemd sees it: READY, WATCHDOG, STOPPING, exit codes.

Each test runs the real ``toko-api`` console script with NOTIFY_SOCKET bound to
a real AF_UNIX datagram socket (tests.support.notify).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from itertools import pairwise
from pathlib import Path

import aiohttp
import pytest

from service import __version__
from service.store.sqlite import connect
from service.store.sqlite.migrations import migrate
from tests.conftest import ServiceFactory
from tests.support import db
from tests.support.api import create_product, create_products, healthz, wait_healthy
from tests.support.faults import FATAL_PRODUCT, FATAL_WRITER
from tests.support.notify import Notification
from tests.support.service import (
    TOKO_API,
    LogRecord,
    ServiceProcess,
    clean_environment,
    free_port,
)
from tests.support.smtp import SmtpServer

STATUS_RE = re.compile(r"pending=\d+ running=\d+ failed=\d+ workers=\d+/\d+")


def _watchdogs_after(notes: list[Notification], since: float) -> list[float]:
    return [n.at for n in notes if "WATCHDOG" in n.fields and n.at >= since]


async def test_ready_only_when_port_accepts(service_factory: ServiceFactory) -> None:
    svc = service_factory({"TOKO_WORKERS": "3"}).start()
    ready = await svc.async_wait_ready(timeout=20)
    assert svc.notify is not None
    # Checked in the notify thread the moment READY=1 arrived, before anyone woke.
    assert svc.port_accepting_at_ready is True
    assert svc.notify.hook_errors == []
    # READY=1 is followed by STATUS= with the queue figures.
    status = await svc.notify.async_wait_for_field("STATUS", timeout=10, since=ready.at)
    assert STATUS_RE.search(status.fields["STATUS"]), status
    await svc.async_wait_log("ready", timeout=5)
    async with aiohttp.ClientSession() as session:
        code, body = await healthz(session, svc.base_url)
    assert code == 200, body
    assert body["status"] == "ok"
    assert body["workers"] == {"alive": 3, "configured": 3}
    assert {"pending", "running", "failed", "done"} <= set(body["queue"])
    svc.notify.flush()
    notes = svc.notify.messages()
    assert not any("MAINPID" in n.fields for n in notes), notes
    assert [n for n in notes if n.get("READY") == "1"] == [ready], "READY=1 sent more than once"
    assert svc.notify.count("WATCHDOG") == 0, "WATCHDOG=1 without WATCHDOG_USEC"
    # Outside journald every stdout line is one JSON object with the contract's keys.
    records = svc.logs.snapshot()
    assert records
    for record in records:
        assert "_raw" not in record, f"stdout line is not JSON: {record['_raw']!r}"
        assert {"ts", "level", "logger", "message"} <= set(record), record
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z", records[0]["ts"]), records[0]


async def test_an_unknown_setting_is_one_warning_at_start(service_factory: ServiceFactory) -> None:
    # TOKO_WORKER=8 was ignored without a word: three workers, and no hint why.
    svc = service_factory({"TOKO_WORKER": "8", "TOKO_SMTP_ULR": "smtp://127.0.0.1"}).start()
    await svc.async_wait_ready(timeout=20)
    (warning,) = svc.find_logs(UNKNOWN_SETTINGS="TOKO_SMTP_ULR TOKO_WORKER")
    assert warning["level"] == "WARNING", warning
    assert warning["message"] == (
        "unknown settings ignored: 'TOKO_SMTP_ULR' (meant TOKO_SMTP_URL?), "
        "'TOKO_WORKER' (meant TOKO_WORKERS?) (man toko.env lists the known ones)"
    )


async def test_watchdog_cadence(service_factory: ServiceFactory) -> None:
    usec = 400_000  # pings expected every 200 ms
    svc = service_factory(watchdog_usec=usec).start()
    ready = await svc.async_wait_ready(timeout=20)
    assert svc.notify is not None
    pings = 15
    notes = await svc.notify.log.async_wait_for(
        lambda xs: list(xs) if len(_watchdogs_after(list(xs), ready.at)) >= pings else None,
        timeout=15,
        what=f"{pings} WATCHDOG=1 after READY",
    )
    times = _watchdogs_after(notes, ready.at)[:pings]
    span = times[-1] - times[0]
    gaps = [b - a for a, b in pairwise(times)]
    # 14 intervals of ~0.2 s = 2.8 s; generous bounds against a busy machine.
    assert 1.4 <= span <= 6.0, f"{pings} pings spanned {span:.2f}s; gaps {gaps}"
    # systemd kills the service when a gap exceeds WATCHDOG_USEC.
    assert max(gaps) < usec / 1e6, f"a gap of {max(gaps):.3f}s exceeds WATCHDOG_USEC; {gaps}"
    assert times[0] - ready.at < usec / 1e6, "first WATCHDOG=1 came too long after READY"


async def test_sigterm_stops_with_drain_and_exit_0(
    service_factory: ServiceFactory, smtp: SmtpServer
) -> None:
    smtp.set_delay(2.0)
    svc = service_factory(
        {"TOKO_SMTP_URL": smtp.url, "TOKO_WORKERS": "1", "TOKO_DRAIN_TIMEOUT": "10"}
    ).start()
    await svc.async_wait_ready(timeout=20)
    assert svc.notify is not None
    async with aiohttp.ClientSession() as session:
        products = await create_products(session, svc.base_url, ["Satu", "Dua", "Tiga"])
    # One worker: one email in flight at the SMTP server, two jobs queued.
    arrived = await smtp.arrivals.async_wait_for(lambda xs: xs, timeout=10, what="an email")
    term_at = time.monotonic()
    svc.terminate()
    stopping = await svc.notify.async_wait_for_field("STOPPING", "1", timeout=5, since=term_at)
    assert stopping.at - term_at < 1.0, "STOPPING=1 was not sent promptly"
    extend = await svc.notify.async_wait_for_field(
        "EXTEND_TIMEOUT_USEC", timeout=5, since=stopping.at
    )
    assert int(extend.fields["EXTEND_TIMEOUT_USEC"]) > 0
    assert await svc.async_wait_exit(timeout=20) == 0
    # The in-flight email was allowed to finish before the exit ...
    (delivered,) = smtp.delivered()
    assert delivered.message_id == arrived[0].message_id
    assert delivered.at > term_at
    assert extend.at < delivered.at, "EXTEND_TIMEOUT_USEC should come while the email is in flight"
    # ... no new job was started, and the queued ones stay queued for the next start.
    assert len(smtp.arrivals) == 1
    assert db.job_states(svc.database) == {"done": 1, "pending": 2}
    assert db.product_count(svc.database) == len(products)
    assert svc.find_logs("stopped"), svc.output_tail()
    svc.notify.flush()
    assert svc.notify.count("WATCHDOG") == 0


async def test_sigint_stops_cleanly(service_factory: ServiceFactory) -> None:
    svc = service_factory().start()
    await svc.async_wait_ready(timeout=20)
    assert svc.notify is not None
    svc.send_signal(signal.SIGINT)
    await svc.notify.async_wait_for_field("STOPPING", "1", timeout=5)
    assert await svc.async_wait_exit(timeout=15) == 0
    assert svc.stderr.snapshot() == [], "a clean stop prints nothing on stderr (no traceback)"


def _logged_starting_with(prefix: str) -> Callable[[Sequence[LogRecord]], LogRecord | None]:
    def predicate(records: Sequence[LogRecord]) -> LogRecord | None:
        return next((r for r in records if str(r.get("message", "")).startswith(prefix)), None)

    return predicate


async def _assert_start_up_stopped(svc: ServiceProcess, asked_at: float) -> None:
    """Out within a moment, exit 0, one line saying so, no READY=1, no listening port."""
    assert await svc.async_wait_exit(timeout=10) == 0, svc.output_tail()
    took = time.monotonic() - asked_at
    # Half the shortest wait a stop used to sit out (the 10 s busy timeout;
    # the database retries: 20 s). A tighter bound timed the machine: from
    # before the start, an interpreter start-up on a busy machine took 2.2 s.
    assert took < 5.0, f"took {took:.1f}s to stop during start-up"
    assert svc.find_logs("start-up stopped: asked to stop before ready"), svc.output_tail()
    assert svc.stderr.snapshot() == [], "a stop that was asked for is no failure"
    assert svc.notify is not None
    svc.notify.flush()
    assert svc.notify.first("READY") is None
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", svc.port), timeout=2).close()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_a_stop_while_the_database_is_not_reachable_yet_ends_start_up(
    service_factory: ServiceFactory, signum: signal.Signals
) -> None:
    # At boot PostgreSQL may come up after toko-api, which keeps trying for
    # OPEN_RETRY_SECONDS (20 s). A `systemctl stop` meanwhile used to wait for
    # that to end; with a lock in the way, until systemd's SIGKILL.
    closed_port = free_port()
    svc = service_factory({"TOKO_DATABASE": f"postgresql://toko@127.0.0.1:{closed_port}/x"})
    svc.start()
    await svc.logs.async_wait_for(
        _logged_starting_with("database not reachable yet, retrying"),
        timeout=10,
        what="a connection retry",
    )
    asked_at = time.monotonic()
    svc.send_signal(signum)
    await _assert_start_up_stopped(svc, asked_at)


async def test_a_stop_while_another_process_holds_the_sqlite_write_lock_ends_start_up(
    service_factory: ServiceFactory, tmp_path: Path
) -> None:
    # A toko-queue command or a sqlite3 shell in the middle of a write: start-up
    # waits in its migration for up to the busy timeout (10 s), in a thread
    # that a cancelled start-up used to leave running until then.
    database = tmp_path / "toko.db"
    prepared = connect(str(database))
    migrate(prepared)
    prepared.close()
    writer = connect(str(database))
    try:
        writer.execute("BEGIN IMMEDIATE")
        svc = service_factory(database=database).start()
        await svc.async_wait_log("database is locked by another process; waiting for it")
        asked_at = time.monotonic()
        svc.terminate()
        await _assert_start_up_stopped(svc, asked_at)
    finally:
        writer.close()


# toko-api as its console script runs it, but sending itself ``signal`` as it
# starts loading the server (aiohttp and the rest: a few hundred milliseconds,
# most of a start-up on SQLite), the likeliest moment for an early stop.
SIGNAL_WHILE_LOADING = """
import os, signal, sys
from service.cli import main

class SignalOnLoad:
    def find_spec(self, name, path=None, target=None):
        if name == "service.runner":
            os.kill(os.getpid(), signal.{name})
        return None

sys.meta_path.insert(0, SignalOnLoad())
sys.exit(main([]))
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_a_stop_while_the_server_is_still_loading_ends_start_up(
    service_factory: ServiceFactory, signum: signal.Signals
) -> None:
    # Found by a soak: a SIGTERM in the first ~0.3 s killed toko-api by the
    # signal (no line in the journal), and a SIGINT printed a traceback.
    code = SIGNAL_WHILE_LOADING.format(name=signum.name)
    svc = service_factory(executable=Path(sys.executable), args=["-c", code])
    asked_at = time.monotonic()
    svc.start()
    await _assert_start_up_stopped(svc, asked_at)


async def test_a_sighup_while_the_server_is_still_loading_is_ignored(
    service_factory: ServiceFactory,
) -> None:
    # As once it runs (test_sighup_is_logged_and_ignored): its default action
    # would end toko-api in a way systemd counts as clean, and leave it down.
    code = SIGNAL_WHILE_LOADING.format(name="SIGHUP")
    svc = service_factory(executable=Path(sys.executable), args=["-c", code]).start()
    await svc.async_wait_ready(timeout=20)
    async with aiohttp.ClientSession() as session:
        await create_product(session, svc.base_url, "after an early SIGHUP", 1)
    svc.terminate()
    assert await svc.async_wait_exit(timeout=15) == 0


async def test_an_answer_while_stopping_tells_the_client_the_connection_closes(
    service_factory: ServiceFactory,
) -> None:
    # Found by a soak: at every clean stop, clients with kept-alive connections
    # (a proxy's pool, aiohttp's) lost a request or two without an answer. The
    # answers given while stopping closed their connection without saying so,
    # and the client sent its next request on it.
    svc = service_factory().start()
    await svc.async_wait_ready(timeout=20)
    body_sent = asyncio.Event()
    finish_body = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        yield b'{"nama": "Kopi", '
        body_sent.set()
        await finish_body.wait()  # held in flight across the SIGTERM
        yield b'"harga": 15000}'

    async with aiohttp.ClientSession() as session:
        await create_product(session, svc.base_url, "first, kept alive", 1)
        in_flight = asyncio.create_task(
            session.post(
                svc.url("/produk"), data=body(), headers={"Content-Type": "application/json"}
            )
        )
        await body_sent.wait()
        svc.terminate()
        await _until_refused(svc.port, timeout=10)  # stopped accepting: now draining
        finish_body.set()
        async with await in_flight as response:
            assert response.status == 201, await response.text()
            assert response.headers.get("Connection") == "close", dict(response.headers)
    assert await svc.async_wait_exit(timeout=15) == 0


async def _until_refused(port: int, timeout: float) -> None:  # noqa: ASYNC109
    """Until connections to ``port`` are refused: toko-api closed its socket.

    Nothing else tells from outside that it has stopped accepting, so look.
    """
    async with asyncio.timeout(timeout):
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except ConnectionRefusedError:
                return
            writer.close()
            await asyncio.sleep(0.01)


async def test_sighup_is_logged_and_ignored(service_factory: ServiceFactory) -> None:
    # Its default action would end the process undrained, and systemd would
    # count that as a clean exit: Restart=on-failure would not bring it back.
    svc = service_factory().start()
    await svc.async_wait_ready(timeout=20)
    svc.send_signal(signal.SIGHUP)
    await svc.async_wait_log(
        "SIGHUP ignored: settings are read only at start; restart toko-api to apply changes",
        timeout=10,
    )
    async with aiohttp.ClientSession() as session:
        await create_product(session, svc.base_url, "after SIGHUP", 1)
    svc.terminate()
    assert await svc.async_wait_exit(timeout=15) == 0


async def test_a_second_toko_api_on_the_same_database_file_is_refused(
    service_factory: ServiceFactory, tmp_path: Path
) -> None:
    # Start-up puts back the jobs left "running" as a dead process's: a second
    # toko-api on the file would take the first one's running jobs and send
    # their emails again. A symbolic link names the same file by another path.
    first = service_factory().start()
    await first.async_wait_ready(timeout=20)
    link = tmp_path / "link.db"
    link.symlink_to(first.database)
    for path in (first.database, link):
        second = service_factory(database=path).start()
        assert await second.async_wait_exit(timeout=15) == 1, (path, second.output_tail())
        (line,) = second.stderr.snapshot()
        assert line.startswith("toko-api: another toko-api uses this database: "), line
        assert f"held by pid {first.pid}" in line, line
        assert second.notify is not None
        second.notify.flush()
        assert second.notify.first("READY") is None
    async with aiohttp.ClientSession() as session:
        await create_product(session, first.base_url, "still served", 1)
    first.terminate()
    assert await first.async_wait_exit(timeout=15) == 0


async def test_drain_timeout_leaves_the_job_for_the_next_start(
    service_factory: ServiceFactory, smtp: SmtpServer
) -> None:
    smtp.set_delay(6.0)  # longer than the drain timeout
    env = {"TOKO_SMTP_URL": smtp.url, "TOKO_DRAIN_TIMEOUT": "1", "TOKO_JOB_BACKOFF": "0.05"}
    svc = service_factory(env).start()
    await svc.async_wait_ready(timeout=20)
    async with aiohttp.ClientSession() as session:
        (product,) = await create_products(session, svc.base_url, ["Lambat"])
    await smtp.arrivals.async_wait_for(lambda xs: xs, timeout=10, what="the email in flight")
    term_at = time.monotonic()
    svc.terminate()
    assert await svc.async_wait_exit(timeout=15) == 0
    stopped_after = time.monotonic() - term_at
    assert stopped_after < 5.0, f"took {stopped_after:.1f}s to stop with TOKO_DRAIN_TIMEOUT=1"
    assert smtp.delivered() == []
    (job,) = db.jobs(svc.database)
    assert job["state"] in ("pending", "running"), job  # not lost, not a dead letter
    smtp.reset()
    again = service_factory(env).start()
    await again.async_wait_ready(timeout=20)
    await smtp.async_wait_delivered(1, timeout=30)
    assert any(f"Produk baru: {product['nama']}" in m.subject for m in smtp.delivered())


async def test_blocked_event_loop_stops_watchdog(service_factory: ServiceFactory) -> None:
    usec = 400_000
    block = 1.5
    svc = service_factory(
        {"TOKO_FAULT_INJECTION": "1", "TOKO_FAULT_BLOCK_SECONDS": str(block)},
        watchdog_usec=usec,
    ).start()
    ready = await svc.async_wait_ready(timeout=20)
    assert svc.notify is not None
    notify = svc.notify
    await notify.log.async_wait_for(
        lambda xs: len(_watchdogs_after(list(xs), ready.at)) >= 3, timeout=10, what="3 pings"
    )
    last_before = _watchdogs_after(list(notify.log.snapshot()), ready.at)[-1]
    svc.send_signal(signal.SIGUSR2)

    def end_of_silence(notes: Sequence[Notification]) -> float | None:
        # The first ping after a silence as long as the block, whenever
        # toko-api handled the signal: the times are those it sent them at.
        pings = _watchdogs_after(list(notes), last_before)
        return next((b for a, b in pairwise(pings) if b - a >= block - 0.3), None)

    resumed_at = await notify.log.async_wait_for(
        end_of_silence, timeout=block + 10, what=f"no WATCHDOG=1 for {block}s after SIGUSR2"
    )
    # And it recovers: regular pings again.
    notes = await notify.log.async_wait_for(
        lambda xs: list(xs) if len(_watchdogs_after(list(xs), resumed_at)) >= 4 else None,
        timeout=5,
        what="pings after the block",
    )
    after = _watchdogs_after(notes, resumed_at)[:4]
    assert max(b - a for a, b in pairwise(after)) < usec / 1e6
    async with aiohttp.ClientSession() as session:
        code, body = await healthz(session, svc.base_url)
    assert code == 200, body


async def test_killed_worker_is_logged_and_replaced(
    service_factory: ServiceFactory, smtp: SmtpServer
) -> None:
    svc = service_factory(
        {"TOKO_FAULT_INJECTION": "1", "TOKO_SMTP_URL": smtp.url, "TOKO_WORKERS": "2"},
        watchdog_usec=1_000_000,
    ).start()
    await svc.async_wait_ready(timeout=20)
    assert svc.notify is not None
    svc.send_signal(signal.SIGUSR1)
    died = await svc.async_wait_log("worker died", timeout=10)
    replaced = await svc.async_wait_log("worker replaced", timeout=10)
    assert died.get("WORKER") and replaced.get("WORKER"), (died, replaced)
    async with aiohttp.ClientSession() as session:
        body = await wait_healthy(
            session,
            svc.base_url,
            timeout=10,
            check=lambda b: b["workers"] == {"alive": 2, "configured": 2},
        )
        assert body["status"] == "ok"
        # The pool still works ...
        product = await create_product(session, svc.base_url, "Setelah", 5)
    (mid,) = await smtp.async_wait_delivered(1, timeout=15)
    assert f"Produk baru: {product['nama']}" in smtp.delivered()[0].subject
    # ... and the watchdog keeps going.
    replaced_seen = time.monotonic()
    await svc.notify.log.async_wait_for(
        lambda xs: len(_watchdogs_after(list(xs), replaced_seen)) >= 2, timeout=5, what="pings"
    )
    assert mid


async def test_a_dead_sqlite_writer_stops_the_process_for_systemd_to_restart(
    service_factory: ServiceFactory, tmp_path: Path
) -> None:
    wrapper = tmp_path / "fatal_writer.py"
    wrapper.write_text(FATAL_WRITER)
    svc = service_factory(executable=Path(sys.executable), args=(str(wrapper),)).start()
    await svc.async_wait_ready(timeout=20)
    async with aiohttp.ClientSession() as session:
        kept = await create_product(session, svc.base_url, "Sebelum", 1)
        async with session.post(
            svc.url("/produk"), json={"nama": FATAL_PRODUCT, "harga": 1}
        ) as resp:
            assert resp.status == 503, await resp.text()
            assert "error" in await resp.json()
    # Before, it stayed up answering 503 while the watchdog kept pinging; now it
    # stops with a failure exit, and Restart=on-failure brings it back.
    assert await svc.async_wait_exit(timeout=20) == 1
    died = svc.wait_log("side task died; stopping", timeout=5)
    assert died["TASK"] == "toko-store", died
    assert "the SQLite writer thread died: Fatal()" in died["REASON"], died
    assert svc.notify is not None
    assert any("STOPPING" in n.fields for n in svc.notify.log.snapshot())
    assert db.query(svc.database, "SELECT nama FROM products") == [{"nama": kept["nama"]}]


async def test_watchdog_only_while_every_worker_is_alive(service_factory: ServiceFactory) -> None:
    """Kill workers over and over: pings and health must agree about the pool.

    Whatever replacement policy the service has, WATCHDOG=1 may only go on while
    /healthz reports every configured worker alive; once it does not, systemd
    must be left to restart the service (no pings).
    """
    usec = 400_000
    svc = service_factory(
        {"TOKO_FAULT_INJECTION": "1", "TOKO_WORKERS": "2"}, watchdog_usec=usec
    ).start()
    await svc.async_wait_ready(timeout=20)
    assert svc.notify is not None
    kills = 0
    async with aiohttp.ClientSession() as session:
        code, body = await healthz(session, svc.base_url)
        while kills < 10 and code == 200:
            kills += 1
            svc.send_signal(signal.SIGUSR1)
            await svc.logs.async_wait_for(
                lambda xs, k=kills: [r for r in xs if r.get("message") == "worker died"][k - 1 :],
                timeout=10,
                what=f"worker death #{kills}",
            )
            # A replacement may still be starting: let the pool settle (no event for it).
            deadline = time.monotonic() + 3
            while True:
                code, body = await healthz(session, svc.base_url)
                whole = code == 200 and body["workers"]["alive"] == body["workers"]["configured"]
                if whole or code != 200 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
    observed = time.monotonic()
    await asyncio.sleep(5 * usec / 1e6)  # a window of ~10 expected pings, measured below
    svc.notify.flush()
    pings = svc.notify.count("WATCHDOG", since=observed + usec / 1e6)
    print(f"after {kills} worker kills: healthz {code} {body}; {pings} pings in the window")
    if code == 200 and body["workers"]["alive"] == body["workers"]["configured"]:
        assert pings >= 5, "all workers alive, yet the watchdog pings stopped"
    else:
        assert code == 503, f"workers dead but /healthz says {code}: {body}"
        assert pings == 0, f"{pings} WATCHDOG=1 sent while the pool is not whole"
    assert svc.returncode is None


BAD_CONFIG = [
    ("TOKO_DATABASE", "postgresql://toko@[::1/toko"),  # was a traceback from urlsplit
    ("TOKO_WORKERS", "abc"),
    ("TOKO_WORKERS", "0"),
    ("TOKO_LISTEN", "nonsense"),
    ("TOKO_LISTEN", "127.0.0.1:99999"),
    ("TOKO_JOB_BACKOFF", "-1"),
    ("TOKO_JOB_MAX_ATTEMPTS", "many"),
    ("TOKO_DRAIN_TIMEOUT", "soon"),
    ("TOKO_SMTP_URL", "http://127.0.0.1:25"),
]


@pytest.mark.parametrize(("variable", "value"), BAD_CONFIG)
async def test_bad_configuration_exits_2_naming_the_variable(
    service_factory: ServiceFactory, variable: str, value: str
) -> None:
    svc = service_factory({variable: value}).start()
    assert await svc.async_wait_exit(timeout=15) == 2, svc.output_tail()
    lines = svc.stderr.snapshot()
    assert len(lines) == 1, f"expected one line on stderr, got {lines}"
    assert variable in lines[0], lines[0]
    assert svc.notify is not None
    svc.notify.flush()
    assert svc.notify.first("READY") is None


def test_a_passed_socket_that_is_no_listening_stream_stops_start_up_in_one_line(
    tmp_path: Path,
) -> None:
    # A .socket unit with ListenDatagram=: socket activation hands over a UDP
    # socket as fd 3. A restart cannot mend that, so: exit 2, one line, no traceback.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.bind(("127.0.0.1", 0))
        fd = udp.fileno()
        script = f'exec 3<&{fd} {fd}<&-; LISTEN_FDS=1 LISTEN_PID=$$ exec "$0"'
        started = subprocess.run(
            ["bash", "-c", script, str(TOKO_API)],  # dash takes single-digit fds only
            env=clean_environment(TOKO_DATABASE=str(tmp_path / "toko.db")),
            pass_fds=(fd,),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    assert started.returncode == 2, started
    assert "not a listening stream socket" in started.stderr, started.stderr
    assert "Traceback" not in started.stderr + started.stdout, started.stderr


async def test_toko_listen_under_socket_activation_is_said_to_be_ignored(tmp_path: Path) -> None:
    # The installed units listen through toko-api.socket; an address an admin
    # puts in toko.env is not used, and toko-api says so rather than look applied.
    with socket.create_server(("127.0.0.1", 0)) as passed:
        fd = passed.fileno()
        port = passed.getsockname()[1]
        script = f'exec 3<&{fd} {fd}<&-; LISTEN_FDS=1 LISTEN_PID=$$ exec "$0"'
        proc = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            script,
            str(TOKO_API),  # dash takes single-digit fds only
            env=clean_environment(
                TOKO_DATABASE=str(tmp_path / "toko.db"), TOKO_LISTEN="0.0.0.0:9999"
            ),
            pass_fds=(fd,),
            stdout=asyncio.subprocess.PIPE,
        )
    try:
        assert proc.stdout is not None
        records = []
        async with asyncio.timeout(20):
            while not records or records[-1].get("message") != "ready":
                records.append(json.loads(await proc.stdout.readline()))
        async with aiohttp.ClientSession() as session:
            assert (await healthz(session, f"http://127.0.0.1:{port}"))[0] == 200
    finally:
        proc.terminate()
        await proc.wait()
    ignored = [r for r in records if r["message"].startswith("TOKO_LISTEN is ignored")]
    assert [r["level"] for r in ignored] == ["WARNING"], records
    assert f"('127.0.0.1', {port})" in ignored[0]["message"]
    assert "systemctl edit toko-api.socket" in ignored[0]["message"]
    assert records[-1]["LISTEN"] == f"('127.0.0.1', {port}) (socket activation)"


def _run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*args],
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", **(env or {})},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_version_and_help() -> None:
    version = _run_cli(str(TOKO_API), "--version")
    assert version.returncode == 0, version
    assert __version__ in version.stdout + version.stderr
    as_module = _run_cli(sys.executable, "-m", "service", "--version")
    assert as_module.returncode == 0, as_module
    assert __version__ in as_module.stdout + as_module.stderr
    usage = _run_cli(str(TOKO_API), "--help")
    assert usage.returncode == 0, usage
    assert "usage" in usage.stdout.lower()
    assert "TOKO_WORKERS" in usage.stdout


def test_open_files_soft_limit_is_raised_to_the_hard_limit(
    service_factory: ServiceFactory,
) -> None:
    # Started at a soft limit of 256, as systemd starts services at 1024.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    expected = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    assert expected > 256, "this machine's hard limit leaves nothing to raise"
    prlimit = shutil.which("prlimit")
    assert prlimit is not None, "prlimit (util-linux) is missing"
    svc = service_factory(
        executable=Path(prlimit), args=(f"--nofile=256:{hard_text}", str(TOKO_API))
    ).start()
    svc.wait_ready(timeout=20)
    limits = Path(f"/proc/{svc.pid}/limits").read_text()
    (line,) = [row for row in limits.splitlines() if row.startswith("Max open files")]
    assert line.split()[3] == str(expected), line
    ready = svc.wait_log("ready", timeout=5)
    assert ready["OPEN_FILES_LIMIT"] == expected, ready


async def test_out_of_open_files_is_logged_once_and_the_service_recovers(
    service_factory: ServiceFactory,
) -> None:
    # A hard limit of 64 that toko-api cannot lift, and more silent clients
    # than it has files for. Python's accept loop then reports every failed
    # accept() and schedules a retry per backlog slot, and the retries
    # multiply: unthrottled, over 4,000 error lines a second, each with a
    # traceback, and more at stop for the retries left pending.
    limit = 64
    prlimit = shutil.which("prlimit")
    assert prlimit is not None, "prlimit (util-linux) is missing"
    svc = service_factory(
        {"TOKO_CLIENT_TIMEOUT": "1"},
        executable=Path(prlimit),
        args=(f"--nofile={limit}:{limit}", str(TOKO_API)),
    ).start()
    await svc.async_wait_ready(timeout=20)
    free = limit - len(os.listdir(f"/proc/{svc.pid}/fd"))
    clients = [await asyncio.open_connection("127.0.0.1", svc.port) for _ in range(free + 20)]
    try:
        # The server closes each silent client after TOKO_CLIENT_TIMEOUT; those
        # past the limit wait in the listen queue until a retry accepts them,
        # so every client closed means the retries ran, at the limit and after.
        async with asyncio.timeout(30):
            closed = await asyncio.gather(*(reader.read() for reader, _ in clients))
        assert closed == [b""] * len(clients)
    finally:
        for _, writer in clients:
            writer.close()
    async with aiohttp.ClientSession() as session:
        await create_product(session, svc.base_url, "Kopi", 1000)
    svc.send_signal(signal.SIGTERM)
    assert await svc.async_wait_exit(timeout=20) == 0

    loop_errors = [r for r in svc.logs.snapshot() if r.get("logger") == "asyncio"]
    assert any("Too many open files" in r.get("exception", "") for r in loop_errors), (
        "the test never reached the limit"
    )
    # One line per distinct error per 10 s: the accept failure, and perhaps a
    # retry that outlived the socket at stop (unthrottled: about a thousand).
    assert len(loop_errors) <= 4, [r["message"] for r in loop_errors[:5]]


def test_quick_answers_do_not_load_the_server(tmp_path: Path) -> None:
    # --version, --help and --check-config (an ExecStartPre= line, an admin's
    # shell) should not pay for importing aiohttp and the rest of the server.
    probe = (
        "import contextlib, sys\n"
        "from service.cli import main\n"
        "with contextlib.suppress(SystemExit):\n"
        "    main(sys.argv[1:])\n"
        "print('server loaded:', 'aiohttp' in sys.modules)\n"
    )
    env = {"TOKO_DATABASE": str(tmp_path / "x.db")}
    for flag in ("--version", "--help", "--check-config"):
        done = _run_cli(sys.executable, "-c", probe, flag, env=env)
        assert done.returncode == 0, done
        assert "server loaded: False" in done.stdout, (flag, done.stdout)


def test_check_config(tmp_path: Path) -> None:
    env = {"TOKO_DATABASE": str(tmp_path / "x.db")}
    good = _run_cli(str(TOKO_API), "--check-config", env=env)
    assert good.returncode == 0, good
    bad = _run_cli(str(TOKO_API), "--check-config", env={**env, "TOKO_WORKERS": "abc"})
    assert bad.returncode == 2, bad
    assert "TOKO_WORKERS" in bad.stderr
    # A login without its password would fail every email; toko-api alone
    # needs it (the timer jobs send no mail and are not given it).
    login = {**env, "TOKO_SMTP_URL": "smtp://toko@mail.example.com:587"}
    no_password = _run_cli(str(TOKO_API), "--check-config", env=login)
    assert no_password.returncode == 2, no_password
    (line,) = no_password.stderr.splitlines()
    assert line.startswith("toko-api: TOKO_SMTP_URL") and "smtp-password" in line, line
    password = tmp_path / "smtp-password"
    password.write_text("s3cret\n")
    with_password = {**login, "TOKO_SMTP_PASSWORD_FILE": str(password)}
    assert _run_cli(str(TOKO_API), "--check-config", env=with_password).returncode == 0
