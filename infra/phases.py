"""The driver's phases around RL: data, replay-buffer seeding, the Mexp checkpoint, engines, evaluation.

Owns "collect or reuse", "train or load", "start embedded or connect", so the driver
reads like the architecture diagram. Each phase is cached on disk where it is
expensive: the task splits and offline trajectories under `<data_dir>`, the Mexp SFT
checkpoint under `<data_dir>/mexp/`, MiniLM embeddings in a sqlite cache. A second
quickstart run therefore skips straight to RL.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.config import Config

log = logging.getLogger(__name__)


@dataclass
class Engines:
    """Clients for the two roles and the embedded servers this process started (stopped at the end)."""

    mexp: Any
    policy: Any
    handles: list = field(default_factory=list)

    async def close(self) -> None:
        for c in (self.mexp, self.policy):
            try:
                await c.close()
            except Exception as exc:  # closing is best effort
                log.debug("engine client close: %s", exc)
        for h in self.handles:
            await h.stop()


def embedding_cache(cfg: Config) -> Path:
    """The MiniLM embedding cache shared with `dreamgym train-mexp` (same texts, embedded once)."""
    return Path(cfg.infra.data_dir) / ".cache" / "embeddings.sqlite"


def prepare_data(cfg: Config, console: Any = None) -> tuple[Any, list]:
    """(task splits, offline trajectories): read from `<data_dir>`, or generate/collect them once."""
    from actors.dataset import read_trajectories, trajectories_path, write_trajectories
    from actors.envs.registry import load_or_make_splits

    family = cfg.actors.env_family
    t0 = time.perf_counter()
    splits = load_or_make_splits(family, cfg.data, cfg.infra.data_dir, seed=cfg.infra.seed)
    path = trajectories_path(cfg.infra.data_dir, family)
    if path.exists():
        offline = list(read_trajectories(path))
        _say(console, f"reusing {len(offline)} offline trajectories from {path}")
    else:
        from actors.collect import collect

        _say(console, f"collecting offline {family} trajectories on {len(splits.train)} train tasks ...")
        offline = collect(family, splits.train, list(cfg.data.policies), cfg.data.episodes_per_task,
                          cfg.data.noise_eps, cfg.data.max_steps, cfg.data.workers, seed=cfg.infra.seed)
        write_trajectories(path, offline)
    _say(console, f"data: {len(splits.train)} train / {len(splits.heldout)} held-out tasks, "
                  f"{len(offline)} offline trajectories ({time.perf_counter() - t0:.1f} s)")
    return splits, offline


def seed_buffer(cfg: Config, offline: list, run_dir: Path, console: Any = None) -> Any:
    """The run's replay buffer: created and seeded with every real offline transition, or
    reopened as it was (a resumed run keeps what it wrote back and is not seeded twice)."""
    from simulator.embedder import Embedder
    from simulator.replay_buffer import make_buffer, seed_buffer as seed

    t0 = time.perf_counter()
    embedder = Embedder(cache_path=embedding_cache(cfg))
    buffer = make_buffer(cfg.simulator, run_dir / "buffer", embedder)
    if len(buffer):
        _say(console, f"replay buffer reopened with {len(buffer)} transitions ({time.perf_counter() - t0:.1f} s)")
        return buffer
    n = seed(buffer, offline)
    _say(console, f"replay buffer seeded with {n} real transitions ({time.perf_counter() - t0:.1f} s)")
    return buffer


def mexp_checkpoint(cfg: Config, offline: list, console: Any = None) -> str:
    """The Mexp weights: `simulator.checkpoint`, else the cached SFT checkpoint, else a short SFT now."""
    if cfg.simulator.checkpoint:
        return cfg.simulator.checkpoint
    from learner import mexp_sft

    cache = Path(cfg.infra.data_dir) / "mexp" / cfg.actors.env_family
    if (cache / "config.json").exists():
        _say(console, f"reusing the Mexp checkpoint {cache}")
        return str(cache)
    t0 = time.perf_counter()
    _say(console, f"fine-tuning Mexp on {len(offline)} offline trajectories ...")
    report = mexp_sft.run_sft(cfg.simulator, cfg.infra.data_dir, cache, cfg.actors.env_family, cfg.infra.seed)
    after = report.get("after", {}).get("loss_all")
    _say(console, f"Mexp SFT done ({time.perf_counter() - t0:.0f} s, {report['train_examples']} examples, "
                  f"held-out loss {report.get('before', {}).get('loss_all', float('nan')):.3f} -> "
                  f"{after if after is not None else float('nan'):.3f}): {cache}")
    return str(cache)


async def start_engines(cfg: Config, mexp_model: str, policy_model: str) -> Engines:
    """Connect to configured endpoints or start embedded engines on this event loop."""
    from infra.engine_client import EngineClient
    from infra.engine_server import start_embedded_engine

    e = cfg.engines
    handles = []

    async def endpoints(configured: list, model: str) -> list[str]:
        if configured:
            return list(configured)
        h = await start_embedded_engine(model=model, max_batch_size=e.max_batch_size, dtype=e.dtype,
                                        device=e.device)
        handles.append(h)
        return [h.url]

    kw = dict(timeout_s=e.request_timeout_s, max_retries=e.max_retries, health_interval_s=e.health_interval_s)
    mexp = EngineClient(await endpoints(e.mexp_endpoints, mexp_model), role="mexp", **kw)
    policy = EngineClient(await endpoints(e.policy_endpoints, policy_model), role="policy", **kw)
    return Engines(mexp, policy, handles)


async def evaluate_policy(cfg: Config, policy_client: Any, tokenizer: Any, tasks: list, label: str,
                          console: Any = None) -> dict:
    """Greedy ChoicePolicy on held-out REAL tasks; the EvalReport as a dict."""
    from actors.evaluate import choice_policy_chooser, evaluate
    from actors.policy import ChoicePolicy

    chooser = choice_policy_chooser(ChoicePolicy(policy_client, tokenizer, temperature=0.0, seed=cfg.infra.seed))
    t0 = time.perf_counter()
    report = await evaluate(chooser, tasks, cfg.actors.env_family, max_steps=cfg.data.max_steps,
                            concurrency=min(4, max(1, len(tasks))), policy_name=label)
    d = report.to_dict()
    _say(console, f"held-out real {cfg.actors.env_family} ({label}): success {d['success_rate']:.3f} "
                  f"on {d['episodes']} episodes ({time.perf_counter() - t0:.0f} s)")
    return d


def _say(console: Any, text: str) -> None:
    if console is not None:
        console.print(text)
    else:
        log.info(text)


def policy_start(cfg: Config, offline: list, run_dir: Path, console: Any = None) -> str:
    """The weights RL starts from: the base model, or a supervised warm start on expert steps when configured."""
    if cfg.learner.warm_start_steps <= 0:
        return cfg.engines.model
    from learner import policy_sft

    cache = Path(cfg.infra.data_dir) / "policy-warm" / cfg.actors.env_family
    if (cache / "config.json").exists():
        _say(console, f"reusing the warm-started policy {cache}")
        return str(cache)
    t0 = time.perf_counter()
    path = policy_sft.warm_start(cfg, offline, cache)
    _say(console, f"policy warm start: {cfg.learner.warm_start_steps} steps ({time.perf_counter() - t0:.0f} s)")
    return str(path)


def env_factory(cfg: Config, mexp_client: Any, buffer: Any, tokenizer: Any):
    """Fresh environments for the rollout workers: synthetic (Mexp + buffer) or real."""
    if cfg.actors.env_kind == "synthetic":
        from simulator.experience_model import ExperienceModel
        from simulator.synthetic_env import SyntheticEnv

        mexp = ExperienceModel(mexp_client, buffer, cfg.simulator, tokenizer)
        return lambda: SyntheticEnv(mexp, cfg.simulator.max_steps)
    from actors.envs.registry import make_env

    return lambda: make_env(cfg.actors.env_family, max_steps=cfg.actors.max_steps)


def task_source(cfg: Config, client: Any, prefix: str, seeds: list, mtask_client: Any, tokenizer: Any,
                embedder: Any = None) -> Any:
    """The curriculum scheduler: variants from Mtask when enabled, uniform sampling when `curriculum.enabled` is off."""
    from simulator.curriculum import CurriculumScheduler

    variants = None
    if cfg.curriculum.enabled and cfg.curriculum.variants_per_seed > 0:
        from simulator.embedder import Embedder
        from simulator.task_variants import TaskVariantGenerator

        embedder = embedder or Embedder(cache_path=embedding_cache(cfg))
        variants = TaskVariantGenerator(mtask_client, tokenizer, cfg.curriculum, embedder)
    return CurriculumScheduler(client, cfg.curriculum, prefix, seeds, variants=variants, seed=cfg.infra.seed,
                               stream_maxlen=cfg.infra.stream_maxlen)


async def set_worker_target(client: Any, prefix: str, n: int) -> None:
    from infra.scale import desired_key

    await client.set(desired_key(prefix), n)


async def train_sync(learner: Any, source: Any, pool: Any, client: Any, prefix: str, on_update: Any,
                     stop: Any = None) -> None:
    """Synchronous mode: push one update's worth of tasks, let the workers play them, train; repeat."""
    from infra.schema import encode
    from infra.streams import StreamProducer, tasks_stream, trajectories_stream
    from infra.task_sampler import stream_backlog

    producer = StreamProducer(client, tasks_stream(prefix))
    n = learner.cfg.groups_per_update
    await learner.consumer.ensure_group()
    while learner.updates < learner.cfg.total_updates and not (stop is not None and stop.is_set()):
        idle = all(not s.get("inflight") for s in await pool.statuses())
        missing = n - len(learner._ready)  # groups the learner still needs (zero-variance ones were dropped)
        if (idle and missing > 0 and await stream_backlog(client, tasks_stream(prefix)) == 0
                and await stream_backlog(client, trajectories_stream(prefix), "learner") == 0):
            tasks: list = []
            while len(tasks) < missing:
                tasks += await source.next_batch()
            await producer.add(encode(t) for t in tasks[:missing])
        stats = await learner.step()
        if stats is not None:
            on_update(stats)


