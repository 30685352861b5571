"""What a run builds once and caches on disk: task splits and offline data, the Mexp checkpoint, the warm-started policy.

Owns "collect or reuse" and "train or load", so the driver reads like the
architecture diagram. Each artifact is cached where it is expensive, keyed by the
content of the settings that shape it (so an ablation never reuses an artifact made
with another setting): the task splits and offline trajectories under `<data_dir>`,
stamped with their settings' key (actors/dataset.py) and rebuilt when it differs; the
Mexp SFT checkpoint under `<data_dir>/mexp/<family>-<key>` and the warm-started policy
under `<data_dir>/policy-warm/<family>-<key>` (learner/mexp_sft.py and
learner/policy_sft.py say what each key covers; one cache-or-build rule for both,
`cached_model`); MiniLM embeddings in a sqlite cache (`embedding_cache`). A second
run with the same settings therefore skips straight to RL.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from actors.collect import collect
from actors.dataset import offline_settings, read_trajectories, stamp_matches, trajectories_path, write_stamp, write_trajectories
from actors.envs.env_process import Isolation
from actors.envs.registry import canonical_family, load_or_make_splits
from infra.config import Config
from learner import mexp_sft, policy_sft
from learner.learner import release_freed_memory
from learner.sft_validation import CURVE_FILE, PLOT_FILE, read_curve

log = logging.getLogger(__name__)


def say(console: Any, text: str) -> None:
    """A progress line on the run's console, or in the log when there is none."""
    if console is not None:
        console.print(text)
    else:
        log.info(text)


def embedding_cache(cfg: Config) -> Path:
    """The MiniLM embedding cache shared with `dreamgym train-mexp` (same texts, embedded once)."""
    return Path(cfg.infra.data_dir) / ".cache" / "embeddings.sqlite"


def prepare_data(cfg: Config, console: Any = None) -> tuple[Any, list]:
    """(task splits, offline trajectories): read from `<data_dir>`, or generate/collect them once."""
    family = canonical_family(cfg.actors.env_family)
    t0 = time.perf_counter()
    splits = load_or_make_splits(family, cfg.data, cfg.infra.data_dir, seed=cfg.infra.seed)
    path = trajectories_path(cfg.infra.data_dir, family)
    settings = {**offline_settings(family, cfg.data, cfg.infra.seed), "limit": 0}  # as `dreamgym collect` stamps it
    if stamp_matches(path, settings):
        offline = list(read_trajectories(path))
        say(console, f"reusing {len(offline)} offline trajectories from {path}")
    else:
        say(console, f"collecting offline {family} trajectories on {len(splits.train)} train tasks ...")
        bad: list[dict] = []
        offline = collect(family, splits.train, list(cfg.data.policies), cfg.data.episodes_per_task,
                          cfg.data.noise_eps, cfg.data.max_steps, cfg.data.workers, seed=cfg.infra.seed,
                          isolation=Isolation.from_config(cfg.actors), bad_tasks=bad)
        for b in bad:  # their environment crashed, hung or was refused: the rest were collected
            say(console, f"bad task: {b['task_id']} {b['game_file']} ({b['reason']})")
        if not offline:  # every task failed: stamping an empty file would make each later run reuse it
            raise RuntimeError(f"offline {family} collection on {len(splits.train)} train tasks produced no "
                               "trajectories (each task's error is logged above); nothing was cached")
        write_trajectories(path, offline)
        write_stamp(path, settings)
    say(console, f"data: {len(splits.train)} train / {len(splits.heldout)} held-out tasks, "
                 f"{len(offline)} offline trajectories ({time.perf_counter() - t0:.1f} s)")
    return splits, offline


def cached_model(cache: Path, what: str, build: Callable[[Path], str], console: Any = None) -> str:
    """The model directory `cache`: reused when it holds a model, else written there by `build(cache)`
    (which returns a few words on how it went)."""
    if (cache / "config.json").exists():
        say(console, f"reusing the {what} {cache}")
        return str(cache)
    t0 = time.perf_counter()
    say(console, f"building the {what} ...")
    note = build(cache)
    resident = release_freed_memory()  # the build's model, optimizer and activations: GBs the run no longer needs
    say(console, f"{what} done ({time.perf_counter() - t0:.0f} s{', ' + note if note else ''}; "
                 f"{resident / 1024:.1f} GB resident after it): {cache}")
    return str(cache)


