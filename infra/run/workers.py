"""Rollout workers: how one is built, and the elastic pool that runs them.

Owns worker construction, once for both runtimes: `make_policy` (a Policy on the
policy engines, seeded per worker) and `make_env_factory` (fresh synthetic
environments over one ExperienceModel per process, or real ones) are called by the
local path here (`local_spawner`, workers on the driver's event loop) and by each Ray
worker actor in its own process (infra/run/cluster/rollout_fleet.py). Nothing else
builds a worker's policy or environments.

Owns how many rollout workers run. `WorkerPool.running` starts the configured number
and watches a Redis control key (`<prefix>:control:workers`); `dreamgym scale
--workers N` (infra/run/scale.py) sets it from any shell that reaches the job's Redis.
Growing spawns workers; shrinking stops the newest ones with drain (they finish their
in-flight groups) or, past `drain_timeout_s`, hands their tasks back. Nothing is lost
either way: a task is acked only after its group was pushed (actors/rollout_worker.py).
A worker whose process dies (kill -9, a lost node) is started again under its id at the
next poll (`replace_exited`), and reads its own pending tasks back first.
Every resize is kept in `WorkerPool.history` (when, from how many to how many, why, and
how each stopped worker ended), which the driver writes into summary.json, and exported
as `rollout_pool_workers` / `rollout_pool_target_workers` (the workers dashboard).

The optional autoscale rule (`autoscale_target`, bound to a job by `Autoscaler`) is a
pure function of the task stream's backlog and the engines' queue depth (read from their
own /metrics, infra/engine/load.py, so it sees Ray and SGLang engines too): more waiting
tasks than the workers can take at once, and engines with room -> one more worker; one
worker fewer could still take every waiting task (the engines' fullness no longer matters:
more workers would only queue) -> one fewer, once that has held for `DOWN_PATIENCE` polls
in a row, so a backlog the curriculum is about to top up does not stop a worker it needs.
This is the queue-length rule of KEDA-style autoscalers (about one worker per `slots` waiting
tasks). The curriculum keeps about `curriculum.max_backlog` tasks waiting, so a run settles
where its workers take that many at once, or where the engines fill: that setting sizes the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
import zlib
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

import aiohttp
import redis.asyncio as aioredis

from actors.envs.env_process import Isolation
from actors.envs.registry import make_env
from actors.policy import Policy
from actors.rollout_worker import EnvFactory, RolloutWorker
from infra import metrics
from infra.config import Config, rl_seed
from infra.engine.load import max_queue_depth
from infra.stream_backlog import stream_backlog
from infra.streams import key, tasks_stream, with_retry
from simulator.synthetic_env import SyntheticEnv

log = logging.getLogger(__name__)


def desired_key(prefix: str) -> str:
    return key(prefix, "control:workers")


def alive_key(prefix: str) -> str:
    return key(prefix, "control:workers_alive")


def worker_seed(seed: int, worker_id: str) -> int:
    """The policy's sampling seed of one worker: stable across processes (unlike hash() of a str)."""
    return zlib.crc32(f"{seed}:{worker_id}".encode())


def make_policy(cfg: Config, policy_client: Any, tokenizer: Any, worker_id: str) -> Policy:
    """One worker's policy, in the configured action mode, sampling through the policy engines."""
    return Policy.from_config(cfg.actors, policy_client, tokenizer, seed=worker_seed(rl_seed(cfg.infra), worker_id))


def make_env_factory(cfg: Config, experience_model: Callable[[], Any]) -> EnvFactory:
    """Fresh environments for the workers of one process: synthetic ones share one ExperienceModel,
    built by `experience_model()` on first use, and take free text with `actors.free_text_actions`;
    real ones are `actors.env_family` environments."""
    if cfg.actors.env_kind != "synthetic":
        # one Isolation per process: its EnvProcesses share the crash book that refuses a task crashing again and again
        return functools.partial(make_env, cfg.actors.env_family, isolation=Isolation.from_config(cfg.actors),
                                 max_steps=cfg.actors.max_steps)
    mexp = None

    def synthetic() -> SyntheticEnv:
        nonlocal mexp
        if mexp is None:
            mexp = experience_model()
        return SyntheticEnv(mexp, cfg.simulator.max_steps, free_text=cfg.actors.free_text_actions)
    return synthetic


