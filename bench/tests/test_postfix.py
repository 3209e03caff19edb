"""Postfix's smtp-sink as the bench runs it: unpacked, started, counting, stopped."""

from __future__ import annotations

import shutil
import smtplib
from pathlib import Path

import pytest

from bench.postfix import PostfixTools, ensure_tools, postfix_sink, read_counts
from bench.procs import port_accepts

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tools() -> PostfixTools:
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb")):
        pytest.skip("needs apt-get and dpkg-deb (Debian) to unpack the postfix package")
    return ensure_tools()


def test_ensure_tools_is_idempotent(tools: PostfixTools) -> None:
    again = ensure_tools()
    assert again == tools
    assert tools.sink.is_file() and tools.source.is_file()
    assert (tools.man_dir / "man1" / "smtp-sink.1.gz").is_file()


def test_sink_takes_mail_counts_it_and_stops(tools: PostfixTools, tmp_path: Path) -> None:
    with postfix_sink(tmp_path, "sink", tools=tools) as sink:
        assert sink.url == f"smtp://127.0.0.1:{sink.port}"
        assert sink.messages() == 0
        with smtplib.SMTP("127.0.0.1", sink.port, timeout=10) as client:
            client.sendmail("shop@example.com", ["admin@example.com"], "Subject: a\r\n\r\none\r\n")
            assert sink.wait_messages(1, timeout=5) == 1
            # A kept connection, as toko's workers keep theirs.
            client.sendmail("shop@example.com", ["admin@example.com"], "Subject: b\r\n\r\ntwo\r\n")
            assert sink.wait_messages(2, timeout=5) == 2
        pid, port = sink.proc.pid, sink.port
    assert sink.proc.proc.poll() is not None, f"smtp-sink {pid} still runs"
    assert not port_accepts(port)
    assert read_counts(tmp_path / "sink.log").messages == 2


def test_counts_ignore_a_torn_record(tmp_path: Path) -> None:
    log = tmp_path / "sink.log"
    log.write_bytes(b"sess=1 quit=1 mesg=7\rsess=1 quit=1 mesg=8\rsess=1 quit=1 mesg=9")
    assert read_counts(log).messages == 8
    assert read_counts(tmp_path / "missing.log").messages == 0
