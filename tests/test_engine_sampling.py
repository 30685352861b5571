"""Sampling maths against a slow, obvious reference (full sort, plain Python loops)."""

from __future__ import annotations

import math

import pytest
import torch

from infra.engine.sampling import draw, nucleus, sample_tokens


def reference_nucleus(probs: list[float], top_p: float) -> dict[int, float]:
    """The paper-style definition: most likely first, keep tokens while the mass before them is < p."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = {}, 0.0
    for i in order:
        if mass >= top_p:
            break
        kept[i] = probs[i]
        mass += probs[i]
    return kept


@pytest.mark.parametrize("scale", [0.1, 1.0, 8.0])  # 0.1: flat rows, whose nucleus needs the full sort
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99])
def test_nucleus_equals_the_full_sort_reference(scale, top_p):
    gen = torch.Generator().manual_seed(int(scale * 10 + top_p * 100))
    probs = torch.softmax(torch.randn(2000, generator=gen, dtype=torch.float64) * scale, dim=-1)
    ids, weights = nucleus(probs, top_p)
    ref = reference_nucleus(probs.tolist(), top_p)
    assert sorted(ids.tolist()) == sorted(ref)
    for i, w in zip(ids.tolist(), weights.tolist()):
        assert math.isclose(w, ref[i], rel_tol=1e-12)


def test_sample_tokens_greedy_seeds_and_filters():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 500, generator=gen)
    greedy = sample_tokens(logits, [0.0] * 4, [1.0] * 4, [-1] * 4, [None] * 4)
    assert greedy == logits.argmax(-1).tolist()
    assert sample_tokens(logits, [1.0] * 4, [1.0] * 4, [1] * 4, [None] * 4) == greedy  # top_k 1 is greedy

    def seeded(rows):
        return sample_tokens(logits[rows], [1.0] * len(rows), [0.9] * len(rows), [-1] * len(rows),
                             [torch.Generator().manual_seed(7) for _ in rows])
    # a seeded row draws the same token alone or batched with others
    assert seeded([2]) == seeded([0, 1, 2])[2:]

    # top-k 3: only the three largest logits are ever drawn
    top3 = set(torch.topk(logits[0], 3).indices.tolist())
    draws = {sample_tokens(logits[:1], [2.0], [1.0], [3], [None])[0] for _ in range(60)}
    assert draws <= top3 and len(draws) > 1


def test_sampled_frequencies_match_the_temperature_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    gen = torch.Generator().manual_seed(1)
    n = 4000
    counts = [0] * 4
    for _ in range(n):
        counts[sample_tokens(logits, [0.5], [1.0], [-1], [gen])[0]] += 1
    expected = torch.softmax(logits[0] / 0.5, -1).tolist()
    for c, p in zip(counts, expected):
        assert abs(c / n - p) < 0.03
    # top_p 0.8 at T=0.5: token 0 alone holds 0.865 of the mass, so it is the whole nucleus
    nuc = reference_nucleus(expected, 0.8)
    draws = {sample_tokens(logits, [0.5], [0.8], [-1], [gen])[0] for _ in range(200)}
    assert draws == set(nuc) == {0}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sample_tokens_on_cuda_with_device_generators():
    """Logits and per-request generators on the GPU: seeded draws repeat, greedy matches argmax."""
    logits = torch.randn(4, 1000, device="cuda")
    gens = [None, torch.Generator(device="cuda").manual_seed(7), torch.Generator(device="cuda").manual_seed(7), None]
    a = sample_tokens(logits, [0.0, 0.8, 0.8, 1.0], [1.0, 0.9, 0.9, 1.0], [-1, 50, 50, -1], gens)
    gens = [None, torch.Generator(device="cuda").manual_seed(7), None, None]
    b = sample_tokens(logits, [0.0, 0.8, 0.0, 1.0], [1.0, 0.9, 1.0, 1.0], [-1, 50, -1, -1], gens)
    assert a[0] == b[0] == int(logits[0].argmax()) and a[1] == b[1] == a[2]


def test_engine_device_option_is_validated():
    from infra.config import load_config

    assert load_config().engines.device == "cpu"
    assert load_config(overrides=["engines.device=cuda:1"]).engines.device == "cuda:1"
    with pytest.raises(Exception, match="engines.device"):
        load_config(overrides=["engines.device=gpu"])


def test_inverse_cdf_draw_matches_the_weights_and_never_draws_a_zero_weight():
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.0, 6.0, 0.0])
    gen = torch.Generator().manual_seed(3)
    n = 20000
    counts = [0] * len(weights)
    for _ in range(n):
        counts[draw(weights, gen)] += 1
    assert counts[0] == counts[2] == counts[4] == counts[6] == 0
    for c, w in zip(counts, (weights / weights.sum()).tolist()):
        assert abs(c / n - w) < 0.015
    # seeded: the same generator state draws the same index
    assert [draw(weights, torch.Generator().manual_seed(9)) for _ in range(3)] == [draw(weights, torch.Generator().manual_seed(9))] * 3
