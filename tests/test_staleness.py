"""The staleness policy: drop or importance-correct, counted, thread-safe."""

from __future__ import annotations

import math
import threading

import pytest

from learner.staleness import StalenessFilter, Verdict, staleness, truncated_is_weight


def test_lag_and_bounds():
    assert staleness(3, 5) == 2
    assert staleness(7, 5) == 0  # a worker ahead of the learner (resumed run) is not stale
    f = StalenessFilter(max_staleness=2, mode="drop")
    assert f.classify(3, 5) is Verdict.FRESH  # exactly at the bound is kept
    assert f.classify(2, 5) is Verdict.DROP
    c = f.counts()
    assert (c.fresh, c.dropped, c.corrected, c.total_lag, c.seen) == (1, 1, 0, 5, 2)


def test_importance_mode_corrects_instead_of_dropping():
    f = StalenessFilter(max_staleness=0, mode="importance")
    assert f.classify(0, 0) is Verdict.FRESH
    assert f.classify(0, 1) is Verdict.CORRECT
    assert f.counts().corrected == 1


def test_truncated_weight():
    assert truncated_is_weight(-1.0, -1.0) == pytest.approx(1.0)
    assert truncated_is_weight(-0.5, -1.0, cap=10) == pytest.approx(math.exp(0.5))
    assert truncated_is_weight(0.0, -100.0, cap=2.0) == 2.0
    assert truncated_is_weight(-100.0, 0.0) == pytest.approx(math.exp(-100.0))


def test_bad_arguments():
    with pytest.raises(ValueError):
        StalenessFilter(-1)
    with pytest.raises(ValueError):
        StalenessFilter(1, mode="ignore")


def test_counts_are_exact_under_threads():
    f = StalenessFilter(max_staleness=1, mode="drop")

    def work():
        for i in range(2000):
            f.classify(i % 4, 3)  # lags 3, 2, 1, 0: two dropped, two fresh

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c = f.counts()
    assert c.seen == 16000 and c.dropped == 8000 and c.fresh == 8000
    assert c.total_lag == 8 * 500 * (3 + 2 + 1 + 0)
