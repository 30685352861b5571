"""Held-out evaluation on real environments, and the one episode loop for real envs.

Owns `dreamgym eval`, the `ActionChooser` plug-in point, `run_episode` (a policy
against a real Environment, recorded as a wire-schema Trajectory) and
`evaluate(policy_fn, tasks, family) -> EvalReport`: success rate with a 95 % Wilson
interval, mean steps and invalid-action rate. The orchestration loop calls
`evaluate` for held-out real success before and after training; the learner's
`ChoicePolicy` plugs in through `choice_policy_chooser`.

Fixed seeds: TextWorld games are deterministic given the file; a MiniWoB page is
reset with the task's seed; scripted choosers are seeded. Tasks are run in order,
one episode each by default, on `concurrency` environments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

from infra.metrics import ROLLOUT_EPISODE_SECONDS, ROLLOUT_EPISODES, ROLLOUT_STEPS
from infra.schema import EnvKind, Status, Step, Task, Trajectory, new_id

log = logging.getLogger(__name__)


class ActionChooser(Protocol):
    """A policy as evaluation sees it: (task, state, candidates, history of actions) -> action text.

    Scripted choosers that read the environment's info (the expert) set
    `uses_env_info = True` and take an `info=` keyword.
    """

    async def __call__(self, task: Task, state: str, candidates: Sequence[str], history: Sequence[str]) -> str: ...


def rationale_source(family: str) -> str:
    return "env-dom-diff" if family.startswith("miniwob") else "env-facts"


async def run_episode(env: Any, task: Task, chooser: ActionChooser, max_steps: int, worker_id: str = "",
                      group_id: str = "", policy_version: int = 0) -> Trajectory:
    """One episode of `chooser` on a real env; every step carries its env-derived rationale and next state."""
    t0 = time.perf_counter()
    policy_s = 0.0
    steps: list[Step] = []
    history: list[str] = []
    source = rationale_source(task.family or getattr(env, "family", ""))
    status = Status.TRUNCATED
    try:
        state, info = await env.reset(task)
        for _ in range(max_steps):
            candidates = list(info.get("candidates", []))
            tp = time.perf_counter()
            if getattr(chooser, "uses_env_info", False):
                action = await chooser(task, state, candidates, history, info=info)
            else:
                action = await chooser(task, state, candidates, history)
            policy_s += time.perf_counter() - tp
            res = await env.step(action)
            info = res.info
            steps.append(Step(state=state, action=action, reward=float(res.reward), done=bool(res.done),
                              next_state=res.state, reasoning=str(info.get("rationale", "")),
                              reasoning_source=source, valid=bool(info.get("valid", True))))
            history.append(action)
            state = res.state
            if res.done:
                status = Status.SUCCESS if info.get("won") else (Status.TRUNCATED if info.get("truncated") else Status.FAILURE)
                break
    except Exception as exc:  # a crashed real env ends this episode, not the run
        from infra.metrics import ENV_ERRORS

        ENV_ERRORS.labels(family=source).inc()
        status = Status.ENV_ERROR
        log.warning("episode of %s crashed: %s: %s", task.task_id, type(exc).__name__, str(exc)[:300])
    if steps and status == Status.TRUNCATED:
        steps[-1].done = True
    total = time.perf_counter() - t0
    ROLLOUT_EPISODES.labels(env_kind="real", status=status.value).inc()
    ROLLOUT_STEPS.labels(env_kind="real").inc(len(steps))
    ROLLOUT_EPISODE_SECONDS.labels(env_kind="real").observe(total)
    return Trajectory(task_id=task.task_id, group_id=group_id or new_id(), steps=steps, env_kind=EnvKind.REAL,
                      status=status, success=status == Status.SUCCESS, policy_version=policy_version,
                      worker_id=worker_id, timings={"policy": policy_s, "env": total - policy_s, "total": total},
                      task=task)


def wilson_interval(successes: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (95 % by default); (0, 1) when n = 0."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= n:
        raise ValueError(f"successes={successes} outside [0, {n}]")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # Exact ends at 0 and n (rounding would otherwise leave p itself just outside).
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return lo, hi


@dataclass
class EvalReport:
    family: str
    policy: str
    episodes: int
    successes: int
    success_rate: float
    ci_low: float
    ci_high: float
    mean_steps: float
    invalid_rate: float  # invalid actions / all actions
    env_errors: int
    seconds: float
    per_task: list = field(default_factory=list)  # [{task_id, success, steps, invalid}]

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(trajs: Sequence[Trajectory], family: str, policy: str, seconds: float = 0.0) -> EvalReport:
    n = len(trajs)
    k = sum(1 for t in trajs if t.success)
    n_steps = sum(len(t.steps) for t in trajs)
    invalid = sum(1 for t in trajs for s in t.steps if not s.valid)
    lo, hi = wilson_interval(k, n)
    per = [{"task_id": t.task_id, "success": t.success, "steps": len(t.steps),
            "invalid": sum(1 for s in t.steps if not s.valid), "status": t.status.value} for t in trajs]
    return EvalReport(family, policy, n, k, k / n if n else 0.0, lo, hi, n_steps / n if n else 0.0,
                      invalid / n_steps if n_steps else 0.0, sum(t.status == Status.ENV_ERROR for t in trajs),
                      seconds, per)


async def evaluate(policy_fn: ActionChooser, tasks: Sequence[Task], family: str, max_steps: int = 20,
                   episodes_per_task: int = 1, concurrency: int = 1, policy_name: str = "policy",
                   env_kwargs: dict | None = None, on_episode: Any = None) -> EvalReport:
    """Run `policy_fn` on each task (`episodes_per_task` times) in real `family` environments."""
    from actors.envs.registry import make_env

    t0 = time.perf_counter()
    jobs: asyncio.Queue = asyncio.Queue()
    order = [(i, task) for task in tasks for i in range(episodes_per_task)]
    for j, item in enumerate(order):
        jobs.put_nowait((j, item))
    results: list[Trajectory | None] = [None] * len(order)

    async def worker(w: int) -> None:
        env = make_env(family, max_steps=max_steps, **(env_kwargs or {}))
        try:
            while not jobs.empty():
                j, (_i, task) = jobs.get_nowait()
                results[j] = await run_episode(env, task, policy_fn, max_steps, worker_id=f"eval-{w}")
                if on_episode is not None:
                    on_episode(results[j])
        finally:
            await env.close()

    await asyncio.gather(*(worker(w) for w in range(max(1, min(concurrency, len(order))))))
    return summarize([t for t in results if t is not None], family, policy_name, time.perf_counter() - t0)


def choice_policy_chooser(policy: Any) -> ActionChooser:
    """Adapt the learner's ChoicePolicy (`act(task, state, candidates, history, affinity_key)`)."""

    async def choose(task: Task, state: str, candidates: Sequence[str], history: Sequence[str]) -> str:
        from actors.policy import MAX_CHOICES

        decision = await policy.act(task, state, list(candidates)[:MAX_CHOICES], list(history), task.task_id)
        return decision.action

    return choose


