"""toko-backup on PostgreSQL: pg_dump while toko-api writes, verify, restore.

A backup taken mid-write holds one consistent snapshot (every product with
its job, each row identical to the source's); restored into an empty database
it gives back exactly those rows. Restore refuses while a toko-api is
connected, and refuses an archive toko-api could not start on (a newer
toko's) before it replaces anything. Backups are private (0600), verified,
pruned like SQLite's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import stat
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from jobs import backup_files, pg_backup
from jobs.common import JobFailed
from service.models import Product
from service.settings import Settings, StoreSettings
from service.store.postgres import PostgresStore
from service.store.postgres.migrations import LATEST_VERSION
from service.tasks import product_email_job
from tests.conftest import ServiceFactory
from tests.operability.cli import freeze_mid_copy, partials
from tests.support.api import create_product, wait_healthy
from tests.support.old_schema import make_postgres_at
from tests.support.postgres import PostgresCluster, fetch, pg_env
from tests.support.syscalls import SYNCS, numbered, synced, trace_command, where
from tests.support.tools import clean_env, run_tool, tool_command

TABLES = {
    "products": "SELECT id, nama, harga, created_at FROM products ORDER BY id",
    "jobs": "SELECT id, kind, payload::text, state, attempts, max_attempts, run_at,"
    " lease_until, last_error, created_at, updated_at FROM jobs ORDER BY id",
    "recaps": "SELECT * FROM recaps ORDER BY period",
    "toko_schema": "SELECT * FROM toko_schema",
}


async def dump_rows(cluster: PostgresCluster, url: str) -> dict[str, list[tuple[Any, ...]]]:
    return {name: await fetch(cluster, url, sql) for name, sql in TABLES.items()}


def printed(stdout: str) -> list[str]:
    """What the tool printed for people (its log lines are JSON on the same stdout)."""
    return [line for line in stdout.splitlines() if not line.startswith("{")]


class Writers:
    """Clients posting products until stopped; ``reached(n)`` awaits the n-th 201."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str) -> None:
        self.session = session
        self.base_url = base_url
        self.created: list[int] = []
        self.stop = asyncio.Event()
        self._grew = asyncio.Condition()

    async def run(self, worker: int) -> None:
        while not self.stop.is_set():
            product = await create_product(self.session, self.base_url, f"Backup {worker}", 500)
            async with self._grew:
                self.created.append(product["id"])
                self._grew.notify_all()

    async def reached(self, count: int) -> None:
        async with asyncio.timeout(30), self._grew:
            await self._grew.wait_for(lambda: len(self.created) >= count)


