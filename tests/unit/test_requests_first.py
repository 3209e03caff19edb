"""Requests before jobs (service.requests_first): when a job is held, and for how long.

The two clocks are faked (wall and the loop thread's CPU); the waiting is a
real asyncio wait, and the middleware is tested on a real socket.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from service import requests_first
from service.requests_first import RequestsFirst


class Clocks:
    """Wall and CPU time under the test's hand: ``run(s)`` spends s of both."""

    def __init__(self) -> None:
        self.wall = 1000.0
        self.cpu = 5.0

    def run(self, seconds: float, *, busy: float) -> None:
        """``seconds`` pass, ``busy`` of them in the loop's thread."""
        self.wall += seconds
        self.cpu += seconds * busy


def gate(clocks: Clocks) -> RequestsFirst:
    return RequestsFirst(clock=lambda: clocks.wall, cpu_clock=lambda: clocks.cpu)


def busy_gate(clocks: Clocks, share: float = 0.9) -> RequestsFirst:
    """A gate that has seen one window of the loop ``share`` busy, a request in flight."""
    first = gate(clocks)
    first.in_flight = 1
    assert first._loop_busy() is False  # the first question starts a window
    clocks.run(1.5 * requests_first.WINDOW_SECONDS, busy=share)
    return first


async def pending_after_a_few_pauses(task: asyncio.Task[None]) -> bool:
    await asyncio.sleep(3 * requests_first.PAUSE_SECONDS)
    return not task.done()


async def test_with_no_request_in_flight_a_job_goes_at_once() -> None:
    clocks = Clocks()
    first = busy_gate(clocks)
    first.in_flight = 0
    await first.turn()
    assert first.held == 0


async def test_a_loop_busy_under_half_the_window_lets_a_job_go() -> None:
    clocks = Clocks()
    first = busy_gate(clocks, share=requests_first.BUSY_SHARE - 0.05)
    await first.turn()
    assert first.held == 0


async def test_a_busy_loop_holds_the_job_until_no_request_is_in_flight() -> None:
    clocks = Clocks()
    first = busy_gate(clocks)
    task = asyncio.create_task(first.turn())
    assert await pending_after_a_few_pauses(task)  # the fake wall clock stands still
    assert first.held == 1
    first.in_flight = 0
    async with asyncio.timeout(5):
        await task


async def test_a_held_job_goes_once_the_loop_has_room_again() -> None:
    clocks = Clocks()
    first = busy_gate(clocks)
    task = asyncio.create_task(first.turn())
    assert await pending_after_a_few_pauses(task)
    clocks.run(1.5 * requests_first.WINDOW_SECONDS, busy=0.2)  # the load eased
    async with asyncio.timeout(5):
        await task


async def test_under_a_load_that_never_ends_a_job_waits_at_most_the_longest_wait() -> None:
    clocks = Clocks()
    first = busy_gate(clocks)
    task = asyncio.create_task(first.turn())
    assert await pending_after_a_few_pauses(task)
    # Busy all along (window after window), until 1 ms short of the default bound.
    for _ in range(3):
        clocks.run(0.03, busy=1.0)
        assert await pending_after_a_few_pauses(task)
    clocks.run(requests_first.LONGEST_WAIT_SECONDS - 0.09 - 0.001, busy=1.0)
    assert await pending_after_a_few_pauses(task)
    clocks.run(0.002, busy=1.0)
    async with asyncio.timeout(5):
        await task
    assert requests_first.LONGEST_WAIT_SECONDS == 0.1  # 3 workers: 30 jobs/s at the least


async def test_a_window_nobody_asked_about_for_long_says_nothing_about_now() -> None:
    clocks = Clocks()
    first = busy_gate(clocks)
    clocks.run(5 * requests_first.WINDOW_SECONDS, busy=1.0)  # busy, but long ago asked
    await first.turn()
    assert first.held == 0


async def test_the_middleware_counts_requests_in_flight_on_a_real_socket() -> None:
    first = RequestsFirst()
    entered = asyncio.Event()
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        entered.set()
        await release.wait()
        return web.json_response({"ok": True})

    async def failing(request: web.Request) -> web.Response:
        raise RuntimeError("a bug")

    app = web.Application(middlewares=[first.middleware])
    app.router.add_get("/slow", slow)
    app.router.add_get("/fail", failing)
    async with TestClient(TestServer(app)) as client:
        request = asyncio.create_task(client.get("/slow"))
        async with asyncio.timeout(5):
            await entered.wait()
        assert first.in_flight == 1
        release.set()
        async with asyncio.timeout(5):
            response = await request
        assert response.status == 200
        assert first.in_flight == 0
        response = await client.get("/fail")  # an exception still ends the count
        assert response.status == 500
        assert first.in_flight == 0
