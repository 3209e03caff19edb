"""The email a peer stack's job sends for a new product, as its users would write it.

The email package builds it and ``aiosmtplib.send`` delivers it, as
aiosmtplib's documentation shows: one SMTP connection per email (toko keeps
its connections open between emails; the report says so). Same recipient,
subject and a Message-ID per product, like toko's, so the bench's SMTP sink
counts them the same way. The server comes from ``PEER_SMTP_URL``
(``smtp://host:port``, the TOKO_SMTP_URL form).
"""

from __future__ import annotations

import os
from email.message import EmailMessage
from email.utils import formatdate
from urllib.parse import urlsplit

import aiosmtplib

ADMIN = "admin@toko.com"
SENDER = "peer@localhost"


def smtp_server() -> tuple[str, int]:
    url = urlsplit(os.environ["PEER_SMTP_URL"])
    return url.hostname or "127.0.0.1", url.port or 25


def product_email(product_id: int, nama: str, harga: int, stack: str) -> EmailMessage:
    message = EmailMessage()
    message["From"] = SENDER
    message["To"] = ADMIN
    message["Subject"] = f"Produk baru: {nama}"
    message["Date"] = formatdate(localtime=False)
    message["Message-ID"] = f"<{stack}.{product_id}@localhost>"
    message.set_content(f"Produk baru #{product_id}: {nama}, harga {harga}.\n")
    return message


async def send_product_email(product_id: int, nama: str, harga: int, stack: str) -> None:
    host, port = smtp_server()
    await aiosmtplib.send(
        product_email(product_id, nama, harga, stack), hostname=host, port=port, timeout=30
    )
