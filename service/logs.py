"""Logging: structured journal entries under systemd, JSON lines for pipes
and files, and one readable line per event for a person at a terminal.

Code attaches fields with ``extra={"JOB_ID": 7, ...}``; upper-case names become
journal fields (``journalctl JOB_ID=7``) or keys of the JSON line.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from systemd.journal import JournalHandler

from service.journal import JournalSender
from service.models import iso_utc

if TYPE_CHECKING:
    import asyncio

# Attributes every LogRecord has; anything else on a record came from extra=.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
}
# Built once: json.dumps() with options would build an encoder per line.
_ENCODER = json.JSONEncoder(default=str, ensure_ascii=False)


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields code attached with ``extra=``."""
    attrs = record.__dict__
    return {key: attrs[key] for key in attrs.keys() - _STANDARD if not key.startswith("_")}


class Throttle:
    """One log line per ``interval`` for a failure that repeats on every request or batch.

    While the disk is full or the database is down, a line per failed request
    floods the journal, and journald then drops lines of its own choosing. The
    first failure is logged at once; later ones within the interval are
    counted, and the next line logged says how many were held back. Not
    thread-safe: each thread that logs through one keeps its own.
    """

    def __init__(self, interval: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._quiet_until = float("-inf")
        self._held = 0

    def allow(self) -> int | None:
        """Whether to log this occurrence: None to hold it back (it is counted),
        else how many were held back since the last one logged."""
        now = self._clock()
        if now < self._quiet_until:
            self._held += 1
            return None
        held, self._held = self._held, 0
        self._quiet_until = now + self.interval
        return held

    def log(
        self,
        logger: logging.Logger,
        level: int,
        msg: str,
        *args: object,
        exc_info: BaseException | None = None,
        **fields: Any,
    ) -> None:
        held = self.allow()
        if held is None:
            return
        if held:
            msg += _HELD_BACK
            args = (*args, held, self.interval)
            fields["SUPPRESSED"] = held
        logger.log(level, msg, *args, exc_info=exc_info, extra=fields)


_HELD_BACK = " (%d more like this in the %g s before were not logged)"


class LoopErrorThrottle:
    """The event loop's exception handler: each distinct error once per interval.

    asyncio hands this handler the errors it has nobody to raise to, and some
    repeat without end. At the open-files limit, Python's accept loop (3.11
    to 3.13) reports every failed accept() and schedules a retry for each
    slot of the listen backlog; the retries multiply, and once the socket is
    closed at stop they fail again: thousands of lines a second, each with a
    traceback, for as long as files are short. The first of each error is
    logged as asyncio logs it; repeats within the interval are counted into
    the next line.
    """

    # Distinct errors followed at once; a flood of ever-new texts starts afresh.
    MAX_KINDS = 100

    def __init__(self, interval: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._throttles: dict[tuple[type[BaseException] | None, str], Throttle] = {}

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        message = str(context.get("message", "unhandled error in the event loop"))
        kind = (None, message) if exc is None else (type(exc), str(exc))
        throttle = self._throttles.get(kind)
        if throttle is None:
            if len(self._throttles) >= self.MAX_KINDS:
                self._throttles.clear()
            throttle = self._throttles[kind] = Throttle(self.interval, self._clock)
        held = throttle.allow()
        if held is None:
            return
        if held:
            context = {**context, "message": message + _HELD_BACK % (held, self.interval)}
        loop.default_exception_handler(context)


class JsonLineFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": iso_utc(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(record_fields(record))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return _ENCODER.encode(line)


class ConsoleFormatter(logging.Formatter):
    """Local time, level, message, then the fields as KEY=value: what someone
    trying toko in a terminal reads. A value with blanks, quotes or line
    breaks (an email's body) is quoted as JSON, so each event stays one line."""

    def format(self, record: logging.LogRecord) -> str:
        when = time.strftime("%H:%M:%S", time.localtime(record.created))
        line = f"{when} {record.levelname:<7} {record.getMessage()}"
        fields = record_fields(record)
        if fields:
            line += "  " + " ".join(f"{k}={_console_value(v)}" for k, v in sorted(fields.items()))
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _console_value(value: object) -> str:
    text = str(value)
    if text and not any(c.isspace() or c in '"=' for c in text):
        return text
    return _ENCODER.encode(text)


class StructuredJournalHandler(JournalHandler):  # type: ignore[misc]
    """systemd-python's JournalHandler, sending only our fields.

    The stock handler forwards every attribute of the record (``args``,
    ``msecs``, ...); journald drops the lower-case ones anyway, and building
    them costs time on every line.

    An entry's ``ERROR`` (why a job failed) is also appended to its message:
    ``journalctl`` shows the message alone, and "job failed, will retry"
    without the reason sends an admin looking for ``--output-fields``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # One lock for the handler and a JournalSender: its retry thread holds the
        # sender's lock while a finalizer may log (see JournalSender), and would
        # then wait for the handler's, held by a thread that waits for the sender's.
        sender_lock = getattr(self.send, "lock", None)
        if sender_lock is not None:
            self.lock = sender_lock

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            fields = dict(self._extra)
            fields.update((k, v) for k, v in record_fields(record).items() if k.isupper())
            if "ERROR" in fields:
                message = f"{message}: {fields['ERROR']}"
            if record.exc_info:
                fields["EXCEPTION_TEXT"] = self.formatter.formatException(record.exc_info)
            fields["PRIORITY"] = str(self.map_priority(record.levelno))
            fields["LOGGER"] = record.name
            fields.pop("MESSAGE", None)  # the message is send()'s first argument
            self.send(message, **fields)
        except Exception:
            self.handleError(record)

    def flush(self) -> None:
        # logging.shutdown() at exit: what journald has not taken yet.
        flush = getattr(self.send, "flush", None)
        if flush is not None:
            flush()


def stop_waiting_for_journald() -> None:
    """End the exit's wait for journald (JournalSender.flush) now: from a signal
    handler, such as a timer job's SIGTERM while it waits."""
    for handler in logging.getLogger().handlers:
        stop = getattr(getattr(handler, "send", None), "stop_waiting", None)
        if stop is not None:
            stop()


def setup_logging(
    level: str,
    *,
    journal: bool,
    identifier: str,
    flush_timeout: float = JournalSender.FLUSH_TIMEOUT_S,
) -> None:
    """Log to the journal, or to stdout: readable lines on a terminal, JSON
    lines otherwise; ``flush_timeout`` is how long the exit waits for a
    journald that does not read (JournalSender)."""
    # Per the logging HOWTO's "Optimization" advice: skip the stack walk for the
    # caller's file/line and the process/thread look-ups on every record. The
    # log mailer logs one line per email, so this is on the hot path.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler: logging.Handler
    if journal:
        handler = StructuredJournalHandler(
            sender_function=JournalSender(flush_timeout=flush_timeout),
            SYSLOG_IDENTIFIER=identifier,
        )
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(ConsoleFormatter() if sys.stdout.isatty() else JsonLineFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # aiohttp's access log would double the journal volume for every request.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
