"""Which environment and which task set a family name means.

Owns the mapping from a family name to an Environment (`make_env`), to its task splits
(`load_or_make_splits`) and to the checks of its states' action lists (`action_grammar`) and
of a free-text command (`command_refusal`).
Family names: "textworld" (or any tw-make family such as "tw-cooking-2", "custom"),
"miniwob" (or "miniwob/<task>"), "alfworld" (or "alfworld/<task type>") and "browsergym"
(or "browsergym/<env id>": MiniWoB++, or WebArena with the user's servers, through
BrowserGym). Splits live at `<data_dir>/<family>/splits.json` and are made once (games
generated, pages visited) from the `data` config section, then read back.

Bring your own environment: any other family name is a plug-in, resolved by `plugin_class`:
- `package.module:Class` (an import path; the current directory is searched too, so a
  checkout's `examples.keydoor:KeyDoorEnv` works),
- a name registered in the `dreamgym.envs` entry-point group of an installed package
  (`[project.entry-points."dreamgym.envs"] keydoor = "mypkg.envs:KeyDoorEnv"`),
- `gym:<gymnasium id>`, any gymnasium environment with text observations, through the one
  adapter in actors/envs/gym_adapter.py.
The class implements the `Environment` protocol (actors/envs/base.py: async `reset(task)`,
`step(action)`, `close()`, `info["candidates"]` on every state; `info["expert_action"]` lets
`dreamgym collect` record expert trajectories) and provides its tasks with one more method,

    @classmethod
    def tasks(cls, split: str, n: int, seed: int) -> list[Task]: ...

(`split` is "train" or "heldout", `n` is `data.env_tasks` or `data.env_heldout`; the two
splits must not share tasks). Its constructor may take `max_steps`. The family name itself
keys its files (`<data_dir>/<family>/splits.json`, `<data_dir>/offline/<family>/...`), so
`collect`, `eval`, `train`, `fidelity` and `experiment` all take it unchanged. An optional
classmethod `tasks_from_spec(spec) -> list[Task]` serves `dreamgym eval --tasks`.
"""

from __future__ import annotations

import glob
import importlib
import inspect
import logging
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable

from actors.dataset import TaskSplits, splits_path, splits_settings, stamp_matches, write_stamp
from actors.envs.alfworld_env import AlfWorldEnv
from actors.envs.alfworld_problems import GAME_SUFFIX as ALFWORLD_SUFFIX
from actors.envs.alfworld_problems import make_alfworld_tasks
from actors.envs.alfworld_problems import tasks_from_games as alfworld_tasks
from actors.envs.base import Environment
from actors.envs.gym_adapter import gym_family
from actors.envs.browsergym_env import BrowserGymEnv, make_browsergym_tasks
from actors.envs.env_process import EnvProcess
from actors.envs.miniwob_env import MiniWoBEnv, make_miniwob_tasks
from actors.envs.textworld_env import TextWorldEnv, game_file_problem, make_textworld_tasks
from actors.envs.textworld_grammar import consistent_actions as textworld_actions
from actors.envs.textworld_grammar import refusal as textworld_refusal
from actors.envs.textworld_env import tasks_from_games as textworld_tasks
from infra.config import BUILTIN_FAMILIES, ENV_ENTRY_POINTS, ConfigError

log = logging.getLogger(__name__)

PLUGIN_METHODS = ("reset", "step", "close", "tasks")


def add_family_argument(p: Any) -> None:
    """`--family` of the commands that read or play a family (collect, eval, train-mexp, fidelity);
    `family_of` resolves it."""
    p.add_argument("--family", default="", help="real environment family (default: the config's actors.env_family): "
                   "textworld, miniwob, alfworld, browsergym, or your own (package.module:Class, gym:<gymnasium id>, "
                   "a dreamgym.envs entry point; actors/envs/registry.py)")


def family_of(args: Any, cfg: Any) -> str:
    """The family a command plays: `--family`, else the config's (an ALFWorld preset plays ALFWorld)."""
    return args.family or cfg.actors.env_family


