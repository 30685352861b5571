"""`dreamgym train`: start everything, train the policy in DreamGym, evaluate on real tasks.

`train()` reads like the architecture diagram:

    curriculum ──tasks──▶ rollout workers ──trajectories──▶ learner ──weights──▶ policy engine
                            │      ▲                            (every publish_every updates)
                            ▼      │ replay buffer (top-k grounding, grows with synthetic steps)
                       synthetic env ── Mexp engine

the devices of the learner and Mexp SFT (checked first: `check_devices`) → data
(collect or reuse, infra/run/artifacts.py) → the replay buffer (seeded, or
reopened on --resume) → Mexp (SFT or cached checkpoint) → engines (embedded unless
endpoints are configured) → Mexp's fidelity on held-out real steps → held-out REAL
evaluation → the RL phases (`rl_plan`), in each of which GRPO/PPO updates while N
rollout workers play the curriculum's tasks (async, or `--sync`: roll out, then
train), with a held-out REAL evaluation between phases → held-out REAL evaluation →
plots, summary.json, table (infra/run/report.py).

The phases: DreamGym (synthetic environments); the real-environment baseline
(`actors.env_kind=real`, within an exact budget of real transitions,
`actors.real_transitions`); sim-to-real (DreamGym, then the same learner in the real
environment for `learner.s2r_real_transitions`, on the tasks where the policy still splits,
`learner.s2r_selection`; summary.json's `s2r_trained_share` is the share of those real
transitions that reached an update). `learner.total_updates=0` runs no
phase and only evaluates the starting policy (the base and SFT regimes of
`dreamgym experiment`); runs without a synthetic phase start neither the replay
buffer nor Mexp, unless `simulator.fidelity_every` asks for the live fidelity probe
(simulator/fidelity.FidelityProbe: every N updates, held-out real steps replayed
through Mexp, exported as gauges). With `infra.metrics_port` set every process
serves /metrics and the run lists them for Prometheus (infra/run/monitoring.py). Redis,
the engines, the buffer and the workers are owned by one context manager
(infra/run/services.py). Redis is embedded unless `infra.redis_url` is set;
`dreamgym scale --workers N` resizes the worker pool live; rollout workers run on
this process's event loop, or as Ray actors with `actors.runtime=ray`, which also makes
the learner, the embedded engines, the curriculum scheduler and the buffer Ray actors
placed by role; summary.json then says where each ran (`placement`). Each phase's
`worker_pool` in summary.json keeps every resize of its pool (start, `dreamgym scale`,
`actors.autoscale`, end) with the time, the sizes, the reason, and how stopped workers ended.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

from rich.console import Console

from actors.envs.env_process import Isolation
from actors.evaluate import choice_policy_chooser, evaluate
from actors.policy import Policy
from infra import metrics
from infra.budget import StepBudget, run_counts
from infra.config import Config, config_from_args, rl_seed, settings_key
from infra.run import artifacts, report
from infra.run.cluster.learner_actor import LearnerHandle
from infra.run.monitoring import record_success_gap
from infra.run.services import Services
from infra.run.train_args import add_arguments, check  # noqa: F401 (add_arguments: the command's)
from infra.run.workers import WorkerPool
from infra.schema import encode
from infra.stream_backlog import stream_backlog
from infra.streams import LEARNER_GROUP, StreamProducer, tasks_stream, trajectories_stream
from learner.fsdp import check_ranks
from learner.learner import Learner
from learner.precision import Precision
from learner.weights import record_start
from simulator.curriculum import CurriculumScheduler
from simulator.embedder import Embedder
from simulator.fidelity import FidelityProbe, export_fidelity, replay_heldout
from simulator.mexp_data import split_trajectories
from simulator.task_variants import TaskVariantGenerator


def run(args: argparse.Namespace) -> int:
    """`dreamgym train`; its arguments are infra/run/train_args.py's (add_arguments, check)."""
    check(args)
    cfg = config_from_args(args)
    if args.sync:
        cfg.learner.sync = True
    name = args.name or f"quickstart__{cfg.learner.algo}__{cfg.infra.seed}__{time.strftime('%Y%m%d-%H%M%S')}"
    asyncio.run(train(cfg, name, resume=args.resume, evaluate=not args.no_eval))
    return 0


