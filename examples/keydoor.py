"""A key-and-door text world: a worked example of bringing your own environment to DreamGym.

Use it with `actors.env_family=examples.keydoor:KeyDoorEnv` (run from the checkout) or register it
as an entry point (`[project.entry-points."dreamgym.envs"] keydoor = "examples.keydoor:KeyDoorEnv"`).

The player stands in a hall; the vault lies behind a door. Level 1: the door is open. Level 2:
closed. Level 3: locked, and one of two keys fits. Entering the vault wins (reward 1). Every
state lists its admissible commands (`info["candidates"]`), and `info["expert_action"]` is the
next move of the shortest plan, so `dreamgym collect` records expert trajectories.
Everything DreamGym needs is here: the async `reset`/`step`/`close` of the Environment
protocol (actors/envs/base.py) and the classmethod `tasks(split, n, seed)`.
"""

from __future__ import annotations

import random
from typing import Any

from actors.envs.base import AbstractState, StepResult, invalid_observation
from infra.schema import Task

COLOURS = ("red", "blue", "green", "brass", "silver", "black")
SIDES = ("north", "east", "south", "west")


class KeyDoorEnv:
    def __init__(self, max_steps: int = 12) -> None:
        self.max_steps = max_steps
        self.task: Task | None = None

    @classmethod
    def tasks(cls, split: str, n: int, seed: int) -> list[Task]:
        """Every (level, key, decoy, side) world, shuffled by `seed`; train from the front, held-out from the back."""
        worlds = [(lv, k, d, s) for lv in (1, 2, 3) for k in COLOURS for d in COLOURS if d != k for s in SIDES]
        random.Random(seed).shuffle(worlds)
        picked = worlds[:n] if split == "train" else worlds[len(worlds) - n:] if n else []
        out = []
        for level, key, decoy, side in picked:
            meta = {"level": level, "key": key, "decoy": decoy, "side": side}
            t = Task(task_id=f"keydoor-l{level}-{key}-{decoy}-{side}", instruction=f"Enter the vault through the {side} door.",
                     seed=level, meta=meta)
            t.initial_state = cls()._start(t)
            out.append(t)
        return out

    def _start(self, task: Task) -> str:
        m = task.meta
        self.task, self.steps, self.held, self.won = task, 0, [], False
        self.floor = [m["key"], m["decoy"]]
        self.door = {1: "open", 2: "closed", 3: "locked"}[m["level"]]
        return self._state()

    def _commands(self) -> list[str]:
        side = self.task.meta["side"]
        cmds = ["look"] + [f"take {c} key" for c in self.floor] + [f"drop {c} key" for c in self.held]
        if self.door == "locked":
            cmds += [f"unlock door with {c} key" for c in self.held]
        if self.door == "closed":
            cmds.append("open door")
        return cmds + [f"go {side}"]

    def _state(self) -> str:
        keys = " and ".join(f"a {c} key" for c in self.floor)
        desc = (f"Goal: {self.task.instruction}\nRoom: Hall. The {self.task.meta['side']} door is {self.door}."
                + (f" You see {keys}." if keys else "")
                + f"\nInventory: {', '.join(f'{c} key' for c in self.held) or 'nothing'}")
        return AbstractState(desc, list(enumerate(self._commands(), 1))).render()

    def _expert(self) -> str:
        key, side = self.task.meta["key"], self.task.meta["side"]
        if self.door == "locked":
            return f"unlock door with {key} key" if key in self.held else f"take {key} key"
        return "open door" if self.door == "closed" else f"go {side}"

    def _info(self, valid: bool = True, rationale: str = "") -> dict[str, Any]:
        return {"candidates": self._commands(), "valid": valid, "won": self.won, "rationale": rationale,
                "expert_action": "" if self.won else self._expert()}

    async def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        return self._start(task), self._info()

    async def step(self, action: str) -> StepResult:
        cmds, act = self._commands(), action.strip()
        if act.startswith("[") and act.endswith("]") and act[1:-1].isdigit() and 0 < int(act[1:-1]) <= len(cmds):
            act = cmds[int(act[1:-1]) - 1]
        if act not in cmds:
            return StepResult(invalid_observation(self._state(), action, "not an admissible command"), 0.0, False,
                              self._info(valid=False))
        self.steps += 1
        words = act.split()
        if words[0] == "take":
            self.floor.remove(words[1]); self.held.append(words[1]); why = f"You pick up the {words[1]} key."
        elif words[0] == "drop":
            self.held.remove(words[1]); self.floor.append(words[1]); why = f"You drop the {words[1]} key."
        elif words[0] == "unlock":
            fits = words[3] == self.task.meta["key"]
            self.door = "closed" if fits else self.door
            why = f"The {words[3]} key turns: the door is unlocked." if fits else f"The {words[3]} key does not fit."
        elif words[0] == "open":
            self.door, why = "open", "You open the door."
        elif words[0] == "go":
            self.won = self.door == "open"
            why = "You walk into the vault. You win!" if self.won else f"The door is {self.door}."
        else:
            why = "Nothing changes."
        truncated = not self.won and self.steps >= self.max_steps
        info = {**self._info(rationale=why), "truncated": truncated}
        return StepResult(self._state(), 1.0 if self.won else 0.0, self.won or truncated, info)

    async def close(self) -> None:
        self.task = None
