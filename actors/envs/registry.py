"""Which environment and which task set a family name means.

Owns the mapping from a family name to an Environment (`make_env`) and to its task
splits (`load_or_make_splits`). Family names: "textworld" (or any tw-make family such
as "tw-cooking-2", "custom") and "miniwob" (or "miniwob/<task>"). Splits live at
`<data_dir>/<family>/splits.json` and are made once (games generated, pages
visited) from the `data` config section, then read back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from actors.dataset import TaskSplits, splits_path
from actors.envs.base import Environment


def canonical_family(family: str) -> str:
    """'textworld' or 'miniwob' for any family or task-family name."""
    f = family.strip().lower()
    if f == "miniwob" or f.startswith("miniwob/"):
        return "miniwob"
    if f == "textworld" or f.startswith("tw-") or f.startswith("custom"):
        return "textworld"
    raise ValueError(f"unknown environment family {family!r}; expected textworld or miniwob")


def make_env(family: str, **kw: Any) -> Environment:
    """A fresh real environment of `family` (keyword arguments go to its constructor, e.g. max_steps)."""
    kind = canonical_family(family)
    if kind == "textworld":
        from actors.envs.textworld_env import TextWorldEnv

        return TextWorldEnv(**kw)
    from actors.envs.miniwob_env import MiniWoBEnv

    return MiniWoBEnv(**kw)


def load_or_make_splits(family: str, data_cfg: Any, data_dir: str | Path, seed: int = 0, rebuild: bool = False) -> TaskSplits:
    """Read `<data_dir>/<family>/splits.json`, or make and save it from the data config."""
    kind = canonical_family(family)
    path = splits_path(data_dir, kind)
    if path.exists() and not rebuild:
        return TaskSplits.load(path)
    if kind == "textworld":
        from actors.envs.textworld_env import make_textworld_tasks

        splits = make_textworld_tasks(data_dir, data_cfg.textworld_games, data_cfg.textworld_heldout,
                                      list(data_cfg.textworld_families), seed=seed,
                                      heldout_families=list(data_cfg.textworld_heldout_families),
                                      workers=data_cfg.workers)
    else:
        from actors.envs.miniwob_env import make_miniwob_tasks

        splits = make_miniwob_tasks(list(data_cfg.miniwob_tasks), list(data_cfg.miniwob_heldout),
                                    seeds_per_task=data_cfg.miniwob_seeds, seed=seed)
    splits.save(path)
    return splits
