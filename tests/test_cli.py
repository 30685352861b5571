"""The dreamgym command line: help everywhere, status against a real Redis, config errors named."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from infra import schema
from infra.cli import COMMANDS
from infra.schema import Task
from infra.streams import StreamConsumer, StreamProducer, connect, tasks_stream

CLI = [sys.executable, "-m", "infra.cli"]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", COLUMNS="200")
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_top_level_help_lists_every_command():
    out = _run("--help")
    assert out.returncode == 0
    for name in COMMANDS:
        assert name in out.stdout


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_help(command):
    out = _run(command, "--help")
    assert out.returncode == 0, out.stderr
    assert f"dreamgym {command}" in out.stdout


def test_status_reports_streams_pending_and_dead_letters(redis_url):
    async def seed() -> None:
        client = connect(redis_url)
        stream = tasks_stream("dreamgym")
        await StreamProducer(client, stream).add([schema.encode(Task(f"t{i}", "x")) for i in range(3)] + [b"junk"])
        consumer = StreamConsumer(client, stream, "workers", "w0", schema.decode)
        await consumer.ensure_group()
        await consumer.read(count=10, block_ms=10)
        await client.aclose()

    asyncio.run(seed())
    out = _run("status", "--redis-url", redis_url, "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    tasks = report["streams"][0]
    assert report["reachable"] and tasks["length"] == 4 and tasks["dead_letters"] == 1
    assert tasks["groups"][0]["pending"] == 3
    table = _run("status", "--redis-url", redis_url)
    assert "dreamgym:tasks" in table.stdout


def test_status_never_cuts_a_stream_name_short(redis_url):
    # an experiment's regime names its streams (dreamgym:dreamgym_grpo:tasks); 80 columns must show them whole
    env = dict(os.environ, HF_HUB_OFFLINE="1", COLUMNS="80")
    out = subprocess.run([*CLI, "status", "--redis-url", redis_url, "--prefix", "dreamgym:dreamgym_s2r_strong_mexp480"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "dreamgym:dreamgym_s2r_strong_mexp480:tasks" in out.stdout, out.stdout
    assert "dreamgym:dreamgym_s2r_strong_mexp480:trajectories" in out.stdout, out.stdout


def test_status_unreachable_exits_nonzero():
    out = _run("status", "--redis-url", "redis://127.0.0.1:1/0")
    assert out.returncode == 1 and "unreachable" in out.stdout


@pytest.mark.parametrize("args", [["tasks"], ["scale", "--workers", "2"],
                                  ["tasks", "infra.redis_url=redis://:secret@127.0.0.1:1/0"]])
def test_commands_on_an_unreachable_redis_print_one_line_and_fail(args, tmp_path):
    """No traceback and no 120 s of retries: one line naming the URL (never its password), exit 3."""
    url = ["infra.redis_url=redis://127.0.0.1:1/0"] if not any("redis_url" in a for a in args) else []
    out = _run(*args, *url, f"infra.run_dir={tmp_path}", timeout=60)
    assert out.returncode == 3, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith(f"dreamgym {args[0]}: cannot reach Redis at redis://") and "127.0.0.1:1" in lines[0]
    assert "secret" not in out.stderr


def test_config_error_names_the_key():
    out = _run("status", "configs/quickstart.yaml", "learner.lr=oops", "--redis-url", "redis://127.0.0.1:1/0")
    assert out.returncode == 2
    assert "learner.lr" in out.stderr and "'oops'" in out.stderr
