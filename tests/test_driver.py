"""`dreamgym train` end to end on real parts, then `--resume` of the same run.

Real TextWorld games (env_kind=real: the Mexp engine is not stepped), the embedded
engines serving the tiny random Llama of `conftest.tiny_run` (SmolLM2's tokenizer and
code paths, none of its weight: the quickstart runs the real model), a real Redis,
the real GRPO learner. The first run stops after two updates with a checkpoint
after each; the resumed run must continue from weight version 2 and make exactly one
more update to reach the budget of three, in the same streams, with the run's replay
buffer reopened as it was rather than seeded a second time.
"""

from __future__ import annotations

import json

import pytest

from infra.config import load_config
from learner.weights import published_versions

pytestmark = [pytest.mark.slow]


def _cfg(tiny_run, total_updates):
    return load_config(None, [*tiny_run, "learner.checkpoint_every=1", "learner.keep_weights=1",
                              f"learner.total_updates={total_updates}"])


async def test_train_then_resume_continues_the_run(tiny_run, tmp_path):
    from infra.run.driver import train

    first = await train(_cfg(tiny_run, 2), "resume-me", evaluate=False)
    assert first["updates"] == 2 and first["weight_version"] == 2
    assert [r["version"] for r in first["history"]] == [1, 2]
    assert published_versions(tmp_path / "runs" / "resume-me") == [2]  # learner.keep_weights=1

    second = await train(_cfg(tiny_run, 3), "resume-me", resume=True, evaluate=False)
    assert second["updates"] == 3 and second["weight_version"] == 3
    assert second["phases"][0]["updates"] == 1  # one new update, not three
    # the summary goes on from the first segment: its update rows, trajectories trained and clocks
    assert [r["version"] for r in second["history"]] == [1, 2, 3]
    assert second["trajectories_trained"] > first["trajectories_trained"] > 0
    assert second["train_seconds"] > first["history"][-1]["t"]
    assert second["replay_buffer_size"] == first["replay_buffer_size"] == 0  # real rollouts open no replay buffer
    saved = json.loads((tmp_path / "runs" / "resume-me" / "summary.json").read_text())
    assert saved["weight_version"] == 3
    assert published_versions(tmp_path / "runs" / "resume-me") == [3]

    # Resumed at its last update: the phase is done, so no worker starts and nothing is rolled out.
    third = await train(_cfg(tiny_run, 3), "resume-me", resume=True, evaluate=False)
    assert third["updates"] == 3 and third["weight_version"] == 3
    assert third["phases"][0]["trajectories_pushed"] == 0 and third["phases"][0]["seconds"] == 0.0
    # The summary's counts cover every segment of the run, the phases only their own.
    assert first["trajectories_pushed"] == first["phases"][0]["trajectories_pushed"] > 0
    assert second["trajectories_pushed"] == first["trajectories_pushed"] + second["phases"][0]["trajectories_pushed"]
    assert third["trajectories_pushed"] == second["trajectories_pushed"]


async def test_train_sync_rolls_out_then_trains(tiny_run, tmp_path):
    """`dreamgym train --sync`: the learner's before_step pushes exactly one update's worth of tasks."""
    from infra.run.driver import train

    cfg = _cfg(tiny_run, 2)
    cfg.learner.sync = True
    summary = await train(cfg, "in-sync", evaluate=False)
    assert summary["sync"] and summary["updates"] == 2
    assert summary["trajectories_trained"] == 4 and summary["trajectories_pushed"] >= 4
    # Every pushed trajectory is accounted for: trained, set aside by the learner (by outcome), or held.
    phase = summary["phases"][0]
    assert all(n > 0 for n in phase["trajectories_set_aside"].values())
    assert phase["trajectories_pushed"] == (summary["trajectories_trained"] + sum(phase["trajectories_set_aside"].values())
                                            + phase["trajectories_waiting"])


@pytest.mark.ray
async def test_train_with_ray_worker_actors(tiny_run, tmp_path):
    from infra.run.cluster.runtime import init_ray, shutdown_ray
    from infra.run.driver import train

    init_ray(num_cpus=2, memory_bytes=2 * 1024 ** 3, object_store_bytes=128 * 1024 ** 2)
    try:
        cfg = _cfg(tiny_run, 1)
        cfg.actors.runtime = "ray"
        summary = await train(cfg, "on-ray", evaluate=False)
    finally:
        shutdown_ray()
    assert summary["updates"] == 1 and summary["trajectories_trained"] == 2
    assert summary["trajectories_pushed"] >= 2  # counted from the worker actors' final status
    assert summary["replay_buffer_size"] == 0  # real rollouts: no replay buffer, no Mexp


