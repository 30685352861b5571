"""`dreamgym train`: start everything, train the policy in DreamGym, evaluate on real tasks.

Reads like the architecture diagram:

    curriculum ──tasks──▶ rollout workers ──trajectories──▶ learner ──weights──▶ policy engine
                            │      ▲                            (every publish_every updates)
                            ▼      │ replay buffer (top-k grounding, grows with synthetic steps)
                       synthetic env ── Mexp engine

Phases: data (collect or reuse) → seed the replay buffer → Mexp (SFT or cached
checkpoint) → engines (embedded unless endpoints are configured) → held-out REAL
evaluation → GRPO/PPO with N rollout workers (async, or `--sync`: roll out, then train)
→ held-out REAL evaluation → plots, summary.json, table. Redis is embedded unless
`infra.redis_url` is set; `dreamgym scale --workers N` resizes the worker pool live.
Rollout workers run on this process's event loop by default (one machine: the
engines are here too); `actors.runtime=ray` starts them as Ray actors instead
(infra/cluster/rollout_fleet.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from infra.cli import add_config_arguments, config_from_args
from infra.config import Config, dump


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p, default="configs/quickstart.yaml")
    p.add_argument("--name", default="", help="run name: runs/<name>/ (default: quickstart__<algo>__<seed>__<time>)")
    p.add_argument("--resume", action="store_true", help="continue runs/<name> from its latest checkpoint")
    p.add_argument("--sync", action="store_true", help="synchronous mode: roll out, then train (no overlap)")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out real evaluations")


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if args.sync:
        cfg.learner.sync = True
    if args.resume and not args.name:
        raise SystemExit("--resume needs --name of the run to continue")
    name = args.name or f"quickstart__{cfg.learner.algo}__{cfg.infra.seed}__{time.strftime('%Y%m%d-%H%M%S')}"
    asyncio.run(train(cfg, name, resume=args.resume, evaluate=not args.no_eval))
    return 0


async def train(cfg: Config, name: str, resume: bool = False, evaluate: bool = True) -> dict:
    from rich.console import Console

    from actors.policy import ChoicePolicy
    from actors.rollout_worker import RolloutWorker
    from infra import phases
    from infra.model_loading import load_tokenizer
    from infra.redis_server import EmbeddedRedis
    from infra.run_report import RunHistory, results_table, write_plots, write_summary
    from infra.scale import LocalWorkerHandle, WorkerPool
    from infra.schema import Trajectory, decode_as
    from infra.streams import StreamConsumer, connect, trajectories_stream
    from learner.learner import Learner
    from learner.weights import WeightPublisher

    console, t_start = Console(), time.time()
    run_dir = Path(cfg.infra.run_dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump(cfg))
    redis = None if cfg.infra.redis_url else EmbeddedRedis().start()
    url, prefix = cfg.infra.redis_url or redis.url, f"{cfg.infra.stream_prefix}:{name}"
    (Path(cfg.infra.run_dir) / "latest.json").write_text(json.dumps({"redis_url": url if redis else "", "prefix": prefix, "run_dir": str(run_dir)}))
    client = connect(url, cfg.infra.redis_tls_ca)
    engines = fleet = buffer = None
    try:
        splits, offline = phases.prepare_data(cfg, console)
        buffer = phases.seed_buffer(cfg, offline, run_dir, console)
        mexp_model = phases.mexp_checkpoint(cfg, offline, console)
        policy_model = phases.policy_start(cfg, offline, run_dir, console)
        engines = await phases.start_engines(cfg, mexp_model, policy_model)
        tok = load_tokenizer(cfg.engines.model)
        before = await phases.evaluate_policy(cfg, engines.policy, tok, splits.heldout, "before", console) if evaluate else None

        consumer = StreamConsumer(client, trajectories_stream(prefix), "learner", "learner-0",
                                  lambda b: decode_as(b, Trajectory), reclaim_idle_ms=cfg.infra.reclaim_idle_ms)
        learner = Learner(cfg.learner, policy_model, run_dir, consumer, WeightPublisher(run_dir, engines.policy),
                          group_size=cfg.actors.group_size)
        if resume and learner.resume():
            await learner.publish()
        if cfg.actors.runtime == "ray":  # workers as Ray actors; an embedded store moves into one buffer actor
            from infra.cluster.rollout_fleet import RolloutFleet

            fleet = RolloutFleet(cfg, url, prefix, engines.mexp.urls, engines.policy.urls, buffer, run_dir / "buffer",
                                 phases.embedding_cache(cfg))
            spawn = fleet.spawn
        else:  # workers on this event loop, sharing this process's engine clients and buffer
            env_factory = phases.env_factory(cfg, engines.mexp, buffer, tok)

            def spawn(wid: str) -> LocalWorkerHandle:
                policy = ChoicePolicy(engines.policy, tok, cfg.actors.temperature, seed=hash((cfg.infra.seed, wid)))
                return LocalWorkerHandle(RolloutWorker(
                    wid, client, prefix, policy, env_factory, cfg.actors,
                    buffer=buffer if cfg.simulator.write_back else None, reclaim_idle_ms=cfg.infra.reclaim_idle_ms,
                    maxlen=cfg.infra.stream_maxlen))

        pool, stop, history = WorkerPool(spawn), asyncio.Event(), RunHistory()
        source = phases.task_source(cfg, client, prefix, splits.train, engines.mexp, tok, getattr(buffer, "embedder", None))
        # The curriculum's pool, statistics and RNG are saved with every learner checkpoint.
        learner.register_state("curriculum", source.state_dict, lambda _state: None)
        if resume and "curriculum" in learner.extra:
            await source.load_state_dict(learner.extra["curriculum"])
        t_train = time.time()
        with phases.progress(console, "GRPO in DreamGym" if cfg.learner.algo == "grpo" else "PPO in DreamGym",
                             cfg.learner.total_updates, learner.updates) as advance:
            def on_update(s) -> None:
                history.record(version=s.version, loss=s.loss, kl=s.kl, mean_reward=s.mean_reward,
                               success_rate=s.success_rate, staleness=s.mean_staleness,
                               traj_per_s=len(learner.consumed_ids) / max(1e-9, time.time() - t_train),
                               discarded=s.discarded)
                advance(s)

            await pool.scale_to(cfg.actors.num_workers)
            await phases.set_worker_target(client, prefix, cfg.actors.num_workers)
            watcher = asyncio.create_task(pool.watch(client, prefix, stop, autoscale=phases.autoscaler(cfg, client, prefix)
                                                      if cfg.actors.autoscale else None))
            budget = asyncio.get_running_loop().call_later(cfg.infra.train_budget_s, stop.set) \
                if cfg.infra.train_budget_s > 0 else None
            if cfg.learner.sync:
                await phases.train_sync(learner, source, pool, client, prefix, on_update, stop)
            else:
                feeder = asyncio.create_task(source.run(stop))
                await learner.run(cfg.learner.total_updates, on_update=on_update, stop=stop)
            if stop.is_set():
                console.print(f"[yellow]train budget of {cfg.infra.train_budget_s:.0f} s spent after "
                              f"{learner.updates} of {cfg.learner.total_updates} updates[/]")
            if budget is not None:
                budget.cancel()
            stop.set()
            await watcher
            if not cfg.learner.sync:
                await feeder
            await pool.stop_all(drain=False)
        train_s = time.time() - t_train
        if learner.updates % cfg.learner.publish_every:
            await learner.publish()
        learner.save()
        after = await phases.evaluate_policy(cfg, engines.policy, tok, splits.heldout, "after", console) if evaluate else None

        buffer_size = fleet.buffer_size() if fleet is not None else len(buffer)
        summary = phases.summary(cfg, name, before, after, history, learner, pool, buffer_size, t_start, train_s)
        write_summary(run_dir / "summary.json", summary)
        write_plots(history, run_dir / "plots")
        console.print(results_table(before, after, {"updates": learner.updates, "weight version": learner.version,
                                                    "trajectories": len(learner.consumed_ids),
                                                    "train s": f"{train_s:.0f}",
                                                    "total s": f"{time.time() - t_start:.0f}"}))
        console.print(f"run directory: {run_dir}")
        return summary
    finally:
        if fleet is not None:
            fleet.close()
        if buffer is not None:
            buffer.close()  # releases the store's lock: a resumed run in this process reopens it
        if engines is not None:
            await engines.close()
        await client.aclose()
        if redis is not None:
            redis.stop()
