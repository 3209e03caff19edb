"""Load and start-up benchmarks for toko-api (``make bench`` = ``python -m bench``).

Scenarios (see ``python -m bench --help``):

- ``throughput``: durable ``POST /produk`` with wrk at 16 connections, toko-api
  side by side with an in-memory aiohttp baseline (``bench.baseline_app``).
- ``backlog``: the tutorial's scenario, a constant-rate open-loop load while
  every email takes 2 s at a real SMTP server; then proves no job was lost.
- ``startup``: spawn to ``READY=1`` on a real NOTIFY_SOCKET, and idle RSS.
- ``postgres``: POST throughput with one and two toko-api instances on one
  PostgreSQL, and jobs/s drained, beside SQLite (``bench.scenario_postgres``).

Results go to ``bench/results/<timestamp>.json`` and ``bench/results/latest.md``.
"""
