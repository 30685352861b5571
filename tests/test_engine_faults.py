"""Hostile requests against a real engine while good ones run: the good ones succeed, /health stays fast.

The engine is the real `dreamgym serve` in a subprocess (SmolLM2, an API key, a small
queue), reached over HTTP as a worker reaches it. Each probe is one row of issue 12's
table: NaN and 1e-45 temperatures, a 20 MB body, 3000 prompts in one request, no or a
wrong key, a weights path outside the allowed root, a burst beyond the queue. One
more probe runs inside the decode loop (a request whose sampling raises mid-batch),
which no HTTP request can reach any more since validation stops NaN at the door.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import aiohttp
import pytest

from infra.engine.client import EngineClient
from infra.engine.server import launch_engine_process

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.model]

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD = ["The capital of France is", "Once upon a time, there was a", "def fib(n):", "List three colors:",
        "The sun rises in the"]
SP = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory):
    """An allowed weights root holding a model directory whose weights are a pickled .bin, not safetensors."""
    root = tmp_path_factory.mktemp("weights")
    (root / "pickled").mkdir()
    (root / "pickled" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (root / "pickled" / "pytorch_model.bin").write_bytes(b"\x80\x04not a real pickle")
    return root


@pytest.fixture(scope="module")
def engine(weights_root):
    with launch_engine_process(max_batch_size=4, api_key=KEY, max_queue=4, prefix_cache_mb=32,
                               weights_root=str(weights_root)) as proc:
        yield proc.url


async def _health_latencies(url: str, stop: asyncio.Event) -> list[float]:
    out = []
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            t0 = time.perf_counter()
            async with s.get(url + "/health") as r:
                assert r.status == 200
            out.append(time.perf_counter() - t0)
            await asyncio.sleep(0.05)
    return out


async def test_hostile_requests_fail_alone_and_health_stays_fast(engine, weights_root):
    big = json.dumps({"text": "x" * (20 * 2 ** 20)}).encode()  # encoded up front: not on the probing loop
    async with EngineClient([engine], role="test", api_key=KEY, timeout_s=600) as client:
        alone = [await client.generate(p, sampling_params=SP) for p in GOOD]

        async def hostile() -> dict[str, int]:
            got = {}
            async with aiohttp.ClientSession(headers=AUTH) as s:
                async def post(name: str, path: str = "/generate", **kw) -> None:
                    async with s.post(engine + path, **kw) as r:
                        await r.read()
                        got[name] = r.status

                nan = b'{"text": ["hi", "hello"], "sampling_params": [{"temperature": NaN}, {"max_new_tokens": 2}]}'
                await post("nan temperature", data=nan, headers={"Content-Type": "application/json"})
                await post("20 MB body", data=big, headers={"Content-Type": "application/json"})
                await post("3000 prompts", json={"text": ["hi"] * 3000, "sampling_params": {"max_new_tokens": 64}})
                await post("weights outside root", "/update_weights_from_disk", json={"model_path": "/etc"})
                await post("pickled .bin weights", "/update_weights_from_disk",
                           json={"model_path": str(weights_root / "pickled")})
                deep = b"[" * 100_000 + b"]" * 100_000  # Python's decoder recurses: it used to answer 500
                await post("JSON 100,000 deep", data=deep, headers={"Content-Type": "application/json"})
            async with aiohttp.ClientSession() as s:
                for name, headers in (("no key", {}), ("wrong key", {"Authorization": "Bearer nope"})):
                    async with s.post(engine + "/generate", json={"text": "hi"}, headers=headers) as r:
                        got[name] = r.status
                        assert (await r.json()) == {"error": "Unauthorized"}  # SGLang's answer
            return got

        stop = asyncio.Event()
        probe = asyncio.create_task(_health_latencies(engine, stop))
        good_task = asyncio.gather(*(client.generate(p, sampling_params=SP) for p in GOOD),
                                   client.generate(GOOD[0], sampling_params={**SP, "temperature": 1e-45}))
        statuses = await hostile()
        together = await good_task
        stop.set()
        latencies = await probe

    assert statuses == {"nan temperature": 400, "20 MB body": 413, "3000 prompts": 400,
                        "weights outside root": 403, "pickled .bin weights": 400, "JSON 100,000 deep": 400,
                        "no key": 401, "wrong key": 401}
    # every good request got its tokens; temperature 1e-45 is greedy (it used to give inf logits, 500 for all)
    assert [r.output_ids for r in together] == [r.output_ids for r in alone] + [alone[0].output_ids]
    # /health while the engine decodes a full batch with a queue behind it and reads a 20 MB body
    assert len(latencies) >= 5
    assert statistics.median(latencies) < 0.1 and max(latencies) < 1.0, latencies


async def test_a_full_queue_answers_429_and_the_client_waits_its_turn(engine):
    from infra.metrics import ENGINE_RETRY_AFTER_WAITS

    body = {"text": "Tell me a story.", "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}
    async with aiohttp.ClientSession(headers=AUTH) as s:
        async def one() -> tuple[int, str | None]:
            async with s.post(engine + "/generate", json=body) as r:
                await r.read()
                return r.status, r.headers.get("Retry-After")

        burst = await asyncio.gather(*(one() for _ in range(14)))  # 4 decoding + 4 queued fit; the rest do not
    assert {st for st, _ in burst} == {200, 429}
    assert all(ra is not None and float(ra) >= 1 for st, ra in burst if st == 429)

    waits = ENGINE_RETRY_AFTER_WAITS.labels(role="test")._value.get()
    async with EngineClient([engine], role="test", api_key=KEY, max_retries=0, timeout_s=600) as client:
        results = await asyncio.gather(*(client.generate("Tell me a story.", sampling_params=body["sampling_params"])
                                         for _ in range(14)))
    assert all(len(r.output_ids) == 8 for r in results)  # every one served, none failed
    assert ENGINE_RETRY_AFTER_WAITS.labels(role="test")._value.get() > waits


def test_a_request_that_fails_inside_the_batch_fails_alone(smollm2):
    from infra.engine.batcher import Batcher, GenRequest, RequestFailed, SamplingParams

    model, tok = smollm2
    batcher = Batcher(model, tok, max_batch_size=8)
    batcher.start()
    try:
        ids = [tok(p, add_special_tokens=False).input_ids for p in GOOD[:3]]
        sp = SamplingParams(max_new_tokens=8, temperature=0.0)
        alone = [batcher.submit(GenRequest(list(i), sp)).result(120) for i in ids]
        poison = SamplingParams(max_new_tokens=8, temperature=float("nan"))  # past validation: sampling raises
        futs = batcher.submit_many([GenRequest(list(ids[0]), sp), GenRequest(list(ids[1]), poison),
                                    GenRequest(list(ids[2]), sp)])
        with pytest.raises(RequestFailed, match="sampling failed"):
            futs[1].result(120)
        assert [futs[0].result(120).output_ids, futs[2].result(120).output_ids] == [alone[0].output_ids,
                                                                                    alone[2].output_ids]
    finally:
        batcher.stop()
