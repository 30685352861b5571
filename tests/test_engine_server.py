"""The embedded engine against the real SmolLM2: batching, log-probs, reloads, bad input, disconnects.

One engine serves the module (it shares the session's loaded model); the weight
reload test starts its own engine so the others keep the base weights.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import torch

from infra.engine.client import EngineClient
from infra.engine.server import start_embedded_engine

pytestmark = [pytest.mark.slow, pytest.mark.model]

PROMPTS = ["The capital of France is", "Once upon a time, there was a", "def fib(n):", "List three colors:"]
GREEDY = {"max_new_tokens": 12, "temperature": 0.0}


@pytest.fixture(scope="module")
async def engine(smollm2, tmp_path_factory):
    handle = await start_embedded_engine(loaded=smollm2, max_batch_size=8,
                                         weights_roots=[str(tmp_path_factory.getbasetemp())])
    yield handle
    await handle.stop()


@pytest.fixture
async def client(engine):
    async with EngineClient([engine.url], role="test") as c:
        yield c


async def test_greedy_batched_equals_unbatched(engine, client, smollm2):
    alone = [await client.generate(p, sampling_params=GREEDY) for p in PROMPTS]
    together = await asyncio.gather(*(client.generate(p, sampling_params=GREEDY) for p in PROMPTS))
    assert [r.output_ids for r in together] == [r.output_ids for r in alone]

    # Staggered arrivals join a batch that is already decoding (continuous batching).
    async def late(i: int, p: str):
        await asyncio.sleep(0.15 * i)
        return await client.generate(p, sampling_params=GREEDY)

    steps_before = engine.batcher.steps
    staggered = await asyncio.gather(*(late(i, p) for i, p in enumerate(PROMPTS)))
    assert [r.output_ids for r in staggered] == [r.output_ids for r in alone]
    assert engine.batcher.max_batch_seen >= 2
    # fewer decode steps than running the four one after the other: they overlapped
    assert engine.batcher.steps - steps_before < sum(len(r.output_ids) for r in alone)

    # and the same tokens as transformers' own greedy generate
    model, tok = smollm2
    ids = tok(PROMPTS[0], add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert ref[0, ids.shape[1]:].tolist() == alone[0].output_ids[: ref.shape[1] - ids.shape[1]]


async def test_sequences_leaving_at_prefill_do_not_disturb_the_batch(client):
    # One-token policy calls finish at prefill while longer Mexp-style calls keep decoding.
    sps = [{"max_new_tokens": n, "temperature": 0.0} for n in (1, 8, 1, 6)]
    alone = [await client.generate(p, sampling_params=sp) for p, sp in zip(PROMPTS, sps)]
    together = await asyncio.gather(*(client.generate(p, sampling_params=sp) for p, sp in zip(PROMPTS, sps)))
    assert [r.output_ids for r in together] == [r.output_ids for r in alone]
    assert [len(r.output_ids) for r in together] == [1, 8, 1, 6]


async def test_logprobs_match_a_direct_forward_pass(client, smollm2):
    model, tok = smollm2
    labels = [81, 82, 83]  # 'a', 'b', 'c'
    res = await client.generate(PROMPTS[1], sampling_params={"max_new_tokens": 8, "temperature": 0.8, "sampling_seed": 3},
                                return_logprob=True, token_ids_logprob=labels)
    prompt_ids = tok(PROMPTS[1], add_special_tokens=False).input_ids
    full = torch.tensor([prompt_ids + res.output_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(full).logits.float(), dim=-1)[0]
    n = len(prompt_ids)
    direct = [float(lp[n - 1 + i, t]) for i, t in enumerate(res.output_ids)]
    assert res.output_logprobs == pytest.approx(direct, abs=1e-4)
    assert len(res.token_ids_logprobs) == len(res.output_ids)
    for i, row in enumerate(res.token_ids_logprobs):
        assert set(row) == set(labels)
        assert [row[t] for t in labels] == pytest.approx([float(lp[n - 1 + i, t]) for t in labels], abs=1e-4)


async def test_sampling_seed_stop_and_limits(client):
    sp = {"max_new_tokens": 10, "temperature": 1.0, "top_p": 0.9, "sampling_seed": 7}
    a, b = await asyncio.gather(client.generate(PROMPTS[3], sampling_params=sp), client.generate(PROMPTS[3], sampling_params=sp))
    assert a.output_ids == b.output_ids  # same seed, same tokens, even batched together
    others = [await client.generate(PROMPTS[3], sampling_params={**sp, "sampling_seed": s}) for s in (8, 9, 10)]
    assert any(o.output_ids != a.output_ids for o in others)

    capped = await client.generate(PROMPTS[0], sampling_params={"max_new_tokens": 3, "temperature": 0})
    assert len(capped.output_ids) == 3 and capped.finish_reason == "length"

    stopped = await client.generate(PROMPTS[2], sampling_params={"max_new_tokens": 20, "temperature": 0, "stop": ["=="]})
    assert stopped.finish_reason == "stop" and stopped.meta["finish_reason"]["matched"] == "=="
    assert "==" not in stopped.text and stopped.text.strip().startswith("if n")


async def test_batch_request_returns_a_list(engine):
    async with aiohttp.ClientSession() as s:
        async with s.post(engine.url + "/generate", json={"text": PROMPTS[:2], "sampling_params": GREEDY}) as r:
            body = await r.json()
    assert r.status == 200 and isinstance(body, list) and len(body) == 2
    assert all(isinstance(b["text"], str) and b["meta_info"]["completion_tokens"] == 12 for b in body)


BAD_REQUESTS = [
    ("not json", b"{oops"),
    ("no prompt", {"sampling_params": {"max_new_tokens": 4}}),
    ("both prompts", {"text": "hi", "input_ids": [1, 2]}),
    ("text not str", {"text": 42}),
    ("ids out of vocab", {"input_ids": [1, 10 ** 9]}),
    ("empty ids", {"input_ids": []}),
    ("negative temperature", {"text": "hi", "sampling_params": {"temperature": -1}}),
    ("top_p zero", {"text": "hi", "sampling_params": {"top_p": 0}}),
    ("max_new_tokens str", {"text": "hi", "sampling_params": {"max_new_tokens": "ten"}}),
    ("unknown param", {"text": "hi", "sampling_params": {"temprature": 0.5}}),
    ("too long", {"text": "hi", "sampling_params": {"max_new_tokens": 10 ** 6}}),
    ("stream", {"text": "hi", "stream": True}),
    ("bad logprob ids", {"text": "hi", "token_ids_logprob": ["a"]}),
    ("NaN temperature", b'{"text": "hi", "sampling_params": {"temperature": NaN}}'),
    ("inf temperature", b'{"text": "hi", "sampling_params": {"temperature": Infinity}}'),
    ("NaN top_p", b'{"text": "hi", "sampling_params": {"top_p": NaN}}'),
    ("NaN penalty", b'{"text": "hi", "sampling_params": {"repetition_penalty": NaN}}'),
    ("negative seed", {"text": "hi", "sampling_params": {"sampling_seed": -1}}),
    ("huge seed", {"text": "hi", "sampling_params": {"sampling_seed": 2 ** 64}}),
    ("bool ids", {"input_ids": [True, 2]}),
    ("too many prompts", {"text": ["hi"] * 257}),
]


@pytest.mark.parametrize("name,body", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
async def test_malformed_requests_get_4xx_with_a_message(engine, name, body):
    async with aiohttp.ClientSession() as s:
        kw = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
        async with s.post(engine.url + "/generate", **kw) as r:
            payload = await r.json()
    assert 400 <= r.status < 500, name
    assert isinstance(payload["error"]["message"], str) and payload["error"]["message"]


BAD_CHATS = [[{"role": "hacker", "content": "hi"}], [{"role": "user", "content": ["hi"]}], [{"role": "user"}], []]


@pytest.mark.parametrize("messages", BAD_CHATS, ids=["role", "content list", "no content", "empty"])
async def test_chat_roles_and_content_are_checked(engine, messages):
    async with aiohttp.ClientSession() as s:
        async with s.post(engine.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2}) as r:
            payload = await r.json()
    assert r.status == 400 and "messages" in payload["error"]["message"]


async def test_tiny_temperature_is_greedy(client):
    greedy = await client.generate(PROMPTS[0], sampling_params=GREEDY)
    tiny = await client.generate(PROMPTS[0], sampling_params={**GREEDY, "temperature": 1e-45})
    assert tiny.output_ids == greedy.output_ids  # below 1e-5 is greedy, as in SGLang (not inf logits)


async def test_bad_weight_update_is_4xx_and_keeps_serving(engine, client, tmp_path):
    async with aiohttp.ClientSession() as s:
        async with s.post(engine.url + "/update_weights_from_disk", json={"model_path": str(tmp_path / "nope")}) as r:
            body = await r.json()
        assert r.status == 400 and body["success"] is False and "nope" in body["message"]
        # outside the allowed roots: refused before anything is read, even through a symlink
        (tmp_path / "link").symlink_to("/etc")
        for path in ("/etc", str(tmp_path / "link"), str(tmp_path / ".." / ".." / ".." / "etc")):
            async with s.post(engine.url + "/update_weights_from_disk", json={"model_path": path}) as r:
                body = await r.json()
            if path.endswith("link"):
                assert r.status == 403, path
            else:
                assert r.status == 403 and body["success"] is False and "weights_root" in body["message"], path
    assert (await client.generate("Hi", sampling_params={"max_new_tokens": 2})).weight_version == 0


async def test_server_survives_clients_that_disconnect(engine, client):
    async def abandon():
        async with aiohttp.ClientSession() as s:
            await s.post(engine.url + "/generate", json={"text": PROMPTS[1], "sampling_params": {"max_new_tokens": 200}})

    tasks = [asyncio.create_task(abandon()) for _ in range(3)]
    deadline = time.monotonic() + 30
    while engine.batcher.load < 3 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    res = await client.generate(PROMPTS[0], sampling_params=GREEDY)
    assert len(res.output_ids) == 12
    # the abandoned sequences were dropped from the batch, not decoded to 200 tokens
    deadline = time.monotonic() + 10
    while engine.batcher.load and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert engine.batcher.load == 0


async def test_openai_routes_with_the_official_client(engine, smollm2):
    from openai import AsyncOpenAI

    oai = AsyncOpenAI(base_url=engine.url + "/v1", api_key="none")
    comp = await oai.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=6, temperature=0)
    assert comp.choices[0].text and comp.usage.completion_tokens == 6
    chat = await oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hi."}],
                                             max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    await oai.close()


async def test_weight_reload_changes_outputs_and_bumps_version(smollm2, tmp_path):
    model, tok = smollm2
    # A perturbed copy of the model, saved as a Hugging Face directory (a learner checkpoint).
    from transformers import AutoModelForCausalLM

    copy = AutoModelForCausalLM.from_config(model.config)
    copy.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    copy.save_pretrained(tmp_path / "ckpt")  # weights and config only, as a learner checkpoint may be
    del copy

    handle = await start_embedded_engine(loaded=smollm2, max_batch_size=4, weights_roots=[str(tmp_path)])
    try:
        async with EngineClient([handle.url], role="test") as client:
            before = await client.generate(PROMPTS[0], sampling_params=GREEDY)
            assert before.weight_version == 0
            # a request in flight during the update finishes on the old weights
            inflight = asyncio.create_task(client.generate(PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 30}))
            while handle.batcher.load == 0:
                await asyncio.sleep(0.01)
            await client.update_weights_from_disk(str(tmp_path / "ckpt"), weight_version=5)
            old = await inflight
            after = await client.generate(PROMPTS[0], sampling_params=GREEDY)
            info = await client.model_info()
        assert old.weight_version == 0 and old.output_ids[:12] == before.output_ids
        assert after.weight_version == 5 and info["weight_version"] == 5
        assert after.output_ids != before.output_ids
    finally:
        await handle.stop()
