"""A seeded random walk over the HTTP contract, against a real toko-api.

Each step builds one request from a seed (odd methods, paths, headers, framing
and bodies, mostly near a valid POST so that the checks deep in the handler
are reached), sends its exact bytes over a real socket and checks what the
contract promises for any client input:

- never a 5xx; every 4xx is JSON ``{"error": "<what is wrong>"}``, except the
  plain-text 400s of aiohttp's parser for requests that are not HTTP at all
  (README, HTTP API), which toko's code never sees;
- a 201 is the stored product, valid by the contract's rules, and
  ``GET /produk/{id}`` returns the same; a replay returns the key's product;
- the products table grows by exactly the new 201s (read read-only);
- /healthz stays 200 and the process stays up, with no ERROR in its log.

The walk is deterministic; run longer walks with
``TOKO_FUZZ_SEEDS=50 TOKO_FUZZ_STEPS=500``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import random
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support import db, http
from tests.support.service import ServiceProcess, ready_service

SEEDS = range(int(os.environ.get("TOKO_FUZZ_SEEDS", "1")))
STEPS = int(os.environ.get("TOKO_FUZZ_STEPS", "150"))
TOKEN = "fuzz-token-0123456789"
LIMIT = 64 * 1024
# A body that never arrives whole is answered 408 after this (the minimum).
CLIENT_TIMEOUT = 1.0
# test_bad_input's 300, plus room for an Idempotency-Key (up to 255 characters)
# that a 422 names whole.
MESSAGE_MAX = 400
HARGA_MAX = 10**12
NAMA_BLANKS = (
    "\t\n\v\f\r \xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
)


@dataclass
class FuzzRequest:
    method: str
    target: str
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes | None = None
    # "length": a right Content-Length; "chunked": chunks of ``chunks`` sizes;
    # "none": no framing header; "short"/"long": a Content-Length ``delta`` off.
    framing: str = "length"
    chunks: list[int] = field(default_factory=list)
    chunk_style: str = "plain"
    delta: int = 0
    # A second request on the same connection after this one.
    pipelined: bool = False
    # "whole": all bytes in one write; "split": the head, then the body a
    # moment later (a body still arriving); "abort": half the body, then hang up.
    delivery: str = "whole"
    why: list[str] = field(default_factory=list)

    def raw(self) -> bytes:
        lines = [f"{self.method} {self.target} HTTP/1.1", "Host: 127.0.0.1"]
        if not self.pipelined:
            lines.append("Connection: close")
        lines += [f"{k}: {v}" for k, v in self.headers]
        body = self.body or b""
        payload = b""
        if self.framing == "chunked":
            lines.append("Transfer-Encoding: chunked")
            payload = _chunked(body, self.chunks, self.chunk_style)
        elif self.framing == "length" and self.body is not None:
            lines.append(f"Content-Length: {len(body)}")
            payload = body
        elif self.framing in ("short", "long"):
            lines.append(f"Content-Length: {max(0, len(body) + self.delta)}")
            payload = body
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")
        data = head + payload
        if self.pipelined:
            data += b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        return data

    def __repr__(self) -> str:
        raw = self.raw()
        return f"FuzzRequest({self.why}, {raw[:600]!r}{'...' if len(raw) > 600 else ''})"


BROKEN_CHUNKS = ("overstated", "huge")


def _chunked(body: bytes, sizes: list[int], style: str) -> bytes:
    out = b""
    at = 0
    for size in [*sizes, len(body)]:
        chunk = body[at : at + size]
        if not chunk:
            continue
        at += len(chunk)
        size_text = f"{len(chunk):x}"
        if style == "upper":
            size_text = size_text.upper()
        elif style == "zeros":
            size_text = "000" + size_text
        elif style == "extension":
            size_text += ";name=value"
        elif style == "overstated":  # the framing breaks mid-body
            size_text = f"{len(chunk) + 1:x}"
        elif style == "huge":
            size_text = "f" * 20
        out += size_text.encode() + b"\r\n" + chunk + b"\r\n"
        if at >= len(body):
            break
    return out + b"0\r\n\r\n"


# -- the generator ----------------------------------------------------------------

NAMES = [
    "Kopi",
    "Teh Manis",
    "  Gula  ",
    "Kue \u00e9clair",
    "\u0645\u0646\u062a\u062c",
    "\U0001f600 senyum",
    "x" * 200,
    "\ufeffKopi\ufeff",
    "Kopi\u00a0Susu",
    "\u3000Nasi\u3000",
]
ODD_NAMES: list[Any] = [
    "",
    " ",
    "\t\n",
    "\ufeff",
    "x" * 201,
    " " + "y" * 200 + " ",
    "Ko\x00pi",
    "Ko\x7fpi",
    "Ko\x85pi",
    "Ko\u2028pi",
    "Kopi\r\nBcc: x@y",
    "\x1c",
    "\u200b",
    "\u180e",
    123,
    None,
    True,
    ["Kopi"],
    {"v": "Kopi"},
]
HARGA_TEXTS = [
    "0",
    "1",
    "-0",
    "15000",
    str(HARGA_MAX),
    str(HARGA_MAX + 1),
    str(2**63),
    str(2**64),
    "-1",
    "1e3",
    "1E+3",
    "1.0",
    "-0.0",
    "0.5",
    "1e400",
    "-1e400",
    "01",
    "+1",
    "0x10",
    "NaN",
    "Infinity",
    "-Infinity",
    "true",
    "false",
    "null",
    '"100"',
    '""',
    "[]",
    "{}",
    "9" * 41,
    "9" * 5000,
    "-" + "9" * 50,
    "1" + "0" * 12,
]
# Raw JSON string contents (escapes as sent).
NAMA_ESCAPES = [
    "\\ud800",
    "\\udc00\\ud800",
    "\\ud83d\\ude00",
    "Ko\\u0000pi",
    "\\u0009Kopi",
    "\\uFEFF",
    "Kopi\\/Teh",
    "\\u00e9",
    "\\x41",
    "\\uZZZZ",
    "Ko\tpi",
]
CONTENT_TYPES = [
    "application/json",
    "application/json",
    "application/json",
    "APPLICATION/JSON",
    "application/json; charset=utf-8",
    "application/json; charset=latin-1",
    "application/json; charset=UTF-16",
    'application/json; charset=""',
    "application/json;",
    "application/json;;",
    "application/json; =x",
    "application/vnd.toko+json",
    "application/problem+json",
    "+json",
    "application/json-seq",
    "text/json",
    "text/plain",
    "",
    ";",
    "multipart/form-data; boundary=x",
    "application/x-www-form-urlencoded",
    "application/json\u00e9",
    "application/json; charset=\udcff",
    "*/*",
]
CODINGS = [
    "gzip",
    "deflate",
    "identity",
    "GZIP",
    " gzip ",
    "x-gzip",
    "gzip, gzip",
    "identity, gzip",
    "",
    "br",
    "zstd",
    "compress",
    "*",
    "gzip;q=1",
]
KEYS = ["k1", "k2", '"k1"', "order-17", "a" * 255]
# "\udcff" is sent as the single byte 0xFF (not UTF-8).
ODD_KEYS = ["", '"', '""', '"k1', "a" * 256, "k\u00e9", "k 1", "k\t1", " k1 ", "\u00ff", "k\udcff"]
AUTHS = [
    "Bearer",
    "Bearer ",
    f"bearer {TOKEN}",
    f"BEARER  {TOKEN}  ",
    f"Bearer {TOKEN}x",
    f"Bearer {TOKEN[:-1]}",
    "Basic dXNlcjpwYXNz",
    f"Bearer\t{TOKEN}",
    "Bearer \u00e9\u00e9",
    "Bearer " + "x" * 5000,
    f"Token {TOKEN}",
    "Bearer \udcff\udcfe",
]
METHODS = (
    ["POST"] * 12
    + ["GET"] * 5
    + [
        "HEAD",
        "PUT",
        "DELETE",
        "PATCH",
        "OPTIONS",
        "TRACE",
        "post",
        "Get",
        "PROPFIND",
        "X" * 200,
        "QUERY",
    ]
)
QUERY_VALUES = [
    "",
    "0",
    "1",
    "200",
    "201",
    "-1",
    "+1",
    " 1",
    "1 ",
    "%201",
    "1%00",
    "%00",
    "1.0",
    "1e2",
    "0x10",
    "\u0661",
    "%D9%A1",
    "\u00b2",
    "0" * 100 + "5",
    "9" * 30,
    str(2**63 - 1),
    str(2**63),
    "abc",
    "%FF",
    "%",
    "%zz",
    "+",
]


def _id_segment(rng: random.Random, known: list[int]) -> str:
    choices: list[Callable[[], str]] = [
        lambda: str(rng.choice(known)) if known else "1",
        lambda: str(rng.randint(0, 10**6)),
        lambda: "-1",
        lambda: "0",
        lambda: "9" * rng.choice([19, 20, 100, 5000]),
        lambda: str(2**63 - 1),
        lambda: str(2**63),
        lambda: "0" * 50 + "1",
        lambda: "%31",
        lambda: "1%2F2",
        lambda: "\u0661\u0662",
        lambda: "%D9%A1",
        lambda: "1.0",
        lambda: "1e3",
        lambda: "abc",
        lambda: "1;x=y",
        lambda: "%00",
        lambda: "%FF",
        lambda: "\u00e9",
    ]
    return rng.choice(choices)()


def _target(rng: random.Random, method: str, known: list[int]) -> str:
    roll = rng.random()
    if roll < 0.45 and method.upper() == "POST":
        base = "/produk"
    elif roll < 0.65:
        base = f"/produk/{_id_segment(rng, known)}"
    elif roll < 0.8:
        params = []
        for _ in range(rng.choice([1, 1, 2, 3])):
            name = rng.choice(["after", "limit", "after", "limit", "x", "AFTER", ""])
            if rng.random() < 0.1:
                params.append(name)
            else:
                params.append(f"{name}={rng.choice(QUERY_VALUES)}")
        base = "/produk?" + "&".join(params)
    else:
        base = rng.choice(
            [
                "/",
                "/healthz",
                "/healthz?x=1",
                "/metrics",
                "/openapi.json",
                "//produk",
                "/produk//1",
                "/./produk",
                "/produk/../produk",
                "/x/../produk",
                "/produk/%2e%2e/healthz",
                "/%70roduk",
                "/PRODUK",
                "/produk%2F1",
                "/produk;a=b",
                "/produk#frag",
                "*",
                "http://127.0.0.1/produk",
                "/produk?",
                "/produk?&",
                "/produk?%",
                "/\u00e9",
                "/" + "a" * rng.choice([100, 4000, 9000]),
                "/produk/" + "1/" * 50,
            ]
        )
    if rng.random() < 0.08 and "?" not in base:
        base += "/"
    return base


def _json_body(rng: random.Random) -> tuple[bytes, str]:
    """A JSON-ish body and a word on what was done to it."""
    members, why = _json_members(rng)
    text, why = _json_framed(rng, "{" + ", ".join(members) + "}", why)
    encoding = "utf-8"
    if rng.random() < 0.04:
        encoding = rng.choice(["latin-1", "utf-16", "utf-32", "utf-8-sig"])
        why += f", {encoding}"
    try:
        return text.encode(encoding, "surrogatepass"), why
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass"), why


def _json_members(rng: random.Random) -> tuple[list[str], str]:
    """The members of the body's object, odd values and shapes included."""
    nama: Any = rng.choice(NAMES)
    harga_text = str(rng.randint(0, 10**6))
    why = "valid"
    roll = rng.random()
    if roll < 0.15:
        nama = rng.choice(ODD_NAMES)
        why = f"nama {nama!r:.40}"
    elif roll < 0.3:
        harga_text = rng.choice(HARGA_TEXTS)
        why = f"harga {harga_text:.40}"
    nama_json = json.dumps(nama, ensure_ascii=rng.random() < 0.5)
    if roll >= 0.3 and rng.random() < 0.15:
        nama_json = '"' + rng.choice(NAMA_ESCAPES) + rng.choice(["", "Kopi"]) + '"'
        why = f"nama escapes {nama_json:.40}"
    members = [f'"nama": {nama_json}', f'"harga": {harga_text}']
    shape = rng.random()
    if shape < 0.05:
        members.append(f'"harga": {rng.randint(0, 9)}')
        why += ", duplicate harga"
    elif shape < 0.1:
        members.append(f'"nama": {json.dumps(rng.choice(NAMES))}')
        why += ", duplicate nama"
    elif shape < 0.15:
        members.append(rng.choice(['"stok": 1', '"id": 7', '"": 0', '"Nama": "x"']))
        why += ", extra field"
    elif shape < 0.2:
        members.pop(rng.randrange(2))
        why += ", missing field"
    if rng.random() < 0.5:
        rng.shuffle(members)
    return members, why


