"""Peer stack of bench (h): FastAPI on uvicorn, the product in PostgreSQL and its
email job deferred with procrastinate in the same transaction.

Written as the projects' documentation shows for production:

- web: ``uvicorn bench.peer_fastapi:api --workers N`` (``uvicorn[standard]``:
  uvloop, httptools), a psycopg ``AsyncConnectionPool`` opened in FastAPI's
  lifespan and handed to procrastinate (``App.open_async(pool)``), so the job
  row is written on the request's connection, inside its transaction
  (``Task.configure(connection=conn)``, procrastinate's transactional defer);
- jobs: ``procrastinate --app bench.peer_fastapi.jobs worker``, a process of
  its own, sending each email through SMTP (bench.peer_mail).

Environment: ``PEER_DATABASE_URL`` (``postgresql://user@host:port/db``),
``PEER_DATABASE_PASSWORD_FILE``, ``PEER_POOL_SIZE`` (the web pool, per
uvicorn worker), ``PEER_WORKER_POOL_SIZE`` (the job worker's), ``PEER_SMTP_URL``.
``python -m bench.peer_fastapi setup`` creates the tables (procrastinate's
schema and ``produk``) in an empty database.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, Request
from procrastinate import App, PsycopgConnector
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from bench.peer_mail import send_product_email

PRODUK_TABLE = """
CREATE TABLE produk (
    id bigserial PRIMARY KEY,
    nama text NOT NULL,
    harga bigint NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)
"""


def _conninfo() -> tuple[str, str]:
    password = Path(os.environ["PEER_DATABASE_PASSWORD_FILE"]).read_text().strip()
    return os.environ["PEER_DATABASE_URL"], password


def _connector() -> PsycopgConnector:
    url, password = _conninfo()
    size = int(os.environ.get("PEER_WORKER_POOL_SIZE", "4"))
    return PsycopgConnector(
        conninfo=url, kwargs={"password": password}, min_size=size, max_size=size
    )


jobs = App(connector=_connector())


@jobs.task(name="send_product_email")
async def email_job(product_id: int, nama: str, harga: int) -> None:
    await send_product_email(product_id, nama, harga, "fastapi")


class NewProduct(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)
    nama: Annotated[str, Field(min_length=1, max_length=200)]
    harga: Annotated[StrictInt, Field(ge=0, le=10**12)]


class Product(BaseModel):
    id: int
    nama: str
    harga: int


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    url, password = _conninfo()
    size = int(os.environ.get("PEER_POOL_SIZE", "8"))
    async with AsyncConnectionPool(
        url, kwargs={"password": password}, min_size=size, max_size=size, open=False
    ) as pool:
        await pool.wait()
        await jobs.open_async(pool)
        app.state.pool = pool
        yield
        await jobs.close_async()


api = FastAPI(lifespan=lifespan)


@api.post("/produk", status_code=201)
async def create_product(new: NewProduct, request: Request) -> Product:
    pool: AsyncConnectionPool = request.app.state.pool
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO produk (nama, harga) VALUES (%s, %s) RETURNING id", (new.nama, new.harga)
        )
        row = await cur.fetchone()
        assert row is not None
        await email_job.configure(connection=conn).defer_async(
            product_id=row[0], nama=new.nama, harga=new.harga
        )
    return Product(id=row[0], nama=new.nama, harga=new.harga)


@api.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


async def setup() -> None:
    """procrastinate's schema and the product table, in an empty database."""
    async with jobs.open_async():
        await jobs.schema_manager.apply_schema_async()
        await jobs.connector.execute_query_async(PRODUK_TABLE)


if __name__ == "__main__":
    if sys.argv[1:] != ["setup"]:
        sys.exit("usage: python -m bench.peer_fastapi setup")
    asyncio.run(setup())
