"""A deterministic in-test Environment and a scripted policy for the orchestration tests.

Not mocks of DreamGym code: a tiny real implementation of the Environment protocol
(actors/envs/base.py) and of the policy's `act` contract, so worker, elastic and
benchmark tests run in seconds without a model. `delay_s` makes a step take wall time
(to kill a worker mid-episode, or to make workers of unequal speed).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

from actors.envs.base import AbstractState, StepResult
from infra.schema import Task


class LadderEnv:
    """Climb `height` rungs with 'up'; 'down' loses a rung; reaching the top wins (reward 1)."""

    def __init__(self, height: int = 2, delay_s: float = 0.0):
        self.height, self.delay_s, self.pos = height, delay_s, 0
        self.closed = False

    def _state(self) -> str:
        return AbstractState(f"Rung {self.pos} of {self.height}", [(1, "up"), (2, "down")]).render()

    async def reset(self, task: Task):
        self.pos = 0
        return self._state(), {"candidates": ["up", "down"], "valid": True, "won": False}

    async def step(self, action: str) -> StepResult:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        self.pos = self.pos + 1 if action == "up" else max(0, self.pos - 1)
        won = self.pos >= self.height
        return StepResult(self._state(), 1.0 if won else 0.0, won,
                          {"candidates": ["up", "down"], "valid": True, "won": won, "reasoning": f"moved {action}"})

    async def close(self) -> None:
        self.closed = True


@dataclass
class Decision:
    action: str
    index: int
    prompt: str
    action_token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    choice_token_ids: list = field(default_factory=list)
    weight_version: int = 0


class ScriptedPolicy:
    """Picks a candidate at random (seeded); reports a fixed weight version and label tokens 81.."""

    def __init__(self, seed: int = 0, p_first: float = 0.7, version: int = 0, delay_s: float = 0.0):
        self.rng, self.p_first, self.version, self.delay_s = random.Random(seed), p_first, version, delay_s
        self.calls = 0

    async def act(self, task, state, candidates, history, affinity_key):
        self.calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        i = 0 if self.rng.random() < self.p_first else self.rng.randrange(len(candidates))
        labels = list(range(81, 81 + len(candidates)))
        return Decision(candidates[i], i, f"prompt for {task.task_id}: {state[:20]}", [labels[i]], [-0.5], labels,
                        self.version)


async def slow_scripted_policy(delay_s: float = 1.5) -> ScriptedPolicy:
    """A policy factory that takes a while, as loading a tokenizer and an engine client does."""
    await asyncio.sleep(delay_s)
    return ScriptedPolicy()
