"""Bad input: malformed requests get the right 4xx with a JSON error, and nothing else.

One toko-api process serves the whole table (module-scoped). Requests are sent
as raw bytes (tests.support.http) so no client library can "fix" them. After
every case: no product row exists in the SQLite file and /healthz is 200.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.support import db, http
from tests.support.service import ServiceProcess, ready_service

JSON = {"Content-Type": "application/json"}
LIMIT = 64 * 1024
# More digits than Python's int() takes from a string (4300).
DIGITS = "1" * 5000
ZEROS = "0" * 5000
# No answer echoes such input whole: an error message stays readable.
MESSAGE_MAX = 300


def _body(obj: object) -> bytes:
    return json.dumps(obj).encode()


# The whole JSON is there; the gzip trailer (CRC-32 and length, 8 bytes) is not.
GZIP_WITHOUT_TRAILER = gzip.compress(_body({"nama": "Kopi", "harga": 1}))[:-8]


@dataclass(frozen=True)
class Case:
    id: str
    status: int
    body: bytes | None = None
    method: str = "POST"
    path: str = "/produk"
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON))
    chunked: bool = False
    # Sent after ``headers``: a header given a second time.
    repeated: tuple[tuple[str, str], ...] = ()
    # Part of the error message: it says what is wrong.
    says: str = ""


CASES = [
    # Not JSON at all, or not the JSON we take.
    Case("truncated-json", 400, b'{"nama": "Kopi", "harga": 1'),
    Case("empty-body", 400, b""),
    Case("trailing-garbage", 400, b'{"nama": "Kopi", "harga": 1} x'),
    Case("nan-harga", 400, b'{"nama": "Kopi", "harga": NaN}'),
    Case("infinity-harga", 400, b'{"nama": "Kopi", "harga": Infinity}'),
    Case("deeply-nested", 400, b"[" * 30000 + b"]" * 30000),
    Case(
        "5000-digit-harga",
        400,
        b'{"nama": "Kopi", "harga": ' + b"9" * 5000 + b"}",
        says="field 'harga' must be an integer from 0 to 1000000000000",
    ),
    Case("invalid-utf8", 400, b'{"nama": "Kop\xff\xfe", "harga": 1}'),
    Case("lone-surrogate", 400, b'{"nama": "\\ud800", "harga": 1}'),
    Case("byte-order-mark", 400, b'\xef\xbb\xbf{"nama": "Kopi", "harga": 1}'),
    Case("array-body", 400, _body([{"nama": "Kopi", "harga": 1}])),
    Case("null-body", 400, b"null"),
    Case("string-body", 400, b'"Kopi"'),
    Case("number-body", 400, b"42"),
    # harga.
    Case("harga-string", 400, _body({"nama": "Kopi", "harga": "100"})),
    Case("harga-true", 400, _body({"nama": "Kopi", "harga": True})),
    Case("harga-false", 400, _body({"nama": "Kopi", "harga": False})),
    Case("harga-float", 400, _body({"nama": "Kopi", "harga": 1.5})),
    Case("harga-integral-float", 400, b'{"nama": "Kopi", "harga": 100.0}'),
    Case("harga-exponent", 400, b'{"nama": "Kopi", "harga": 1e3}'),
    Case("harga-negative", 400, _body({"nama": "Kopi", "harga": -1})),
    Case("harga-too-big", 400, _body({"nama": "Kopi", "harga": 10**12 + 1})),
    Case("harga-null", 400, _body({"nama": "Kopi", "harga": None})),
    Case("harga-object", 400, _body({"nama": "Kopi", "harga": {"v": 1}})),
    # nama.
    Case("nama-number", 400, _body({"nama": 123, "harga": 1})),
    Case("nama-null", 400, _body({"nama": None, "harga": 1})),
    Case("nama-list", 400, _body({"nama": ["Kopi"], "harga": 1})),
    Case("nama-empty", 400, _body({"nama": "", "harga": 1})),
    Case("nama-whitespace", 400, _body({"nama": " \t\n  ", "harga": 1})),
    # Blank to JavaScript's \s, which the OpenAPI pattern uses, though not to str.strip().
    Case(
        "nama-zero-width-no-break-space",
        400,
        _body({"nama": " \ufeff\ufeff ", "harga": 1}),
        says="field 'nama' must not be empty",
    ),
    Case("nama-201-chars", 400, _body({"nama": "x" * 201, "harga": 1})),
    Case("nama-10k-chars", 400, _body({"nama": "x" * 10_000, "harga": 1})),
    Case("nama-nul", 400, b'{"nama": "Ko\\u0000pi", "harga": 1}'),
    Case("nama-del", 400, b'{"nama": "Ko\\u007fpi", "harga": 1}'),
    Case("nama-c1-control", 400, b'{"nama": "Ko\\u0085pi", "harga": 1}'),
    Case("nama-line-separator", 400, b'{"nama": "Kopi\\u2028Susu", "harga": 1}'),
    # Fields.
    Case("missing-nama", 400, _body({"harga": 1})),
    Case("missing-harga", 400, _body({"nama": "Kopi"})),
    Case("empty-object", 400, b"{}"),
    Case("unknown-field", 400, _body({"nama": "Kopi", "harga": 1, "stok": 3})),
    Case("id-field", 400, _body({"id": 7, "nama": "Kopi", "harga": 1})),
    Case(
        "nama-twice",
        400,
        b'{"nama": "Kopi", "harga": 1, "nama": "Teh"}',
        says="field 'nama' is given twice",
    ),
    # Content-Type.
    Case(
        "text-plain",
        415,
        _body({"nama": "Kopi", "harga": 1}),
        headers={"Content-Type": "text/plain"},
    ),
    # A coding aiohttp would not decode: it would read the bytes as they are.
    Case(
        "content-encoding-unknown",
        415,
        _body({"nama": "Kopi", "harga": 1}),
        headers={**JSON, "Content-Encoding": "compress"},
    ),
    Case(
        "content-encoding-stacked",
        415,
        _body({"nama": "Kopi", "harga": 1}),
        headers={**JSON, "Content-Encoding": "gzip, identity"},
    ),
    # aiohttp decodes by the last of several headers; all of them count.
    Case(
        "content-encoding-twice",
        415,
        _body({"nama": "Kopi", "harga": 1}),
        repeated=(("Content-Encoding", "gzip"), ("Content-Encoding", "compress")),
        says="gzip, compress is not supported",
    ),
    # A body that does not decode in the Content-Encoding it declares.
    Case(
        "gzip-label-on-plain-body",
        400,
        _body({"nama": "Kopi", "harga": 1}),
        headers={**JSON, "Content-Encoding": "gzip"},
    ),
    Case(
        "deflate-label-on-plain-body",
        400,
        _body({"nama": "Kopi", "harga": 1}),
        headers={**JSON, "Content-Encoding": "deflate"},
    ),
    # The JSON decodes whole, but the body was cut short: it is not what was sent.
    Case(
        "gzip-without-trailer",
        400,
        GZIP_WITHOUT_TRAILER,
        headers={**JSON, "Content-Encoding": "gzip"},
        says="the gzip body is incomplete",
    ),
    Case(
        "gzip-trailer-cut-short",
        400,
        GZIP_WITHOUT_TRAILER + b"\x00\x00\x00",
        headers={**JSON, "Content-Encoding": "gzip"},
        says="the gzip body is incomplete",
    ),
    Case(
        "gzip-wrong-checksum",
        400,
        GZIP_WITHOUT_TRAILER + bytes(8),
        headers={**JSON, "Content-Encoding": "gzip"},
        says="not valid gzip",
    ),
    Case(
        "gzip-then-more",
        400,
        gzip.compress(_body({"nama": "Kopi", "harga": 1})) + b"x",
        headers={**JSON, "Content-Encoding": "gzip"},
        says="after the end of the gzip data",
    ),
    Case(
        "gzip-second-member-cut-short",
        400,
        gzip.compress(_body({"nama": "Kopi", "harga": 1})) + gzip.compress(b" ")[:-8],
        headers={**JSON, "Content-Encoding": "gzip"},
        says="the gzip body is incomplete",
    ),
    Case(
        "deflate-without-checksum",
        400,
        zlib.compress(_body({"nama": "Kopi", "harga": 1}))[:-4],
        headers={**JSON, "Content-Encoding": "deflate"},
        says="the deflate body is incomplete",
    ),
    # JSON is UTF-8 whatever the charset says (RFC 8259 §8.1, §11).
    Case(
        "latin-1-charset",
        400,
        '{"nama": "Kopi Caf\u00e9", "harga": 1}'.encode("latin-1"),
        headers={"Content-Type": "application/json; charset=latin-1"},
    ),
    Case(
        "no-content-type",
        415,
        _body({"nama": "Kopi", "harga": 1}),
        headers={},
        says="none was sent",
    ),
    Case(
        "form-urlencoded",
        415,
        b"nama=Kopi&harga=1",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    ),
    # Size.
    Case("over-64k", 413, _body({"nama": "x" * LIMIT, "harga": 1})),
    Case("over-64k-chunked", 413, _body({"nama": "x" * LIMIT, "harga": 1}), chunked=True),
    # The limit is on the body decoded: a few hundred bytes of gzip are too much.
    Case(
        "over-64k-decoded",
        413,
        gzip.compress(_body({"nama": "x" * LIMIT, "harga": 1})),
        headers={**JSON, "Content-Encoding": "gzip"},
    ),
    # Routing.
    Case("put-collection", 405, _body({"nama": "Kopi", "harga": 1}), method="PUT"),
    Case("put-item", 405, _body({"nama": "Kopi", "harga": 1}), method="PUT", path="/produk/1"),
    # Whether or not the product exists: a change must be conditional.
    Case(
        "delete-item-without-if-match",
        428,
        None,
        method="DELETE",
        path="/produk/1",
        headers={},
        says="needs If-Match",
    ),
    Case("post-item", 405, _body({"nama": "Kopi", "harga": 1}), path="/produk/1"),
    Case("unknown-path", 404, None, method="GET", path="/barang"),
    Case("non-numeric-id", 404, None, method="GET", path="/produk/abc"),
    Case("missing-id", 404, None, method="GET", path="/produk/999999"),
    Case("negative-id", 404, None, method="GET", path="/produk/-1"),
    Case(
        "5000-digit-id",
        404,
        None,
        method="GET",
        path=f"/produk/{DIGITS}",
        says="no product with id 1111",
    ),
    Case(
        "id-after-5000-zeros",
        404,
        None,
        method="GET",
        path=f"/produk/{ZEROS}7",
        says="no product with id 7",
    ),
    # Answered from aiohttp's router; the path is not echoed whole (a request
    # line may be 8 KB).
    Case(
        "4000-char-unknown-path",
        404,
        None,
        method="GET",
        path="/" + "a" * 4000,
        says="not found: /aaaa",
    ),
    Case(
        "5000-digit-id-trailing-slash",
        404,
        None,
        method="GET",
        path=f"/produk/{DIGITS}/",
        says="not found: /produk/1111",
    ),
    Case(
        "wrong-method-on-5000-digit-id",
        405,
        None,
        method="PUT",
        path=f"/produk/{DIGITS}",
        says="method PUT is not allowed on /produk/1111",
    ),
    # An expectation other than 100-continue: aiohttp refuses it before any
    # middleware runs, on any path.
    Case(
        "expect-unknown",
        417,
        _body({"nama": "Kopi", "harga": 1}),
        headers={**JSON, "Expect": "foo"},
        says="Expect: foo",
    ),
    Case(
        "expect-unknown-unknown-path",
        417,
        None,
        method="GET",
        path="/barang",
        headers={"Expect": "100-continue, foo"},
        says="Expect: 100-continue, foo",
    ),
    Case(
        "expect-8000-chars",
        417,
        None,
        method="GET",
        path="/produk",
        headers={"Expect": "e" * 8000},
        says="Expect: eeee",
    ),
    # Pagination.
    Case("limit-zero", 400, None, method="GET", path="/produk?limit=0"),
    Case("limit-too-big", 400, None, method="GET", path="/produk?limit=201"),
    Case("limit-text", 400, None, method="GET", path="/produk?limit=abc"),
    Case("limit-float", 400, None, method="GET", path="/produk?limit=1.5"),
    Case("after-text", 400, None, method="GET", path="/produk?after=abc"),
    Case("after-negative", 400, None, method="GET", path="/produk?after=-5"),
    Case("limit-twice", 400, None, method="GET", path="/produk?limit=1&limit=200"),
    Case(
        "limit-5000-digits",
        400,
        None,
        method="GET",
        path=f"/produk?limit={DIGITS}",
        says="query parameter 'limit' must be an integer from 1 to 200",
    ),
    Case(
        "limit-zeros-then-too-big",
        400,
        None,
        method="GET",
        path=f"/produk?limit={ZEROS}201",
        says="query parameter 'limit' must be an integer from 1 to 200",
    ),
    Case(
        "after-5000-digits",
        400,
        None,
        method="GET",
        path=f"/produk?after={DIGITS}",
        says="query parameter 'after' must be an integer from 0 to",
    ),
    # Idempotency-Key.
    Case(
        "idempotency-key-twice",
        400,
        _body({"nama": "Kopi", "harga": 1}),
        repeated=(("Idempotency-Key", "a1"), ("Idempotency-Key", "b2")),
        says="Idempotency-Key given more than once",
    ),
]


# PATCH and DELETE /produk/{id}, against a service of their own holding product 1
# ("Kopi", 1000, at version 1) and product 2, deleted (at version 2). Unless a
# case says otherwise: a PATCH of product 1 with If-Match "1" and a good body.
LIVE, GONE = "/produk/1", "/produk/2"
IF_1 = {**JSON, "If-Match": '"1"'}
CHANGE = _body({"harga": 2000})


def _edit(
    id: str,
    status: int,
    body: bytes | None = CHANGE,
    *,
    method: str = "PATCH",
    path: str = LIVE,
    headers: dict[str, str] | None = None,
    if_match: str | None = '"1"',
    says: str = "",
    chunked: bool = False,
) -> Case:
    sent = dict(JSON if headers is None else headers)
    if if_match is not None:
        sent["If-Match"] = if_match
    return Case(id, status, body, method, path, sent, chunked=chunked, says=says)


EDIT_CASES = [
    # If-Match: missing, not the header's syntax, or not the version the product is at.
    _edit("patch-without-if-match", 428, if_match=None, says="PATCH needs If-Match"),
    _edit("delete-without-if-match", 428, None, method="DELETE", if_match=None),
    _edit("if-match-unquoted", 400, if_match="1", says="If-Match must be the ETag"),
    _edit("if-match-empty", 400, if_match=""),
    _edit("if-match-only-commas", 400, if_match=" , ,"),
    _edit("if-match-unterminated", 400, if_match='"1'),
    _edit("if-match-star-and-a-tag", 400, if_match='*, "1"'),
    _edit("if-match-lower-case-weak", 400, if_match='w/"1"'),
    _edit("if-match-tags-without-comma", 400, if_match='"1" "2"'),
    _edit("if-match-non-ascii", 400, if_match='"caf\u00e9"'),
    _edit("delete-if-match-unquoted", 400, None, method="DELETE", if_match="1"),
    _edit("if-match-stale", 412, if_match='"2"', says='it is at version 1 now (ETag "1")'),
    _edit("if-match-stale-list", 412, if_match='"2", "3",, "4"', says="version 1"),
    # Strong comparison: a weak tag never matches, nor a tag of another form.
    _edit("if-match-weak", 412, if_match='W/"1"', says="version 1"),
    _edit("if-match-other-form", 412, if_match='"v1"'),
    _edit("if-match-leading-zero", 412, if_match='"01"'),
    _edit("if-match-past-64-bits", 412, if_match=f'"{2**64 + 1}"'),
    _edit("if-match-8000-chars", 412, if_match='"' + "x" * 8000 + '"', says="version 1"),
    _edit("delete-if-match-stale", 412, None, method="DELETE", if_match='"9"'),
    # The body: the rules of a new product's, for the fields it has.
    _edit("empty-object", 400, b"{}", says="body changes nothing"),
    _edit("unknown-field", 400, _body({"harga": 1, "stok": 3}), says="unknown field(s): stok"),
    _edit("id-field", 400, _body({"id": 2, "harga": 1})),
    _edit("version-field", 400, _body({"version": 2, "harga": 1})),
    _edit("nama-empty", 400, _body({"nama": " "}), says="field 'nama' must not be empty"),
    _edit("nama-null", 400, _body({"nama": None})),
    _edit("nama-201-chars", 400, _body({"nama": "x" * 201})),
    _edit("nama-line-separator", 400, b'{"nama": "Kopi\\u2028Susu"}'),
    _edit("harga-null", 400, _body({"harga": None})),
    _edit("harga-negative", 400, _body({"harga": -1})),
    _edit("harga-true", 400, _body({"harga": True})),
    _edit("harga-integral-float", 400, b'{"harga": 100.0}'),
    _edit("harga-too-big", 400, _body({"harga": 10**12 + 1})),
    _edit("harga-5000-digits", 400, b'{"harga": ' + b"9" * 5000 + b"}"),
    _edit("harga-twice", 400, b'{"harga": 1, "harga": 2}', says="given twice"),
    _edit("truncated-json", 400, b'{"harga": 1'),
    _edit("empty-body", 400, b""),
    _edit("no-body", 400, None),
    _edit("array-body", 400, _body([{"harga": 1}])),
    _edit("invalid-utf8", 400, b'{"nama": "Kop\xff"}'),
    # Content-Type, Content-Encoding and size: as on POST.
    _edit("text-plain", 415, headers={"Content-Type": "text/plain"}),
    _edit("no-content-type", 415, headers={}, says="none was sent"),
    _edit("content-encoding-unknown", 415, headers={**JSON, "Content-Encoding": "compress"}),
    _edit(
        "gzip-without-trailer",
        400,
        gzip.compress(CHANGE)[:-8],
        headers={**JSON, "Content-Encoding": "gzip"},
        says="the gzip body is incomplete",
    ),
    _edit("over-64k", 413, _body({"nama": "x" * LIMIT})),
    _edit("over-64k-chunked", 413, _body({"nama": "x" * LIMIT}), chunked=True),
    _edit(
        "over-64k-decoded",
        413,
        gzip.compress(_body({"nama": "x" * LIMIT})),
        headers={**JSON, "Content-Encoding": "gzip"},
    ),
    _edit("expect-unknown", 417, headers={**JSON, "Expect": "foo"}),
    # A deleted product is gone, whatever If-Match says (RFC 9110, 13.2.1).
    _edit("patch-deleted-id", 404, path=GONE, if_match='"2"', says="no product with id 2"),
    _edit("patch-deleted-id-any-version", 404, path=GONE, if_match="*"),
    _edit("delete-deleted-id", 404, None, method="DELETE", path=GONE, if_match='"2"'),
    _edit("delete-deleted-id-stale", 404, None, method="DELETE", path=GONE, if_match='"1"'),
    _edit("patch-missing-id", 404, path="/produk/999999", says="no product with id 999999"),
    _edit("delete-missing-id", 404, None, method="DELETE", path="/produk/999999"),
    # Ids past 64 bits: no such row can exist, so not even If-Match is asked for.
    _edit("patch-id-past-64-bits", 404, path=f"/produk/{2**63}", if_match=None),
    _edit(
        "delete-5000-digit-id",
        404,
        None,
        method="DELETE",
        path=f"/produk/{DIGITS}",
        says="no product with id 1111",
    ),
    _edit("patch-negative-id", 404, path="/produk/-1"),
    _edit("patch-non-numeric-id", 404, path="/produk/abc"),
    # Methods the routes do not have.
    _edit("patch-collection", 405, path="/produk"),
    _edit("delete-collection", 405, None, method="DELETE", path="/produk"),
]


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with ready_service(tmp_path_factory.mktemp("bad-input")) as svc:
        yield svc


@pytest.fixture(scope="module")
def edit_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with ready_service(tmp_path_factory.mktemp("bad-edits")) as svc:
        for nama in ("Kopi", "Teh"):
            made = _call(svc, "POST", "/produk", _body({"nama": nama, "harga": 1000}), JSON)
            assert made.status == 201, made
        gone = _call(svc, "DELETE", GONE, None, {"If-Match": '"1"'})
        assert gone.status == 204, gone
        yield svc


def _call(
    svc: ServiceProcess, method: str, path: str, body: bytes | None, headers: dict[str, str]
) -> http.RawResponse:
    return asyncio.run(http.request(svc.port, method, path, body=body, headers=headers))


def _products_and_jobs(svc: ServiceProcess) -> list[list[dict[str, Any]]]:
    return [
        db.query(svc.database, "SELECT * FROM products ORDER BY id"),
        db.query(svc.database, "SELECT id, kind, payload FROM jobs ORDER BY id"),
    ]


def test_table_is_big_enough() -> None:
    assert len(CASES) >= 20
    assert len({c.id for c in CASES}) == len(CASES)
    assert len({c.id for c in EDIT_CASES}) == len(EDIT_CASES) >= 40


@pytest.mark.parametrize("case", EDIT_CASES, ids=[c.id for c in EDIT_CASES])
async def test_bad_change_or_delete(edit_api: ServiceProcess, case: Case) -> None:
    before = _products_and_jobs(edit_api)
    assert [(p["nama"], p["version"], p["deleted_at"] is None) for p in before[0]] == [
        ("Kopi", 1, True),
        ("Teh", 2, False),
    ]
    resp = await http.request(
        edit_api.port,
        case.method,
        case.path,
        body=case.body,
        headers=[*case.headers.items(), *case.repeated],
        chunked=case.chunked,
    )
    assert resp.status == case.status, resp
    assert resp.headers.get("content-type", "").startswith("application/json"), resp
    payload = resp.json()
    assert isinstance(payload, dict) and set(payload) == {"error"}, payload
    assert isinstance(payload["error"], str) and payload["error"].strip(), payload
    assert case.says in payload["error"], payload
    assert len(payload["error"]) <= MESSAGE_MAX, payload
    assert "etag" not in resp.headers, resp  # only answers that carry the product have one
    # Nothing written: no field, no version, no deleted mark, no job.
    assert _products_and_jobs(edit_api) == before
    health = await http.request(edit_api.port, "GET", "/healthz", headers={})
    assert health.status == 200, health
    assert edit_api.returncode is None


async def test_after_the_bad_edits_a_good_one_goes_through(edit_api: ServiceProcess) -> None:
    ok = await http.request(edit_api.port, "PATCH", LIVE, body=CHANGE, headers=IF_1)
    assert ok.status == 200, ok
    assert ok.headers["etag"] == '"2"'
    assert ok.json()["harga"] == 2000
    server_errors = [r for r in edit_api.logs.snapshot() if r.get("level") in ("ERROR", "CRITICAL")]
    assert server_errors == [], server_errors


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
async def test_bad_request(api: ServiceProcess, case: Case) -> None:
    before = db.product_count(api.database)
    resp = await http.request(
        api.port,
        case.method,
        case.path,
        body=case.body,
        headers=[*case.headers.items(), *case.repeated],
        chunked=case.chunked,
    )
    assert resp.status == case.status, resp
    assert resp.headers.get("content-type", "").startswith("application/json"), resp
    payload = resp.json()
    assert isinstance(payload, dict), payload
    assert isinstance(payload.get("error"), str), payload
    assert payload["error"].strip(), payload
    assert case.says in payload["error"], payload
    assert len(payload["error"]) <= MESSAGE_MAX, payload
    assert db.product_count(api.database) == before == 0
    health = await http.request(api.port, "GET", "/healthz", headers={})
    assert health.status == 200, health
    assert api.returncode is None


async def test_leading_zeros_do_not_count_as_digits(api: ServiceProcess) -> None:
    # One at a time: together they would exceed aiohttp's 8190-byte request line.
    for query in (f"after={ZEROS}", f"limit={ZEROS}5"):
        page = await http.request(api.port, "GET", f"/produk?{query}")
        assert page.status == 200, page
        assert page.json() == []


async def test_malformed_http_is_a_400_and_a_warning_not_an_error(api: ServiceProcess) -> None:
    # Refused by aiohttp's parser before any handler runs; the answer is still
    # JSON, and toko decides how loudly to log the client's mistake.
    raw = (
        b"POST /produk HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"
    )
    resp = await http.send_raw("127.0.0.1", api.port, raw)
    assert resp.status == 400, resp
    assert resp.headers.get("content-type", "").startswith("application/json"), resp
    assert resp.json() == {"error": "Invalid character in chunk size"}, resp

    def parser_lines(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
        return [r for r in records if r.get("logger") == "aiohttp.server"] or None

    (line,) = await api.logs.async_wait_for(parser_lines, timeout=5, what="aiohttp.server line")
    assert line["level"] == "WARNING", line
    assert "chunk size" in line["message"], line
    assert "exception" not in line, line
    assert db.product_count(api.database) == 0


@pytest.mark.parametrize(
    "raw",
    [
        b"GET /produk HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n",
        b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"NOT HTTP AT ALL\r\n\r\n",
    ],
    ids=["header-over-8190-bytes", "request-line-over-8190-bytes", "no-http-method"],
)
async def test_requests_the_http_layer_refuses_get_a_json_error(
    api: ServiceProcess, raw: bytes
) -> None:
    resp = await http.send_raw("127.0.0.1", api.port, raw)
    assert resp.status == 400, resp
    assert resp.headers.get("content-type", "").startswith("application/json"), resp
    error = resp.json()["error"]
    assert isinstance(error, str) and error.strip(), resp
    # The client's 9000 bytes are not echoed back whole.
    assert len(error) <= MESSAGE_MAX, resp


async def test_afterwards_nothing_was_created_and_service_is_healthy(api: ServiceProcess) -> None:
    listing = await http.request(api.port, "GET", "/produk", headers={})
    assert listing.status == 200, listing
    assert listing.json() == []
    assert db.product_count(api.database) == 0
    assert db.job_states(api.database) == {}
    health = await http.request(api.port, "GET", "/healthz", headers={})
    assert health.status == 200, health
    assert health.json()["status"] == "ok"
    server_errors = [r for r in api.logs.snapshot() if r.get("level") in ("ERROR", "CRITICAL")]
    assert server_errors == [], server_errors
    # The same service still takes a good request: the 4xx were not a broken route.
    ok = await http.request(
        api.port, "POST", "/produk", body=_body({"nama": "Kopi", "harga": 1}), headers=JSON
    )
    assert ok.status == 201, ok
    assert db.product_count(api.database) == 1
