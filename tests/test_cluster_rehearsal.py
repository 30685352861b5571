"""A multi-node rehearsal on one machine (issue 15, items 6 and 7).

A real Ray cluster of five nodes (`ray.cluster_utils.Cluster`), each advertising its role
labels the way `ray start --resources` does on a real cluster: the head `buffer_cpu` and
`scheduler_cpu`, the others `rollout_cpu`, `mexp_gpu`, `policy_gpu` and `learner_gpu` (CPU
nodes here; the labels are what placement reads). `dreamgym train` joins it through `infra.ray_address` with `actors.runtime=ray`, on
real TextWorld offline data, the tiny random Llama as policy and Mexp, and a real Redis, in
sim-to-real: a DreamGym phase (synthetic environments: the buffer actor and the Mexp engine
serve the workers; the random Mexp's output is rejected, so the phase would only end by running
out its time budget: the test ends it once its worker has pushed a group, tests/phase_guard.py),
then a real-environment phase that spends its exact transition budget and trains. Two phases
also check that the scheduler actor feeds a second phase after it was stopped once.

Checks where each actor ran, from summary.json's `placement` (each actor's own
`ray.get_runtime_context()`) against the node ids the cluster gave: rollout workers on the
rollout node, the Mexp and policy engines on theirs, the buffer actor and the scheduler on the
head, by their labels (the buffer reopens the store the driver seeded there), and the
learner on `learner_gpu` (issue 15 item 3), which reads the trajectory stream and writes the
run's checkpoint (the curriculum's state included) from there. A second test
checks that joining a cluster ships the code (`infra.ray_runtime_env: auto`): an actor
imports DreamGym from Ray's runtime_env files, not from this checkout. A third checks that a Ray
connection this process did not make for the run (Ray's auto-init after `ray.shutdown`) is never
taken for it: that made the second test order-dependent in the full suite.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from infra.config import load_config
from learner import checkpoint as ckpt
from tests.phase_guard import first_group_ends

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MB = 1024 ** 2
NODE = {"num_cpus": 1, "memory": 768 * MB, "object_store_memory": 80 * MB}  # two cores, shared: keep it small
LABELS = {"rollout": "rollout_cpu", "mexp": "mexp_gpu", "policy": "policy_gpu", "learner": "learner_gpu"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from ray.cluster_utils import Cluster

    from infra.run.cluster.runtime import shutdown_ray

    shutdown_ray()  # another module's local runtime, if any
    here = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("nodes"))  # nodes started outside the checkout, as on a real cluster
    try:
        # the driver's node holds the replay buffer's store and the curriculum: their labels are on it
        c = Cluster(initialize_head=True, head_node_args={**NODE, "resources": {"buffer_cpu": 1, "scheduler_cpu": 1}})
        nodes = {role: c.add_node(**NODE, resources={label: 1}) for role, label in LABELS.items()}
        c.wait_for_nodes()
    finally:
        os.chdir(here)
    yield c, {"head": c.head_node.node_id, **{role: n.node_id for role, n in nodes.items()}}
    shutdown_ray()
    c.shutdown()


@pytest.fixture(autouse=True)
def own_ray_connection():
    """Each test joins the cluster itself and leaves it. A test that fails mid-run (a timed-out `train`
    whose task is still pending on the session's event loop) stays connected, its job's actors holding
    the rollout node's CPU; the next test would then reuse that connection (`init_ray` keeps a Ray it
    is already in) and wait on a node that is full, or, once Ray's API was called after the shutdown,
    a local Ray that auto-started (now refused by `init_ray` and avoided by `kill_actor`)."""
    from infra.run.cluster.runtime import shutdown_ray

    shutdown_ray()
    yield
    shutdown_ray()


@pytest.mark.timeout(1500)  # ~10 min on two shared cores: two phases, five nodes, a real Redis and TextWorld
async def test_train_places_every_role_on_its_labelled_node(cluster, tiny_run, tmp_path, monkeypatch):
    import ray
    import torch

    from infra.run.driver import train

    c, node = cluster
    monkeypatch.chdir(tmp_path)  # see below: Ray puts the driver's working directory on every worker's path
    cfg = load_config(None, [*tiny_run, "actors.runtime=ray", f"infra.ray_address={c.address}",
                             "actors.env_kind=synthetic", "simulator.max_steps=2", "learner.total_updates=1",
                             "learner.s2r_real_transitions=4", "learner.s2r_max_updates=1",
                             # each phase's guard, never reached when all goes well: the DreamGym phase ends
                             # at its first pushed group (below), the real one on its spent transitions; at
                             # 90 s a loaded machine (load 5) ended the real phase before its new worker actor
                             # had played a step
                             "infra.train_budget_s=240", "learner.checkpoint_every=1"])
    ended = first_group_ends(monkeypatch, cfg, "rehearsal")
    try:
        summary = await train(cfg, "rehearsal", evaluate=False)
    finally:
        await ended.aclose()
    assert not ray.is_initialized()  # train joined the cluster itself, and left it
    dream, real = summary["phases"]
    assert dream["env_kind"] == "synthetic" and summary["replay_buffer_size"] > 0
    # the DreamGym phase's worker actor played through the Mexp engine and the buffer actor and pushed a
    # group (its episodes end as sim_error), which ended the phase before its guard
    assert ended.fired and dream["trajectories_pushed"] >= cfg.actors.group_size
    assert dream["seconds"] < cfg.infra.train_budget_s
    assert real["env_kind"] == "real" and real["real_transitions"] == 4 and real["transition_budget_spent"]

    placed = json.loads((tmp_path / "runs" / "rehearsal" / "summary.json").read_text())["placement"]
    assert placed == summary["placement"]
    assert placed["driver"] == node["head"]  # this process attached to the head node
    actors = placed["actors"]
    assert actors["rollout_worker"] == [node["rollout"]] * 2  # one worker in each phase
    assert actors["mexp_engine"] == [node["mexp"]]
    assert actors["policy_engine"] == [node["policy"]]
    assert actors["buffer"] == [node["head"]]
    assert actors["scheduler"] == [node["head"]]
    assert actors["learner"] == [node["learner"]]
    assert set(actors) == {"rollout_worker", "mexp_engine", "policy_engine", "buffer", "scheduler", "learner"}
    # the learner actor read the stream and wrote the run's final checkpoint from its node, with the
    # curriculum's state the driver registered. The real phase's one group decides whether it updated:
    # once when its sampled rewards varied (its trajectories trained), not at all when they did not
    assert real["trajectories_pushed"] >= 1
    assert summary["updates"] == (1 if summary["trajectories_trained"] else 0)
    saved = torch.load(ckpt.latest(tmp_path / "runs" / "rehearsal") / ckpt.STATE_FILE, weights_only=False)
    assert saved["train_state"]["extra"]["curriculum"]["pool"]
    assert placed["nodes"][node["rollout"]] == ["rollout_cpu"]
    assert placed["nodes"][node["head"]] == ["buffer_cpu", "scheduler_cpu"]


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_joining_a_cluster_ships_the_code_as_a_runtime_env(cluster, mode, tmp_path, monkeypatch):
    """Ray puts the driver's working directory first on every worker's path: run from the checkout,
    this machine's nodes would import it whatever is shipped. A real node has no checkout at that
    path, so the driver here runs from an empty directory, as it effectively does on a cluster."""
    import ray

    import infra
    from infra.run.cluster.runtime import code_runtime_env, init_ray, placement_options, shutdown_ray

    c, node = cluster

    @ray.remote
    class Where:
        def files(self) -> dict:
            import actors, learner, simulator
            import infra.run.cluster.worker_actor as worker_actor

            return {m.__name__: m.__file__ for m in (actors, learner, simulator, infra, worker_actor)}

    checkout = Path(infra.__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)
    init_ray(c.address, runtime_env=mode)
    try:
        assert ray.get_runtime_context().gcs_address == c.address  # this cluster, joined by this test
        with pytest.raises(RuntimeError, match="already in the Ray at"):
            init_ray("127.0.0.1:1", runtime_env=mode)  # never taken for another cluster
        if mode == "off":  # nor, by a run that ships its code, for a connection made without it
            with pytest.raises(RuntimeError, match="without DreamGym's code"):
                init_ray(c.address, runtime_env="auto")
        env = ray.get_runtime_context().runtime_env
        probe = Where.options(**placement_options("rollout", ray.cluster_resources())).remote()
        files = ray.get(probe.files.remote(), timeout=300)
    finally:
        shutdown_ray()
    if mode == "off":
        assert not env.get("py_modules")
        assert all(Path(f).resolve().is_relative_to(checkout) for f in files.values()), files
        return
    shipped = code_runtime_env(mode)["py_modules"]
    assert sorted(Path(p).name for p in shipped) == ["actors", "infra", "learner", "simulator"]
    assert len(env["py_modules"]) == 4 and all(u.startswith("gcs://_ray_pkg_") for u in env["py_modules"])  # uploaded
    for name, f in files.items():  # every package from Ray's unpacked copy on that node, none from the checkout
        assert "runtime_resources" in Path(f).parts and not Path(f).resolve().is_relative_to(checkout), (name, f)


def test_a_ray_call_after_shutdown_is_never_taken_for_the_run(cluster):
    """The order dependence the suite showed: a cleanup calling Ray's API after `ray.shutdown` (a
    cancelled run unwinding late) makes Ray auto-init, which joins this cluster with no runtime_env;
    the next `init_ray` kept that connection, so an 'auto' run shipped no code. `kill_actor` does not
    call Ray once it is down, and `init_ray` refuses a connection that lacks the code."""
    import ray

    from infra.run.cluster.runtime import init_ray, kill_actor, shutdown_ray

    c, _node = cluster

    @ray.remote(num_cpus=0)
    class Idle:
        def ping(self) -> int:
            return 1

    init_ray(c.address, runtime_env="auto")
    actor = Idle.remote()
    assert ray.get(actor.ping.remote(), timeout=120) == 1
    shutdown_ray()
    kill_actor(actor)  # the actor went with its job
    assert not ray.is_initialized()
    with pytest.raises(Exception):
        ray.kill(actor)  # what the cleanups used to do: Ray joins the newest cluster by itself ...
    try:
        assert ray.is_initialized() and not ray.get_runtime_context().runtime_env.get("py_modules")
        # ... and is not taken for the run: it lacks the code, or (with another test's cluster started since
        # on this machine, as under `pytest -n 2`) it joined that newer cluster, not this one
        with pytest.raises(RuntimeError, match="without DreamGym's code|is already in the Ray at"):
            init_ray(c.address, runtime_env="auto")
    finally:
        shutdown_ray()
