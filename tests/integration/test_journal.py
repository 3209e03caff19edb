"""Logging to a journald that stops reading: toko-api goes on serving, and says what it lost.

toko-api runs in a mount namespace of its own whose /run/systemd/journal is a
directory of the test's, so its journal socket is a datagram socket the test
holds, and JOURNAL_STREAM names its stdout as systemd would. Until the test
reads it, the socket is journald stopped with SIGSTOP: its queue fills after a
few entries and stays full.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import ServiceFactory
from tests.support import db
from tests.support.api import create_product, create_products, wait_healthy
from tests.support.journald import fill
from tests.support.service import TOKO_API, clean_environment

pytestmark = pytest.mark.root

WATCHDOG_USEC = 1_000_000  # WATCHDOG=1 every 0.5 s while the loop runs


@pytest.fixture
def journal_dir() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.fail(
            "a mount namespace for the journal socket needs root (deselect with -m 'not root')",
            pytrace=False,
        )
    # AF_UNIX paths are limited to ~107 bytes; pytest's tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="toko-journal-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def under_journald(journal_dir: Path, tmp_path: Path, program: Path = TOKO_API) -> Path:
    """``program`` with ``journal_dir/socket`` as its journal socket, stdout the journal stream."""
    wrapper = tmp_path / f"{program.name}-under-journald"
    wrapper.write_text(
        "#!/bin/sh\n"
        "exec unshare --mount --propagation private sh -c '"
        "mount -t tmpfs toko-test /run && mkdir -p /run/systemd/journal"
        f" && mount --bind {journal_dir} /run/systemd/journal"
        ' && exec 3>&1 && export JOURNAL_STREAM="$(stat -L -c %d:%i /proc/self/fd/3)"'
        ' && exec "$0" "$@"\' '
        f'{program} "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


def parse(data: bytes) -> dict[str, str]:
    """One entry (simple KEY=value lines, as toko's are here)."""
    return {
        key: value for key, _, value in (ln.partition("=") for ln in data.decode().splitlines())
    }


async def read_entries(
    sock: socket.socket, entries: list[dict[str, str]], last: Callable[[dict[str, str]], bool]
) -> None:
    """journald reading again: every entry that arrives, up to the ``last`` one."""
    loop = asyncio.get_running_loop()
    while True:
        entries.append(parse(await loop.sock_recv(sock, 1 << 20)))
        if last(entries[-1]):
            return


async def test_a_journald_that_stops_reading_holds_up_log_lines_not_requests(
    service_factory: ServiceFactory, journal_dir: Path, tmp_path: Path
) -> None:
    journald = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    journald.setblocking(False)
    journald.bind(str(journal_dir / "socket"))
    entries: list[dict[str, str]] = []
    with journald:
        svc = service_factory(
            watchdog_usec=WATCHDOG_USEC, executable=under_journald(journal_dir, tmp_path)
        ).start()
        await svc.async_wait_ready(timeout=20)
        assert svc.notify is not None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            # Each product's email is a log line ("email logged"): far more
            # than the socket's queue holds. With a blocking send the first
            # line that did not fit froze the event loop: no answer, and no
            # WATCHDOG=1, until systemd killed the process.
            names = [f"Teh {n}" for n in range(200)]
            await create_products(session, svc.base_url, names)
            await wait_healthy(
                session, svc.base_url, timeout=15, check=lambda b: b["queue"]["done"] == 200
            )
            # The loop still runs: it still pings the watchdog.
            await svc.notify.async_wait_for_field("WATCHDOG", timeout=5, since=time.monotonic())
            assert db.job_states(svc.database) == {"done": 200}
            assert svc.stderr.snapshot() == []  # no "--- Logging error ---" tracebacks

            # journald reads again: the lines held back follow, then new ones.
            product = await create_product(session, svc.base_url, "Kopi", 100)
            kopi_emailed = {"MESSAGE": "email logged", "PRODUCT_ID": str(product["id"])}
            async with asyncio.timeout(15):
                await read_entries(journald, entries, lambda e: kopi_emailed.items() <= e.items())
    emails = [e for e in entries if e.get("MESSAGE") == "email logged"]
    assert {e["SUBJECT"] for e in emails} == {f"Produk baru: {n}" for n in [*names, "Kopi"]}
    assert len(emails) == 201
    assert emails[-1]["PRODUCT_ID"] == str(product["id"])
    assert emails[-1]["SYSLOG_IDENTIFIER"] == "toko-api"
    assert not [e for e in entries if "DROPPED" in e]


@contextlib.asynccontextmanager
async def failed_job_waiting_for_journald(
    journal_dir: Path, tmp_path: Path
) -> AsyncIterator[tuple[socket.socket, asyncio.subprocess.Process, int]]:
    """toko-backup without a database, journald's queue full: the job has failed
    and said so on stderr, and its last journal line waits at exit for journald.
    Yields journald's socket, the job and how many entries fill the queue."""
    journald = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    journald.setblocking(False)
    journald.bind(str(journal_dir / "socket"))
    with journald:
        others = fill(journald)  # journald has not read for a while
        job = await asyncio.create_subprocess_exec(
            under_journald(journal_dir, tmp_path, TOKO_API.parent / "toko-backup"),
            env=clean_environment(TOKO_DATABASE=str(tmp_path / "missing.db")),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            assert job.stderr is not None
            first = await asyncio.wait_for(job.stderr.readline(), 10)
            assert first.startswith(b"toko-backup: no database at ")
            yield journald, job, others
        finally:
            if job.returncode is None:
                job.kill()
                await job.wait()


async def test_a_timer_job_waits_at_exit_for_journald_to_take_its_last_lines(
    journal_dir: Path, tmp_path: Path
) -> None:
    async with failed_job_waiting_for_journald(journal_dir, tmp_path) as (journald, job, others):
        # Its last line ("toko-backup failed: ...") is waiting for journald:
        # the exit waits too, well past the 2 s toko-api's stop allows.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(job.wait()), 3)
        loop = asyncio.get_running_loop()
        for _ in range(others):  # journald reads again
            await loop.sock_recv(journald, 1 << 20)
        entry = parse(await asyncio.wait_for(loop.sock_recv(journald, 1 << 20), 5))
        assert await asyncio.wait_for(job.wait(), 5) == 1
    assert entry["MESSAGE"].startswith("toko-backup failed: no database at ")
    assert entry["SYSLOG_IDENTIFIER"] == "toko-backup" and entry["PRIORITY"] == "3"
    assert job.stderr is not None
    assert await job.stderr.read() == b""  # nothing lost


async def test_a_sigterm_ends_a_timer_jobs_wait_for_journald_and_it_counts_what_is_lost(
    journal_dir: Path, tmp_path: Path
) -> None:
    # journald has stopped reading, and does not read again.
    async with failed_job_waiting_for_journald(journal_dir, tmp_path) as (_, job, _):
        with pytest.raises(TimeoutError):  # waiting for journald to take its last line
            await asyncio.wait_for(asyncio.shield(job.wait()), 1)
        # systemctl stop, or a shutdown, while the job waits at exit.
        job.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(job.wait(), 5) == 1  # well before its 30 s
    # Not Stopped's traceback: the count of what journald never got.
    assert job.stderr is not None
    assert await job.stderr.read() == (
        b"1 log lines were lost: the journal did not take them"
        b" before the program was stopped at exit\n"
    )
