"""How busy the engines are, read from their own `/metrics`: the autoscaler's second signal.

Owns one question, asked over HTTP so that it reads the same whether an engine runs in
the driver's process, as a Ray actor on another node, or is an SGLang server: how many
requests each engine holds now (waiting or decoding). The embedded engine exports
`engine_queue_depth` (infra/metrics.EngineServerMetrics); SGLang, launched with
`--enable-metrics`, exports `sglang:num_queue_reqs` and `sglang:num_running_reqs`, whose
sum is the same quantity. An engine that does not answer, or exports neither, reads as
None (unknown); `max_queue_depth` leaves it out, so with no answer at all nothing is known
to be full and the task backlog alone decides.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

EMBEDDED = ("engine_queue_depth",)
SGLANG = ("sglang:num_queue_reqs", "sglang:num_running_reqs")


def parse_queue_depth(text: str) -> float | None:
    """Requests held by the engine whose /metrics text this is (summed over label sets), or None."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in EMBEDDED + SGLANG:
                found[sample.name] = found.get(sample.name, 0.0) + float(sample.value)
    for names in (EMBEDDED, SGLANG):
        if any(n in found for n in names):
            return sum(found.get(n, 0.0) for n in names)
    return None


async def queue_depth(session: aiohttp.ClientSession, url: str, timeout_s: float = 2.0) -> float | None:
    """One engine's queue depth from `url`/metrics; None when it does not answer or exports none."""
    try:
        async with session.get(f"{url.rstrip('/')}/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                return None
            return parse_queue_depth(await r.text())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        log.debug("queue depth of %s unknown: %s", url, exc)
        return None


async def max_queue_depth(session: aiohttp.ClientSession, urls: list[str]) -> float:
    """The fullest engine's queue depth among `urls` (0 when none answers: nothing known to be full)."""
    depths = await asyncio.gather(*(queue_depth(session, u) for u in urls))
    return max((d for d in depths if d is not None), default=0.0)
