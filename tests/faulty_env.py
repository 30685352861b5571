"""A plug-in environment (actors/envs/registry.py) whose tasks fail on purpose, for tests/test_env_isolation.py.

A task's id says what its one step does: `ok-*` wins, `exit-*` ends the process with exit(1) as
TextWorld's C interpreter does on a corrupt game, `segv-*` kills it with SIGSEGV, `hang-*` blocks for an
hour (a hung engine holds the GIL-free wait, the thread never answers). A `spawn` in the id starts a helper
process at reset, as a browser environment starts Chromium (its pid in the info, `helper_pid`), and the
rest of the id still says what the step does (`spawnhang-1` hangs). Only ever run out of process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

from actors.envs.base import StepResult
from infra.schema import Task

FAMILY = "tests.faulty_env:FaultyEnv"
STATE = "Goal: finish\nActions:\n[1] finish"


class FaultyEnv:
    family = FAMILY
    accepts_free_text = False

    def __init__(self, max_steps: int = 4):
        self.task: Task | None = None

    @classmethod
    def tasks(cls, split: str, n: int, seed: int) -> list[Task]:
        names = ["ok-1", "exit-1", "hang-1", "ok-2"] if split == "train" else ["ok-3"]
        return cls.tasks_from_spec(",".join(names[:n]))

    @classmethod
    def tasks_from_spec(cls, spec: str) -> list[Task]:
        return [Task(task_id=n.strip(), instruction="finish", family=FAMILY) for n in spec.split(",") if n.strip()]

    async def reset(self, task: Task):
        self.task = task
        info = {"candidates": ["finish"], "expert_action": "finish", "won": False, "valid": True}
        if "spawn" in task.task_id:
            info["helper_pid"] = subprocess.Popen(["sleep", "600"]).pid
        return STATE, info

    async def step(self, action: str) -> StepResult:
        kind = self.task.task_id.split("-")[0].replace("spawn", "") if self.task else ""
        if kind == "exit":
            os._exit(1)
        if kind == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if kind == "hang":
            time.sleep(3600)
        return StepResult("Goal: finish\nDone.\nActions:\n[1] wait", 1.0, True,
                          {"candidates": ["wait"], "won": True, "valid": True, "rationale": "finished"})

    async def close(self) -> None:
        self.task = None
