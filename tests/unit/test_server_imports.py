"""The server's libraries imported without their unused parts (service.server_imports)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trustme

from service.server_imports import IMPORT_ENVIRONMENT, import_environment


def test_the_environment_is_as_it_was_afterwards(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", "/etc/toko/relay-ca.pem")
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    monkeypatch.delenv("FROZENLIST_NO_EXTENSIONS", raising=False)
    before = dict(os.environ)
    with import_environment():
        for name, value in IMPORT_ENVIRONMENT.items():
            assert os.environ[name] == value
    assert dict(os.environ) == before


def test_the_environment_is_restored_when_an_import_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    with pytest.raises(ImportError), import_environment():
        import service.no_such_module  # type: ignore[import-not-found]  # noqa: F401
    assert "SSL_CERT_FILE" not in os.environ


# In a fresh interpreter, as toko-api imports them: aiohttp's client contexts
# hold no certificates, frozenlist is the pure-Python one, and a TLS context
# made afterwards (as the SMTP client's is) trusts what the admin set.
PROBE = """
import json, ssl
from service.server_imports import import_environment
with import_environment():
    import aiohttp.web
import aiohttp.connector, frozenlist
print(json.dumps({
    "aiohttp_cas": aiohttp.connector._SSL_CONTEXT_VERIFIED.cert_store_stats()["x509_ca"],
    "pure_frozenlist": frozenlist.FrozenList is frozenlist.PyFrozenList,
    "later_cas": ssl.create_default_context().cert_store_stats()["x509_ca"],
}))
"""


def test_aiohttp_loads_no_certificates_and_later_contexts_trust_the_admins(
    tmp_path: Path,
) -> None:
    bundle = tmp_path / "relay-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(bundle))
    env = {
        "PATH": os.environ["PATH"],
        "SSL_CERT_FILE": str(bundle),
        "SSL_CERT_DIR": str(tmp_path / "no-other-cas"),
    }
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out) == {"aiohttp_cas": 0, "pure_frozenlist": True, "later_cas": 1}
