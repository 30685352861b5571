"""Elastic rollout workers: the pool that grows and shrinks, and `dreamgym scale`.

Owns how many rollout workers run. The driver's `WorkerPool` watches a Redis control
key (`<prefix>:control:workers`); `dreamgym scale --workers N` sets it from any shell
that reaches the job's Redis. Growing spawns workers; shrinking stops the newest ones
with drain (they finish their in-flight groups) or, past `drain_timeout_s`, hands
their tasks back. Nothing is lost either way: a task is acked only after its group
was pushed (actors/rollout_worker.py).

The optional autoscale rule (`autoscale_target`) is a pure function of the task
stream's backlog and the engine queue depth: more waiting tasks than the workers can
take at once -> one more worker; no backlog and saturated engines -> one fewer
(more workers would only queue at the engines).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Awaitable, Callable, Protocol

import redis.asyncio as aioredis

from infra import metrics
from infra.streams import key, with_retry

log = logging.getLogger(__name__)


def desired_key(prefix: str) -> str:
    return key(prefix, "control:workers")


def alive_key(prefix: str) -> str:
    return key(prefix, "control:workers_alive")


class WorkerHandle(Protocol):
    worker_id: str

    async def stop(self, drain: bool = True) -> dict: ...

    async def status(self) -> dict: ...


class LocalWorkerHandle:
    """A RolloutWorker running as a task on this process's event loop (quickstart, tests)."""

    def __init__(self, worker):
        self.worker, self.worker_id = worker, worker.worker_id
        self.task = asyncio.create_task(worker.run())

    async def stop(self, drain: bool = True) -> dict:
        await self.worker.stop(drain=drain)
        await self.task
        return self.worker.status()

    async def status(self) -> dict:
        return self.worker.status()


def autoscale_target(current: int, backlog: int, queue_depth: float, slots_per_worker: int,
                     engine_capacity: int, lo: int = 1, hi: int = 8) -> int:
    """One step of the autoscale rule; returns the new worker count within [lo, hi]."""
    if backlog > current * slots_per_worker and queue_depth < engine_capacity:
        return min(hi, current + 1)
    if backlog == 0 and queue_depth >= engine_capacity and current > lo:
        return max(lo, current - 1)
    return max(lo, min(hi, current))


class WorkerPool:
    """Spawns and retires workers to match a target count."""

    def __init__(self, spawn: Callable[[str], WorkerHandle | Awaitable[WorkerHandle]], drain_timeout_s: float = 120.0):
        self.spawn_fn, self.drain_timeout_s = spawn, drain_timeout_s
        self.workers: list[WorkerHandle] = []
        self.retired: list[dict] = []
        self._next = 0

    def __len__(self) -> int:
        return len(self.workers)

    async def scale_to(self, n: int, drain: bool = True) -> None:
        while len(self.workers) < n:
            wid = f"w{self._next}"
            self._next += 1
            h = self.spawn_fn(wid)
            self.workers.append(await h if asyncio.iscoroutine(h) else h)  # type: ignore[arg-type]
            log.info("rollout worker %s started (%d running)", wid, len(self.workers))
        while len(self.workers) > n:
            h = self.workers.pop()
            try:
                status = await asyncio.wait_for(h.stop(drain=drain), self.drain_timeout_s)
            except asyncio.TimeoutError:
                log.warning("worker %s did not drain in %.0fs; handing its tasks back", h.worker_id, self.drain_timeout_s)
                status = await h.stop(drain=False)
            self.retired.append(status)
            log.info("rollout worker %s stopped (%d running)", h.worker_id, len(self.workers))
        metrics.ROLLOUT_WORKERS.set(len(self.workers))

    async def statuses(self) -> list[dict]:
        return [await h.status() for h in self.workers]

    async def watch(self, client: aioredis.Redis, prefix: str, stop_event: asyncio.Event, poll_s: float = 1.0,
                    autoscale: Callable[[int], Awaitable[int]] | None = None) -> None:
        """Follow the control key (and the autoscale rule, when given) until stop_event."""
        await with_retry(lambda: client.set(desired_key(prefix), len(self.workers), nx=True), "init worker target")
        while not stop_event.is_set():
            raw = await with_retry(lambda: client.get(desired_key(prefix)), "read worker target")
            target = int(raw) if raw is not None else len(self.workers)
            if autoscale is not None:
                target = await autoscale(target)
                await client.set(desired_key(prefix), target)
            if target != len(self.workers):
                await self.scale_to(target)
            await client.set(alive_key(prefix), len(self.workers))
            try:
                await asyncio.wait_for(stop_event.wait(), poll_s)
            except asyncio.TimeoutError:
                pass

    async def stop_all(self, drain: bool = False) -> None:
        await self.scale_to(0, drain=drain)


# ----- `dreamgym scale` -----
def add_arguments(p: argparse.ArgumentParser) -> None:
    from infra.cli import add_config_arguments

    add_config_arguments(p)
    p.add_argument("--workers", type=int, required=True, help="desired number of rollout workers")
    p.add_argument("--redis-url", default=None, help="the job's Redis (default: infra.redis_url, else the running job's)")
    p.add_argument("--prefix", default=None, help="the job's key prefix (default: the running job's, else infra.stream_prefix)")


async def _scale(url: str, prefix: str, n: int) -> tuple[int | None, int]:
    from infra.streams import connect

    client = connect(url)
    try:
        before = await client.get(alive_key(prefix))
        await client.set(desired_key(prefix), n)
        return (int(before) if before is not None else None), n
    finally:
        await client.aclose()


def run(args: argparse.Namespace) -> int:
    from infra.cli import config_from_args

    if args.workers < 0:
        print("dreamgym scale: --workers must be >= 0")
        return 2
    cfg = config_from_args(args)
    import json
    from pathlib import Path

    # The driver records the running job's Redis (an embedded one has no fixed URL) and key prefix.
    latest = Path(cfg.infra.run_dir) / "latest.json"
    job = json.loads(latest.read_text()) if latest.exists() else {}
    url = args.redis_url or cfg.infra.redis_url or job.get("redis_url", "")
    prefix = args.prefix or job.get("prefix") or cfg.infra.stream_prefix
    if not url:
        print("dreamgym scale: no Redis URL (give --redis-url or infra.redis_url; no running job recorded)")
        return 2
    before, after = asyncio.run(_scale(url, prefix, args.workers))
    print(f"rollout workers: {before if before is not None else '?'} -> {after} requested")
    return 0