def _json_framed(rng: random.Random, text: str, why: str) -> tuple[str, str]:
    """The object's text, nested, padded, cut short or replaced."""
    frame = rng.random()
    if frame < 0.03:
        depth = rng.choice([10, 1000, 100_000])
        text = "[" * depth + text + "]" * depth
        why += f", nested {depth}"
    elif frame < 0.06:
        text = "\ufeff" + text
        why += ", BOM"
    elif frame < 0.09:
        text = rng.choice([" \n\t", "\r\n", "\x00", "\x0b"]) + text + rng.choice(["", " \n", "x"])
        why += ", padding"
    elif frame < 0.12:
        text = text[: rng.randrange(len(text))]
        why += ", cut short"
    elif frame < 0.14:
        text = rng.choice(["", " ", "null", "[]", "42", '"Kopi"', "{}", "{,}", "{'nama': 1}"])
        why = f"body {text!r}"
    return text, why


def _compress(rng: random.Random, body: bytes, coding: str) -> tuple[bytes, str]:
    name = coding.strip().lower()
    if name == "gzip" or name == "x-gzip":
        data = gzip.compress(body)
    elif name == "deflate":
        data = zlib.compress(body) if rng.random() < 0.7 else zlib.compress(body, wbits=-15)
    else:
        return body, ""
    roll = rng.random()
    if roll < 0.1 and data:
        return data[: rng.randrange(len(data))], ", compressed then cut"
    if roll < 0.15 and data:
        at = rng.randrange(len(data))
        return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :], ", compressed then flipped"
    if roll < 0.2:
        return data + rng.choice([b"x", data, b"\x00" * 8]), ", compressed then more"
    if roll < 0.23:
        return body, ", not compressed"
    return data, ""


