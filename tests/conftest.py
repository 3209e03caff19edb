"""Shared fixtures: a real SMTP server and a factory of real toko-api processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.service import ServiceProcess
from tests.support.smtp import SmtpServer

ServiceFactory = Callable[..., ServiceProcess]


@pytest.fixture
def smtp() -> Iterator[SmtpServer]:
    with SmtpServer() as server:
        yield server


@pytest.fixture
def service_factory(tmp_path: Path) -> Iterator[ServiceFactory]:
    """``make(env=None, **ServiceProcess kwargs)`` -> an unstarted ServiceProcess.

    Every process made here shares ``tmp_path / "toko.db"`` unless told otherwise
    (so a restart sees the same store), and is killed and reaped at teardown,
    with its output printed (pytest shows it when the test failed).
    """
    made: list[ServiceProcess] = []

    def make(env: dict[str, str | None] | None = None, **kwargs: Any) -> ServiceProcess:
        kwargs.setdefault("database", tmp_path / "toko.db")
        svc = ServiceProcess(tmp_path / f"svc{len(made)}", env, **kwargs)
        made.append(svc)
        return svc

    yield make
    for svc in made:
        svc.close()
        if svc.proc is not None:
            print(svc.output_tail(60))
