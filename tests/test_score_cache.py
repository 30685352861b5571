"""The CPU scorer's prompt cache (infra/engine/score_cache.py) and where it is switched on.

On the tiny random Llama with SmolLM2's tokenizer (fp32, CPU): a token tree that takes the
tokens earlier prompts share from the cache gives the uncached tree's log-probs, round after
round of requests that repeat, extend and cut each other's prompts; the cache keeps within its
bytes and forgets weights it no longer serves; an engine started from `engines.score_cache_mb`
answers a score-mode episode's requests as an engine without the cache does, counting what it
reused; and the warm start's validation (reached by `dreamgym train` with
`learner.warm_start=best`) plays the same real TextWorld games with the cache and without.
"""

from __future__ import annotations

import inspect
import random

import pytest
import torch

from infra.config import EngineConfig, load_config
from infra.engine import scorer as scorer_module
from infra.engine.client import EngineClient
from infra.engine.kv import CACHE_ARG, cache_arg, returned_cache
from infra.engine.models import load_model
from infra.engine.score_cache import ScoreCache, cached_tree_logprobs
from infra.engine.scoring import tree_continuation_logprobs
from infra.engine.server import start_embedded_engine


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(str(tiny_dir))


def _gap(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max((x - y).abs().max().item() for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def test_the_cached_tree_gives_the_uncached_trees_logprobs_round_after_round(tiny):
    model, _ = tiny
    rng = random.Random(0)
    goal = [rng.randrange(10, 40000) for _ in range(60)]  # what an episode's prompts start with

    def item(shared: int, own: int):
        conts = [[rng.randrange(10, 40000) for _ in range(rng.randint(1, 5))] for _ in range(rng.randint(1, 4))]
        return goal[:shared] + [rng.randrange(10, 40000) for _ in range(own)], conts

    cache = ScoreCache(1 << 30)
    cache.for_version(0)
    with torch.no_grad():
        for r in range(6):
            items = [item(rng.randint(1, 60), rng.randint(0, 20)) for _ in range(rng.randint(1, 5))]
            if r == 3:
                items.append((list(items[0][0]), [[5]]))  # a prompt asked again (all but its last token cached)
            if r == 4:
                items.append((list(items[0][0][:-3]), [[7, 8]]))  # a prompt that a stored one extends
            ref, _ = tree_continuation_logprobs(model, items)
            assert _gap(ref, cached_tree_logprobs(model, items, cache)) <= 1e-5
    assert 0 < cache.hit_tokens < cache.prompt_tokens
    assert len(cache) > 1


def test_a_kv_cache_reaches_the_model_under_the_installed_transformers_name(tiny):
    """transformers 5.24 renamed `past_key_values` to `cache`; an older release swallows `cache=` unread
    into **kwargs, and the next tokens then attend to nothing. Under the name `cache_arg` picks, the
    second half of a sequence run over the first half's cache gives the logits of one full forward."""
    model, _ = tiny
    assert CACHE_ARG in inspect.signature(type(model).forward).parameters
    ids = torch.tensor([[11, 523, 77, 4096, 31, 902, 18, 2048]])
    with torch.no_grad():
        full = model(input_ids=ids).logits
        head = model(input_ids=ids[:, :5], use_cache=True)
        tail = model(input_ids=ids[:, 5:], position_ids=torch.arange(5, 8)[None], use_cache=True,
                     **cache_arg(returned_cache(head)))
    assert (tail.logits - full[:, 5:]).abs().max().item() <= 1e-5
    alone = model(input_ids=ids[:, 5:], position_ids=torch.arange(5, 8)[None]).logits
    assert (alone - full[:, 5:]).abs().max().item() > 1e-3  # the check can tell a cache that was not read


def test_the_cache_keeps_within_its_bytes_and_forgets_other_weights():
    def kv(n: int) -> list[torch.Tensor]:
        return [torch.zeros(1, 1, n, 4)]  # 16 bytes a token a tensor

    cache = ScoreCache(budget_bytes=2 * 128)  # two 4-token prompts: 16 bytes a token for keys, 16 for values
    cache.for_version(1)
    cache.store([1, 2, 3, 4], kv(4), kv(4))
    cache.store([1, 2, 9, 9], kv(4), kv(4))
    entry, shared = cache.match([1, 2, 3, 4, 5])  # the longest shared start, and now the most recently used
    assert entry.ids.tolist() == [1, 2, 3, 4] and shared == 4
    cache.store([7, 7, 7, 7], kv(4), kv(4))  # evicts the least recently used: [1, 2, 9, 9]
    assert cache.bytes <= cache.budget and len(cache) == 2
    assert cache.match([1, 2, 9, 9, 1])[1] == 2  # only [1, 2] of it is still held, by [1, 2, 3, 4]
    assert cache.match([5])[1] == 0  # a prompt's last token always runs
    cache.store(list(range(20)), kv(20), kv(20))  # larger than the whole budget: not kept
    assert len(cache) == 2
    cache.for_version(2)
    assert len(cache) == 0 and cache.bytes == 0


async def _score_episode(url: str, tok, rounds: int = 4) -> list[list[list[float]]]:
    """A score-mode episode's requests: each step's prompt repeats the goal, then its own state."""
    client = EngineClient([url], role="policy")
    goal = tok("Goal: take the whisk from the canteen and put it in the cabinet of the laundromat.")["input_ids"]
    out = []
    try:
        for step in range(rounds):
            state = tok(f"Room: room {step}. You see: a table, a cabinet. Exits: east, west.")["input_ids"]
            conts = [tok(a)["input_ids"] for a in ("go east", "go west", "take whisk")]
            rows, _ = await client.score(goal + state, conts)
            out.append(rows)
    finally:
        await client.close()
    return out


async def test_an_engine_started_from_the_setting_answers_as_one_without_the_cache(tiny):
    model, tok = tiny
    answers, counted = {}, {}
    for mb in (0.0, 16.0):
        handle = await start_embedded_engine(loaded=(model, tok), max_batch_size=4,
                                             engine_cfg=EngineConfig(threads=0, score_cache_mb=mb))
        try:
            assert (handle.batcher.scorer.cache is not None) == (mb > 0)
            client = EngineClient([handle.url], role="policy")
            assert (await client.model_info())["score_cache_mb"] == mb
            await client.close()
            answers[mb] = await _score_episode(handle.url, tok)
            counted[mb] = handle.batcher.metrics.score_cached_tokens._value.get()
        finally:
            await handle.stop()
    for a, b in zip(answers[0.0], answers[16.0]):
        assert max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)) <= 1e-5
    assert counted[0.0] == 0 and counted[16.0] > 0


def test_the_warm_start_validation_plays_the_same_games_with_the_cache_and_without(tiny, tmp_path, monkeypatch):
    from actors.envs.textworld_env import make_textworld_tasks
    from learner.sft_validation import play_validation

    model, tok = tiny
    tasks = make_textworld_tasks(tmp_path / "data", 2, 0, ["custom"], seed=0).train
    calls = []
    real = scorer_module.cached_tree_logprobs
    monkeypatch.setattr(scorer_module, "cached_tree_logprobs", lambda *a: calls.append(1) or real(*a))
    reports = {}
    for mb in (0, 64):
        cfg = load_config(None, ["actors.env_family=textworld", "actors.action_mode=score", "actors.multi_turn=false",
                                 "evaluation.max_steps=4",
                                 f"engines.score_cache_mb={mb}"])
        before = len(calls)
        reports[mb] = play_validation(model, tok, cfg, tasks)
        assert (len(calls) > before) == (mb > 0)  # the setting reached the validation's engine
    strip = lambda r: [{k: v for k, v in t.items() if "second" not in k} for t in r["per_task"]]  # noqa: E731
    assert strip(reports[0]) == strip(reports[64])
