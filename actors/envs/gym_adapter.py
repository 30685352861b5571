"""Any gymnasium environment with text observations, as a DreamGym Environment.

Owns the one adapter from `gymnasium.Env` to the Environment protocol (actors/envs/base.py),
the reverse of actors/envs/gym_wrapper.py. `actors.env_family=gym:<id>` uses it on
`gymnasium.make(id)`; a subclass setting `gym_id` (or overriding `make_gym`) is a plug-in
family like any other (`actors.env_family=mypkg.envs:MyGymText`).

What it reads from the gymnasium environment:
- the observation: text (a `str`, or a dict with an "observation"/"text" entry) becomes the
  state's description; the candidates are listed under it as numbered items;
- the candidates: `info["candidates"]` (or `info["admissible_commands"]`) when the env lists
  them each step; else the labels of a `Discrete` action space (`action_labels` on the
  unwrapped env, else "0".."n-1");
- the action: for a `Discrete` space the chosen candidate's index, for a `Text` space the
  candidate's text; an action that is no candidate is answered as invalid without stepping;
- reward as is; `terminated or truncated` -> done, `info["truncated"]` when only truncated;
  `info["won"]` is the env's own `won` if it sets one, else `terminated and reward > 0`;
  `info["expert_action"]` and `info["rationale"]` pass through (collection's expert, Mexp's SFT);
- tasks: a task is a reset seed (`tasks(split, n, seed)`: train and held-out seeds disjoint),
  its instruction the env's `info["instruction"]`/`info["goal"]`, else its first line.
"""

from __future__ import annotations

from typing import Any

from actors.envs.base import AbstractState, StepResult, invalid_observation, parse_action
from infra.schema import Task

HELDOUT_SEED_OFFSET = 1_000_000  # held-out tasks' seeds start here, so the splits never share one


def _text(obs: Any) -> str:
    if isinstance(obs, dict):
        for key in ("observation", "text", "obs"):
            if key in obs:
                return str(obs[key])
    return obs if isinstance(obs, str) else str(obs)


class GymTextEnv:
    """Environment over one gymnasium env (made on first reset, reused across tasks)."""

    gym_id: str = ""

    def __init__(self, max_steps: int = 20, env: Any = None) -> None:
        self.max_steps = max_steps
        self.env = env
        self.labels: list[str] = []
        self.candidates: list[str] = []
        self.state = ""
        self.steps = 0

    def make_gym(self) -> Any:
        import gymnasium  # only the gym families need it

        return gymnasium.make(self.gym_id)

    def _candidates(self, info: dict) -> list[str]:
        listed = info.get("candidates", info.get("admissible_commands"))
        if listed is not None:
            return [str(c) for c in listed]
        space = self.env.action_space
        if hasattr(space, "n"):
            labels = getattr(self.env.unwrapped, "action_labels", None)
            return [str(x) for x in labels] if labels else [str(i) for i in range(int(space.n))]
        return []

    def _render(self, obs: Any, info: dict) -> tuple[str, dict]:
        self.candidates = self._candidates(info)
        self.state = AbstractState(_text(obs), list(enumerate(self.candidates, 1))).render()
        out = {"candidates": list(self.candidates), "valid": True, "won": False}
        if info.get("expert_action"):
            out["expert_action"] = str(info["expert_action"])
        return self.state, out

    async def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        if self.env is None:
            self.env = self.make_gym()
        obs, info = self.env.reset(seed=int(task.seed))
        self.steps = 0
        return self._render(obs, dict(info or {}))

    def _choice(self, action: str) -> int | None:
        try:
            a = parse_action(action)
        except ValueError:
            return None
        if a.kind == "choose" and a.ref is not None and 1 <= a.ref <= len(self.candidates):
            return a.ref - 1
        return self.candidates.index(a.text) if a.text in self.candidates else None

    async def step(self, action: str) -> StepResult:
        i = self._choice(action)
        if i is None:
            return StepResult(invalid_observation(self.state, action, "not one of the listed actions"), 0.0, False,
                              {"candidates": list(self.candidates), "valid": False, "won": False})
        gym_action = i if hasattr(self.env.action_space, "n") else self.candidates[i]
        obs, reward, terminated, truncated, info = self.env.step(gym_action)
        info = dict(info or {})
        self.steps += 1
        state, out = self._render(obs, info)
        done = bool(terminated or truncated)
        if not done and self.steps >= self.max_steps:
            done, truncated = True, True
        out["won"] = bool(info["won"]) if "won" in info else bool(terminated and reward > 0)
        out["truncated"] = bool(truncated and not terminated)
        if info.get("rationale"):
            out["rationale"] = str(info["rationale"])
        return StepResult(state, float(reward), done, out)

    async def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None

    @classmethod
    def tasks(cls, split: str, n: int, seed: int) -> list[Task]:
        """`n` tasks: reset seeds `seed*n + i` (train) or past HELDOUT_SEED_OFFSET (held-out), each with
        the initial state it resets to (so Mexp starts a synthetic episode from the real one)."""
        base = HELDOUT_SEED_OFFSET if split == "heldout" else 0
        env, out = cls(), []
        env.env = env.make_gym()
        try:
            for i in range(n):
                s = base + seed * n + i
                obs, info = env.env.reset(seed=s)
                state, _ = env._render(obs, dict(info or {}))
                info = dict(info or {})
                instruction = str(info.get("instruction") or info.get("goal") or _text(obs).strip().splitlines()[0])
                out.append(Task(task_id=f"{cls.gym_id or cls.__name__}-s{s}", instruction=instruction,
                                initial_state=state, game_file=cls.gym_id, seed=s))
        finally:
            env.env.close()
        return out


def gym_family(gym_id: str) -> type:
    """The plug-in class of `actors.env_family=gym:<gym_id>`."""
    if not gym_id.strip():
        raise ValueError("gym: needs a gymnasium id, e.g. gym:MyTextGame-v0")
    return type(f"GymTextEnv[{gym_id}]", (GymTextEnv,), {"gym_id": gym_id.strip()})