async def test_backup_while_writing_restores_into_an_empty_database(
    tmp_path: Path,
    pg_cluster: PostgresCluster,
    pg_url: str,
    service_factory: ServiceFactory,
) -> None:
    backups = tmp_path / "backups"
    env = pg_env(pg_cluster, pg_url, TOKO_BACKUP_DIR=str(backups))
    api = service_factory(env).start()
    await api.async_wait_ready(timeout=30)
    async with aiohttp.ClientSession() as session:
        writers = Writers(session, api.base_url)
        tasks = [asyncio.create_task(writers.run(i)) for i in range(4)]
        await writers.reached(100)
        result = await asyncio.to_thread(run_tool, "toko-backup", tmp_path / "run", env)
        await writers.reached(len(writers.created) + 50)  # writing goes on after it
        writers.stop.set()
        await asyncio.gather(*tasks)
        await wait_healthy(
            session,
            api.base_url,
            30,
            check=lambda body: body["queue"]["pending"] + body["queue"]["running"] == 0,
        )
    created = writers.created
    assert result.returncode == 0, result.stderr
    archive = Path(printed(result.stdout)[-1])
    assert archive.parent == backups and archive.name.startswith("toko-")
    assert archive.suffix == ".dump"
    assert stat.S_IMODE(os.stat(archive).st_mode) == 0o600
    assert not [name for name in os.listdir(backups) if name.endswith(".partial")]
    listing = await asyncio.to_thread(run_tool, "toko-backup", tmp_path / "run", env, "--list")
    assert listing.returncode == 0 and str(archive) in listing.stdout

    # Into an empty database: rows identical to the source's at the snapshot.
    empty = await pg_cluster.async_create_database("restore")
    restore_env = pg_env(pg_cluster, empty, TOKO_BACKUP_DIR=str(backups))
    restored = await asyncio.to_thread(
        run_tool, "toko-backup", tmp_path / "run", restore_env, "--restore", str(archive)
    )
    assert restored.returncode == 0, restored.stderr
    assert "kept as" not in restored.stdout  # nothing to keep from an empty database
    source = await dump_rows(pg_cluster, pg_url)
    copy = await dump_rows(pg_cluster, empty)
    assert 100 <= len(copy["products"]) < len(source["products"]), "not taken mid-write"
    assert set(copy["products"]) <= set(source["products"])
    # Consistent: each product came with its job, in one transaction.
    product_ids = {row[0] for row in copy["products"]}
    job_products = await fetch(
        pg_cluster, empty, "SELECT (payload->>'product_id')::bigint FROM jobs"
    )
    assert {pid for (pid,) in job_products} == product_ids
    assert copy["toko_schema"] == source["toko_schema"]
    # The restored database works: a store opens it and goes on numbering.
    store = PostgresStore(empty, password=pg_cluster.password)
    await store.open()
    try:
        new, _ = await store.create_product("after restore", 1, _job)
        assert new.id > max(product_ids)
    finally:
        await store.close()

    # A backup of the quiet database restores to exactly the same rows.
    quiet = await asyncio.to_thread(run_tool, "toko-backup", tmp_path / "run", env)
    assert quiet.returncode == 0, quiet.stderr
    second = await pg_cluster.async_create_database("restore")
    restored = await asyncio.to_thread(
        run_tool,
        "toko-backup",
        tmp_path / "run",
        pg_env(pg_cluster, second, TOKO_BACKUP_DIR=str(backups)),
        "--restore",
        printed(quiet.stdout)[-1],
    )
    assert restored.returncode == 0, restored.stderr
    assert await dump_rows(pg_cluster, second) == await dump_rows(pg_cluster, pg_url)

    # Restore into the live database is refused while toko-api is connected ...
    refused = await asyncio.to_thread(
        run_tool, "toko-backup", tmp_path / "run", env, "--restore", str(archive)
    )
    assert refused.returncode == 1
    assert "toko-api is connected to this database" in refused.stderr
    # Its socket too, or the next connection starts it again.
    assert "(systemctl stop toko-api.socket toko-api)" in refused.stderr
    assert len(await fetch(pg_cluster, pg_url, "SELECT id FROM products")) == len(created)
    # ... and works once it is stopped, keeping the replaced contents.
    api.terminate()
    assert await api.async_wait_exit(timeout=30) == 0
    done = await asyncio.to_thread(
        run_tool, "toko-backup", tmp_path / "run", env, "--restore", str(archive)
    )
    assert done.returncode == 0, done.stderr
    assert await dump_rows(pg_cluster, pg_url) == copy
    (kept_line,) = [line for line in printed(done.stdout) if "kept as" in line]
    kept = Path(kept_line.rsplit(" ", 1)[1])
    assert kept.parent == backups and stat.S_IMODE(os.stat(kept).st_mode) == 0o600
    assert kept not in backup_files.list_backups(backups, pg_backup.SUFFIX)  # never pruned
    for url in (empty, second):
        await pg_cluster.async_drop_database(url)


async def test_a_restore_keeps_the_replaced_contents_on_disk_before_replacing_them(
    tmp_path: Path, pg_cluster: PostgresCluster, pg_url: str
) -> None:
    backups, env = await _seeded(pg_cluster, pg_url, 1, tmp_path / "backups")
    made = await asyncio.to_thread(run_tool, "toko-backup", tmp_path / "run", env)
    assert made.returncode == 0, made.stderr
    archive = printed(made.stdout)[-1]

    # strace follows toko-backup into the pg_dump of the current contents,
    # then into the pg_restore that replaces them.
    argv = tool_command("toko-backup", "--restore", archive)
    calls = (*SYNCS, "execve")
    run = await trace_command(argv, tmp_path / "strace.log", calls, clean_env(tmp_path, env))
    assert run.returncode == 0, run.output
    (kept,) = await asyncio.to_thread(lambda: list(backups.glob("before-restore-*")))
    trace = numbered(run.calls)
    # Not the pg_restore --list that checks the archive first.
    (replacing,) = where(run.calls, lambda c: c.name == "execve" and '"--clean"' in c.args)
    for path in (kept, backups):  # its contents, and its name in the folder
        assert any(i < replacing for i in synced(run.calls, path)), (
            f"{path} was not synced before pg_restore started at {replacing}:\n{trace}"
        )


