"""Elastic rollout workers inside a live `dreamgym train` (issue 61 part 3), with `actors.runtime=ray`.

Real parts throughout: a real Redis, the embedded policy engine and the learner as Ray actors
serving the tiny random Llama, real TextWorld games played by worker actors. The phase is
ended by the test (the driver's phase guard, `driver.budget`, gives the test its stop event)
once what it checks has happened.

- `dreamgym scale` (the command, in its own process, finding the job from its record) takes the
  pool 1 -> 4 -> 1 -> 0 while the learner trains; the shrinks drain the stopped workers' groups.
  With the pool at 0 and the trajectory stream read, every trajectory pushed was trained or set
  aside: none lost. summary.json's `worker_pool` history says when and why each resize happened.
- `actors.autoscale`: tasks injected into the task stream (beyond the curriculum's one-task
  reserve) grow the pool to `actors.autoscale_max_workers`; once the workers have played them the
  pool shrinks back to one, and the history gives each step's reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time

import pytest

from infra import metrics
from infra.config import load_config
from infra.run.workers import alive_key
from infra.schema import Task, Trajectory, decode_as, encode
from infra.stream_backlog import stream_backlog
from infra.streams import LEARNER_GROUP, StreamProducer, connect, run_prefix, tasks_stream, trajectories_stream

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture
def ray_local():
    """A local Ray with room for four worker actors (0.5 CPU each) beside the engine and the scheduler,
    whatever this machine's core count; `train` keeps a Ray it finds."""
    from infra.run.cluster.runtime import init_ray, shutdown_ray

    shutdown_ray()
    for attempt in range(3):  # Ray gives its raylet 30 s to register, too few on two cores at load 20 and more
        try:
            init_ray(num_cpus=4, memory_bytes=3 * 1024 ** 3, object_store_bytes=128 * 1024 ** 2)
            break
        except Exception as exc:
            shutdown_ray()
            if attempt == 2 or "timed out during startup" not in str(exc):
                raise
            time.sleep(20)  # the failed session's processes exit first
    yield
    shutdown_ray()


class PhaseEnd:
    """The driver's phase guard, plus a stop event this test sets."""

    def __init__(self, budget):
        self.budget, self.event = budget, None

    def __call__(self, seconds: float) -> asyncio.Event:
        self.event = self.budget(seconds)
        return self.event


def ended_by_test(monkeypatch) -> PhaseEnd:
    from infra.run import driver

    end = PhaseEnd(driver.budget)
    monkeypatch.setattr(driver, "budget", end)
    return end


async def until(run: asyncio.Task, check, timeout_s: float, what: str, poll_s: float = 0.5):
    """Poll `check()` until it is true, while the run goes on (a run that ended raises its error here)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if run.done():
            run.result()
            raise AssertionError(f"the run ended before: {what}")
        if value := await check():
            return value
        await asyncio.sleep(poll_s)
    raise AssertionError(f"not within {timeout_s:.0f} s: {what}")


def autoscale_resizes() -> float:
    return metrics.REGISTRY.get_sample_value("rollout_pool_resizes_total", {"cause": "autoscale"}) or 0.0


async def alive(client, prefix: str) -> int | None:
    raw = await client.get(alive_key(prefix))
    return None if raw is None else int(raw)


async def dreamgym_scale(n: int, run_dir, redis_url: str) -> str:
    """`dreamgym scale --workers n`, as a user runs it from another shell: its own process, the job found
    from the record `train` left under infra.run_dir."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "infra.cli", "scale", "--workers", str(n), f"infra.run_dir={run_dir}",
        f"infra.redis_url={redis_url}", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    out, _ = await proc.communicate()
    assert proc.returncode == 0, out.decode()
    return out.decode()


class WorkerIds:
    """Which workers pushed trajectories, read off the stream as it grows (the learner trims what it acked)."""

    def __init__(self, client, prefix: str):
        self.client, self.stream, self.last, self.seen = client, trajectories_stream(prefix), "0-0", set()

    async def __call__(self) -> set[str]:
        for _, entries in await self.client.xread({self.stream: self.last}, count=1000) or []:
            for eid, fields in entries:
                self.last = eid
                self.seen.add(decode_as(fields[b"d"], Trajectory).worker_id)
        return self.seen


