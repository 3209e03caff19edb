"""A throwaway PostgreSQL cluster for the tests, and fresh databases in it.

Usage::

    cluster = acquire_cluster()             # started once per test process
    try:
        url = cluster.create_database()     # postgresql://toko@127.0.0.1:PORT/t_ab12cd34
        ...TOKO_DATABASE=url, password in cluster.password_file...
    finally:
        release_cluster()                   # the last release stops it

The cluster is made with the Debian server binaries (``initdb``, ``pg_ctl`` from
``/usr/lib/postgresql/*/bin``, newest version) in a temporary folder, listens
on 127.0.0.1 on a free port only, and asks for a password over TCP (scram), so
the tests go through the same credential path as production. PostgreSQL
refuses to run as root: as root the cluster runs as the ``postgres`` user when
it exists, else as ``nobody``, owning the temporary folder.

Fixtures in several conftest files share one cluster through
:func:`acquire_cluster`/:func:`release_cluster`; an ``atexit`` hook stops it
should a session end without the fixtures' teardown. When the binaries are
missing this fails with the Debian package names, never skips.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import asyncpg

from tests.support.ports import free_port

SUPERUSER = "toko"
DEBIAN_PACKAGES = "postgresql postgresql-client"


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server could be started; the message says what to install."""


def server_bindir() -> Path:
    """The newest ``/usr/lib/postgresql/<version>/bin`` that has initdb and pg_ctl."""
    candidates = sorted(
        (Path(p) for p in glob.glob("/usr/lib/postgresql/*/bin")),
        key=lambda p: _version_key(p.parent.name),
    )
    for bindir in reversed(candidates):
        if (bindir / "initdb").exists() and (bindir / "pg_ctl").exists():
            return bindir
    raise PostgresUnavailable(
        "PostgreSQL server binaries (initdb, pg_ctl) not found under /usr/lib/postgresql/*/bin; "
        f"install the Debian packages: apt-get install {DEBIAN_PACKAGES} (make test does this)"
    )


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(part) for part in name.split(".") if part.isdigit())


