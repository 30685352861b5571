"""Speculative decoding with prompt-lookup drafts: the drafts against a brute-force search, then
the promise that matters, checked on the tiny model and on SmolLM2: greedy outputs and their
log-probs are the same with speculation on and off, in a batch that mixes greedy and sampled
requests, and the prefix cache still hands a finished reply's KV (which has holes where drafts
were rejected) to the next turn."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infra.engine.speculation import NGRAM_SIZES, NgramIndex, accepted


def reference_drafts(seq: list[int], k: int) -> list[int]:
    """The tokens after the latest earlier occurrence (with a token after it) of the longest suffix n-gram."""
    for n in NGRAM_SIZES:
        if len(seq) <= n:
            continue
        suffix = seq[-n:]
        for i in range(len(seq) - n - 1, -1, -1):
            if seq[i:i + n] == suffix:
                return seq[i + n:i + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(prompt=st.lists(st.integers(0, 4), max_size=30), grown=st.lists(st.integers(0, 4), max_size=12),
       k=st.integers(0, 6))
def test_drafts_are_what_followed_the_last_ngram_before(prompt, grown, k):
    index = NgramIndex(prompt)
    seq = list(prompt)
    for tok in grown:  # the index grows a token at a time, as a reply does
        assert index.propose(k) == (reference_drafts(seq, k) if k > 0 else [])
        index.extend([tok])
        seq.append(tok)
    assert index.propose(k) == (reference_drafts(seq, k) if k > 0 else [])


def test_accepted_counts_the_leading_agreement():
    assert accepted([5, 6, 7, 9], [5, 6, 8]) == 2
    assert accepted([1, 2], []) == 0
    assert accepted([3, 4, 5], [3, 4]) == 2


# A copy-heavy prompt, as Mexp's are: the reply restates a state that is already in the prompt.
STATE = ("Room: kitchen\nYou see: table, lamp, locked door, brass key on the table\nExits: north to hall, "
         "east to garden\nInventory: nothing\nTo do: take the brass key, unlock the door\nActions:\n[1] take brass key\n"
         "[2] go north\n[3] go east\n[4] examine lamp")


def _prompts(tok) -> list[list[int]]:
    def chat(user: str) -> list[int]:
        msgs = [{"role": "system", "content": "Repeat the state you are given exactly, then stop."},
                {"role": "user", "content": user}]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False).input_ids
    return [chat(f"State:\n{STATE}"), chat(f"State:\n{STATE}\nAction: take brass key"),
            chat(f"State:\n{STATE.replace('kitchen', 'pantry')}")]


def _run(model, tok, speculative_tokens: int, prefix_cache_mb: float = 0.0):
    from infra.engine.batcher import Batcher, GenRequest, SamplingParams

    batcher = Batcher(model, tok, max_batch_size=8, prefix_cache_mb=prefix_cache_mb,
                      speculative_tokens=speculative_tokens)
    batcher.start()
    greedy = SamplingParams.from_dict({"max_new_tokens": 48, "temperature": 0.0})
    sampled = SamplingParams.from_dict({"max_new_tokens": 48, "temperature": 0.8, "sampling_seed": 3})
    try:
        prompts = _prompts(tok)
        reqs = [GenRequest(list(p), greedy, token_ids_logprob=[tok.eos_token_id]) for p in prompts]
        reqs.append(GenRequest(list(prompts[0]), sampled))  # a sampled row rides along without drafts
        first = [f.result(300) for f in batcher.submit_many(reqs)]
        # the next turn extends a finished reply: its prefix comes from the cache when one is on
        second = batcher.submit(GenRequest(prompts[0] + first[0].output_ids, greedy)).result(300)
        accepted_tokens = batcher.metrics.registry.get_sample_value("engine_speculative_accepted_tokens_total")
        return first, second, accepted_tokens, batcher.steps
    finally:
        batcher.stop()


def _same_greedy_output(model, tok, prefix_cache_mb: float) -> None:
    off, off2, _, steps_off = _run(model, tok, 0, prefix_cache_mb)
    on, on2, accepted_on, steps_on = _run(model, tok, 4, prefix_cache_mb)
    greedy_off, greedy_on = off[:3] + [off2], on[:3] + [on2]
    assert [o.output_ids for o in greedy_on] == [o.output_ids for o in greedy_off]
    diff = max(abs(a - b) for x, y in zip(greedy_on, greedy_off) for a, b in zip(x.output_logprobs, y.output_logprobs))
    assert diff < 1e-4, diff
    tid = max(abs(a[t] - b[t]) for x, y in zip(on[:3], off[:3])
              for a, b in zip(x.token_ids_logprobs, y.token_ids_logprobs) for t in a)
    assert tid < 1e-4, tid
    assert len(on[3].output_ids) > 0  # the sampled request finished beside them
    assert accepted_on > 0 and steps_on < steps_off  # drafts were taken, and saved decode steps
    if prefix_cache_mb:
        assert on2.cached_tokens > len(_prompts(tok)[0])  # the reply's KV, holes skipped, was reused


def test_speculation_changes_nothing_but_the_steps_tiny(tiny_dir):
    from infra.engine.models import load_model

    model, tok = load_model(str(tiny_dir))
    _same_greedy_output(model, tok, prefix_cache_mb=16)


@pytest.mark.slow
@pytest.mark.model
def test_speculation_changes_nothing_but_the_steps_smollm2(smollm2):
    model, tok = smollm2
    _same_greedy_output(model, tok, prefix_cache_mb=16)
    _same_greedy_output(model, tok, prefix_cache_mb=0)


async def test_the_engines_a_train_run_embeds_take_engines_speculative_tokens(tiny_run, tiny_dir):
    """`dreamgym train` starts its engines through Services: `engines.speculative_tokens` reaches them,
    and a greedy Mexp request is answered with drafts verified (the engine's own /metrics says so)."""
    import aiohttp

    from infra.config import load_config
    from infra.run.services import Services

    cfg = load_config(None, [*tiny_run, "engines.speculative_tokens=4"])
    async with Services(cfg, "speculative") as svc:
        await svc.start_engines(str(tiny_dir), str(tiny_dir))
        prompt = f"State:\n{STATE}\nAction: take brass key\nNext state:\n{STATE}\nAction: go north\nNext state:\n"
        res = await svc.mexp.generate(prompt, sampling_params={"max_new_tokens": 32, "temperature": 0.0})
        assert len(res.output_ids) > 0
        async with aiohttp.ClientSession() as http, http.get(f"{svc.mexp.urls[0]}/metrics") as r:
            metrics = await r.text()
    drafted = [float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("engine_speculative_draft_tokens_total ")]
    assert drafted and drafted[0] > 0
