"""The engine's scoring queue (infra/engine/scorer.py) and the batched scoring it runs, and the
learner's layouts of the same computation (a padded batch, a token tree).

On the tiny random Llama with SmolLM2's tokenizer (fp32, CPU): many (prefix, continuations)
items in two forwards, or in one forward over their token trie, give each item's
`continuation_logprobs` (and the learner's gradients); concurrent requests share
batches when batching is on (padded, or as one token tree) and run alone when it is off; a
request that breaks its batch fails alone; a GPU batches padded rows by default, a CPU token trees.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from infra.config import ConfigError, load_config
from infra.engine.batcher import Batcher
from infra.engine.models import load_model
from infra.engine.scorer import CPU_TREE_TOKENS, GPU_BATCH_TOKENS, Scorer, batch_budget
from infra.engine.scoring import (TokenTrie, batched_continuation_logprobs, continuation_logprobs,
                                  tree_continuation_logprobs)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(str(tiny_dir))


def _items(seed: int, n: int) -> list[tuple[list[int], list[list[int]]]]:
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        prefix = [rng.randrange(10, 40000) for _ in range(rng.randint(1, 50))]
        conts = [[rng.randrange(10, 40000) for _ in range(rng.randint(1, 6))] for _ in range(rng.randint(1, 5))]
        items.append((prefix, conts))
    return items


def test_batched_scoring_equals_each_item_alone(tiny):
    """Prefixes of 1..50 tokens left-padded together, continuations of 1..6 tokens right-padded
    together: every log-prob is the unbatched one (padding keys get zero weight)."""
    model, _ = tiny
    items = _items(0, 12) + [([5, 6, 7], [[8]])]  # and an item whose continuations are all one token
    with torch.no_grad():
        got, _ = batched_continuation_logprobs(model, items)
        for (prefix, conts), mine in zip(items, got):
            ref, _ = continuation_logprobs(model, prefix, conts)
            assert len(mine) == len(conts)
            for a, b in zip(ref, mine):
                assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5), (a, b)
    only_first, _ = batched_continuation_logprobs(model, [([5, 6, 7], [[8], [9]])])
    with torch.no_grad():
        ref, _ = continuation_logprobs(model, [5, 6, 7], [[8], [9]])
    assert torch.allclose(torch.cat(only_first[0]), torch.cat(ref), atol=1e-5)
    with pytest.raises(ValueError, match="at least one token"):
        batched_continuation_logprobs(model, [([1, 2], [[]])])


def _jobs(scorer: Scorer, n: int) -> tuple[list, list]:
    """n requests of 4 prompts each (one shared prefix), submitted from n threads at once."""
    work = [([p + c for c in conts], len(p)) for p, conts in _items(1, n)]
    futures: list = [None] * n
    barrier = threading.Barrier(n)

    def submit(i):
        barrier.wait()
        futures[i] = scorer.submit(*work[i])

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return work, [f.result(timeout=60) for f in futures]


@pytest.mark.parametrize("budget,tree", [(GPU_BATCH_TOKENS, False), (CPU_TREE_TOKENS, True), (0, False)])
def test_the_queue_batches_concurrent_requests_only_when_batching_is_on(tiny, budget, tree):
    """Padded or as one token tree, the batched answers are each request's own."""
    model, _ = tiny
    gate = threading.Event()
    scorer = Scorer(lambda: (gate.wait(), (model, 7))[1], batch_tokens=budget, tree=tree)  # holds the first batch
    scorer.start()
    try:
        threading.Timer(0.5, gate.set).start()  # every request is queued before the first one runs
        work, answers = _jobs(scorer, 16)
    finally:
        scorer.stop()
    for (prompts, start), (rows, version) in zip(work, answers):
        assert version == 7
        with torch.no_grad():
            ref, _ = continuation_logprobs(model, prompts[0][:start], [p[start:] for p in prompts])
        for r, mine in zip(ref, rows):
            assert torch.allclose(r, torch.tensor(mine), atol=1e-5)
    assert scorer.jobs == 16
    if budget:
        assert scorer.batches <= 2  # the first request alone, perhaps; the other 15 together
    else:
        assert scorer.batches == 16


