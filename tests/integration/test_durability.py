"""What the disk sees, traced with strace on a running toko-api.

A 201 means the product is on disk, so a power cut right after it loses
nothing. No test can cut the power, but the order of system calls shows
whether one could lose an answered request: SQLite (``synchronous=FULL``, WAL)
has to sync the write-ahead log before toko-api sends the 201. With
``NORMAL``, the commit would stay in the page cache until a checkpoint.

And the event loop never waits on the disk: every read, write and sync of the
database happens on another thread, which is what keeps the watchdog honest.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import aiohttp

from tests.conftest import ServiceFactory
from tests.support.api import wait_healthy
from tests.support.syscalls import Call, traced

SYNCS = ("fdatasync", "fsync")
# The request comes in with recvfrom; the answer goes out with send (sendto)
# or, on newer Pythons, the transport's writelines (sendmsg).
SOCKET_CALLS = ("recvfrom", "recvmsg", "sendto", "sendmsg")
# How SQLite reads and writes its files (the -shm index is memory-mapped).
FILE_IO = ("pread64", "pwrite64", "read", "write", "openat", "ftruncate")


def _where(calls: list[Call], matches: Callable[[Call], bool]) -> list[int]:
    return [index for index, call in enumerate(calls) if matches(call)]


async def test_every_201_goes_out_after_its_commit_is_synced_to_disk(
    service_factory: ServiceFactory, tmp_path: Path
) -> None:
    svc = service_factory().start()
    await svc.async_wait_ready(timeout=20)
    wal = f"{svc.database}-wal>"
    # Several, one after the other: the first write to a fresh WAL syncs its
    # header whatever the setting, the ones after it only with FULL.
    async with (
        traced(svc.pid, tmp_path / "strace.log", SYNCS + SOCKET_CALLS) as calls,
        aiohttp.ClientSession() as session,
    ):
        for harga in range(3):
            async with session.post(
                svc.url("/produk"), json={"nama": "Kopi", "harga": harga}
            ) as resp:
                assert resp.status == 201, await resp.text()

    requests = _where(calls, lambda c: '"POST /produk' in c.args)
    answers = _where(calls, lambda c: '"HTTP/1.1 201' in c.args)
    synced = _where(calls, lambda c: c.name in SYNCS and wal in c.args and c.succeeded)
    trace = "\n".join(f"{i:3d} {calls[i]}" for i in sorted({*requests, *answers, *synced}))
    assert len(requests) == len(answers) == 3, trace
    for request, answer in zip(requests, answers, strict=True):
        assert any(request < index < answer for index in synced), (
            f"the write-ahead log was not synced between the request at {request} "
            f"and its 201 at {answer}:\n{trace}"
        )
    # And the event loop's thread (the one reading requests) never waits on the disk.
    loop_thread = calls[requests[0]].tid
    assert all(calls[index].tid != loop_thread for index in synced), trace


async def test_the_event_loop_thread_never_touches_the_database_files(
    service_factory: ServiceFactory, tmp_path: Path
) -> None:
    svc = service_factory().start()
    await svc.async_wait_ready(timeout=20)
    database = str(svc.database)
    async with (
        traced(svc.pid, tmp_path / "strace.log", SYNCS + SOCKET_CALLS + FILE_IO) as calls,
        aiohttp.ClientSession() as session,
    ):
        # Every route that reads or writes the store, and a job run and acked.
        async with session.post(svc.url("/produk"), json={"nama": "Teh", "harga": 2}) as resp:
            assert resp.status == 201, await resp.text()
            product = await resp.json()
        await wait_healthy(session, svc.base_url, timeout=10, check=lambda b: b["queue"]["done"])
        for path in ("/produk", f"/produk/{product['id']}", "/healthz", "/metrics"):
            async with session.get(svc.url(path)) as resp:
                assert resp.status == 200, (path, await resp.text())

    requests = _where(calls, lambda c: '"GET /metrics' in c.args)
    on_disk = _where(calls, lambda c: f"<{database}" in c.args)
    assert requests and on_disk, calls
    loop_thread = calls[requests[0]].tid
    on_loop = [calls[i] for i in on_disk if calls[i].tid == loop_thread]
    assert on_loop == [], "database file calls on the event loop's thread:\n" + "\n".join(
        map(str, on_loop)
    )
