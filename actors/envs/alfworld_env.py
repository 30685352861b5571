"""ALFWorld behind the one text interface: generated household games played through TextWorld.

Owns `AlfWorldEnv` and the ALFWorld abstract state:

- Games come from actors/envs/alfworld_problems.py (`.tw-pddl` files over ALFWorld's
  own PDDL domain and grammar). Each is registered with
  `textworld.gym.register_games(..., wrappers=[AlfredDemangler, AlfredInfos])`, as
  ALFWorld's `AlfredTWEnv` does, so the text and the object names ("apple 1",
  "countertop 2") are ALFWorld's. A synchronous core (`reset_sync`/`step_sync`) is
  exposed through the async Environment interface with `asyncio.to_thread`, under the
  lock that TextWorld's grammar parser needs (shared with TextWorldEnv).
- State: the goal as ALFWorld states it, where the agent is (the receptacles at its
  location, open or closed, and what they visibly hold), what it holds (and whether
  that is hot, cool or clean), then the admissible commands as numbered items. Like
  TextWorld's, it is rendered from the game's facts rather than its prose, and
  limited to what ALFWorld's own text shows at that point (closed receptacles hide
  their contents; nothing is said about rooms not visited), so the policy still has
  to search the room. Object states of what the agent holds are shown although
  ALFWorld only says them after `examine` (the agent made them so itself).
- Items: interaction commands first, then the `go to` commands, so that a policy
  limited to the first N candidates keeps every interaction. `look`, `inventory`,
  `examine ...` and `help` are left out of the items (the state shows what they
  print) but stay valid when typed.
- Reward: the paper's outcome reward, 1.0 when the goal holds at that step.
- Rationale: the world facts that the step added and removed, in words
  ("heat apple 1 with microwave 1: now apple 1 hot").
- Expert: TextWorld's planner (`policy_commands`, Fast Downward). The plan from the
  start is the game's walkthrough; while the agent follows it the rest of it stays
  valid, and only after a deviation does the planner run again, when the expert
  move is asked for. `info["expert_action"]` is then a zero-argument callable that
  returns it (a replan costs up to ~1 s of CPU on the larger problems, and a random
  policy never asks).
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any, Callable

from actors.envs.base import (AbstractState, ActionFormatError, EpisodeBookkeeping, LockedThreadCore, StepResult,
                              parse_action)
from actors.envs.textworld_env import _TW_LOCK
from infra.metrics import ENV_RESETS
from infra.schema import Task

_HIDDEN = re.compile(r"^(look|inventory|help|examine .+)$")
_TASK = re.compile(r"Your task is to:\s*(.+?)\s*$", re.S)
_SHOWN_STATES = (("ishot", "hot"), ("iscool", "cool"), ("isclean", "clean"))
_registered: dict[str, str] = {}  # game file -> textworld.gym env id (one registration per file and process)


def _request_infos() -> Any:
    import textworld  # the game engine: only when an ALFWorld game is opened

    return textworld.EnvInfos(admissible_commands=True, won=True, lost=True, facts=True, feedback=True,
                              extras=["gamefile"])


def _env_id(game_file: str) -> str:
    # the game engine and ALFWorld's wrappers: optional installs, only when a game is opened
    import textworld.gym
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos  # optional install, only when used

    if game_file not in _registered:
        _registered[game_file] = textworld.gym.register_games([game_file], _request_infos(), max_episode_steps=None,
                                                              name="dreamgym-alfworld",
                                                              wrappers=[AlfredDemangler, AlfredInfos])
    return _registered[game_file]


Fact = tuple[str, tuple[str, ...]]


def facts_of(props: Any) -> set[Fact]:
    """TextWorld propositions -> {(predicate, (argument names...))}, names as ALFWorld shows them."""
    return {(p.name, tuple(a.name.strip() for a in p.arguments)) for p in (props or [])}


def _index(facts: set[Fact]) -> dict[str, list[tuple[str, ...]]]:
    out: dict[str, list[tuple[str, ...]]] = {}
    for pred, args in facts:
        out.setdefault(pred, []).append(args)
    return out


def _here(idx: dict[str, list[tuple[str, ...]]]) -> list[str]:
    """The receptacles at the agent's location, sorted."""
    locs = {a[1] for a in idx.get("atlocation", []) if len(a) == 2}
    return sorted(a[0] for a in idx.get("receptacleatlocation", []) if len(a) == 2 and a[1] in locs)


