"""What the crash loops share: the POSTs clients make, and the SMTP server's moods.

tests/integration/test_crash_loop.py (SQLite, one toko-api) and
tests/integration/test_crash_loop_two_hosts.py (two on one database) draw their plans
from these.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from service.mail_message import message_id
from tests.support.http import build_request
from tests.support.service import ServiceProcess
from tests.support.smtp import SmtpServer

MAIL_FROM = "toko@toko.test"
# Products whose name holds this are refused for good (550) by the SMTP server.
REFUSED = "TOLAK"


@dataclass(frozen=True)
class Post:
    """One POST a client makes. ``hang_up``: "" (waits for the answer),
    "after" (sends it whole, then closes unread) or "during" (closes
    halfway through the body: must store nothing)."""

    nama: str
    harga: int
    key: str | None = None
    hang_up: str = ""


T = TypeVar("T")
SmtpStep = tuple[float, str, float]  # (pause before, action, argument)


def draw_clients(rng: random.Random, label: str, draw: Callable[[str], T]) -> list[list[T]]:
    """3-5 clients of 3-9 requests each, ``draw`` making each from its name."""
    return [
        [draw(f"{label} k{k} n{n}") for n in range(rng.randint(3, 9))]
        for k in range(rng.randint(3, 5))
    ]


def draw_smtp_steps(rng: random.Random) -> list[SmtpStep]:
    """1-6 switches of the SMTP server's mood (see behave), each after a pause."""
    return [
        (
            rng.uniform(0.05, 0.4),
            rng.choice(("fast", "slow", "slow", "defer", "drop")),
            rng.uniform(0.1, 0.6),
        )
        for _ in range(rng.randint(1, 6))
    ]


@dataclass
class Answer:
    post: Post
    status: int | None  # None: no answer (the process died, or we hung up)
    body: Any = None
    replayed: bool = False


def behave(smtp: SmtpServer, action: str, argument: float) -> int:
    """Switch the SMTP server; the connections it dropped."""
    if action == "drop":
        return smtp.drop_connections()
    smtp.reset()
    smtp.refuse_subject(REFUSED)
    if action == "slow":
        smtp.set_delay(argument)
    elif action == "defer":
        smtp.fail_next(1 + int(argument * 5))
    return 0


async def send(session: aiohttp.ClientSession, svc: ServiceProcess, post: Post) -> Answer:
    headers = {"Idempotency-Key": post.key} if post.key else {}
    try:
        async with session.post(
            svc.url("/produk"), json={"nama": post.nama, "harga": post.harga}, headers=headers
        ) as resp:
            body = await resp.json()
            replayed = resp.headers.get("Idempotent-Replayed") == "true"
            return Answer(post, resp.status, body, replayed)
    except (aiohttp.ClientConnectionError, aiohttp.ContentTypeError):
        return Answer(post, None)