def generate(rng: random.Random, known: list[int], auth: bool) -> FuzzRequest:
    method = rng.choice(METHODS)
    req = FuzzRequest(method, _target(rng, method, known))
    _add_body(rng, req)
    _add_content_type(rng, req)
    if auth:
        _add_authorization(rng, req)
    _add_idempotency_key(rng, req)
    _add_expect(rng, req)
    _add_odd_header(rng, req)
    _set_framing(rng, req)
    _set_delivery(rng, req)
    return req


def _add_body(rng: random.Random, req: FuzzRequest) -> None:
    if req.method.upper() in ("POST", "PUT", "PATCH") or rng.random() < 0.1:
        body, why = _json_body(rng)
        req.why.append(why)
        if rng.random() < 0.2:
            coding = rng.choice(CODINGS)
            body, broken = _compress(rng, body, coding)
            req.headers.append(("Content-Encoding", coding))
            req.why.append(f"coding {coding!r}{broken}")
            if rng.random() < 0.1:
                req.headers.append(("Content-Encoding", rng.choice(CODINGS)))
                req.why.append("second Content-Encoding")
        if rng.random() < 0.01:
            body = body + b" " * (LIMIT + rng.choice([-10, 1, 100]))
            req.why.append("near the size limit")
        req.body = body


