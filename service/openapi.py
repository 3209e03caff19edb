"""The OpenAPI 3 document of the HTTP API, shipped as package data (openapi.json).

It is the contract schemathesis tests the live service against, so it lives
beside the code and is served unchanged at ``GET /openapi.json``.
"""

from __future__ import annotations

import functools
from importlib import resources


@functools.cache
def openapi_document() -> bytes:
    return resources.files("service").joinpath("openapi.json").read_bytes()
