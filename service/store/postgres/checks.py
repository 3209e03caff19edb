"""What the PostgreSQL store checks of the server: encoding, durable commits,
idle sessions, and the clock every host compares leases with."""

from __future__ import annotations

import logging

import asyncpg  # type: ignore[import-untyped]  # no stubs shipped

from service.redaction import redact
from service.store.base import StoreError
from service.store.postgres.transport import COMMAND_TIMEOUT, PostgresTransport

log = logging.getLogger("toko.store")

# Leases and retry times are this host's wall clock, compared on every host:
# a clock this far from the database server's is worth a warning. Trouble
# (a job run twice at once) starts once it nears the lease, 30 s or more.
CLOCK_SKEW_WARN_SECONDS = 5.0

SERVER_TIME_SQL = "SELECT extract(epoch FROM clock_timestamp())::float8"


class PostgresChecks(PostgresTransport):
    async def _insist_on_utf8(self, conn: asyncpg.Connection) -> None:
        """Refuse a database that cannot hold every name a client may send.

        `createdb` takes the cluster's encoding, SQL_ASCII where initdb ran
        under the C locale (a Debian without locales). asyncpg talks UTF-8,
        and the server then fails every statement with a character beyond
        ASCII: each such product would be a 503 for good, not a bad start.
        """
        encoding = await conn.fetchval("SHOW server_encoding", timeout=COMMAND_TIMEOUT)
        if encoding != "UTF8":
            raise StoreError(
                f"the database {redact(self.url)} is in {encoding}, not UTF8, so names beyond"
                " ASCII cannot be stored: create it with createdb --encoding=UTF8"
                " --template=template0"
            )

    async def _insist_on_durable_commits(self, conn: asyncpg.Connection) -> None:
        """A 201 promises the product survives a crash, the database's included.

        With synchronous_commit off (a default some servers set for speed), a
        commit returns before its WAL is flushed, and a database crash loses
        the last fraction of a second of answered requests. toko's sessions
        then ask for on; any other value already flushes locally and is kept
        (remote_apply waits for standbys too).
        """
        setting = await conn.fetchval("SHOW synchronous_commit", timeout=COMMAND_TIMEOUT)
        if setting == "off":
            self._session_settings["synchronous_commit"] = "on"
            log.info(
                "the database's synchronous_commit is off: toko's own sessions use on,"
                " so that every 201 survives a database crash"
            )

    async def _stay_connected_while_idle(self, conn: asyncpg.Connection) -> None:
        """Keep the database's idle_session_timeout off toko's own sessions.

        Managed servers often set one (PostgreSQL 14+, per role or database).
        toko's connections are idle by design: the LISTEN connection waits for
        NOTIFYs and probes only every 30 s, pooled ones wait for requests.
        Under such a timeout the server closed the LISTEN connection every few
        seconds: a warning each time, and the jobs other processes enqueued
        while it reconnected waited for the sweep instead of starting at once.
        The pool is bounded (see the README), so nothing piles up.
        """
        # NULL before PostgreSQL 14, which has no such setting (and would
        # refuse it as a connection parameter).
        setting = await conn.fetchval(
            "SELECT current_setting('idle_session_timeout', true)", timeout=COMMAND_TIMEOUT
        )
        if setting not in (None, "0"):
            self._session_settings["idle_session_timeout"] = "0"
            log.info(
                "the database's idle_session_timeout is %s: toko's own sessions use 0 (none),"
                " since its LISTEN and pooled connections wait idle by design",
                setting,
            )

    async def _check_clock(self, conn: asyncpg.Connection) -> None:
        """Warn when this host's clock strays from the database server's, and
        say when it is back: every host compares leases with its own clock."""
        before = self._clock()
        server = await conn.fetchval(SERVER_TIME_SQL, timeout=COMMAND_TIMEOUT)
        skew = (before + self._clock()) / 2 - server
        skewed = abs(skew) > CLOCK_SKEW_WARN_SECONDS
        if skewed and not self._clock_skewed:
            log.warning(
                "this host's clock is %+.1f s off the database server's: job leases and"
                " retry times compare clocks across hosts, so keep them in sync (NTP)",
                skew,
                extra={"CLOCK_SKEW_SECONDS": round(skew, 1)},
            )
        elif self._clock_skewed and not skewed:
            log.info(
                "this host's clock agrees with the database server's again",
                extra={"CLOCK_SKEW_SECONDS": round(skew, 1)},
            )
        self._clock_skewed = skewed
