"""The engine client over two real embedded engines: affinity, balancing, failover, recovery."""

from __future__ import annotations

import asyncio
import time

import pytest

from infra.engine.client import EngineClient, EngineError, EngineRequestError
from infra.engine.server import start_embedded_engine

pytestmark = [pytest.mark.slow, pytest.mark.model]

SP = {"max_new_tokens": 3, "temperature": 0.0}


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def test_affinity_balancing_failover_and_recovery(smollm2):
    a = await start_embedded_engine(loaded=smollm2, max_batch_size=8)
    b = await start_embedded_engine(loaded=smollm2, max_batch_size=8)
    engines = {a.url: a, b.url: b}
    client = EngineClient([a.url, b.url], role="test", timeout_s=60, max_retries=2, health_interval_s=0.2, backoff_s=0.05)
    try:
        # Affinity: an episode's requests all land on one server.
        for key in ("episode-1", "episode-2", "episode-3"):
            before = {u: e.batcher.requests_total for u, e in engines.items()}
            for _ in range(3):
                await client.generate("Hello", sampling_params=SP, affinity_key=key)
            grew = [u for u, e in engines.items() if e.batcher.requests_total > before[u]]
            assert len(grew) == 1, key

        # No key: least-loaded, so concurrent requests spread over both servers.
        before = {u: e.batcher.requests_total for u, e in engines.items()}
        await asyncio.gather(*(client.generate("Hello", sampling_params=SP) for _ in range(8)))
        assert all(e.batcher.requests_total - before[u] >= 3 for u, e in engines.items())

        # A request in flight on a server that dies moves to the other one.
        key = next(k for k in (f"ep-{i}" for i in range(100)) if client._pick(k, set()).url == a.url)
        # ignore_eos: a sampled end-of-sequence must not end the request before A dies
        long_sp = {"max_new_tokens": 40, "ignore_eos": True}
        slow = asyncio.create_task(client.generate("Once upon a time", sampling_params=long_sp, affinity_key=key))
        while a.batcher.load == 0:
            await asyncio.sleep(0.01)
        port_a = _port(a.url)
        await a.stop()
        res = await slow
        assert len(res.output_ids) == 40
        assert not client.servers[0].healthy
        # while A is down everything (even A's episodes) goes to B
        before_b = b.batcher.requests_total
        for _ in range(3):
            await client.generate("Hi", sampling_params=SP, affinity_key=key)
        assert b.batcher.requests_total == before_b + 3
        assert (await client.health()) == {a.url: False, b.url: True}
        # a weight update while A is down reaches B and does not fail the caller
        from infra.engine.models import resolve

        await client.update_weights_from_disk(str(resolve("smollm2")), weight_version=3)
        assert b.batcher.weight_version == 3

        # A comes back on the same port (still at version 0): the background probe gives it
        # the latest weights, then A's episodes return to it.
        a2 = await start_embedded_engine(loaded=smollm2, port=port_a, max_batch_size=8)
        engines[a.url] = a2
        deadline = time.monotonic() + 120
        while not client.servers[0].healthy and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert client.servers[0].healthy and a2.batcher.weight_version == 3
        res = await client.generate("Hi", sampling_params=SP, affinity_key=key)
        assert a2.batcher.requests_total == 1 and res.weight_version == 3
        await a2.stop()
    finally:
        await client.close()
        await b.stop()
        if a.runner.server is not None:
            await a.stop()


async def test_bad_request_is_not_retried_and_dead_cluster_raises(smollm2):
    a = await start_embedded_engine(loaded=smollm2, max_batch_size=2)
    async with EngineClient([a.url], role="test", max_retries=3, backoff_s=0.01) as client:
        with pytest.raises(EngineRequestError) as err:
            await client.generate("Hi", sampling_params={"temperature": -2})
        assert err.value.status == 400 and "temperature" in err.value.message
        assert a.batcher.requests_total == 0
        await a.stop()
        with pytest.raises(EngineError, match="failed after 4 attempts"):
            await client.generate("Hi", sampling_params=SP)
    with pytest.raises(ValueError):
        EngineClient([])
