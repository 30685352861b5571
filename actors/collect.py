"""`dreamgym collect`: offline trajectories from real environments.

Owns offline collection: the expert, ε-noisy expert and random choosers
(actors/envs/expert.py) run over the train tasks, in parallel worker processes
(`data.workers`; one environment, and for MiniWoB one browser, per process), and
write wire-schema Trajectory records (env_kind=REAL) to
`<data_dir>/offline/<family>/trajectories.msgpack`; the task splits go to
`<data_dir>/<family>/splits.json`. This dataset seeds the replay buffer and is the
SFT data of Mexp.

Every step's `reasoning` is the environment's own account of the state change
(TextWorld facts diff: "env-facts"; MiniWoB element diff: "env-dom-diff"). With
`data.teacher_endpoint` set, a teacher LLM behind an OpenAI-compatible API rewrites
each rationale from (state, action, next state, env rationale) and the step records
"teacher"; a failed teacher call keeps the env rationale and its source.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from actors.dataset import offline_settings, splits_path, trajectories_path, write_stamp, write_trajectories
from actors.envs.env_process import Isolation
from actors.envs.expert import make_chooser
from actors.envs.miniwob_env import browsers_that_fit
from actors.envs.registry import add_family_argument, family_of, load_or_make_splits, make_env
from actors.episode import run_episode
from infra.config import ConfigError, add_config_arguments, config_from_args
from infra.schema import Status, Task, Trajectory, decode_as, encode, from_fields

log = logging.getLogger(__name__)


def _collect_one_task(family: str, task_d: dict, policies: list[str], episodes: int, eps: float, max_steps: int,
                      seed: int, isolation: dict | None = None) -> list[bytes]:
    """Worker-process entry: every (policy, episode) of one task on one fresh environment
    (`isolation`: Isolation's settings; the environment runs in a child of this worker process)."""
    task = from_fields(Task, task_d)

    async def go() -> list[bytes]:
        env = make_env(family, isolation=iso, max_steps=max_steps)
        out = []
        try:
            for p_i, policy in enumerate(policies):
                for e in range(episodes):
                    chooser = make_chooser(policy, seed=seed * 1_000_003 + task.seed * 101 + p_i * 13 + e, eps=eps)
                    traj = await run_episode(env, task, chooser, max_steps, worker_id=f"collect-{policy}",
                                             group_id=f"{task.task_id}-{policy}")
                    traj.timings["policy_name"] = policy  # which collection policy wrote it
                    out.append(encode(traj))
        finally:
            await env.close()
        return out

    iso = Isolation(**isolation) if isolation is not None else None
    try:
        return asyncio.run(go())
    finally:
        if iso is not None:
            iso.close()


def collect(family: str, tasks: list[Task], policies: list[str], episodes: int, eps: float, max_steps: int,
            workers: int, seed: int = 0, progress: Any = None, isolation: Isolation | None = None,
            bad_tasks: list | None = None) -> list[Trajectory]:
    """Collect in `workers` processes; returns the trajectories in task order. Episodes whose environment
    crashed, hung or was refused (env_error) are left out; `bad_tasks` (a list) gets one entry per such task."""
    iso = None if isolation is None else {"step_timeout_s": isolation.step_timeout_s,
                                          "max_crashes": isolation.max_crashes}
    results: dict[int, list[Trajectory]] = {}
    ctx = mp.get_context("spawn")  # selenium and TextWorld threads do not survive fork
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(tasks) or 1)), mp_context=ctx) as pool:
        futs = {pool.submit(_collect_one_task, family, asdict(t), policies, episodes, eps, max_steps, seed, iso): i
                for i, t in enumerate(tasks)}
        for fut in as_completed(futs):
            i = futs[fut]
            try:
                results[i] = [decode_as(b, Trajectory) for b in fut.result()]
            except Exception as exc:  # one task's env failing to start must not lose the others' data
                log.error("collection on task %s failed: %s: %s", tasks[i].task_id, type(exc).__name__, str(exc)[:300])
                results[i] = []
            if progress is not None:
                progress(len(results[i]) or len(policies) * episodes)
    if bad_tasks is not None:
        for i in sorted(results):
            reasons = sorted({str(t.timings.get("env_error", "env_exception")) for t in results[i]
                              if t.status == Status.ENV_ERROR})
            if reasons or not results[i]:
                bad_tasks.append({"task_id": tasks[i].task_id, "game_file": tasks[i].game_file,
                                  "reason": ",".join(reasons) or "failed"})
    # An episode whose env crashed before its first step has nothing to learn from.
    return [t for i in sorted(results) for t in results[i] if t.steps]


def _openai_client_class() -> Any:
    """openai.AsyncOpenAI, or a ConfigError saying how to install it (checked before collecting, too)."""
    try:
        from openai import AsyncOpenAI  # optional: only a teacher endpoint needs it (the `teacher` extra)
    except ImportError as exc:
        raise ConfigError("data.teacher_endpoint is set, which needs the openai client: "
                          "pip install 'dreamgym[teacher]' (or leave data.teacher_endpoint empty)") from exc
    return AsyncOpenAI