def _job(product: Product) -> object:
    return product_email_job(product, 3)


async def _seeded(
    cluster: PostgresCluster, url: str, products: int, backups: Path
) -> tuple[Path, dict[str, str]]:
    """``products`` in the database, and toko-backup's environment writing to ``backups``."""
    await _seed(cluster, url, products)
    return backups, pg_env(cluster, url, TOKO_BACKUP_DIR=str(backups))


async def _seed(cluster: PostgresCluster, url: str, products: int) -> None:
    store = PostgresStore(url, password=cluster.password)
    await store.open()
    try:
        await asyncio.gather(*(store.create_product(f"p{i}", i, _job) for i in range(products)))
    finally:
        await store.close()


async def _backup_of(
    cluster: PostgresCluster, tmp_path: Path, version: int, *changes: str
) -> tuple[str, Path]:
    """A toko-backup archive of a new database at schema ``version``, then ``changes``."""
    url = await cluster.async_create_database("source")
    conn = await cluster.connect(url.rsplit("/", 1)[1])
    try:
        row = "INSERT INTO products (nama, harga, created_at) VALUES ('Lama', 1, 0)"
        await make_postgres_at(conn, version, row)
        for change in changes:
            await conn.execute(change)
    finally:
        await conn.close()
    # Even a newer toko's database: a host not yet upgraded backs it up all the same.
    env = pg_env(cluster, url, TOKO_BACKUP_DIR=str(tmp_path / "archives"))
    made = await asyncio.to_thread(run_tool, "toko-backup", tmp_path / "run", env)
    assert made.returncode == 0, made.stderr
    return url, Path(printed(made.stdout)[-1])


async def test_a_restore_refuses_an_archive_toko_api_could_not_start_on_but_takes_an_older_one(
    tmp_path: Path, pg_cluster: PostgresCluster, pg_url: str
) -> None:
    backups, env = await _seeded(pg_cluster, pg_url, 2, tmp_path / "backups")
    bump = f"UPDATE toko_schema SET version = {LATEST_VERSION + 1}"  # as a newer toko leaves it
    newer_url, newer = await _backup_of(pg_cluster, tmp_path, LATEST_VERSION, bump)
    unversioned_url, unversioned = await _backup_of(
        pg_cluster, tmp_path, LATEST_VERSION, "DELETE FROM toko_schema"
    )
    before = await dump_rows(pg_cluster, pg_url)

    refusals = []
    for archive in (newer, unversioned):
        refused = await asyncio.to_thread(
            run_tool, "toko-backup", tmp_path / "run", env, "--restore", str(archive)
        )
        refusals.append((refused.returncode, refused.stderr))

    assert refusals == [
        (
            1,
            f"toko-backup: {newer} was made by a newer toko (schema version {LATEST_VERSION + 1};"
            f" this toko knows up to {LATEST_VERSION}): upgrade toko first\n",
        ),
        (1, f"toko-backup: {unversioned} is not a toko backup (no schema version in it)\n"),
    ]
    assert await dump_rows(pg_cluster, pg_url) == before
    assert not backups.exists()  # refused before the current contents were even dumped

    # An older toko's archive is restored as it is; toko-api upgrades it at start.
    # Done jobs here leave counts behind that the archive knows nothing of.
    await fetch(pg_cluster, pg_url, "UPDATE jobs SET state = 'done'")
    older_url, older = await _backup_of(pg_cluster, tmp_path, 1)
    restored = await asyncio.to_thread(
        run_tool, "toko-backup", tmp_path / "run", env, "--restore", str(older)
    )
    assert restored.returncode == 0, restored.stderr
    assert await fetch(pg_cluster, pg_url, "SELECT version FROM toko_schema") == [(1,)]
    store = PostgresStore(pg_url, password=pg_cluster.password)
    await store.open()
    try:
        assert [p.nama for p in await store.list_products(0, 10)] == ["Lama"]
        counts = await store.counts()
        assert (counts.pending, counts.running, counts.done, counts.failed) == (0, 0, 0, 0)
    finally:
        await store.close()
    for url in (newer_url, unversioned_url, older_url):
        await pg_cluster.async_drop_database(url)


