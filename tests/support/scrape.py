"""Read a toko-api's /metrics the way Prometheus does (its own text parser)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Scrape:
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float]
    content_type: str

    def value(self, name: str, **labels: str) -> float:
        """One sample's value; 0 for a labelled series not exported yet."""
        return self.samples.get((name, frozenset(labels.items())), 0.0)


async def scrape(session: aiohttp.ClientSession, base_url: str) -> Scrape:
    async with session.get(f"{base_url}/metrics") as resp:
        assert resp.status == 200, await resp.text()
        text = await resp.text()
        content_type = resp.headers["Content-Type"]
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return Scrape(samples, content_type)


async def scrape_until(
    session: aiohttp.ClientSession,
    base_url: str,
    condition: Callable[[Scrape], bool],
    timeout: float = 15.0,  # noqa: ASYNC109
) -> Scrape:
    """Scrape until ``condition`` holds: queue gauges have no event to await, like /healthz."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last = await scrape(session, base_url)
    while not condition(last):
        if loop.time() > deadline:
            raise AssertionError(f"metrics condition not met within {timeout}s: {last.samples}")
        await asyncio.sleep(0.05)
        last = await scrape(session, base_url)
    return last
