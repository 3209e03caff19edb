"""A raw HTTP/1.1 client over asyncio streams, for requests a library would "fix".

:func:`request` sends exactly the bytes it is given (invalid UTF-8, no or wrong
Content-Type, chunked bodies, any method, a header twice: give ``headers`` as pairs)
with ``Connection: close`` and reads the whole response. Use aiohttp's
ClientSession for well-formed traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# A mapping, or (name, value) pairs when a header is to be sent more than once.
Headers = Mapping[str, str] | Iterable[tuple[str, str]]


@dataclass(frozen=True)
class RawResponse:
    status: int
    reason: str
    headers: dict[str, str]  # lower-case names; repeated headers joined with ", "
    body: bytes = field(repr=False)

    def json(self) -> Any:
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"RawResponse({self.status} {self.reason}, {self.headers}, {self.body[:300]!r})"


def build_request(
    method: str,
    path: str,
    *,
    host: str = "127.0.0.1",
    headers: Headers | None = None,
    body: bytes | None = None,
    chunked: bool = False,
) -> bytes:
    """The bytes of one request; Content-Length (or chunked framing) is added for a body."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: close"]
    pairs = headers.items() if isinstance(headers, Mapping) else headers or ()
    lines += [f"{k}: {v}" for k, v in pairs]
    payload = b""
    if body is not None:
        if chunked:
            lines.append("Transfer-Encoding: chunked")
            size = 8192
            for i in range(0, len(body), size):
                chunk = body[i : i + size]
                payload += f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
            payload += b"0\r\n\r\n"
        else:
            lines.append(f"Content-Length: {len(body)}")
            payload = body
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload


async def send_raw(host: str, port: int, data: bytes, timeout: float = 10.0) -> RawResponse:  # noqa: ASYNC109
    """Send ``data`` on a fresh connection and parse the response."""
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(data)
            # The server may answer (e.g. 413) before reading everything.
            with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                await writer.drain()
            raw = await reader.read()
        finally:
            writer.close()
            with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                await writer.wait_closed()
    return parse_response(raw)


async def request(
    port: int,
    method: str,
    path: str,
    *,
    body: bytes | None = None,
    headers: Headers | None = None,
    chunked: bool = False,
    host: str = "127.0.0.1",
    timeout: float = 10.0,  # noqa: ASYNC109
) -> RawResponse:
    data = build_request(method, path, host=host, headers=headers, body=body, chunked=chunked)
    return await send_raw(host, port, data, timeout)


def parse_response(raw: bytes) -> RawResponse:
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        raise ValueError(f"incomplete HTTP response: {raw[:300]!r}")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    _version, status, *reason = status_line.split(" ", 2)
    headers: dict[str, str] = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        key = name.strip().lower()
        value = value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = _dechunk(rest)
    elif "content-length" in headers:
        body = rest[: int(headers["content-length"])]
    else:
        body = rest
    return RawResponse(int(status), reason[0] if reason else "", headers, body)


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while True:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += data[:size]
        data = data[size + 2 :]
