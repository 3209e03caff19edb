"""On a terminal, one readable line per event; JSON lines into a pipe.

The terminal is a real pseudo-terminal (pty), the pipe a real pipe: what
``make run`` in a terminal and ``toko-api | jq`` each get.
"""

from __future__ import annotations

import json
import logging
import os
import pty
import re
import subprocess
import sys

from service.logs import ConsoleFormatter

PROGRAM = (
    "import logging\n"
    "from service.logs import setup_logging\n"
    "setup_logging('INFO', journal=False, identifier='toko-api')\n"
    "logging.getLogger('toko.worker').info(\n"
    "    'email logged', extra={'JOB_ID': 7, 'BODY': 'Produk baru:\\nKopi \"Luwak\"'})\n"
)


def _run(stdout: int) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-c", PROGRAM], stdout=stdout, stderr=subprocess.PIPE, check=True
    )


def test_a_terminal_gets_one_readable_line_per_event() -> None:
    controller, terminal = pty.openpty()
    try:
        _run(terminal)
        os.close(terminal)
        terminal = -1
        out = b""
        while chunk := _read(controller):
            out += chunk
    finally:
        if terminal != -1:
            os.close(terminal)
        os.close(controller)
    (line,) = out.decode().splitlines()
    assert re.fullmatch(
        r'\d\d:\d\d:\d\d INFO    email logged  BODY="Produk baru:\\nKopi \\"Luwak\\"" JOB_ID=7',
        line,
    ), line


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 4096)
    except OSError:  # EIO: the terminal's other end is closed, all is read
        return b""


def test_a_pipe_gets_json_lines() -> None:
    out = _run(subprocess.PIPE).stdout.decode()
    (line,) = out.splitlines()
    record = json.loads(line)
    assert record["message"] == "email logged"
    assert record["JOB_ID"] == 7
    assert record["BODY"] == 'Produk baru:\nKopi "Luwak"'


def test_an_exception_follows_its_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("toko", logging.ERROR, "", 0, "failed", None, sys.exc_info())
    first, *rest = ConsoleFormatter().format(record).splitlines()
    assert first.endswith("ERROR   failed")
    assert rest[-1] == "ValueError: boom"
