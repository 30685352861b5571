"""The replay buffer on real Qdrant Edge and qdrant-client local mode, with the real MiniLM."""

from __future__ import annotations

import numpy as np
import pytest

from infra.config import SimulatorConfig
from infra.schema import Step, Task, Trajectory
from simulator.embedder import Embedder, transition_text
from simulator.replay_buffer import EdgeBuffer, QdrantBuffer, Transition, make_buffer, seed_buffer

pytestmark = pytest.mark.slow

ROOMS = ["kitchen", "garden", "cellar", "attic", "bedroom", "bathroom", "garage", "study", "hall", "pantry"]
OBJECTS = ["apple", "key", "lamp", "book", "coin", "knife", "shovel", "towel", "hat", "map"]


def _t(i: int, source: str = "real", episode: str | None = None) -> Transition:
    room, obj = ROOMS[i % 10], OBJECTS[(i // 10) % 10]
    state = f"Goal: find the {obj}\nRoom: {room.title()}. You see a {obj} on a table.\nActions:\n[1] take {obj}\n[2] go east"
    return Transition(task_id=f"task{i % 7}", instruction=f"find the {obj}", state=state, action=f"take {obj}",
                      reasoning="", next_state=state.replace(f"take {obj}", f"drop {obj}"), reward=0.0, done=False,
                      source=source, episode_id=episode or f"ep{i}")


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    e = Embedder(cache_path=tmp_path_factory.mktemp("emb") / "cache.sqlite")
    yield e
    e.close()


@pytest.fixture(params=["edge", "qdrant-local"])
def buffer_factory(request, tmp_path, embedder):
    def make(max_size=1000):
        if request.param == "edge":
            return EdgeBuffer(tmp_path / "edge", embedder, max_size=max_size)
        return QdrantBuffer(embedder, path=tmp_path / "qdrant", max_size=max_size)
    return make


def test_embedder_unit_norm_and_cache(embedder):
    texts = [transition_text("[1] open door", "open door"), transition_text("[1] eat apple", "eat apple")]
    a = embedder.embed(texts)
    assert a.shape == (2, 384) and np.allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-4)
    assert np.array_equal(embedder.embed(texts[::-1]), a[::-1])  # second call served by the cache


def test_long_states_still_embed_the_action(embedder):
    """MiniLM truncates at 256 word pieces; a state longer than that must not swallow the action."""
    things = ", ".join(f"{c} {o}" for c in ("red", "blue", "green", "old", "shiny") for o in OBJECTS)
    items = "\n".join(f"[{i + 1}] take {o}" for i, o in enumerate(OBJECTS * 3))
    state = f"Goal: tidy the house\nRoom: Attic\nYou see: {things}\nActions:\n{items}"
    assert len(embedder._load().tokenizer(state)["input_ids"]) > 300
    a, b = embedder.embed([transition_text(state, "take apple"), transition_text(state, "go east")])
    assert float(a @ b) < 0.97
    # A web action names its item by number; the item's text goes with it.
    assert "(take key)" in transition_text(state, "click [2]")


def test_planted_neighbour_is_retrieved_and_own_episode_excluded(buffer_factory):
    buf = buffer_factory()
    buf.add([_t(i) for i in range(60)])
    planted = Transition("tp", "bake a cake", "Goal: bake a cake\nRoom: Bakery. An oven hums.\nActions:\n[1] turn on oven",
                         "turn on oven", "heat", "Goal: bake a cake\nThe oven is hot.\nActions:\n[1] bake cake", 0.0,
                         False, "real", "planted-ep")
    buf.add([planted])
    assert len(buf) == 61
    query = ("Goal: bake a cake\nRoom: Bakery. The oven hums quietly.\nActions:\n[1] turn on oven", "turn on oven")
    hits = buf.query([query, (_t(3).state, _t(3).action)], k=3)
    assert hits[0][0] == planted
    assert hits[1][0].state == _t(3).state
    excluded = buf.query([query], k=3, exclude_episodes=["planted-ep"])[0]
    assert len(excluded) == 3 and all(h.episode_id != "planted-ep" for h in excluded)
    buf.close()


def test_eviction_drops_oldest_synthetic_first_then_oldest_real(buffer_factory):
    buf = buffer_factory(max_size=6)
    buf.add([_t(i, "real") for i in range(3)])
    buf.add([_t(10 + i, "synthetic") for i in range(3)])
    buf.add([_t(20 + i, "synthetic") for i in range(2)])  # 8 > 6: the two oldest synthetic go
    eps = {h.episode_id for h in buf.query([(_t(0).state, _t(0).action)], k=10)[0]}
    assert eps == {"ep0", "ep1", "ep2", "ep12", "ep20", "ep21"}
    buf.add([_t(30 + i, "real") for i in range(5)])  # 11 > 6: all synthetic, then the oldest real
    eps = {h.episode_id for h in buf.query([(_t(0).state, _t(0).action)], k=10)[0]}
    assert eps == {"ep2", "ep30", "ep31", "ep32", "ep33", "ep34"}
    buf.close()


def test_survives_restart(buffer_factory):
    buf = buffer_factory()
    buf.add([_t(i) for i in range(20)])
    buf.flush()
    buf.close()
    buf = buffer_factory()
    assert len(buf) == 20
    buf.add([_t(99, episode="after-restart")])
    assert buf.query([(_t(99).state, _t(99).action)], k=1)[0][0].episode_id == "after-restart"
    buf.close()


def test_edge_hnsw_after_optimize(tmp_path, embedder):
    buf = EdgeBuffer(tmp_path / "edge", embedder)
    ts = [_t(i) for i in range(100)]
    vecs = embedder.embed([transition_text(t.state, t.action) for t in ts])
    buf.add_vectors(ts, vecs)
    buf.optimize()
    assert buf.query_ids(vecs[:5], k=1) == [[0], [1], [2], [3], [4]]
    buf.close()


def test_make_buffer_and_seed_from_trajectories(tmp_path, embedder):
    traj = Trajectory(task_id="t1", group_id="g", task=Task("t1", "find the key"),
                      steps=[Step(state=_t(i).state, action=_t(i).action, next_state=_t(i).next_state)
                             for i in range(4)])
    buf = make_buffer(SimulatorConfig(), tmp_path / "store", embedder)
    assert seed_buffer(buf, [traj]) == 4
    hit = buf.query([(_t(2).state, _t(2).action)], k=1)[0][0]
    assert hit.episode_id == traj.trajectory_id and hit.instruction == "find the key" and hit.source == "real"
    assert buf.query([(_t(2).state, _t(2).action)], k=1, exclude_episodes=[traj.trajectory_id]) == [[]]
    buf.close()


@pytest.mark.ray
def test_buffer_actor_serves_workers(tmp_path):
    import asyncio

    import ray

    from infra.run.cluster.buffer_actor import BufferActor, BufferClient

    ray.init(num_cpus=1, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    try:
        handle = BufferActor.remote({"buffer_backend": "edge"}, str(tmp_path / "store"),
                                    str(tmp_path / "emb.sqlite"))
        client = BufferClient(handle)

        async def go():
            await client.add([_t(i) for i in range(10)])
            return await client.query([(_t(4).state, _t(4).action)], 2, ["nobody"])

        hits = asyncio.run(go())
        assert hits[0][0] == _t(4)
        assert ray.get(handle.size.remote()) == 10
    finally:
        ray.shutdown()
