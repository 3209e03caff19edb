"""The test helpers themselves, against real sockets and a stand-in process.

If these fail, the integration tests' verdicts mean nothing; they also show
that each check the integration tests rely on *can* fail.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time
from email.message import EmailMessage
from pathlib import Path

import aiosmtplib
import pytest
from aiohttp import web

from tests.support import http, ports
from tests.support.notify import Notification, NotifyListener, send
from tests.support.recorder import Recorder
from tests.support.service import ProcessExited, ServiceProcess
from tests.support.smtp import SmtpServer
from tests.support.syscalls import Call, parse, traced


def _message(subject: str, message_id: str, to: str = "admin@toko.test") -> EmailMessage:
    msg = EmailMessage()
    msg["From"] = "toko@toko.test"
    msg["To"] = to
    msg["Subject"] = subject
    msg["Message-ID"] = message_id
    msg.set_content("body")
    return msg


async def _send(smtp: SmtpServer, msg: EmailMessage) -> None:
    await aiosmtplib.send(msg, hostname="127.0.0.1", port=smtp.port, timeout=10)


# -- recorder ----------------------------------------------------------------


async def test_recorder_wakes_async_waiter_from_another_thread() -> None:
    rec: Recorder[int] = Recorder()
    threading.Timer(0.05, rec.append, [7]).start()
    started = time.monotonic()
    assert await rec.async_wait_for(lambda xs: 7 in xs, timeout=5) is True
    assert time.monotonic() - started < 2


async def test_recorder_times_out_with_a_useful_message() -> None:
    rec: Recorder[int] = Recorder("numbers")
    rec.append(1)
    with pytest.raises(TimeoutError, match=r"numbers: two items not met within 0.1s"):
        await rec.async_wait_for(lambda xs: len(xs) >= 2, timeout=0.1, what="two items")
    with pytest.raises(TimeoutError):
        rec.wait_for(lambda xs: len(xs) >= 2, timeout=0.1)


# -- SMTP server ---------------------------------------------------------------


async def test_smtp_delivers_and_records(smtp: SmtpServer) -> None:
    await _send(smtp, _message("Produk baru: Kopi ☕", "<job-1@toko.test>"))
    ids = await smtp.async_wait_delivered(1, timeout=5)
    assert ids == {"<job-1@toko.test>"}
    (m,) = smtp.delivered()
    assert m.subject == "Produk baru: Kopi ☕"
    assert m.to == ("admin@toko.test",)
    assert m.mail_from == "toko@toko.test"
    assert m.headers["To"] == "admin@toko.test"
    assert b"body" in m.raw
    assert smtp.url == f"smtp://127.0.0.1:{smtp.port}"


async def test_smtp_fail_next_gives_4xx_then_delivers_with_same_id(smtp: SmtpServer) -> None:
    smtp.fail_next(2)
    msg = _message("s", "<job-2@toko.test>")
    for _ in range(2):
        with pytest.raises(aiosmtplib.SMTPResponseException) as info:
            await _send(smtp, msg)
        assert 400 <= info.value.code < 500
    await _send(smtp, msg)
    assert [m.outcome for m in smtp.messages()] == ["tempfailed", "tempfailed", "delivered"]
    assert {m.message_id for m in smtp.messages()} == {"<job-2@toko.test>"}


async def test_smtp_fail_for_a_time(smtp: SmtpServer) -> None:
    smtp.fail_for(0.3)
    with pytest.raises(aiosmtplib.SMTPResponseException):
        await _send(smtp, _message("s", "<a@t>"))
    await asyncio.sleep(0.35)  # the behaviour under test is time itself
    await _send(smtp, _message("s", "<a@t>"))
    assert smtp.delivered_ids() == {"<a@t>"}


async def test_smtp_refuses_matching_subject_permanently(smtp: SmtpServer) -> None:
    smtp.refuse_subject("TOLAK")
    with pytest.raises(aiosmtplib.SMTPResponseException) as info:
        await _send(smtp, _message("Produk baru: TOLAK ini", "<r@t>"))
    assert info.value.code == 550
    await _send(smtp, _message("Produk baru: terima", "<ok@t>"))
    assert [m.outcome for m in smtp.messages()] == ["refused", "delivered"]
    smtp.reset()
    await _send(smtp, _message("Produk baru: TOLAK ini", "<r@t>"))
    assert smtp.delivered_ids() == {"<ok@t>", "<r@t>"}


async def test_smtp_delay_and_arrivals(smtp: SmtpServer) -> None:
    smtp.set_delay(0.4)
    started = time.monotonic()
    task = asyncio.create_task(_send(smtp, _message("s", "<d@t>")))
    arrived = await smtp.arrivals.async_wait_for(lambda xs: xs, timeout=5)
    assert arrived[0].message_id == "<d@t>"
    assert smtp.delivered() == []  # arrived, reply still held back
    await task
    assert time.monotonic() - started >= 0.4
    assert smtp.delivered_ids() == {"<d@t>"}


async def test_smtp_wait_for_distinct_ids_and_duplicates(smtp: SmtpServer) -> None:
    sends = [_send(smtp, _message("s", f"<{i % 3}@t>")) for i in range(5)]
    waiter = asyncio.create_task(smtp.async_wait_delivered(3, timeout=10))
    await asyncio.gather(*sends)
    assert await waiter == {"<0@t>", "<1@t>", "<2@t>"}
    assert smtp.duplicates() == {"<0@t>": 2, "<1@t>": 2}
    with pytest.raises(TimeoutError):
        await smtp.async_wait_delivered(4, timeout=0.1)
    assert smtp.wait_delivered(3, timeout=1) == {"<0@t>", "<1@t>", "<2@t>"}


# -- notify socket -------------------------------------------------------------


async def test_notify_records_parses_and_runs_hooks_first() -> None:
    seen_in_log_at_hook: list[int] = []
    listener = NotifyListener()
    listener.hooks.append(lambda note: seen_in_log_at_hook.append(len(listener.log)))
    with listener:
        assert len(listener.path) < 100
        send(listener.path, "READY=1\nSTATUS=pending=0 running=0")
        ready = await listener.async_wait_for_field("READY", "1", timeout=5)
        assert ready.fields == {"READY": "1", "STATUS": "pending=0 running=0"}
        for _ in range(3):
            send(listener.path, "WATCHDOG=1")
        await listener.log.async_wait_for(lambda xs: len(xs) >= 4, timeout=5)
        assert listener.count("WATCHDOG") == 3
        assert listener.count("WATCHDOG", since=ready.at) == 3
        assert listener.count("WATCHDOG", until=ready.at) == 0
        assert listener.first("STOPPING") is None
        send(listener.path, "STOPPING=1")
        assert listener.wait_for_field("STOPPING", timeout=5).get("STOPPING") == "1"
        assert listener.times("READY") == [ready.at]
        listener.flush()
        assert listener.first("X_TEST_FLUSH", "1") is not None
    # The hook ran before each datagram became visible to waiters.
    assert seen_in_log_at_hook == [0, 1, 2, 3, 4, 5]
    assert _gone(listener.path)


def test_notify_stamps_a_datagram_when_it_was_sent_not_when_read() -> None:
    # A loaded machine wakes the listener late; a run of pings sent 200 ms
    # apart then looked like one long gap and a burst (the watchdog tests).
    held, release = threading.Event(), threading.Event()

    def hold(note: Notification) -> None:
        held.set()
        release.wait(5)

    with NotifyListener(hooks=[hold]) as listener:
        send(listener.path, "HOLD=1")
        assert held.wait(5)  # the listener thread is stuck in the hook
        sent_at = time.monotonic()
        send(listener.path, "WATCHDOG=1")
        time.sleep(0.5)  # the behaviour under test is time itself: read late
        release.set()
        ping = listener.wait_for_field("WATCHDOG", timeout=5)
    assert ping.at - sent_at < 0.1, f"stamped {ping.at - sent_at:.3f}s after it was sent"


def _gone(path: str) -> bool:
    return not Path(path).exists()


# -- raw HTTP client -------------------------------------------------------------


async def test_raw_http_sends_exact_bytes_and_parses_chunked() -> None:
    received: list[tuple[str, str, bytes]] = []

    async def echo(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        received.append((request.method, request.headers.get("Content-Type", ""), body))
        resp = web.StreamResponse(status=418)
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await resp.write(b'{"error": ')
        await resp.write(b'"teapot"}')
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.SockSite(runner, _listening_socket())
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        resp = await http.request(
            port, "PATCH", "/x", body=b"\xff\xfe", headers={"Content-Type": "text/plain"}
        )
        assert resp.status == 418
        assert resp.json() == {"error": "teapot"}
        big = await http.request(port, "POST", "/y", body=b"a" * 20000, chunked=True)
        assert big.status == 418
    finally:
        await runner.cleanup()
    assert received == [("PATCH", "text/plain", b"\xff\xfe"), ("POST", "", b"a" * 20000)]


def _listening_socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    return s


# -- ServiceProcess against a stand-in executable ------------------------------

FAKE = """\
import json, os, signal, socket, sys, time
if os.environ.get("FAKE_BAD_CONFIG"):
    print("toko-api: TOKO_WORKERS must be an integer", file=sys.stderr)
    sys.exit(2)
