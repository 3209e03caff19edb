"""Shared fixtures: a real SMTP server, a factory of real toko-api processes,
the store on each backend, and PostgreSQL.

Tests are folded by scope (unit, integration, operability, system); the
backend is a fixture parameter. Every test that reaches PostgreSQL (through
``pg_cluster``, or the ``postgres`` side of ``backend``) gets the ``postgres``
marker, so ``-m "not postgres"`` runs without a PostgreSQL server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from service.store.roles import Store
from service.store.sqlite import SqliteStore
from tests.support.backends import Backend, FakeClock, PostgresBackend, SqliteBackend
from tests.support.postgres import PostgresCluster, acquire_cluster, release_cluster
from tests.support.service import ServiceProcess
from tests.support.smtp import SmtpServer

ServiceFactory = Callable[..., ServiceProcess]


@pytest.fixture
def smtp() -> Iterator[SmtpServer]:
    with SmtpServer() as server:
        yield server


@pytest.fixture
def service_factory(tmp_path: Path) -> Iterator[ServiceFactory]:
    """``make(env=None, **ServiceProcess kwargs)`` -> an unstarted ServiceProcess.

    Every process made here shares ``tmp_path / "toko.db"`` unless told otherwise
    (so a restart sees the same store), and is killed and reaped at teardown,
    with its output printed (pytest shows it when the test failed).
    """
    made: list[ServiceProcess] = []

    def make(env: dict[str, str | None] | None = None, **kwargs: Any) -> ServiceProcess:
        kwargs.setdefault("database", tmp_path / "toko.db")
        svc = ServiceProcess(tmp_path / f"svc{len(made)}", env, **kwargs)
        made.append(svc)
        return svc

    yield make
    for svc in made:
        svc.close()
        if svc.proc is not None:
            print(svc.output_tail(60))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        params = getattr(item, "callspec", None)
        on_postgres = params is not None and params.params.get("backend") == "postgres"
        if on_postgres or "pg_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.postgres)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PostgresCluster]:
    cluster = acquire_cluster()
    yield cluster
    release_cluster()


@pytest.fixture
async def pg_url(pg_cluster: PostgresCluster) -> AsyncIterator[str]:
    """A new empty database (URL without password; the password is in a file)."""
    url = await pg_cluster.async_create_database()
    yield url
    await pg_cluster.async_drop_database(url)


@pytest.fixture(params=["sqlite", "postgres"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    if request.param == "sqlite":
        yield SqliteBackend(tmp_path)
        return
    # Looked up here, so a run of SQLite tests alone never starts PostgreSQL.
    cluster: PostgresCluster = request.getfixturevalue("pg_cluster")
    url = await cluster.async_create_database()
    yield PostgresBackend(cluster, url)
    await cluster.async_drop_database(url)


@pytest.fixture
async def store(backend: Backend, clock: FakeClock) -> AsyncIterator[Store]:
    s = backend.make_store(clock)
    await s.open()
    yield s
    await s.close()


@pytest.fixture
async def sqlite_store(tmp_path: Path, clock: FakeClock) -> AsyncIterator[SqliteStore]:
    s = SqliteStore(str(tmp_path / "toko.db"), clock=clock)
    await s.open()
    yield s
    await s.close()
