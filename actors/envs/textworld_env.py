"""TextWorld behind the one text interface: game generation, task splits, the environment.

Owns three things:

- `make_textworld_tasks`: tw-make games from fixed seeds, cached on disk
  (`<data_dir>/textworld/games/<family>-s<seed>.z8`), split into train and held-out
  by seed and, optionally, by whole families that only appear in the held-out set.
- `TextWorldEnv`: a synchronous core (`reset_sync`/`step_sync`) over
  `textworld.start`, exposed through the async Environment interface with
  `asyncio.to_thread`.
- the abstract state: goal, room (name and a short description), inventory, what is
  still to do (the facts of the quest's win condition that do not hold yet, read from
  TextWorld's `win_facts`), then the admissible commands as numbered items; and the
  env-facts rationale of a step (the world facts that the action added and removed, in
  words, then each To do item marked done or not yet).

Departures from plain TextWorld: the state shows the win condition's missing facts, which
TextWorld keeps to itself (the quest's prose names them only loosely), so that a small
experience model can tell when a quest is won; the reward is the paper's outcome reward (1.0 when
the game is won at that step, else 0.0), not TextWorld's score; `look`,
`inventory` and `examine ...` are left out of the numbered items because the state
already shows what they would print (they stay valid if typed); an action that is
not admissible never reaches the game, it returns the unchanged state marked
invalid. `info["expert_action"]` is TextWorld's `policy_commands[0]`, the plan from
the current state, so a noisy expert recovers after a random step.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from actors.dataset import TaskSplits
from actors.envs.base import (AbstractState, ActionFormatError, EpisodeBookkeeping, LockedThreadCore, StepResult,
                              parse_action)
from actors.envs.env_process import EnvProcess, EnvProcessError, Isolation
from infra.metrics import ENV_RESETS
from infra.schema import Task

FAMILY_ARGS: dict[str, list[str]] = {
    # Tiny worlds so a game is generated in 2-5 s and solved in a handful of steps.
    "tw-simple": ["tw-simple", "--rewards", "sparse", "--goal", "detailed"],
    "tw-cooking-1": ["tw-cooking", "--recipe", "1", "--take", "1", "--go", "1"],
    "tw-cooking-2": ["tw-cooking", "--recipe", "2", "--take", "2", "--go", "1", "--open"],
    "tw-cooking-3": ["tw-cooking", "--recipe", "2", "--take", "2", "--go", "6", "--open", "--cut"],
    "custom": ["custom", "--world-size", "2", "--nb-objects", "4", "--quest-length", "2"],
    "custom-3": ["custom", "--world-size", "3", "--nb-objects", "6", "--quest-length", "3"],
    # Longer quests in bigger worlds (configs/experiments/textworld_long.yaml): the expert's plan is the quest
    # length (4, 5, 6, 8 steps); tw-make took 13-17 s a game on the loaded 2-core CPU (2026-12-03).
    "custom-4": ["custom", "--world-size", "4", "--nb-objects", "8", "--quest-length", "4"],
    "custom-5": ["custom", "--world-size", "5", "--nb-objects", "9", "--quest-length", "5"],
    "custom-6": ["custom", "--world-size", "6", "--nb-objects", "10", "--quest-length", "6"],
    "custom-8": ["custom", "--world-size", "8", "--nb-objects", "12", "--quest-length", "8"],
    "tw-coin_collector": ["tw-coin_collector", "--level", "5"],
    "tw-treasure_hunter": ["tw-treasure_hunter", "--level", "2"],
}
# "tw-cooking" alone cycles through its levels, one game per level in turn.
FAMILY_ALIASES = {"tw-cooking": ["tw-cooking-1", "tw-cooking-2", "tw-cooking-3"]}

# Commands whose output the abstract state already shows; kept valid, not listed.
_HIDDEN = re.compile(r"^(look|inventory|examine .+)$")
_FACT = re.compile(r"^(\w+)\((.*)\)$")
DESCRIPTION_CHARS = 320
# TextWorld's grammar parser (tatsu) is not thread-safe: concurrent game loads in one
# process corrupt each other. The calls are short and GIL-bound, so one lock costs nothing.
_TW_LOCK = threading.Lock()


class GameGenerationError(RuntimeError):
    """tw-make failed for a family and seed."""


class GameFileError(ValueError):
    """A game file that cannot be played: missing, corrupt, truncated, or without the .json tw-make writes beside it."""

    reason = "bad_game_file"  # what an episode that meets one records (actors/episode.py)


# Z-machine header (the Z-Machine Standard 1.1, section 11): byte 0 is the version (1-8); the word at 0x1A
# is the file's length divided by 2 (versions 1-3), 4 (4-5) or 8 (6-8); the header is 64 bytes.
_ZHEADER_BYTES = 64
_ZLENGTH_SCALE = {1: 2, 2: 2, 3: 2, 4: 4, 5: 4, 6: 8, 7: 8, 8: 8}


def game_file_problem(path: str | Path) -> str | None:
    """Why the game at `path` cannot be played, in one line naming it, or None when it passes the check.

    The check reads the header only: a .z8 (any Z-machine version) must have a version byte of 1..8 and at
    least the length its header states; a .ulx starts with Glulx's magic; both need the .json that
    tw-make writes beside them (textworld.start reads the quest from it). TextWorld's interpreter calls
    exit() from C on a bad version byte, so this is checked before any game is opened."""
    p = Path(path)
    if not p.is_file():
        return f"{p}: no such game file"
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(_ZHEADER_BYTES)
    if p.suffix == ".ulx":
        if head[:4] != b"Glul":
            return f"{p}: not a Glulx game (no 'Glul' magic at its start)"
    else:
        if len(head) < _ZHEADER_BYTES:
            return f"{p}: truncated ({size} bytes, shorter than a Z-machine header)"
        version = head[0]
        if version not in _ZLENGTH_SCALE:
            return f"{p}: not a Z-machine game (version byte {version}, expected 1..8)"
        declared = int.from_bytes(head[0x1A:0x1C], "big") * _ZLENGTH_SCALE[version]
        if declared and size < declared:
            return f"{p}: truncated ({size} bytes; its header says {declared})"
    if not p.with_suffix(".json").is_file():
        return f"{p}: no {p.with_suffix('.json').name} beside it (tw-make writes one; TextWorld reads the quest from it)"
    return None


def check_game_file(path: str | Path) -> None:
    """Raise GameFileError, naming the file, unless `game_file_problem` finds nothing."""
    problem = game_file_problem(path)
    if problem is not None:
        raise GameFileError(problem)


def _tw_make() -> str:
    exe = Path(sys.executable).with_name("tw-make")
    return str(exe) if exe.exists() else (shutil.which("tw-make") or "tw-make")


def generate_game(family: str, seed: int, games_dir: str | Path) -> Path:
    """The .z8 game of `family` with `seed`, generated once and then read from the cache."""
    if family not in FAMILY_ARGS:
        raise ValueError(f"unknown TextWorld family {family!r}; expected one of {sorted(FAMILY_ARGS) + list(FAMILY_ALIASES)}")
    out = Path(games_dir) / f"{family}-s{seed}.z8"
    if out.exists() and game_file_problem(out) is None:
        return out  # a cached game that fails the load-time check (truncated, corrupt) is made again
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.tmp.z8")  # rename at the end: a crash never leaves half a game
    cmd = [_tw_make(), *FAMILY_ARGS[family], "--seed", str(seed), "--output", str(tmp), "--silent", "-f"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 or not tmp.exists():
        raise GameGenerationError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-500:]}")
    for ext in (".json", ".ni"):  # tw-make writes sidecars; textworld.start reads the .json
        side = tmp.with_suffix(ext)
        if side.exists():
            side.replace(out.with_suffix(ext))
    tmp.replace(out)
    return out


def _expand(families: list[str]) -> list[str]:
    out: list[str] = []
    for f in families:
        out += FAMILY_ALIASES.get(f, [f])
    for f in out:
        if f not in FAMILY_ARGS:
            raise ValueError(f"unknown TextWorld family {f!r}; expected one of {sorted(FAMILY_ARGS) + list(FAMILY_ALIASES)}")
    return out


def make_textworld_tasks(data_dir: str | Path, n_train: int, n_heldout: int, families: list[str], seed: int = 0,
                         heldout_families: list[str] | tuple[str, ...] = (), workers: int = 2):
    """Generate (or load from the cache) games and split them into train and held-out tasks.

    Train games take seeds `seed*10000 + i`, held-out ones `seed*10000 + 5000 + i`, so
    no game appears in both. Families are assigned round-robin; `heldout_families`
    appear only in the held-out split (the "held-out family" test).
    """
    train_fams = _expand(list(families))
    held_fams = train_fams + [f for f in _expand(list(heldout_families)) if f not in train_fams]
    if not train_fams:
        raise ValueError("no TextWorld families given")
    games_dir = Path(data_dir).resolve() / "textworld" / "games"  # absolute: splits.json is read from any cwd
    plan = [("train", train_fams[i % len(train_fams)], seed * 10000 + i) for i in range(n_train)]
    plan += [("heldout", held_fams[i % len(held_fams)], seed * 10000 + 5000 + i) for i in range(n_heldout)]
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:  # tw-make runs as a subprocess
        paths = list(pool.map(lambda p: generate_game(p[1], p[2], games_dir), plan))
    tasks = tasks_from_games(paths, [(fam, s) for _split, fam, s in plan])
    if refused_games(tasks):  # generated here and checked: a bad one is a broken install, not a bad input
        raise GameFileError("; ".join(refused_games(tasks)))
    return TaskSplits(train=[t for t, p in zip(tasks, plan) if p[0] == "train"],
                      heldout=[t for t, p in zip(tasks, plan) if p[0] == "heldout"])


def tasks_from_games(paths: list[Path], origins: list[tuple[str, int]] | None = None,
                     isolated: bool = True) -> list[Task]:
    """One Task per game file, its instruction and initial state read off a reset.

    `origins` gives each game's (family, seed) when it was generated here; any other
    game (a user's own, `dreamgym eval --tasks DIR`) is named after its file. Each file is
    checked first (`game_file_problem`), and the resets run in one supervised child process
    (actors/envs/env_process.py; `isolated=False`: in this one), so a game that makes the
    interpreter exit costs that game only. A game that fails either way is still returned,
    with `meta["refused"]`: one line naming its file and why (`dreamgym eval --tasks` reports
    it and plays the rest; `make_textworld_tasks` raises)."""
    env: Any = EnvProcess("textworld", Isolation(max_crashes=0), max_steps=1) if isolated else TextWorldEnv()
    tasks = []
    try:
        for i, path in enumerate(paths):
            fam, s = origins[i] if origins else ("textworld", 0)
            task_id = f"{fam}-s{s}" if origins else Path(path).stem
            task = Task(task_id=task_id, instruction="", family=fam, game_file=str(path), seed=s)
            problem = game_file_problem(path)
            if problem is None:
                try:
                    state, info = env.reset_sync(task)
                    task.instruction = str(info.get("objective") or "")
                    task.initial_state = state
                    # the expert's plan from the start: the results table's "longer than training" slice reads it
                    task.meta["plan_length"] = int(info.get("plan_length") or 0)
                except (EnvProcessError, GameFileError) as exc:
                    problem = str(exc)
                except Exception as exc:  # in process: whatever the game engine raised on this file
                    problem = f"{path}: {type(exc).__name__}: {exc}"
            if problem is not None:
                task.meta["refused"] = problem[:500]
            tasks.append(task)
    finally:
        env.close_sync()
    return tasks


def refused_games(tasks: list[Task]) -> list[str]:
    """The one-line reasons of the tasks `tasks_from_games` refused."""
    return [str(t.meta["refused"]) for t in tasks if t.meta.get("refused")]


def _humanize_fact(fact: str) -> str:
    """'in(milk: f, I)' -> 'milk in inventory'; 'open(fridge: c)' -> 'fridge open'."""
    m = _FACT.match(fact.strip())
    if not m:
        return fact
    pred, args = m.group(1), [a.split(":")[0].strip() for a in m.group(2).split(",") if a.strip()]
    args = ["inventory" if a == "I" else "you" if a == "P" else a for a in args]
    pred = pred.replace("_", " ")
    if len(args) == 1:
        return f"{args[0]} {pred}"
    if len(args) == 2:
        if args[0] == "you" and pred == "at":
            return f"you in {args[1]}"
        return f"{args[0]} {pred} {args[1]}"
    return f"{pred}({', '.join(args)})"


def _missing(win: list[str] | None, facts: set[str]) -> list[str]:
    """The win condition's facts that do not hold in `facts`, in the condition's order."""
    return [f for f in win or [] if f not in facts]


def to_do(win: list[str], facts: set[str]) -> list[str]:
    """The win condition's facts that do not hold yet, in words ('cloak at cellar')."""
    return [_humanize_fact(f) for f in _missing(win, facts)]


def facts_rationale(action: str, before: set[str], after: set[str], won: bool, limit: int = 4,
                    win: list[str] | None = None) -> str:
    """A short causal rationale from the facts diff, then a check of the state's To do items, e.g.
    'take apple: now apple in inventory; no longer apple on counter; to do: apple in fridge (not yet)'
    and 'put apple in fridge: now apple in fridge; ...; to do: apple in fridge (done); the goal is reached'.

    Each item the step started with (`to_do(win, before)`) is copied and marked done or not yet,
    so the reward follows from a match between an item and the "now" clause just written: the
    135M experience model copied the list unchanged when it had to drop the item achieved."""
    added = sorted(_humanize_fact(f) for f in after - before)[:limit]
    removed = sorted(_humanize_fact(f) for f in before - after)[:limit]
    parts = []
    if added:
        parts.append("now " + ", ".join(added))
    if removed:
        parts.append("no longer " + ", ".join(removed))
    if not parts:
        parts.append("nothing in the world changed")
    pending = _missing(win, before)
    if pending:
        parts.append("to do: " + ", ".join(f"{_humanize_fact(f)} ({'done' if f in after else 'not yet'})"
                                           for f in pending))
    text = f"{action}: " + "; ".join(parts)
    return text + ("; the goal is reached" if won else "")


def _room(description: str) -> str:
    text = (description or "").strip()
    m = re.search(r"-=\s*(.+?)\s*=-", text)
    name = m.group(1) if m else "unknown"
    body = " ".join(text[m.end():].split()) if m else " ".join(text.split())
    if len(body) > DESCRIPTION_CHARS:
        cut = body[:DESCRIPTION_CHARS]
        body = cut[: cut.rfind(".") + 1] if "." in cut else cut + "..."
    return f"{name}. {body}".strip()


def _inventory(text: str) -> str:
    t = " ".join((text or "").split())
    t = re.sub(r"^You are carrying:?\s*", "", t)
    return t.rstrip(".") or "nothing"


_DIRECTIONS = ("north", "south", "east", "west")


def _parse_fact(fact: str) -> tuple[str, list[str]]:
    m = _FACT.match(fact.strip())
    if not m:
        return "", []
    return m.group(1), [a.split(":")[0].strip() for a in m.group(2).split(",") if a.strip()]


def facts_description(facts: list[str]) -> tuple[str, str] | None:
    """(room line, inventory) built from the world facts, or None when the player's room is unknown.

    The paper's abstract state is the task-relevant part of an observation. TextWorld's
    prose ("Well how about that, you are in a place we're calling a bedroom...") costs
    ~100 tokens and carries nothing the facts do not, so the room is rendered from the
    facts instead: what is here and in which state, what open containers and supporters
    hold, and the exits. A 135M experience model then predicts a ~60-token state whose
    change is exactly the facts diff of the step.
    """
    parsed = [_parse_fact(f) for f in facts]
    room = next((a[1] for p, a in parsed if p == "at" and len(a) == 2 and a[0] == "P"), None)
    if room is None:
        return None
    states: dict[str, list[str]] = {}
    holds: dict[str, list[tuple[str, str]]] = {}
    inventory = []
    for p, a in parsed:
        if p in ("open", "closed", "locked") and len(a) == 1:
            states.setdefault(a[0], []).append(p)
        elif p in ("in", "on") and len(a) == 2:
            if a[1] == "I":
                inventory.append(a[0])
            else:
                holds.setdefault(a[1], []).append((p, a[0]))
    here = [a[0] for p, a in parsed if p == "at" and len(a) == 2 and a[1] == room and a[0] != "P"]

    def describe(obj: str) -> str:
        bits = list(states.get(obj, []))
        visible = "closed" not in bits and "locked" not in bits
        inside = [f"{rel} it: {x}" for rel, x in holds.get(obj, []) if rel == "on" or visible]
        label = ", ".join(bits + inside)
        return f"{obj} ({label})" if label else obj

    exits = []
    doors = {(a[0], a[2]): a[1] for p, a in parsed if p == "link" and len(a) == 3}
    for p, a in parsed:
        if p.endswith("_of") and p[:-3] in _DIRECTIONS and len(a) == 2 and a[1] == room:
            door = doors.get((room, a[0]))
            door_text = f" through {describe(door)}" if door else ""
            exits.append(f"{p[:-3]} to {a[0]}{door_text}")
    lines = [f"Room: {room}", "You see: " + (", ".join(describe(o) for o in sorted(here)) or "nothing")]
    if exits:
        lines.append("Exits: " + "; ".join(sorted(exits)))
    return "\n".join(lines), ", ".join(sorted(inventory)) or "nothing"


def render_state(objective: str, description: str, inventory: str, commands: list[str],
                 facts: list[str] | None = None, win: list[str] | None = None) -> str:
    """The abstract state of a TextWorld game: goal, room, inventory, what is still to do, numbered commands.

    "To do" lists the win condition's facts that do not hold yet (`to_do`; "nothing" once
    they all do), so progress toward the goal is part of the state: the experience model
    predicts the reward by checking the action's effect against it, rather than by
    reading the quest's prose instruction."""
    shown = [c for c in commands if not _HIDDEN.match(c)] or list(commands)
    compact = facts_description(facts) if facts else None
    if compact is not None:
        room, inv = compact
        desc = f"Goal: {' '.join(objective.split())}\n{room}\nInventory: {inv}"
    else:
        desc = f"Goal: {' '.join(objective.split())}\nRoom: {_room(description)}\nInventory: {_inventory(inventory)}"
    if win:
        desc += "\nTo do: " + (", ".join(to_do(win, set(facts or []))) or "nothing")
    return AbstractState(desc, [(i + 1, c) for i, c in enumerate(shown)]).render()


class TextWorldEnv(EpisodeBookkeeping, LockedThreadCore):
    """One TextWorld game at a time; `reset(task)` opens `task.game_file`."""
    _core_lock = _TW_LOCK

    family = "textworld"
    # generate mode (actors.free_text_actions): a written command goes to `_resolve`, which takes any
    # admissible command (hidden ones such as "look" too) up to case and spacing, else answers invalid
    accepts_free_text = True

    def __init__(self, max_steps: int = 50):
        self.max_steps = max_steps
        self._env = None
        self._game_file = ""
        self._gs = None
        self.state = ""
        self.objective = ""
        self.win: list[str] = []  # the win condition's facts (first event of each quest)
        self.steps = 0
        self.invalid = 0
        self.done = True

    # --- sync core -------------------------------------------------------
    def _open(self, game_file: str) -> None:
        import textworld  # the game engine: only when a game opens

        if self._env is not None and game_file == self._game_file:
            return
        self.close_sync()
        infos = textworld.EnvInfos(admissible_commands=True, policy_commands=True, won=True, lost=True,
                                   objective=True, facts=True, description=True, inventory=True, win_facts=True)
        self._env = textworld.start(game_file, request_infos=infos)
        self._game_file = game_file

    def _observe(self) -> str:
        gs = self._gs
        self._shown = [c for c in gs.admissible_commands if not _HIDDEN.match(c)] or list(gs.admissible_commands)
        self.state = render_state(self.objective, gs.description or "", gs.inventory or "", list(gs.admissible_commands),
                                  [str(f) for f in (gs.facts or [])], self.win)
        return self.state

    def _info(self, valid: bool, **extra: Any) -> dict[str, Any]:
        plan = list(self._gs.policy_commands or []) if self._gs is not None else []
        return self._book_info(self._shown, valid, lambda: plan[0] if plan else None, **extra)

    def reset_sync(self, task: Task) -> tuple[str, dict[str, Any]]:
        if not task.game_file:
            raise GameFileError(f"task {task.task_id} names no TextWorld game file")
        check_game_file(task.game_file)
        self._open(task.game_file)
        self._gs = self._env.reset()
        self.objective = self._gs.objective or task.instruction
        self.win = [str(f) for quest in (self._gs.win_facts or []) if quest for f in quest[0]]
        self._begin()
        ENV_RESETS.labels(family="textworld").inc()
        # the task's instruction and the expert's plan length, for `tasks_from_games` (run in a child process)
        return self._observe(), self._info(True, objective=self.objective,
                                           plan_length=len(self._gs.policy_commands or []))

    def _resolve(self, action: str) -> str | None:
        """The admissible command an action names, or None."""
        try:
            act = parse_action(action)
        except ActionFormatError:
            return None
        admissible = {c.lower(): c for c in self._gs.admissible_commands}
        if act.kind == "choose":
            return self._shown[act.ref - 1] if 1 <= act.ref <= len(self._shown) else None
        if act.kind == "command":
            return admissible.get(" ".join(act.text.lower().split()))
        return None  # click/type have no meaning in a text game

    def step_sync(self, action: str) -> StepResult:
        if self._gs is None:
            raise RuntimeError("step() before reset()")
        if self.done:
            return self._over(self.state, action)
        command = self._resolve(action)
        self._count_step()
        if command is None:
            reason = "not one of the listed commands" if not isinstance(action, str) or not action.lower().startswith(("click", "type")) else "web actions do not apply to a text game"
            return self._refuse(self.state, action, reason)
        before = {str(f) for f in self._gs.facts}
        self._gs, _score, game_over = self._env.step(command)
        won, lost = bool(self._gs.won), bool(self._gs.lost)
        after = {str(f) for f in self._gs.facts}
        truncated = self._end_step(won, lost or game_over)
        state = self._observe()
        return StepResult(state, self._outcome(), self.done,
                          self._info(True, lost=lost, truncated=truncated, command=command,
                                     rationale=facts_rationale(command, before, after, won, win=self.win)))

    def close_sync(self) -> None:
        if self._env is not None:
            try:
                self._env.close()
            finally:
                self._env, self._game_file, self._gs = None, "", None

