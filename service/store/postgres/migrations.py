"""Versioned PostgreSQL schema. Append new steps; never edit a shipped one.

The applied version lives in ``toko_schema``. Several toko-api instances may
start at once against one database: the whole upgrade runs in one transaction
that first takes an advisory lock, so one instance migrates while the others
wait and then find nothing left to do. DDL is transactional in PostgreSQL, so
a crash mid-upgrade leaves the previous version intact.

Times are epoch seconds (``double precision``), as in the SQLite schema, so
both backends share the models and the clock the tests set.
"""

from __future__ import annotations

import asyncpg  # type: ignore[import-untyped]  # no stubs shipped

from service.store.base import note_schema_migrated

# pg_advisory_xact_lock keys: "toko" in ASCII, then what the lock guards.
LOCK_NAMESPACE = 0x746F6B6F
MIGRATION_LOCK = (LOCK_NAMESPACE << 16) | 1
# The recap lock uses the two-int form: (RECAP_LOCK_CLASS, hashtext(period)).
RECAP_LOCK_CLASS = 0x746F6B72

# Sent in the enqueuing transaction (a trigger, so every path that inserts a
# job notifies): listeners hear it only once the job is committed.
JOBS_CHANNEL = "toko_jobs"

MIGRATIONS: tuple[str, ...] = (
    # 1: products, the job queue (the transactional outbox), recaps, and the
    #    NOTIFY that wakes idle workers on every instance.
    f"""
    CREATE TABLE products (
        id         bigserial PRIMARY KEY,
        nama       text      NOT NULL,
        harga      bigint    NOT NULL CHECK (harga >= 0),
        created_at double precision NOT NULL
    );
    CREATE INDEX products_created_at ON products (created_at);
    CREATE TABLE jobs (
        id           bigserial PRIMARY KEY,
        kind         text      NOT NULL,
        payload      jsonb     NOT NULL,
        state        text      NOT NULL DEFAULT 'pending'
                     CHECK (state IN ('pending', 'running', 'done', 'failed')),
        attempts     integer   NOT NULL DEFAULT 0,
        max_attempts integer   NOT NULL,
        run_at       double precision NOT NULL,
        lease_until  double precision,
        last_error   text,
        created_at   double precision NOT NULL,
        updated_at   double precision NOT NULL
    );
    -- Partial indexes: a claim reads only due or expired rows, however many are done.
    CREATE INDEX jobs_pending_due ON jobs (run_at, id) WHERE state = 'pending';
    CREATE INDEX jobs_running_lease ON jobs (lease_until) WHERE state = 'running';
    CREATE TABLE recaps (
        period         text    PRIMARY KEY,
        products_total bigint  NOT NULL,
        products_new   bigint  NOT NULL,
        job_id         bigint  REFERENCES jobs (id),
        created_at     double precision NOT NULL
    );
    CREATE FUNCTION toko_notify_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM pg_notify('{JOBS_CHANNEL}', '');
        RETURN NULL;
    END
    $$;
    CREATE TRIGGER jobs_notify AFTER INSERT ON jobs
        FOR EACH STATEMENT EXECUTE FUNCTION toko_notify_jobs();
    """,
    # 2: retention (toko-recap, toko-queue purge) deletes old done jobs by age.
    """
    CREATE INDEX jobs_done_updated_at ON jobs (updated_at) WHERE state = 'done';
    """,
    # 3: no NOTIFY for jobs inserted already leased: their own instance runs
    #    them, so waking every instance's claimer would only cost each a claim,
    #    and a NOTIFY serialises the commit it rides on.
    f"""
    CREATE OR REPLACE FUNCTION toko_notify_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF EXISTS (SELECT 1 FROM inserted WHERE state = 'pending') THEN
            PERFORM pg_notify('{JOBS_CHANNEL}', '');
        END IF;
        RETURN NULL;
    END
    $$;
    DROP TRIGGER jobs_notify ON jobs;
    CREATE TRIGGER jobs_notify AFTER INSERT ON jobs REFERENCING NEW TABLE AS inserted
        FOR EACH STATEMENT EXECUTE FUNCTION toko_notify_jobs();
    """,
    # 4: the Idempotency-Key a product was created with, so a retried POST
    #    finds it instead of making a second one.
    """
    ALTER TABLE products ADD COLUMN idempotency_key text;
    CREATE UNIQUE INDEX products_idempotency_key ON products (idempotency_key)
        WHERE idempotency_key IS NOT NULL;
    """,
    # 5: `toko-queue list --state failed` read the whole table. Partial, so
    #    the hot path (insert, claim, ack) never touches it.
    """
    CREATE INDEX jobs_failed_updated_at ON jobs (updated_at, id) WHERE state = 'failed';
    """,
    # 6: products can be changed and deleted (PATCH, DELETE /produk/{id}).
    #    version: 1 when created, +1 a change; the ETag is made of it.
    #    deleted_at: set by a delete, which keeps the row, so that recaps of
    #    past days and the jobs enqueued for it stay as they were.
    #    created_nama/created_harga: what the product was created with, kept
    #    by its first change (NULL: unchanged since), so that a POST retried
    #    with its Idempotency-Key still gets the first answer. A constant
    #    default (PostgreSQL 11 on) rewrites no row; the CHECK reads them once.
    """
    ALTER TABLE products
        ADD COLUMN version bigint NOT NULL DEFAULT 1 CHECK (version >= 1),
        ADD COLUMN deleted_at double precision,
        ADD COLUMN created_nama text,
        ADD COLUMN created_harga bigint;
    """,
    # 7: how many jobs are done and failed, the states jobs stay in (a week of
    #    done jobs by default, the dead letters), kept by triggers, so that
    #    /healthz, /metrics and the status line no longer count every one of
    #    them (90 ms at a million, on every host, every 5 s and at each
    #    scrape). Kept as changes appended, not as one row updated: no
    #    host's commit waits for another's lock on it, and a read folds them
    #    (service.store.postgres.queue). Pending and running are still
    #    counted: the live queue, and a POST or a claim fires no trigger.
    #    Deletes come in chunks (retention): one change a state a statement.
    #    A restore of an older backup (pg_restore --clean drops only what the
    #    archive holds) leaves this step's table and functions behind, with
    #    the replaced database's changes in it: they are made anew here.
    """
    DROP TABLE IF EXISTS job_count_changes;
    CREATE TABLE job_count_changes (
        id    bigserial PRIMARY KEY,
        state text   NOT NULL CHECK (state IN ('done', 'failed')),
        n     bigint NOT NULL
    );
    INSERT INTO job_count_changes (state, n)
        SELECT state, count(*) FROM jobs WHERE state IN ('done', 'failed') GROUP BY state;
    CREATE OR REPLACE FUNCTION toko_count_kept_job() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_OP = 'UPDATE' THEN
            IF OLD.state IN ('done', 'failed') THEN
                INSERT INTO job_count_changes (state, n) VALUES (OLD.state, -1);
            END IF;
        END IF;
        IF NEW.state IN ('done', 'failed') THEN
            INSERT INTO job_count_changes (state, n) VALUES (NEW.state, 1);
        END IF;
        RETURN NULL;
    END
    $$;
    CREATE TRIGGER jobs_count_kept_insert AFTER INSERT ON jobs FOR EACH ROW
        WHEN (NEW.state IN ('done', 'failed'))
        EXECUTE FUNCTION toko_count_kept_job();
    CREATE TRIGGER jobs_count_kept_update AFTER UPDATE OF state ON jobs FOR EACH ROW
        WHEN (OLD.state IS DISTINCT FROM NEW.state
              AND (OLD.state IN ('done', 'failed') OR NEW.state IN ('done', 'failed')))
        EXECUTE FUNCTION toko_count_kept_job();
    CREATE OR REPLACE FUNCTION toko_count_deleted_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO job_count_changes (state, n)
            SELECT state, -count(*) FROM deleted WHERE state IN ('done', 'failed') GROUP BY state;
        RETURN NULL;
    END
    $$;
    CREATE TRIGGER jobs_count_kept_delete AFTER DELETE ON jobs REFERENCING OLD TABLE AS deleted
        FOR EACH STATEMENT EXECUTE FUNCTION toko_count_deleted_jobs();
    """,
)

