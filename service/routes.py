"""HTTP handlers: parse, call the domain, shape the answer. Field names follow the tutorial."""

from __future__ import annotations

import asyncio
import logging
import zlib

from aiohttp import hdrs, web

from service.errors import Refused, abandon_body, body_too_large, json_error
from service.expect import continue_if_awaited, continue_later
from service.keys import HEALTH, METRICS, POOL, SETTINGS, STORE
from service.models import Job, NewJob, Product, stored_job
from service.openapi import openapi_document
from service.store.base import StoreError
from service.tasks import PRODUCT_EMAIL, product_email_job
from service.validation import (
    ID_MAX,
    InvalidInput,
    ascii_int,
    idempotency_key,
    page_params,
    parse_json_object,
    validate_new_product,
)

log = logging.getLogger("toko.http")
routes = web.RouteTableDef()

JSON_TYPES = {"application/json"}
# What a body may be sent in (decoded_body); any other is refused, not read as
# plain bytes.
BODY_CODINGS = {"gzip", "deflate", "identity", ""}
GZIP_MAGIC = b"\x1f\x8b"
# A client that repeats a POST with the same key gets the first answer again
# (draft-ietf-httpapi-idempotency-key-header); the replay is marked as such.
IDEMPOTENCY_KEY = "Idempotency-Key"
REPLAYED = "Idempotent-Replayed"


@routes.post("/produk", expect_handler=continue_later)
async def create_product(request: web.Request) -> web.Response:
    key = idempotency_key(request.headers.getall(IDEMPOTENCY_KEY, ()))
    data = parse_json_object(await _json_body(request))
    nama, harga = validate_new_product(data)
    max_attempts = request.app[SETTINGS].jobs.max_attempts
    store = request.app[STORE]

    async def write(leased_for: float | None) -> tuple[Product, Job | None]:
        def make_job(product: Product) -> NewJob:
            return product_email_job(product, max_attempts, leased_for)

        product, job_id = await store.create_product(nama, harga, make_job, key)
        if job_id is None:
            return product, None
        # The job is stored with its product's created_at (Store.create_product),
        # which its email's Message-ID is made of on every attempt.
        return product, stored_job(job_id, make_job(product), product.created_at)

    # With a worker slot free, the job is written already claimed and handed
    # straight to the pool; otherwise it waits pending for the claimer.
    product, job_id = await request.app[POOL].enqueue_here(write)
    headers = {"Location": f"/produk/{product.id}"}
    if job_id is None:  # the key's product, stored by an earlier request
        if (product.nama, product.harga) != (nama, harga):
            message = (
                f"Idempotency-Key {key} was already used for another product (id {product.id})"
            )
            return json_error(422, message)
        log.info("repeated request answered", extra={"PRODUCT_ID": product.id})
        request.app[METRICS].replays.inc()
        headers[REPLAYED] = "true"
    else:
        request.app[METRICS].job_enqueued(PRODUCT_EMAIL)
        log.debug("product created", extra={"PRODUCT_ID": product.id, "JOB_ID": job_id})
    return web.json_response(product.to_json(), status=201, headers=headers)


async def _json_body(request: web.Request) -> bytes:
    """The body of a JSON request, decoded from gzip or deflate; Refused otherwise."""
    content_type = request.content_type
    if content_type not in JSON_TYPES and not content_type.endswith("+json"):
        # aiohttp reports application/octet-stream when no Content-Type was sent.
        sent = hdrs.CONTENT_TYPE in request.headers
        got = f"got {content_type or 'none'}" if sent else "but none was sent"
        raise Refused(
            json_error(
                415,
                f"Content-Type must be application/json, {got} "
                "(with curl: -H 'Content-Type: application/json')",
            )
        )
    # All of them: a second header (gzip, then compress) is a second coding.
    coding = ", ".join(request.headers.getall(hdrs.CONTENT_ENCODING, ())).strip().lower()
    if coding not in BODY_CODINGS:
        raise Refused(
            json_error(
                415,
                f"Content-Encoding {coding} is not supported; send the body as is, "
                "or gzip or deflate",
                headers={"Accept-Encoding": "gzip, deflate"},
            )
        )
    # A declared length over the limit is refused at once, before any of the
    # body is read: the client may be waiting for an answer before it sends it.
    # (A compressed body's limit is on what it decodes to: read it to know.)
    # The connection then closes once aiohttp has read and dropped what does
    # arrive (its lingering close, 10 s at most): closing on unread data would
    # send a reset that can reach the client before the 413 does.
    limit = request.app[SETTINGS].http.max_body_bytes
    if coding in ("", "identity") and (request.content_length or 0) > limit:
        too_large = json_error(413, body_too_large(limit))
        too_large.force_close()
        raise Refused(too_large)
    # Usually the whole body came with the headers. One still arriving gets
    # TOKO_CLIENT_TIMEOUT, so a client trickling it cannot hold a handler forever.
    if request.content.is_eof():
        return decoded_body(await request.read(), coding, limit)
    # Every check that needs no body has passed (the token's too, in its
    # middleware): only now is a client that waits for it asked to send it.
    await continue_if_awaited(request)
    timeout = request.app[SETTINGS].http.client_timeout
    try:
        async with asyncio.timeout(timeout):
            body = await request.read()
    except TimeoutError:
        message = f"the request body did not arrive within {timeout:g} s"
        raise Refused(abandon_body(request, json_error(408, message))) from None
    except ConnectionResetError:
        # The client's doing, not a fault of ours: one line, no traceback.
        log.info("client hung up before sending the whole body", extra={"PATH": request.path})
        message = "the connection closed before the body arrived"
        raise Refused(abandon_body(request, json_error(400, message))) from None
    return decoded_body(body, coding, limit)


