"""Held-out evaluation on real environments.

Owns `dreamgym eval` and `evaluate(policy_fn, tasks, family) -> EvalReport`: success
rate with a 95 % Wilson interval, mean steps and invalid-action rate, over episodes
played by the one episode loop (actors/episode.py, shared with the rollout worker and
collection; it owns what counts as success). The driver calls `evaluate` for held-out
real success before and after training; the learner's `Policy` plugs in through
`choice_policy_chooser`.

Fixed seeds: TextWorld games are deterministic given the file; a MiniWoB page is
reset with the task's seed; scripted choosers are seeded. Tasks are run in order,
one episode each by default, on `concurrency` environments.

A bad task costs itself only: game files are checked when loaded and a bad one is named and not
played; each environment runs in a supervised child process (`actors.env_isolation`,
actors/envs/env_process.py), so a crash or hang ends that episode as env_error with its reason.
The report's `bad_tasks` names them all, and the command exits EXIT_BAD_TASKS (3) when there are any.

`--compare-to` pairs the report with an earlier one on the tasks both played (`paired_summary`: the
difference in success with its bootstrap interval over tasks, actors/confidence.py, and the tasks won
and lost): how an RL checkpoint is read against the SFT it started from.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from actors.confidence import compare, per_task_success, wilson_interval
from actors.envs.env_process import Isolation
from actors.envs.expert import PerTaskChooser
from actors.envs.registry import add_family_argument, family_of, load_or_make_splits, make_env, tasks_from_spec
from actors.episode import Chooser, run_episode
from actors.policy import MAX_CHOICES, Policy
from infra.config import UsageError, add_config_arguments, config_from_args
from infra.engine.client import EngineClient
from infra.engine.models import load_tokenizer
from infra.engine.server import start_embedded_engine
from infra.schema import Status, Task, Trajectory
from learner.weights import resolve_model


# `dreamgym eval`'s exit status when the report is written but some tasks were not played to an end (a game
# file refused when loaded; an environment that crashed, hung or was refused): the report's bad_tasks names them.
# 0: every task played; 1: the command failed (no report); 2: a usage error.
EXIT_BAD_TASKS = 3


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
    per_task: list = field(default_factory=list)  # [{task_id, success, steps, invalid, status, family, plan_length}]
    # tasks not played to an end: refused when loaded (a bad game file) or whose environment crashed, hung or
    # was refused (env_error): [{task_id, game_file, reason, detail}]
    bad_tasks: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(trajs: Sequence[Trajectory], family: str, policy: str, seconds: float = 0.0) -> EvalReport:
    n = len(trajs)
    k = sum(1 for t in trajs if t.success)
    n_steps = sum(len(t.steps) for t in trajs)
    invalid = sum(1 for t in trajs for s in t.steps if not s.valid)
    lo, hi = wilson_interval(k, n)
    per = [{"task_id": t.task_id, "success": t.success, "steps": len(t.steps),
            "invalid": sum(1 for s in t.steps if not s.valid), "status": t.status.value,
            # what the results table's slices read (infra/run/generalisation.py): the task's family and the
            # expert's plan length from its start, where the task records one
            "family": t.task.family if t.task else "",
            "plan_length": t.task.meta.get("plan_length") if t.task else None,
            "env_error": str(t.timings.get("env_error", "")) if t.status == Status.ENV_ERROR else ""} for t in trajs]
    bad = [{"task_id": t.task_id, "game_file": t.task.game_file if t.task else "",
            "reason": str(t.timings.get("env_error", "env_exception")), "detail": ""}
           for t in trajs if t.status == Status.ENV_ERROR]
    return EvalReport(family, policy, n, k, k / n if n else 0.0, lo, hi, n_steps / n if n else 0.0,
                      invalid / n_steps if n_steps else 0.0, sum(t.status == Status.ENV_ERROR for t in trajs),
                      seconds, per, bad)


async def evaluate(policy_fn: Chooser, tasks: Sequence[Task], family: str, max_steps: int = 20,
                   episodes_per_task: int = 1, concurrency: int = 1, policy_name: str = "policy",
                   env_kwargs: dict | None = None, on_episode: Any = None, isolation: Any = None) -> EvalReport:
    """Run `policy_fn` on each task (`episodes_per_task` times) in real `family` environments
    (`isolation`: each in a supervised child process, actors/envs/env_process.py; None = in this one)."""
    t0 = time.perf_counter()
    jobs: asyncio.Queue = asyncio.Queue()
    order = [(i, task) for task in tasks for i in range(episodes_per_task)]
    for j, item in enumerate(order):
        jobs.put_nowait((j, item))
    results: list[Trajectory | None] = [None] * len(order)

    async def worker(w: int) -> None:
        env = make_env(family, isolation=isolation, max_steps=max_steps, **(env_kwargs or {}))
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


def choice_policy_chooser(policy: Any) -> Chooser:
    """Adapt the learner's Policy (`act(task, state, candidates, history, affinity_key)`)."""

    async def choose(task: Task, state: str, candidates: Sequence[str], history: Sequence) -> Any:
        # The decision itself (not its text): the episode hands it back as history, which a
        # multi-turn policy extends by one turn.
        return await policy.act(task, state, list(candidates)[:MAX_CHOICES], list(history), task.task_id)

    return choose


