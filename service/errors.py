"""Map every failure to a JSON error; no tracebacks ever reach a client."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.web_request import BaseRequest

from service.keys import SETTINGS
from service.logs import Throttle
from service.store.base import StoreError
from service.validation import InvalidInput, shortened

log = logging.getLogger("toko.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Every request fails alike while the store is down: log a sample, not each.
_STORE_FAILURES = Throttle()


def json_error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


def body_too_large(limit: int) -> str:
    return f"request body too large; the limit is {limit} bytes"


def _http_error_message(request: web.Request, exc: web.HTTPException) -> str:
    if isinstance(exc, web.HTTPNotFound):
        return f"not found: {shortened(request.path)}"
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        path = shortened(request.path)
        return f"method {request.method} is not allowed on {path}; allowed: {allowed}"
    if isinstance(exc, web.HTTPExpectationFailed):
        expect = shortened(request.headers.get(hdrs.EXPECT, ""))
        return f"Expect: {expect} is not supported; send 'Expect: 100-continue' or none"
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return body_too_large(request.app[SETTINGS].http.max_body_bytes)
    return exc.reason


class Refused(Exception):
    """A request we will not serve, carrying its exact answer (json_errors returns it)."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


def close_after(response: web.StreamResponse) -> None:
    """Close the connection after ``response``, from app.before_each_answer.

    aiohttp has chosen the Connection header by then: without saying so, the
    client would send its next request on a connection that closes after this
    answer, and get no answer to it.
    """
    response.force_close()
    response.headers[hdrs.CONNECTION] = "close"


def abandon_body(request: web.Request, response: web.Response) -> web.Response:
    """Answer without reading the rest of the body, and close the connection.

    Ending the body stream stops aiohttp from draining it after the answer
    (up to 10 s more, and a second log line when the body is broken).
    """
    request.content.feed_eof()
    response.force_close()
    return response


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except InvalidInput as exc:
        return json_error(400, str(exc))
    except Refused as refused:
        return refused.response
    except web.RequestPayloadError as exc:
        # The body did not arrive as its headers describe it (a bad chunk), so
        # no more of it can be read, and the connection is no longer trusted.
        detail = getattr(exc.__cause__, "message", None) or str(exc)
        return abandon_body(
            request, json_error(400, f"the request body could not be read: {detail}")
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return json_error(exc.status, _http_error_message(request, exc), headers)
    except StoreError as exc:
        _STORE_FAILURES.log(log, logging.ERROR, "storage failure: %s", exc, PATH=request.path)
        return json_error(503, "storage is unavailable; try again shortly")
    except Exception:
        log.exception("unhandled error", extra={"PATH": request.path})
        return json_error(500, "internal error; it has been logged")


def json_router_errors(request: web.Request, response: web.StreamResponse) -> None:
    """Before an answer is sent (app.before_each_answer): aiohttp's own error answers, made JSON.

    aiohttp checks the Expect header before any middleware runs, so its 417
    for anything but 100-continue never reaches json_errors; every other
    error raised as an HTTPException does, and arrives here as a plain
    Response. (Requests aiohttp cannot parse at all have no app, and no hook.)
    """
    if not isinstance(response, web.HTTPException) or response.status < 400:
        return
    body = json.dumps({"error": _http_error_message(request, response)}).encode()
    response.body = body
    response.content_type = "application/json"
    # aiohttp has set the length of the plain-text body by now.
    response.headers[hdrs.CONTENT_LENGTH] = str(len(body))


class ClientProtocolErrors(logging.Filter):
    """aiohttp logs a request it cannot parse as an ERROR with a traceback.

    That is the client's mistake, already answered with a 400: one WARNING line
    naming the problem keeps ``journalctl -p err`` for our own faults.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BadHttpMessage):
            # The parser's message may go on to draw a caret under the bad byte.
            problem = str(exc.message).partition("\n")[0].rstrip(": ")
            record.msg, record.args = "%s: %s (answered 400)", (record.getMessage(), problem)
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info, record.exc_text = None, None
        return True


class JsonProtocolErrors(web.RequestHandler):
    """A connection whose own error answers are JSON as well.

    aiohttp answers a request it cannot parse (broken framing, a header over
    8190 bytes) before any app code runs, so neither json_errors nor the
    response hooks see it: the answer was a plain-text 400, the one error a
    client could not read as ``{"error": ...}``.
    """

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        # aiohttp's own: it logs (ClientProtocolErrors makes that one line) and
        # refuses once part of an answer has been sent.
        plain = super().handle_error(request, status, exc, message)
        if status >= 500:
            text = "internal error; it has been logged"
        else:
            # The parser's message may go on to draw a caret under the bad byte.
            text = shortened((message or plain.reason).partition("\n")[0].rstrip(": "))
        response = json_error(status, text)
        response.force_close()
        return response


class JsonErrorsServer(web.Server):
    def __call__(self) -> web.RequestHandler:
        return JsonProtocolErrors(self, loop=self._loop, **self._kwargs)


class JsonErrorsRunner(web.AppRunner):
    """An AppRunner whose connections are JsonProtocolErrors."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # The app's server as made (its handler, request factory and settings);
        # only the class of the connections it makes changes, and aiohttp has
        # no setting for that. Those are aiohttp's internals: an aiohttp that
        # has changed them keeps its plain-text answers rather than fail every
        # connection (tests/integration/test_bad_input.py says which it is).
        if type(server) is web.Server and hasattr(server, "_loop") and hasattr(server, "_kwargs"):
            server.__class__ = JsonErrorsServer
        else:
            log.warning("this aiohttp's own error answers stay plain text, not JSON")
        return server
