"""Shared fixtures: a real Redis server per test session, the real models loaded once."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pathlib import Path

import pytest
import redis

from infra.engine.models import save_tiny_model
from infra.processes import patient_gcs_start
from infra.redis_server import EmbeddedRedis

# the tests' own Ray clusters (ray.cluster_utils.Cluster) start beside a loaded suite: the same GCS
# patience as every local runtime the product starts
patient_gcs_start()


@pytest.fixture(scope="session")
def redis_server():
    """A private Redis server on a free port for the whole test session."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server):
    """The session server, flushed before each test."""
    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server.url


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct, loaded once."""
    from infra.engine.models import load_model

    return load_model("smollm2")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """The tiny random Llama of infra.engine.models.save_tiny_model (SmolLM2's tokenizer), made once."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tw_data_dir(tmp_path_factory) -> Path:
    """One data directory for the session's small TextWorld runs: the games and the offline
    trajectories of `tiny_run`'s data settings are made once (the first run builds, the rest reuse)."""
    return tmp_path_factory.mktemp("tw-data")


@pytest.fixture
def tiny_run(tmp_path, redis_url, tiny_dir, tw_data_dir) -> list[str]:
    """Overrides for a small real `dreamgym train`: two real TextWorld games (one held out), the
    embedded engines serving the tiny model as both policy and Mexp (so no Mexp SFT), one worker,
    groups of two, one group per update. Tests append their own overrides (the last one wins)."""
    return [f"infra.run_dir={tmp_path / 'runs'}", f"infra.data_dir={tw_data_dir}", f"infra.redis_url={redis_url}",
            "infra.train_budget_s=600", f"engines.model={tiny_dir}", "engines.max_batch_size=4",
            f"simulator.checkpoint={tiny_dir}", "data.textworld_games=2", "data.textworld_heldout=1",
            "data.textworld_families=[custom]", "data.policies=[expert]", "data.episodes_per_task=1",
            "data.workers=1", "actors.env_kind=real", "actors.num_workers=1", "actors.group_size=2",
            "actors.concurrent_episodes=2", "actors.max_steps=2", "learner.groups_per_update=1",
            "curriculum.variants_per_seed=0"]
