"""GRPO group advantages and GAE against slow references written close to the paper."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.advantages import gae, group_advantages, grpo_advantages, step_advantages


def ref_grpo(rewards, std_normalize=True, eps=1e-6):
    """Eq. 3: A_i = (r_i - mean_j r_j) / std_j r_j, written with loops."""
    g = len(rewards)
    mean = 0.0
    for r in rewards:
        mean += r / g
    var = 0.0
    for r in rewards:
        var += (r - mean) ** 2 / g
    if var <= eps * eps:
        return None
    out = []
    for r in rewards:
        out.append((r - mean) / (math.sqrt(var) + eps) if std_normalize else r - mean)
    return out


def ref_gae(rewards, values, gamma, lam):
    """Eq. 2: A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t (V_T = 0)."""
    T = len(rewards)
    v = list(values) + [0.0]
    deltas = [rewards[t] + gamma * v[t + 1] - v[t] for t in range(T)]
    adv = []
    for t in range(T):
        a = 0.0
        for l in range(T - t):
            a += (gamma * lam) ** l * deltas[t + l]
        adv.append(a)
    return adv, [adv[t] + values[t] for t in range(T)]


rewards_st = st.lists(st.sampled_from([0.0, 1.0, 0.5, -1.0]) | st.floats(-5, 5), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(rewards_st, st.booleans())
def test_group_advantages_match_reference(rewards, norm):
    got, want = group_advantages(rewards, norm), ref_grpo(rewards, norm)
    assert (got is None) == (want is None)
    if got is not None:
        assert got == pytest.approx(want, abs=1e-9)
        assert sum(got) == pytest.approx(0.0, abs=1e-6)


def test_edge_cases():
    assert group_advantages([1.0]) is None  # a single member has no spread
    assert group_advantages([0.0, 0.0, 0.0]) is None  # all equal: no signal
    a = group_advantages([1.0, 0.0, 0.0, 0.0])
    assert a[0] > 0 and all(x < 0 for x in a[1:])
    assert group_advantages([1.0, 0.0], std_normalize=False) == [0.5, -0.5]
    with pytest.raises(ValueError):
        group_advantages([])


def test_zero_variance_groups_are_counted():
    out = grpo_advantages([[1, 1], [0, 1], [0, 0, 0], [2]])
    assert out.zero_variance_groups == 3
    assert out.advantages[0] is None and out.advantages[1] is not None


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(-2, 2), st.floats(-2, 2)), min_size=1, max_size=10),
       st.floats(0, 1), st.floats(0, 1))
def test_gae_matches_reference(pairs, gamma, lam):
    rewards, values = [p[0] for p in pairs], [p[1] for p in pairs]
    adv, ret = gae(rewards, values, gamma, lam)
    want_adv, want_ret = ref_gae(rewards, values, gamma, lam)
    assert adv == pytest.approx(want_adv, abs=1e-9)
    assert ret == pytest.approx(want_ret, abs=1e-9)


def test_gae_outcome_reward_lambda_one_is_monte_carlo():
    adv, ret = gae([0, 0, 1], [0.2, 0.4, 0.6], gamma=1.0, lam=1.0)
    assert ret == pytest.approx([1, 1, 1])
    assert adv == pytest.approx([0.8, 0.6, 0.4])
    with pytest.raises(ValueError):
        gae([0, 1], [0.0])


@given(st.floats(-3, 3), st.lists(st.booleans(), min_size=1, max_size=8), st.booleans())
@settings(max_examples=200, deadline=None)
def test_step_advantages_match_a_loop(adv, valid, never_positive):
    want = []
    for ok in valid:  # every step carries the trajectory's advantage; an invalid reply never a positive one
        if never_positive and not ok and adv > 0:
            want.append(0.0)
        else:
            want.append(adv)
    assert step_advantages(adv, valid, never_positive) == want
