"""Load and start-up benchmarks for toko-api (``make bench`` = ``python -m bench``).

Scenarios (see ``python -m bench --help``):

- ``throughput``: durable ``POST /produk`` with wrk at 1, 16, 64 and 256
  connections, toko-api side by side with an in-memory aiohttp baseline
  (``bench.baseline_app``).
- ``backlog``: the tutorial's scenario, a constant-rate open-loop load while
  every email takes 2 s at a real SMTP server; then proves no job was lost.
- ``startup``: spawn to ``READY=1`` on a real NOTIFY_SOCKET, and idle RSS.
- ``postgres``: POST throughput with one and two toko-api instances on one
  PostgreSQL, and jobs/s drained, beside SQLite (``bench.scenario_postgres``).
- ``queue``, ``tutorial``, ``disk``: the queue against arq and procrastinate,
  the tutorial's Go program, and open-loop POSTs on the real disk.
- ``sink``, ``peers``, ``email``: Postfix's smtp-sink's own ceiling
  (``bench.postfix``), the peer stacks users would build instead, and
  toko-api's email drain on one core.

Results go to ``bench/results/<timestamp>.json`` and ``bench/results/latest.md``.
"""