async def test_backups_are_pruned_and_verified(
    tmp_path: Path, pg_cluster: PostgresCluster, pg_url: str
) -> None:
    await _seed(pg_cluster, pg_url, 5)
    settings = Settings(store=StoreSettings(database=pg_url, database_password=pg_cluster.password))
    folder = tmp_path / "b"
    made = []
    for second in range(3):
        path = await asyncio.to_thread(pg_backup.make_backup, settings, folder, 2)
        # Names carry the second; make them distinct without sleeping.
        renamed = path.with_name(f"toko-2026010{second}T000000Z.dump")
        path.rename(renamed)
        made.append(renamed)
    backup_files.prune(folder, 2, pg_backup.SUFFIX)
    assert backup_files.list_backups(folder, pg_backup.SUFFIX) == made[1:]
    for path in made[1:]:
        await asyncio.to_thread(pg_backup.check_archive, settings, path)
    # A clock behind (2000-01-01) names the new backup oldest: it is kept all the same.
    late = await asyncio.to_thread(pg_backup.make_backup, settings, folder, 2, lambda: 946684800.0)
    assert backup_files.list_backups(folder, pg_backup.SUFFIX) == [late, made[2]]

    bad = tmp_path / "bad.dump"
    bad.write_bytes(b"PGDMP but not really" * 100)
    with pytest.raises(JobFailed, match="not a usable pg_dump archive"):
        await asyncio.to_thread(pg_backup.check_archive, settings, bad)
    with pytest.raises(JobFailed, match="not a usable pg_dump archive"):
        await asyncio.to_thread(pg_backup.restore, settings, bad, folder)

    # Cut short (a copy to another host interrupted, a disk that lied): its
    # table of contents, at the start, is whole; the data after it are not.
    cut = tmp_path / "cut.dump"
    cut.write_bytes(made[2].read_bytes()[:-100])
    with pytest.raises(JobFailed, match=r"not a usable pg_dump archive.*end of file"):
        await asyncio.to_thread(pg_backup.check_archive, settings, cut)
    # Refused before the current contents are dumped beside the backups.
    with pytest.raises(JobFailed, match="not a usable pg_dump archive"):
        await asyncio.to_thread(pg_backup.restore, settings, cut, folder)
    assert not list(folder.glob("before-restore-*"))


async def test_a_wrong_password_fails_with_one_clear_line(
    tmp_path: Path, pg_cluster: PostgresCluster, pg_url: str
) -> None:
    wrong = tmp_path / "pw"
    wrong.write_text("not-the-password\n")
    env = {
        "TOKO_DATABASE": pg_url,
        "TOKO_DATABASE_PASSWORD_FILE": str(wrong),
        "TOKO_BACKUP_DIR": str(tmp_path / "b"),
    }
    result = await asyncio.to_thread(run_tool, "toko-backup", tmp_path, env)
    assert result.returncode == 1
    assert "pg_dump failed" in result.stderr and "password authentication failed" in result.stderr
    assert "not-the-password" not in result.stderr + result.stdout
    with contextlib.suppress(FileNotFoundError):
        # No dump, partial or not; only the (empty) lock file of the runs.
        assert [path.name for path in (tmp_path / "b").iterdir()] == [backup_files.LOCK_NAME]


