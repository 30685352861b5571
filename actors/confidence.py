"""Confidence intervals for held-out success: one policy (Wilson) and two policies on the same tasks (paired bootstrap).

Pure functions on plain numbers, tested against slow references
(tests/test_confidence.py). Evaluation (actors/evaluate.py) reports a Wilson
interval for each policy; the experiment runner (infra/run/experiment.py) compares
two regimes evaluated on the SAME held-out tasks with a paired bootstrap over tasks:
resampling tasks, not episodes, keeps each task's pair together, so a difference
that only comes from which tasks happened to be easy cannot look significant.
A regime trained several times (`dreamgym experiment --repeats K`) adds a second
source of spread, the training run itself: `runs_bootstrap` resamples each side's
runs as well as the shared tasks, so two runs that disagree widen the interval.
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


def runs_bootstrap(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]] | None = None, resamples: int = 10_000,
                   level: float = 0.95, seed: int = 0) -> PairedDifference:
    """Bootstrap interval of mean(a) - mean(b) (of mean(a) without `b`), where each side is runs x tasks, the
    same tasks in the same order: each draw resamples the tasks (one draw for both sides, so pairs stay
    together) and, apart, each side's runs, then takes the mean over the drawn runs and tasks.

    With one run a side it draws the tasks as `paired_bootstrap` does, and gives its interval."""
    x = np.asarray(a, dtype=float)
    y = np.zeros((1, x.shape[1] if x.ndim == 2 else 0)) if b is None else np.asarray(b, dtype=float)
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[1] or 0 in (len(x), len(y)):
        raise ValueError(f"runs x tasks on the same tasks expected, got {x.shape} and {y.shape}")
    n = x.shape[1]
    if n == 0:
        return PairedDifference(0.0, -1.0, 1.0, 0)
    tasks = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    runs = np.random.default_rng([seed, 1])

    def side(m: np.ndarray) -> np.ndarray:
        per_run = m[:, tasks].mean(axis=2).T  # resamples x runs: each run's mean on each draw's tasks
        drawn = runs.integers(0, len(m), size=(resamples, len(m)))
        return np.take_along_axis(per_run, drawn, axis=1).mean(axis=1)

    means = side(x) - side(y)
    tail = (1 - level) / 2
    lo, hi = np.quantile(means, [tail, 1 - tail])
    return PairedDifference(float(x.mean() - y.mean()), float(lo), float(hi), n)


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


def compare_runs(runs_a: Sequence[Sequence[Mapping]], runs_b: Sequence[Sequence[Mapping]] | None = None,
                 resamples: int = 10_000, seed: int = 0) -> PairedDifference:
    """`runs_bootstrap` of several evaluations a side (each one run's `per_task` rows), over the tasks every
    one of them evaluated; without `runs_b`, the interval of side a's mean success."""
    a = [per_task_success(r) for r in runs_a]
    b = [per_task_success(r) for r in runs_b] if runs_b is not None else []
    common = sorted(set.intersection(*(set(s) for s in [*a, *b]))) if a else []
    return runs_bootstrap([[s[t] for t in common] for s in a], [[s[t] for t in common] for s in b] if b else None,
                          resamples, seed=seed)
