"""No database password in any output or command line, on PostgreSQL.

The cluster's password (24 random characters) and a wrong one are looked for,
as they are, percent-encoded, JSON-escaped and base64, in every byte toko-api
and the timer jobs write at log level debug, and in every HTTP response, when
the server refuses the password (from a file or in the URL), when nothing
listens at the URL, and when all goes well. pg_dump and pg_restore, which
every local user can see in ps, get no password on their command line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote

import asyncpg  # type: ignore[import-untyped]

from service.store.postgres import PostgresStore
from tests.operability.cli import BIN, Completed, environment, run
from tests.support.http import request
from tests.support.leaks import assert_no_secret, make_secret
from tests.support.postgres import PostgresCluster, _children
from tests.support.service import ServiceProcess, free_port

PRODUCT = json.dumps({"nama": "Kopi Rahasia", "harga": 9000}).encode()
JOBS = ("toko-recap",), ("toko-backup",), ("toko-queue", "stats")


def with_password(url: str, password: str) -> str:
    """``url`` with ``password`` written into it, percent-encoded as a URL needs."""
    user, at, rest = url.removeprefix("postgresql://").partition("@")
    assert at, url
    return f"postgresql://{user}:{quote(password, safe='')}@{rest}"


def text_of(done: Completed) -> str:
    return done.stdout + done.stderr


async def run_jobs(env: dict[str, str], jobs: tuple[tuple[str, ...], ...] = JOBS) -> str:
    seen = []
    for command in jobs:
        done = await run(*command, env=env, timeout=60)
        seen.append(text_of(done))
    return "\n".join(seen)


async def api_refused(env: dict[str, str], tmp_path: Path) -> str:
    """toko-api started against a database that refuses it: it exits at once."""
    env = {**env, "TOKO_LISTEN": f"127.0.0.1:{free_port()}", "HOME": str(tmp_path)}
    done = await run("toko-api", env=env, timeout=60)
    assert done.returncode == 1, done
    return text_of(done)


async def test_no_password_leaks_when_the_database_refuses_it_or_is_gone(
    pg_cluster: PostgresCluster, pg_url: str, tmp_path: Path
) -> None:
    wrong = make_secret()
    secrets = [pg_cluster.password, wrong]
    wrong_file = tmp_path / "wrong-db-password"
    wrong_file.write_text(wrong + "\n")
    base = {"TOKO_LOG_LEVEL": "debug", "TOKO_BACKUP_DIR": str(tmp_path / "backups")}

    from_file = {**base, "TOKO_DATABASE": pg_url, "TOKO_DATABASE_PASSWORD_FILE": str(wrong_file)}
    refused = await api_refused(from_file, tmp_path) + await run_jobs(from_file)
    assert "password authentication failed" in refused
    assert_no_secret(refused, secrets, "a wrong password from a file")

    in_url = {**base, "TOKO_DATABASE": with_password(pg_url, wrong)}
    refused = await api_refused(in_url, tmp_path) + await run_jobs(in_url)
    assert "password authentication failed" in refused
    assert_no_secret(refused, secrets, "a wrong password in the URL")

    # A "%" not followed by two hex digits: pg_dump quoted the whole token it
    # could not decode, password and all, when it had the URL.
    encoded = quote(wrong, safe="")
    assert encoded.endswith("%25")
    mistyped = {**base, "TOKO_DATABASE": with_password(pg_url, wrong).replace("%25@", "%zz@")}
    printed = await run_jobs(mistyped, (("toko-backup",),))
    assert "toko-backup" in printed and encoded[:-3] not in printed, "the password leaked"

    # libpq and asyncpg also take it as a query parameter.
    in_query = {**base, "TOKO_DATABASE": f"{pg_url}?password={quote(wrong, safe='')}"}
    refused = await api_refused(in_query, tmp_path) + await run_jobs(in_query)
    assert "password authentication failed" in refused
    assert_no_secret(refused, secrets, "a wrong password in the URL's query")

    # Nothing listens there. toko-api waits for it (a booting host): its
    # retry line is what there is to see. The other jobs wait as long.
    gone_url = f"postgresql://{pg_cluster.user}:{pg_cluster.password}@127.0.0.1:{free_port()}/t"
    gone = {**base, "TOKO_DATABASE": gone_url}
    svc = ServiceProcess(tmp_path / "gone", gone, notify=False)
    try:
        svc.start()
        retrying = "database not reachable yet, retrying"
        await svc.logs.async_wait_for(
            lambda records: any(str(r.get("message")).startswith(retrying) for r in records),
            10,
            retrying,
        )
        svc.terminate()
        await svc.async_wait_exit(30)
    finally:
        svc.close()
    backup = await run("toko-backup", env=gone, timeout=60)
    assert backup.returncode == 1, backup
    down = "\n".join([svc.stdout_text(), svc.stderr_text(), text_of(backup)])
    assert_no_secret(down, secrets, "a database that is down")


async def test_no_password_leaks_from_a_working_deployment_at_debug(
    pg_cluster: PostgresCluster, pg_url: str, tmp_path: Path
) -> None:
    secrets = [pg_cluster.password]
    env = {
        "TOKO_DATABASE": with_password(pg_url, pg_cluster.password),
        "TOKO_LOG_LEVEL": "debug",
        "TOKO_BACKUP_DIR": str(tmp_path / "backups"),
    }
    svc = ServiceProcess(tmp_path / "api", env)
    responses = []
    try:
        svc.start()
        await svc.async_wait_ready(timeout=30)
        headers = {"Content-Type": "application/json"}
        for method, path in [("POST", "/produk"), ("GET", "/healthz"), ("GET", "/metrics")]:
            body = PRODUCT if method == "POST" else None
            response = await request(svc.port, method, path, body=body, headers=headers)
            assert response.status < 300, response
            responses.append(f"{response.headers}\n{response.body.decode()}")
        await svc.async_wait_log("email logged")
        svc.terminate()
        assert await svc.async_wait_exit(30) == 0
    finally:
        svc.close()
    assert svc.notify is not None
    jobs = await run_jobs(env)
    statuses = [note.raw for note in svc.notify.messages()]
    everything = "\n".join([svc.stdout_text(), svc.stderr_text(), *statuses, *responses, jobs])
    assert_no_secret(everything, secrets, "a working deployment")


async def migrated(cluster: PostgresCluster, url: str) -> None:
    store = PostgresStore(url, password=cluster.password)
    await store.open()
    await store.close()


@contextlib.asynccontextmanager
async def locked(cluster: PostgresCluster, url: str, table: str) -> AsyncIterator[None]:
    """``table`` locked (ACCESS EXCLUSIVE) until the block ends: a pg_dump or
    pg_restore that touches it waits, its command line there to read."""
    conn: asyncpg.Connection = await cluster.connect(url.rsplit("/", 1)[1])
    try:
        async with conn.transaction():
            await conn.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
            yield
    finally:
        await conn.close()


def _running_tool(parent: int, tool: str) -> str | None:
    """The command line of ``parent``'s child ``tool`` connecting to a database, if any."""
    for pid in _children(parent):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if Path(argv[0].decode()).name == tool and any(b"--dbname" in a for a in argv):
                return b" ".join(argv).decode()
    return None


