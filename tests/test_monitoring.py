"""A run's monitoring: the driver's /metrics, file_sd targets as processes come and go, `dreamgym monitor`."""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest

from infra import metrics
from infra.cli import main
from infra.config import InfraConfig
from infra.run.monitoring import Monitoring
from infra.targets import Targets, discovery_path, read_targets, targets_path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_targets_file_is_prometheus_file_sd(tmp_path):
    t = Targets(tmp_path, "r1")
    t.add("rollout_worker", "w0", "10.0.0.5:4711")
    t.add("engine", "policy", "127.0.0.1:8000", "/metrics")
    t.add("proxied", "x", "127.0.0.1:9000", "/sub/metrics")
    got = json.loads(targets_path(tmp_path).read_text())
    assert {"targets": ["10.0.0.5:4711"], "labels": {"job": "rollout_worker", "run": "r1", "instance_name": "w0"}} in got
    assert [g["labels"].get("__metrics_path__") for g in got if g["labels"]["job"] == "proxied"] == ["/sub/metrics"]
    t.remove("rollout_worker", "w0")  # an elastic worker went away
    assert [g["labels"]["job"] for g in read_targets(tmp_path)] == ["engine", "proxied"]
    t.remove("rollout_worker", "w0")  # twice is fine
    assert len(t) == 2
    # the copy the shipped scrape config globs: <runs>/_prometheus/<run>.json
    assert json.loads(discovery_path(tmp_path).read_text()) == read_targets(tmp_path)
    assert discovery_path(tmp_path) == tmp_path.parent / "_prometheus" / f"{tmp_path.name}.json"


def test_monitoring_serves_the_driver_and_lists_targets_for_dreamgym_monitor(tmp_path, capsys):
    port = _free_port()
    mon = Monitoring(InfraConfig(metrics_port=port), tmp_path, "run-a").start()
    other = metrics.serve_metrics(0)  # stands for a worker actor's own endpoint
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "learner_updates_total" in body
        mon.add("rollout_worker", "w0", f"127.0.0.1:{other.port}")
        mon.add_url("engine", "policy", "http://127.0.0.1:1")  # listed, but nothing answers there
        assert main(["monitor", str(tmp_path)]) == 1  # one target is down
        out = capsys.readouterr().out
        assert "driver" in out and "rollout_worker" in out and "engine" in out and "no" in out
        mon.remove("engine", "policy")
        assert main(["monitor", str(tmp_path)]) == 0
        capsys.readouterr()
        assert main(["monitor", "--json", str(tmp_path)]) == 0
        listed = json.loads(capsys.readouterr().out)
        assert {t["labels"]["job"] for t in listed} == {"driver", "rollout_worker"}
    finally:
        other.close()
        mon.close()
    assert read_targets(tmp_path) == []  # the run ended: nothing left to scrape
    assert main(["monitor", str(tmp_path)]) == 1


def test_monitoring_off_writes_nothing(tmp_path):
    mon = Monitoring(InfraConfig(metrics_port=0), tmp_path, "run-b").start()
    mon.add("driver", "driver", "127.0.0.1:1")
    mon.close()
    assert not targets_path(tmp_path).exists()


@pytest.mark.ray
@pytest.mark.slow
async def test_ray_actors_serve_their_own_process_metrics(redis_url, tmp_path):
    """A scheduler actor pushes tasks in its own process; its /metrics shows them, the driver's does not."""
    from prometheus_client import REGISTRY

    from infra.config import CurriculumConfig
    from infra.run.cluster.runtime import init_ray, shutdown_ray
    from infra.run.cluster.scheduler_actor import spawn_scheduler
    from infra.schema import Task

    init_ray(num_cpus=2, memory_bytes=1024 ** 3, object_store_bytes=96 * 1024 ** 2)
    try:
        seeds = [Task(task_id=f"seed-{i}", instruction=f"find key {i}", family="tw-simple") for i in range(3)]
        actor = spawn_scheduler(redis_url, "mon", CurriculumConfig(enabled=False, batch_size=2, max_backlog=4), seeds,
                                options={"num_cpus": 0}, limit=4)
        await actor.run.remote()
        address = await actor.serve_metrics.remote("127.0.0.1")
        assert address == await actor.serve_metrics.remote("127.0.0.1")  # once per process
        mon = Monitoring(InfraConfig(metrics_port=_free_port()), tmp_path, "run-ray").start()
        try:
            mon.add("scheduler", "curriculum", address)
            assert {t["labels"]["job"] for t in read_targets(tmp_path)} == {"driver", "scheduler"}
            body = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
            pushed = [line for line in body.splitlines() if line.startswith("curriculum_tasks_pushed_total")]
            assert sum(float(line.rsplit(" ", 1)[1]) for line in pushed) == 4  # the actor's own counts
        finally:
            mon.close()
        before = sum(REGISTRY.get_sample_value("curriculum_tasks_pushed_total", {"origin": o}) or 0
                     for o in ("seed", "generated"))
        await actor.next_batch.remote()  # more pushes in the actor's process...
        after = sum(REGISTRY.get_sample_value("curriculum_tasks_pushed_total", {"origin": o}) or 0
                    for o in ("seed", "generated"))
        assert after == before  # ...never show in the driver's registry
    finally:
        shutdown_ray()
