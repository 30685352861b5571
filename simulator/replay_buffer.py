"""The experience replay buffer: transitions embedded by (state, action), top-k retrieval.

Owns storing transitions (real ones seeded from the offline data, synthetic ones
written back online) and retrieving the top-k most similar (state, action) pairs for
the Mexp prompt (paper §4.1, "experience replay buffer"). Cosine similarity on
all-MiniLM-L6-v2 embeddings of `transition_text(state, action)`; the querying
episode's own transitions are filtered out on the payload, so an episode never
retrieves itself.

Two backends behind one Protocol:
- `EdgeBuffer`: Qdrant Edge, in-process, on disk; `optimize()` builds the HNSW
  index. Only one process can open a store, so in a cluster one owner serves it
  (infra/run/cluster/buffer_actor.py) and workers call it in batches.
- `QdrantBuffer`: qdrant-client against a Qdrant server (URL + API key), or its
  local mode (`path=`, an exact Python scan, for tests and small stores).

Eviction rule (size bound `max_size`): when an `add` overflows the bound, the
oldest synthetic transitions go first; real transitions are evicted (oldest first)
only when no synthetic ones remain. Real experience anchors the simulator, and
synthetic experience is cheap to regenerate. Age = insertion sequence number,
stored in the payload, so the rule survives a restart.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Iterable, Protocol, runtime_checkable

import numpy as np

from infra import metrics
from infra.config import SimulatorConfig
from infra.schema import Trajectory
from simulator.embedder import DIM, Embedder, transition_text

VECTOR = "v"


@dataclass
class Transition:
    task_id: str
    instruction: str
    state: str
    action: str
    reasoning: str
    next_state: str
    reward: float
    done: bool
    source: str = "real"  # "real" | "synthetic"
    episode_id: str = ""
    policy_version: int = 0


_FIELDS = [f.name for f in fields(Transition)]


def _payload(t: Transition, seq: int) -> dict:
    d = asdict(t)
    d["reward"] = float(d["reward"])
    d["done"] = bool(d["done"])
    d["seq"] = seq
    return d


def _from_payload(p: dict) -> Transition:
    return Transition(**{k: p[k] for k in _FIELDS if k in p})


def transitions_from_trajectory(traj: Trajectory, source: str = "real") -> list[Transition]:
    """One Transition per step the environment took (not a generate-mode invalid reply); the trajectory id
    is the episode id."""
    instruction = traj.task.instruction if traj.task is not None else ""
    return [Transition(task_id=traj.task_id, instruction=instruction, state=s.state, action=s.action,
                       reasoning=s.reasoning, next_state=s.next_state, reward=float(s.reward), done=bool(s.done),
                       source=source, episode_id=traj.trajectory_id, policy_version=traj.policy_version)
            for s in traj.steps if not getattr(s, "invalid_reason", "")]


@runtime_checkable
class ReplayBuffer(Protocol):
    def add(self, transitions: list[Transition]) -> None:
        """Embed and upsert a batch; evicts per the module's rule when over the size bound."""

    def query(self, pairs: list[tuple[str, str]], k: int,
              exclude_episodes: list[str] | None = None) -> list[list[Transition]]:
        """Top-k neighbours of each (state, action), best first, none from `exclude_episodes`."""

    def __len__(self) -> int: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class EdgeBuffer:
    """Qdrant Edge store at `path` (created, or reopened with its contents)."""

    def __init__(self, path: str | Path, embedder: Embedder, max_size: int = 200_000, hnsw_m: int = 16,
                 hnsw_ef_construct: int = 100, hnsw_ef: int = 64) -> None:
        import qdrant_edge as q  # the configured backend only

        self._q = q
        self.path = Path(path)
        self.embedder = embedder
        self.max_size = max_size
        self.hnsw_ef = hnsw_ef
        cfg = q.EdgeConfig(vectors={VECTOR: q.EdgeVectorParams(size=DIM, distance=q.Distance.Cosine)},
                           hnsw_config=q.HnswIndexConfig(m=hnsw_m, ef_construct=hnsw_ef_construct,
                                                         full_scan_threshold=10_000))
        if self.path.exists() and any(self.path.iterdir()):
            self._shard = q.EdgeShard.load(str(self.path))
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            self._shard = q.EdgeShard.create(str(self.path), cfg)
            for name, typ in (("seq", q.PayloadSchemaType.Integer), ("source", q.PayloadSchemaType.Keyword),
                              ("episode_id", q.PayloadSchemaType.Keyword)):
                self._shard.update(q.UpdateOperation.create_field_index(name, typ))
        last = self._shard.scroll(q.ScrollRequest(limit=1, order_by=q.OrderBy("seq", direction=q.Direction.Desc)))[0]
        self._next = (int(last[0].id) + 1) if last else 0
        self._update_gauge()

    # -- writes --
    def add(self, transitions: list[Transition]) -> None:
        if not transitions:
            return
        vecs = self.embedder.embed([transition_text(t.state, t.action) for t in transitions])
        self.add_vectors(transitions, vecs)

    def add_vectors(self, transitions: list[Transition], vecs: np.ndarray) -> None:
        """Upsert with precomputed vectors (the benchmark and bulk seeding use this)."""
        q = self._q
        points = []
        for t, v in zip(transitions, vecs):
            points.append(q.Point(self._next, {VECTOR: v.tolist()}, _payload(t, self._next)))
            self._next += 1
        for i in range(0, len(points), 2048):
            self._shard.update(q.UpdateOperation.upsert_points(points[i:i + 2048]))
        self._evict()
        self._update_gauge()

    def _count(self, source: str | None = None) -> int:
        q = self._q
        flt = None if source is None else q.Filter(must=[q.FieldCondition(key="source", match=q.MatchValue(source))])
        return int(self._shard.count(q.CountRequest(exact=True, filter=flt)))

    def _evict(self) -> None:
        q = self._q
        excess = self._count() - self.max_size
        for source in ("synthetic", "real"):
            if excess <= 0:
                return
            flt = q.Filter(must=[q.FieldCondition(key="source", match=q.MatchValue(source))])
            recs, _ = self._shard.scroll(q.ScrollRequest(limit=excess, filter=flt, order_by=q.OrderBy("seq")))
            if recs:
                self._shard.update(q.UpdateOperation.delete_points([r.id for r in recs]))
                excess -= len(recs)

    def optimize(self) -> None:
        """Build the HNSW index over what is stored (seconds at 10k, tens of seconds at 100k)."""
        self._shard.optimize()

    # -- reads --
    def query(self, pairs: list[tuple[str, str]], k: int,
              exclude_episodes: list[str] | None = None) -> list[list[Transition]]:
        if not pairs or k <= 0:
            return [[] for _ in pairs]
        vecs = self.embedder.embed([transition_text(s, a) for s, a in pairs])
        return self.query_vectors(vecs, k, exclude_episodes)

    def query_vectors(self, vecs: np.ndarray, k: int, exclude_episodes: list[str] | None = None,
                      exact: bool = False) -> list[list[Transition]]:
        q = self._q
        start = time.perf_counter()
        flt = None
        if exclude_episodes:
            flt = q.Filter(must_not=[q.FieldCondition(key="episode_id", match=q.MatchAny(list(exclude_episodes)))])
        params = q.SearchParams(hnsw_ef=max(self.hnsw_ef, k), exact=exact)
        reqs = [q.QueryRequest(limit=k, query=q.Query.Nearest(v.tolist(), using=VECTOR), with_payload=True,
                               filter=flt, params=params) for v in vecs]
        res = self._shard.query_batch(q.QueryBatchRequest(reqs))
        metrics.SIMULATOR_RETRIEVAL_SECONDS.observe(time.perf_counter() - start)
        return [[_from_payload(p.payload) for p in hits] for hits in res]

    def query_ids(self, vecs: np.ndarray, k: int, exact: bool = False) -> list[list[int]]:
        """Point ids of the top-k (for recall measurements)."""
        q = self._q
        params = q.SearchParams(hnsw_ef=max(self.hnsw_ef, k), exact=exact)
        return [[int(p.id) for p in self._shard.query(q.QueryRequest(
            limit=k, query=q.Query.Nearest(v.tolist(), using=VECTOR), params=params))] for v in vecs]

    def __len__(self) -> int:
        return self._count()

    def _update_gauge(self) -> None:
        for source in ("real", "synthetic"):
            metrics.SIMULATOR_BUFFER_SIZE.labels(source=source).set(self._count(source))

    def flush(self) -> None:
        self._shard.flush()

    def close(self) -> None:
        if self._shard is not None:
            self._shard.flush()
            self._shard.close()
            self._shard = None