def _stopped_run(sig: signal.Signals, workdir: Path, env: dict[str, str], folder: Path) -> int:
    """toko-backup sent ``sig`` mid-dump (while its partial dump exists); its exit code."""
    proc = subprocess.Popen(
        tool_command("toko-backup"),
        env=clean_env(workdir, env),
        cwd=workdir,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        freeze_mid_copy(proc, folder)
        proc.send_signal(sig)
        proc.send_signal(signal.SIGCONT)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode


async def test_a_stopped_backup_leaves_no_partial_dump_behind(
    tmp_path: Path, pg_cluster: PostgresCluster, pg_url: str
) -> None:
    folder, env = await _seeded(pg_cluster, pg_url, 5, tmp_path / "backups")
    # systemd's stop: the run removes its partial dump and fails.
    code = await asyncio.to_thread(_stopped_run, signal.SIGTERM, tmp_path, env, folder)
    assert code == 128 + signal.SIGTERM
    assert partials(folder) == []
    # systemd's last resort: nothing runs after SIGKILL, the next run cleans up.
    code = await asyncio.to_thread(_stopped_run, signal.SIGKILL, tmp_path, env, folder)
    assert code == -signal.SIGKILL and partials(folder)
    assert backup_files.list_backups(folder, pg_backup.SUFFIX) == []
    result = run_tool("toko-backup", tmp_path, env)
    assert result.returncode == 0, result
    assert partials(folder) == []
    assert len(backup_files.list_backups(folder, pg_backup.SUFFIX)) == 1


@pytest.mark.parametrize("form", ["--inserts", "--column-inserts"])
async def test_an_archive_pg_dump_wrote_with_inserts_restores_too(
    tmp_path: Path, pg_cluster: PostgresCluster, pg_url: str, form: str
) -> None:
    # An admin's own `pg_dump -Fc --inserts`: its data are INSERTs, not COPY.
    source_url, _ = await _backup_of(pg_cluster, tmp_path, LATEST_VERSION)
    archive = tmp_path / "by-hand.dump"
    dumped = await asyncio.to_thread(
        subprocess.run,
        [pg_backup.pg_tool("pg_dump"), "-Fc", form, f"--file={archive}", source_url],
        env={**os.environ, "PGPASSWORD": pg_cluster.password},
        capture_output=True,
        text=True,
        check=False,
    )
    assert dumped.returncode == 0, dumped.stderr
    env = pg_env(pg_cluster, pg_url)
    restored = await asyncio.to_thread(
        run_tool, "toko-backup", tmp_path / "run", env, "--restore", str(archive)
    )
    assert restored.returncode == 0, restored.stderr
    assert await fetch(pg_cluster, pg_url, "SELECT nama FROM products") == [("Lama",)]
    await pg_cluster.async_drop_database(source_url)


@contextlib.asynccontextmanager
async def _dump_waits_on_a_lock(cluster: PostgresCluster, url: str) -> AsyncIterator[Any]:
    """Hold the jobs table so a toko-backup started now waits mid-dump (its
    partial dump exists, pg_dump is connected); yields the holding connection.

    A dump slower than the unit's TimeoutStartSec=, or a server going away
    under it, without depending on how fast this machine dumps.
    """
    conn = await cluster.connect(url.rsplit("/", 1)[1])
    try:
        async with conn.transaction():
            await conn.execute("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE")
            yield conn
    finally:
        await conn.close()


async def _until_the_dump_waits(conn: Any, proc: subprocess.Popen[str]) -> None:
    waiting = (
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE application_name = 'toko-backup' AND wait_event_type = 'Lock'"
    )
    async with asyncio.timeout(30):
        while not await conn.fetchval(waiting):
            assert proc.poll() is None, proc.communicate()
            await asyncio.sleep(0.02)
            # Within a transaction, pg_stat_activity repeats its first answer.
            await conn.execute("SELECT pg_stat_clear_snapshot()")


def _start_backup(workdir: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        tool_command("toko-backup", *args),
        env=clean_env(workdir, env),
        cwd=workdir,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: pg_dump can be signalled with it
    )


@contextlib.asynccontextmanager
async def _backup_waiting_mid_dump(
    cluster: PostgresCluster, url: str, workdir: Path, env: dict[str, str], *args: str
) -> AsyncIterator[tuple[Any, subprocess.Popen[str]]]:
    """A toko-backup (with ``args``) held mid-dump by _dump_waits_on_a_lock, once it
    waits there; yields the holding connection and the process, killed if left running."""
    async with _dump_waits_on_a_lock(cluster, url) as conn:
        proc = _start_backup(workdir, env, *args)
        try:
            await _until_the_dump_waits(conn, proc)
            yield conn, proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


async def _stderr_once_ended(proc: subprocess.Popen[str]) -> str:
    _, err = await asyncio.to_thread(proc.communicate, timeout=60)
    return err


async def test_a_server_gone_mid_dump_fails_in_one_line_and_keeps_the_older_backups(
    tmp_path: Path, pg_cluster: PostgresCluster, pg_url: str
) -> None:
    folder, env = await _seeded(pg_cluster, pg_url, 5, tmp_path / "backups")
    older = run_tool("toko-backup", tmp_path, env)
    assert older.returncode == 0, older.stderr
    async with _backup_waiting_mid_dump(pg_cluster, pg_url, tmp_path, env) as (conn, proc):
        assert partials(folder)
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name = 'toko-backup'"
        )
        err = await _stderr_once_ended(proc)
    assert proc.returncode == 1
    # One line, as every failure: pg_dump spreads this one over five.
    (line,) = err.splitlines()
    assert line.startswith("toko-backup: pg_dump failed (1): pg_dump: error: ")
    assert "terminating connection due to administrator command" in line
    assert partials(folder) == []
    assert backup_files.list_backups(folder, pg_backup.SUFFIX) == [Path(printed(older.stdout)[-1])]