# --- the `dreamgym eval` command ------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    from infra.cli import add_config_arguments

    add_config_arguments(p)
    p.add_argument("--family", default="textworld", choices=["textworld", "miniwob"], help="real environment family")
    p.add_argument("--policy", default="expert", choices=["expert", "random", "noisy", "endpoint", "checkpoint"],
                   help="scripted baseline, an SGLang-compatible policy endpoint, or a local checkpoint served in-process")
    p.add_argument("--endpoint", default="", help="policy engine URL for --policy endpoint")
    p.add_argument("--checkpoint", default="", help="model directory for --policy checkpoint")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="engine policies: sampling temperature over the candidate labels (0 = greedy, reproducible)")
    p.add_argument("--split", default="heldout", choices=["heldout", "train"], help="which task split to evaluate")
    p.add_argument("--limit", type=int, default=0, help="evaluate only the first N tasks (0 = all)")
    p.add_argument("--episodes", type=int, default=1, help="episodes per task")
    p.add_argument("--out", default="", help="JSON report path (default <run_dir>/eval/<family>-<policy>.json)")


async def _engine_chooser(args: argparse.Namespace, cfg: Any):
    """(chooser, cleanup) for an engine endpoint or a checkpoint served by the embedded engine."""
    from actors.policy import ChoicePolicy
    from infra.engine_client import EngineClient
    from infra.model_loading import load_tokenizer

    handle = None
    if args.policy == "checkpoint":
        from infra.engine_server import start_embedded_engine

        handle = await start_embedded_engine(model=args.checkpoint or cfg.engines.model, max_batch_size=cfg.engines.max_batch_size)
        url = handle.url
    else:
        if not args.endpoint:
            raise SystemExit("--policy endpoint needs --endpoint URL")
        url = args.endpoint
    client = EngineClient([url], role="policy")
    tokenizer = load_tokenizer(args.checkpoint or cfg.engines.model)
    chooser = choice_policy_chooser(ChoicePolicy(client, tokenizer, temperature=args.temperature, seed=cfg.infra.seed))

    async def cleanup() -> None:
        await client.close()
        if handle is not None:
            await handle.stop()

    return chooser, cleanup


def print_report(report: EvalReport) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"dreamgym eval: {report.family}, policy {report.policy}")
    for col in ("episodes", "success", "95% CI", "mean steps", "invalid rate", "env errors", "seconds"):
        t.add_column(col, justify="right")
    t.add_row(str(report.episodes), f"{report.success_rate:.3f} ({report.successes})",
              f"[{report.ci_low:.3f}, {report.ci_high:.3f}]", f"{report.mean_steps:.2f}",
              f"{report.invalid_rate:.3f}", str(report.env_errors), f"{report.seconds:.1f}")
    Console().print(t)


def run(args: argparse.Namespace) -> int:
    from actors.envs.expert import make_chooser
    from actors.envs.registry import load_or_make_splits
    from infra.cli import config_from_args

    cfg = config_from_args(args)
    splits = load_or_make_splits(args.family, cfg.data, cfg.infra.data_dir, seed=cfg.infra.seed)
    tasks = splits.heldout if args.split == "heldout" else splits.train
    if args.limit:
        tasks = tasks[: args.limit]

    async def go() -> EvalReport:
        if args.policy in ("expert", "random", "noisy"):
            chooser, cleanup = make_chooser(args.policy, seed=cfg.infra.seed, eps=cfg.data.noise_eps), None
        else:
            chooser, cleanup = await _engine_chooser(args, cfg)
        try:
            return await evaluate(chooser, tasks, args.family, max_steps=cfg.data.max_steps,
                                  episodes_per_task=args.episodes, concurrency=cfg.data.workers if args.policy in ("expert", "random", "noisy") else 1,
                                  policy_name=args.policy)
        finally:
            if cleanup is not None:
                await cleanup()

    report = asyncio.run(go())
    out = Path(args.out or Path(cfg.infra.run_dir) / "eval" / f"{args.family}-{args.policy}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report.to_dict(), indent=1))
    print_report(report)
    print(f"report: {out}")
    return 0