host, port = os.environ["TOKO_LISTEN"].rsplit(":", 1)
notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
def sd(msg):
    notify.sendto(msg.encode(), os.environ["NOTIFY_SOCKET"])
if os.environ.get("FAKE_READY_EARLY"):
    sd("READY=1")
    time.sleep(0.5)
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((host, int(port)))
srv.listen()
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # taken by sigwait below
print(json.dumps({"message": "env", "KEYS": sorted(os.environ)}), flush=True)
print("not json", flush=True)
sd("READY=1")
print(json.dumps({"message": "ready", "PORT": int(port)}), flush=True)
signal.sigwait({signal.SIGTERM})
sd("STOPPING=1")
print(json.dumps({"message": "stopped"}), flush=True)
"""


def _fake(tmp_path: Path) -> Path:
    script = tmp_path / "fake-toko-api"
    script.write_text(f"#!{sys.executable}\n{FAKE}")
    script.chmod(0o755)
    return script


async def test_service_process_ready_logs_env_and_sigterm(tmp_path: Path) -> None:
    svc = ServiceProcess(
        tmp_path / "w", {"TOKO_WORKERS": "2", "HOME": None}, executable=_fake(tmp_path)
    )
    try:
        svc.start()
        await svc.async_wait_ready(timeout=10)
        assert svc.port_accepting_at_ready is True
        ready = await svc.async_wait_log("ready", timeout=5, PORT=svc.port)
        assert ready["PORT"] == svc.port
        (env,) = svc.find_logs("env")
        assert env["KEYS"] == sorted(
            ["LANG", "NOTIFY_SOCKET", "PATH", "TOKO_DATABASE", "TOKO_LISTEN", "TOKO_WORKERS"]
        )
        assert {"_raw": "not json"} in svc.logs.snapshot()
        svc.terminate()
        assert await svc.async_wait_exit(10) == 0
        assert svc.notify is not None and svc.notify.first("STOPPING", "1") is not None
        assert svc.find_logs("stopped")
        with pytest.raises(ProcessExited, match="exited before logging 'never'"):
            await svc.async_wait_log("never", timeout=5)
    finally:
        svc.close()


def test_service_process_sees_ready_before_listen(tmp_path: Path) -> None:
    svc = ServiceProcess(tmp_path / "w", {"FAKE_READY_EARLY": "1"}, executable=_fake(tmp_path))
    try:
        svc.start()
        svc.wait_ready(timeout=10)
        assert isinstance(svc.port_accepting_at_ready, str)
        assert "connect failed" in svc.port_accepting_at_ready
    finally:
        svc.close()
    assert svc.returncode == -9


async def test_service_process_exit_before_ready_fails_fast(tmp_path: Path) -> None:
    svc = ServiceProcess(tmp_path / "w", {"FAKE_BAD_CONFIG": "1"}, executable=_fake(tmp_path))
    try:
        svc.start()
        started = time.monotonic()
        with pytest.raises(ProcessExited, match="TOKO_WORKERS must be an integer"):
            await svc.async_wait_ready(timeout=30)
        assert time.monotonic() - started < 10
        assert await svc.async_wait_exit(5) == 2
        assert svc.stderr.snapshot() == ["toko-api: TOKO_WORKERS must be an integer"]
    finally:
        svc.close()


def test_strace_output_parses_with_interleaved_threads() -> None:
    # As strace -f -y prints two threads whose calls overlap.
    text = (
        '101 recvfrom(16<socket:[7]>, "POST /produk HTTP/1.1"..., 262144, 0, NULL, NULL) = 213\n'
        "102 fdatasync(9</db/toko.db-wal> <unfinished ...>\n"
        '101 sendto(6<socket:[8]>, "\\0", 1, 0, NULL, 0) = 1\n'
        "102 <... fdatasync resumed>)            = 0\n"
        "101 recvfrom(5<socket:[9]>, 0x55f8, 4096, 0, NULL, NULL) = -1 EAGAIN (Resource ...)\n"
        "101 --- SIGINT {si_signo=SIGINT, si_code=SI_USER} ---\n"
        "102 +++ exited with 0 +++\n"
    )
    sync_started = Call(102, "fdatasync", "9</db/toko.db-wal>", None)
    assert parse(text) == [
        Call(
            101,
            "recvfrom",
            '16<socket:[7]>, "POST /produk HTTP/1.1"..., 262144, 0, NULL, NULL',
            "213",
        ),
        sync_started,
        Call(101, "sendto", '6<socket:[8]>, "\\0", 1, 0, NULL, 0', "1"),
        Call(102, "fdatasync", "9</db/toko.db-wal>", "0"),
        Call(
            101,
            "recvfrom",
            "5<socket:[9]>, 0x55f8, 4096, 0, NULL, NULL",
            "-1 EAGAIN (Resource ...)",
        ),
    ]
    assert parse(text)[3].succeeded and not sync_started.succeeded
    assert not parse(text)[4].succeeded


SYNC_ON_EACH_LINE = """
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT)
for line in sys.stdin:
    os.fdatasync(fd)
    print("synced", flush=True)
"""


async def test_traced_records_only_what_happens_while_attached(tmp_path: Path) -> None:
    data = tmp_path / "data"
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-c", SYNC_ON_EACH_LINE, str(data)],
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None

    async def sync() -> None:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
        assert await proc.stdout.readline() == b"synced\n"

    try:
        await sync()  # before strace attaches: not in the trace
        async with traced(proc.pid, tmp_path / "strace.log", ["fdatasync"]) as calls:
            await sync()
            await sync()
        await sync()  # after it detached: the process runs on, untraced
    finally:
        proc.stdin.close()
        assert await proc.wait() == 0
    # -y names the descriptor's file: "3</path/to/data>".
    synced = [(c.name, c.args.partition("<")[2], c.result) for c in calls]
    assert synced == [("fdatasync", f"{data}>", "0")] * 2


def test_free_ports_never_repeat_and_no_client_socket_gets_one() -> None:
    picked = [ports.free_port() for _ in range(200)]
    assert len(set(picked)) == len(picked)
    # The kernel gives client sockets their source port from this range only.
    low, _high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert all(ports.LOWEST <= port < low for port in picked), picked