async def test_a_dump_past_the_units_timeout_is_stopped_with_pg_dump_and_leaves_nothing(
    tmp_path: Path, pg_cluster: PostgresCluster, pg_url: str
) -> None:
    # TimeoutStartSec=: systemd sends SIGTERM to every process of the unit,
    # pg_dump included, not to toko-backup alone.
    folder, env = await _seeded(pg_cluster, pg_url, 5, tmp_path / "backups")
    async with _backup_waiting_mid_dump(pg_cluster, pg_url, tmp_path, env) as (_, proc):
        os.killpg(proc.pid, signal.SIGTERM)
        err = await _stderr_once_ended(proc)
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.splitlines() == ["toko-backup: stopped by SIGTERM before it finished"]
    assert partials(folder) == []
    assert backup_files.list_backups(folder, pg_backup.SUFFIX) == []


@pytest.mark.parametrize("stop", ["server gone", "SIGTERM"])
async def test_a_restore_whose_safety_dump_fails_leaves_no_dump_named_as_kept(
    tmp_path: Path, pg_cluster: PostgresCluster, pg_url: str, stop: str
) -> None:
    # The current contents are dumped to before-restore-<time>.dump first;
    # a dump cut short there used to stay, looking like the kept contents.
    folder, env = await _seeded(pg_cluster, pg_url, 5, tmp_path / "backups")
    made = run_tool("toko-backup", tmp_path, env)
    assert made.returncode == 0, made.stderr
    await _seed(pg_cluster, pg_url, 2)  # newer than the backup
    before = await dump_rows(pg_cluster, pg_url)
    restoring = ("--restore", printed(made.stdout)[-1])
    async with _backup_waiting_mid_dump(pg_cluster, pg_url, tmp_path, env, *restoring) as (
        conn,
        proc,
    ):
        assert list(folder.glob("before-restore-*"))  # the safety dump under way
        if stop == "SIGTERM":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            await conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = 'toko-backup' AND wait_event_type = 'Lock'"
            )
        err = await _stderr_once_ended(proc)
    assert proc.returncode == (128 + signal.SIGTERM if stop == "SIGTERM" else 1)
    assert len(err.splitlines()) == 1, err
    assert not list(folder.glob("before-restore-*"))
    assert await dump_rows(pg_cluster, pg_url) == before


async def test_restores_in_the_same_second_each_keep_what_they_replaced(
    tmp_path: Path, pg_cluster: PostgresCluster, pg_url: str
) -> None:
    # The second's safety dump was refused: "[Errno 17] File exists: ...".
    await _seed(pg_cluster, pg_url, 5)
    settings = Settings(store=StoreSettings(database=pg_url, database_password=pg_cluster.password))
    folder = tmp_path / "b"
    made = await asyncio.to_thread(pg_backup.make_backup, settings, folder, 2)
    second = lambda: 1796089751.0  # noqa: E731  # both restores within it
    kept = [
        await asyncio.to_thread(pg_backup.restore, settings, made, folder, second) for _ in range(2)
    ]
    assert kept[0] is not None and kept[1] is not None and kept[0] != kept[1]
