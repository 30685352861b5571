"""The one environment interface, the abstract textual state and the action format.

Owns the contract that real environments (TextWorld, MiniWoB++) and the synthetic
one (simulator/synthetic_env.py) share, so a policy and the sim-to-real switch never
see which is which:

- `reset(task) -> (state, info)` and `step(action) -> StepResult(state, reward, done, info)`;
  text in, text out; outcome reward (1.0 on success at the final step, else 0.0).
- `info["candidates"]` lists the actions the policy may choose from (TextWorld's
  admissible commands; click/type actions for a page's elements); `info["valid"]`
  says whether the last action was accepted; `info["won"]` marks success.
- An invalid action never raises: the returned state says it was invalid.
- An environment that cannot go on raises `SimulationError` (a synthetic step Mexp
  could not produce); any other exception of a real environment is a crash.

The abstract state (paper §4.1) is a short description followed by numbered
actionable items, one per line:

    Goal: put the apple in the fridge
    Room: Kitchen. You see a fridge and a counter.
    Inventory: nothing
    Actions:
    [1] open fridge
    [2] take apple from counter

For web pages the items are elements: `[7] input_text #username`, `[11] button 'Login'`.
Actions are one parseable format everywhere: `click [11]`, `type [7] "kenda"`, or,
for command-style environments, the command text itself or `[n]` for item n.
"""

from __future__ import annotations

import asyncio
import re
import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

from infra.metrics import ROLLOUT_INVALID_ACTIONS
from infra.schema import Task

ITEM_RE = re.compile(r"^\[(\d+)\]\s+(.+?)\s*$")
ACTIONS_HEADER = "Actions:"
INVALID_PREFIX = "Invalid action"

# Web element tags that take typed text rather than a click.
TYPEABLE_TAGS = ("input_text", "input_password", "textarea", "input_email", "input_search", "input_number")


class StateFormatError(ValueError):
    """Text that is not an abstract state (no numbered actionable items)."""


class ActionFormatError(ValueError):
    """Text that is not an action in the uniform format."""


class SimulationError(RuntimeError):
    """The environment could not produce the next state (the synthetic one: Mexp's output was rejected).

    Not the policy's doing: the episode loop (actors/episode.py) ends the episode with
    status `sim_error`, which the learner never trains on.
    """


@dataclass
class AbstractState:
    description: str
    items: list[tuple[int, str]] = field(default_factory=list)

    def render(self) -> str:
        lines = [self.description.rstrip(), ACTIONS_HEADER] if self.description.strip() else [ACTIONS_HEADER]
        lines += [f"[{i}] {text}" for i, text in self.items]
        return "\n".join(lines)

    def item(self, ref: int) -> str | None:
        for i, text in self.items:
            if i == ref:
                return text
        return None

    @classmethod
    def parse(cls, text: str) -> "AbstractState":
        """Strict parse: the description is every non-item line; at least one item is required."""
        if not isinstance(text, str):
            raise StateFormatError(f"state must be text, got {type(text).__name__}")
        desc, items, seen = [], [], set()
        for line in text.strip().splitlines():
            m = ITEM_RE.match(line.strip())
            if m:
                ref = int(m.group(1))
                if ref in seen:
                    raise StateFormatError(f"item [{ref}] appears twice")
                seen.add(ref)
                items.append((ref, m.group(2)))
            elif line.strip() != ACTIONS_HEADER:
                desc.append(line.rstrip())
        if not items:
            raise StateFormatError("no numbered actionable items like '[1] open door'")
        return cls("\n".join(desc).strip(), items)


def validate_state(text: str) -> AbstractState:
    """Raise StateFormatError unless `text` is a well-formed abstract state."""
    return AbstractState.parse(text)


_TODO_LINE = re.compile(r"^To do:(.*)$", re.M)


def to_do_items(state: str) -> list[str] | None:
    """The items of a state's "To do:" line, lower case ([] for "To do: nothing"); None without one.

    The line is what a quest still needs (TextWorld renders it, actors/envs/textworld_env.py); the
    reward check (simulator/mexp_output.py) and the variant check (simulator/task_variants.py) read it."""
    line = _TODO_LINE.search(state)
    if line is None:
        return None
    items = [i.strip() for i in line.group(1).lower().split(",")]
    return [i for i in items if i and i != "nothing"]


@dataclass(frozen=True)
class Action:
    kind: str  # "click", "type", "choose" (item n of a command list) or "command"
    ref: int | None = None
    text: str = ""

    def render(self) -> str:
        if self.kind == "click":
            return f"click [{self.ref}]"
        if self.kind == "type":
            return f'type [{self.ref}] "{self.text}"'
        if self.kind == "choose":
            return f"[{self.ref}]"
        return self.text


_CLICK = re.compile(r"^click\s*\[(\d+)\]$", re.I)
_TYPE = re.compile(r'^type\s*\[(\d+)\]\s*"(.*)"$', re.I | re.S)
_CHOOSE = re.compile(r"^\[?(\d+)\]?$")


def parse_action(text: str) -> Action:
    """Parse the uniform action format; anything else is a free command."""
    if not isinstance(text, str) or not text.strip():
        raise ActionFormatError("empty action")
    t = text.strip()
    if m := _CLICK.match(t):
        return Action("click", int(m.group(1)))
    if m := _TYPE.match(t):
        return Action("type", int(m.group(1)), m.group(2))
    if m := _CHOOSE.match(t):
        return Action("choose", int(m.group(1)))
    if t.lower().startswith(("click", "type")):
        raise ActionFormatError(f"malformed web action {t!r}; expected click [n] or type [n] \"text\"")
    return Action("command", None, t)


