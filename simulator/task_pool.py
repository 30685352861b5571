"""The curriculum's task pool: seed tasks plus validated Mtask variants, with lineage.

Owns where tasks live and who begat whom, nothing about which to pick (that is
simulator/curriculum.py). The pool is one Redis hash `<prefix>:curriculum:pool`
(task_id -> schema-encoded Task), so a restarted scheduler, the `dreamgym tasks`
command and any other process see the same pool; a local dict mirrors it. The
scheduler's counters (batches and tasks pushed, generated ones among them) live
beside it in `<prefix>:curriculum:counters` so the share of generated tasks over a
whole run can be read back.

Also the `dreamgym tasks` command: the pool as a rich table (or --json) with each
task's statistics (n, mean reward, V_tau) and lineage, and how the run spread its
groups over the seeds (played, at most on one) and the variants. It reads a live job's
Redis, or with `--run DIR` a finished run's, served from a copy of its append-only files
(infra/redis_server.py `run_snapshot`; the run's own files are never opened for writing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path
from typing import Iterable

import redis.asyncio as aioredis
from rich.console import Console
from rich.table import Table

from infra import metrics
from infra.config import ConfigError, add_config_arguments, config_from_args, load_config
from infra.redis_server import read_job_record, run_snapshot
from infra.schema import SchemaError, Task, decode_as, encode
from infra.streams import connect, key, ping, run_prefix, with_retry
from infra.task_stats import TaskStatsStore

log = logging.getLogger(__name__)


def pool_key(prefix: str) -> str:
    return key(prefix, "curriculum:pool")


def counters_key(prefix: str) -> str:
    return key(prefix, "curriculum:counters")


class PoolFull(RuntimeError):
    """The pool already holds max_pool tasks."""


class TaskPool:
    """Seed tasks and generated variants, mirrored from one Redis hash."""

    def __init__(self, client: aioredis.Redis, prefix: str, max_pool: int = 1000):
        self.client, self.prefix, self.max_pool = client, prefix, max_pool
        self.key = pool_key(prefix)
        self.tasks: dict[str, Task] = {}

    async def load(self) -> dict[str, Task]:
        """Read the whole pool from Redis; an undecodable entry is logged and skipped, never deleted."""
        raw = await with_retry(lambda: self.client.hgetall(self.key), "read task pool")
        tasks = {}
        for tid, data in raw.items():
            tid = tid.decode() if isinstance(tid, bytes) else tid
            try:
                tasks[tid] = decode_as(data, Task)
            except SchemaError as exc:
                log.error("task %s in the pool does not decode (%s); left in Redis, not used", tid, exc)
        self.tasks = tasks
        self._export_metrics()
        return tasks

    async def add(self, tasks: Iterable[Task]) -> list[Task]:
        """Add tasks not already present; raises PoolFull before adding any generated task past max_pool."""
        new = [t for t in tasks if t.task_id not in self.tasks]
        if not new:
            return []
        if any(t.generated for t in new) and len(self.tasks) + len(new) > self.max_pool:
            raise PoolFull(f"pool holds {len(self.tasks)} tasks; max_pool is {self.max_pool}")
        mapping = {t.task_id: encode(t) for t in new}
        await with_retry(lambda: self.client.hset(self.key, mapping=mapping), "add to task pool")
        for t in new:
            self.tasks[t.task_id] = t
        self._export_metrics()
        return new

    async def replace_all(self, tasks: Iterable[Task]) -> None:
        """Make the pool exactly `tasks` (restoring a checkpoint)."""
        tasks = list(tasks)

        async def op() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(self.key)
            if tasks:
                pipe.hset(self.key, mapping={t.task_id: encode(t) for t in tasks})
            await pipe.execute()

        await with_retry(op, "restore task pool")
        self.tasks = {t.task_id: t for t in tasks}
        self._export_metrics()

    def seeds(self) -> list[Task]:
        return [t for t in self.tasks.values() if not t.generated]

    def generated(self) -> list[Task]:
        return [t for t in self.tasks.values() if t.generated]

    def children(self, parent_id: str) -> list[Task]:
        return [t for t in self.tasks.values() if t.parent_id == parent_id]

    def lineage(self, task_id: str) -> list[str]:
        """Ancestor ids from the task up to its root seed (cycles cut)."""
        chain, seen = [], set()
        tid = task_id
        while tid and tid not in seen:
            seen.add(tid)
            chain.append(tid)
            t = self.tasks.get(tid)
            tid = t.parent_id if t else ""
        return chain

    def __len__(self) -> int:
        return len(self.tasks)

    def __contains__(self, task_id: str) -> bool:
        return task_id in self.tasks

    def _export_metrics(self) -> None:
        g = sum(1 for t in self.tasks.values() if t.generated)
        metrics.CURRICULUM_POOL_SIZE.labels("seed").set(len(self.tasks) - g)
        metrics.CURRICULUM_POOL_SIZE.labels("generated").set(g)


# --- `dreamgym tasks` ---

def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--json", action="store_true", help="print the pool as JSON instead of a table")
    p.add_argument("--limit", type=int, default=50, help="most rows in the table (default: %(default)s; 0 = all)")
    p.add_argument("--sort", choices=("variance", "n", "id", "lineage"), default="variance",
                   help="row order (default: %(default)s)")
    p.add_argument("--prefix", default="", help="Redis key prefix of the run (default: the latest run's, from "
                                                "<run_dir>/latest.json, else infra.stream_prefix)")
    p.add_argument("--run", default="", metavar="DIR",
                   help="a finished or stopped run's directory (runs/<name>, or runs/<experiment>/<regime>): read "
                        "its pool from a copy of its Redis append-only files, with the config it ran with")


async def pool_report(client: aioredis.Redis, prefix: str) -> dict:
    """The pool with statistics and lineage, plus the run's push counters, as plain data."""
    pool = TaskPool(client, prefix)
    await pool.load()
    stats = await TaskStatsStore(client, prefix).get_many(sorted(pool.tasks))
    counters = {k.decode(): float(v) for k, v in (await client.hgetall(counters_key(prefix))).items()}
    rows = []
    for tid, t in pool.tasks.items():
        s = stats[tid]
        rows.append({"task_id": tid, "origin": "generated" if t.generated else "seed", "parent_id": t.parent_id,
                     "lineage": pool.lineage(tid), "family": t.family, "n": s.n, "groups": s.groups,
                     "mean": round(s.mean, 4), "v_tau": round(s.group_variance, 4), "instruction": t.instruction})
    pushed = counters.get("pushed", 0.0)
    return {"prefix": prefix, "size": len(rows), "seeds": sum(r["origin"] == "seed" for r in rows),
            "generated": sum(r["origin"] == "generated" for r in rows), "counters": counters,
            "generated_share_pushed": (counters.get("generated_pushed", 0.0) / pushed) if pushed else 0.0,
            "spread": {origin: group_spread([r for r in rows if r["origin"] == origin])
                       for origin in ("seed", "generated")},
            "tasks": rows}