async def train(cfg: Config, name: str, resume: bool = False, evaluate: bool = True) -> dict:
    """The whole run; returns its summary (also written to runs/<name>/summary.json)."""
    check_devices(cfg)
    console, t_start = Console(), time.time()
    plan = rl_plan(cfg)
    dreamgym = any(c.actors.env_kind == "synthetic" for c, _, _ in plan)
    live_fidelity = bool(plan) and cfg.simulator.fidelity_every > 0
    async with Services(cfg, name, console, resume=resume) as svc:
        if cfg.actors.runtime == "ray":  # joined now: a labelled cluster lacking a role's label fails before any work
            svc.ray_resources()
        splits, offline = artifacts.prepare_data(cfg, console)
        mexp_model = None
        if dreamgym:  # the replay buffer and the experience model
            svc.open_buffer(offline)
        if dreamgym or live_fidelity:
            mexp_model = artifacts.mexp_checkpoint(cfg, offline, console)
        policy_model = artifacts.policy_start(cfg, offline, console, svc.run_dir)
        record_start(svc.run_dir, policy_model)  # what `--checkpoint runs/<name>` serves if no update is published
        await svc.start_engines(mexp_model, policy_model)
        await serve_built_models(cfg, svc, mexp_model, policy_model, console)
        learner, curriculum = await make_trainer(cfg, svc, policy_model, splits.train, resume) if plan else (None, None)
        fidelity = await fidelity_check(cfg, svc, offline, mexp_model, console) if dreamgym else None
        before = await heldout_eval(cfg, svc, splits.heldout, "before", console) \
            if evaluate and plan and cfg.evaluation.before else None

        probe = fidelity_probe(cfg, svc, offline) if live_fidelity else None
        history, phases = report.RunHistory(path=svc.run_dir / "history.json", run_started=t_start), []
        if resume and learner is not None:
            history.resume(learner.version)  # the earlier segments' rows and clocks
        try:
            for i, (phase_cfg, label, until) in enumerate(plan):
                phases.append(await rl_phase(phase_cfg, svc, learner, curriculum, history, label, until, console,
                                             probe))
                if evaluate and i < len(plan) - 1:  # sim-to-real: what the synthetic phase alone reached
                    if phases[-1]["updates"] == 0 and before is not None:
                        phases[-1]["heldout_after"] = report.brief(before)  # resumed past it: `before` measured it
                        continue
                    await learner.publish()
                    phases[-1]["heldout_after"] = report.brief(
                        await heldout_eval(cfg, svc, splits.heldout, f"after {label}", console))
        finally:
            if probe is not None:
                await probe.wait()
                probe.close()
        history.end()
        if learner is not None:
            await learner.finish()
        after = await heldout_eval(cfg, svc, splits.heldout, "after", console) if evaluate else None
        record_success_gap(history.rows[-1].get("success_rate") if history.rows else None, after)
        trained_on = await heldout_eval(cfg, svc, splits.train, "after", console, split="training") \
            if evaluate and cfg.evaluation.training_tasks else None

        summary = report.summary(cfg, name, before, after, history, learner, phases, svc.buffer_size(), t_start,
                                 offline, fidelity, await run_counts(svc.client, svc.prefix), splits.train,
                                 trained_on)
        if placement := svc.placements():  # actors.runtime=ray: the node each actor ran on
            summary["placement"] = placement
        summary.update(s2r_share(phases))
        summary["warm_start"] = artifacts.warm_start_record(cfg, policy_model)  # which SFT it started from
        return report.write_report(svc.run_dir, summary, history, console)


async def serve_built_models(cfg: Config, svc: Services, mexp_model: str | None, policy_model: str,
                             console: Console) -> None:
    """Configured servers (SGLang on a cluster) serve what they were launched with: load the models this
    run built (the Mexp SFT checkpoint, the warm-started policy) into every one of them before RL, as
    weight version 0. Their paths must be readable by the servers (a shared `infra.data_dir`). A resumed
    learner then publishes its own checkpoint over the policy's (make_trainer)."""
    e = cfg.engines
    for endpoints, client, model, what in ((e.mexp_endpoints, svc.mexp, mexp_model, "Mexp"),
                                           (e.policy_endpoints, svc.policy, policy_model, "policy")):
        if endpoints and client is not None and model and Path(model).is_dir():
            await client.update_weights_from_disk(str(Path(model).resolve()), 0)
            console.print(f"{what} servers now serve {model} ({len(endpoints)} server(s))")


