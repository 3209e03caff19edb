"""PostgreSQL over TLS with the server's certificate checked, as the README
says: ``?sslmode=verify-full&sslrootcert=<CA bundle>`` in TOKO_DATABASE.
toko-api (asyncpg) and toko-backup (pg_dump) both take it from the URL."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trustme

from jobs.backup_files import LOCK_NAME
from service.models import Product
from service.store.base import StoreError
from service.store.postgres import PostgresStore
from service.tasks import product_email_job
from tests.support.postgres import PostgresCluster, fetch, pg_env
from tests.support.tools import run_tool

# A cluster of its own, not pg_cluster: marked here, not by the fixture.
pytestmark = pytest.mark.postgres


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def tls_cluster(ca: trustme.CA) -> Iterator[PostgresCluster]:
    """A cluster of its own that serves TLS with a certificate from ``ca``."""
    leaf = ca.issue_cert("127.0.0.1")
    chain = b"".join(blob.bytes() for blob in leaf.cert_chain_pems)
    cluster = PostgresCluster(tls=(chain, leaf.private_key_pem.bytes())).start()
    yield cluster
    cluster.stop()


@pytest.fixture
async def db_url(tls_cluster: PostgresCluster) -> AsyncIterator[str]:
    url = await tls_cluster.async_create_database()
    yield url
    await tls_cluster.async_drop_database(url)


def pem_file(ca: trustme.CA, path: Path) -> Path:
    ca.cert_pem.write_to_path(str(path))
    return path


def _job(product: Product) -> object:
    return product_email_job(product, 3)


async def test_verify_full_with_the_ca_named_goes_over_tls(
    tls_cluster: PostgresCluster, db_url: str, ca: trustme.CA, tmp_path: Path
) -> None:
    checked = f"{db_url}?sslmode=verify-full&sslrootcert={pem_file(ca, tmp_path / 'ca.pem')}"
    store = PostgresStore(checked, password=tls_cluster.password)
    await store.open()
    try:
        await store.create_product("Lewat TLS", 1, _job)
        sessions = await fetch(
            tls_cluster,
            db_url,
            "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)"
            " WHERE a.application_name = 'toko-api'",
        )
    finally:
        await store.close()
    assert sessions and all(ssl for (ssl,) in sessions), sessions

    # pg_dump (libpq) reads the same URL; HOME holds no ~/.postgresql/root.crt.
    backups = tmp_path / "backups"
    env = pg_env(tls_cluster, checked, TOKO_BACKUP_DIR=str(backups))
    result = run_tool("toko-backup", tmp_path / "run", env)
    assert result.returncode == 0, result.stderr
    assert len([path for path in backups.iterdir() if path.name != LOCK_NAME]) == 1


async def test_a_server_certificate_from_another_ca_is_refused_at_once(
    tls_cluster: PostgresCluster,
    db_url: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    stranger = pem_file(trustme.CA(), tmp_path / "other-ca.pem")
    store = PostgresStore(
        f"{db_url}?sslmode=verify-full&sslrootcert={stranger}", password=tls_cluster.password
    )
    with caplog.at_level(logging.WARNING), pytest.raises(StoreError) as refused:
        await store.open()
    assert "CERTIFICATE_VERIFY_FAILED" in str(refused.value)
    # Waiting cannot fix a certificate: no "not reachable yet" retries first.
    assert not [r for r in caplog.records if "retrying" in r.getMessage()], caplog.text


async def test_verify_full_without_a_ca_names_the_file_it_missed(
    tls_cluster: PostgresCluster,
    db_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What the README used to say: verify-full alone. asyncpg, like libpq,
    # then wants ~/.postgresql/root.crt; it does not read the system's CAs.
    monkeypatch.setenv("HOME", str(tmp_path))
    store = PostgresStore(f"{db_url}?sslmode=verify-full", password=tls_cluster.password)
    with pytest.raises(StoreError) as refused:
        await store.open()
    message = str(refused.value)
    assert f"{tmp_path}/.postgresql/root.crt" in message and "\n" not in message, message
