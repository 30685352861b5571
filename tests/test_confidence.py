"""Confidence intervals: Wilson against its definition solved by bisection, the paired bootstrap against a slow loop."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.confidence import compare, compare_runs, paired_bootstrap, per_task_success, runs_bootstrap, wilson_interval


def _wilson_reference(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The interval's definition, solved by bisection: all p with |p_hat - p| <= z sqrt(p(1-p)/n)."""
    p_hat = k / n

    def inside(p: float) -> bool:
        return (p_hat - p) ** 2 <= z * z * p * (1 - p) / n + 1e-15

    def edge(lo: float, hi: float, want_inside_at_hi: bool) -> float:
        for _ in range(200):
            mid = (lo + hi) / 2
            if inside(mid) == want_inside_at_hi:
                hi = mid
            else:
                lo = mid
        return (lo + hi) / 2

    low = 0.0 if inside(0.0) else edge(0.0, p_hat, True)
    high = 1.0 if inside(1.0) else edge(p_hat, 1.0, False)
    return low, high


@pytest.mark.parametrize("k,n", [(0, 1), (0, 10), (3, 10), (5, 10), (10, 10), (17, 40), (1, 200)])
def test_wilson_interval_matches_its_definition(k, n):
    lo, hi = wilson_interval(k, n)
    rlo, rhi = _wilson_reference(k, n)
    assert math.isclose(lo, rlo, abs_tol=1e-9) and math.isclose(hi, rhi, abs_tol=1e-9)
    assert lo <= k / n <= hi
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


def slow_paired_bootstrap(a, b, resamples, level, seed):
    """The textbook procedure, one resample at a time, drawing the same indices as the fast version."""
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(a), size=(resamples, len(a)))
    means = []
    for row in draws:
        total = 0.0
        for i in row:
            total += a[i] - b[i]
        means.append(total / len(a))
    means.sort()
    tail = (1 - level) / 2
    return sum(x - y for x, y in zip(a, b)) / len(a), np.quantile(means, tail), np.quantile(means, 1 - tail)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.0, 0.5, 1.0]), st.sampled_from([0.0, 0.5, 1.0])), min_size=1, max_size=30),
       st.integers(0, 1000))
def test_paired_bootstrap_matches_the_slow_loop(pairs, seed):
    a, b = [p[0] for p in pairs], [p[1] for p in pairs]
    fast = paired_bootstrap(a, b, resamples=300, seed=seed)
    diff, lo, hi = slow_paired_bootstrap(a, b, 300, 0.95, seed)
    assert fast.diff == pytest.approx(diff) and fast.ci_low == pytest.approx(lo) and fast.ci_high == pytest.approx(hi)


def test_paired_bootstrap_separates_a_real_difference_from_noise():
    rng = random.Random(0)
    better = [1.0 if rng.random() < 0.8 else 0.0 for _ in range(60)]
    worse = [1.0 if rng.random() < 0.3 else 0.0 for _ in range(60)]
    assert paired_bootstrap(better, worse).excludes_zero
    same = paired_bootstrap(better, better)
    assert same.diff == 0 and not same.excludes_zero
    with pytest.raises(ValueError):
        paired_bootstrap([1.0, 0.0], [1.0])


def test_compare_pairs_evaluations_by_task_and_averages_episodes():
    a = [{"task_id": "t1", "success": True}, {"task_id": "t1", "success": False}, {"task_id": "t2", "success": True},
         {"task_id": "only-a", "success": True}]
    b = [{"task_id": "t2", "success": False}, {"task_id": "t1", "success": False}]
    assert per_task_success(a) == {"t1": 0.5, "t2": 1.0, "only-a": 1.0}
    d = compare(a, b, resamples=200)
    assert d.tasks == 2 and d.diff == pytest.approx((0.5 + 1.0) / 2)


def slow_runs_bootstrap(a, b, resamples, level, seed):
    """Two-level bootstrap one draw at a time, with the same draws as the fast version: the tasks (shared by
    both sides), then side a's runs, then side b's."""
    n = len(a[0])
    tasks = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    runs = np.random.default_rng([seed, 1])
    ra = runs.integers(0, len(a), size=(resamples, len(a)))
    rb = runs.integers(0, len(b), size=(resamples, len(b)))
    means = []
    for k in range(resamples):
        mean_a = sum(a[r][t] for r in ra[k] for t in tasks[k]) / (len(a) * n)
        mean_b = sum(b[r][t] for r in rb[k] for t in tasks[k]) / (len(b) * n)
        means.append(mean_a - mean_b)
    tail = (1 - level) / 2
    return np.quantile(means, tail), np.quantile(means, 1 - tail)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 12), st.integers(0, 1000))
def test_runs_bootstrap_matches_the_slow_loop(runs_a, runs_b, n, seed):
    rng = random.Random(seed)
    a = [[float(rng.random() < 0.6) for _ in range(n)] for _ in range(runs_a)]
    b = [[float(rng.random() < 0.4) for _ in range(n)] for _ in range(runs_b)]
    fast = runs_bootstrap(a, b, resamples=200, seed=seed)
    lo, hi = slow_runs_bootstrap(a, b, 200, 0.95, seed)
    assert fast.ci_low == pytest.approx(lo) and fast.ci_high == pytest.approx(hi)
    assert fast.diff == pytest.approx(np.mean(a) - np.mean(b)) and fast.tasks == n


def test_runs_bootstrap_is_the_paired_bootstrap_for_one_run_and_widens_when_runs_disagree():
    rng = random.Random(1)
    good, bad, base = ([float(rng.random() < p) for _ in range(48)] for p in (0.9, 0.5, 0.45))
    one, paired = runs_bootstrap([good], [base]), paired_bootstrap(good, base)
    assert (one.diff, one.ci_low, one.ci_high) == pytest.approx((paired.diff, paired.ci_low, paired.ci_high))
    # two training runs that disagree: the same mean as their per-task average, but a wider interval
    two = runs_bootstrap([good, bad], [base])
    averaged = paired_bootstrap([(g + w) / 2 for g, w in zip(good, bad)], base)
    assert two.diff == pytest.approx(averaged.diff)
    assert two.ci_high - two.ci_low > 1.3 * (averaged.ci_high - averaged.ci_low)
    alone = runs_bootstrap([good, bad])  # one side: the interval of its mean success
    assert alone.diff == pytest.approx(np.mean([good, bad])) and alone.ci_low < alone.diff < alone.ci_high
    with pytest.raises(ValueError):
        runs_bootstrap([[1.0, 0.0]], [[1.0]])


def test_compare_runs_keeps_the_tasks_every_run_evaluated():
    run1 = [{"task_id": "t1", "success": True}, {"task_id": "t2", "success": False}, {"task_id": "t3", "success": True}]
    run2 = [{"task_id": "t1", "success": False}, {"task_id": "t2", "success": False}]
    base = [{"task_id": "t1", "success": False}, {"task_id": "t2", "success": True}, {"task_id": "t3", "success": True}]
    d = compare_runs([run1, run2], [base], resamples=200)
    assert d.tasks == 2 and d.diff == pytest.approx((1 + 0 + 0 + 0) / 4 - (0 + 1) / 2)
    assert compare_runs([run1], [base], resamples=200).diff == compare(run1, base, resamples=200).diff