@pytest.mark.parametrize("tree", [False, True])
def test_a_request_its_caller_cancelled_costs_the_others_nothing(tiny, tree):
    """An episode cancelled at a run's end cancels its scoring request: the batch it was queued in is
    answered without it (set_result on a cancelled future raised, and failed every job after it)."""
    model, _ = tiny
    scorer = Scorer(lambda: (model, 0), batch_tokens=GPU_BATCH_TOKENS, tree=tree)
    jobs = [scorer.submit([[1, 2, 3, 4]], 2), scorer.submit([[5, 6, 7, 8]], 2), scorer.submit([[5, 6, 7]], 2)]
    assert jobs[1].cancel()
    scorer.start()  # the three are waiting: one batch, less the cancelled one
    try:
        assert len(jobs[0].result(timeout=60)[0][0]) == 2 and len(jobs[2].result(timeout=60)[0][0]) == 1
    finally:
        scorer.stop()
    assert scorer.jobs == 2


@pytest.mark.parametrize("tree", [False, True])
def test_a_request_that_breaks_its_batch_fails_alone(tiny, tree):
    model, tok = tiny
    scorer = Scorer(lambda: (model, 0), batch_tokens=GPU_BATCH_TOKENS, tree=tree)
    good = [([[1, 2, 3, 4]], 2), ([[5, 6, 7]], 2)]
    bad = ([[1, 2, len(tok) + 10_000]], 2)  # a token id past the vocabulary: the embedding lookup raises
    jobs = [scorer.submit(*good[0]), scorer.submit(*bad), scorer.submit(*good[1])]
    scorer.start()  # all three are waiting: they go in one batch, which fails, then one by one
    try:
        assert len(jobs[0].result(timeout=60)[0][0]) == 2 and len(jobs[2].result(timeout=60)[0][0]) == 1
        with pytest.raises(IndexError):
            jobs[1].result(timeout=60)
    finally:
        scorer.stop()
    with pytest.raises(Exception, match="engine stopped"):
        scorer.submit(*good[0])


def test_a_gpu_batches_padded_rows_and_a_cpu_token_trees_by_default(tiny):
    model, tok = tiny
    assert batch_budget(-1, torch.device("cpu")) == CPU_TREE_TOKENS
    assert batch_budget(-1, torch.device("cuda", 0)) == GPU_BATCH_TOKENS
    assert batch_budget(4096, torch.device("cpu")) == 4096
    b = Batcher(model, tok)
    assert b.scorer.batch_tokens == CPU_TREE_TOKENS and b.scorer.tree
    assert load_config(None, ["engines.score_batch_tokens=8192"]).engines.score_batch_tokens == 8192
    with pytest.raises(ConfigError, match="score_batch_tokens"):
        load_config(None, ["engines.score_batch_tokens=-2"])
    b.start()
    try:
        rows, version = b.submit_score([[1, 2, 3, 4]], 2).result(timeout=60)
        assert len(rows[0]) == 2 and version == 0 and b.requests_total == 1
    finally:
        b.stop()


def test_the_token_tree_scores_as_each_item_alone(tiny):
    """`tree_continuation_logprobs`: items whose prefixes share their first 40 tokens, continuations
    that share their first tokens, a repeated item and one-token continuations, in one forward over
    their trie: every log-prob is the unbatched one, and the trie runs each shared token once."""
    model, _ = tiny
    rng = random.Random(3)
    head = [rng.randrange(10, 40000) for _ in range(40)]
    items = [(head + [rng.randrange(10, 40000) for _ in range(rng.randint(1, 12))],
              [[7, 8, rng.randrange(10, 40000)], [7, 9], [rng.randrange(10, 40000)]]) for _ in range(4)]
    items += [items[1], ([5, 6, 7], [[8], [9, 10]])] + _items(1, 3)
    with torch.no_grad():
        got, hidden = tree_continuation_logprobs(model, items, want_hidden=True)
        _, padded_hidden = batched_continuation_logprobs(model, items, want_hidden=True)
        for (prefix, conts), mine in zip(items, got):
            ref, _ = continuation_logprobs(model, prefix, conts)
            assert len(mine) == len(conts)
            for a, b in zip(ref, mine):
                assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5), (a, b)
    assert torch.allclose(hidden, padded_hidden, atol=1e-5)
    every = sum(len(p) + sum(len(c) - 1 for c in conts) for p, conts in items)
    assert len(TokenTrie(items).ids) <= every - 3 * 40 - len(items[1][0]) - 2  # the head 3 more times, the repeat, a shared "7"
    with pytest.raises(ValueError, match="at least one token"):
        tree_continuation_logprobs(model, [([1, 2], [[]])])
    with pytest.raises(ValueError, match="no items"):
        tree_continuation_logprobs(model, [])


