"""A tiny real `dreamgym train` as a child process, and what the long-running benchmarks read off it.

Shared by benchmarks/soak.py (memory over time) and benchmarks/chaos.py (kills and recovery):
the run's settings (real TextWorld games, the embedded engine serving a tiny random-initialised
Llama that carries SmolLM2's tokenizer, PPO so that every trajectory trains, no evaluation),
starting the job in its own session, the processes it is made of, and the least-squares
slope that both report in MB/min after a warm-up share of the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from infra.engine.models import save_tiny_model  # noqa: E402


def load() -> str:
    return "load %.2f %.2f %.2f" % os.getloadavg()


def tiny_model(work: Path) -> Path:
    """The tiny random Llama under `work` (made once)."""
    model = work / "tiny-llama"
    if not (model / "config.json").exists():
        save_tiny_model(model)
    return model


def tiny_overrides(work: Path, data_dir: str | Path, redis_url: str, budget_s: float, *extra: str) -> list[str]:
    """`dreamgym train` overrides for a small real run on `redis_url` (the benchmark owns the server)."""
    return [f"infra.run_dir={work / 'runs'}", f"infra.data_dir={data_dir}", f"infra.redis_url={redis_url}",
            f"infra.train_budget_s={budget_s}", f"engines.model={tiny_model(work)}", "engines.max_batch_size=8",
            "data.textworld_games=2", "data.textworld_heldout=1", "data.textworld_families=[custom]",
            "data.policies=[expert]", "data.episodes_per_task=1", "data.workers=1", "data.max_steps=4",
            "actors.env_kind=real", "actors.num_workers=2", "actors.group_size=2", "actors.concurrent_episodes=4",
            "actors.max_steps=3", "learner.algo=ppo", "learner.groups_per_update=2", "learner.max_staleness=1000",
            "learner.checkpoint_every=5", "learner.keep_weights=1", "learner.keep_checkpoints=1",
            "learner.total_updates=1000000", "curriculum.variants_per_seed=0", "evaluation.before=false", *extra]


def start_train(name: str, overrides: list[str], log: Path, resume: bool = False) -> subprocess.Popen:
    """`dreamgym train --no-eval` in its own session (so `os.killpg` ends the whole job), logging to `log`."""
    cmd = [sys.executable, "-m", "infra.cli", "train", "--no-eval", "--name", name,
           *(["--resume"] if resume else []), *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def job_processes(root: psutil.Process) -> dict[str, psutil.Process]:
    """The job's processes by label: "driver" and every descendant as "<name>-<pid>"."""
    procs = {"driver": root}
    try:
        for child in root.children(recursive=True):
            procs[f"{child.name()}-{child.pid}"] = child
    except psutil.NoSuchProcess:
        pass
    return procs


def slope_mb_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, bytes) in MB per minute."""
    if len(samples) < 2:
        return float("nan")
    n = len(samples)
    mx = sum(t for t, _ in samples) / n
    my = sum(v for _, v in samples) / n
    var = sum((t - mx) ** 2 for t, _ in samples)
    if var == 0:
        return float("nan")
    cov = sum((t - mx) * (v - my) for t, v in samples)
    return cov / var * 60 / 1e6


def fitted_slope(samples: list[tuple[float, float]], warmup: float) -> float:
    """The slope of `samples` after the first `warmup` share of them (model loading, caches filling up)."""
    cut = max(1, int(len(samples) * warmup))
    return slope_mb_per_min(samples[cut:])