def _run_as() -> pwd.struct_passwd | None:
    """The unprivileged account to run the server as, or None to run as ourselves."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise PostgresUnavailable("running as root, and neither a postgres nor a nobody user exists")


class PostgresCluster:
    """``tls=(certificate chain PEM, private key PEM)`` also serves TLS (``ssl=on``)."""

    def __init__(self, tls: tuple[bytes, bytes] | None = None) -> None:
        self._tls = tls
        self.bindir = server_bindir()
        self.folder = Path(tempfile.mkdtemp(prefix="toko-pg-"))
        self.datadir = self.folder / "data"
        self.logfile = self.folder / "server.log"
        self.port = free_port()
        self.host = "127.0.0.1"
        self.user = SUPERUSER
        self.password = secrets.token_hex(12)
        self.password_file = self.folder / "db-password"
        self._account = _run_as()
        self._started = False

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> PostgresCluster:
        self.password_file.write_text(self.password + "\n")
        os.chmod(self.password_file, 0o600)
        pwfile = self.folder / "initdb-pw"
        pwfile.write_text(self.password + "\n")
        if self._account is not None:
            # The server's account owns the folder; the password file for
            # initdb must be readable by it too (it is deleted right after).
            for path in (self.folder, pwfile):
                os.chown(path, self._account.pw_uid, self._account.pw_gid)
        try:
            self._pg(
                "initdb",
                "--pgdata",
                str(self.datadir),
                "--username",
                self.user,
                f"--pwfile={pwfile}",
                "--auth-local=trust",
                "--auth-host=scram-sha-256",
                "--encoding=UTF8",
                "--locale=C.UTF-8",
                "--no-instructions",
            )
        finally:
            pwfile.unlink(missing_ok=True)
        options = " ".join(
            [
                *self._tls_options(),
                f"-c port={self.port}",
                f"-c listen_addresses={self.host}",
                f"-c unix_socket_directories={self.folder}",
                "-c max_connections=200",
                "-c shared_buffers=64MB",
                # Durability stays on: the tests measure what production does.
                "-c fsync=on",
                "-c synchronous_commit=on",
            ]
        )
        self._pg(
            "pg_ctl",
            "start",
            "--wait",
            "--timeout=60",
            "--pgdata",
            str(self.datadir),
            "--log",
            str(self.logfile),
            "-o",
            options,
        )
        self._started = True
        return self

    def _tls_options(self) -> list[str]:
        if self._tls is None:
            return []
        chain, key = self._tls
        cert_file, key_file = self.folder / "server.crt", self.folder / "server.key"
        cert_file.write_bytes(chain)
        key_file.write_bytes(key)
        key_file.chmod(0o600)  # the server refuses a key others can read
        if self._account is not None:
            for path in (cert_file, key_file):
                os.chown(path, self._account.pw_uid, self._account.pw_gid)
        return ["-c ssl=on", f"-c ssl_cert_file={cert_file}", f"-c ssl_key_file={key_file}"]

    def stop(self) -> None:
        """Stop the server (immediate: nothing here needs a clean shutdown) and remove it."""
        if self._started:
            self._started = False
            with contextlib.suppress(subprocess.CalledProcessError, OSError):
                self._pg(
                    "pg_ctl", "stop", "--wait", "--pgdata", str(self.datadir), "-m", "immediate"
                )
        shutil.rmtree(self.folder, ignore_errors=True)

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """The server stopped dead (SIGSTOP), as a host that went silent: connections
        stay open, and every query and new connection waits without an answer."""
        postmaster = int((self.datadir / "postmaster.pid").read_text().split()[0])
        processes = [postmaster, *_children(postmaster)]
        for pid in processes:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in processes:
                os.kill(pid, signal.SIGCONT)

    def _pg(self, tool: str, *args: str) -> None:
        command = [str(self.bindir / tool), *args]
        if self._account is not None:
            command = ["runuser", "-u", self._account.pw_name, "--", *command]
        result = subprocess.run(
            command,
            cwd=self.folder,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if result.returncode != 0:
            log = self.logfile.read_text() if self.logfile.exists() else ""
            raise PostgresUnavailable(
                f"{tool} {' '.join(args[:2])} failed ({result.returncode}):\n"
                f"{result.stdout}{result.stderr}{log[-3000:]}"
            )

    # -- databases ---------------------------------------------------------

    def url(self, database: str = "postgres", *, with_password: bool = False) -> str:
        auth = f"{self.user}:{self.password}" if with_password else self.user
        return f"postgresql://{auth}@{self.host}:{self.port}/{database}"

    async def connect(self, database: str = "postgres") -> asyncpg.Connection:
        conn: asyncpg.Connection = await asyncpg.connect(
            host=self.host,
            port=self.port,
            user=self.user,
            password=self.password,
            database=database,
        )
        return conn

    async def async_create_database(self, prefix: str = "t") -> str:
        """A new empty database; returns its URL (password not in it)."""
        name = f"{prefix}_{secrets.token_hex(4)}"
        conn = await self.connect()
        try:
            await conn.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
        finally:
            await conn.close()
        return self.url(name)

    def create_database(self, prefix: str = "t") -> str:
        return _run_sync(self.async_create_database(prefix))

    async def async_drop_database(self, url: str) -> None:
        name = url.rsplit("/", 1)[1]
        conn = await self.connect()
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # "pid (comm) state ppid ...": comm may hold spaces, so split after it.
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.append(int(stat.parent.name))
    return found


async def fetch(cluster: PostgresCluster, url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """Rows of ``sql`` in the database at ``url``, as tuples."""
    conn = await cluster.connect(url.rsplit("/", 1)[1])
    try:
        return [tuple(row) for row in await conn.fetch(sql, *args)]
    finally:
        await conn.close()


def fetch_sync(cluster: PostgresCluster, url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    return _run_sync(fetch(cluster, url, sql, *args))


def _run_sync(coro: Any) -> Any:
    """Run a coroutine to completion from sync code, even inside a running loop."""
    import asyncio

    result: list[Any] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(coro))
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


# -- one cluster per test process, shared by every conftest ---------------------

_lock = threading.Lock()
_cluster: PostgresCluster | None = None
_users = 0
_failure: str | None = None


def acquire_cluster() -> PostgresCluster:
    """The shared cluster, started at the first call; pair with release_cluster()."""
    global _cluster, _users, _failure
    with _lock:
        if _failure is not None:
            raise PostgresUnavailable(_failure)
        if _cluster is None:
            cluster = PostgresCluster()
            try:
                cluster.start()
            except BaseException as exc:
                cluster.stop()
                _failure = f"cannot start a throwaway PostgreSQL cluster: {exc}"
                raise PostgresUnavailable(_failure) from exc
            _cluster = cluster
            atexit.register(_stop_shared)
        _users += 1
        return _cluster


def release_cluster() -> None:
    global _users
    with _lock:
        _users -= 1
        if _users > 0:
            return
    _stop_shared()


def _stop_shared() -> None:
    global _cluster
    with _lock:
        cluster, _cluster = _cluster, None
    if cluster is not None:
        cluster.stop()


def tool_env(cluster: PostgresCluster, extra: Sequence[tuple[str, str]] = ()) -> dict[str, str]:
    """Environment for a toko process on this cluster (password from a file, as systemd would)."""
    env = {"TOKO_DATABASE_PASSWORD_FILE": str(cluster.password_file)}
    env.update(dict(extra))
    return env


def pg_env(cluster: PostgresCluster, url: str, **extra: str) -> dict[str, str]:
    """What a toko process needs to use ``url``: the password comes from a file,
    the way the systemd credential delivers it."""
    return {"TOKO_DATABASE": url, **tool_env(cluster), **extra}