@pytest.mark.parametrize("layout", ["padded", "tree"])
def test_the_learners_scoring_equals_per_prompt_with_its_gradients(tiny, layout):
    """learner/policy_model.py's `scored_logprobs` runs its prompts as a padded batch or as a token
    tree: its log-probs, hidden states and gradients equal the per-prompt path's. The tree counts
    the tokens it ran: the two kitchen prompts' common start once."""
    from learner.policy_model import scored_logprobs

    model, tok = tiny
    prompts = ["Room: kitchen. Take the coin.", "Room: hall, a long corridor with doors.", "Room: kitchen. Take the coin.",
               "Room: kitchen. Take the key."]
    cands = [[[101, 102], [103], [104, 105, 106]], [[201], [202, 203]], [[101, 102], [103], [104, 105, 106]],
             [[101, 102], [103]]]
    results = {}
    for mode in ("per-prompt", layout):
        model.zero_grad(set_to_none=True)
        lp, hidden, tokens = scored_logprobs(model, tok, prompts, cands, [2, 1, 0, 1], want_hidden=True, layout=mode)
        (lp.sum() + hidden.sum()).backward()
        results[mode] = (lp.detach(), hidden.detach(), tokens, model.model.embed_tokens.weight.grad.clone())
    (a, ha, ta, ga), (b, hb, tb, gb) = results["per-prompt"], results[layout]
    assert a.shape == (4,) and hidden.shape[0] == 4
    assert (tb < ta) if layout == "tree" else (tb == ta)
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(ha, hb, atol=1e-5)
    assert torch.allclose(ga, gb, atol=1e-5)
    with pytest.raises(ValueError, match="score layout"):
        scored_logprobs(model, tok, prompts, cands, [2, 1, 0, 1], layout="packed")
    model.zero_grad(set_to_none=True)


def test_the_learner_takes_the_tree_on_the_cpu_unless_told(tiny):
    """learner.score_layout: 'auto' is the tree on the CPU (the GPU's 'padded' needs no GPU to
    name), a setting overrides it, and anything else is a config error naming the key."""
    from learner.policy_model import PolicyModel

    model, tok = tiny
    assert PolicyModel(model=model, tokenizer=tok).score_layout == "tree"
    assert PolicyModel(model=model, tokenizer=tok, score_layout="padded").score_layout == "padded"
    assert load_config(None, ["learner.score_layout=padded"]).learner.score_layout == "padded"
    assert load_config(None).learner.score_layout == "auto"
    with pytest.raises(ConfigError, match="score_layout"):
        load_config(None, ["learner.score_layout=packed"])


def test_the_tree_needs_no_cache_so_it_trains_under_gradient_checkpointing(tiny_dir):
    """Checkpointed layers run without a KV cache; the tree never uses one, so its log-probs and
    gradients are the same with learner.gradient_checkpointing on."""
    from learner.policy_model import scored_logprobs

    model, tok = load_model(str(tiny_dir))  # its own copy: checkpointing stays on
    prompts = ["Room: kitchen. Take the coin.", "Room: kitchen. Take the key."]
    cands = [[[101, 102], [103]], [[101, 102], [103], [7]]]
    got = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        model.zero_grad(set_to_none=True)
        lp, _, _ = scored_logprobs(model, tok, prompts, cands, [1, 2], layout="tree")
        lp.sum().backward()
        got.append((lp.detach(), model.model.embed_tokens.weight.grad.clone()))
    assert model.is_gradient_checkpointing
    assert torch.allclose(got[0][0], got[1][0], atol=1e-6) and torch.allclose(got[0][1], got[1][1], atol=1e-6)


def test_set_threads_changes_the_torch_threads_of_the_decode_and_scoring_threads(tiny):
    """Torch keeps the intra-op thread count per thread: the engine's own threads apply `set_threads`
    (an evaluation computing alone on every core, then back to the count shared with other engines)."""
    from infra.engine.request import GenRequest, SamplingParams

    model, tok = tiny
    b = Batcher(model, tok, threads=1)
    b.start()
    try:
        for threads in (2, 1):
            b.set_threads(threads)
            b.submit_score([[1, 2, 3, 4]], 2).result(timeout=60)
            b.submit(GenRequest([1, 2, 3], SamplingParams(max_new_tokens=2, temperature=0.0))).result(timeout=60)
            assert (b.scorer.threads_in_force, b.threads_in_force) == (threads, threads)
    finally:
        b.stop()

