"""``Expect: 100-continue``: a client's body is asked for only once it is wanted.

Such a client holds its body back until the server says ``100 Continue``, or
answers at once. aiohttp's own Expect handler says it as soon as the headers
are in, before the token, Content-Type and declared-size checks, so a client
refused anyway uploaded its whole body first. Here the route's handler asks
for the body (:func:`continue_if_awaited`) once every check that needs none has
passed, and a request refused before that closes without waiting for a body
that is not coming (:func:`close_if_body_withheld`).
"""

from __future__ import annotations

from aiohttp import HttpVersion11, hdrs, web

from service.errors import close_after

# Set on a request whose 100 Continue was held back, until it is sent.
_WITHHELD = "toko.continue_withheld"


async def continue_later(request: web.Request) -> None:
    """A route's Expect handler: no ``100 Continue`` yet; unknown expectations get 417."""
    expect = request.headers.get(hdrs.EXPECT, "")
    if request.version != HttpVersion11:
        return  # HTTP/1.0 has no 100 Continue: its clients send the body at once
    if expect.lower() != "100-continue":
        raise web.HTTPExpectationFailed(text=f"Unknown Expect: {expect}")
    request[_WITHHELD] = True


async def continue_if_awaited(request: web.Request) -> None:
    """Send ``100 Continue`` if the client is holding its body back for it."""
    if request.get(_WITHHELD) and not request.content.total_bytes:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        # As aiohttp's own handler does: the answer's size counts from here.
        request.writer.output_size = 0
    request[_WITHHELD] = False


def close_if_body_withheld(request: web.Request, response: web.StreamResponse) -> None:
    """Before an answer is sent (app.before_each_answer): one given instead of
    ``100 Continue`` closes the connection.

    The client will not send the body now (RFC 9110, 10.1.1), so waiting for
    it, as aiohttp does for an unread body (up to 10 s), only holds the
    connection. Nothing of the body has arrived, so closing resets nothing.
    """
    if request.get(_WITHHELD) and not request.content.total_bytes:
        request.content.feed_eof()
        close_after(response)