def check_devices(cfg: Config) -> None:
    """Before anything starts: the learner, the policy warm start and Mexp SFT run in this process, so
    a device this machine lacks fails now with the setting's name (ConfigError), not minutes later in torch."""
    Precision.checked(cfg.learner.device, cfg.learner.dtype, "learner.device", "learner.dtype")
    # with Ray each learner rank is an actor given its own GPU: only the LoRA rule applies here
    check_ranks(cfg.learner, one_node=cfg.actors.runtime != "ray")
    Precision.checked(cfg.simulator.sft_device, cfg.simulator.sft_dtype, "simulator.sft_device", "simulator.sft_dtype")


def rl_plan(cfg: Config) -> list[tuple[Config, str, int]]:
    """The RL phases of a run: (the config its workers follow, a label, the update count it runs up to).

    DreamGym trains in the synthetic environment; the real-environment baseline in the real one,
    within `actors.real_transitions`; sim-to-real trains in DreamGym, then continues the same
    learner in the real environment for exactly `learner.s2r_real_transitions` transitions.
    `learner.total_updates=0` plans nothing: the starting policy is only evaluated (the base and
    SFT regimes)."""
    lc = cfg.learner
    if lc.total_updates == 0:
        return []
    plan = [(cfg, "DreamGym" if cfg.actors.env_kind == "synthetic" else "real env", lc.total_updates)]
    if lc.s2r_real_transitions and cfg.actors.env_kind == "synthetic":
        real = dataclasses.replace(cfg, actors=dataclasses.replace(
            cfg.actors, env_kind="real", real_transitions=lc.s2r_real_transitions,
            temperature=lc.s2r_temperature or cfg.actors.temperature))
        plan.append((real, S2R_PHASE, lc.total_updates + (lc.s2r_max_updates or 1_000_000)))
    return plan


S2R_PHASE = "sim-to-real: real env"


def s2r_share(phases: list[dict]) -> dict:
    """summary.json's account of sim-to-real's real phase: its real transitions, those in trajectories an
    update trained on (the rest fell in zero-variance, broken or stale groups, or were left unused), and
    the share; {} without a real phase, and the trained count None when a resumed run's earlier segment
    spent the budget (that segment's updates are not counted here)."""
    real = [p for p in phases if p["phase"] == S2R_PHASE]
    if not real:
        return {}
    used = sum(p["real_transitions"] for p in real)
    known = [p["real_transitions_trained"] for p in real if p.get("real_transitions_trained") is not None]
    trained = sum(known) if len(known) == len(real) else None
    return {"s2r_real_transitions": used, "s2r_real_transitions_trained": trained,
            "s2r_trained_share": round(trained / used, 4) if trained is not None and used else None}


