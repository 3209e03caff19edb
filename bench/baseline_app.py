"""The in-memory baseline for the throughput scenario.

The same request work as toko-api's ``POST /produk`` (Content-Type check, a
64 KiB body limit, strict UTF-8 JSON decoding, the field validation of the
design's contract, a 201 with the stored product as JSON), but the "store" is
a list: no SQLite, no job row, no fsync. toko-api's throughput over this is
what durability and the queue cost.

Run: ``python -m bench.baseline_app --listen 127.0.0.1:8099``
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

MAX_BODY = 64 * 1024
MAX_HARGA = 10**12
FIELDS = {"nama", "harga"}

PRODUCTS: web.AppKey[list[dict[str, Any]]] = web.AppKey("products", list)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def validate(body: Any) -> tuple[str, int]:
    """Return ``(nama, harga)`` or raise ValueError with a client-facing message."""
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    unknown = set(body) - FIELDS
    if unknown:
        raise ValueError(f"unknown fields: {', '.join(sorted(unknown))}")
    nama = body.get("nama")
    harga = body.get("harga")
    if not isinstance(nama, str):
        raise ValueError("nama must be a string")
    nama = nama.strip()
    if not 1 <= len(nama) <= 200:
        raise ValueError("nama must be 1-200 characters")
    if isinstance(harga, bool) or not isinstance(harga, int):
        raise ValueError("harga must be an integer")
    if not 0 <= harga <= MAX_HARGA:
        raise ValueError("harga must be from 0 to 10^12")
    return nama, harga


async def create_produk(request: web.Request) -> web.Response:
    if request.content_type != "application/json":
        return _error(415, "Content-Type must be application/json")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return _error(413, "body too large")
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return _error(400, "body is not valid JSON")
    try:
        nama, harga = validate(body)
    except ValueError as exc:
        return _error(400, str(exc))
    products = request.app[PRODUCTS]
    created = datetime.fromtimestamp(time.time(), UTC).isoformat().replace("+00:00", "Z")
    product = {"id": len(products) + 1, "nama": nama, "harga": harga, "created_at": created}
    products.append(product)
    return web.json_response(product, status=201)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "products": len(request.app[PRODUCTS])})


def create_app() -> web.Application:
    app = web.Application(client_max_size=MAX_BODY)
    app[PRODUCTS] = []
    app.router.add_post("/produk", create_produk)
    app.router.add_get("/healthz", healthz)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="127.0.0.1:8099", help="host:port")
    args = parser.parse_args()
    host, _, port = args.listen.rpartition(":")
    # No access log: toko-api's figure is compared with the cheapest handler.
    web.run_app(create_app(), host=host, port=int(port), access_log=None, print=None)


if __name__ == "__main__":
    main()
