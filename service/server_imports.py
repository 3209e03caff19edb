"""The server's libraries imported without what toko-api never uses.

Two libraries do work at import that toko-api pays for in memory and
start-up time and never uses, and each can be told not to by a variable
it reads at that moment:

- aiohttp makes its HTTP client's two default TLS contexts when it is
  imported, each loading the system's CA certificates (about 2 MiB and
  tens of ms together). toko-api is no HTTP client: with both certificate
  variables pointing at an empty file, those contexts load nothing. The
  contexts toko makes itself (SMTP, PostgreSQL) are made later, with the
  variables as the admin set them.
- frozenlist's C++ extension links libstdc++ (about 1 MiB) for a few
  lists built once at start (aiohttp's signals and middlewares); its
  pure-Python class does the same.

The variables hold only while the server's modules are imported, so
nothing started later sees them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

IMPORT_ENVIRONMENT: Mapping[str, str] = {
    "SSL_CERT_FILE": os.devnull,
    "SSL_CERT_DIR": os.devnull,
    "FROZENLIST_NO_EXTENSIONS": "1",
}


@contextmanager
def import_environment() -> Iterator[None]:
    """``IMPORT_ENVIRONMENT`` in ``os.environ`` for the duration, then as it was."""
    saved = {name: os.environ.get(name) for name in IMPORT_ENVIRONMENT}
    os.environ.update(IMPORT_ENVIRONMENT)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
