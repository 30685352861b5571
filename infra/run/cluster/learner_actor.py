"""The learner as a Ray actor on the `learner_gpu` node: a thin async wrapper, nothing else.

With `actors.runtime=ray`, `dreamgym train` runs learner/learner.Learner in this actor
instead of in the driver, so the process that holds the policy, its optimizer state and
the update's activations is the one on the training node (with `learner.device: cuda`
the actor asks Ray for one GPU). The actor builds everything it touches in its own
process: its Redis client (the run's URL, password included, and `infra.redis_tls_ca`),
the trajectory-stream consumer and the weight publisher's EngineClient to the policy
engines. Weights flow as they do with the learner in the driver: safetensors under
`infra.run_dir` (which must be the same shared path on every node), then
`/update_weights_from_disk` on every policy engine. With `learner.num_gpus` = N > 1 this
actor is rank 0 and starts the other ranks as actors by the same label
(infra/run/cluster/learner_ranks.py).

`LearnerHandle` is the driver's view of the actor with the Learner methods and counters
`dreamgym train` uses, so the driver's loop (`infra/run/driver.rl_phase`) is the same
for both. Its update loop is learner/learner.run_updates, one `step` call per read; the
driver keeps the stop event, the progress bar and the synchronous schedule's feed.
State hooks registered for checkpoints (the curriculum's) are shipped to the actor and
called there at every save: the curriculum is itself an actor then, so its handle works
from any process.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Awaitable, Callable

import ray

from infra.config import Config
from infra.engine.client import EngineClient
from infra.run.cluster.learner_ranks import RayRanks, rank_options
from infra.run.cluster.runtime import serve_actor_metrics
from infra.schema import EnvKind
from infra.streams import connect
from learner.learner import run_updates, stream_learner
from learner.update import UpdateStats


@ray.remote
class LearnerActor:
    def __init__(self, cfg: Config, policy_model: str, run_dir: str, redis_url: str, prefix: str,
                 policy_urls: list[str]):
        self.engines = EngineClient.from_config(cfg.engines, policy_urls, role="policy")
        self.learner = stream_learner(cfg, connect(redis_url, cfg.infra.redis_tls_ca), prefix, run_dir,
                                      self.engines, policy_model, RayRanks(rank_options(cfg.learner)))

    async def ready(self) -> dict:
        """The consumer group exists and the model is loaded; the counters the driver shows."""
        await self.learner.consumer.ensure_group()
        return self.state()

    def state(self) -> dict:
        lr = self.learner
        return {"updates": lr.updates, "version": lr.version, "groups_missing": lr.groups_missing,
                "redelivered": lr.redelivered, "dead_lettered": lr.dead_lettered,
                "failed_updates": dict(lr.failed_updates), "trained": lr.trained, "set_aside": lr.set_aside,
                "waiting": lr.waiting}

    async def step(self, final: bool = False) -> tuple[UpdateStats | None, dict]:
        return await self.learner.step(final), self.state()

    async def publish(self) -> None:
        await self.learner.publish()

    async def set_env_kind(self, kind: str | None) -> None:
        """Train only on trajectories of this environment kind (the RL phase's)."""
        self.learner.env_kind = kind

    async def finish(self) -> dict:
        await self.learner.finish()
        return self.state()

    async def resume(self, path: str | None = None) -> tuple[bool, dict, dict]:
        ok = await asyncio.to_thread(self.learner.resume, path)
        return ok, self.learner.extra, self.state()

    async def register_state(self, name: str, get: Callable[[], Any], set_: Callable[[Any], None]) -> None:
        self.learner.register_state(name, get, set_)

    async def serve_metrics(self, host: str) -> str:
        """Serve this actor's own metrics (updates, non-finite updates, weight version) on a free port; host:port."""
        return serve_actor_metrics(host)

    async def close(self) -> None:
        await self.engines.close()


def spawn_learner(cfg: Config, policy_model: str, run_dir: str | Path, redis_url: str, prefix: str,
                  policy_urls: list[str], options: dict | None = None) -> Any:
    """Create the run's learner actor (named `learner-<prefix>`); returns its handle. Paths are made
    absolute here: the actor's working directory is its node's, not the driver's."""
    model = str(Path(policy_model).resolve()) if Path(policy_model).is_dir() else policy_model
    return LearnerActor.options(name=f"learner-{prefix}", **(options or {})).remote(
        cfg, model, str(Path(run_dir).resolve()), redis_url, prefix, list(policy_urls))


class LearnerHandle:
    """The driver's Learner when the learner is an actor: same methods and counters, same meaning."""

    def __init__(self, actor: Any, state: dict):
        self.actor, self._state = actor, state
        self.extra: dict[str, Any] = {}
        self._env_kind: EnvKind | None = None

    @classmethod
    async def start(cls, actor: Any) -> "LearnerHandle":
        return cls(actor, await actor.ready.remote())

    updates = property(lambda self: self._state["updates"])
    version = property(lambda self: self._state["version"])
    groups_missing = property(lambda self: self._state["groups_missing"])
    redelivered = property(lambda self: self._state["redelivered"])
    dead_lettered = property(lambda self: self._state["dead_lettered"])
    failed_updates = property(lambda self: self._state["failed_updates"])

    trained = property(lambda self: self._state["trained"])
    # as of the actor's last answer to step(), which the update loop polls until the phase ends
    set_aside = property(lambda self: dict(self._state["set_aside"]))
    waiting = property(lambda self: self._state["waiting"])

    @property
    def env_kind(self) -> EnvKind | None:
        return self._env_kind

    @env_kind.setter
    def env_kind(self, kind: EnvKind | str | None) -> None:
        kind = None if kind is None else EnvKind(kind)
        ray.get(self.actor.set_env_kind.remote(None if kind is None else kind.value), timeout=120)
        self._env_kind = kind

    def register_state(self, name: str, get: Callable[[], Any], set_: Callable[[Any], None]) -> None:
        ray.get(self.actor.register_state.remote(name, get, set_), timeout=120)

    def resume(self, path: str | None = None) -> bool:
        ok, self.extra, self._state = ray.get(self.actor.resume.remote(path))
        return ok

    async def step(self, final: bool = False) -> UpdateStats | None:
        stats, self._state = await self.actor.step.remote(final)
        return stats

    async def run(self, total_updates: int, on_update: Callable[[UpdateStats], Awaitable[None] | None] | None = None,
                  stop: asyncio.Event | None = None,
                  before_step: Callable[[], Awaitable[None]] | None = None) -> list[UpdateStats]:
        return await run_updates(self, total_updates, on_update, stop, before_step)

    async def publish(self) -> None:
        await self.actor.publish.remote()

    async def finish(self) -> None:
        self._state = await self.actor.finish.remote()
