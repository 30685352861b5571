"""The synthetic environment: the real environments' interface, stepped by Mexp.

Owns one synthetic episode: `reset(task)` starts from the task's real initial state
when it has one (else Mexp invents it), `step(action)` asks Mexp for the next state,
outcome reward and done flag, keeps the per-episode history Mexp is conditioned on,
and ends the episode at `max_steps` (done, `info["truncated"]`).

An action that is not one of the current state's candidates is answered without
calling Mexp: the unchanged state prefixed with "Invalid action", reward 0,
`info["valid"] = False`, as a real environment would (and counted the same way,
`rollout_invalid_actions_total`). `[n]` picks item n. With `free_text` (the run's
`actors.free_text_actions`: generate mode's unmatched actions, as written), such an action goes
to Mexp instead, unless the family's grammar refuses it there (`ExperienceModel.refusal`: TextWorld's
parser has no such verb, or the state's own description rules it out: then it is invalid as above,
and Mexp is not asked); `info["free_text"]` marks the step.
A step that replayed a real transition (simulator.replay_real) is marked
`info["reasoning_source"] = "replay"`, so the worker does not write it back as synthetic.
A step whose Mexp output is rejected after the retry budget raises
`MexpRejected` (the episode loop ends the episode with status `sim_error`), or,
with `on_reject="end"` (for gymnasium tooling, which expects `step` never to
raise), ends the episode: unchanged state, reward 0, done, `info["sim_error"]`.
"""

from __future__ import annotations

from typing import Any

from actors.envs.base import AbstractState, StateFormatError, StepResult, candidate_actions, invalid_observation
from infra.metrics import ROLLOUT_INVALID_ACTIONS
from infra.schema import REPLAYED, Task, new_id
from simulator.experience_model import ExperienceModel, MexpRejected


def _type_values(task: Task) -> list[str]:
    values = task.meta.get("fields") if isinstance(task.meta, dict) else None
    if isinstance(values, dict):
        return [str(v) for v in values.values()]
    if isinstance(values, (list, tuple)):
        return [str(v) for v in values]
    return []


class SyntheticEnv:
    """Environment interface over an ExperienceModel."""

    def __init__(self, mexp: ExperienceModel, max_steps: int = 8, on_reject: str = "raise",
                 free_text: bool = False) -> None:
        if on_reject not in ("raise", "end"):
            raise ValueError(f"on_reject must be 'raise' or 'end', got {on_reject!r}")
        # the episode loop hands an unmatched generate-mode action to an env that says it takes free text
        self.accepts_free_text = free_text
        self.mexp = mexp
        self.max_steps = max_steps
        self.on_reject = on_reject
        self.task: Task | None = None
        self.state = ""
        self.history: list[str] = []
        self.episode_id = ""
        self.steps = 0
        self.done = True

    def _info(self, **extra: Any) -> dict[str, Any]:
        try:
            cands = candidate_actions(AbstractState.parse(self.state), _type_values(self.task)) if self.task else []
        except StateFormatError:
            cands = []
        return {"candidates": cands, "valid": True, "won": False, "episode_id": self.episode_id, **extra}

    async def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        self.task = task
        self.state = await self.mexp.initial_state(task)
        self.history, self.steps, self.done = [], 0, False
        self.episode_id = new_id()
        return self.state, self._info()

    def _resolve(self, action: str, candidates: list[str]) -> str | None:
        """The candidate `action` names (itself, or item n for `[n]`), else None."""
        a = action.strip()
        if a in candidates:
            return a
        if a.startswith("[") and a.endswith("]") and a[1:-1].isdigit():
            text = AbstractState.parse(self.state).item(int(a[1:-1]))
            if text is not None and text in candidates:
                return text
        return None

    async def step(self, action: str) -> StepResult:
        if self.task is None:
            raise RuntimeError("step() before reset()")
        if self.done:
            return StepResult(self.state, 0.0, True, self._info(valid=False, reason="episode is over"))
        info = self._info()
        text = action.strip() if isinstance(action, str) else ""
        chosen = self._resolve(text, info["candidates"])
        why, free = "not one of the available actions", False
        if chosen is None and self.accepts_free_text and text and not text.startswith("["):
            why = self.mexp.refusal(self.task, self.state, text)
            chosen, free = (None, False) if why else (text, True)
        self.steps += 1
        truncated = self.steps >= self.max_steps
        if chosen is None:
            ROLLOUT_INVALID_ACTIONS.labels(env_kind="synthetic").inc()
            self.done = truncated
            obs = invalid_observation(self.state, str(action), why)
            return StepResult(obs, 0.0, truncated, {**info, "valid": False, "truncated": truncated, "reason": why})
        try:
            out = await self.mexp.step(self.task, self.history, self.state, chosen, self.episode_id)
        except MexpRejected as exc:
            if self.on_reject == "raise":
                raise
            self.done = True
            return StepResult(self.state, 0.0, True, {**info, "sim_error": True, "reason": str(exc)})
        self.history.append(chosen)
        self.state = out.next_state
        self.done = out.done or truncated
        won = out.done and out.reward >= 1.0
        return StepResult(self.state, float(out.reward), self.done,
                          self._info(won=won, truncated=truncated and not out.done, reasoning=out.reasoning,
                                     reasoning_source=REPLAYED if out.replayed else "mexp",
                                     **({"free_text": True} if free else {})))

    async def close(self) -> None:
        self.done = True
