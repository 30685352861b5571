"""`actors.runtime: ray`: the driver's rollout workers as Ray actors, on real parts.

A real Redis, a real embedded engine serving SmolLM2 over HTTP, real TextWorld games,
a real Qdrant Edge store opened by the buffer actor. Checks that a worker actor builds
its policy and environments from the fleet's recipe and delivers a full group, and
that the buffer actor serves retrieval and write-back for the store the driver seeded.
"""

from __future__ import annotations

import asyncio

import pytest

from infra.config import load_config
from infra.schema import Status, Task, Trajectory, decode_as, encode
from infra.streams import StreamProducer, connect, tasks_stream, trajectories_stream
from simulator.replay_buffer import EdgeBuffer, Transition

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.model]
PREFIX = "fleet"


@pytest.fixture(scope="module")
def ray_local():
    from infra.run.cluster.runtime import init_ray, shutdown_ray

    init_ray(num_cpus=2, memory_bytes=2 * 1024 ** 3, object_store_bytes=128 * 1024 ** 2)
    yield
    shutdown_ray()


@pytest.fixture
async def engine(smollm2):
    from infra.engine.server import start_embedded_engine

    handle = await start_embedded_engine(loaded=smollm2, max_batch_size=4)
    yield handle
    await handle.stop()


def _transition(i: int, episode: str = "seed") -> Transition:
    state = f"Room: cellar {i}\nActions:\n[1] open locker\n[2] go west"
    return Transition(f"t{i}", "open the locker", state, "open locker", "", state.replace("open", "close"), 0.0,
                      False, "real", f"{episode}-{i}")


async def test_worker_actor_plays_a_real_group_through_the_engine(redis_url, ray_local, engine, tmp_path):
    from actors.envs.textworld_env import make_textworld_tasks
    from infra.run.cluster.rollout_fleet import RolloutFleet

    splits = make_textworld_tasks(tmp_path, 1, 0, ["tw-simple"], seed=3)
    cfg = load_config(None, ["actors.runtime=ray", "actors.env_kind=real", "actors.group_size=2",
                             "actors.concurrent_episodes=2", "actors.max_steps=2", f"infra.data_dir={tmp_path}"])
    fleet = RolloutFleet(cfg, redis_url, PREFIX, [engine.url], [engine.url], None, tmp_path / "buffer")
    client = connect(redis_url)
    try:
        assert fleet.buffer_actor is None  # real environments need no replay buffer
        await StreamProducer(client, tasks_stream(PREFIX)).add([encode(splits.train[0])])
        worker = fleet.spawn("ray-w0")
        trajs: list[Trajectory] = []
        deadline = asyncio.get_running_loop().time() + 240  # an actor start on a loaded machine takes minutes
        while asyncio.get_running_loop().time() < deadline:
            trajs = [decode_as(f[b"d"], Trajectory) for _, f in await client.xrange(trajectories_stream(PREFIX))]
            if len(trajs) >= 2:
                break
            await asyncio.sleep(0.1)
        status = await worker.stop(drain=True)
        assert len(trajs) == 2, f"worker delivered {len(trajs)} trajectories; status {status}"
        for t in trajs:
            assert t.worker_id == "ray-w0" and t.task_id == splits.train[0].task_id
            assert t.status in (Status.SUCCESS, Status.FAILURE, Status.TRUNCATED)
            assert 1 <= len(t.steps) <= 2
            assert all(s.logprobs and s.logprobs[0] <= 0.0 for s in t.steps)  # the policy engine's log-probs
        assert status["trajectories_pushed"] == 2
    finally:
        await client.aclose()
        fleet.close()


async def test_buffer_actor_serves_retrieval_and_write_back_then_hands_the_store_back(redis_url, ray_local,
                                                                                      engine, tmp_path):
    from infra.run.cluster.buffer_actor import BufferClient
    from infra.run.cluster.rollout_fleet import ActorRecipe, RolloutFleet
    from simulator.embedder import Embedder

    store = tmp_path / "buffer"
    seeded = EdgeBuffer(store, Embedder(cache_path=tmp_path / "emb.sqlite"))
    seeded.add([_transition(i) for i in range(5)])
    cfg = load_config(None, ["actors.runtime=ray", "simulator.top_k=2", "simulator.max_steps=2"])
    fleet = RolloutFleet(cfg, redis_url, PREFIX, [engine.url], [engine.url], seeded, store, tmp_path / "emb.sqlite")
    try:
        assert fleet.buffer_actor is not None and fleet.buffer_size() == 5
        env = ActorRecipe(cfg, "w0", [engine.url], [engine.url], fleet.buffer_actor).env()  # what a worker actor builds
        hits = await env.mexp.retrieve(_transition(2).state, "open locker", episode_id="seed-2")
        assert len(hits) == 2 and all(isinstance(h, Transition) for h in hits)
        assert "seed-2" not in {h.episode_id for h in hits}  # the querying episode never retrieves itself
        await BufferClient(fleet.buffer_actor).add([_transition(9, "synthetic")])
        assert fleet.buffer_size() == 6
    finally:
        fleet.close()
    reopened = EdgeBuffer(store, Embedder(cache_path=tmp_path / "emb.sqlite"))
    assert len(reopened) == 6  # written back through the actor, on disk after close
    reopened.close()