LATEST_VERSION = len(MIGRATIONS)
# The one-row table of the schema's version, as every toko has made it.
SCHEMA_TABLE = (
    "CREATE TABLE IF NOT EXISTS toko_schema ("
    " one boolean PRIMARY KEY DEFAULT true CHECK (one),"
    " version integer NOT NULL)"
)


class SchemaTooNew(RuntimeError):
    pass


async def migrate(conn: asyncpg.Connection) -> int:
    """Bring the schema up to date; return the version it was at before."""
    async with conn.transaction():
        # Wait for another instance's upgrade, or a restore, however long it
        # takes (systemd's start timeout bounds it): a lock_timeout or
        # statement_timeout of the role or database otherwise made toko-api
        # exit at start. Only this wait: the upgrade's own statements keep
        # the database's timeouts, which stop DDL queueing behind long
        # transactions and holding up every host.
        await conn.execute("SET LOCAL lock_timeout = 0; SET LOCAL statement_timeout = 0")
        await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK)
        await conn.execute(
            "SET LOCAL lock_timeout TO DEFAULT; SET LOCAL statement_timeout TO DEFAULT"
        )
        await conn.execute(SCHEMA_TABLE)
        before = await conn.fetchval("SELECT version FROM toko_schema")
        if before is None:
            before = 0
            await conn.execute("INSERT INTO toko_schema (version) VALUES (0)")
        if before > LATEST_VERSION:
            raise SchemaTooNew(
                f"database schema version {before} is newer than this toko ({LATEST_VERSION}); "
                "upgrade toko or restore a matching backup"
            )
        for version in range(before + 1, LATEST_VERSION + 1):
            await conn.execute(MIGRATIONS[version - 1])
            await conn.execute("UPDATE toko_schema SET version = $1", version)
    note_schema_migrated(int(before), LATEST_VERSION)
    return int(before)