@pytest.mark.timeout(1500)
async def test_scale_1_4_1_in_a_live_train_loses_nothing(tiny_run, tmp_path, monkeypatch, ray_local):
    from infra.run.driver import train

    cfg = load_config(None, [*tiny_run, "actors.runtime=ray", "learner.total_updates=100000",
                             "curriculum.max_backlog=2", "curriculum.batch_size=2", "infra.train_budget_s=1200"])
    end = ended_by_test(monkeypatch)
    prefix, runs = run_prefix(cfg.infra.stream_prefix, "scale"), tmp_path / "runs"
    client = connect(cfg.infra.redis_url)
    ids = WorkerIds(client, prefix)
    run = asyncio.create_task(train(cfg, "scale", evaluate=False))
    try:
        async def pushed_by(*workers: str) -> bool:
            return set(workers) <= await ids()

        await until(run, lambda: pushed_by("w0"), 600, "the first worker pushed a group")
        assert "1 -> 4 requested" in await dreamgym_scale(4, runs, cfg.infra.redis_url)
        await until(run, lambda: pushed_by("w0", "w1", "w2", "w3"), 600, "all four workers pushed")
        assert await alive(client, prefix) == 4
        assert "4 -> 1 requested" in await dreamgym_scale(1, runs, cfg.infra.redis_url)
        await until(run, lambda: _is(alive(client, prefix), 1), 300, "the pool shrank to 1")
        await dreamgym_scale(0, runs, cfg.infra.redis_url)  # pause: the last worker drains its group
        await until(run, lambda: _is(alive(client, prefix), 0), 300, "the pool paused")

        async def learner_read_all() -> bool:
            return await stream_backlog(client, trajectories_stream(prefix), LEARNER_GROUP) == 0
        await until(run, learner_read_all, 300, "the learner read every trajectory")
        await asyncio.sleep(2.0)  # the update or set-aside of the last group read
        assert not run.done()
        end.event.set()
        summary = await asyncio.wait_for(run, 600)
    finally:
        if not run.done():
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
        await client.aclose()

    phase = summary["phases"][0]
    pool = phase["worker_pool"]
    moves = [(e["from"], e["to"], e["reason"]) for e in pool["history"]]
    assert moves == [(0, 1, "start: actors.num_workers=1"), (1, 4, "dreamgym scale --workers 4"),
                     (4, 1, "dreamgym scale --workers 1"), (1, 0, "dreamgym scale --workers 0")]
    assert pool["max_workers"] == 4 and pool["workers_started"] == 4
    times = [e["at"] for e in pool["history"]]
    assert times == sorted(times) and summary["started_at"] <= times[0] <= summary["ended_at"]
    stopped = [s for e in pool["history"] for s in e.get("stopped", [])]
    assert sorted(s["worker"] for s in stopped) == ["w0", "w1", "w2", "w3"]
    assert all(s["how"] == "drained" for s in stopped)  # none timed out: their groups finished and pushed
    assert all(s["trajectories_pushed"] > 0 for s in stopped)
    # 0 lost: every trajectory the workers pushed was trained or set aside, none waits half-used
    aside = sum(phase["trajectories_set_aside"].values())
    assert phase["trajectories_pushed"] == sum(s["trajectories_pushed"] for s in stopped) > 0
    assert phase["trajectories_waiting"] == 0
    assert phase["trajectories_pushed"] == summary["trajectories_trained"] + aside, (phase, summary["updates"])
    on_disk = json.loads((runs / "scale" / "summary.json").read_text())
    assert on_disk["phases"][0]["worker_pool"] == pool


async def _is(value, expected) -> bool:
    return await value == expected


@pytest.mark.timeout(1500)
async def test_autoscale_follows_an_injected_backlog_in_a_live_train(tiny_run, tmp_path, monkeypatch, ray_local):
    from infra.run.driver import train

    cfg = load_config(None, [*tiny_run, "actors.runtime=ray", "actors.autoscale=true",
                             "actors.autoscale_max_workers=3", "learner.total_updates=100000",
                             # the curriculum keeps one task waiting: one worker takes it, so no growth of its own
                             "curriculum.max_backlog=1", "curriculum.batch_size=1",
                             "engines.max_batch_size=8", "infra.train_budget_s=1200"])
    end = ended_by_test(monkeypatch)
    prefix = run_prefix(cfg.infra.stream_prefix, "auto")
    client = connect(cfg.infra.redis_url)
    resized0 = autoscale_resizes()
    run = asyncio.create_task(train(cfg, "auto", evaluate=False))
    try:
        ids = WorkerIds(client, prefix)
        await until(run, ids, 600, "the first worker pushed a group")
        assert await alive(client, prefix) == 1  # the curriculum's reserve alone grows nothing
        seed = decode_as((await client.xrange(tasks_stream(prefix), count=1))[0][1][b"d"], Task)
        # enough work that the pool cannot drain it while an actor starts: on an idle machine one worker played
        # 10 tiny tasks before the second was up, the backlog never called for a third and the test waited 600 s
        injected = [dataclasses.replace(seed, task_id=f"injected-{i}") for i in range(40)]
        await StreamProducer(client, tasks_stream(prefix)).add(encode(t) for t in injected)
        await until(run, lambda: _is(alive(client, prefix), 3), 600, "the pool grew to 3")
        await until(run, lambda: _is(alive(client, prefix), 1), 600, "the pool shrank back to 1")
        end.event.set()
        summary = await asyncio.wait_for(run, 600)
    finally:
        if not run.done():
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
        await client.aclose()

    history = summary["phases"][0]["worker_pool"]["history"]
    sizes = [(e["from"], e["to"]) for e in history]
    assert sizes[:3] == [(0, 1), (1, 2), (2, 3)] and (3, 2) in sizes and sizes[-2:] == [(2, 1), (1, 0)], sizes
    assert history[-1]["reason"] == "phase end" and history[-1]["stopped"][0]["how"] == "handed back"
    ups = [e["reason"] for e in history if e["to"] > e["from"] > 0]
    downs = [e for e in history if 0 < e["to"] < e["from"]]
    assert all(r.startswith("autoscale up: ") and "slot(s), engine queue " in r for r in ups), ups
    assert all(e["reason"].startswith("autoscale down: ") and all(s["how"] == "drained" for s in e["stopped"])
               for e in downs), downs
    assert summary["phases"][0]["worker_pool"]["max_workers"] == 3
    assert autoscale_resizes() - resized0 >= 4  # the dashboard's 'Pool resizes by cause' counted each step
    assert summary["trajectories_pushed"] >= len(injected) * cfg.actors.group_size
