"""Versioned SQLite schema. Append new steps; never edit a shipped one.

The applied version lives in ``PRAGMA user_version``; all pending steps run
in one transaction together with the version bump (SQLite's DDL is
transactional), so a crash mid-upgrade leaves the previous version intact.
"""

from __future__ import annotations

import sqlite3

from service.store.base import note_schema_migrated

MIGRATIONS: tuple[str, ...] = (
    # 1: products and the job queue (the transactional outbox).
    """
    CREATE TABLE products (
        id         INTEGER PRIMARY KEY,
        nama       TEXT    NOT NULL,
        harga      INTEGER NOT NULL CHECK (harga >= 0),
        created_at REAL    NOT NULL
    );
    CREATE INDEX products_created_at ON products (created_at);
    CREATE TABLE jobs (
        id           INTEGER PRIMARY KEY,
        kind         TEXT    NOT NULL,
        payload      TEXT    NOT NULL,
        state        TEXT    NOT NULL DEFAULT 'pending'
                     CHECK (state IN ('pending', 'running', 'done', 'failed')),
        attempts     INTEGER NOT NULL DEFAULT 0,
        max_attempts INTEGER NOT NULL,
        run_at       REAL    NOT NULL,
        lease_until  REAL,
        last_error   TEXT,
        created_at   REAL    NOT NULL,
        updated_at   REAL    NOT NULL
    );
    CREATE INDEX jobs_state_run_at ON jobs (state, run_at);
    """,
    # 2: one row per recap period, so a second run for the same period is a no-op.
    """
    CREATE TABLE recaps (
        period         TEXT    PRIMARY KEY,
        products_total INTEGER NOT NULL,
        products_new   INTEGER NOT NULL,
        job_id         INTEGER REFERENCES jobs (id),
        created_at     REAL    NOT NULL
    );
    """,
    # 3: the Idempotency-Key a product was created with, so a retried POST
    #    finds it instead of making a second one.
    """
    ALTER TABLE products ADD COLUMN idempotency_key TEXT;
    CREATE UNIQUE INDEX products_idempotency_key ON products (idempotency_key)
        WHERE idempotency_key IS NOT NULL;
    """,
    # 4: done and failed jobs by when they last changed, for retention and
    #    `toko-queue list`, which otherwise walked every done job. Partial, so
    #    the hot path (insert, claim) never touches them and an ack adds one
    #    entry at the index's end. `state` leads though constant: without
    #    statistics SQLite's planner prefers an equality on jobs_state_run_at
    #    to a range or an ordered walk here; with it, this index wins on both.
    #    The rowid ends every index entry, so the order is (updated_at, id).
    """
    CREATE INDEX jobs_done_updated_at ON jobs (state, updated_at) WHERE state = 'done';
    CREATE INDEX jobs_failed_updated_at ON jobs (state, updated_at) WHERE state = 'failed';
    """,
    # 5: products can be changed and deleted (PATCH, DELETE /produk/{id}).
    #    version: 1 when created, +1 a change; the ETag is made of it.
    #    deleted_at: set by a delete, which keeps the row, so that recaps of
    #    past days and the jobs enqueued for it stay as they were.
    #    created_nama/created_harga: what the product was created with, kept
    #    by its first change (NULL: unchanged since), so that a POST retried
    #    with its Idempotency-Key still gets the first answer. Each ADD
    #    COLUMN only changes the schema: no row is rewritten.
    """
    ALTER TABLE products ADD COLUMN version INTEGER NOT NULL DEFAULT 1 CHECK (version >= 1);
    ALTER TABLE products ADD COLUMN deleted_at REAL;
    ALTER TABLE products ADD COLUMN created_nama TEXT;
    ALTER TABLE products ADD COLUMN created_harga INTEGER;
    """,
    # 6: how many jobs are done and failed, kept by triggers: the states
    #    jobs stay in (a week of done jobs by default, the dead letters), so
    #    that /healthz, /metrics and the status line no longer count every
    #    one of them (82 ms at a million, every 5 s and at each scrape).
    #    Pending and running are still counted: the live queue, and a POST
    #    or a claim fires no trigger here (keeping those too cost each
    #    commit a page of the log). Any process's change goes through them.
    """
    CREATE TABLE job_counts (
        state TEXT    PRIMARY KEY CHECK (state IN ('done', 'failed')),
        n     INTEGER NOT NULL
    ) WITHOUT ROWID;
    INSERT INTO job_counts (state, n)
        SELECT column1, (SELECT count(*) FROM jobs WHERE state = column1)
        FROM (VALUES ('done'), ('failed'));
    CREATE TRIGGER job_counts_insert AFTER INSERT ON jobs
        WHEN NEW.state IN ('done', 'failed') BEGIN
        UPDATE job_counts SET n = n + 1 WHERE state = NEW.state;
    END;
    CREATE TRIGGER job_counts_delete AFTER DELETE ON jobs
        WHEN OLD.state IN ('done', 'failed') BEGIN
        UPDATE job_counts SET n = n - 1 WHERE state = OLD.state;
    END;
    CREATE TRIGGER job_counts_update AFTER UPDATE OF state ON jobs
        WHEN OLD.state IS NOT NEW.state
        AND (OLD.state IN ('done', 'failed') OR NEW.state IN ('done', 'failed')) BEGIN
        UPDATE job_counts SET n = n - 1 WHERE state = OLD.state;
        UPDATE job_counts SET n = n + 1 WHERE state = NEW.state;
    END;
    """,
)

LATEST_VERSION = len(MIGRATIONS)


def migrate(conn: sqlite3.Connection) -> int:
    """Bring the schema up to date; return the version it was at before."""
    # Read the version inside the write transaction: two processes opening a
    # new file at once (toko-api and a toko-alert at first boot) must not both
    # decide to create the tables.
    conn.execute("BEGIN IMMEDIATE")
    try:
        (before,) = conn.execute("PRAGMA user_version").fetchone()
        if before > LATEST_VERSION:
            raise RuntimeError(
                f"database schema version {before} is newer than this toko ({LATEST_VERSION}); "
                "upgrade toko or restore a matching backup"
            )
        for version in range(before + 1, LATEST_VERSION + 1):
            for statement in statements_of(MIGRATIONS[version - 1]):
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {version}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    note_schema_migrated(int(before), LATEST_VERSION)
    return int(before)


def statements_of(script: str) -> list[str]:
    """``script``'s statements, one by one: executescript() would commit on its
    own, and the step must stay one transaction. A trigger's body holds
    semicolons of its own, so a statement ends at the first one that ends it
    whole (sqlite3.complete_statement)."""
    statements, part = [], ""
    for piece in script.split(";"):
        part += piece + ";"
        if sqlite3.complete_statement(part):
            statements.append(part.strip())
            part = ""
    return [s for s in statements if s != ";"]
