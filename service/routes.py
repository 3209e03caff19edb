"""HTTP handlers: parse, call the domain, shape the answer. Field names follow the tutorial."""

from __future__ import annotations

import asyncio
import logging
import zlib

from aiohttp import hdrs, web

from service.errors import Refused, abandon_body, body_too_large, json_error
from service.expect import continue_if_awaited, continue_later
from service.keys import HEALTH, METRICS, POOL, SETTINGS, STORE
from service.models import (
    Job,
    NewJob,
    Product,
    ProductWriteOutcome,
    ProductWritten,
    VersionMismatch,
    stored_job,
)
from service.openapi import openapi_document
from service.store.base import StoreError
from service.tasks import PRICE_EMAIL, PRODUCT_EMAIL, price_email_job, product_email_job
from service.validation import (
    ID_MAX,
    InvalidInput,
    ascii_int,
    idempotency_key,
    if_match_versions,
    page_params,
    parse_json_object,
    validate_new_product,
    validate_product_change,
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
# ASCII digits: \d would also match other scripts' digits, which int() takes.
PRODUCT_PATH = r"/produk/{id:[0-9]+}"


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
    # A replay's product is as the first answer had it: version 1, its ETag.
    headers = {"Location": f"/produk/{product.id}", hdrs.ETAG: product.etag}
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


@routes.get(PRODUCT_PATH)
async def get_product(request: web.Request) -> web.Response:
    product_id = _product_id(request)
    product = await request.app[STORE].get_product(product_id)
    if product is None:
        return _no_such_product(product_id)
    return web.json_response(product.to_json(), headers={hdrs.ETAG: product.etag})


# Changes and deletes are conditional (RFC 9110, 13.1.1): If-Match names the
# version the client read, and the store writes only while the product is
# still at it, so one client cannot undo another's change unseen. What needs
# no lookup comes first: an id past 64 bits (404), a missing If-Match (428,
# RFC 6585) or a malformed one (400), then the body, so a refused client is
# not asked for it. Then, as RFC 9110 (13.2.1) asks, a product that does not
# exist, or was deleted, is a 404 whatever If-Match names, and only one that
# does is a 412. "If-Match: *" is honoured as RFC 9110 (13.1.1) defines it:
# whatever version the product is at, for a client that means to overwrite
# it (a cleanup script deleting products, say).


@routes.patch(PRODUCT_PATH, expect_handler=continue_later)
async def update_product(request: web.Request) -> web.Response:
    product_id = _product_id(request)
    versions = _if_match(request, product_id)
    nama, harga = validate_product_change(parse_json_object(await _json_body(request)))
    max_attempts = request.app[SETTINGS].jobs.max_attempts
    store = request.app[STORE]

    async def write(leased_for: float | None) -> tuple[ProductWriteOutcome, Job | None]:
        def make_job(before: Product, after: Product) -> NewJob | None:
            return price_email_job(before, after, max_attempts, leased_for)

        outcome = await store.update_product(product_id, nama, harga, versions, make_job)
        if not isinstance(outcome, ProductWritten) or outcome.job_id is None:
            return outcome, None
        job = make_job(outcome.before, outcome.after)
        assert job is not None  # the store enqueued it
        return outcome, stored_job(outcome.job_id, job, outcome.at)

    # A price change's email, like a new product's, goes straight to a free worker.
    outcome, job_id = await request.app[POOL].enqueue_here(write)
    if not isinstance(outcome, ProductWritten):
        return _not_written(outcome, product_id)
    product = outcome.after
    fields: dict[str, object] = {"PRODUCT_ID": product.id, "VERSION": product.version}
    if not outcome.fields:
        log.info("product change asks for the values it has; nothing written", extra=fields)
    else:
        fields["FIELDS"] = ",".join(outcome.fields)
        if job_id is not None:
            fields["JOB_ID"] = job_id
            request.app[METRICS].job_enqueued(PRICE_EMAIL)
        log.info("product changed", extra=fields)
    return web.json_response(product.to_json(), headers={hdrs.ETAG: product.etag})


@routes.delete(PRODUCT_PATH, expect_handler=continue_later)
async def delete_product(request: web.Request) -> web.Response:
    product_id = _product_id(request)
    versions = _if_match(request, product_id)
    outcome = await request.app[STORE].delete_product(product_id, versions)
    if not isinstance(outcome, ProductWritten):
        return _not_written(outcome, product_id)
    tombstone = outcome.after
    log.info("product deleted", extra={"PRODUCT_ID": tombstone.id, "VERSION": tombstone.version})
    # No body; the ETag is the version the delete gave the product.
    return web.Response(status=204, headers={hdrs.ETAG: tombstone.etag})


def _product_id(request: web.Request) -> int:
    """The route's id; Refused with a 404 past 64 bits, where no row can exist."""
    text = request.match_info["id"]
    product_id = ascii_int(text, 0, ID_MAX)
    if product_id is None:
        # Not echoed whole: the path may be thousands of digits.
        shown = text if len(text) <= 30 else f"{text[:20]}... ({len(text)} digits)"
        raise Refused(json_error(404, f"no product with id {shown}"))
    return product_id


def _no_such_product(product_id: int) -> web.Response:
    # A deleted product is gone from the API: the same answer as one never made.
    return json_error(404, f"no product with id {product_id}")


def _if_match(request: web.Request, product_id: int) -> frozenset[int] | None:
    """The versions If-Match accepts (None: any); Refused with a 428 without one."""
    values = request.headers.getall(hdrs.IF_MATCH, ())
    if not values:
        raise Refused(
            json_error(
                428,
                f"{request.method} needs If-Match with the ETag of the product as you read it"
                f" (the ETag header of GET /produk/{product_id}), so that it cannot undo"
                " a change made since",
            )
        )
    return if_match_versions(values)


def _not_written(outcome: VersionMismatch | None, product_id: int) -> web.Response:
    if outcome is None:
        return _no_such_product(product_id)
    current = outcome.current
    log.info(
        "product write refused: it is at another version than If-Match names",
        extra={"PRODUCT_ID": current.id, "VERSION": current.version},
    )
    return json_error(
        412,
        f"product {current.id} has changed since that version: it is at version"
        f" {current.version} now (ETag {current.etag}); read it again"
        f" (GET /produk/{current.id}) and send the change with that ETag",
    )


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
