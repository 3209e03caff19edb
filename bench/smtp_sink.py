"""A real SMTP server taking ``--delay`` seconds per message, as its own process.

It wraps the test suite's aiosmtpd server (``tests.support.smtp.SmtpServer``)
so the bench and the tests exercise toko-api against the same SMTP peer, and
runs it in a separate process so its work never disturbs the load
generator's timing. It writes its port to ``--port-file`` once listening, and
appends one line per delivered message, ``<unix time>\\t<Message-ID>\\t<outcome>``,
to ``--record`` (flushed within 0.1 s), so the bench can count distinct
Message-IDs while it runs and across restarts. SIGTERM/SIGINT stop it.

``python -m bench.smtp_sink --delay 2 --record msgs.tsv --port-file port``
"""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path
from typing import TextIO

from tests.support.smtp import SmtpServer


def _flush(server: SmtpServer, out: TextIO, written: int) -> int:
    items = server.log.snapshot()
    now = time.time()
    for m in items[written:]:
        out.write(f"{now:.6f}\t{m.message_id}\t{m.outcome}\n")
    out.flush()
    return len(items)


def serve(delay: float, record: Path, port_file: Path) -> None:
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with SmtpServer() as server, record.open("a") as out:
        server.set_delay(delay)
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(server.port))
        tmp.rename(port_file)  # atomic: the bench never reads half a number
        print(f"smtp sink on 127.0.0.1:{server.port}, {delay}s per message", flush=True)
        written = 0
        while not stopping:
            written = _flush(server, out, written)
            time.sleep(0.1)
        server.stop()  # no message can complete after this: the tail below is complete
        written = _flush(server, out, written)
        arrived = len(server.arrivals)
    print(f"smtp sink stopped: {written} messages recorded, {arrived} arrived", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay", type=float, default=2.0, help="seconds per message")
    parser.add_argument("--record", type=Path, required=True, help="file to append to")
    parser.add_argument("--port-file", type=Path, required=True, help="where to write the port")
    args = parser.parse_args()
    serve(args.delay, args.record, args.port_file)


if __name__ == "__main__":
    main()
