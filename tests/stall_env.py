"""A plug-in environment (actors/envs/registry.py) whose `stall-*` tasks never finish a step inside a Ray
actor, for tests/test_repeated_kills.py's handler deadline through `dreamgym train` with actors.runtime=ray.

In the driver (the offline collection before training) every task plays and wins in one step; in a
rollout worker actor a `stall-*` task's step awaits for an hour, as a handler that neither acks nor
nacks would, while the actor's event loop stays free (run it with actors.env_isolation=false, so no
environment timeout reaches it first and only the handler deadline can end it)."""

from __future__ import annotations

import asyncio

import ray

from actors.envs.base import StepResult
from infra.schema import Task

FAMILY = "tests.stall_env:StallEnv"
STATE = "Goal: finish\nActions:\n[1] finish"


def in_ray_actor() -> bool:
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


class StallEnv:
    family = FAMILY
    accepts_free_text = False

    def __init__(self, max_steps: int = 4):
        self.task: Task | None = None

    @classmethod
    def tasks(cls, split: str, n: int, seed: int) -> list[Task]:
        names = ["ok-1", "stall-1", "ok-2", "ok-3"] if split == "train" else ["ok-4"]
        return cls.tasks_from_spec(",".join(names[:n]))

    @classmethod
    def tasks_from_spec(cls, spec: str) -> list[Task]:
        # a game_file, though nothing reads it: a real rollout worker sets aside a task without one as a
        # synthetic-only curriculum variant (NoRealCounterpart), whatever its family
        return [Task(task_id=n.strip(), instruction="finish", family=FAMILY, game_file=f"stall-env:{n.strip()}")
                for n in spec.split(",") if n.strip()]

    async def reset(self, task: Task):
        self.task = task
        return STATE, {"candidates": ["finish", "wait"], "expert_action": "finish", "won": False, "valid": True}

    async def step(self, action: str) -> StepResult:
        if self.task is not None and self.task.task_id.startswith("stall-") and in_ray_actor():
            await asyncio.sleep(3600)
        won = action == "finish"
        return StepResult("Goal: finish\nDone.\nActions:\n[1] wait", 1.0 if won else 0.0, True,
                          {"candidates": ["wait"], "won": won, "valid": True, "rationale": "finished"})

    async def close(self) -> None:
        self.task = None