def decoded_body(body: bytes, coding: str, limit: int) -> bytes:
    """``body`` decoded from its Content-Encoding, checked to its very end.

    aiohttp's own decoding (turned off in create_app) took a gzip body without
    its trailer, the CRC-32 and length that show it arrived whole. ``limit``
    applies to the decoded body; what arrived was at most that already
    (client_max_size), so a body that inflates a thousandfold stops there.
    """
    if coding in ("", "identity") or not body:  # an empty body is refused as such
        return body
    if coding == "gzip":
        wbits = 16 + zlib.MAX_WBITS
    elif body[:1] and body[0] & 0x0F != 8:
        # Raw deflate without the zlib header, as some clients send it (and
        # as aiohttp took it).
        wbits = -zlib.MAX_WBITS
    else:
        wbits = zlib.MAX_WBITS
    data, rest = _decoded_member(body, coding, wbits, limit)
    # gzip data may be several members one after another, each with its own
    # trailer (RFC 1952, 2.2: what `cat a.gz b.gz` makes); they decode joined.
    while coding == "gzip" and rest.startswith(GZIP_MAGIC):
        more, rest = _decoded_member(rest, coding, wbits, limit - len(data))
        data += more
    if rest:
        raise InvalidInput(f"the request body goes on after the end of the {coding} data")
    return data


def _decoded_member(body: bytes, coding: str, wbits: int, limit: int) -> tuple[bytes, bytes]:
    """The data of the compressed stream ``body`` starts with, and what follows it."""
    decoder = zlib.decompressobj(wbits)
    try:
        data = decoder.decompress(body, limit + 1)
    except zlib.error as exc:
        raise InvalidInput(f"the request body is not valid {coding}: {exc}") from None
    if len(data) > limit:
        raise Refused(json_error(413, body_too_large(limit)))
    if not decoder.eof:
        raise InvalidInput(
            f"the {coding} body is incomplete: it ends before its compressed data does"
        )
    return data, decoder.unused_data


@routes.get("/produk")
async def list_products(request: web.Request) -> web.Response:
    after, limit = page_params(request.query)
    products = await request.app[STORE].list_products(after, limit)
    headers = {}
    if len(products) == limit:
        headers["Link"] = f'</produk?after={products[-1].id}&limit={limit}>; rel="next"'
    return web.json_response([p.to_json() for p in products], headers=headers)


# ASCII digits: \d would also match other scripts' digits, which int() takes.
@routes.get(r"/produk/{id:[0-9]+}")
async def get_product(request: web.Request) -> web.Response:
    text = request.match_info["id"]
    product_id = ascii_int(text, 0, ID_MAX)
    if product_id is None:  # past 64 bits: no such row can exist
        # Not echoed whole: the path may be thousands of digits.
        shown = text if len(text) <= 30 else f"{text[:20]}... ({len(text)} digits)"
        return json_error(404, f"no product with id {shown}")
    product = await request.app[STORE].get_product(product_id)
    if product is None:
        return json_error(404, f"no product with id {product_id}")
    return web.json_response(product.to_json())


@routes.get("/healthz")
async def healthz(request: web.Request) -> web.Response:
    pool = request.app[POOL]
    health = request.app[HEALTH]
    workers = {"alive": pool.alive, "configured": pool.configured}
    try:
        counts = await health.counts()
    except StoreError as exc:
        log.error("health check: store failed: %s", exc)
        body = {"status": "unhealthy", "error": "storage is unavailable", "workers": workers}
        return web.json_response(body, status=503)
    body = {"status": "ok", "queue": counts.to_json(), "workers": workers}
    cannot_write = await health.write_error()
    if cannot_write is not None:
        body["status"] = "unhealthy"
        body["error"] = f"storage cannot write: {cannot_write}"
        return web.json_response(body, status=503)
    if not pool.healthy():
        body["status"] = "unhealthy"
        body["error"] = f"worker pool is not running ({pool.alive}/{pool.configured} workers alive)"
        return web.json_response(body, status=503)
    return web.json_response(body)


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    app_metrics = request.app[METRICS]
    pool = request.app[POOL]
    health = request.app[HEALTH]
    try:
        counts = await health.counts()
    except StoreError as exc:
        # Still answer: toko_store_up 0 is what the alert should fire on.
        log.error("metrics: store failed: %s", exc)
        app_metrics.set_queue(None)
    else:
        app_metrics.set_queue(counts)
    app_metrics.set_writable(await health.write_error() is None)
    app_metrics.set_workers(pool.alive, pool.configured)
    return app_metrics.render()


@routes.get("/openapi.json")
async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=openapi_document(), content_type="application/json")