def write_back_sink(cfg: Config, buffer: Any) -> Any:
    """Where a worker writes its synthetic transitions: the replay buffer, or nowhere (write-back off, real envs)."""
    return buffer if cfg.simulator.write_back and cfg.actors.env_kind == "synthetic" else None


class WorkerHandle(Protocol):
    worker_id: str

    async def stop(self, drain: bool = True) -> dict: ...

    async def status(self) -> dict: ...

    def exited(self) -> bool: ...  # its run ended without a stop: the pool starts it again


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

    def exited(self) -> bool:
        """Its run loop ended without a stop (it raised)."""
        return self.task.done()


def local_spawner(cfg: Config, client: aioredis.Redis, prefix: str, policy_client: Any, tokenizer: Any,
                  env_factory: EnvFactory, buffer: Any) -> Callable[[str], LocalWorkerHandle]:
    """Workers on this event loop, sharing this process's engine clients, environments factory and buffer."""
    def spawn(worker_id: str) -> LocalWorkerHandle:
        return LocalWorkerHandle(RolloutWorker(
            worker_id, client, prefix, make_policy(cfg, policy_client, tokenizer, worker_id), env_factory, cfg.actors,
            buffer=write_back_sink(cfg, buffer), reclaim_idle_ms=cfg.infra.reclaim_idle_ms,
            maxlen=cfg.infra.stream_maxlen, max_deliveries=cfg.infra.max_deliveries,
            handler_timeout_s=cfg.infra.handler_timeout_s))
    return spawn


def autoscale_target(current: int, backlog: int, queue_depth: float, slots_per_worker: int,
                     engine_capacity: int, lo: int = 1, hi: int = 8) -> tuple[int, str]:
    """One step of the autoscale rule: (the new worker count within [lo, hi], what it saw)."""
    seen = (f"{backlog} task(s) waiting for {current} worker(s) x {slots_per_worker} slot(s), "
            f"engine queue {queue_depth:g}/{engine_capacity}")
    if backlog > current * slots_per_worker and queue_depth < engine_capacity and current < hi:
        return current + 1, f"autoscale up: {seen}"
    if current > lo and backlog <= (current - 1) * slots_per_worker:
        return current - 1, f"autoscale down: {seen}"
    bounded = max(lo, min(hi, current))
    return bounded, (f"autoscale within [{lo}, {hi}]: {seen}" if bounded != current else seen)


DOWN_PATIENCE = 5  # polls in a row (about 5 s) a shrink must be called for before the autoscaler makes it


class Autoscaler:
    """The `actors.autoscale` rule bound to a job: its task stream's backlog and the fullest of
    `engine_urls` (the policy and Mexp engines its workers call), against `engines.max_batch_size`.
    Grows at once; shrinks after DOWN_PATIENCE consecutive calls for it. `await rule(current)` ->
    (target, what it saw); `aclose()` ends its HTTP session."""

    def __init__(self, cfg: Config, client: aioredis.Redis, prefix: str, engine_urls: list[str]):
        self.client, self.prefix, self.engine_urls = client, prefix, list(engine_urls)
        self.slots = max(1, math.ceil(cfg.actors.concurrent_episodes / cfg.actors.group_size))
        self.capacity, self.hi = cfg.engines.max_batch_size, cfg.actors.autoscale_max_workers
        self.session: aiohttp.ClientSession | None = None  # made on first use, on the pool's event loop
        self.downs = 0

    async def __call__(self, current: int) -> tuple[int, str]:
        backlog = await stream_backlog(self.client, tasks_stream(self.prefix))
        depth = 0.0
        if self.engine_urls:
            self.session = self.session or aiohttp.ClientSession()
            depth = await max_queue_depth(self.session, self.engine_urls)
        target, why = autoscale_target(current, backlog, depth, self.slots, self.capacity, lo=1, hi=self.hi)
        self.downs = self.downs + 1 if target < current else 0
        if target < current and self.downs < DOWN_PATIENCE:
            return current, why
        self.downs = 0
        return target, why

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None


MAX_HISTORY = 1000  # resize events kept per pool (the oldest go first; `history_dropped` counts them)


def _exited(h: WorkerHandle) -> bool:
    """True when the worker's run ended without a stop (handles without `exited` never say so)."""
    exited = getattr(h, "exited", None)
    return bool(exited()) if exited is not None else False


