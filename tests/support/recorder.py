"""A thread-safe, append-only record of observations that tests can wait on.

Producers (a socket thread, an SMTP server thread, a pipe reader) call
:meth:`Recorder.append`; consumers wait for a condition over everything recorded
so far, either blocking (:meth:`Recorder.wait_for`) or from an asyncio task
(:meth:`Recorder.async_wait_for`). Each append wakes the waiters, so nobody polls
with sleeps; the deadline is only there to fail a test that would hang.

The async waits here and in the sibling modules take a ``timeout`` argument
(ruff's ASYNC109 is silenced for them) rather than relying on the caller's
``asyncio.timeout``: the deadline is part of the failure message, which names
what was awaited and shows what was recorded instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

# A predicate returns something truthy (returned by the wait) or a falsy value.
Predicate = Callable[[Sequence[T]], R | None]


class Recorder(Generic[T]):
    """Append-only list of items of type ``T`` with condition waits."""

    def __init__(self, name: str = "recorder") -> None:
        self.name = name
        self._cond = threading.Condition()
        self._items: list[T] = []
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def append(self, item: T) -> None:
        """Record ``item`` and wake every waiter (callable from any thread)."""
        with self._cond:
            self._items.append(item)
        self.wake()

    def wake(self) -> None:
        """Wake every waiter so it re-evaluates its predicate (any thread)."""
        with self._cond:
            self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # that loop closed; its waiter is gone
                loop.call_soon_threadsafe(event.set)

    def snapshot(self) -> list[T]:
        """A copy of everything recorded so far, in order."""
        with self._cond:
            return list(self._items)

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def wait_for(self, predicate: Predicate[T, R], timeout: float, what: str = "") -> R:
        """Block until ``predicate(items)`` is truthy and return its value.

        Raises :class:`TimeoutError` naming ``what`` after ``timeout`` seconds.
        Exceptions raised by the predicate propagate (use that to abort early,
        e.g. when the process being watched has exited).
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                result = predicate(list(self._items))
                if result:
                    return result
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(self._timeout_message(what, timeout))
                self._cond.wait(remaining)

    async def async_wait_for(self, predicate: Predicate[T, R], timeout: float, what: str = "") -> R:  # noqa: ASYNC109
        """Like :meth:`wait_for`, but awaits without blocking the event loop."""
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        entry = (loop, event)
        with self._cond:
            self._waiters.append(entry)
        try:
            deadline = loop.time() + timeout
            while True:
                # Clear before looking: an append after this point sets it again.
                event.clear()
                result = predicate(self.snapshot())
                if result:
                    return result
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise TimeoutError(self._timeout_message(what, timeout))
                with contextlib.suppress(TimeoutError):  # look once more, then fail
                    await asyncio.wait_for(event.wait(), remaining)
        finally:
            with self._cond:
                self._waiters.remove(entry)

    def _timeout_message(self, what: str, timeout: float) -> str:
        items = self.snapshot()
        tail = "\n  ".join(repr(i)[:300] for i in items[-10:])
        return (
            f"{self.name}: {what or 'condition'} not met within {timeout:g}s; "
            f"{len(items)} item(s) recorded, last ones:\n  {tail}"
        )
