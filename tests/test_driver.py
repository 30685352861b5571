"""`dreamgym train` end to end on real parts, then `--resume` of the same run.

Real TextWorld games (env_kind=real, so no Mexp SFT is needed: the Mexp engine serves
the base model and is not stepped), the embedded engines serving SmolLM2, a real
Redis, the real GRPO learner. The first run stops after two updates with a checkpoint
after each; the resumed run must continue from weight version 2 and make exactly one
more update to reach the budget of three, in the same streams, with the run's replay
buffer reopened as it was rather than seeded a second time.
"""

from __future__ import annotations

import json

import pytest

from infra.config import load_config
from learner.weights import published_versions

pytestmark = [pytest.mark.slow, pytest.mark.model]


def _cfg(tmp_path, redis_url, total_updates):
    return load_config(None, [
        f"infra.run_dir={tmp_path / 'runs'}", f"infra.data_dir={tmp_path / 'data'}", f"infra.redis_url={redis_url}",
        "infra.train_budget_s=600", "engines.max_batch_size=4", "simulator.checkpoint=smollm2",
        "data.textworld_games=2", "data.textworld_heldout=1", "data.textworld_families=[custom]",
        "data.policies=[expert]", "data.episodes_per_task=1", "data.workers=1",
        "actors.env_kind=real", "actors.num_workers=1", "actors.group_size=2", "actors.concurrent_episodes=2",
        "actors.max_steps=2", "learner.groups_per_update=1", "learner.checkpoint_every=1", "learner.keep_weights=1",
        f"learner.total_updates={total_updates}", "curriculum.variants_per_seed=0"])


@pytest.mark.timeout(1500)  # two full SmolLM2 runs with a 1.6 GB checkpoint per update: ~10 min on 2 cores
async def test_train_then_resume_continues_the_run(redis_url, tmp_path):
    from infra.run.driver import train

    first = await train(_cfg(tmp_path, redis_url, 2), "resume-me", evaluate=False)
    assert first["updates"] == 2 and first["weight_version"] == 2
    assert [r["version"] for r in first["history"]] == [1, 2]
    assert published_versions(tmp_path / "runs" / "resume-me") == [2]  # learner.keep_weights=1

    second = await train(_cfg(tmp_path, redis_url, 3), "resume-me", resume=True, evaluate=False)
    assert second["updates"] == 3 and second["weight_version"] == 3
    assert [r["version"] for r in second["history"]] == [3]  # one new update, not three
    assert second["replay_buffer_size"] == first["replay_buffer_size"] == 0  # real rollouts open no replay buffer
    saved = json.loads((tmp_path / "runs" / "resume-me" / "summary.json").read_text())
    assert saved["weight_version"] == 3
    assert published_versions(tmp_path / "runs" / "resume-me") == [3]


async def test_train_sync_rolls_out_then_trains(redis_url, tmp_path):
    """`dreamgym train --sync`: the learner's before_step pushes exactly one update's worth of tasks."""
    from infra.run.driver import train

    cfg = _cfg(tmp_path, redis_url, 2)
    cfg.learner.sync = True
    summary = await train(cfg, "in-sync", evaluate=False)
    assert summary["sync"] and summary["updates"] == 2
    assert summary["trajectories_trained"] == 4 and summary["trajectories_pushed"] >= 4


@pytest.mark.ray
async def test_train_with_ray_worker_actors(redis_url, tmp_path):
    from infra.run.cluster.runtime import init_ray, shutdown_ray
    from infra.run.driver import train

    init_ray(num_cpus=2, memory_bytes=2 * 1024 ** 3, object_store_bytes=128 * 1024 ** 2)
    try:
        cfg = _cfg(tmp_path, redis_url, 1)
        cfg.actors.runtime = "ray"
        summary = await train(cfg, "on-ray", evaluate=False)
    finally:
        shutdown_ray()
    assert summary["updates"] == 1 and summary["trajectories_trained"] == 2
    assert summary["trajectories_pushed"] >= 2  # counted from the worker actors' final status
    assert summary["replay_buffer_size"] == 0  # real rollouts: no replay buffer, no Mexp


async def test_a_resumed_run_reopens_its_replay_buffer_instead_of_seeding_it_twice(redis_url, tmp_path):
    """The DreamGym buffer of `runs/<name>/buffer` survives the run; `--resume` reopens it as it was."""
    from actors.dataset import read_trajectories, trajectories_path
    from infra.run.artifacts import prepare_data
    from infra.run.services import Services

    cfg = _cfg(tmp_path, redis_url, 1)
    _splits, offline = prepare_data(cfg)
    assert offline == list(read_trajectories(trajectories_path(cfg.infra.data_dir, "textworld")))
    sizes = []
    for _ in range(2):
        async with Services(cfg, "buffered") as svc:
            sizes.append(len(svc.open_buffer(offline)))
    assert sizes[0] == sizes[1] == sum(len(t.steps) for t in offline) > 0