async def rl_phase(cfg: Config, svc: Services, learner: Learner, curriculum: CurriculumScheduler,
                   history: report.RunHistory, label: str, until: int, console: Any,
                   probe: FidelityProbe | None = None) -> dict:
    """Workers play the curriculum's tasks in `cfg.actors.env_kind` environments while the learner
    updates, until `until` updates, the wall-clock budget, or (real rollouts) the spent transition budget.
    `probe`: the live fidelity probe, started after every `simulator.fidelity_every` updates."""
    t0, updates0 = time.time(), learner.updates
    real = StepBudget(svc.client, svc.prefix, cfg.actors.real_transitions) if cfg.actors.env_kind == "real" else None
    # a resumed run whose checkpoint already holds this phase, or whose real budget it spent: start no workers
    if updates0 >= until or (real is not None and await real.spent()):
        done = f"already at {updates0} of {until} updates" if updates0 >= until else \
            f"its {cfg.actors.real_transitions} real transitions already spent"
        console.print(f"{label}: {done} (resumed); nothing to roll out")
        # the real transitions it used are on the run's Redis counter, which outlives the killed segment
        return {"phase": label, "env_kind": cfg.actors.env_kind, "updates": 0,
                "real_transitions": await real.used() if real is not None else 0,
                "synthetic_transitions": 0, "trajectories_pushed": 0, "trajectories_set_aside": {},
                "trajectories_waiting": 0, "transition_budget_spent": real is not None and await real.spent(),
                "seconds": 0.0, "earlier_segment": True}
    counts0, aside0, mexp0 = await run_counts(svc.client, svc.prefix), learner.set_aside, metrics.mexp_steps()
    curriculum.real_only = real is not None
    curriculum.real_selection = cfg.learner.s2r_selection if label == S2R_PHASE else "curriculum"
    trained_steps = [0]  # the trainable steps of the trajectories this phase's updates used (real: real transitions)
    learner.env_kind = cfg.actors.env_kind  # sim-to-real: the DreamGym phase's leftovers are set aside, not trained
    stop = budget(cfg.infra.train_budget_s)
    # how Mexp answered this process's synthetic steps so far in the phase (a Ray fleet's actors count their own)
    counts_mexp = cfg.actors.env_kind == "synthetic" and cfg.actors.runtime != "ray"

    def mexp_counts() -> dict:
        return {"mexp_steps": {k: int(v - mexp0[k]) for k, v in metrics.mexp_steps().items()}} if counts_mexp else {}

    with report.training_progress(console, cfg, learner, history, label, until, extra=mexp_counts) as record:
        def on_update(s: Any) -> None:
            record(s)
            trained_steps[0] += s.steps
            if probe is not None:
                probe.after_update(learner.updates, learner.version)

        async with svc.workers(cfg) as pool, task_feed(cfg, curriculum, learner, pool, svc) as before_step:
            watch = asyncio.create_task(real.wait_spent(stop)) if real is not None and real.limit else None
            await learner.run(until, on_update=on_update, stop=stop, before_step=before_step)
            if watch is not None and watch.done() and watch.result():  # spent: train on what it bought
                await pool.retire("real-transition budget spent")
                while learner.updates < until and (s := await learner.step(final=True)) is not None:
                    on_update(s)
            if watch is not None:
                watch.cancel()
    spent = real is not None and await real.spent()
    if stop.is_set() and not spent and learner.updates < until:
        console.print(f"[yellow]{label}: train budget of {cfg.infra.train_budget_s:.0f} s spent after "
                      f"{learner.updates} updates[/]")
    counts = await run_counts(svc.client, svc.prefix)
    return {"phase": label, "env_kind": cfg.actors.env_kind, "updates": learner.updates - updates0,
            "real_transitions": await real.used() if real is not None else 0,
            "real_transitions_trained": trained_steps[0] if real is not None else 0,
            "synthetic_transitions": counts["synthetic_steps_pushed"] - counts0["synthetic_steps_pushed"],
            "trajectories_pushed": counts["trajectories_pushed"] - counts0["trajectories_pushed"],
            # where the pushed ones went: set aside by the learner (by outcome), or still held for an update
            "trajectories_set_aside": {k: n - aside0.get(k, 0) for k, n in learner.set_aside.items()
                                       if n > aside0.get(k, 0)},
            "trajectories_waiting": learner.waiting,
            **mexp_counts(),  # also on each update's history row, for a run stopped before this summary
            "transition_budget_spent": spent, "seconds": round(time.time() - t0, 1),
            # the rollout-worker pool: every resize (start, `dreamgym scale`, actors.autoscale, end) and why
            "worker_pool": pool.report()}


FIDELITY_FILE = "mexp_fidelity.json"


