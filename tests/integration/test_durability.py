"""What reaches the disk, and when, traced with strace.

A 201 means the product is on disk, so a power cut right after it loses
nothing. No test can cut the power, but the order of system calls shows
whether one could lose an answered request: SQLite (``synchronous=FULL``, WAL)
has to sync the write-ahead log before toko-api sends the 201. With
``NORMAL``, the commit would stay in the page cache until a checkpoint.

And the event loop never waits on the disk: every read, write and sync of the
database happens on another thread, which is what keeps the watchdog honest.

A backup is synced before it gets its name, and the name is synced after, so
a crash leaves the whole backup or none, never a truncated one that looks
complete. A restore keeps the database it replaces, synced before the swap.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections import Counter
from pathlib import Path

import aiohttp

from service.store.sqlite import SqliteStore
from service.store.sqlite.checkpoints import FINISH_AT_PAGES, FINISH_PAGES
from service.tasks import product_email_job
from tests.conftest import ServiceFactory
from tests.support.api import wait_healthy
from tests.support.service import clean_environment
from tests.support.syscalls import SYNCS, numbered, synced, trace_command, traced, where

# The request comes in with recvfrom; the answer goes out with send (sendto)
# or, on newer Pythons, the transport's writelines (sendmsg).
SOCKET_CALLS = ("recvfrom", "recvmsg", "sendto", "sendmsg")
# How SQLite reads and writes its files (the -shm index is memory-mapped).
FILE_IO = ("pread64", "pwrite64", "read", "write", "openat", "ftruncate")
RENAMES = ("rename", "renameat", "renameat2")
POSTS = 4
# Enough for several checkpoint rounds: each commit adds a few pages of log.
CHECKPOINT_POSTS = 4000
CHECKPOINT_CLIENTS = 8
TOKO_BACKUP = str(Path(sys.executable).parent / "toko-backup")


def _exchanges(requests: list[int], answers: list[int]) -> list[tuple[int, int]]:
    """(request, its answer) for requests made one after the other on one connection.

    strace can miss the calls of the first moment after it attaches (it seizes
    the threads first and stops them in turn), so a first answer may come
    without its request: it is left out.
    """
    pairs: list[tuple[int, int]] = []
    for answer in answers:
        after_last = pairs[-1][1] if pairs else -1
        asked = [request for request in requests if after_last < request < answer]
        if asked:
            pairs.append((asked[-1], answer))
    return pairs


async def test_every_201_goes_out_after_its_commit_is_synced_to_disk(
    service_factory: ServiceFactory, tmp_path: Path
) -> None:
    svc = service_factory().start()
    await svc.async_wait_ready(timeout=20)
    async with (
        traced(svc.pid, tmp_path / "strace.log", SYNCS + SOCKET_CALLS) as calls,
        aiohttp.ClientSession() as session,
    ):
        # Several, one after the other: the first write to a fresh WAL syncs
        # its header whatever the setting, the ones after it only with FULL.
        for harga in range(POSTS):
            async with session.post(
                svc.url("/produk"), json={"nama": "Kopi", "harga": harga}
            ) as resp:
                assert resp.status == 201, await resp.text()

    requests = where(calls, lambda c: '"POST /produk' in c.args)
    answers = where(calls, lambda c: '"HTTP/1.1 201' in c.args)
    wal_synced = synced(calls, Path(f"{svc.database}-wal"))
    trace = numbered(calls, {*requests, *answers, *wal_synced})
    exchanges = _exchanges(requests, answers)
    assert len(exchanges) >= POSTS - 1, trace
    for request, answer in exchanges:
        assert any(request < index < answer for index in wal_synced), (
            f"the write-ahead log was not synced between the request at {request} "
            f"and its 201 at {answer}:\n{trace}"
        )
    # And the event loop's thread (the one reading requests) never waits on the disk.
    loop_thread = calls[requests[0]].tid
    assert all(calls[index].tid != loop_thread for index in wal_synced), trace


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

    requests = where(calls, lambda c: '"GET /metrics' in c.args)
    on_disk = where(calls, lambda c: f"<{database}" in c.args)
    assert requests and on_disk, calls
    loop_thread = calls[requests[0]].tid
    on_loop = [calls[i] for i in on_disk if calls[i].tid == loop_thread]
    assert on_loop == [], "database file calls on the event loop's thread:\n" + "\n".join(
        map(str, on_loop)
    )


async def _a_shop_with_backups(tmp_path: Path) -> dict[str, str]:
    """A database with a product in ``tmp_path``: toko-backup's environment for it."""
    store = SqliteStore(str(tmp_path / "toko.db"))
    await store.open()
    try:
        await store.create_product("Kopi", 1, lambda p: product_email_job(p, 3))
    finally:
        await store.close()
    return clean_environment(
        TOKO_DATABASE=str(tmp_path / "toko.db"), TOKO_BACKUP_DIR=str(tmp_path / "backups")
    )


