"""A gymnasium view of any DreamGym Environment, for gymnasium tooling and RLlib.

Owns the adapter from the async text interface (actors/envs/base.py) to
`gymnasium.Env`: the observation is the abstract state as a `Text` space, the action
is an index into the step's candidate list (`Discrete(max_actions)`; an index past
the list is an invalid action, answered and counted by the environment like any
other). `reset(seed=s)` picks the task deterministically from the task list, so the
checker's seed-determinism tests hold for deterministic environments (TextWorld,
MiniWoB with the task's seed). The async environment runs on a private event loop
owned by this object.

`gym_env_creator(env_config)` builds one from a plain dict, which is what
`ray.tune.registry.register_env` needs; `register_rllib_env()` does the registration.

`MaskedCandidates` is the numeric view an RLlib algorithm trains on (infra/run/rllib.py,
`dreamgym rllib`): a fixed-size embedding of the state and of each candidate slot (a hashed
bag of words, `hashed_bow`: no model, the same vector in every process) and the mask of the
slots that hold a candidate, in the {"observations", "action_mask"} form of RLlib's
action-masking RLModule. Candidates past `max_actions` are not offered.
"""

from __future__ import annotations

import asyncio
import re
import string
import zlib
from typing import Any, Sequence

import gymnasium as gym
import numpy as np

from actors.dataset import TaskSplits
from actors.envs.registry import make_env
from infra.schema import Task

CHARSET = frozenset(string.printable)


class DreamGymTextEnv(gym.Env):
    metadata = {"render_modes": ["ansi"]}

    def __init__(self, env: Any, tasks: Sequence[Task], max_actions: int = 52, max_length: int = 8192,
                 render_mode: str | None = None):
        if not tasks:
            raise ValueError("DreamGymTextEnv needs at least one task")
        self.env, self.tasks = env, list(tasks)
        self.max_length = max_length
        self.observation_space = gym.spaces.Text(max_length=max_length, min_length=1, charset=CHARSET)
        self.action_space = gym.spaces.Discrete(max_actions)
        self.render_mode = render_mode
        self._loop = asyncio.new_event_loop()
        self._candidates: list[str] = []
        self._state = ""
        self.task: Task | None = None

    def _obs(self, text: str) -> str:
        clean = "".join(c if c in CHARSET else "?" for c in text)[: self.max_length]
        return clean or " "

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        idx = (options or {}).get("task_index")
        if idx is None:
            idx = int(self.np_random.integers(len(self.tasks)))
        self.task = self.tasks[int(idx) % len(self.tasks)]
        state, info = self._loop.run_until_complete(self.env.reset(self.task))
        self._candidates, self._state = list(info.get("candidates", [])), state
        return self._obs(state), {"candidates": self._candidates, "task_id": self.task.task_id}

    def step(self, action: Any):
        i = int(np.asarray(action).item())
        text = self._candidates[i] if 0 <= i < len(self._candidates) else f"[{i + 1}] (no such candidate)"
        res = self._loop.run_until_complete(self.env.step(text))
        self._candidates, self._state = list(res.info.get("candidates", [])), res.state
        truncated = bool(res.info.get("truncated", False))
        info = {"candidates": self._candidates, "valid": res.info.get("valid", True), "won": res.info.get("won", False),
                "action_text": text}
        return self._obs(res.state), float(res.reward), bool(res.done) and not truncated, truncated, info

    def render(self):
        return self._obs(self._state) if self.render_mode == "ansi" else None

    def close(self):
        if not self._loop.is_closed():
            self._loop.run_until_complete(self.env.close())
            self._loop.close()


_WORD = re.compile(r"[a-z0-9]+")


def hashed_bow(text: str, dim: int) -> np.ndarray:
    """Unit-norm counts of `text`'s lower-case words, each in bucket crc32(word) % dim (zeros for no words)."""
    v = np.zeros(dim, dtype=np.float32)
    for w in _WORD.findall(text.lower()):
        v[zlib.crc32(w.encode()) % dim] += 1.0
    n = float(np.linalg.norm(v))
    return v / n if n else v


class MaskedCandidates(gym.ObservationWrapper):
    """A DreamGymTextEnv seen as numbers: state and candidate-slot embeddings, and the action mask."""

    def __init__(self, env: DreamGymTextEnv, state_dim: int = 128, action_dim: int = 32):
        super().__init__(env)
        self.state_dim, self.action_dim, self.slots = state_dim, action_dim, int(env.action_space.n)
        size = state_dim + self.slots * action_dim
        self.observation_space = gym.spaces.Dict({
            "observations": gym.spaces.Box(-1.0, 1.0, (size,), np.float32),
            "action_mask": gym.spaces.Box(0.0, 1.0, (self.slots,), np.float32)})

    def observation(self, observation: str) -> dict:
        cands = self.env.unwrapped._candidates[: self.slots]
        slots = np.zeros((self.slots, self.action_dim), dtype=np.float32)
        for i, c in enumerate(cands):
            slots[i] = hashed_bow(c, self.action_dim)
        mask = np.zeros(self.slots, dtype=np.float32)
        mask[: len(cands)] = 1.0
        if not cands:  # a state with nothing listed (an ended synthetic episode): one slot, answered as invalid
            mask[0] = 1.0
        return {"observations": np.concatenate([hashed_bow(observation, self.state_dim), slots.ravel()]),
                "action_mask": mask}


def gym_env_creator(env_config: dict) -> DreamGymTextEnv:
    """Build from {"family": ..., "splits": path, "split": "train"|"heldout", "max_steps": n, "max_actions": n}."""
    cfg = dict(env_config or {})
    splits = TaskSplits.load(cfg["splits"])
    tasks = splits.train if cfg.get("split", "train") == "train" else splits.heldout
    env = make_env(cfg.get("family", "textworld"), max_steps=int(cfg.get("max_steps", 20)))
    return DreamGymTextEnv(env, tasks, max_actions=int(cfg.get("max_actions", 52)))


def register_rllib_env(name: str = "dreamgym-text") -> str:
    """Register `gym_env_creator` with RLlib under `name` (no Ray runtime needed to register)."""
    from ray.tune.registry import register_env  # Ray, only for RLlib users

    register_env(name, gym_env_creator)
    return name
