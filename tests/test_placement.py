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


def test_buffer_and_scheduler_have_labels_of_their_own():
    from infra.run.cluster.runtime import placement_options

    labelled = {"buffer_cpu": 1, "scheduler_cpu": 1, "CPU": 4}
    assert placement_options("buffer", labelled, num_cpus=0.25) == {"num_cpus": 0.25, "resources": {"buffer_cpu": 1}}
    assert placement_options("scheduler", labelled)["resources"] == {"scheduler_cpu": 1}
    assert placement_options("buffer", {"CPU": 4}) == {"num_cpus": 0.5}  # a single machine: by CPU alone


def test_a_labelled_cluster_missing_a_role_s_label_is_refused_naming_both():
    from infra.run.cluster.runtime import MissingRoleLabel, check_role_labels

    every = ["mexp", "policy", "learner", "rollout", "buffer", "scheduler"]
    check_role_labels(every, {"CPU": 2})  # no role label anywhere: placed by CPU alone
    full = {"mexp_gpu": 1, "policy_gpu": 1, "learner_gpu": 1, "rollout_cpu": 8, "buffer_cpu": 1, "scheduler_cpu": 1}
    check_role_labels(every, full)
    without_buffer = {k: v for k, v in full.items() if k != "buffer_cpu"}
    with pytest.raises(MissingRoleLabel, match="role 'buffer' \\(the replay-buffer actor\\) needs label 'buffer_cpu'"):
        check_role_labels(every, without_buffer)
    check_role_labels([r for r in every if r != "buffer"], without_buffer)  # a run that starts no buffer actor
    with pytest.raises(MissingRoleLabel, match="'scheduler_cpu'.*'mexp_gpu'|'mexp_gpu'.*'scheduler_cpu'"):
        check_role_labels(every, {k: v for k, v in full.items() if k not in ("scheduler_cpu", "mexp_gpu")})
    # an override (actors.worker_resources) is required even on an unlabelled cluster: Ray would wait forever
    with pytest.raises(MissingRoleLabel, match="role 'rollout'.*'big_box'"):
        check_role_labels(["rollout"], {"CPU": 2}, {"rollout": {"big_box": 1}})


async def test_train_on_a_cluster_without_a_role_s_label_fails_at_once(cluster, tiny_run, tmp_path):
    """`dreamgym train` joining this cluster (labelled for the engines, the learner and the workers, not for
    the buffer or the scheduler) fails before its data, engines or first actor, naming roles and labels."""
    import time

    from infra.config import load_config
    from infra.run.cluster.runtime import MissingRoleLabel
    from infra.run.driver import train

    c, _node_ids = cluster
    cfg = load_config(None, [*tiny_run, "actors.runtime=ray", f"infra.ray_address={c.address}",
                             'infra.ray_runtime_env="off"', "actors.env_kind=synthetic", "learner.total_updates=1"])
    t0 = time.monotonic()
    with pytest.raises(MissingRoleLabel) as caught:
        await train(cfg, "unlabelled", evaluate=False)
    said = str(caught.value)
    assert "role 'buffer' (the replay-buffer actor) needs label 'buffer_cpu'" in said
    assert "role 'scheduler' (the curriculum scheduler) needs label 'scheduler_cpu'" in said
    assert "mexp_gpu" not in said and "rollout_cpu" not in said  # those the cluster has
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "runs" / "unlabelled").exists()  # no half-made run directory