async def hang_up(svc: ServiceProcess, post: Post) -> None:
    """Send the request (or half of its body), then close without reading."""
    body = json.dumps({"nama": post.nama, "harga": post.harga}).encode()
    headers = {"Content-Type": "application/json"}
    if post.key:
        headers["Idempotency-Key"] = post.key
    data = build_request("POST", "/produk", headers=headers, body=body)
    if post.hang_up == "during":
        data = data[: len(data) - len(body) // 2]
    with contextlib.suppress(OSError):
        _, writer = await asyncio.open_connection("127.0.0.1", svc.port)
        writer.write(data)
        with contextlib.suppress(OSError):
            await writer.drain()
        writer.transport.abort()


# -- the checks ----------------------------------------------------------------
Row = dict[str, Any]


def check_store_and_emails(
    answers: list[Answer], products: dict[int, Row], jobs: list[Row], smtp: SmtpServer
) -> tuple[dict[int, Row], Counter[str]]:
    """Every answer a client got against the store and the SMTP server; each
    product's email job, and how often each Message-ID was delivered."""
    answered = [a for a in answers if a.status is not None]
    created = [a for a in answered if a.status == 201]

    # Every 201 names a product that exists, as it was sent.
    for a in created:
        product = products.get(a.body["id"])
        assert product is not None, f"201 for a product that is not stored: {a}"
        assert (product["nama"], product["harga"]) == (a.post.nama.strip(), a.post.harga), a
        assert product["idempotency_key"] == a.post.key, a
    for a in answered:
        if a.status == 422:  # its key names another product
            owner = [p for p in products.values() if p["idempotency_key"] == a.post.key]
            assert len(owner) == 1 and owner[0]["nama"] != a.post.nama, a

    # An Idempotency-Key names one product, in every answer and in the store.
    ids_by_key: dict[str, set[int]] = defaultdict(set)
    for a in created:
        if a.post.key is not None:
            ids_by_key[a.post.key].add(a.body["id"])
    for key, ids in ids_by_key.items():
        assert len(ids) == 1, f"key {key} answered with products {ids}"
    keys = Counter(p["idempotency_key"] for p in products.values() if p["idempotency_key"])
    assert all(n == 1 for n in keys.values()), keys

    # Nothing stored that no client sent; a body cut short stores nothing.
    sent = {a.post.nama for a in answers if a.post.hang_up != "during"}
    for p in products.values():
        assert p["nama"] in sent, f"stored but never sent whole: {p}"

    # Every product (answered or not) has exactly one email job; no job without one.
    jobs_by_product: dict[int, list[Row]] = defaultdict(list)
    for j in jobs:
        jobs_by_product[json.loads(j["payload"])["product_id"]].append(j)
    assert set(jobs_by_product) == set(products), "jobs and products differ"
    assert all(len(js) == 1 for js in jobs_by_product.values()), jobs_by_product
    job_by_product = {product_id: js[0] for product_id, js in jobs_by_product.items()}

    # Every job ended (none left running): done, or failed where the SMTP
    # server refused it for good. (Its last error need not be the 550: its
    # last attempt may have met a dropped connection, or a kill in the one
    # more try after its last.)
    for product_id, job in job_by_product.items():
        refused = REFUSED in products[product_id]["nama"]
        assert job["state"] == ("failed" if refused else "done"), (products[product_id], job)

    # Every email arrived, always under its job's Message-ID.
    attempts_by_job: dict[int, set[str]] = defaultdict(set)
    for m in smtp.messages():
        attempts_by_job[int(m.headers["X-Toko-Job-Id"])].add(m.message_id)
    delivered = Counter(m.message_id for m in smtp.delivered())
    for product_id, job in job_by_product.items():
        expected_id = message_id(job["id"], job["created_at"], MAIL_FROM)
        assert attempts_by_job.get(job["id"], set()) <= {expected_id}, job
        if job["state"] == "done":
            assert delivered[expected_id] >= 1, f"no email for {products[product_id]}"
        else:
            assert delivered[expected_id] == 0, job
    return job_by_product, delivered


def check_logs(
    services: Iterable[ServiceProcess],
    products: dict[int, Row],
    job_by_product: dict[int, Row],
    also_explained: Callable[[Row], bool] = lambda record: False,
) -> None:
    """No traceback anywhere, and an ERROR only where a fault explains it: a
    refused email's retries (a 5xx is an error from its first attempt) and
    dead letter, or what ``also_explained`` allows."""
    refused_jobs = {
        str(job["id"]) for pid, job in job_by_product.items() if REFUSED in products[pid]["nama"]
    }
    for svc in services:
        assert "Traceback" not in svc.stderr_text(), svc.output_tail()
        for r in svc.logs.snapshot():
            assert "exception" not in r and "Traceback" not in r.get("_raw", ""), r
            if r.get("level") not in ("ERROR", "CRITICAL"):
                continue
            refusal = r.get("message") in ("job failed, will retry", "job failed permanently")
            refused = refusal and str(r.get("JOB_ID")) in refused_jobs
            assert refused or also_explained(r), f"an ERROR no fault explains: {r}"
