"""PostgreSQL fixtures: the shared throwaway cluster, a fresh database per test,
and the toko timer jobs as real subprocesses pointed at it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path

import pytest

from tests.support.postgres import PostgresCluster, acquire_cluster, release_cluster
from tests.support.service import clean_environment

BIN = Path(sys.executable).parent


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


def pg_env(cluster: PostgresCluster, url: str, **extra: str) -> dict[str, str]:
    """What a toko process needs to use ``url``: the password comes from a file,
    the way the systemd credential delivers it."""
    return {
        "TOKO_DATABASE": url,
        "TOKO_DATABASE_PASSWORD_FILE": str(cluster.password_file),
        **extra,
    }


def tool_command(name: str, *args: str) -> list[str]:
    return [str(BIN / name), *args]


def clean_env(workdir: Path, env: Mapping[str, str]) -> dict[str, str]:
    """The clean environment ServiceProcess also gives toko-api."""
    return clean_environment(HOME=str(workdir), **env)


def run_tool(
    name: str, workdir: Path, env: Mapping[str, str], *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run toko-recap / toko-backup to completion; its exit code, stdout and stderr."""
    workdir.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        tool_command(name, *args),
        env=clean_env(workdir, env),
        cwd=workdir,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
