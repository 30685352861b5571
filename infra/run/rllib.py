"""`dreamgym rllib`: an RLlib algorithm (PPO) trains in a DreamGym environment, the learned simulator included.

For classical RL users who want a learned simulator: DreamGym's synthetic environment (Mexp
stepping abstract text states, grounded in the replay buffer) and every real family
(`actors.env_family`, your own included) are gymnasium environments here, and RLlib's PPO
trains on them as on any other. The policy is not an LLM: an RLlib RLModule (RLlib's own
action-masking PPO module) over a fixed-size embedding of the state and of each candidate
action (actors/envs/gym_wrapper.py `MaskedCandidates`: hashed bag of words), choosing a
candidate slot under the mask of the slots that hold one.

What a run builds: the task splits (and, for `actors.env_kind=synthetic`, the offline data, the
Mexp checkpoint and the seeded replay buffer: the same artifacts as `dreamgym train`,
infra/run/artifacts.py), one embedded Mexp engine served on this process's event loop, then
`--iterations` PPO iterations; each one's episode return goes to `<run_dir>/<name>/rllib.json`.

Where it departs from `dreamgym train`: the env runner lives in this process
(`num_env_runners=0`, PPO stepping in a worker thread while the loop serves Mexp): the synthetic
environment holds an engine client and the replay buffer, which one process opens. A Mexp
reply that cannot be parsed ends the episode (reward 0, `info["sim_error"]`), since gymnasium
tooling expects `step` never to raise; `dreamgym train` instead drops such episodes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any, Callable

from rich.console import Console

from actors.envs.gym_wrapper import DreamGymTextEnv, MaskedCandidates
from actors.envs.registry import load_or_make_splits, make_env
from infra import metrics
from infra.config import Config, add_config_arguments, config_from_args, rl_seed
from infra.engine.client import EngineClient
from infra.engine.models import load_tokenizer
from infra.engine.server import default_weights_roots, start_embedded_engine
from infra.processes import patient_gcs_start
from infra.run.artifacts import embedding_cache, mexp_checkpoint, prepare_data, say
from simulator.embedder import Embedder
from simulator.experience_model import ExperienceModel
from simulator.replay_buffer import make_buffer, seed_buffer
from simulator.reply_memo import ReplyMemo
from simulator.synthetic_env import SyntheticEnv

_ENVS: dict[str, Callable[[], Any]] = {}  # this process's environment factories, by RLlib env name


def _total(counter: Any) -> float:
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


def _mexp_counts() -> dict:
    return {"simulated": _total(metrics.SIMULATOR_STEPS), "replayed": _total(metrics.SIMULATOR_REPLAYED_STEPS)}


def _creator(env_config: Any) -> Any:
    return _ENVS[env_config["factory"]]()


def ppo_config(env_name: str, batch: int, seed: int, lr: float = 3e-4) -> Any:
    """PPO on the new API stack with RLlib's action-masking RLModule, sized for a CPU."""
    from ray.rllib.algorithms.ppo import PPOConfig  # RLlib: seconds to import, only this command uses it
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec  # RLlib, as above
    from ray.rllib.examples.rl_modules.classes.action_masking_rlm import ActionMaskingTorchRLModule  # RLlib's own

    return (PPOConfig()
            .environment(env=env_name, env_config={"factory": env_name})
            .env_runners(num_env_runners=0, rollout_fragment_length="auto")
            .learners(num_learners=0)
            .training(train_batch_size_per_learner=batch, minibatch_size=min(64, batch), num_epochs=4, lr=lr)
            .rl_module(rl_module_spec=RLModuleSpec(module_class=ActionMaskingTorchRLModule,
                                                   model_config={"fcnet_hiddens": [64, 64], "head_fcnet_hiddens": [64]}))
            .debugging(seed=seed))