def _import_path(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module.split(".")[0] or os.getcwd() in sys.path:
            raise ConfigError(f"actors.env_family {spec!r}: cannot import {module!r} ({exc})") from exc
        sys.path.insert(0, os.getcwd())  # a checkout's own package, as `python -m` would find it
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc2:
            raise ConfigError(f"actors.env_family {spec!r}: cannot import {module!r} ({exc2})") from exc2
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"actors.env_family {spec!r}: module {module!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def plugin_class(family: str) -> type:
    """The Environment class a plug-in family names (see the module docstring); ConfigError, naming it,
    when it cannot be imported or lacks the protocol's methods."""
    spec = family.strip()
    if spec.startswith("gym:"):
        return gym_family(spec[4:])
    if ":" in spec:
        cls = _import_path(spec)
    else:
        eps = [ep for ep in entry_points(group=ENV_ENTRY_POINTS) if ep.name == spec]
        if not eps:
            raise ConfigError(f"unknown environment family {family!r}; expected {', '.join(BUILTIN_FAMILIES)}, "
                              f"an import path 'package.module:Class', 'gym:<gymnasium id>' or a "
                              f"{ENV_ENTRY_POINTS!r} entry point")
        try:
            cls = eps[0].load()
        except Exception as exc:
            raise ConfigError(f"actors.env_family {spec!r}: entry point {eps[0].value!r} failed to load "
                              f"({type(exc).__name__}: {exc})") from exc
    missing = [m for m in PLUGIN_METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(f"actors.env_family {spec!r}: {getattr(cls, '__name__', cls)!r} is not an Environment "
                          f"with tasks (missing {', '.join(missing)}; see actors/envs/registry.py)")
    return cls


def is_plugin(family: str) -> bool:
    try:
        _builtin_kind(family)
        return False
    except ValueError:
        return True


def _builtin_kind(family: str) -> str:
    f = family.strip().lower()
    if f == "browsergym" or f.startswith("browsergym/"):
        return "browsergym"
    if f == "miniwob" or f.startswith("miniwob/"):
        return "miniwob"
    if f == "alfworld" or f.startswith("alfworld/"):
        return "alfworld"
    if f == "textworld" or f.startswith("tw-") or f.startswith("custom"):
        return "textworld"
    raise ValueError(family)


def _construct(cls: type, **kw: Any) -> Environment:
    """`cls(**kw)` with only the keyword arguments its constructor takes (a plug-in may take no max_steps)."""
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return cls(**kw)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return cls(**kw)
    return cls(**{k: v for k, v in kw.items() if k in params})


def plugin_tasks(family: str, split: str, n: int, seed: int) -> list:
    """`n` tasks of a plug-in family's `split`, each marked with the family name."""
    tasks = list(plugin_class(family).tasks(split, n, seed))
    for t in tasks:
        t.family = t.family or family.strip()
    return tasks


def canonical_family(family: str) -> str:
    """'textworld', 'miniwob', 'alfworld' or 'browsergym' for any built-in family or task-family name;
    a plug-in family's own name (stripped) once its class resolves (ConfigError naming it if not)."""
    try:
        return _builtin_kind(family)
    except ValueError:
        plugin_class(family)
        return family.strip()


def make_env(family: str, isolation: Any = None, **kw: Any) -> Environment:
    """A fresh real environment of `family` (keyword arguments go to its constructor, e.g. max_steps).

    `isolation` (actors/envs/env_process.Isolation, from `actors.env_isolation`): the environment runs in
    a supervised child process, so its crash or hang costs one episode; None = in this process."""
    kind = canonical_family(family)
    if isolation is not None:
        return EnvProcess(family, isolation, **kw)
    if kind == "textworld":
        return TextWorldEnv(**kw)
    if kind == "alfworld":
        return AlfWorldEnv(**kw)
    if kind == "browsergym":
        return BrowserGymEnv(**kw)
    if kind == "miniwob":
        return MiniWoBEnv(**kw)
    return _construct(plugin_class(kind), **kw)


def action_grammar(family: str) -> Callable[[str, list[str]], list[str]] | None:
    """The check `(state, listed actions) -> the actions the state's own description allows` of a
    family whose states spell out the world (TextWorld: actors/envs/textworld_grammar.py, which drops
    what the description rules out and adds what it implies); None for the others (web pages list
    what is on them) and for a family name it does not know."""
    try:
        kind = _builtin_kind(family)
    except ValueError:
        return None
    return textworld_actions if kind == "textworld" else None


def command_refusal(family: str) -> Callable[[str, str], str] | None:
    """The check `(state, a free-text action) -> why the family's grammar refuses it there ("" = it does
    not)` of a family with a command grammar (TextWorld: actors/envs/textworld_grammar.py `refusal`);
    None for the others, whose free text only the environment (or Mexp) can judge."""
    try:
        kind = _builtin_kind(family)
    except ValueError:
        return None
    return textworld_refusal if kind == "textworld" else None


def load_or_make_splits(family: str, data_cfg: Any, data_dir: str | Path, seed: int = 0, rebuild: bool = False,
                        need: tuple[str, int] | None = None) -> TaskSplits:
    """Read `<data_dir>/<family>/splits.json`, or make and save it from the data config (also when the
    file was made with other settings: its stamp's key differs).

    `need=(split, n)`: the caller uses only the first n tasks of that split (`dreamgym eval --limit n`).
    Where the splits are not made yet and making them is costly (ALFWorld's planner), only those n are
    made, the same n the whole split starts with, and nothing is saved as the splits file."""
    kind = canonical_family(family)
    path = splits_path(data_dir, kind)
    settings = splits_settings(kind, data_cfg, seed)
    if not rebuild and stamp_matches(path, settings):
        splits = TaskSplits.load(path)
        problem = _game_files_problem(kind, splits)
        if problem is None:
            return splits
        log.warning("%s: %s; making the splits again", path, problem)  # deterministic: the same tasks, files here
    if need is not None and need[1] > 0 and kind == "alfworld":
        return make_alfworld_tasks(data_dir, data_cfg.alfworld_games, data_cfg.alfworld_heldout,
                                   list(data_cfg.alfworld_task_types), seed=seed,
                                   heldout_task_types=list(data_cfg.alfworld_heldout_task_types),
                                   workers=data_cfg.workers, only=need)
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
    elif is_plugin(kind):
        splits = TaskSplits(plugin_tasks(kind, "train", data_cfg.env_tasks, seed),
                            plugin_tasks(kind, "heldout", data_cfg.env_heldout, seed))
        if not splits.train:
            raise ConfigError(f"actors.env_family {kind!r}: its tasks('train', {data_cfg.env_tasks}, {seed}) returned none")
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


def _game_files_problem(kind: str, splits: TaskSplits) -> str | None:
    """Why saved splits cannot be played as they are: a game file they name is gone (the data directory was
    moved: splits hold absolute paths) or damaged (TextWorld's load-time check); None when all are fine."""
    files = sorted({t.game_file for t in [*splits.train, *splits.heldout] if t.game_file})
    gone = [f for f in files if not Path(f).is_file()]
    if gone:
        return f"{len(gone)} of its {len(files)} game files are gone (e.g. {gone[0]})"
    if kind == "textworld":
        return next((p for f in files if (p := game_file_problem(f)) is not None), None)
    return None


def tasks_from_spec(family: str, spec: str, data_cfg: Any = None, seed: int = 0) -> list:
    """Tasks named by the user (`dreamgym eval --tasks SPEC`), any family.

    TextWorld and ALFWorld: game files, given as a directory, a glob or one file
    (TextWorld .z8/.ulx, e.g. made with `tw-make`; ALFWorld .tw-pddl). MiniWoB++ and
    BrowserGym: task names, comma-separated or one per line in a file, each played at
    `data.miniwob_seeds` page seeds.
    """
    kind = canonical_family(family)
    if is_plugin(kind):
        cls = plugin_class(kind)
        if not callable(getattr(cls, "tasks_from_spec", None)):
            raise ValueError(f"--tasks {spec}: family {kind!r} has no tasks_from_spec; its held-out split is evaluated without --tasks")
        return [t for t in cls.tasks_from_spec(spec)]
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
