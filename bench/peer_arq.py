"""Peer stack of bench (h): aiohttp, the product in SQLite, its email job enqueued to arq.

Not atomic: the product is committed first and the job enqueued to Redis
afterwards, so a crash between the two leaves a product that is never
emailed (and a Redis without fsync on every write can lose acknowledged
jobs). Written as the projects' documentation shows:

- web: one aiohttp process (``web.run_app``; SQLite has one writer anyway),
  the database and the arq pool as ``cleanup_ctx`` resources; SQLite through
  aiosqlite in WAL mode with ``synchronous=FULL`` (each INSERT commits on its
  own, durable when the 201 goes out, as toko's commit is);
- jobs: ``arq bench.peer_arq.WorkerSettings``, a process of its own, sending
  each email through SMTP (bench.peer_mail).

Environment: ``PEER_LISTEN_PORT``, ``PEER_SQLITE``, ``PEER_REDIS_PORT``,
``PEER_MAX_JOBS`` (the worker's concurrency), ``PEER_SMTP_URL``.
``python -m bench.peer_arq`` runs the web server.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import aiosqlite
from aiohttp import web
from arq import create_pool
from arq.connections import ArqRedis, RedisSettings

from bench.peer_mail import send_product_email

DB = web.AppKey("db", aiosqlite.Connection)
REDIS = web.AppKey("redis", ArqRedis)
MAX_HARGA = 10**12

# arq's CLI logs two INFO lines per job by default; every stack here logs warnings only.
LOG_WARNING: dict[str, Any] = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"level": "WARNING", "class": "logging.StreamHandler"}},
    "loggers": {"arq": {"handlers": ["stderr"], "level": "WARNING"}},
}


def _redis() -> RedisSettings:
    return RedisSettings(host="127.0.0.1", port=int(os.environ["PEER_REDIS_PORT"]))


async def send_email(ctx: dict[str, Any], product_id: int, nama: str, harga: int) -> None:
    await send_product_email(product_id, nama, harga, "aiohttp-arq")


class WorkerSettings:
    functions: ClassVar = [send_email]
    redis_settings = _redis()
    max_jobs = int(os.environ.get("PEER_MAX_JOBS", "10"))


def invalid(body: object) -> str | None:
    """Why ``body`` is not a new product (toko's rules), or None."""
    if not isinstance(body, dict) or set(body) != {"nama", "harga"}:
        return "expected exactly the fields nama and harga"
    nama, harga = body["nama"], body["harga"]
    if not isinstance(nama, str) or not 1 <= len(nama.strip()) <= 200:
        return "nama must be 1-200 characters"
    if type(harga) is not int or not 0 <= harga <= MAX_HARGA:
        return "harga must be an integer from 0 to 10^12"
    return None


async def create_product(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except ValueError:
        return web.json_response({"error": "body is not JSON"}, status=400)
    if error := invalid(body):
        return web.json_response({"error": error}, status=400)
    nama, harga = body["nama"].strip(), body["harga"]
    async with request.app[DB].execute(
        "INSERT INTO produk (nama, harga) VALUES (?, ?) RETURNING id", (nama, harga)
    ) as cur:
        row = await cur.fetchone()
    assert row is not None
    await request.app[REDIS].enqueue_job("send_email", row[0], nama, harga)
    return web.json_response({"id": row[0], "nama": nama, "harga": harga}, status=201)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def database(app: web.Application) -> AsyncIterator[None]:
    # isolation_level=None: each statement commits on its own.
    async with aiosqlite.connect(os.environ["PEER_SQLITE"], isolation_level=None) as db:
        await db.execute("PRAGMA journal_mode=WAL")
        await db.execute("PRAGMA synchronous=FULL")
        await db.execute(
            "CREATE TABLE IF NOT EXISTS produk (id INTEGER PRIMARY KEY,"
            " nama TEXT NOT NULL, harga INTEGER NOT NULL)"
        )
        app[DB] = db
        yield


async def queue(app: web.Application) -> AsyncIterator[None]:
    redis = await create_pool(_redis())
    app[REDIS] = redis
    yield
    await redis.aclose()


def create_app() -> web.Application:
    app = web.Application()
    app.cleanup_ctx.extend([database, queue])
    app.router.add_post("/produk", create_product)
    app.router.add_get("/healthz", healthz)
    return app


if __name__ == "__main__":
    web.run_app(
        create_app(),
        host="127.0.0.1",
        port=int(os.environ["PEER_LISTEN_PORT"]),
        access_log=None,
        print=None,
    )