async def _teacher_rationales(trajs: list[Trajectory], endpoint: str, model: str, concurrency: int = 4,
                              timeout_s: float = 300.0) -> tuple[int, list[str]]:
    """Rewrite rationales with a teacher LLM; returns (steps it wrote, errors of the calls that failed)."""
    client = _openai_client_class()(base_url=endpoint, api_key="none", timeout=timeout_s, max_retries=1)
    sem = asyncio.Semaphore(concurrency)
    written = 0
    errors: list[str] = []

    async def one(step: Any) -> None:
        nonlocal written
        prompt = (f"State:\n{step.state}\n\nAction: {step.action}\n\nNext state:\n{step.next_state}\n\n"
                  f"Observed change: {step.reasoning}\n\nIn one or two sentences, explain causally why the action "
                  "led to the next state and whether it moved toward the goal.")
        async with sem:
            try:
                r = await client.chat.completions.create(model=model or "teacher", max_tokens=96, temperature=0.2,
                                                         messages=[{"role": "user", "content": prompt}])
                text = (r.choices[0].message.content or "").strip()
            except Exception as exc:  # keep the env rationale and its source; say so at the end
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
                return
        if text:
            step.reasoning, step.reasoning_source = text, "teacher"
            written += 1

    await asyncio.gather(*(one(s) for t in trajs for s in t.steps))
    await client.close()
    return written, errors


def summary_rows(trajs: list[Trajectory]) -> list[dict]:
    by: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        by[str(t.timings.get("policy_name", "?"))].append(t)
    rows = []
    for name, ts in by.items():
        n_steps = sum(len(t.steps) for t in ts)
        rows.append({"policy": name, "episodes": len(ts), "transitions": n_steps,
                     "success": sum(t.success for t in ts) / len(ts) if ts else 0.0,
                     "invalid": sum(not s.valid for t in ts for s in t.steps) / n_steps if n_steps else 0.0})
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    add_family_argument(p)
    p.add_argument("--out", default="", help="data directory to write into (default: infra.data_dir)")
    p.add_argument("--limit", type=int, default=0, help="collect on the first N train tasks only (0 = all)")
    p.add_argument("--rebuild-splits", action="store_true", help="regenerate the task splits even if splits.json exists")


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    args.family = family_of(args, cfg)
    if cfg.data.teacher_endpoint:
        _openai_client_class()  # fail now, not after the collection
    data_dir = Path(args.out or cfg.infra.data_dir)
    console = Console()
    t0 = time.perf_counter()
    with console.status(f"preparing {args.family} tasks"):
        splits = load_or_make_splits(args.family, cfg.data, data_dir, seed=cfg.infra.seed, rebuild=args.rebuild_splits)
    tasks = splits.train[: args.limit] if args.limit else splits.train
    console.print(f"{len(splits.train)} train / {len(splits.heldout)} held-out tasks ({time.perf_counter() - t0:.1f} s); "
                  f"splits: {splits_path(data_dir, args.family)}")
    policies = list(cfg.data.policies)
    workers = cfg.data.workers
    if args.family in ("miniwob", "browsergym"):  # browsers per worker process; size the pool by memory
        workers = min(workers, browsers_that_fit())
    total = len(tasks) * len(policies) * cfg.data.episodes_per_task
    tenth, done = max(1, total // 10), 0

    def advance(n: int) -> None:  # the live bar; where none can show (a log file, CI), a line each tenth
        nonlocal done
        prog.advance(bar, n)
        before, done = done, done + n
        if not console.is_terminal and (done // tenth > before // tenth or done == total):
            console.print(f"collect: {done}/{total} episodes ({time.perf_counter() - t0:.0f} s)")

    with Progress(TextColumn("collect"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console) as prog:
        bar = prog.add_task("episodes", total=total)
        bad: list[dict] = []
        trajs = collect(args.family, tasks, policies, cfg.data.episodes_per_task, cfg.data.noise_eps,
                        cfg.data.max_steps, workers, seed=cfg.infra.seed, progress=advance,
                        isolation=Isolation.from_config(cfg.actors), bad_tasks=bad)
    if cfg.data.teacher_endpoint:
        n, errors = asyncio.run(_teacher_rationales(trajs, cfg.data.teacher_endpoint, cfg.data.teacher_model,
                                                    timeout_s=cfg.engines.request_timeout_s))
        console.print(f"teacher wrote {n} rationales; {len(errors)} calls failed (kept the env rationale)"
                      + (f", first: {errors[0]}" if errors else ""))
    if len(trajs) < total:
        console.print(f"[yellow]{total - len(trajs)} episodes produced no steps (environment errors; see the log)[/yellow]")
    out = trajectories_path(data_dir, args.family)
    write_trajectories(out, trajs)
    write_stamp(out, {**offline_settings(args.family, cfg.data, cfg.infra.seed), "limit": args.limit})
    table = Table(title=f"dreamgym collect: {args.family} ({time.perf_counter() - t0:.1f} s)")
    for col in ("policy", "episodes", "transitions", "success", "invalid rate"):
        table.add_column(col, justify="right")
    for r in summary_rows(trajs):
        table.add_row(r["policy"], str(r["episodes"]), str(r["transitions"]), f"{r['success']:.3f}", f"{r['invalid']:.3f}")
    console.print(table)
    console.print(f"trajectories: {out}")
    for b in bad:  # named, after the rest were collected and written
        console.print(f"bad task: {b['task_id']} {b['game_file']} ({b['reason']})", markup=False)
    return 0
