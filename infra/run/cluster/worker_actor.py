"""The rollout worker as a Ray actor: a thin async wrapper, nothing else.

The actor builds its own Redis client (the run's URL, password included, and its TLS
CA), policy and environments inside its process from factories (plain callables
shipped by Ray when the actor is created), then runs
actors/rollout_worker.RolloutWorker on the actor's event loop. `stop` and `status`
calls arrive concurrently with `run` (an async actor). A killed actor's run call
fails; the pool (infra/run/workers.py) sees it through `exited()` and starts the worker again
under its id, which reads its own pending task back (see rollout_worker.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from typing import Any, Callable

import ray

from actors.rollout_worker import STATUS_COUNTERS, RolloutWorker
from infra.config import ActorsConfig
from infra.run.cluster.runtime import serve_actor_metrics
from infra.streams import DEFAULT_MAX_DELIVERIES, connect


@ray.remote
class RolloutWorkerActor:
    def __init__(self, worker_id: str, redis_url: str, prefix: str, actors_cfg: dict,
                 make_policy: Callable[[], Any], make_env: Callable[[], Any], buffer: Any = None,
                 reclaim_idle_ms: int = 30_000, maxlen: int = 100_000, redis_tls_ca: str = "",
                 max_deliveries: int = DEFAULT_MAX_DELIVERIES, handler_timeout_s: float = 0.0):
        self.args = (worker_id, redis_url, prefix, ActorsConfig(**actors_cfg), make_policy, make_env, buffer,
                     reclaim_idle_ms, maxlen, max_deliveries, handler_timeout_s)
        self.redis_tls_ca = redis_tls_ca
        self.worker: RolloutWorker | None = None
        self._stop_requested: bool | None = None

    async def run(self, max_groups: int | None = None) -> dict:
        worker_id, url, prefix, cfg, make_policy, make_env, buffer, idle_ms, maxlen, max_deliveries, deadline = self.args
        policy = make_policy()
        if inspect.isawaitable(policy):
            policy = await policy
        self.worker = RolloutWorker(worker_id, connect(url, self.redis_tls_ca), prefix, policy, make_env, cfg,
                                    buffer=buffer, reclaim_idle_ms=idle_ms, maxlen=maxlen,
                                    max_deliveries=max_deliveries, handler_timeout_s=deadline)
        if self._stop_requested is not None:
            return self.worker.status()
        await self.worker.run(max_groups)
        return self.worker.status()

    async def serve_metrics(self, host: str) -> str:
        """Serve this actor's own metrics (its episodes, steps, engine calls) on a free port; host:port."""
        return serve_actor_metrics(host)

    async def stop(self, drain: bool = True) -> dict:
        self._stop_requested = drain
        while self.worker is None:
            await asyncio.sleep(0.01)
        await self.worker.stop(drain=drain)
        return self.worker.status()

    async def status(self) -> dict:
        if self.worker is not None:
            return self.worker.status()
        # Still building its policy and environments: the same keys as a worker's status, all zero.
        return {"worker_id": self.args[0], **dict.fromkeys(STATUS_COUNTERS, 0), "inflight": 0,
                "stopping": self._stop_requested is not None, "starting": True}


class RayWorkerHandle:
    """The driver's view of one worker actor (the WorkerHandle of infra/run/workers.py)."""

    def __init__(self, worker_id: str, actor: Any, run_ref: Any):
        self.worker_id, self.actor, self.run_ref = worker_id, actor, run_ref

    @classmethod
    def spawn(cls, worker_id: str, redis_url: str, prefix: str, actors_cfg: ActorsConfig,
              make_policy: Callable[[], Any], make_env: Callable[[], Any], options: dict | None = None,
              buffer: Any = None, reclaim_idle_ms: int = 30_000, maxlen: int = 100_000,
              redis_tls_ca: str = "", max_deliveries: int = DEFAULT_MAX_DELIVERIES,
              handler_timeout_s: float = 0.0) -> "RayWorkerHandle":
        """Start the actor and its run loop; `buffer` is the worker's write-back sink (picklable) or None;
        `handler_timeout_s` is infra.handler_timeout_s, the task stream's handler deadline."""
        # named per run: two jobs on one cluster each have a w0
        actor = RolloutWorkerActor.options(name=f"rollout-{prefix}-{worker_id}", **(options or {})).remote(
            worker_id, redis_url, prefix, dataclasses.asdict(actors_cfg), make_policy, make_env, buffer,
            reclaim_idle_ms, maxlen, redis_tls_ca, max_deliveries, handler_timeout_s)
        return cls(worker_id, actor, actor.run.remote())

    async def stop(self, drain: bool = True) -> dict:
        status = await self.actor.stop.remote(drain)
        await self.run_ref
        ray.kill(self.actor)
        return status

    async def status(self) -> dict:
        return await self.actor.status.remote()

    def exited(self) -> bool:
        """Its run call has returned: the actor died (kill -9, a lost node) or its loop ended unasked."""
        ready, _ = ray.wait([self.run_ref], timeout=0)
        return bool(ready)

    def kill(self) -> None:
        """Kill the actor at once, as a node failure would."""
        ray.kill(self.actor, no_restart=True)
