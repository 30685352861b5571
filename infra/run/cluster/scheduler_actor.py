"""The curriculum scheduler as a Ray actor: a thin async wrapper, nothing else.

The actor builds its Redis client (the run's URL, password included, and its TLS CA)
and (optionally) its Mtask variant source inside its own process, the variant source from a factory (a plain callable shipped by Ray,
which may return an awaitable: it usually opens an EngineClient and loads a
tokenizer), then runs simulator/curriculum.CurriculumScheduler on the actor's event
loop. Tasks cross the wire schema-encoded; `state_dict` is plain data the learner
saves in its checkpoints and hands back to `load_state_dict` on --resume.

`CurriculumHandle` is the driver's view of the actor with the CurriculumScheduler methods
`dreamgym train` uses (so `actors.runtime=ray` changes nothing in the driver's loop), and
`VariantSource` is the factory of its Mtask variant source, built in the actor's process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from typing import Any, Callable

import ray

from infra.config import Config, CurriculumConfig
from infra.engine.client import EngineClient
from infra.engine.models import load_tokenizer
from infra.run.artifacts import embedding_cache
from infra.run.cluster.runtime import serve_actor_metrics
from infra.schema import Task, decode_as, encode
from infra.streams import connect
from simulator.curriculum import CurriculumScheduler
from simulator.embedder import Embedder
from simulator.task_variants import TaskVariantGenerator


@ray.remote
class SchedulerActor:
    def __init__(self, redis_url: str, prefix: str, curriculum_cfg: dict, seeds: list[bytes],
                 make_variants: Callable[[], Any] | None = None, seed: int = 0, stream_maxlen: int = 100_000,
                 limit: int | None = None, redis_tls_ca: str = ""):
        self.args = (redis_url, prefix, CurriculumConfig(**curriculum_cfg), [decode_as(s, Task) for s in seeds],
                     make_variants, seed, stream_maxlen, limit)
        self.redis_tls_ca = redis_tls_ca
        self.scheduler: CurriculumScheduler | None = None
        self._stop = asyncio.Event()
        self._lock = asyncio.Lock()

    async def _ready(self) -> CurriculumScheduler:
        async with self._lock:
            if self.scheduler is None:
                url, prefix, cfg, seeds, make_variants, seed, maxlen, limit = self.args
                variants = make_variants() if make_variants is not None and cfg.enabled else None
                if inspect.isawaitable(variants):
                    variants = await variants
                self.scheduler = CurriculumScheduler(connect(url, self.redis_tls_ca), cfg, prefix, seeds, variants, seed,
                                                     maxlen, limit)
                await self.scheduler.start()
            return self.scheduler

    async def run(self) -> dict:
        """Push task batches until stop() (or the limit); returns the final status. Runs again after a
        stop (a run's next RL phase): each run has its own stop event, made before anything awaits."""
        self._stop = stop = asyncio.Event()
        sched = await self._ready()
        await sched.run(stop)
        return await self.status()

    async def set_real_only(self, real_only: bool) -> None:
        """Hand out only tasks with a real counterpart (a real-environment phase)."""
        (await self._ready()).real_only = real_only

    async def set_real_selection(self, rule: str) -> None:
        """How a real phase picks its tasks (learner.s2r_selection in sim-to-real, else 'curriculum')."""
        (await self._ready()).real_selection = rule

    async def stop(self) -> None:
        self._stop.set()

    async def serve_metrics(self, host: str) -> str:
        """Serve this actor's own metrics (pool size, generated share, V_tau) on a free port; host:port."""
        return serve_actor_metrics(host)

    async def next_batch(self) -> list[bytes]:
        return [encode(t) for t in await (await self._ready()).next_batch()]

    async def generate_round(self) -> list[bytes]:
        return [encode(t) for t in await (await self._ready()).generate_round()]

    async def state_dict(self) -> dict:
        return (await self._ready()).state_dict()

    async def load_state_dict(self, state: dict) -> None:
        await (await self._ready()).load_state_dict(state)

    async def status(self) -> dict:
        s = await self._ready()
        return {"pool": len(s.pool), "generated": len(s.pool.generated()), "batches": s.batches,
                "handed_out": s.handed_out, "generated_handed_out": s.generated_handed_out}


def spawn_scheduler(redis_url: str, prefix: str, cfg: CurriculumConfig, seeds: list[Task],
                    make_variants: Callable[[], Any] | None = None, seed: int = 0, options: dict | None = None,
                    **kw: Any) -> Any:
    """Create the named scheduler actor (one per run); returns its handle. `kw` reaches the actor
    (stream_maxlen, limit, redis_tls_ca)."""
    return SchedulerActor.options(name=f"curriculum-{prefix}", **(options or {})).remote(
        redis_url, prefix, dataclasses.asdict(cfg), [encode(t) for t in seeds], make_variants, seed, **kw)


@dataclasses.dataclass
class VariantSource:
    """The Mtask variant generator on the Mexp engines' URLs, built inside the scheduler actor."""

    cfg: Config
    mexp_urls: list[str]

    def __call__(self) -> TaskVariantGenerator:
        client = EngineClient.from_config(self.cfg.engines, self.mexp_urls, role="mexp")
        return TaskVariantGenerator(client, load_tokenizer(self.cfg.engines.model), self.cfg.curriculum,
                                    Embedder(cache_path=embedding_cache(self.cfg)))


class CurriculumHandle:
    """The driver's CurriculumScheduler when the scheduler is an actor: same methods, same meaning."""

    def __init__(self, actor: Any):
        self.actor = actor
        self._real_only = False
        self._real_selection = "curriculum"

    @property
    def real_only(self) -> bool:
        return self._real_only

    @real_only.setter
    def real_only(self, value: bool) -> None:
        ray.get(self.actor.set_real_only.remote(bool(value)))
        self._real_only = bool(value)

    @property
    def real_selection(self) -> str:
        return self._real_selection

    @real_selection.setter
    def real_selection(self, rule: str) -> None:
        ray.get(self.actor.set_real_selection.remote(str(rule)))
        self._real_selection = str(rule)

    async def run(self, stop_event: asyncio.Event) -> None:
        """Keep the task stream topped up (in the actor) until stop_event; an actor failure raises here."""
        done = self.actor.run.remote()
        waiter = asyncio.ensure_future(stop_event.wait())
        running = asyncio.ensure_future(done)
        finished, _ = await asyncio.wait({waiter, running}, return_when=asyncio.FIRST_COMPLETED)
        if running not in finished:
            await self.actor.stop.remote()
        waiter.cancel()
        await running

    async def next_batch(self) -> list[Task]:
        return [decode_as(b, Task) for b in await self.actor.next_batch.remote()]

    def state_dict(self) -> dict:
        return ray.get(self.actor.state_dict.remote(), timeout=120)

    async def load_state_dict(self, state: dict) -> None:
        await self.actor.load_state_dict.remote(state)

    async def status(self) -> dict:
        return await self.actor.status.remote()