class progress:
    """A rich progress bar over learner updates; `advance(stats)` moves it and shows the last numbers."""

    def __init__(self, console: Any, label: str, total: int, done: int = 0):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TextColumn("{task.fields[info]}"), console=console)
        self.task = self.bar.add_task(label, total=total, completed=done, info="waiting for the first groups")

    def __enter__(self):
        self.bar.start()
        return self.advance

    def advance(self, s: Any) -> None:
        self.bar.update(self.task, completed=s.version, info=f"loss {s.loss:.3f} reward {s.mean_reward:.2f} "
                                                           f"success {s.success_rate:.2f} stale {s.mean_staleness:.1f}")

    def __exit__(self, *exc: Any) -> None:
        self.bar.stop()


def summary(cfg: Config, name: str, before: dict | None, after: dict | None, history: Any, learner: Any,
            pool: Any, buffer_size: int, t_start: float, train_s: float) -> dict:
    def brief(r: dict | None) -> dict | None:
        return None if r is None else {k: r[k] for k in ("success_rate", "ci_low", "ci_high", "episodes",
                                                         "mean_steps", "invalid_rate", "seconds")}
    return {
        "run": name, "algo": cfg.learner.algo, "sync": cfg.learner.sync, "env_kind": cfg.actors.env_kind,
        "heldout_before": brief(before), "heldout_after": brief(after),
        "improved": (after["success_rate"] > before["success_rate"]) if before and after else None,
        "updates": learner.updates, "weight_version": learner.version,
        "trajectories_trained": len(learner.consumed_ids),
        "trajectories_pushed": sum(s.get("trajectories_pushed", 0) for s in pool.retired),
        "replay_buffer_size": buffer_size,
        "train_seconds": round(train_s, 1), "total_seconds": round(time.time() - t_start, 1),
        "history": history.rows,
    }


def autoscaler(cfg: Config, client: Any, prefix: str):
    """The `actors.autoscale` rule bound to this job: task-stream backlog and the embedded engines' queue depth."""
    import math

    from infra import metrics
    from infra.scale import autoscale_target
    from infra.streams import tasks_stream
    from infra.task_sampler import stream_backlog

    slots = max(1, math.ceil(cfg.actors.concurrent_episodes / cfg.actors.group_size))

    async def rule(current: int) -> int:
        backlog = await stream_backlog(client, tasks_stream(prefix))
        depth = metrics.ENGINE_QUEUE_DEPTH._value.get()  # this process's engines (0 with remote endpoints)
        return autoscale_target(current, backlog, depth, slots, cfg.engines.max_batch_size,
                                lo=1, hi=cfg.actors.autoscale_max_workers)
    return rule
