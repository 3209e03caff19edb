"""Logging: structured journal entries under systemd, JSON lines elsewhere.

Code attaches fields with ``extra={"JOB_ID": 7, ...}``; upper-case names become
journal fields (``journalctl JOB_ID=7``) or keys of the JSON line.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from service.models import iso_utc

# Attributes every LogRecord has; anything else on a record came from extra=.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonLineFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": iso_utc(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


def setup_logging(level: str, *, journal: bool, identifier: str) -> None:
    # Per the logging HOWTO's "Optimization" advice: skip the stack walk for the
    # caller's file/line and the process/thread look-ups on every record. The
    # log mailer logs one line per email, so this is on the hot path.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler: logging.Handler
    if journal:
        from systemd.journal import JournalHandler

        handler = JournalHandler(SYSLOG_IDENTIFIER=identifier)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(JsonLineFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # aiohttp's access log would double the journal volume for every request.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