class WorkerPool:
    """Spawns and retires workers to match a target count, keeping a history of every resize."""

    def __init__(self, spawn: Callable[[str], WorkerHandle | Awaitable[WorkerHandle]], drain_timeout_s: float = 120.0,
                 on_stop: Callable[[str], None] | None = None):
        """`on_stop(worker_id)` runs after a worker stopped (the driver takes it off the scrape targets)."""
        self.spawn_fn, self.drain_timeout_s, self.on_stop = spawn, drain_timeout_s, on_stop
        self.workers: list[WorkerHandle] = []
        self.retired: list[dict] = []
        self.history: list[dict] = []  # {"at", "from", "to", "reason"[, "stopped"]}, oldest first
        self.history_dropped = 0
        self.target: int | None = None  # the target this pool last followed (the control key's value)
        self._next = 0
        self.closed = False  # set by `retire`: no worker starts again, whatever the control key says
        self._scaling = asyncio.Lock()

    def __len__(self) -> int:
        return len(self.workers)

    async def scale_to(self, n: int, drain: bool = True, reason: str = "") -> None:
        async with self._scaling:  # the watcher and `retire` may both resize
            await self._scale_to(n, drain, reason)

    async def _scale_to(self, n: int, drain: bool, reason: str) -> None:
        if self.closed:
            n = 0
        before, stopped = len(self.workers), []
        while len(self.workers) < n:
            wid = f"w{self._next}"
            self._next += 1
            h = self.spawn_fn(wid)
            self.workers.append(await h if asyncio.iscoroutine(h) else h)  # type: ignore[arg-type]
            metrics.ROLLOUT_SCALE_EVENTS.labels(direction="up").inc()
            log.info("rollout worker %s started (%d running)", wid, len(self.workers))
        while len(self.workers) > n:
            h = self.workers.pop()
            stopped.append(await self._stop_one(h, drain))
        metrics.ROLLOUT_POOL_WORKERS.set(len(self.workers))
        if len(self.workers) != before:
            self._record({"at": round(time.time(), 3), "from": before, "to": len(self.workers),
                          "reason": reason or "resize", **({"stopped": stopped} if stopped else {})})

    async def _stop_one(self, h: WorkerHandle, drain: bool) -> dict:
        """Stop one worker: drained (its in-flight groups finish and push), or its tasks handed back
        (no drain asked, or the drain took over `drain_timeout_s`); returns how it ended."""
        inflight = None
        with contextlib.suppress(Exception):  # a dead worker has no status: it is stopped all the same
            inflight = (await asyncio.wait_for(h.status(), 10)).get("inflight")
        how = "drained" if drain else "handed back"
        try:
            status = await asyncio.wait_for(h.stop(drain=drain), self.drain_timeout_s)
        except asyncio.TimeoutError:
            log.warning("worker %s did not drain in %.0fs; handing its tasks back", h.worker_id, self.drain_timeout_s)
            status, how = await h.stop(drain=False), "handed back"
        except Exception as exc:  # its process died (kill -9, a lost node): its tasks are reclaimed by the others
            if not _exited(h):
                raise
            log.warning("worker %s was gone already (%s)", h.worker_id, type(exc).__name__)
            status, how = {"worker_id": h.worker_id}, "gone"
        self.retired.append(status)
        metrics.ROLLOUT_SCALE_EVENTS.labels(direction="down").inc()
        if self.on_stop is not None:
            self.on_stop(h.worker_id)
        log.info("rollout worker %s stopped (%s; %d running)", h.worker_id, how, len(self.workers))
        return {"worker": h.worker_id, "inflight": inflight, "how": how,
                "trajectories_pushed": status.get("trajectories_pushed")}

    def _record(self, event: dict) -> None:
        self.history.append(event)
        if len(self.history) > MAX_HISTORY:
            del self.history[0]
            self.history_dropped += 1

    def report(self) -> dict:
        """What summary.json keeps of this pool: its resizes, the most workers it ran, how many it retired."""
        sizes = [e["to"] for e in self.history] + [e["from"] for e in self.history]
        return {"history": list(self.history), "history_dropped": self.history_dropped,
                "max_workers": max(sizes, default=len(self.workers)), "workers_started": self._next}

    def _follow(self, target: int, cause: str) -> None:
        self.target = target
        metrics.ROLLOUT_POOL_TARGET.set(target)
        if cause:
            metrics.ROLLOUT_POOL_RESIZES.labels(cause=cause).inc()

    async def statuses(self) -> list[dict]:
        return [await h.status() for h in self.workers]

    async def replace_exited(self) -> list[str]:
        """Start again every worker whose run ended unasked (its process was killed, or its loop raised),
        under the same id: a consumer of the same name reads its own pending tasks back first, so the
        killed worker's groups are played again at once, not after the reclaim idle time. Called by
        `watch` every poll; returns the ids replaced."""
        async with self._scaling:
            replaced = []
            for i, h in enumerate(self.workers):
                if self.closed or not _exited(h):
                    continue
                log.warning("rollout worker %s exited unasked; starting it again", h.worker_id)
                try:
                    fresh = self.spawn_fn(h.worker_id)
                    fresh = await fresh if asyncio.iscoroutine(fresh) else fresh
                except ValueError:  # the dead actor's name is not released yet: a new id (the others reclaim)
                    fresh = self.spawn_fn(f"w{self._next}")
                    self._next += 1
                    fresh = await fresh if asyncio.iscoroutine(fresh) else fresh
                self.workers[i] = fresh  # type: ignore[assignment]
                replaced.append(h.worker_id)
            if replaced:
                self._record({"at": round(time.time(), 3), "from": len(self.workers), "to": len(self.workers),
                              "reason": f"replaced {', '.join(replaced)}: exited unasked"})
            return replaced

    async def watch(self, client: aioredis.Redis, prefix: str, stop_event: asyncio.Event, poll_s: float = 1.0,
                    autoscale: Callable[[int], Awaitable[tuple[int, str]]] | None = None) -> None:
        """Follow the control key (and the autoscale rule, when given) until stop_event. A control key that
        changed since this pool last set or read it is a `dreamgym scale`; the rule then moves on from there."""
        await with_retry(lambda: client.set(desired_key(prefix), len(self.workers), nx=True), "init worker target")
        if self.target is None:
            self._follow(len(self.workers), "")
        while not stop_event.is_set():
            raw = await with_retry(lambda: client.get(desired_key(prefix)), "read worker target")
            target = int(raw) if raw is not None else len(self.workers)
            if self.closed:
                break
            await self.replace_exited()
            reason = ""
            if target != self.target:
                reason = f"dreamgym scale --workers {target}"
                self._follow(target, "command")
            if autoscale is not None:
                wanted, why = await autoscale(target)
                if wanted != target:
                    target, reason = wanted, why
                    await with_retry(lambda: client.set(desired_key(prefix), target), "set worker target")
                    self._follow(target, "autoscale")
            if target != len(self.workers):
                await self.scale_to(target, reason=reason or f"target {target}")
            await with_retry(lambda: client.set(alive_key(prefix), len(self.workers)), "report live workers")
            try:
                await asyncio.wait_for(stop_event.wait(), poll_s)
            except asyncio.TimeoutError:
                pass

    async def stop_all(self, drain: bool = False, reason: str = "") -> None:
        await self.scale_to(0, drain=drain, reason=reason)

    async def retire(self, reason: str = "retired") -> None:
        """Stop every worker for good, letting in-flight groups finish and push (a spent real budget:
        their remaining steps end at once, and what they already took still trains)."""
        self.closed = True
        await self.stop_all(drain=True, reason=reason)

    @contextlib.asynccontextmanager
    async def running(self, client: aioredis.Redis, prefix: str, n: int,
                      autoscale: Callable[[int], Awaitable[tuple[int, str]]] | None = None) -> AsyncIterator["WorkerPool"]:
        """`n` workers that follow `dreamgym scale` (and `autoscale`) until the block ends; then all stop
        without drain (their unfinished tasks are handed back)."""
        await self.scale_to(n, reason=f"start: actors.num_workers={n}")
        await with_retry(lambda: client.set(desired_key(prefix), n), "set worker target")
        self._follow(n, "")
        stop = asyncio.Event()
        watcher = asyncio.create_task(self.watch(client, prefix, stop, autoscale=autoscale))
        try:
            yield self
        finally:
            stop.set()
            await watcher
            await self.stop_all(drain=False, reason="phase end")
            if isinstance(autoscale, Autoscaler):
                await autoscale.aclose()