def _add_content_type(rng: random.Random, req: FuzzRequest) -> None:
    if rng.random() < 0.9:
        ct = "application/json" if rng.random() < 0.75 else rng.choice(CONTENT_TYPES)
        req.headers.append(("Content-Type", ct))
        if rng.random() < 0.03:
            req.headers.append(("Content-Type", rng.choice(CONTENT_TYPES)))
            req.why.append("second Content-Type")


def _add_authorization(rng: random.Random, req: FuzzRequest) -> None:
    if rng.random() < 0.85:
        req.headers.append(("Authorization", f"Bearer {TOKEN}"))
    elif rng.random() < 0.8:
        value = rng.choice(AUTHS)
        req.headers.append(("Authorization", value))
        req.why.append(f"auth {value:.30}")
    if rng.random() < 0.03:
        req.headers.append(("Authorization", rng.choice(AUTHS)))
        req.why.append("second Authorization")


def _add_idempotency_key(rng: random.Random, req: FuzzRequest) -> None:
    roll = rng.random()
    if roll < 0.25:
        req.headers.append(("Idempotency-Key", rng.choice(KEYS)))
    elif roll < 0.3:
        value = rng.choice(ODD_KEYS)
        req.headers.append(("Idempotency-Key", value))
        req.why.append(f"odd key {value:.20}")
    elif roll < 0.32:
        req.headers += [("Idempotency-Key", rng.choice(KEYS)), ("Idempotency-Key", "k2")]
        req.why.append("two keys")


