"""Placement by role label on a real multi-node Ray cluster (ray.cluster_utils.Cluster) on this machine."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MB = 1024 ** 2


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    from infra.run.cluster.runtime import shutdown_ray

    shutdown_ray()  # another module's local runtime, if any
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "memory": 512 * MB,
                                                      "object_store_memory": 80 * MB})
    nodes = {
        "mexp": c.add_node(num_cpus=1, resources={"mexp_gpu": 1}, memory=512 * MB, object_store_memory=80 * MB),
        "learner": c.add_node(num_cpus=1, resources={"learner_gpu": 1, "policy_gpu": 1}, memory=512 * MB,
                              object_store_memory=80 * MB),
        "rollout": c.add_node(num_cpus=2, resources={"rollout_cpu": 4}, memory=512 * MB, object_store_memory=80 * MB),
    }
    ray.init(address=c.address, namespace="placement-test", log_to_driver=False)
    c.wait_for_nodes()
    yield c, {role: n.node_id for role, n in nodes.items()}
    ray.shutdown()
    c.shutdown()


def test_each_role_lands_on_its_labelled_node(cluster):
    import ray

    from infra.run.cluster.runtime import node_of_actor, placement_options

    _c, node_ids = cluster

    @ray.remote
    class Probe:
        def ping(self) -> str:
            return "ok"

    res = ray.cluster_resources()
    placed = {}
    for role in ("mexp", "learner", "policy", "rollout", "rollout"):
        a = Probe.options(**placement_options(role, res)).remote()
        assert ray.get(a.ping.remote(), timeout=60) == "ok"
        placed.setdefault(role, []).append(node_of_actor(a))
    assert placed["mexp"] == [node_ids["mexp"]]
    assert placed["learner"] == [node_ids["learner"]] and placed["policy"] == [node_ids["learner"]]
    assert placed["rollout"] == [node_ids["rollout"]] * 2


def test_missing_label_is_not_required_and_override_wins(cluster):
    from infra.run.cluster.runtime import placement_options

    assert placement_options("mexp", {"CPU": 2}) == {"num_cpus": 0.5}
    assert placement_options("rollout", {"rollout_cpu": 4}) == {"num_cpus": 0.5, "resources": {"rollout_cpu": 1}}
    assert placement_options("rollout", {}, override={"big_box": 1})["resources"] == {"big_box": 1}
    with pytest.raises(ValueError):
        placement_options("painter")
