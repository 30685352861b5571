"""Scripted action choosers: the environment's expert, an ε-noisy expert, uniform random.

They are `Chooser`s (actors/episode.py) used by offline collection and as
evaluation baselines. The expert's move comes from the environment itself
(`info["expert_action"]`: TextWorld's `policy_commands`, MiniWoB's scripted solver,
ALFWorld's planner; a zero-argument callable where the move costs a planner call),
so these choosers read the step's info dict; the runner passes it to choosers whose
`uses_env_info` is true. Randomness is a private `random.Random` per chooser, seeded;
an evaluation over concurrent environments uses `PerTaskChooser`, one seeded chooser
per task, so its draws do not depend on which episodes interleave with it.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from typing import Any, Sequence

from infra.schema import Task


class RandomChooser:
    """Uniform over the candidate actions."""

    uses_env_info = False

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    async def __call__(self, task: Task, state: str, candidates: Sequence[str], history: Sequence[str],
                       info: dict[str, Any] | None = None) -> str:
        if not candidates:
            return "look"  # nothing listed: any action is answered as invalid, never a crash
        return self.rng.choice(list(candidates))


class ExpertChooser:
    """The environment's own expert move; falls back to random where it has none."""

    uses_env_info = True

    def __init__(self, seed: int = 0):
        self.fallback = RandomChooser(seed)

    async def __call__(self, task: Task, state: str, candidates: Sequence[str], history: Sequence[str],
                       info: dict[str, Any] | None = None) -> str:
        move = (info or {}).get("expert_action")
        if callable(move):  # an environment whose expert costs a planner call computes it on demand
            move = await asyncio.to_thread(move)
        return move if move else await self.fallback(task, state, candidates, history)


class NoisyExpertChooser:
    """With probability ε a uniformly random candidate, else the expert's move."""

    uses_env_info = True

    def __init__(self, eps: float = 0.3, seed: int = 0):
        if not 0.0 <= eps <= 1.0:
            raise ValueError(f"eps must be in [0, 1], got {eps}")
        self.eps = eps
        self.rng = random.Random(seed)
        self.expert = ExpertChooser(seed)
        self.random = RandomChooser(seed + 1)

    async def __call__(self, task: Task, state: str, candidates: Sequence[str], history: Sequence[str],
                       info: dict[str, Any] | None = None) -> str:
        if self.rng.random() < self.eps:
            return await self.random(task, state, candidates, history)
        return await self.expert(task, state, candidates, history, info)


def make_chooser(name: str, seed: int = 0, eps: float = 0.3):
    """'expert', 'noisy' or 'random'."""
    if name == "expert":
        return ExpertChooser(seed)
    if name == "noisy":
        return NoisyExpertChooser(eps, seed)
    if name == "random":
        return RandomChooser(seed)
    raise ValueError(f"unknown scripted policy {name!r}; expected expert, noisy or random")


class PerTaskChooser:
    """A scripted chooser per task, seeded from (seed, task id).

    One shared chooser draws from one random stream, so with several environments
    stepping at once which task gets which draw depends on timing: the random anchor
    of the same 48 games scored 0.250 in one run and 0.167 in the next. Per task, the
    draws of a task are its own (reproducible as long as a task's episodes run one
    after another, as `evaluate` deals them)."""

    def __init__(self, name: str, seed: int = 0, eps: float = 0.3):
        self.name, self.seed, self.eps = name, seed, eps
        self.uses_env_info = make_chooser(name, seed, eps).uses_env_info  # also validates the name
        self._by_task: dict[str, Any] = {}

    async def __call__(self, task: Task, state: str, candidates: Sequence[str], history: Sequence[str],
                       info: dict[str, Any] | None = None) -> str:
        chooser = self._by_task.get(task.task_id)
        if chooser is None:
            digest = hashlib.sha1(f"{self.seed}:{task.task_id}".encode()).hexdigest()
            chooser = self._by_task[task.task_id] = make_chooser(self.name, int(digest[:8], 16), self.eps)
        if chooser.uses_env_info:
            return await chooser(task, state, candidates, history, info)
        return await chooser(task, state, candidates, history)
