"""The policy warm start's validation: its split, its measurement, its early-stopping rule, its curve.

Owns what `learner.warm_start=best` (learner/policy_sft.py) decides with:

- `validation_split`: a seeded share of the offline expert trajectories' TRAINING tasks
  (never the held-out ones: the offline data is collected on the train split only) is set
  aside. Its trajectories are never trained on; its tasks are played.
- `play_validation`: greedy episodes on those tasks in the REAL environment, through the very
  path the held-out evaluation takes (`actors.evaluate.evaluate` over `Policy.from_config`,
  whatever `actors.action_mode` says), the policy being trained served in-process by an
  embedded engine over its live weights (a fresh engine per evaluation, so no prefix cache
  outlives the weights it was computed with).
- `best_index` / `should_stop`: pure rules over the curve. The best point has the highest
  validation success; ties go to the lower validation loss, then to fewer steps. Training
  stops once `patience` evaluations in a row have not raised the best validation success: the
  loss picks among tied points but never extends training (when success saturates, a falling
  loss made every evaluation a "new best" and the warm start ran to warm_start_max_steps).
  Until a validation game is won, patience does not run out.
- `write_curve`: the curve as JSON and a PNG (matplotlib, Agg, imported only here).

Not in the paper (its policies start from instruction-tuned 3-8B models, no warm start); this is
the standard early-stopped behaviour cloning an RL result is compared with.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from actors.evaluate import choice_policy_chooser, evaluate
from actors.policy import Policy
from infra.engine.client import EngineClient
from infra.engine.server import start_embedded_engine
from infra.schema import Task, Trajectory

log = logging.getLogger(__name__)

CURVE_FILE = "warm_start_curve.json"
PLOT_FILE = "warm_start_curve.png"


@dataclass
class CurvePoint:
    step: int  # supervised steps taken when measured
    val_success: float  # greedy success on the validation tasks, real environment
    val_loss: float  # mean cross-entropy of the expert's choice (generate: of the reply tokens) on them
    train_loss: float | None  # mean training loss of the steps since the last point (None at step 0)
    val_episodes: int = 0
    seconds: float = 0.0  # wall time of this evaluation


def _key(p: CurvePoint) -> tuple:
    """Larger is better: success, then lower loss, then fewer steps."""
    loss = p.val_loss if p.val_loss == p.val_loss else float("inf")  # NaN ranks last
    return (p.val_success, -loss, -p.step)


def best_index(curve: Sequence[CurvePoint]) -> int:
    """Index of the best point of `curve` (non-empty): highest validation success, ties to the lower
    validation loss, then to fewer steps."""
    if not curve:
        raise ValueError("an empty curve has no best point")
    return max(range(len(curve)), key=lambda i: _key(curve[i]))


def should_stop(curve: Sequence[CurvePoint], patience: int) -> bool:
    """Whether the last `patience` evaluations all came after the first one to reach the curve's highest
    validation success (none of them raised it). Lower losses at the same success do not count. While no
    validation game has been won (the highest success is 0) patience never runs out: there is nothing to
    keep yet, and training goes on to warm_start_max_steps (alfworld_cpu's first curve stopped at step 24,
    0 of 6 won at every point while the loss fell 2.69 -> 1.60)."""
    if not curve:
        return False
    top = max(p.val_success for p in curve)
    if top <= 0:
        return False
    first = next(i for i, p in enumerate(curve) if p.val_success == top)
    return len(curve) - 1 - first >= patience


def validation_split(trajectories: Sequence[Trajectory], fraction: float, min_tasks: int, seed: int,
                     eligible: Any = None) -> tuple[list[Trajectory], list[Trajectory], list[Task]]:
    """(trajectories to train on, trajectories of the validation tasks, the validation tasks).

    The tasks are those of the trajectories `eligible(traj)` accepts (all by default) that record their
    Task; `max(min_tasks, round(fraction * n))` of them (at most n - 1: one is left to train on), drawn
    by `seed` from the sorted task ids, are the validation tasks. Every trajectory of a validation task
    is held out, whoever wrote it."""
    tasks: dict[str, Task] = {}
    for t in trajectories:
        if t.task is not None and (eligible is None or eligible(t)):
            tasks.setdefault(t.task_id, t.task)
    ids = sorted(tasks)
    if len(ids) < 2:
        raise ValueError(f"warm start validation: {len(ids)} task(s) with expert trajectories; the 'best' warm start "
                         "needs at least 2 (one to train on, one to validate on): collect on more train tasks or "
                         "use learner.warm_start=fixed")
    n_val = min(len(ids) - 1, max(min_tasks, round(fraction * len(ids))))
    chosen = set(random.Random(seed).sample(ids, n_val))
    train = [t for t in trajectories if t.task_id not in chosen]
    val = [t for t in trajectories if t.task_id in chosen]
    return train, val, [tasks[i] for i in sorted(chosen)]


def episode_cap(cfg: Any) -> int:
    """A validation episode's step cap: learner.warm_start_val_max_steps, else the held-out evaluation's."""
    return cfg.learner.warm_start_val_max_steps or cfg.evaluation.max_steps or cfg.data.max_steps


def play_validation(model: Any, tokenizer: Any, cfg: Any, tasks: Sequence[Task]) -> dict:
    """Greedy episodes of `model` (the live torch model) on `tasks` in the real `actors.env_family`
    environment, as `dreamgym train`'s held-out evaluation plays them; the EvalReport as a dict.
    Runs its own event loop in a helper thread, so it may be called from inside a running loop
    (the driver calls the warm start synchronously from its own)."""
    async def go() -> dict:
        handle = await start_embedded_engine(model=cfg.engines.model, loaded=(model, tokenizer),
                                             max_batch_size=cfg.engines.max_batch_size,
                                             engine_cfg=replace(cfg.engines, threads=0))  # the process's threads
        client = EngineClient([handle.url], role="policy")
        try:
            policy = Policy.from_config(cfg.actors, client, tokenizer, temperature=0.0, seed=cfg.infra.seed)
            report = await evaluate(choice_policy_chooser(policy), list(tasks), cfg.actors.env_family,
                                    max_steps=episode_cap(cfg),
                                    concurrency=max(1, min(cfg.evaluation.concurrency, len(tasks))),
                                    policy_name="warm-start-validation")
            return report.to_dict()
        finally:
            await client.close()
            await handle.stop()

    was_training = model.training
    model.eval()
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="warm-start-validation") as pool:
            return pool.submit(asyncio.run, go()).result()
    finally:
        model.train(was_training)


def write_curve(out_dir: str | Path, curve: Sequence[CurvePoint], best: int, meta: dict | None = None) -> Path:
    """`<out_dir>/warm_start_curve.json` (the points, the chosen one, `meta`) and its plot beside it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / CURVE_FILE
    path.write_text(json.dumps({"points": [asdict(p) for p in curve], "best": best,
                                "best_step": curve[best].step if curve else None, **(meta or {})}, indent=1))
    try:
        plot_curve(curve, best, out / PLOT_FILE)
    except ImportError:  # matplotlib is an optional nicety here; the JSON holds everything
        log.info("warm start: matplotlib missing, no %s", PLOT_FILE)
    return path


def plot_curve(curve: Sequence[CurvePoint], best: int, path: Path) -> None:
    import matplotlib  # heavy, and only the end of a warm start draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display

    steps = [p.step for p in curve]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [p.val_success for p in curve], "o-", color="tab:blue", label="validation success")
    ax.axvline(curve[best].step, color="tab:blue", ls=":", lw=1, label=f"kept: step {curve[best].step}")
    ax.set_xlabel("supervised steps")
    ax.set_ylabel("success (real env, greedy)")
    ax.set_ylim(-0.02, 1.02)
    loss_ax = ax.twinx()
    loss_ax.plot(steps, [p.val_loss for p in curve], "s--", color="tab:red", label="validation loss")
    trained = [p for p in curve if p.train_loss is not None]
    loss_ax.plot([p.step for p in trained], [p.train_loss for p in trained], "^:", color="tab:gray", label="train loss")
    loss_ax.set_ylabel("cross-entropy")
    lines = ax.get_legend_handles_labels()
    more = loss_ax.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="center right")
    ax.set_title("policy warm start: early stopping on validation tasks", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def read_curve(model_dir: str | Path) -> dict | None:
    """The curve JSON beside a warm-started model, or None."""
    path = Path(model_dir) / CURVE_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
