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