async def tool_command_line(parent: asyncio.subprocess.Process, tool: str) -> str:
    """The command line of ``parent``'s child ``tool``, once it runs."""
    async with asyncio.timeout(30):
        while parent.returncode is None:
            if (found := _running_tool(parent.pid, tool)) is not None:
                return found
            await asyncio.sleep(0.01)  # no event tells that a child started
    raise AssertionError(f"toko-backup ended ({parent.returncode}) before {tool} was seen")


async def started(command: str, *args: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        str(BIN / command),
        *args,
        env=environment(env),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def finished(proc: asyncio.subprocess.Process) -> str:
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert proc.returncode == 0, (out, err)
    return out.decode() + err.decode()


async def test_pg_dump_and_pg_restore_get_no_password_on_their_command_line(
    pg_cluster: PostgresCluster, pg_url: str, tmp_path: Path
) -> None:
    # The password written into the URL, where an admin may well put it.
    password = pg_cluster.password
    folder = tmp_path / "backups"
    env = {"TOKO_DATABASE": with_password(pg_url, password), "TOKO_BACKUP_DIR": str(folder)}
    await migrated(pg_cluster, pg_url)

    async with locked(pg_cluster, pg_url, "products"):
        backup = await started("toko-backup", env=env)
        dump_argv = await tool_command_line(backup, "pg_dump")
    printed = await finished(backup)
    (archive,) = folder.glob("toko-*.dump")

    # Restored into a database without products (so no safety dump first),
    # where pg_restore's --clean waits on a table it drops.
    empty = await pg_cluster.async_create_database()
    try:
        conn = await pg_cluster.connect(empty.rsplit("/", 1)[1])
        await conn.execute("CREATE TABLE jobs (id int)")
        await conn.close()
        target = {**env, "TOKO_DATABASE": with_password(empty, password)}
        async with locked(pg_cluster, empty, "jobs"):
            restore = await started("toko-backup", "--restore", str(archive), env=target)
            restore_argv = await tool_command_line(restore, "pg_restore")
        printed += await finished(restore)
    finally:
        await pg_cluster.async_drop_database(empty)

    assert pg_url.rsplit("/", 1)[1] in dump_argv and empty.rsplit("/", 1)[1] in restore_argv
    assert_no_secret(dump_argv, [password], "pg_dump's command line")
    assert_no_secret(restore_argv, [password], "pg_restore's command line")
    assert_no_secret(printed, [password], "toko-backup's output")