def mexp_checkpoint(cfg: Config, offline: list, console: Any = None) -> str:
    """The Mexp weights: `simulator.checkpoint`, else the cached SFT checkpoint, else a short SFT now."""
    if cfg.simulator.checkpoint:
        return cfg.simulator.checkpoint

    def sft(cache: Path) -> str:
        report = mexp_sft.run_sft(cfg.simulator, cfg.infra.data_dir, cache, cfg.actors.env_family, cfg.infra.seed,
                                  base_model=mexp_sft.base_model(cfg))
        before = report.get("before", {}).get("loss_all", float("nan"))
        after = report.get("after", {}).get("loss_all")
        return (f"{report['train_examples']} examples, held-out loss {before:.3f} -> "
                f"{after if after is not None else float('nan'):.3f}")

    return cached_model(mexp_sft.cache_dir(cfg),
                        f"Mexp SFT checkpoint ({len(offline)} offline trajectories)", sft, console)


def policy_start(cfg: Config, offline: list, console: Any = None, run_dir: Path | None = None) -> str:
    """The weights RL starts from: the base model, or a supervised warm start on expert steps when configured
    (`learner.warm_start`: fixed steps, or the best checkpoint on a validation split, whose curve is copied
    into `run_dir` too)."""
    if cfg.learner.warm_start_steps <= 0:
        return cfg.engines.model

    best = cfg.learner.warm_start == "best"
    steps, t0 = (cfg.learner.warm_start_max_steps if best else cfg.learner.warm_start_steps), time.perf_counter()
    every = max(1, steps // 8)

    def report(i: int, loss: float) -> None:  # a line per eighth: a CPU warm start takes minutes
        if not best and ((i + 1) % every == 0 or i + 1 == steps):
            say(console, f"  warm start step {i + 1}/{steps}: loss {loss:.3f} ({time.perf_counter() - t0:.0f} s)")

    def validated(p: Any) -> None:  # best mode: a line per validation
        train = f", train loss {p.train_loss:.3f}" if p.train_loss is not None else ""
        say(console, f"  warm start step {p.step}/{steps} at most: validation success {p.val_success:.3f} on "
                     f"{p.val_episodes} episodes, loss {p.val_loss:.3f}{train} ({time.perf_counter() - t0:.0f} s)")

    def warm_start(cache: Path) -> str:
        policy_sft.warm_start(cfg, offline, cache, on_step=report, on_eval=validated)
        return policy_sft.describe(json.loads((cache / "warm_start.json").read_text()))

    cache = policy_sft.cache_dir(cfg)
    if best and stopped_before_a_win(cache, cfg.learner.warm_start_max_steps):
        aside = cache.with_name(f"{cache.name}.stopped-before-a-win-{int(time.time())}")
        say(console, f"the cached warm start {cache} stopped before winning a validation game, which no longer "
                     f"ends a 'best' warm start; training it again (the old one moved to {aside.name})")
        cache.rename(aside)
    model = cached_model(cache, "warm-started policy", warm_start, console)
    if run_dir is not None:
        for name in (CURVE_FILE, PLOT_FILE):
            if (Path(model) / name).exists():
                Path(run_dir).mkdir(parents=True, exist_ok=True)
                shutil.copyfile(Path(model) / name, Path(run_dir) / name)
    return model


def stopped_before_a_win(cache: Path, max_steps: int) -> bool:
    """Whether a cached 'best' warm start's curve ended before `max_steps` with no validation game ever won:
    written before patience stopped running out at zero success (learner/sft_validation.should_stop), so its
    cache key matches a warm start that would now train on."""
    curve = read_curve(cache)
    points = (curve or {}).get("points") or []
    return bool(points) and max(p["val_success"] for p in points) <= 0 and points[-1]["step"] < max_steps


def warm_start_record(cfg: Config, policy_model: str) -> dict | None:
    """summary.json's account of the warm start the run started from (None without one): its mode, the
    steps it kept, and in 'best' mode the validation success and loss it was chosen by."""
    if cfg.learner.warm_start_steps <= 0:
        return None
    try:
        info = json.loads((Path(policy_model) / "warm_start.json").read_text())
    except (OSError, ValueError):
        return {"mode": cfg.learner.warm_start, "model": policy_model}
    keep = ("mode", "action_mode", "steps", "trained_steps", "val_success", "val_loss", "val_episodes", "examples")
    return {"model": policy_model, "mode": "fixed", **{k: info[k] for k in keep if k in info},
            **({"val_tasks": len(info["val_tasks"])} if "val_tasks" in info else {})}