def _add_expect(rng: random.Random, req: FuzzRequest) -> None:
    if rng.random() < 0.05:
        value = rng.choice(["100-continue", "100-Continue", "100-continue, foo", "foo", ""])
        req.headers.append(("Expect", value))
        req.why.append(f"Expect {value!r}")


def _add_odd_header(rng: random.Random, req: FuzzRequest) -> None:
    if rng.random() < 0.03:
        extra = rng.choice(
            [
                ("Connection", "keep-alive, Upgrade"),
                ("Upgrade", "websocket"),
                ("Accept", "text/html"),
                ("Accept-Encoding", "gzip"),
                ("X-Forwarded-For", "1.2.3.4"),
                ("Host", "other"),
                ("Content-Length", "5"),
                ("Transfer-Encoding", "gzip"),
                ("Range", "bytes=0-1"),
                ("X-" + "a" * 100, "b" * 9000),
            ]
        )
        req.headers.append(extra)
        req.why.append(f"header {extra[0][:20]}")


def _set_framing(rng: random.Random, req: FuzzRequest) -> None:
    framing = rng.random()
    if req.body is not None and framing < 0.1:
        req.framing = "chunked"
        req.chunks = [rng.choice([1, 2, 7, 100, 5000]) for _ in range(rng.randint(0, 4))]
        req.chunk_style = rng.choice(
            ["plain", "plain", "upper", "zeros", "extension", *BROKEN_CHUNKS]
        )
        req.why.append(f"chunked {req.chunks} {req.chunk_style}")
    elif req.body is not None and framing < 0.13:
        req.framing = "short"
        req.delta = -rng.randint(1, 5)
        req.why.append(f"Content-Length {req.delta}")
    elif req.body is not None and framing < 0.14:
        req.framing = "long"
        req.delta = rng.randint(1, 5)
        req.why.append(f"Content-Length +{req.delta}")
    elif req.body is not None and framing < 0.15:
        req.framing = "none"
        req.why.append("no framing")