async def fidelity_check(cfg: Config, svc: Services, offline: list, mexp_model: str | None,
                         console: Any) -> dict | None:
    """Mexp's reward accuracy and ΔR on held-out real steps before RL (simulator.fidelity_check_steps);
    a Mexp below simulator.min_reward_accuracy is reported loudly, since the paper's bound ties real
    improvement to the model's reward error. The result is kept in the run directory under a key of
    the Mexp checkpoint and the simulator's settings, so a resumed run (and a sim-to-real run that
    continues another, infra/run/fork.py) reports the check of the Mexp it serves without replaying it."""
    n = cfg.simulator.fidelity_check_steps
    if not n or cfg.actors.env_kind != "synthetic":
        return None
    key = settings_key({"mexp": mexp_model, "simulator": dataclasses.asdict(cfg.simulator),
                        "seed": cfg.infra.seed, "family": cfg.actors.env_family})
    kept = svc.run_dir / FIDELITY_FILE
    s = kept_summary(kept, key) if mexp_model else None
    if s is not None:
        took = f"this Mexp's check, kept in {kept}"
    else:
        train_trajs, held_trajs = split_trajectories(offline, cfg.simulator.heldout_frac, cfg.infra.data_dir,
                                                     cfg.actors.env_family)
        t0 = time.perf_counter()
        replayed = await replay_heldout(svc.mexp, cfg.simulator, svc.tokenizer, train_trajs, held_trajs,
                                        getattr(svc.buffer, "embedder", None) or Embedder(
                                            cache_path=artifacts.embedding_cache(cfg)), max_steps=n)
        s = replayed["full"]["summary"]
        if not s.get("steps"):
            console.print("[yellow]Mexp fidelity check: no held-out real steps to replay[/]")
            return None
        took = f"{time.perf_counter() - t0:.0f} s"
        if mexp_model:
            kept.write_text(json.dumps({"key": key, "summary": s}, indent=1, default=str))
    ok = s["reward_accuracy"] >= cfg.simulator.min_reward_accuracy
    false_rewards = s.get("reward_false_positive_rate", float("nan"))  # a check kept before it was measured lacks it
    line = (f"Mexp fidelity on {s['steps']} held-out real steps: reward accuracy {s['reward_accuracy']:.2f} "
            f"(always 0 would score {s['reward_accuracy_all_zero']:.2f}; recall {s['reward_recall']:.2f}, "
            f"precision {s['reward_precision']:.2f}, false rewards on {false_rewards:.2f} of the "
            f"unrewarded steps), "
            f"ΔR {s['delta_r_mean']:.3f}, parse failures {s['parse_failure_rate']:.2f} ({took})")
    export_fidelity(s)
    console.print(line if ok else f"[bold red]WARNING: {line}: below simulator.min_reward_accuracy="
                                   f"{cfg.simulator.min_reward_accuracy}; synthetic rewards are unreliable and "
                                   f"RL in DreamGym may learn the simulator's mistakes[/]")
    return {**{k: s[k] for k in ("steps", "reward_accuracy", "reward_accuracy_all_zero", "reward_recall",
                                  "reward_precision", "reward_false_positive_rate", "delta_r_mean", "done_accuracy",
                                  "parse_failure_rate", "item_recall", "token_f1") if k in s},
            "below_threshold": not ok}