async def test_a_backup_is_on_disk_before_it_gets_its_name(tmp_path: Path) -> None:
    env = await _a_shop_with_backups(tmp_path)
    folder = tmp_path / "backups"
    run = await trace_command([TOKO_BACKUP], tmp_path / "strace.log", SYNCS + RENAMES, env)
    assert run.returncode == 0, run.output
    (backup,) = await asyncio.to_thread(lambda: list(folder.glob("toko-*.db")))
    partial = folder / f".{backup.name}.partial"

    calls = run.calls
    (renamed,) = where(calls, lambda c: c.name in RENAMES and f'"{partial}"' in c.args)
    trace = numbered(calls)
    assert any(i < renamed for i in synced(calls, partial)), (
        f"the backup was not synced before its rename at {renamed}:\n{trace}"
    )
    assert any(i > renamed for i in synced(calls, folder)), (
        f"the backups folder was not synced after the rename at {renamed}:\n{trace}"
    )


async def test_a_restore_keeps_the_previous_database_on_disk_before_replacing_it(
    tmp_path: Path,
) -> None:
    env = await _a_shop_with_backups(tmp_path)
    made = await trace_command([TOKO_BACKUP], tmp_path / "backup.log", SYNCS, env)
    assert made.returncode == 0, made.output
    (backup,) = await asyncio.to_thread(lambda: list((tmp_path / "backups").glob("toko-*.db")))

    restore = [TOKO_BACKUP, "--restore", str(backup)]
    run = await trace_command(restore, tmp_path / "strace.log", SYNCS + RENAMES, env)
    assert run.returncode == 0, run.output
    (kept,) = await asyncio.to_thread(lambda: list(tmp_path.glob("toko.db.before-restore-*")))
    restoring = tmp_path / ".toko.db.restoring"

    calls = run.calls
    (renamed,) = where(calls, lambda c: c.name in RENAMES and f'"{restoring}"' in c.args)
    trace = numbered(calls)
    # The previous database may hold the newest data: it is kept, on disk.
    for path in (kept, restoring):
        assert any(i < renamed for i in synced(calls, path)), (
            f"{path.name} was not synced before the database was replaced at {renamed}:\n{trace}"
        )
    assert any(i > renamed for i in synced(calls, tmp_path)), (
        f"the database's folder was not synced after the rename at {renamed}:\n{trace}"
    )


async def test_checkpoints_copy_into_the_database_off_the_commit_path_and_the_log_stays_bounded(
    service_factory: ServiceFactory, tmp_path: Path
) -> None:
    # SQLite's own checkpoint ran inside the commit that crossed 1,000 pages of
    # log: that batch's requests waited for the copy and the database file's
    # sync. Now a thread of its own copies and syncs; the writer only finishes
    # a round: the few pages appended since, and one sync.
    svc = service_factory().start()
    await svc.async_wait_ready(timeout=20)
    database, wal = Path(svc.database), Path(f"{svc.database}-wal")
    wal_sizes: list[int] = []

    async def post(session: aiohttp.ClientSession, client: int) -> None:
        for n in range(CHECKPOINT_POSTS // CHECKPOINT_CLIENTS):
            body = {"nama": f"Barang {client}-{n}", "harga": n}
            async with session.post(svc.url("/produk"), json=body) as resp:
                assert resp.status == 201, await resp.text()
            wal_sizes.append(os.path.getsize(wal))  # noqa: ASYNC240 (a stat, microseconds)

    async with (
        traced(svc.pid, tmp_path / "strace.log", (*SYNCS, "pwrite64")) as calls,
        aiohttp.ClientSession() as session,
    ):
        await asyncio.gather(*(post(session, c) for c in range(CHECKPOINT_CLIENTS)))

    writes = set(where(calls, lambda c: c.name == "pwrite64" and f"<{database}>," in c.args))
    db_synced = set(synced(calls, database))
    # The thread that commits syncs the log most (a checkpoint syncs it too).
    ((writer, _),) = Counter(calls[i].tid for i in synced(calls, wal)).most_common(1)
    by_thread = [i for i in writes if calls[i].tid != writer]
    trace = numbered(calls, db_synced)
    assert any(calls[i].tid != writer for i in db_synced), (
        f"no thread but the writer synced the database file:\n{trace}"
    )
    # Each of the writer's syncs of the database file ends a finish: count the
    # pages it copied since its last one. SQLite's own checkpoint copies the
    # whole log, 1,000 pages or more, at each.
    finishes: list[int] = []
    pages = 0
    for i, call in enumerate(calls):
        if call.tid != writer:
            continue
        if i in writes:
            pages += 1
        elif i in db_synced:
            finishes.append(pages)
            pages = 0
    assert len(by_thread) > sum(finishes), (len(by_thread), finishes)
    assert max(finishes, default=0) <= 2 * FINISH_PAGES, finishes
    assert max(wal_sizes) <= 4 * FINISH_AT_PAGES * 4096, max(wal_sizes)
