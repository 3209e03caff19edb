"""A minimal keep-alive HTTP/1.1 client pool for the open loop, cheap in CPU.

aiohttp's client spends about 250 µs of CPU per POST (measured with
``time.process_time`` at 2,000/s): at that rate most of a core, on a 2-core
machine where toko-api needs the other. This pool does only what the bench
needs against aiohttp servers on 127.0.0.1: one request at a time per
connection, ``Content-Length`` bodies (no chunked encoding), keep-alive unless
the server says ``Connection: close``. Up to ``limit`` connections are opened
on demand; a request finding none idle waits in FIFO order, as aiohttp's
connector does, and that wait counts as latency.
"""

from __future__ import annotations

import asyncio


class HttpError(Exception):
    """The connection failed or the response could not be read."""


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed = False
        self.keep_alive = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(HttpError(f"connection lost: {exc or 'EOF'}"))

    def data_received(self, data: bytes) -> None:
        self.buf += data
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        head_end = self.buf.find(b"\r\n\r\n")
        if head_end < 0:
            return
        try:
            status, length, keep_alive = parse_head(bytes(self.buf[:head_end]))
        except ValueError as exc:
            waiter.set_exception(HttpError(str(exc)))
            return
        end = head_end + 4 + length
        if len(self.buf) < end:
            return
        body = bytes(self.buf[head_end + 4 : end])
        del self.buf[:end]
        self.keep_alive = keep_alive
        waiter.set_result((status, body))


def parse_head(head: bytes) -> tuple[int, int, bool]:
    """(status, Content-Length, keep-alive) of a response head without its final CRLFCRLF."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise ValueError(f"bad status line {lines[0][:80]!r}")
    status = int(parts[1])
    length = 0
    keep_alive = parts[0] == b"HTTP/1.1"
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        key = name.strip().lower()
        if key == b"content-length":
            length = int(value.strip())
        elif key == b"connection":
            keep_alive = value.strip().lower() == b"keep-alive"
        elif key == b"transfer-encoding":
            raise ValueError("chunked responses are not supported")
    return status, length, keep_alive


class Pool:
    """Up to ``limit`` keep-alive connections to ``host:port``, FIFO among waiters."""

    def __init__(self, host: str, port: int, limit: int, request_timeout_s: float) -> None:
        self.host = host
        self.port = port
        self.request_timeout_s = request_timeout_s
        self.slots = asyncio.Semaphore(limit)
        self.idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                return conn
        try:
            _, conn = await asyncio.get_running_loop().create_connection(
                _Conn, self.host, self.port
            )
        except OSError as exc:
            raise HttpError(f"connect: {exc}") from exc
        return conn

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        """Send one complete request (head and body); return (status, body).

        The timeout covers the wait for a connection too, as aiohttp's total does.
        """
        async with asyncio.timeout(self.request_timeout_s), self.slots:
            conn = await self._connect()
            conn.waiter = asyncio.get_running_loop().create_future()
            reusable = False
            try:
                assert conn.transport is not None
                conn.transport.write(raw)
                result = await conn.waiter
                reusable = conn.keep_alive and not conn.closed
                return result
            finally:
                conn.waiter = None
                if reusable:
                    self.idle.append(conn)
                elif conn.transport is not None:
                    conn.transport.close()

    def close(self) -> None:
        for conn in self.idle:
            if conn.transport is not None:
                conn.transport.close()
        self.idle.clear()