class QdrantBuffer:
    """The same buffer on qdrant-client: a server (`url`, `api_key`) or local mode (`path`)."""

    def __init__(self, embedder: Embedder, url: str = "", api_key: str = "", path: str | Path = "",
                 collection: str = "transitions", max_size: int = 200_000) -> None:
        from qdrant_client import QdrantClient, models  # the configured backend only

        self._m = models
        self.embedder = embedder
        self.collection = collection
        self.max_size = max_size
        self._local = not url
        if url:
            self._client = QdrantClient(url=url, api_key=api_key or None)
        else:
            if not path:
                raise ValueError("QdrantBuffer needs a server url or a local path")
            self._client = QdrantClient(path=str(path))
        if not self._client.collection_exists(collection):
            self._client.create_collection(collection, vectors_config={
                VECTOR: models.VectorParams(size=DIM, distance=models.Distance.COSINE)})
            if not self._local:  # local mode ignores payload indexes
                for name, schema in (("seq", models.PayloadSchemaType.INTEGER),
                                     ("source", models.PayloadSchemaType.KEYWORD),
                                     ("episode_id", models.PayloadSchemaType.KEYWORD)):
                    self._client.create_payload_index(collection, name, schema)
        self._next = self._max_seq() + 1

    def _max_seq(self) -> int:
        best, offset = -1, None
        while True:  # a full scroll: fine for local mode, where order_by is not offered
            recs, offset = self._client.scroll(self.collection, limit=1024, offset=offset,
                                               with_payload=["seq"], with_vectors=False)
            for r in recs:
                best = max(best, int(r.payload.get("seq", -1)))
            if offset is None:
                return best

    def add(self, transitions: list[Transition]) -> None:
        if not transitions:
            return
        m = self._m
        vecs = self.embedder.embed([transition_text(t.state, t.action) for t in transitions])
        points = []
        for t, v in zip(transitions, vecs):
            # Server ids must be uint or UUID; a UUID derived from seq keeps them stable.
            points.append(m.PointStruct(id=str(uuid.UUID(int=self._next)), vector={VECTOR: v.tolist()},
                                        payload=_payload(t, self._next)))
            self._next += 1
        self._client.upsert(self.collection, points=points)
        self._evict()

    def _evict(self) -> None:
        m = self._m
        excess = len(self) - self.max_size
        for source in ("synthetic", "real"):
            if excess <= 0:
                return
            flt = m.Filter(must=[m.FieldCondition(key="source", match=m.MatchValue(value=source))])
            recs, offset, found = [], None, []
            while True:
                recs, offset = self._client.scroll(self.collection, scroll_filter=flt, limit=1024, offset=offset,
                                                   with_payload=["seq"], with_vectors=False)
                found += [(int(r.payload["seq"]), r.id) for r in recs]
                if offset is None:
                    break
            victims = [pid for _, pid in sorted(found)[:excess]]
            if victims:
                self._client.delete(self.collection, points_selector=m.PointIdsList(points=victims))
                excess -= len(victims)

    def query(self, pairs: list[tuple[str, str]], k: int,
              exclude_episodes: list[str] | None = None) -> list[list[Transition]]:
        if not pairs or k <= 0:
            return [[] for _ in pairs]
        m = self._m
        start = time.perf_counter()
        vecs = self.embedder.embed([transition_text(s, a) for s, a in pairs])
        flt = None
        if exclude_episodes:
            flt = m.Filter(must_not=[m.FieldCondition(key="episode_id", match=m.MatchAny(any=list(exclude_episodes)))])
        reqs = [m.QueryRequest(query=v.tolist(), using=VECTOR, limit=k, filter=flt, with_payload=True) for v in vecs]
        res = self._client.query_batch_points(self.collection, requests=reqs)
        metrics.SIMULATOR_RETRIEVAL_SECONDS.observe(time.perf_counter() - start)
        return [[_from_payload(p.payload) for p in r.points] for r in res]

    def __len__(self) -> int:
        return int(self._client.count(self.collection, exact=True).count)

    def flush(self) -> None:
        pass  # the server persists on write; local mode persists on close

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def make_buffer(cfg: SimulatorConfig, path: str | Path, embedder: Embedder | None = None) -> ReplayBuffer:
    """The configured backend. `path` is the store directory (Edge) or the local-mode fallback (qdrant)."""
    path = Path(path)
    if embedder is None:
        embedder = Embedder(cache_path=path.parent / "embeddings.sqlite")
    if cfg.buffer_backend == "edge":
        return EdgeBuffer(path, embedder, max_size=cfg.buffer_max_size, hnsw_m=cfg.hnsw_m,
                          hnsw_ef_construct=cfg.hnsw_ef_construct, hnsw_ef=cfg.hnsw_ef)
    return QdrantBuffer(embedder, url=cfg.qdrant_url, api_key=cfg.qdrant_api_key,
                        path=cfg.qdrant_path or path, collection=cfg.collection, max_size=cfg.buffer_max_size)


def seed_buffer(buffer: ReplayBuffer, trajectories: Iterable[Trajectory], batch: int = 256) -> int:
    """Add every step of `trajectories` as real transitions; returns how many were added."""
    pending: list[Transition] = []
    n = 0
    for traj in trajectories:
        pending += transitions_from_trajectory(traj, "real")
        if len(pending) >= batch:
            buffer.add(pending)
            n += len(pending)
            pending = []
    if pending:
        buffer.add(pending)
        n += len(pending)
    buffer.flush()
    return n
