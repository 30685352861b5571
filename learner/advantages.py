"""Advantages: GRPO's group-relative advantage (paper Eq. 3) and GAE for PPO (Eq. 2).

Pure functions on plain Python lists, so they are tested against slow loop
references and reused by any loop. Departures from the paper:
- GRPO: the advantage is per trajectory (the outcome reward, centred on the group
  mean and optionally divided by the group std) and broadcast to every action
  token of the trajectory. Groups whose rewards are all equal carry no signal and
  are filtered out and counted (the caller increments the metric), as DAPO does.
- The std is the population std (divide by G), with `eps` guarding tiny spreads.
- GAE bootstraps with 0 after the last step of every episode, also for truncated
  ones (the learner has no value of the final next state).
- Generate mode, `learner.invalid_advantage: never_positive` (not the paper's): a step whose reply named
  no legal action keeps a negative trajectory advantage but never a positive one, so a rollout that won
  despite an invalid reply does not reinforce that reply's tokens (`step_advantages`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass
class GroupAdvantages:
    """Advantages per group (None where the group was filtered) and the filter count."""

    advantages: list[list[float] | None]
    zero_variance_groups: int


def group_advantages(rewards: Sequence[float], std_normalize: bool = True, eps: float = 1e-6) -> list[float] | None:
    """A_i = (r_i - mean(r)) [/ (std(r) + eps)] for one group; None when all rewards are equal.

    A single-member group is zero-variance by definition, hence None.
    """
    n = len(rewards)
    if n == 0:
        raise ValueError("empty group")
    mean = sum(rewards) / n
    var = sum((r - mean) ** 2 for r in rewards) / n
    if var <= eps * eps:
        return None
    std = math.sqrt(var)
    return [(r - mean) / (std + eps) if std_normalize else (r - mean) for r in rewards]


def grpo_advantages(groups: Sequence[Sequence[float]], std_normalize: bool = True, eps: float = 1e-6) -> GroupAdvantages:
    """group_advantages for each group, counting the zero-variance ones."""
    out = [group_advantages(g, std_normalize, eps) for g in groups]
    return GroupAdvantages(out, sum(1 for a in out if a is None))


def step_advantages(advantage: float, valid: Sequence[bool], never_positive_invalid: bool = False) -> list[float]:
    """One GRPO trajectory advantage per step: the same for every step (the paper), or, with
    `never_positive_invalid`, at most 0 on the steps whose reply was invalid (`valid` false)."""
    return [min(advantage, 0.0) if never_positive_invalid and not ok else advantage for ok in valid]


def gae(rewards: Sequence[float], values: Sequence[float], gamma: float = 1.0, lam: float = 0.95,
        last_value: float = 0.0) -> tuple[list[float], list[float]]:
    """(advantages, returns) of one episode by generalised advantage estimation.

    delta_t = r_t + gamma * V(s_{t+1}) - V(s_t), with V(s_T) = last_value;
    A_t = delta_t + gamma * lam * A_{t+1}; returns R_t = A_t + V(s_t).
    """
    if len(rewards) != len(values):
        raise ValueError(f"{len(rewards)} rewards but {len(values)} values")
    adv = [0.0] * len(rewards)
    running = 0.0
    next_value = last_value
    for t in range(len(rewards) - 1, -1, -1):
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
        next_value = values[t]
    return adv, [a + v for a, v in zip(adv, values)]
