"""Reusable real-part test helpers for toko (integration tests and the bench).

- :mod:`tests.support.smtp`: a real SMTP server (aiosmtpd) whose behaviour can be
  switched at run time (deliver, delay, fail temporarily, refuse permanently).
- :mod:`tests.support.notify`: a real AF_UNIX datagram socket receiving sd_notify
  messages, with timestamps.
- :mod:`tests.support.service`: ``toko-api`` as a real subprocess with a clean
  environment, its JSON-lines log, signals and exit codes.
- :mod:`tests.support.http`: a raw HTTP/1.1 client for requests a client library
  would "fix".
- :mod:`tests.support.db`: read-only queries on the service's SQLite file.
- :mod:`tests.support.recorder`: the thread-safe record-and-wait primitive the
  others share.
"""
