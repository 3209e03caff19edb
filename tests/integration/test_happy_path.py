"""The happy path: create, read, list with pagination, and the email goes out."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from tests.conftest import ServiceFactory
from tests.support import db
from tests.support.api import create_products, next_link, wait_healthy
from tests.support.service import TOKO_API
from tests.support.smtp import SmtpServer


async def test_create_read_and_email(service_factory: ServiceFactory, smtp: SmtpServer) -> None:
    svc = service_factory(
        {
            "TOKO_SMTP_URL": smtp.url,
            "TOKO_ADMIN_EMAIL": "bos@toko.test",
            "TOKO_MAIL_FROM": "kasir@toko.test",
        }
    ).start()
    await svc.async_wait_ready(timeout=20)
    async with aiohttp.ClientSession() as session:
        async with session.post(
            svc.url("/produk"), json={"nama": "  Kopi Susu ☕  ", "harga": 15000}
        ) as resp:
            assert resp.status == 201, await resp.text()
            assert resp.content_type == "application/json"
            product = await resp.json()
        assert set(product) == {"id", "nama", "harga", "created_at"}, product
        assert isinstance(product["id"], int)
        assert product["nama"] == "Kopi Susu ☕"
        assert product["harga"] == 15000
        created = datetime.fromisoformat(product["created_at"])
        offset = created.utcoffset()
        assert offset is not None and offset.total_seconds() == 0, product["created_at"]
        assert abs((datetime.now(UTC) - created).total_seconds()) < 60

        async with session.get(svc.url(f"/produk/{product['id']}")) as resp:
            assert resp.status == 200
            assert await resp.json() == product

        (mid,) = await smtp.async_wait_delivered(1, timeout=15)
        (mail,) = smtp.delivered()
        assert "Produk baru: Kopi Susu ☕" in mail.subject
        assert mail.to == ("bos@toko.test",)
        assert "bos@toko.test" in str(mail.headers["To"])
        assert "kasir@toko.test" in str(mail.headers["From"])
        assert mid.startswith("<") and mid.endswith(">") and "@" in mid, mid

        await wait_healthy(session, svc.base_url, timeout=10, check=lambda b: b["queue"]["done"])
    (job,) = db.jobs(svc.database)
    assert job["state"] == "done"
    assert job["kind"] == "product_email"
    assert str(mail.headers["X-Toko-Job-Id"]) == str(job["id"])
    assert db.query(svc.database, "SELECT nama, harga FROM products") == [
        {"nama": "Kopi Susu ☕", "harga": 15000}
    ]
    sent = await svc.async_wait_log("email sent", timeout=5)
    assert sent  # the SMTP mailer, not the log mailer, did the job


async def test_list_pagination_with_link_header(service_factory: ServiceFactory) -> None:
    svc = service_factory().start()  # log mailer: no SMTP needed here
    await svc.async_wait_ready(timeout=20)
    async with aiohttp.ClientSession() as session:
        created = []
        for i in range(7):  # one by one: ids ascend in creation order
            created += await create_products(session, svc.base_url, [f"Barang {i}"], harga=i)
        ids = [p["id"] for p in created]
        assert ids == sorted(ids)

        seen: list[int] = []
        url: str | None = "/produk?limit=3"
        pages = 0
        while url is not None:
            async with session.get(svc.url(url)) as resp:
                assert resp.status == 200
                page = await resp.json()
                link = resp.headers.get("Link")
            pages += 1
            assert len(page) <= 3
            seen += [p["id"] for p in page]
            url = next_link(link)
            if url is not None:
                assert url.startswith("/produk?")
            assert pages <= 5, "the Link chain does not end"
        assert seen == ids
        assert pages >= 3

        async with session.get(svc.url("/produk")) as resp:
            assert resp.status == 200
            everything = await resp.json()
            assert next_link(resp.headers.get("Link")) is None
        assert everything == created

        async with session.get(svc.url(f"/produk?after={ids[4]}&limit=50")) as resp:
            assert [p["id"] for p in await resp.json()] == ids[5:]

        # Only ASCII digits make an id: Arabic-Indic and fullwidth "1" are not product 1.
        assert ids[0] == 1
        for other_one in ("%D9%A1", "%EF%BC%91"):
            async with session.get(svc.url(f"/produk/{other_one}")) as resp:
                assert resp.status == 404, other_one

    # Without TOKO_SMTP_URL the emails go to the log, one per product.
    def logged_emails(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
        found = [r for r in records if r.get("message") == "email logged"]
        return found if len(found) >= 7 else None

    logged = await svc.logs.async_wait_for(logged_emails, timeout=10, what="7 'email logged'")
    assert len(logged) == 7
    subjects = sorted(str(r.get("SUBJECT")) for r in logged)
    assert all("Produk baru: Barang " in s for s in subjects), subjects


async def test_a_compressed_body_is_read_decoded(service_factory: ServiceFactory) -> None:
    svc = service_factory().start()
    await svc.async_wait_ready(timeout=20)
    body = json.dumps({"nama": "Kopi Bubuk", "harga": 30000}).encode()
    async with aiohttp.ClientSession() as session:
        codings = [
            ("gzip", gzip.compress(body)),
            ("GZIP", gzip.compress(body)),
            ("deflate", zlib.compress(body)),
            # Raw deflate, without the zlib header: some clients send it so.
            ("deflate", zlib.compress(body)[2:-4]),
            # Two gzip members one after another, as `cat a.gz b.gz` makes.
            ("gzip", gzip.compress(body[:9]) + gzip.compress(body[9:])),
            ("identity", body),
        ]
        for coding, data in codings:
            headers = {"Content-Type": "application/json", "Content-Encoding": coding}
            async with session.post(svc.url("/produk"), data=data, headers=headers) as resp:
                assert resp.status == 201, (coding, await resp.text())
                assert (await resp.json())["nama"] == "Kopi Bubuk"
        # Any other coding is refused, saying which ones are read (RFC 9110, 15.5.16).
        headers = {"Content-Type": "application/json", "Content-Encoding": "x-gzip"}
        async with session.post(
            svc.url("/produk"), data=gzip.compress(body), headers=headers
        ) as resp:
            assert resp.status == 415, await resp.text()
            assert resp.headers["Accept-Encoding"] == "gzip, deflate"
            assert "x-gzip is not supported" in (await resp.json())["error"]
    assert db.product_count(svc.database) == 6


async def test_message_id_is_stable_across_retries(
    service_factory: ServiceFactory, smtp: SmtpServer
) -> None:
    smtp.fail_next(1)
    svc = service_factory({"TOKO_SMTP_URL": smtp.url, "TOKO_JOB_BACKOFF": "0.05"}).start()
    await svc.async_wait_ready(timeout=20)
    async with aiohttp.ClientSession() as session:
        await create_products(session, svc.base_url, ["Ulang"])
    (mid,) = await smtp.async_wait_delivered(1, timeout=15)
    (rejected,) = smtp.messages("tempfailed")
    assert rejected.message_id == mid
    assert rejected.at < smtp.delivered()[0].at
    assert rejected.raw != b"" and smtp.delivered()[0].subject == rejected.subject


async def test_every_email_greets_the_server_with_the_name_the_host_had_at_start(
    service_factory: ServiceFactory, smtp: SmtpServer, tmp_path: Path
) -> None:
    # toko-api runs in a UTS namespace of its own, under a host name of its
    # own. It gives that name in every EHLO, as aiosmtplib would by itself, but
    # looks it up once: a renamed host is picked up at the next start.
    wrapper = tmp_path / "toko-api-on-its-own-host"
    wrapper.write_text(
        "#!/bin/sh\n"
        'exec unshare --uts sh -c \'hostname kasir.toko.test && exec "$0" "$@"\' '
        f'{TOKO_API} "$@"\n'
    )
    wrapper.chmod(0o755)
    svc = service_factory({"TOKO_SMTP_URL": smtp.url}, executable=wrapper).start()
    await svc.async_wait_ready(timeout=20)
    async with aiohttp.ClientSession() as session:
        await create_products(session, svc.base_url, ["Satu", "Dua"])
        await smtp.async_wait_delivered(2, timeout=15)
        rename = await asyncio.create_subprocess_exec(
            *["nsenter", "-t", str(svc.pid), "-u", "hostname", "gudang.toko.test"]
        )
        assert await rename.wait() == 0
        await create_products(session, svc.base_url, ["Tiga"])
        await smtp.async_wait_delivered(3, timeout=15)
    assert [m.helo for m in smtp.delivered()] == ["kasir.toko.test"] * 3
