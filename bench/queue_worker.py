"""Entry point of the queue bench's worker and producer processes.

``python -m bench.queue_worker <system> worker|produce ...`` with ``<system>``
one of :data:`SYSTEMS`; the options are bench.queue_common's. One entry
module for all systems, so no system's module runs as ``__main__``.
"""

from __future__ import annotations

import importlib
import sys

from bench.queue_common import Adapter, main

SYSTEMS = {
    "toko": "bench.queue_toko",
    "arq": "bench.queue_arq",
    "procrastinate": "bench.queue_procrastinate",
}


def adapter(system: str) -> Adapter:
    module = importlib.import_module(SYSTEMS[system])
    found: Adapter = module.ADAPTER
    return found


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in SYSTEMS:
        sys.exit(f"usage: python -m bench.queue_worker {{{','.join(SYSTEMS)}}} worker|produce ...")
    sys.exit(main(adapter(sys.argv[1]), sys.argv[2:]))
