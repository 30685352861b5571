"""Clipped surrogate, k3 KL and value loss against loop references."""

from __future__ import annotations

import math

import pytest
import torch

from learner.losses import k3_kl, masked_aggregate, policy_loss, value_loss


def ref_policy_loss(logp, old, adv, mask, eps, ref=None, beta=0.0, isw=None, aggregate="sequence", rw=None):
    """-(1/G) sum_i w_i/|o_i| sum_t [min(r A, clip(r) A) - beta KL_k3], loops only (w_i = 1 without `rw`)."""
    per_row, tokens = [], []
    for i in range(len(logp)):
        terms = []
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            r = math.exp(logp[i][t] - old[i][t])
            s = min(r * adv[i][t], max(min(r, 1 + eps), 1 - eps) * adv[i][t])
            if isw is not None:
                s *= isw[i][t]
            if ref is not None:
                d = ref[i][t] - logp[i][t]
                s -= beta * (math.exp(d) - d - 1)
            terms.append(s)
        tokens += terms
        if terms:
            per_row.append((rw[i] if rw is not None else 1.0) * sum(terms) / len(terms))
    if aggregate == "token":
        return -sum(tokens) / max(1, len(tokens))
    return -sum(per_row) / len(per_row) if per_row else 0.0


def rand(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("aggregate", ["sequence", "token"])
@pytest.mark.parametrize("with_kl", [False, True])
def test_policy_loss_matches_reference(seed, aggregate, with_kl):
    shape = (4, 5)
    logp = -rand(shape, seed).abs()
    old = logp + 0.3 * rand(shape, seed + 100)
    adv = rand(shape, seed + 200)
    mask = (rand(shape, seed + 300) > -0.5).to(torch.float64)
    mask[2] = 0  # a row with nothing to train
    ref = logp + 0.2 * rand(shape, seed + 400) if with_kl else None
    isw = rand(shape, seed + 500).abs() if seed % 2 else None
    # a piece of a trajectory split across micro-batches weighs its share of it ("sequence" only)
    rw = rand((4,), seed + 600).abs() if seed % 4 < 2 and aggregate == "sequence" else None
    out = policy_loss(logp, old, adv, mask, 0.2, ref, 0.1, isw, aggregate, row_weights=rw)
    want = ref_policy_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2,
                           ref.tolist() if ref is not None else None, 0.1,
                           isw.tolist() if isw is not None else None, aggregate, rw.tolist() if rw is not None else None)
    assert float(out.loss) == pytest.approx(want, abs=1e-10)


def test_gradient_only_flows_through_masked_unclipped_tokens():
    logp = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0, -1.0]])  # token 1: ratio e > 1.2, clipped for A > 0
    adv = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = policy_loss(logp, old, adv, mask, 0.2)
    out.loss.backward()
    assert logp.grad[0, 0] < 0  # raising the prob of a positive-advantage token lowers the loss
    assert logp.grad[0, 1] == 0  # clipped
    assert logp.grad[0, 2] == 0  # masked
    assert float(out.clip_fraction) == pytest.approx(0.5)


def test_on_policy_loss_is_minus_mean_advantage():
    logp = torch.tensor([[-0.5, -0.7], [-0.1, -2.0]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    out = policy_loss(logp, logp.clone(), adv, torch.ones_like(logp), 0.2)
    assert float(out.loss) == pytest.approx(0.0)
    assert float(out.clip_fraction) == 0.0


def test_k3_is_nonnegative_and_zero_at_equality():
    a = rand((100,), 1)
    b = rand((100,), 2)
    assert bool((k3_kl(a, b) >= 0).all())
    assert float(k3_kl(a, a).abs().max()) == 0.0


def test_all_masked_is_zero_not_nan():
    x = torch.ones(2, 3, requires_grad=True)
    m = torch.zeros(2, 3)
    for agg in ("sequence", "token"):
        v = masked_aggregate(x, m, agg)
        assert float(v.detach()) == 0.0 and not math.isnan(float(v.detach()))
    with pytest.raises(ValueError):
        masked_aggregate(x, m, "nope")


def test_value_loss_matches_reference_and_clips():
    v = torch.tensor([[0.5, 2.0]])
    r = torch.tensor([[1.0, 0.0]])
    m = torch.ones_like(v)
    assert float(value_loss(v, r, m)) == pytest.approx(0.5 * (0.25 + 4.0) / 2)
    old = torch.tensor([[0.5, 0.0]])
    # token 1: clipped value 0.2 has error 0.04 < 4.0, the max keeps the unclipped 4.0
    assert float(value_loss(v, r, m, old, 0.2)) == pytest.approx(0.5 * (0.25 + 4.0) / 2)
    v2 = torch.tensor([[0.5, -1.0]])
    r2 = torch.tensor([[1.0, 1.0]])
    # token 1: unclipped error 4.0; clipped value -0.2 error 1.44 -> max 4.0; token 0 unchanged
    assert float(value_loss(v2, r2, m, old, 0.2)) == pytest.approx(0.5 * (0.25 + 4.0) / 2)
