"""The replay buffer as a Ray actor: the one process that opens the embedded store.

Qdrant Edge (and qdrant-client's local mode) can be opened by one process only, so
in embedded mode a single actor owns the buffer (simulator/replay_buffer.py) and
every worker talks to it in batches: one `add` per finished group, one `query` per
Mexp step (or per batch of steps). Nothing here but the wrapper; `BufferClient`
makes the handle look like a local buffer whose methods return awaitables, which
is what ExperienceModel and the rollout worker accept.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import ray

from infra.config import SimulatorConfig
from infra.run.cluster.runtime import serve_actor_metrics
from simulator.embedder import Embedder
from simulator.replay_buffer import Transition, make_buffer


def _as_transition(t: Any) -> Transition:
    return t if isinstance(t, Transition) else Transition(**t)


@ray.remote
class BufferActor:
    def __init__(self, sim_cfg: dict, path: str, cache_path: str = ""):
        cfg = SimulatorConfig(**sim_cfg)
        embedder = Embedder(cache_path=cache_path or None)
        self.buffer = make_buffer(cfg, path, embedder)

    def add(self, transitions: list) -> int:
        self.buffer.add([_as_transition(t) for t in transitions])
        return len(self.buffer)

    def query(self, pairs: list, k: int, exclude_episodes: list | None = None) -> list[list[dict]]:
        # Plain dicts back over the wire: no class identity needed on the caller's side.
        return [[asdict(t) for t in hits] for hits in
                self.buffer.query([tuple(p) for p in pairs], k, exclude_episodes)]

    def size(self) -> int:
        return len(self.buffer)

    def serve_metrics(self, host: str) -> str:
        """Serve this actor's own metrics (buffer size, retrieval latency) on a free port; host:port."""
        return serve_actor_metrics(host)

    def optimize(self) -> None:
        if hasattr(self.buffer, "optimize"):
            self.buffer.optimize()

    def flush(self) -> None:
        self.buffer.flush()

    def close(self) -> None:
        self.buffer.close()


class BufferClient:
    """A BufferActor handle with the ReplayBuffer methods, each returning an awaitable."""

    def __init__(self, handle: Any):
        self.handle = handle

    async def add(self, transitions: list[Transition]) -> int:
        return await self.handle.add.remote([asdict(t) if isinstance(t, Transition) else t for t in transitions])

    async def query(self, pairs: list[tuple[str, str]], k: int,
                    exclude_episodes: list[str] | None = None) -> list[list[Transition]]:
        rows = await self.handle.query.remote(list(pairs), k, exclude_episodes)
        return [[Transition(**d) for d in hits] for hits in rows]

    async def size(self) -> int:
        return await self.handle.size.remote()

    async def flush(self) -> None:
        await self.handle.flush.remote()