def kept_summary(path: Path, key: str) -> dict | None:
    """The fidelity summary kept at `path` under `key` (fidelity_check), or None."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return saved["summary"] if isinstance(saved, dict) and saved.get("key") == key \
        and isinstance(saved.get("summary"), dict) else None


def fidelity_probe(cfg: Config, svc: Services, offline: list) -> FidelityProbe | None:
    """The live fidelity probe on the run's Mexp: `simulator.fidelity_probe_steps` held-out real steps
    (the same task split as Mexp's SFT), or None when there is no Mexp or no held-out step."""
    if svc.mexp is None:
        return None
    train_trajs, held_trajs = split_trajectories(offline, cfg.simulator.heldout_frac, cfg.infra.data_dir,
                                                 cfg.actors.env_family)
    probe = FidelityProbe(svc.mexp, cfg.simulator, svc.tokenizer, train_trajs, held_trajs,
                          getattr(svc.buffer, "embedder", None) or Embedder(cache_path=artifacts.embedding_cache(cfg)),
                          cfg.simulator.fidelity_probe_steps, cfg.simulator.fidelity_every)
    if not probe.examples:
        probe.close()
        return None
    return probe


def budget(seconds: float) -> asyncio.Event:
    """An event set once `seconds` of wall time have passed (never, for 0)."""
    stop = asyncio.Event()
    if seconds > 0:
        asyncio.get_running_loop().call_later(seconds, stop.set)
    return stop


async def heldout_eval(cfg: Config, svc: Services, tasks: list, label: str, console: Any = None,
                       split: str = "held-out") -> dict:
    """The served policy on REAL tasks, the held-out ones but for evaluation.training_tasks's replay of the training
    ones (`split` names them in the log), greedy unless `evaluation.temperature`; the EvalReport as a dict."""
    ev = cfg.evaluation
    chooser = choice_policy_chooser(Policy.from_config(cfg.actors, svc.policy, svc.tokenizer, temperature=ev.temperature,
                                                            seed=cfg.infra.seed))
    t0 = time.perf_counter()
    iso = Isolation.from_config(cfg.actors)  # each environment in a supervised child process
    try:
        with svc.engine_threads("policy", ev.engine_threads):
            result = await evaluate(chooser, tasks, cfg.actors.env_family, max_steps=ev.max_steps or cfg.data.max_steps,
                                    episodes_per_task=ev.episodes, concurrency=min(ev.concurrency, max(1, len(tasks))),
                                    policy_name=label, isolation=iso)
    finally:
        if iso is not None:
            iso.close()
    d = result.to_dict()
    artifacts.say(console, f"{split} real {cfg.actors.env_family} ({label}): success {d['success_rate']:.3f} "
                           f"on {d['episodes']} episodes ({time.perf_counter() - t0:.0f} s)")
    return d


async def make_trainer(cfg: Config, svc: Services, policy_model: str, seeds: list,
                       resume: bool) -> tuple[Learner, CurriculumScheduler]:
    """The learner and the curriculum that feeds its workers, restored from the latest checkpoint on --resume
    (and the restored weights published: the "before" evaluation measures what is served)."""
    learner = await make_learner(cfg, svc, policy_model)
    curriculum = make_curriculum(cfg, svc, seeds)
    # The curriculum's pool, statistics and RNG are saved with every learner checkpoint.
    learner.register_state("curriculum", curriculum.state_dict, lambda _state: None)
    if resume and learner.resume():
        await learner.publish()
        if "curriculum" in learner.extra:
            await curriculum.load_state_dict(learner.extra["curriculum"])
    return learner, curriculum


async def make_learner(cfg: Config, svc: Services, policy_model: str) -> Learner | LearnerHandle:
    """The GRPO/PPO learner on the run's trajectory stream, publishing to the policy engines: in this
    process, or with `actors.runtime=ray` an actor on the `learner_gpu` node (the same methods)."""
    if cfg.actors.runtime == "ray":
        return await svc.learner_actor(policy_model)
    return svc.learner(policy_model)


def make_curriculum(cfg: Config, svc: Services, seeds: list) -> CurriculumScheduler:
    """The curriculum scheduler: variants from Mtask (the Mexp engine) when enabled; uniform when `curriculum.enabled` is off.
    With `actors.runtime=ray` it runs as an actor and this returns its handle (same methods)."""
    mtask = cfg.curriculum.enabled and cfg.curriculum.variants_per_seed > 0 and svc.mexp is not None
    if cfg.actors.runtime == "ray":
        return svc.curriculum_actor(seeds, variants=mtask)
    variants = None  # Mtask writes tasks with no real counterpart: only DreamGym can play them
    if mtask:
        embedder = getattr(svc.buffer, "embedder", None) or Embedder(cache_path=artifacts.embedding_cache(cfg))
        variants = TaskVariantGenerator(svc.mexp, svc.tokenizer, cfg.curriculum, embedder)
    return CurriculumScheduler(svc.client, cfg.curriculum, svc.prefix, seeds, variants=variants, seed=rl_seed(cfg.infra),
                               stream_maxlen=cfg.infra.stream_maxlen)


@contextlib.asynccontextmanager
async def task_feed(cfg: Config, curriculum: CurriculumScheduler, learner: Learner, pool: WorkerPool,
                    svc: Services) -> AsyncIterator[Callable[[], Awaitable[None]] | None]:
    """Tasks for the workers while the block runs. Async: the curriculum keeps the task stream topped up
    in the background. `--sync`: yields the learner's `before_step`, which pushes one update's worth."""
    if cfg.learner.sync:
        yield SyncFeed(curriculum, learner, pool, svc.client, svc.prefix)
        return
    stop = asyncio.Event()
    feeder = asyncio.create_task(curriculum.run(stop))
    try:
        yield None
    finally:
        stop.set()
        await feeder


class SyncFeed:
    """Synchronous mode: once the workers are idle and both streams are drained, push exactly the groups the
    learner still needs; so every update trains on trajectories of the weights it just published."""

    def __init__(self, curriculum: CurriculumScheduler, learner: Learner, pool: WorkerPool, client: Any, prefix: str):
        self.curriculum, self.learner, self.pool, self.client, self.prefix = curriculum, learner, pool, client, prefix
        self.producer = StreamProducer(client, tasks_stream(prefix))

    async def __call__(self) -> None:
        missing = self.learner.groups_missing  # zero-variance and stale groups were set aside: play more
        if (missing > 0 and all(not s.get("inflight") for s in await self.pool.statuses())
                and await stream_backlog(self.client, tasks_stream(self.prefix)) == 0
                and await stream_backlog(self.client, trajectories_stream(self.prefix), LEARNER_GROUP) == 0):
            tasks: list = []
            while len(tasks) < missing:
                tasks += await self.curriculum.next_batch()
            await self.producer.add(encode(t) for t in tasks[:missing])