async def _synthetic_factory(cfg: Config, stack: list, console: Any) -> tuple[Callable[[], Any], list]:
    splits, offline = await asyncio.to_thread(prepare_data, cfg, console)
    model = await asyncio.to_thread(mexp_checkpoint, cfg, offline, console)
    e = cfg.engines
    handle = await start_embedded_engine(model=model, max_batch_size=e.max_batch_size, dtype=e.dtype, device=e.device,
                                         engine_cfg=e, weights_roots=default_weights_roots(model, cfg.infra.run_dir))
    stack.append(handle.stop)
    buffer = make_buffer(cfg.simulator, Path(cfg.infra.run_dir) / "rllib-buffer" / str(time.time_ns()),
                         Embedder(cache_path=embedding_cache(cfg)))
    stack.append(buffer.close)
    say(console, f"Mexp {model} at {handle.url}; replay buffer seeded with {seed_buffer(buffer, offline)} real transitions")
    tok, memo = load_tokenizer(e.model), ReplyMemo(cfg.simulator.reply_memo)

    def make() -> Any:  # the client is made on the env's own loop, where its connections live
        client = EngineClient.from_config(e, [handle.url], role="mexp")
        sim = SyntheticEnv(ExperienceModel(client, buffer, cfg.simulator, tok, memo), cfg.simulator.max_steps,
                           on_reject="end")
        return sim
    return make, splits.train


async def train_rllib(cfg: Config, name: str, iterations: int, batch: int, max_actions: int,
                      console: Any = None) -> dict:
    """PPO for `iterations` iterations in `actors.env_kind` environments of `actors.env_family`; the summary."""
    import ray  # Ray and RLlib's registry: only when a run starts (the command's --help stays fast)
    from ray.tune.registry import register_env  # as above

    run_dir = Path(cfg.infra.run_dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    stack: list = []
    try:
        if cfg.actors.env_kind == "synthetic":
            make_core, tasks = await _synthetic_factory(cfg, stack, console)
        else:
            splits = await asyncio.to_thread(load_or_make_splits, cfg.actors.env_family, cfg.data, cfg.infra.data_dir,
                                             cfg.infra.seed)
            tasks = splits.train
            make_core = lambda: make_env(cfg.actors.env_family, max_steps=cfg.actors.max_steps)  # noqa: E731
        env_name = f"dreamgym-{cfg.actors.env_kind}-{name}"
        _ENVS[env_name] = lambda: MaskedCandidates(DreamGymTextEnv(make_core(), tasks, max_actions=max_actions))
        register_env(env_name, _creator)
        started = not ray.is_initialized()
        if started:
            # "local": a fresh runtime even where a cluster of another test or command is running,
            # which ray.init() would otherwise join (and refuse num_cpus for)
            patient_gcs_start()
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
            stack.append(ray.shutdown)
        algo = ppo_config(env_name, batch, rl_seed(cfg.infra)).build_algo()
        stack.append(lambda: asyncio.to_thread(algo.stop))  # its envs close on their own loops, off this one
        history, before = [], _mexp_counts()
        for i in range(iterations):
            t0 = time.perf_counter()
            r = await asyncio.to_thread(algo.train)  # the loop stays free to serve Mexp
            runners = r.get("env_runners", {})
            row = {"iteration": i + 1, "episode_return_mean": runners.get("episode_return_mean"),
                   "episodes": runners.get("num_episodes", 0), "steps": runners.get("num_env_steps_sampled", 0),
                   "seconds": round(time.perf_counter() - t0, 1)}
            history.append(row)
            say(console, f"rllib PPO iteration {row['iteration']}: episode return {row['episode_return_mean']} "
                         f"over {row['episodes']} episodes, {row['steps']} steps ({row['seconds']} s)")
        summary = {"run": name, "algo": "PPO (RLlib)", "env_kind": cfg.actors.env_kind, "family": cfg.actors.env_family,
                   "tasks": len(tasks), "max_actions": max_actions, "iterations": history}
        if cfg.actors.env_kind == "synthetic":  # how Mexp answered the steps: generated, or a real transition replayed
            summary["mexp_steps"] = {k: int(v - before[k]) for k, v in _mexp_counts().items()}
        (run_dir / "rllib.json").write_text(json.dumps(summary, indent=1))
        return summary
    finally:
        for close in reversed(stack):
            out = close()
            if asyncio.iscoroutine(out):
                await out
        _ENVS.clear()


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--name", default="rllib", help="run name: the summary goes to <run_dir>/<name>/rllib.json")
    p.add_argument("--iterations", type=int, default=5, help="PPO training iterations")
    p.add_argument("--batch", type=int, default=256, help="environment steps per PPO iteration")
    p.add_argument("--max-actions", type=int, default=32, help="candidate slots of the action (more are not offered)")


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    summary = asyncio.run(train_rllib(cfg, args.name, args.iterations, args.batch, args.max_actions, Console()))
    print(f"rllib summary: {Path(cfg.infra.run_dir) / args.name / 'rllib.json'} "
          f"({len(summary['iterations'])} iterations)")
    return 0
