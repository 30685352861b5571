"""Which environment and which task set a family name means.

Owns the mapping from a family name to an Environment (`make_env`), to its task splits
(`load_or_make_splits`) and to the check of its states' action lists (`action_grammar`).
Family names: "textworld" (or any tw-make family such as "tw-cooking-2", "custom"),
"miniwob" (or "miniwob/<task>"), "alfworld" (or "alfworld/<task type>") and "browsergym"
(or "browsergym/<env id>": MiniWoB++, or WebArena with the user's servers, through
BrowserGym). Splits live at `<data_dir>/<family>/splits.json` and are made once (games
generated, pages visited) from the `data` config section, then read back.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any, Callable

from actors.dataset import TaskSplits, splits_path, splits_settings, stamp_matches, write_stamp
from actors.envs.alfworld_env import AlfWorldEnv
from actors.envs.alfworld_problems import GAME_SUFFIX as ALFWORLD_SUFFIX
from actors.envs.alfworld_problems import make_alfworld_tasks
from actors.envs.alfworld_problems import tasks_from_games as alfworld_tasks
from actors.envs.base import Environment
from actors.envs.browsergym_env import BrowserGymEnv, make_browsergym_tasks
from actors.envs.miniwob_env import MiniWoBEnv, make_miniwob_tasks
from actors.envs.textworld_env import TextWorldEnv, make_textworld_tasks
from actors.envs.textworld_grammar import consistent_actions as textworld_actions
from actors.envs.textworld_env import tasks_from_games as textworld_tasks


def canonical_family(family: str) -> str:
    """'textworld', 'miniwob', 'alfworld' or 'browsergym' for any family or task-family name."""
    f = family.strip().lower()
    if f == "browsergym" or f.startswith("browsergym/"):
        return "browsergym"
    if f == "miniwob" or f.startswith("miniwob/"):
        return "miniwob"
    if f == "alfworld" or f.startswith("alfworld/"):
        return "alfworld"
    if f == "textworld" or f.startswith("tw-") or f.startswith("custom"):
        return "textworld"
    raise ValueError(f"unknown environment family {family!r}; expected textworld, miniwob, alfworld or browsergym")


def make_env(family: str, **kw: Any) -> Environment:
    """A fresh real environment of `family` (keyword arguments go to its constructor, e.g. max_steps)."""
    kind = canonical_family(family)
    if kind == "textworld":
        return TextWorldEnv(**kw)
    if kind == "alfworld":
        return AlfWorldEnv(**kw)
    if kind == "browsergym":
        return BrowserGymEnv(**kw)

    return MiniWoBEnv(**kw)


def action_grammar(family: str) -> Callable[[str, list[str]], list[str]] | None:
    """The check `(state, listed actions) -> the actions the state's own description allows` of a
    family whose states spell out the world (TextWorld: actors/envs/textworld_grammar.py, which drops
    what the description rules out and adds what it implies); None for the others (web pages list
    what is on them) and for a family name it does not know."""
    try:
        kind = canonical_family(family)
    except ValueError:
        return None
    return textworld_actions if kind == "textworld" else None


def load_or_make_splits(family: str, data_cfg: Any, data_dir: str | Path, seed: int = 0, rebuild: bool = False) -> TaskSplits:
    """Read `<data_dir>/<family>/splits.json`, or make and save it from the data config (also when the
    file was made with other settings: its stamp's key differs)."""
    kind = canonical_family(family)
    path = splits_path(data_dir, kind)
    settings = splits_settings(kind, data_cfg, seed)
    if not rebuild and stamp_matches(path, settings):
        return TaskSplits.load(path)
    if kind == "textworld":
        splits = make_textworld_tasks(data_dir, data_cfg.textworld_games, data_cfg.textworld_heldout,
                                      list(data_cfg.textworld_families), seed=seed,
                                      heldout_families=list(data_cfg.textworld_heldout_families),
                                      workers=data_cfg.workers)
    elif kind == "alfworld":
        splits = make_alfworld_tasks(data_dir, data_cfg.alfworld_games, data_cfg.alfworld_heldout,
                                     list(data_cfg.alfworld_task_types), seed=seed,
                                     heldout_task_types=list(data_cfg.alfworld_heldout_task_types),
                                     workers=data_cfg.workers)
    elif kind == "browsergym":
        splits = make_browsergym_tasks(list(data_cfg.browsergym_tasks), list(data_cfg.browsergym_heldout),
                                       seeds_per_task=data_cfg.browsergym_seeds, seed=seed)
    else:
        splits = make_miniwob_tasks(list(data_cfg.miniwob_tasks), list(data_cfg.miniwob_heldout),
                                    seeds_per_task=data_cfg.miniwob_seeds, seed=seed)
    splits.save(path)
    write_stamp(path, settings)
    return splits


GAME_SUFFIXES = {"textworld": (".z8", ".ulx"), "alfworld": (ALFWORLD_SUFFIX,)}


def tasks_from_spec(family: str, spec: str, data_cfg: Any = None, seed: int = 0) -> list:
    """Tasks named by the user (`dreamgym eval --tasks SPEC`), any family.

    TextWorld and ALFWorld: game files, given as a directory, a glob or one file
    (TextWorld .z8/.ulx, e.g. made with `tw-make`; ALFWorld .tw-pddl). MiniWoB++ and
    BrowserGym: task names, comma-separated or one per line in a file, each played at
    `data.miniwob_seeds` page seeds.
    """
    kind = canonical_family(family)
    if kind in GAME_SUFFIXES:
        p = Path(spec)
        paths = sorted(p.iterdir()) if p.is_dir() else [Path(x) for x in sorted(glob.glob(spec))] or [p]
        games = [x for x in paths if x.name.endswith(GAME_SUFFIXES[kind]) and x.is_file()]
        if not games:
            raise ValueError(f"--tasks {spec}: no {kind} game files ({', '.join(GAME_SUFFIXES[kind])}) there")
        return textworld_tasks(games) if kind == "textworld" else alfworld_tasks(games)
    text = Path(spec).read_text() if Path(spec).is_file() else spec
    names = [n.strip() for n in text.replace(",", "\n").splitlines() if n.strip() and not n.strip().startswith("#")]
    if not names:
        raise ValueError(f"--tasks {spec}: no task names")
    seeds = getattr(data_cfg, "miniwob_seeds", 1) if kind == "miniwob" else getattr(data_cfg, "browsergym_seeds", 1)
    make = make_miniwob_tasks if kind == "miniwob" else make_browsergym_tasks
    return make([], names, seeds_per_task=seeds, seed=seed).heldout
