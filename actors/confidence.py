"""Confidence intervals for held-out success: one policy (Wilson) and two policies on the same tasks (paired bootstrap).

Pure functions on plain numbers, tested against slow references
(tests/test_confidence.py). Evaluation (actors/evaluate.py) reports a Wilson
interval for each policy; the experiment runner (infra/run/experiment.py) compares
two regimes evaluated on the SAME held-out tasks with a paired bootstrap over tasks:
resampling tasks, not episodes, keeps each task's pair together, so a difference
that only comes from which tasks happened to be easy cannot look significant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

Z95 = 1.959963984540054


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (95 % by default); (0, 1) when n = 0."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= n:
        raise ValueError(f"successes={successes} outside [0, {n}]")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # Exact ends at 0 and n (rounding would otherwise leave p itself just outside).
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return lo, hi


@dataclass(frozen=True)
class PairedDifference:
    """mean(a) - mean(b) over the common tasks, with a percentile bootstrap interval."""

    diff: float
    ci_low: float
    ci_high: float
    tasks: int

    @property
    def excludes_zero(self) -> bool:
        return self.ci_low > 0 or self.ci_high < 0


def paired_bootstrap(a: Sequence[float], b: Sequence[float], resamples: int = 10_000, level: float = 0.95,
                     seed: int = 0) -> PairedDifference:
    """Bootstrap interval of mean(a - b), resampling the paired entries (tasks) with replacement.

    `a[i]` and `b[i]` are the two policies' success rates on task i (a task's mean over its episodes).
    """
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"paired samples must be two equal-length lists, got {x.shape} and {y.shape}")
    n = len(x)
    if n == 0:
        return PairedDifference(0.0, -1.0, 1.0, 0)
    d = x - y
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    means = d[idx].mean(axis=1)
    tail = (1 - level) / 2
    lo, hi = np.quantile(means, [tail, 1 - tail])
    return PairedDifference(float(d.mean()), float(lo), float(hi), n)


def per_task_success(per_task: Sequence[Mapping]) -> dict[str, float]:
    """Each task's success rate over its episodes, from an EvalReport's `per_task` rows."""
    runs: dict[str, list[float]] = {}
    for row in per_task:
        runs.setdefault(str(row["task_id"]), []).append(1.0 if row["success"] else 0.0)
    return {t: sum(v) / len(v) for t, v in runs.items()}


def compare(per_task_a: Sequence[Mapping], per_task_b: Sequence[Mapping], resamples: int = 10_000,
            seed: int = 0) -> PairedDifference:
    """Paired bootstrap of two evaluations' per-task success, over the tasks both evaluated."""
    sa, sb = per_task_success(per_task_a), per_task_success(per_task_b)
    common = sorted(set(sa) & set(sb))
    return paired_bootstrap([sa[t] for t in common], [sb[t] for t in common], resamples, seed=seed)