def _set_delivery(rng: random.Random, req: FuzzRequest) -> None:
    # Not after a HEAD: an answer aiohttp's parser gives has a body even then.
    # Nor after broken framing: aiohttp reads what it can of an unread body
    # for up to 10 s (its lingering close) before it gives up on the connection.
    framed = req.framing in ("length", "chunked") and req.chunk_style not in BROKEN_CHUNKS
    if rng.random() < 0.05 and req.method.upper() != "HEAD" and framed:
        req.pipelined = True
        req.why.append("pipelined")
    if req.body and rng.random() < 0.08:
        req.delivery = rng.choice(["split", "split", "abort"])
        # Half of what is sent must be less than the request: a whole request
        # from a client that hung up is still stored.
        if req.delivery == "abort" and (req.pipelined or req.framing not in ("length", "chunked")):
            req.delivery = "split"
        req.why.append(req.delivery)


# -- reading answers --------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def _read_answer(reader: asyncio.StreamReader, method: str) -> Answer | None:
    """One final response (1xx skipped), framed by its own headers; None at EOF."""
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise AssertionError(f"response cut short: {exc.partial[:300]!r}") from None
            return None
        status_line, *lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        headers: dict[str, str] = {}
        for line in lines:
            name, _, value = line.partition(":")
            key = name.strip().lower()
            headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
        if 100 <= status < 200:
            continue
        break
    if method.upper() == "HEAD" or status in (204, 304):
        return Answer(status, headers, b"")
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return Answer(status, headers, body)
            body += (await reader.readexactly(size + 2))[:-2]
    if "content-length" in headers:
        return Answer(status, headers, await reader.readexactly(int(headers["content-length"])))
    return Answer(status, headers, await reader.read())