async def test_a_resumed_run_reopens_its_replay_buffer_instead_of_seeding_it_twice(tiny_run, tmp_path):
    """The DreamGym buffer of `runs/<name>/buffer` survives the run; `--resume` reopens it as it was."""
    from actors.dataset import read_trajectories, trajectories_path
    from infra.run.artifacts import prepare_data
    from infra.run.services import Services

    cfg = _cfg(tiny_run, 1)
    _splits, offline = prepare_data(cfg)
    assert offline == list(read_trajectories(trajectories_path(cfg.infra.data_dir, "textworld")))
    sizes = []
    for _ in range(2):
        async with Services(cfg, "buffered") as svc:
            sizes.append(len(svc.open_buffer(offline)))
    assert sizes[0] == sizes[1] == sum(len(t.steps) for t in offline) > 0


async def test_train_in_score_mode_warm_starts_trains_and_evaluates(tiny_run, tmp_path):
    """`actors.action_mode=score` through `dreamgym train`: the warm start trains on scored
    candidates, workers score through the engine's prefill log-probs, the learner updates on
    score-mode steps (one log-prob per choice), and the held-out evaluation plays in score mode."""
    from infra.run.driver import train
    from learner import policy_sft

    # learner.micro_batch_tokens below one step's tokens: every trajectory is cut into passes of a step
    cfg = load_config(None, [*tiny_run, "actors.action_mode=score", "actors.multi_turn=false",
                             "learner.warm_start_steps=2", "learner.warm_start_batch=2", "learner.total_updates=1",
                             "learner.checkpoint_every=1", "evaluation.max_steps=2", "learner.micro_batch_tokens=16"])
    summary = await train(cfg, "scored")
    assert summary["updates"] == 1 and summary["trajectories_trained"] >= 2
    h = summary["history"][0]
    assert h["passes"] == cfg.learner.epochs_per_batch * h["steps"] > h["trajectories"]  # a pass a step
    assert summary["heldout_after"]["episodes"] == 1
    assert summary["history"][0]["version"] == 1 and summary["history"][0]["loss"] == summary["history"][0]["loss"]
    assert summary["history"][0]["invalid_share"] is None  # only generate-mode replies can name no legal action
    warm = json.loads((policy_sft.cache_dir(cfg) / "warm_start.json").read_text())
    assert warm["steps"] == 2 and warm["first_loss"] > 0


async def test_train_loads_the_policy_it_built_into_configured_servers(tiny_run, tiny_dir, tw_data_dir, tmp_path):
    """With `engines.policy_endpoints` (SGLang on a cluster), the warm-started policy reaches the
    servers through /update_weights_from_disk before anything is evaluated: the held-out
    evaluation measures the model the run built, not the one the server was launched with."""
    import aiohttp

    from infra.engine.server import start_embedded_engine
    from infra.run.driver import train
    from learner import policy_sft

    server = await start_embedded_engine(model=str(tiny_dir), max_batch_size=4,
                                         weights_roots=[str(tw_data_dir), str(tmp_path)])
    try:
        cfg = load_config(None, [*tiny_run, f"engines.policy_endpoints=[{server.url}]", "learner.total_updates=0",
                                 "learner.warm_start_steps=1", "learner.warm_start_batch=2"])
        summary = await train(cfg, "external-policy")
        async with aiohttp.ClientSession() as http, http.get(server.url + "/get_model_info") as r:
            served = (await r.json())["model_path"]
    finally:
        await server.stop()
    built = policy_sft.cache_dir(cfg)
    assert served == str(built.resolve()) and (built / "config.json").exists()
    assert summary["heldout_after"] is not None


def test_a_collection_that_yields_nothing_is_an_error_and_caches_nothing(tiny_run, monkeypatch, tmp_path):
    """Every task's collection failing (say, workers that cannot start) must not leave an empty,
    stamped trajectories file that later runs would silently reuse as "0 offline trajectories"."""
    from actors.dataset import trajectories_path
    from infra.run import artifacts

    cfg = load_config(None, [*tiny_run, f"infra.data_dir={tmp_path / 'data'}"])
    path = trajectories_path(cfg.infra.data_dir, "textworld")
    real_collect = artifacts.collect
    monkeypatch.setattr(artifacts, "collect", lambda *a, **k: [])
    with pytest.raises(RuntimeError, match="produced no trajectories"):
        artifacts.prepare_data(cfg)
    assert not path.exists()
    monkeypatch.setattr(artifacts, "collect", real_collect)
    _splits, offline = artifacts.prepare_data(cfg)
    assert offline and path.exists()