def _natural(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def describe(facts: set[Fact]) -> tuple[str, str]:
    """(location line, holding line) of the abstract state, from the facts."""
    idx = _index(facts)
    unary = {pred: {a[0] for a in args if a} for pred, args in idx.items()}
    inside: dict[str, list[str]] = {}
    for o, r in (a for a in idx.get("inreceptacle", []) if len(a) == 2):
        inside.setdefault(r, []).append(o)

    def obj(o: str) -> str:
        return f"{o} (on)" if o in unary.get("istoggled", ()) else o

    def recep(r: str) -> str:
        things = ", ".join(obj(o) for o in sorted(inside.get(r, []), key=_natural))
        if r in unary.get("openable", ()):
            if r not in unary.get("opened", ()):
                return f"{r} (closed)"
            return f"{r} (open; in it: {things})" if things else f"{r} (open, empty)"
        return f"{r} (on it: {things})" if things else f"{r} (empty)"

    here = _here(idx)
    location = "; ".join(recep(r) for r in sorted(here, key=_natural)) if here else "the middle of the room"
    held = []
    for o in sorted((a[1] for a in idx.get("holds", []) if len(a) == 2), key=_natural):
        states = [word for pred, word in _SHOWN_STATES if o in unary.get(pred, ())]
        held.append(f"{o} ({', '.join(states)})" if states else o)
    return location, ", ".join(held) or "nothing"


def order_commands(commands: list[str]) -> list[str]:
    """The listed items: interactions first, then `go to` commands, each group in natural order."""
    shown = [c for c in commands if not _HIDDEN.match(c)] or list(commands)
    acts = sorted((c for c in shown if not c.startswith("go to ")), key=_natural)
    goes = sorted((c for c in shown if c.startswith("go to ")), key=_natural)
    return acts + goes


def render_state(objective: str, facts: set[Fact], commands: list[str]) -> str:
    """The abstract state of an ALFWorld game: goal, location, holding, numbered commands."""
    location, holding = describe(facts)
    desc = f"Goal: {' '.join(objective.split())}\nLocation: {location}\nHolding: {holding}"
    return AbstractState(desc, [(i + 1, c) for i, c in enumerate(order_commands(commands))]).render()


def _phrase(fact: Fact, idx: dict[str, list[tuple[str, ...]]]) -> str | None:
    pred, a = fact
    if pred == "inreceptacle" and len(a) == 2:
        return f"{a[0]} in {a[1]}"
    if pred == "holds" and len(a) == 2:
        return f"holding {a[1]}"
    if pred == "opened" and a:
        return f"{a[0]} open"
    if pred == "istoggled" and a:
        return f"{a[0]} on"
    if pred == "atlocation" and len(a) == 2:
        at = sorted((r for r, l in idx.get("receptacleatlocation", []) if l == a[1]), key=_natural)
        return f"you at {', '.join(at)}" if at else "you in the middle of the room"
    for p, word in _SHOWN_STATES:
        if pred == p and a:
            return f"{a[0]} {word}"
    return None


def facts_rationale(action: str, before: set[Fact], after: set[Fact], won: bool, limit: int = 4) -> str:
    """'take apple 1 from countertop 1: now holding apple 1; no longer apple 1 in countertop 1'."""
    ib, ia = _index(before), _index(after)
    added = sorted(p for f in after - before if (p := _phrase(f, ia)))[:limit]
    removed = sorted(p for f in before - after if (p := _phrase(f, ib)))[:limit]
    parts = (["now " + ", ".join(added)] if added else []) + (["no longer " + ", ".join(removed)] if removed else [])
    text = f"{action}: " + ("; ".join(parts) if parts else "nothing in the world changed")
    return text + ("; the goal is reached" if won else "")


class AlfWorldEnv(EpisodeBookkeeping, LockedThreadCore):
    """One ALFWorld game at a time; `reset(task)` opens `task.game_file` (a `.tw-pddl` file)."""
    _core_lock = _TW_LOCK

    family = "alfworld"

    def __init__(self, max_steps: int = 50):
        self.max_steps = max_steps
        self._gym = None
        self._game_file = ""
        self._walkthrough: list[str] = []
        self._plan: list[str] | None = None
        self._infos: dict[str, Any] = {}
        self._facts: set[Fact] = set()
        self._shown: list[str] = []
        self.state = ""
        self.objective = ""
        self.steps = 0
        self.invalid = 0
        self.replans = 0
        self.done = True
        self.won = False

    # --- sync core ---------------------------------------------------------
    def _open(self, game_file: str) -> None:
        import textworld.gym  # the game engine: only when a game is opened

        if self._gym is not None and game_file == self._game_file:
            return
        self.close_sync()
        data = json.loads(Path(game_file).read_text())
        self._walkthrough = list(data.get("walkthrough") or [])
        self._gym = textworld.gym.make(_env_id(game_file))
        self._game_file = game_file

    def _observe(self, infos: dict[str, Any]) -> str:
        self._infos = infos
        self._facts = facts_of(infos.get("facts"))
        commands = list(infos.get("admissible_commands") or [])
        self._shown = order_commands(commands)
        self.state = render_state(self.objective, self._facts, commands)
        return self.state

    def replan(self) -> list[str]:
        """TextWorld's planner from the current state (what `policy_commands` would hold)."""
        core = self._gym.batch_env.envs[0]  # the wrapper chain forwards to the PddlEnv
        self.replans += 1
        with _TW_LOCK:
            return list(core._pddl_state.replan(core._entity_infos) or [])

    def expert_move(self) -> str | None:
        """The planner's next command from here; replans only when the agent has left the current plan."""
        if self.done:
            return None
        admissible = set(self._infos.get("admissible_commands") or [])
        if not self._plan or self._plan[0] not in admissible:
            self._plan = self.replan()
        return self._plan[0] if self._plan else None

    def _expert(self) -> str | Callable[[], str | None] | None:
        if self.done:
            return None
        if self._plan and self._plan[0] in set(self._infos.get("admissible_commands") or []):
            return self._plan[0]
        return self.expert_move  # asked for only by the expert choosers; a replan is not free

    def _info(self, valid: bool, **extra: Any) -> dict[str, Any]:
        return self._book_info(self._shown, valid, self._expert, **extra)

    def reset_sync(self, task: Task) -> tuple[str, dict[str, Any]]:
        if not task.game_file or not Path(task.game_file).exists():
            raise FileNotFoundError(f"ALFWorld game file {task.game_file!r} of task {task.task_id} does not exist")
        self._open(task.game_file)
        obs, infos = self._gym.reset()
        m = _TASK.search(str(obs))
        self.objective = m.group(1).rstrip(".") + "." if m else task.instruction
        self._begin()
        self._plan = list(self._walkthrough) or None
        ENV_RESETS.labels(family="alfworld").inc()
        return self._observe(infos), self._info(True)

    def _resolve(self, action: str) -> str | None:
        try:
            act = parse_action(action)
        except ActionFormatError:
            return None
        if act.kind == "choose":
            return self._shown[act.ref - 1] if 1 <= act.ref <= len(self._shown) else None
        if act.kind == "command":
            admissible = {c.lower(): c for c in self._infos.get("admissible_commands") or []}
            return admissible.get(" ".join(act.text.lower().split()))
        return None  # click/type have no meaning in a text game

    def step_sync(self, action: str) -> StepResult:
        if self._gym is None:
            raise RuntimeError("step() before reset()")
        if self.done:
            return self._over(self.state, action)
        command = self._resolve(action) if isinstance(action, str) else None
        self._count_step()
        if command is None:
            web = isinstance(action, str) and action.strip().lower().startswith(("click", "type"))
            reason = "web actions do not apply to a text game" if web else "not one of the listed commands"
            return self._refuse(self.state, action, reason)
        if self._plan and command == self._plan[0]:
            self._plan = self._plan[1:]  # the rest of an optimal plan stays a plan from the state it leads to
        else:
            self._plan = None
        before = self._facts
        _obs, _score, game_done, infos = self._gym.step(command)
        lost = bool(infos.get("lost"))
        truncated = self._end_step(bool(infos.get("won")), lost or bool(game_done))
        state = self._observe(infos)
        return StepResult(state, self._outcome(), self.done,
                          self._info(True, lost=lost, truncated=truncated, command=command,
                                     rationale=facts_rationale(command, before, self._facts, self.won)))

    def close_sync(self) -> None:
        if self._gym is not None:
            try:
                self._gym.close()
            finally:
                self._gym, self._game_file, self._plan = None, "", None

