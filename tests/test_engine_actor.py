"""The engine Ray actors: the embedded engine served from an actor, the SGLang actor's placement."""

from __future__ import annotations

import pytest

from infra.config import EngineConfig

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.model]


@pytest.fixture(scope="module")
def ray_runtime():
    from infra.run.cluster.runtime import init_ray, shutdown_ray

    init_ray(num_cpus=2, memory_bytes=2 * 1024 ** 3, object_store_bytes=128 * 1024 ** 2)
    yield
    shutdown_ray()


async def test_embedded_engine_actor_serves_http(ray_runtime):
    import ray

    from infra.run.cluster.engine_actor import start_embedded_engine_actor
    from infra.engine.client import EngineClient

    actor, url = start_embedded_engine_actor(EngineConfig(max_batch_size=2), num_cpus=1)
    try:
        async with EngineClient([url], role="test") as client:
            res = await client.generate("The capital of France is", sampling_params={"max_new_tokens": 3, "temperature": 0})
            assert len(res.output_ids) == 3 and "Paris" in res.text
            assert (await client.model_info())["model_path"] == "smollm2"
    finally:
        ray.get(actor.stop.remote())
        ray.kill(actor)


def test_sglang_actor_is_placed_by_its_role_label():
    from infra.run.cluster.engine_actor import sglang_actor_options

    cfg = EngineConfig(sglang_tp_size=2)
    assert sglang_actor_options(cfg, "mexp") == {"num_gpus": 2, "num_cpus": 1, "resources": {"mexp_gpu": 1}}
    assert sglang_actor_options(cfg, "policy")["resources"] == {"policy_gpu": 1}
    # a cluster that does not advertise the label: no resource request (it would never schedule)
    assert "resources" not in sglang_actor_options(cfg, "mexp", {"CPU": 4.0})


@pytest.mark.timeout(900)
async def test_a_killed_engine_actor_is_replaced_on_its_port(ray_runtime, tiny_dir, tmp_path):
    """kill -9 of the policy engine's actor (benchmarks/chaos.py's `engine`): the supervisor starts a
    replacement on the same port, so a client that holds the URL is served again without being told,
    and the replacement serves the run's last published weights (v7 here), not the model it started with."""
    import asyncio
    import os
    import shutil
    import signal

    import ray

    from infra.engine.client import EngineClient
    from infra.run.cluster.engine_actor import EngineSupervisor, start_role_engine
    from learner.weights import version_path

    cfg = EngineConfig(model=str(tiny_dir), max_batch_size=2)

    def start(port=0, model=None, version=0):
        return start_role_engine(cfg, "policy", model or str(tiny_dir), ray.cluster_resources(), port=port,
                                 weight_version=version)
    actor, url = await asyncio.to_thread(start)
    for v in (6, 7):  # what the learner published meanwhile
        shutil.copytree(tiny_dir, version_path(tmp_path, v))
    keeper = EngineSupervisor(start, actor, url, poll_s=0.5, run_dir=tmp_path)
    keeper.watch()
    try:
        os.kill(await actor.__ray_call__.remote(lambda _self: os.getpid()), signal.SIGKILL)
        for _ in range(1200):  # a new actor process loads torch and the model: seconds, minutes on a loaded machine
            if keeper.restarts:
                break
            await asyncio.sleep(0.5)
        assert keeper.restarts == 1 and keeper.actor is not actor
        assert await keeper.actor.url.remote() == url  # the same port
        async with EngineClient([url], role="test", timeout_s=60) as client:
            res = await client.generate("hello", sampling_params={"max_new_tokens": 2, "temperature": 0})
            assert len(res.output_ids) == 2 and res.weight_version == 7
            assert (await client.model_info())["model_path"] == str(version_path(tmp_path, 7).resolve())
    finally:
        await keeper.aclose()
        keeper.stop()