def candidate_actions(state: AbstractState, type_values: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The actions a policy may choose from in `state`.

    Command-style items (TextWorld) are their own actions. Web elements become
    `click [n]`, or `type [n] "v"` for each value in `type_values` (the task's fields).
    """
    out: list[str] = []
    for ref, text in state.items:
        tag = text.split()[0] if text.split() else ""
        if tag in TYPEABLE_TAGS:
            out += [Action("type", ref, v).render() for v in type_values]
        elif _is_web_element(tag):
            out.append(Action("click", ref).render())
        else:
            out.append(text)
    return out


_WEB_TAGS = {"button", "link", "a", "input_checkbox", "input_radio", "checkbox", "radio", "span", "div", "label",
             "option", "select", "li", "td", "tab", "img", "p", "h1", "h2", "h3", "input_submit", "input_button", "t"}


def _is_web_element(tag: str) -> bool:
    return tag in _WEB_TAGS or tag in TYPEABLE_TAGS


def invalid_observation(state: str, action: str, reason: str) -> str:
    """The state returned for an invalid action: the unchanged state with a first line saying why."""
    return f"{INVALID_PREFIX} {action!r}: {reason}\n{state}"


class StepResult(NamedTuple):
    state: str
    reward: float
    done: bool
    info: dict[str, Any]


class EpisodeBookkeeping:
    """One real episode's bookkeeping, kept here once for TextWorld, ALFWorld, MiniWoB++ and BrowserGym.

    - `steps`: every action counts toward `max_steps`, valid or not; `invalid`: the actions the
      environment never saw (each counted in rollout_invalid_actions_total{env_kind=real}), whose
      result is the unchanged state marked invalid with the reason;
    - `done`, `won`, truncation: the step limit truncates an episode that the environment itself
      did not end (won, lost, terminated); the reward is the paper's outcome reward, 1.0 at the
      winning step, else 0.0; an action after the end is answered "the episode is over";
    - the info dict's common keys: candidates, valid, won, invalid_actions, steps, and the expert's
      next action (None once the episode is over).

    The environment keeps what differs: how it resolves an action, renders its state, lists its
    candidates and finds the expert's move; it defines `_info(valid, **extra)` with `_book_info`."""

    max_steps: int
    steps: int = 0
    invalid: int = 0
    done: bool = True
    won: bool = False

    def _info(self, valid: bool, **extra: Any) -> dict[str, Any]:
        raise NotImplementedError

    def _begin(self) -> None:
        """A new episode."""
        self.steps, self.invalid, self.done, self.won = 0, 0, False, False

    def _count_step(self) -> None:
        self.steps += 1

    def _end_step(self, won: bool, ended: bool) -> bool:
        """After a step the environment took (`ended`: it ended the episode itself); whether the step limit truncated it."""
        self.won = bool(won)
        truncated = not (self.won or ended) and self.steps >= self.max_steps
        self.done = bool(self.won or ended or truncated)
        return truncated

    def _outcome(self) -> float:
        return 1.0 if self.won else 0.0

    def _refuse(self, state: str, action: Any, reason: str) -> StepResult:
        """An action the environment never saw (already counted by `_count_step`): the unchanged state, marked invalid."""
        self.invalid += 1
        ROLLOUT_INVALID_ACTIONS.labels(env_kind="real").inc()
        self.done = self.steps >= self.max_steps
        return StepResult(invalid_observation(state, str(action), reason), 0.0, self.done,
                          self._info(False, truncated=self.done, rationale=f"{action}: invalid, nothing changed"))

    def _over(self, state: str, action: Any) -> StepResult:
        return StepResult(invalid_observation(state, str(action), "the episode is over"), 0.0, True, self._info(False))

    def _book_info(self, candidates: Any, valid: bool, expert: Any, **extra: Any) -> dict[str, Any]:
        """The info dict; `expert()` gives the expert's next action and is asked only while the episode runs."""
        return {"candidates": list(candidates), "valid": valid, "won": self.won, "invalid_actions": self.invalid,
                "expert_action": None if self.done else expert(), "steps": self.steps, **extra}


@runtime_checkable
class Environment(Protocol):
    """Text in, text out. Real and synthetic environments both implement this."""

    async def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Start `task`; returns the initial abstract state and info (with "candidates")."""

    async def step(self, action: str) -> StepResult:
        """Apply one action in the uniform format; never raises on a bad action."""

    async def close(self) -> None:
        """Release processes (browsers, game interpreters)."""


class LockedThreadCore:
    """The async Environment interface over a synchronous core (`reset_sync`, `step_sync`,
    `close_sync`) that runs in a worker thread under `_core_lock`: TextWorld's game
    interpreters are not safe to drive from two threads at once."""

    _core_lock: threading.Lock

    def _locked(self, fn: Any, *args: Any) -> Any:
        with self._core_lock:
            return fn(*args)

    async def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        return await asyncio.to_thread(self._locked, self.reset_sync, task)  # type: ignore[attr-defined]

    async def step(self, action: str) -> StepResult:
        return await asyncio.to_thread(self._locked, self.step_sync, action)  # type: ignore[attr-defined]

    async def close(self) -> None:
        await asyncio.to_thread(self._locked, self.close_sync)  # type: ignore[attr-defined]