async def exchange(port: int, req: FuzzRequest) -> list[Answer]:
    """Send the request's bytes; its answers (two when pipelined, if the first kept on)."""
    answers: list[Answer] = []
    data = req.raw()
    head_end = data.index(b"\r\n\r\n") + 4
    async with asyncio.timeout(CLIENT_TIMEOUT + 15):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                if req.delivery == "whole":
                    writer.write(data)
                else:
                    writer.write(data[:head_end])
                    await writer.drain()
                    # Not a synchronisation: the body is meant to come later,
                    # so the handler finds it still arriving.
                    await asyncio.sleep(0.005)
                    if req.delivery == "abort":
                        writer.write(data[head_end : head_end + (len(data) - head_end) // 2])
                        await writer.drain()
                        return answers
                    writer.write(data[head_end:])
                await writer.drain()
            for _ in range(2 if req.pipelined else 1):
                try:
                    answer = await _read_answer(reader, req.method)
                except ConnectionResetError:
                    answer = None
                if answer is None:
                    break
                answers.append(answer)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                await writer.wait_closed()
    return answers


# -- the checks ---------------------------------------------------------------------


def is_parser_refusal(answer: Answer) -> bool:
    """aiohttp's own 400 for a request it could not parse (plain text, toko never ran)."""
    return answer.status == 400 and answer.headers.get("content-type", "").startswith("text/plain")


def check_product(product: Any) -> None:
    assert isinstance(product, dict), product
    assert set(product) == {"id", "nama", "harga", "created_at"}, product
    nama, harga = product["nama"], product["harga"]
    assert isinstance(nama, str) and 1 <= len(nama) <= 200, product
    assert nama == nama.strip(NAMA_BLANKS), product
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in nama), product
    assert not any(0xD800 <= ord(c) <= 0xDFFF or c in "\u2028\u2029" for c in nama), product
    assert type(harga) is int and 0 <= harga <= HARGA_MAX, product


def check_error(answer: Answer, method: str) -> None:
    if method.upper() == "HEAD":
        return
    assert answer.headers.get("content-type", "").startswith("application/json"), answer
    payload = answer.json()
    assert isinstance(payload, dict) and set(payload) == {"error"}, payload
    assert isinstance(payload["error"], str) and payload["error"].strip(), payload
    assert len(payload["error"]) <= MESSAGE_MAX, payload


@dataclass
class Tally:
    statuses: dict[int, int] = field(default_factory=dict)
    parser_refusals: list[str] = field(default_factory=list)
    created: int = 0


@dataclass
class Target:
    svc: ServiceProcess
    auth: bool
    # Each Idempotency-Key's product, over every walk against this service.
    keys: dict[str, dict[str, Any]] = field(default_factory=dict)


class Walk:
    def __init__(self, target: Target, seed: int) -> None:
        self.svc = target.svc
        self.auth = target.auth
        self.keys = target.keys
        self.rng = random.Random(seed)
        self.known = [p["id"] for p in db.query(self.svc.database, "SELECT id FROM products")]
        # The rows there should be: those before the walk, plus its new 201s.
        self.rows = len(self.known)
        self.tally = Tally()

    async def step(self) -> None:
        req = generate(self.rng, self.known, self.auth)
        answers = await exchange(self.svc.port, req)
        # A client that hangs up gets no answer; the next steps' counts show
        # that its half a body stored nothing, even later.
        assert answers or req.delivery == "abort", f"no answer to {req!r}"
        created = 0
        for answer in answers:
            self.tally.statuses[answer.status] = self.tally.statuses.get(answer.status, 0) + 1
            assert answer.status < 500, (answer, req)
            if is_parser_refusal(answer):
                self.tally.parser_refusals.append(answer.body.decode("latin-1").partition("\n")[0])
            elif answer.status >= 400:
                check_error(answer, req.method)
            elif answer.status == 201:
                created += await self.check_created(answer, req)
        self.rows += created
        assert db.product_count(self.svc.database) == self.rows, (created, answers, req)
        self.tally.created += created

    async def check_created(self, answer: Answer, req: FuzzRequest) -> int:
        product = answer.json()
        check_product(product)
        assert answer.headers.get("location") == f"/produk/{product['id']}", answer
        stored = await http.request(self.svc.port, "GET", f"/produk/{product['id']}")
        assert stored.status == 200 and stored.json() == product, (stored, product, req)
        replayed = answer.headers.get("idempotent-replayed") == "true"
        sent = [v for k, v in req.headers if k == "Idempotency-Key"]
        if sent:
            (key,) = sent  # two are a 400
            if len(key) >= 2 and key[0] == key[-1] == '"':
                key = key[1:-1]
            # A replay answers with the key's product; a new product, a new key.
            assert replayed == (key in self.keys), (answer, self.keys.get(key), req)
            assert self.keys.setdefault(key, product) == product, (self.keys[key], product, req)
        else:
            assert not replayed, (answer, req)
        if replayed:
            return 0
        self.known.append(product["id"])
        return 1

    async def healthy(self) -> None:
        health = await http.request(self.svc.port, "GET", "/healthz", headers={})
        assert health.status == 200, health
        assert self.svc.returncode is None, self.svc.output_tail()


@pytest.fixture(scope="module", params=["open", "token"])
def target(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Target]:
    workdir = tmp_path_factory.mktemp(f"fuzz-{request.param}")
    env = {"TOKO_CLIENT_TIMEOUT": str(CLIENT_TIMEOUT)}
    if request.param == "token":
        token_file = Path(workdir) / "api-token"
        token_file.write_text(TOKEN + "\n")
        env["TOKO_API_TOKEN_FILE"] = str(token_file)
    with ready_service(workdir, env) as svc:
        yield Target(svc, auth=request.param == "token")


@pytest.mark.parametrize("seed", SEEDS)
async def test_no_client_input_breaks_the_contract(target: Target, seed: int) -> None:
    walk = Walk(target, seed)
    for n in range(STEPS):
        await walk.step()
        if n % 25 == 0:
            await walk.healthy()
    await walk.healthy()
    errors = [r for r in target.svc.logs.snapshot() if r.get("level") in ("ERROR", "CRITICAL")]
    assert errors == [], errors
    print(walk.tally)
