"""The driver's rollout workers as Ray actors (`actors.runtime: ray`).

Owns what each worker actor builds inside its own process, and the one buffer actor
they share:

- `PolicyFactory`: a ChoicePolicy on the policy engines' URLs;
- `EnvFactory`: fresh environments, synthetic (a SyntheticEnv over one ExperienceModel
  per actor, on the Mexp engines' URLs) or real;
- `ServerBuffer`: with a Qdrant server, each actor opens its own client (and embeds its
  own queries) on first use, once per process;
- `RolloutFleet`: starts or joins Ray, opens the replay buffer the driver seeded in a
  BufferActor when the store admits one process only (Qdrant Edge, qdrant-client's
  local mode), and spawns `RayWorkerHandle`s for infra/scale.WorkerPool.

The factories are small picklable classes, not closures: Ray ships them by value and
each actor builds its engine clients on its own event loop, on first use. Engine and
Redis URLs must be reachable from every node. With embedded engines and the embedded
Redis (the quickstart) the actors share the driver's machine; on a multi-node cluster
configure `engines.*_endpoints` and `infra.redis_url`.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infra.config import Config, SimulatorConfig

log = logging.getLogger(__name__)


def _shares_store(cfg: Config) -> bool:
    """True when the buffer is a store only one process may open (Edge, or qdrant-client's local mode)."""
    return cfg.simulator.buffer_backend == "edge" or not cfg.simulator.qdrant_url


_OPEN: dict[tuple[str, str], Any] = {}  # this process's Qdrant-server buffers


@dataclass
class ServerBuffer:
    """A Qdrant-server replay buffer, opened in the calling process on first use."""

    sim: SimulatorConfig

    def _open(self) -> Any:
        key = (self.sim.qdrant_url, self.sim.collection)
        if key not in _OPEN:
            import tempfile

            from simulator.replay_buffer import make_buffer

            # With a URL the path only places the embedding cache.
            _OPEN[key] = make_buffer(self.sim, Path(tempfile.mkdtemp(prefix="dreamgym-buffer-")) / "store")
        return _OPEN[key]

    def add(self, transitions: list) -> None:
        self._open().add(transitions)

    def query(self, pairs: list, k: int, exclude_episodes: list | None = None) -> list:
        return self._open().query(pairs, k, exclude_episodes)


@dataclass
class PolicyFactory:
    """Builds one worker's policy in the actor's process."""

    urls: list[str]
    cfg: Config
    seed: int

    def __call__(self) -> Any:
        from actors.policy import ChoicePolicy
        from infra.engine_client import EngineClient
        from infra.model_loading import load_tokenizer

        client = EngineClient.from_config(self.cfg.engines, self.urls, role="policy")
        return ChoicePolicy(client, load_tokenizer(self.cfg.engines.model), self.cfg.actors.temperature, seed=self.seed)


@dataclass
class EnvFactory:
    """Builds one worker's environments; the synthetic ones share one ExperienceModel per actor."""

    cfg: Config
    mexp_urls: list[str]
    buffer_actor: Any = None  # a BufferActor handle; None: a Qdrant server, opened here
    _mexp: Any = field(default=None, repr=False)

    def _experience_model(self) -> Any:
        from infra.cluster.buffer_actor import BufferClient
        from infra.engine_client import EngineClient
        from infra.model_loading import load_tokenizer
        from simulator.experience_model import ExperienceModel

        buffer = BufferClient(self.buffer_actor) if self.buffer_actor is not None else ServerBuffer(self.cfg.simulator)
        client = EngineClient.from_config(self.cfg.engines, self.mexp_urls, role="mexp")
        return ExperienceModel(client, buffer, self.cfg.simulator, load_tokenizer(self.cfg.engines.model))

    def __call__(self) -> Any:
        if self.cfg.actors.env_kind != "synthetic":
            from actors.envs.registry import make_env

            return make_env(self.cfg.actors.env_family, max_steps=self.cfg.actors.max_steps)
        from simulator.synthetic_env import SyntheticEnv

        if self._mexp is None:
            self._mexp = self._experience_model()
        return SyntheticEnv(self._mexp, self.cfg.simulator.max_steps)


class RolloutFleet:
    """Spawns rollout worker actors for WorkerPool and owns the buffer actor they share.

    `buffer` is the driver's replay buffer, seeded, at `buffer_path`. When the workers need
    it and only one process may open it, the fleet closes the driver's handle and reopens
    the store in a BufferActor; otherwise the driver keeps it.
    """

    def __init__(self, cfg: Config, redis_url: str, prefix: str, mexp_urls: list[str], policy_urls: list[str],
                 buffer: Any, buffer_path: str | Path, embedding_cache: str | Path = ""):
        import ray

        from infra.cluster.runtime import init_ray, placement_options

        self.cfg, self.redis_url, self.prefix = cfg, redis_url, prefix
        self.mexp_urls, self.policy_urls = list(mexp_urls), list(policy_urls)
        self.started_ray = not ray.is_initialized()
        resources = init_ray(cfg.infra.ray_address)
        self.worker_options = placement_options("rollout", resources, override=cfg.actors.worker_resources or None)
        self.buffer_actor, self.local_buffer = None, buffer
        if cfg.actors.env_kind == "synthetic" and _shares_store(cfg):
            from infra.cluster.buffer_actor import BufferActor

            buffer.close()
            self.local_buffer = None
            self.buffer_actor = BufferActor.options(**placement_options("buffer", resources, num_cpus=0.25)).remote(
                asdict(cfg.simulator), str(buffer_path), str(embedding_cache))
            ray.get(self.buffer_actor.size.remote())  # opened, or the error surfaces here
        log.info("rollout workers run as Ray actors with %s", self.worker_options)

    def spawn(self, worker_id: str) -> Any:
        from infra.cluster.worker_actor import RayWorkerHandle

        cfg = self.cfg
        env = EnvFactory(cfg, self.mexp_urls, self.buffer_actor)
        write_back = None
        if cfg.simulator.write_back and cfg.actors.env_kind == "synthetic":
            write_back = self.buffer_actor if self.buffer_actor is not None else ServerBuffer(cfg.simulator)
        return RayWorkerHandle.spawn(
            worker_id, self.redis_url, self.prefix, cfg.actors,
            PolicyFactory(self.policy_urls, cfg, seed=hash((cfg.infra.seed, worker_id))), env,
            options=self.worker_options, buffer=write_back, reclaim_idle_ms=cfg.infra.reclaim_idle_ms,
            maxlen=cfg.infra.stream_maxlen)

    def buffer_size(self) -> int:
        import ray

        if self.buffer_actor is not None:
            return int(ray.get(self.buffer_actor.size.remote()))
        return len(self.local_buffer) if self.local_buffer is not None else 0

    def close(self) -> None:
        """Flush and close the buffer (so the store reopens cleanly), then stop Ray if this fleet started it."""
        import ray

        from infra.cluster.runtime import shutdown_ray

        if self.buffer_actor is not None:
            try:
                ray.get(self.buffer_actor.close.remote(), timeout=60)
            except Exception as exc:  # a dead actor already let go of the store
                log.warning("closing the buffer actor: %s", exc)
            ray.kill(self.buffer_actor)
            self.buffer_actor = None
        if self.started_ray:
            shutdown_ray()
