"""The driver's rollout workers as Ray actors (`actors.runtime: ray`).

Owns what each worker actor builds inside its own process, and the one buffer actor
they share:

- `PolicyFactory`: a Policy on the policy engines' URLs;
- `EnvFactory`: fresh environments, synthetic (a SyntheticEnv over one ExperienceModel
  per actor, on the Mexp engines' URLs) or real;
- `ServerBuffer`: with a Qdrant server, each actor opens its own client (and embeds its
  own queries) on first use, once per process;
- `RolloutFleet`: starts or joins Ray, opens the replay buffer the driver seeded in a
  BufferActor when the store admits one process only (Qdrant Edge, qdrant-client's
  local mode), on the `buffer_cpu` node of a labelled cluster, else on the driver's,
  and spawns `RayWorkerHandle`s for infra/run/workers.WorkerPool.

The factories are small picklable classes, not closures: Ray ships them by value and
each actor builds its engine clients on its own event loop, on first use. Engine and
Redis URLs must be reachable from every node. With embedded engines and the embedded
Redis (the quickstart) the actors share the driver's machine; on a multi-node cluster
configure `engines.*_endpoints` and `infra.redis_url`.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray

from infra.config import Config, SimulatorConfig
from infra.engine.client import EngineClient
from infra.engine.models import load_tokenizer
from infra.run.cluster.buffer_actor import BufferActor, BufferClient
from infra.run.cluster.runtime import driver_node_id, init_ray, kill_actor, on_node, placement_options, shutdown_ray
from infra.run.cluster.worker_actor import RayWorkerHandle
from infra.run.workers import make_env_factory, make_policy, write_back_sink
from simulator.experience_model import ExperienceModel
from simulator.replay_buffer import make_buffer
from simulator.reply_memo import ReplyMemo

log = logging.getLogger(__name__)


def shares_store(cfg: Config) -> bool:
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
            # With a URL the path only places the embedding cache.
            _OPEN[key] = make_buffer(self.sim, Path(tempfile.mkdtemp(prefix="dreamgym-buffer-")) / "store")
        return _OPEN[key]

    def add(self, transitions: list) -> None:
        self._open().add(transitions)

    def query(self, pairs: list, k: int, exclude_episodes: list | None = None) -> list:
        return self._open().query(pairs, k, exclude_episodes)


@dataclass
class ActorRecipe:
    """One worker's policy and environments, built in the actor's process on first use."""

    cfg: Config
    worker_id: str
    mexp_urls: list[str]
    policy_urls: list[str]
    buffer_actor: Any = None  # a BufferActor handle; None: a Qdrant server, opened here
    _envs: Any = field(default=None, repr=False)
    _memo: ReplyMemo | None = field(default=None, repr=False)

    def policy(self) -> Any:
        client = EngineClient.from_config(self.cfg.engines, self.policy_urls, role="policy")
        return make_policy(self.cfg, client, load_tokenizer(self.cfg.engines.model), self.worker_id)

    def buffer(self) -> Any:
        """The replay buffer as this actor reaches it: through the buffer actor, or its own Qdrant-server client."""
        return BufferClient(self.buffer_actor) if self.buffer_actor is not None else ServerBuffer(self.cfg.simulator)

    def _experience_model(self) -> ExperienceModel:
        client = EngineClient.from_config(self.cfg.engines, self.mexp_urls, role="mexp")
        if self._memo is None:  # one for the actor's experience models
            self._memo = ReplyMemo(self.cfg.simulator.reply_memo)
        return ExperienceModel(client, self.buffer(), self.cfg.simulator, load_tokenizer(self.cfg.engines.model),
                               self._memo)

    def env(self) -> Any:
        if self._envs is None:
            self._envs = make_env_factory(self.cfg, self._experience_model)
        return self._envs()


class RolloutFleet:
    """Spawns rollout worker actors for WorkerPool and owns the buffer actor they share.

    `buffer` is the driver's replay buffer, seeded, at `buffer_path`. When the workers need
    it and only one process may open it, the fleet closes the driver's handle and reopens
    the store in a BufferActor; otherwise the driver keeps it.
    """

    def __init__(self, cfg: Config, redis_url: str, prefix: str, mexp_urls: list[str], policy_urls: list[str],
                 buffer: Any, buffer_path: str | Path, embedding_cache: str | Path = ""):
        self.cfg, self.redis_url, self.prefix = cfg, redis_url, prefix
        self.mexp_urls, self.policy_urls = list(mexp_urls), list(policy_urls)
        self.started_ray = not ray.is_initialized()
        resources = init_ray(cfg.infra.ray_address, runtime_env=cfg.infra.ray_runtime_env)
        self.worker_options = placement_options("rollout", resources, override=cfg.actors.worker_resources or None)
        self.buffer_actor, self.local_buffer = None, buffer
        if cfg.actors.env_kind == "synthetic" and shares_store(cfg):
            buffer.close()
            self.local_buffer = None
            # It reopens the store the driver seeded at `buffer_path`: on the `buffer_cpu` node of a labelled
            # cluster (which must see that path: the driver's node, or a shared infra.run_dir), else on the driver's.
            options = placement_options("buffer", resources, num_cpus=0.25)
            if "resources" not in options:
                options = on_node(options, driver_node_id())
            self.buffer_actor = BufferActor.options(**options).remote(  # absolute: an actor's cwd is its node's
                asdict(cfg.simulator), str(Path(buffer_path).resolve()),
                str(Path(embedding_cache).resolve()) if embedding_cache else "")
            ray.get(self.buffer_actor.size.remote())  # opened, or the error surfaces here
        log.info("rollout workers run as Ray actors with %s", self.worker_options)

    def spawn(self, worker_id: str, cfg: Config | None = None) -> RayWorkerHandle:
        """A worker actor following `cfg` (a phase's config; the fleet's own by default)."""
        cfg = cfg or self.cfg
        recipe = ActorRecipe(cfg, worker_id, self.mexp_urls, self.policy_urls, self.buffer_actor)
        return RayWorkerHandle.spawn(worker_id, self.redis_url, self.prefix, cfg.actors, recipe.policy, recipe.env,
                                     options=self.worker_options, buffer=write_back_sink(cfg, recipe.buffer()),
                                     reclaim_idle_ms=cfg.infra.reclaim_idle_ms, maxlen=cfg.infra.stream_maxlen,
                                     redis_tls_ca=cfg.infra.redis_tls_ca, max_deliveries=cfg.infra.max_deliveries,
                                     handler_timeout_s=cfg.infra.handler_timeout_s)

    def buffer_size(self) -> int:
        if self.buffer_actor is not None:
            return int(ray.get(self.buffer_actor.size.remote()))
        return len(self.local_buffer) if self.local_buffer is not None else 0

    def close(self) -> None:
        """Flush and close the buffer (so the store reopens cleanly), then stop Ray if this fleet started it."""
        if self.buffer_actor is not None and ray.is_initialized():  # else it went with the job (see kill_actor)
            try:
                ray.get(self.buffer_actor.close.remote(), timeout=60)
            except Exception as exc:  # a dead actor already let go of the store
                log.warning("closing the buffer actor: %s", exc)
            kill_actor(self.buffer_actor)
        self.buffer_actor = None
        if self.started_ray:
            shutdown_ray()
