"""Shared fixtures: a real Redis server per test session, the real models loaded once."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import redis

from infra.redis_server import EmbeddedRedis


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
