"""The prefix cache and the batch KV layout: against brute-force references, then with the real SmolLM2.

The radix tree is checked against the plainest reference there is (the longest common
prefix with any sequence still cached, and KV tensors that encode their own token and
position, so a wrong piece shows). The model tests check the promise that matters:
greedy outputs and log-probs are the same with the cache on and off, on a GRPO-shaped
workload and on a second turn that extends the first.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from infra.engine.kv import SlotCache
from infra.engine.prefix_cache import PrefixCache

LAYERS, HEADS, DIM = 2, 1, 2
BPT = LAYERS * 2 * HEADS * DIM * 4  # bytes per token, fp32


def encode(ids, start: int, stop: int) -> torch.Tensor:
    """A KV tensor whose every cell says which (token, position) it belongs to."""
    vals = torch.tensor([ids[p] * 1000.0 + p for p in range(start, stop)])
    return vals[None, None, None, :, None].expand(LAYERS, 2, HEADS, stop - start, DIM).clone()


def check_pieces(ids, m: int, pieces) -> None:
    got = torch.cat(pieces, dim=-2) if pieces else torch.zeros(LAYERS, 2, HEADS, 0, DIM)
    assert got.shape[-2] == m
    assert torch.equal(got, encode(ids, 0, m))


def lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


seqs = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(inserted=seqs, queries=seqs)
def test_match_is_the_longest_common_prefix_with_anything_cached(inserted, queries):
    cache = PrefixCache(budget_bytes=10 ** 9, bytes_per_token=BPT)
    for ids in inserted:
        cache.insert(ids, lambda a, b, ids=ids: encode(ids, a, b))
    assert cache.tokens == cache.bytes // BPT
    for q in queries + inserted:
        m, pieces = cache.match(q)
        assert m == max(lcp(q, s) for s in inserted)
        check_pieces(q, m, pieces)
        m1, _ = cache.match(q, limit=len(q) - 1)
        assert m1 == min(m, len(q) - 1)
    # the tree holds each distinct prefix once: its size is the number of distinct non-empty prefixes
    assert cache.tokens == len({tuple(s[:i]) for s in inserted for i in range(1, len(s) + 1)})


@settings(max_examples=200, deadline=None)
@given(inserted=seqs, budget_tokens=st.integers(1, 30))
def test_eviction_keeps_the_budget_and_never_corrupts(inserted, budget_tokens):
    cache = PrefixCache(budget_bytes=budget_tokens * BPT, bytes_per_token=BPT)
    for ids in inserted:
        cache.insert(ids, lambda a, b, ids=ids: encode(ids, a, b))
        assert cache.bytes <= cache.budget_bytes and cache.tokens * BPT == cache.bytes
        for q in inserted:
            m, pieces = cache.match(q)
            assert m <= max(lcp(q, s) for s in inserted)
            check_pieces(q, m, pieces)


def test_least_recently_used_goes_first_and_disabled_is_a_no_op():
    cache = PrefixCache(budget_bytes=8 * BPT, bytes_per_token=BPT)
    a, b, c = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    for ids in (a, b):
        cache.insert(ids, lambda x, y, ids=ids: encode(ids, x, y))
    cache.match(a)  # a is now more recent than b
    cache.insert(c, lambda x, y: encode(c, x, y))
    assert cache.match(a)[0] == 4 and cache.match(c)[0] == 4 and cache.match(b)[0] == 0
    assert cache.evicted_tokens == 4
    off = PrefixCache(0, BPT)
    assert off.insert(a, lambda x, y: encode(a, x, y)) == 0 and off.match(a) == (0, [])


def test_slot_cache_moves_rows_and_columns_without_losing_a_cell():
    slots = SlotCache(LAYERS, HEADS, DIM, rows=4, dtype=torch.float32, device=torch.device("cpu"), cols=4)
    slots.make_room(3)
    seqs_ = {0: [5, 6, 7], 1: [8, 9], 2: [4]}
    for row, ids in seqs_.items():
        slots.mask[row, slots.end - len(ids):slots.end] = True
        slots.put(row, slots.end - len(ids), [encode(ids, 0, len(ids))], len(ids))
    slots.n, slots.start = 3, slots.end - 3

    def content(row: int, ids) -> torch.Tensor:
        cols = slots.mask[row].nonzero()[:, 0]
        return slots.kv[:, :, row, :, cols]

    slots.ensure_free_column()  # 3 of 4 columns used: no move
    slots.make_room(6)  # a longer prompt joins: the content shifts right and the buffer grows
    assert slots.end == 6 and slots.cols >= 7
    for row, ids in seqs_.items():
        assert torch.equal(content(row, ids), encode(ids, 0, len(ids)))
    slots.keep_rows([1, 2])  # row 0 finished: rows 1, 2 move down to 0, 1
    assert slots.n == 2 and slots.start == slots.end - 2
    assert torch.equal(content(0, seqs_[1]), encode(seqs_[1], 0, 2))
    assert torch.equal(content(1, seqs_[2]), encode(seqs_[2], 0, 1))


# --- with the real model ---
GREEDY = {"max_new_tokens": 10, "temperature": 0.0}


def _chat(tok, *turns: str) -> list[int]:
    msgs = [{"role": "system", "content": "You are a text adventure. Describe the next state in one line."}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def _run(smollm2, prefix_cache_mb: float):
    from infra.engine.batcher import Batcher, GenRequest, SamplingParams

    model, tok = smollm2
    batcher = Batcher(model, tok, max_batch_size=8, prefix_cache_mb=prefix_cache_mb)
    batcher.start()
    sp = SamplingParams.from_dict(GREEDY)
    try:
        task = "Task: find the key. State: You are in a kitchen. There is a table and a locked door."
        # a GRPO group: G rollouts of one task, arriving together, then diverging actions on the same state
        group = [_chat(tok, task)] * 4 + [_chat(tok, task + f" Action {a}") for a in ("open door", "look", "take key")]
        first = [f.result(300) for f in batcher.submit_many([GenRequest(list(p), sp) for p in group])]
        # an episode's second turn extends the first (history + the model's reply + a new action)
        second_prompt = _chat(tok, task, first[0].text, "Action: take key")
        second = batcher.submit(GenRequest(second_prompt, sp)).result(300)
        return first + [second], batcher.cached_tokens_total, batcher.prompt_tokens_total
    finally:
        batcher.stop()


@pytest.mark.slow
@pytest.mark.model
def test_prefix_cache_changes_nothing_but_the_work(smollm2):
    off, cached_off, prompt_off = _run(smollm2, 0)
    on, cached_on, prompt_on = _run(smollm2, 64)
    assert cached_off == 0 and prompt_on == prompt_off
    assert [o.output_ids for o in on] == [o.output_ids for o in off]
    diff = max(abs(a - b) for x, y in zip(on, off) for a, b in zip(x.output_logprobs, y.output_logprobs))
    assert diff < 1e-4, diff
    # the group's later members and the second turn reused their shared prefixes
    assert all(o.cached_tokens > 0 for o in on[1:4]) and on[-1].cached_tokens > 0.5 * on[-1].prompt_tokens
    assert cached_on == sum(o.cached_tokens for o in on) and cached_on > 0.5 * prompt_on


@pytest.mark.slow
@pytest.mark.model
async def test_cached_tokens_reach_sglangs_meta_field(smollm2):
    from infra.config import EngineConfig
    from infra.engine.client import EngineClient
    from infra.engine.server import start_embedded_engine

    model, tok = smollm2
    handle = await start_embedded_engine(loaded=smollm2, max_batch_size=4, engine_cfg=EngineConfig(prefix_cache_mb=16))
    try:
        async with EngineClient([handle.url], role="test") as client:
            prompt = "Once upon a time, in a land far away, there lived a"
            a = await client.generate(prompt, sampling_params=GREEDY)
            b, c = await asyncio.gather(*(client.generate(prompt, sampling_params=GREEDY) for _ in range(2)))
        n = len(tok(prompt, add_special_tokens=False).input_ids)
        assert a.meta["cached_tokens"] == 0 and b.meta["cached_tokens"] == c.meta["cached_tokens"] == n - 1
        assert a.output_ids == b.output_ids == c.output_ids
    finally:
        await handle.stop()