def group_spread(rows: list[dict]) -> dict:
    """How a run's finished groups fell on these tasks: how many tasks got one, in all, at most on one."""
    groups = [r["groups"] for r in rows]
    return {"played": sum(g > 0 for g in groups), "groups": sum(groups), "max_on_one": max(groups, default=0)}


def _sorted_rows(rows: list[dict], how: str) -> list[dict]:
    if how == "n":
        return sorted(rows, key=lambda r: (-r["n"], r["task_id"]))
    if how == "id":
        return sorted(rows, key=lambda r: r["task_id"])
    if how == "lineage":
        return sorted(rows, key=lambda r: (list(reversed(r["lineage"])), r["task_id"]))
    return sorted(rows, key=lambda r: (-r["v_tau"], -r["n"], r["task_id"]))


def render_table(report: dict, sort: str = "variance", limit: int = 50):
    """A rich Table of the pool (returned, not printed, so tests can render it)."""
    share = report["generated_share_pushed"]
    c = report["counters"]
    seed, gen = report["spread"]["seed"], report["spread"]["generated"]
    table = Table(title=f"task pool {report['prefix']}: {report['seeds']} seed + {report['generated']} generated; "
                        f"{int(c.get('pushed', 0))} tasks pushed in {int(c.get('batches', 0))} batches, "
                        f"{share:.0%} generated; groups: {seed['groups']} on {seed['played']} seeds (at most "
                        f"{seed['max_on_one']} on one), {gen['groups']} on {gen['played']} variants (at most "
                        f"{gen['max_on_one']})")
    for col, kw in (("task", {}), ("origin", {}), ("parent", {}), ("depth", {"justify": "right"}),
                    ("n", {"justify": "right"}), ("mean", {"justify": "right"}), ("V_tau", {"justify": "right"}),
                    ("instruction", {"overflow": "fold"})):
        table.add_column(col, **kw)
    rows = _sorted_rows(report["tasks"], sort)
    for r in rows[:limit] if limit else rows:
        table.add_row(r["task_id"], r["origin"], r["parent_id"] or "-", str(len(r["lineage"]) - 1), str(r["n"]),
                      f"{r['mean']:.2f}", f"{r['v_tau']:.3f}", r["instruction"][:90])
    return table


def run(args: argparse.Namespace) -> int:
    if args.run:
        return _run_finished(args)
    cfg = config_from_args(args)
    url, prefix = cfg.infra.redis_url, args.prefix
    if not url or not prefix:  # the latest `dreamgym train` job (infra/redis_server.py keeps its record)
        info = read_job_record(cfg.infra.run_dir, with_password=not url)
        url, prefix = url or info.get("redis_url", ""), prefix or info.get("prefix", "")
    prefix = prefix or cfg.infra.stream_prefix
    if not url:
        print("dreamgym tasks: the pool lives in the run's Redis; give its URL, e.g. "
              "`dreamgym tasks configs/quickstart.yaml infra.redis_url=redis://127.0.0.1:6379/0`")
        return 2

    _print(args, asyncio.run(_report(url, prefix, cfg.infra.redis_tls_ca)))
    return 0


def _run_finished(args: argparse.Namespace) -> int:
    run_dir = Path(args.run)
    if args.config and "=" not in args.config:
        raise ConfigError(f"--run {run_dir} takes the config the run wrote there; drop {args.config}")
    overrides = [args.config] if args.config else []
    cfg = load_config(run_dir, overrides + list(args.overrides or []))
    prefix = args.prefix or run_prefix(cfg.infra.stream_prefix, run_dir.resolve().name)
    with run_snapshot(run_dir) as url:
        _print(args, asyncio.run(_report(url, prefix, "")))
    return 0


async def _report(url: str, prefix: str, tls_ca: str) -> dict:
    client = connect(url, tls_ca)
    try:
        await ping(client, url)
        return await pool_report(client, prefix)
    finally:
        await client.aclose()


def _print(args: argparse.Namespace, report: dict) -> None:
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        Console().print(render_table(report, args.sort, args.limit))
    return 0
