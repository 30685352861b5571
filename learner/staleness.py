"""Staleness: what the learner does with a trajectory produced by an older policy.

Owns one small policy: a trajectory whose policy_version lags the learner's
version by more than `max_staleness` is dropped (counted) or, in "importance" mode,
kept with truncated importance weights. Counters are guarded by a lock, so several
consumer threads may share one `StalenessFilter` (AReaL keeps its staleness manager
thread-safe the same way).

Importance mode follows AReaL's decoupled PPO: for a too-stale trajectory the
clipped ratio is taken against the proximal policy (the learner's own log-probs
before this update, detached) instead of the behaviour policy, and each token's
surrogate is multiplied by w = min(cap, pi_prox / mu), mu being the behaviour
log-prob the worker recorded. Fresh trajectories keep the plain ratio against mu.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from enum import Enum


class Verdict(str, Enum):
    FRESH = "fresh"
    DROP = "drop"
    CORRECT = "correct"


def staleness(policy_version: int, learner_version: int) -> int:
    """Weight versions between the policy that acted and the learner now (never negative)."""
    return max(0, int(learner_version) - int(policy_version))


def truncated_is_weight(prox_logp: float, behaviour_logp: float, cap: float = 2.0) -> float:
    """min(cap, exp(prox - behaviour)): the decoupled-PPO behaviour correction for one token."""
    return min(cap, math.exp(min(prox_logp - behaviour_logp, 50.0)))


@dataclass
class StalenessCounts:
    fresh: int = 0
    dropped: int = 0
    corrected: int = 0
    total_lag: int = 0

    @property
    def seen(self) -> int:
        return self.fresh + self.dropped + self.corrected


class StalenessFilter:
    """Classifies trajectories by lag and counts the outcomes; thread-safe."""

    def __init__(self, max_staleness: int, mode: str = "drop", is_cap: float = 2.0):
        if max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        if mode not in ("drop", "importance"):
            raise ValueError(f"staleness mode must be 'drop' or 'importance', got {mode!r}")
        self.max_staleness, self.mode, self.is_cap = max_staleness, mode, is_cap
        self._lock = threading.Lock()
        self._counts = StalenessCounts()

    def classify(self, policy_version: int, learner_version: int) -> Verdict:
        lag = staleness(policy_version, learner_version)
        if lag <= self.max_staleness:
            verdict = Verdict.FRESH
        else:
            verdict = Verdict.DROP if self.mode == "drop" else Verdict.CORRECT
        with self._lock:
            self._counts.total_lag += lag
            if verdict is Verdict.FRESH:
                self._counts.fresh += 1
            elif verdict is Verdict.DROP:
                self._counts.dropped += 1
            else:
                self._counts.corrected += 1
        return verdict

    def counts(self) -> StalenessCounts:
        with self._lock:
            c = self._counts
            return StalenessCounts(c.fresh, c.dropped, c.corrected, c.total_lag)
