"""What each system of the queue bench runs with (recorded in the results).

Defaults are the libraries' own (an empty dict), except where a measurement
fixes the concurrency. "Tuned" is our best setting for throughput, argued
beside each value. No library is imported here, so the unit tests (which run
without the bench extra) can check these.
"""

from __future__ import annotations

from typing import Any

# arq: arq.worker.Worker keyword arguments.
ARQ_TUNED: dict[str, Any] = {
    "max_jobs": 100,  # many no-op jobs in flight per poll (default 10)
    "poll_delay": 0.002,  # poll Redis every 2 ms (default 0.5 s: arq has no push)
    "queue_read_limit": 1000,  # job ids read per poll (default max(5 x max_jobs, 100))
    "keep_result": 0,  # no result key written per job (default 3600 s)
    "log_results": False,  # no per-job result line formatted (default on)
    "max_tries": 1,  # nothing here is retried
    "health_check_interval": 3600,
}

# procrastinate: {"worker": App.run_worker_async options, "pool": AsyncConnectionPool options}.
PROCRASTINATE_TUNED: dict[str, Any] = {
    "worker": {
        # procrastinate fetches one job per query, one query at a time; more
        # jobs in flight overlap each job's finish query with the next fetch.
        "concurrency": 20,
        "delete_jobs": "successful",  # finished rows do not pile up in the jobs table
        "fetch_job_polling_interval": 0.5,  # fallback poll (LISTEN/NOTIFY does the waking)
        "abort_job_polling_interval": 60.0,
        "update_heartbeat_interval": 30.0,
    },
    # A connection for every job in flight, the fetch and the listener
    # (psycopg_pool's default is 4).
    "pool": {"min_size": 22, "max_size": 22},
}


def settings_for(label: str, measure: str, concurrency: int) -> dict[str, Any]:
    """The worker settings of one system for one measurement (noop, sleep, latency)."""
    if label.startswith("toko"):
        return {"workers": concurrency}
    if label == "arq-default":
        return {}  # max_jobs is 10 by default
    if label == "arq-tuned":
        tuned = dict(ARQ_TUNED)
        if measure == "sleep":
            tuned["max_jobs"] = concurrency
        return tuned
    if label == "procrastinate-default":
        if measure == "sleep":
            return {"worker": {"concurrency": concurrency}}
        return {}
    if label == "procrastinate-tuned":
        tuned = {k: dict(v) for k, v in PROCRASTINATE_TUNED.items()}
        if measure == "sleep":
            tuned["worker"]["concurrency"] = concurrency
            tuned["pool"] = {"min_size": concurrency + 2, "max_size": concurrency + 2}
        return tuned
    raise ValueError(f"unknown system {label!r}")