# --- the `dreamgym eval` command ------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    add_family_argument(p)
    p.add_argument("--policy", default="expert", choices=["expert", "random", "noisy", "endpoint", "checkpoint"],
                   help="scripted baseline, an SGLang-compatible policy endpoint, or a local checkpoint served in-process")
    p.add_argument("--endpoint", default="", help="policy engine URL for --policy endpoint")
    p.add_argument("--checkpoint", default="", help="--policy checkpoint: a model directory, or a run directory "
                                                    "(runs/<name>: its latest published weights)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="engine policies: sampling temperature over the candidate labels (0 = greedy, reproducible)")
    p.add_argument("--split", default="heldout", choices=["heldout", "train"], help="which task split to evaluate")
    p.add_argument("--tasks", default="", help="evaluate on these tasks instead of a split: TextWorld/ALFWorld game files "
                                               "(a directory, a glob or a file), or MiniWoB/BrowserGym task names "
                                               "(comma-separated, or a file with one per line)")
    p.add_argument("--limit", type=int, default=0, help="evaluate only the first N tasks (0 = all)")
    p.add_argument("--episodes", type=int, default=1, help="episodes per task")
    p.add_argument("--out", default="", help="JSON report path (default <run_dir>/eval/<family>-<policy>.json)")
    p.add_argument("--compare-to", default="", metavar="REPORT",
                   help="an earlier report's JSON (say, the SFT's): print and record this policy's paired difference "
                        "in success against it on the tasks both played, with its 95%% interval and the tasks won and lost")


def paired_summary(per_task: Sequence[dict], earlier: Sequence[dict]) -> dict:
    """This evaluation's `per_task` rows against an earlier one's, on the tasks both played: the paired
    difference in success (a fraction) with its 95 % bootstrap interval, and the tasks won and lost."""
    d = compare(per_task, earlier)
    a, b = per_task_success(per_task), per_task_success(earlier)
    common = set(a) & set(b)
    return {"diff": d.diff, "ci_low": d.ci_low, "ci_high": d.ci_high, "tasks": d.tasks,
            "won": sum(a[t] > b[t] for t in common), "lost": sum(a[t] < b[t] for t in common)}


def _earlier_report(path: str) -> dict:
    """The --compare-to report, read before anything is played: a UsageError names what is wrong with it."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"--compare-to {path}: not a readable JSON report ({e})") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("per_task"), list):
        raise UsageError(f"--compare-to {path}: no per_task rows (a `dreamgym eval` report has them)")
    return doc


async def _engine_chooser(args: argparse.Namespace, cfg: Any):
    """(chooser, cleanup) for an engine endpoint or a checkpoint served by the embedded engine."""
    handle = None
    model = resolve_model(args.checkpoint or cfg.engines.model)
    if args.policy == "checkpoint":
        # Served as `dreamgym train` serves and evaluates it: engines.device and dtype, the engine settings, and
        # evaluation.engine_threads torch threads on a CPU (-1: every core, the policy engine computing alone).
        e, want = cfg.engines, cfg.evaluation.engine_threads
        threads = 0 if want == -1 else e.threads if want == 0 else want  # EngineConfig.threads 0 = every core
        handle = await start_embedded_engine(model=model, max_batch_size=e.max_batch_size, dtype=e.dtype,
                                             device=e.device, engine_cfg=replace(e, threads=threads))
        url = handle.url
    else:
        if not args.endpoint:
            raise UsageError("--policy endpoint needs --endpoint URL")
        url = args.endpoint
    client = EngineClient.from_config(cfg.engines, [url], role="policy")  # engines.api_key, timeouts, retries
    tokenizer = load_tokenizer(model)
    chooser = choice_policy_chooser(Policy.from_config(cfg.actors, client, tokenizer, temperature=args.temperature,
                                                            seed=cfg.infra.seed))

    async def cleanup() -> None:
        await client.close()
        if handle is not None:
            await handle.stop()

    return chooser, cleanup


def print_report(report: EvalReport) -> None:
    t = Table(title=f"dreamgym eval: {report.family}, policy {report.policy}")
    for col in ("episodes", "success", "95% CI", "mean steps", "invalid rate", "env errors", "seconds"):
        t.add_column(col, justify="right")
    t.add_row(str(report.episodes), f"{report.success_rate:.3f} ({report.successes})",
              f"[{report.ci_low:.3f}, {report.ci_high:.3f}]", f"{report.mean_steps:.2f}",
              f"{report.invalid_rate:.3f}", str(report.env_errors), f"{report.seconds:.1f}")
    Console().print(t)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    args.family = family_of(args, cfg)
    earlier = _earlier_report(args.compare_to) if args.compare_to else None
    if args.tasks:
        tasks = tasks_from_spec(args.family, args.tasks, cfg.data, seed=cfg.infra.seed)
    else:
        splits = load_or_make_splits(args.family, cfg.data, cfg.infra.data_dir, seed=cfg.infra.seed,
                                     need=(args.split, args.limit) if args.limit else None)
        tasks = splits.heldout if args.split == "heldout" else splits.train
    if args.limit:
        tasks = tasks[: args.limit]
    refused = [t for t in tasks if t.meta.get("refused")]  # bad game files: named now, never played
    for t in refused:
        print(f"refused: {t.meta['refused']}", flush=True)
    tasks = [t for t in tasks if not t.meta.get("refused")]

    iso = Isolation.from_config(cfg.actors)

    async def go() -> EvalReport:
        if args.policy in ("expert", "random", "noisy"):
            chooser, cleanup = PerTaskChooser(args.policy, seed=cfg.infra.seed, eps=cfg.data.noise_eps), None
        else:
            chooser, cleanup = await _engine_chooser(args, cfg)
        # A scripted chooser plays on data.workers environments; an engine policy on evaluation.concurrency,
        # as the driver's held-out evaluation does, so the engine sees batches.
        scripted = args.policy in ("expert", "random", "noisy")
        concurrency = cfg.data.workers if scripted else cfg.evaluation.concurrency
        with Progress(TextColumn(f"eval {args.policy}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.fields[won]} won"), console=Console(stderr=True)) as prog:
            bar = prog.add_task("episodes", total=len(tasks) * args.episodes, won=0)
            won = 0

            def on_episode(t: Trajectory) -> None:
                nonlocal won
                won += bool(t.success)
                prog.update(bar, advance=1, won=won)

            try:
                return await evaluate(chooser, tasks, args.family,
                                      max_steps=cfg.evaluation.max_steps or cfg.data.max_steps,
                                      episodes_per_task=args.episodes, concurrency=concurrency,
                                      policy_name=args.policy, isolation=iso, on_episode=on_episode)
            finally:
                if iso is not None:
                    iso.close()
                if cleanup is not None:
                    await cleanup()

    report = asyncio.run(go()) if tasks else summarize([], args.family, args.policy)
    report.bad_tasks = [{"task_id": t.task_id, "game_file": t.game_file, "reason": "refused_at_load",
                         "detail": str(t.meta["refused"])} for t in refused] + report.bad_tasks
    out = Path(args.out or Path(cfg.infra.run_dir) / "eval" / f"{args.family}-{args.policy}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = report.to_dict()
    if earlier is not None:
        doc["compared_to"] = {"report": args.compare_to, **paired_summary(doc["per_task"], earlier["per_task"])}
    out.write_text(json.dumps(doc, indent=1))
    print_report(report)
    if earlier is not None:
        c = doc["compared_to"]
        print(f"vs {args.compare_to}: {100 * c['diff']:+.1f} points [{100 * c['ci_low']:+.1f}, {100 * c['ci_high']:+.1f}] "
              f"paired over {c['tasks']} tasks; won {c['won']}, lost {c['lost']}")
    named: dict[tuple, int] = {}
    for b in report.bad_tasks:  # one line per task and reason, with its count of episodes
        k = (b["task_id"], b["game_file"], b["reason"], b["detail"])
        named[k] = named.get(k, 0) + 1
    for (task_id, game_file, reason, detail), n in named.items():
        print(f"bad task: {task_id} {game_file} ({reason}{', ' + str(n) + ' episodes' if n > 1 else ''})"
              + (f": {detail}" if detail else ""))
    print(f"report: {out}")
    return EXIT_BAD_TASKS if report.bad_tasks else 0
