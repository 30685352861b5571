"""Deliveries counted where they are used, and the handler deadline, through `dreamgym train` (issue 63
parts 2 and 3): real child processes killed with SIGKILL, as the issue's probes did.

- six kills of a learner in a row, each inside an update once it has read its batch ahead: no good trajectory
  is dead-lettered that was not in an update the learner died in twice (LearnerCrash), and the run
  then trains the rest, losing nothing;
- a batch reader's death: ten trajectories read at once, the learner killed twice inside the update
  of the 4th (with `infra.max_deliveries=2`, so read-ahead counted at read would be dead-lettered at
  the third start): the 4th alone is dead-lettered;
- the handler deadline on the Ray path: a rollout worker actor whose group never ends has its task
  nacked at `infra.handler_timeout_s`, counted, redelivered, and dead-lettered with HandlerTimeout
  after `infra.max_deliveries`; the run finishes.

The job's Redis is the test's own (infra.redis_url), so the streams outlive every kill. Trajectories
are written to the stream by the test (the tiny model's label prompts, tests/test_faults.py), with
no rollout workers, so which entry is where is known."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest
import redis as sync_redis

from infra.engine.models import load_tokenizer
from infra.redis_server import EmbeddedRedis
from infra.schema import EnvKind, Step, Task, Trajectory, decode_as, encode
from infra.streams import LEARNER_GROUP, StreamProducer, connect, dead_letter_stream, tasks_stream, trajectories_stream
from learner.inflight import InflightLedger
from tests.stall_env import FAMILY as STALL_FAMILY
from tests.test_faults import (_no_orphans, account, data_dir, finish, report, start_train, traj,  # noqa: F401
                               train_overrides)

pytestmark = [pytest.mark.faults, pytest.mark.slow]


def inject(url: str, prefix: str, trajs: list[Trajectory]) -> list[str]:
    """Add `trajs` to the run's trajectory stream; their entry ids, in order."""
    async def go() -> list[str]:
        client = connect(url)
        ids = await StreamProducer(client, trajectories_stream(prefix)).add([encode(t) for t in trajs])
        await client.aclose()
        return [i.decode() for i in ids]
    return asyncio.run(go())


def real(t: Trajectory) -> Trajectory:
    t.env_kind = EnvKind.REAL  # the RL phase of these runs plays the real environment
    return t


def good_trajectories(tiny_dir: Path, n: int) -> list[Trajectory]:
    tok = load_tokenizer(str(tiny_dir))
    return [real(traj(tok, f"g{i}", float(i % 2))) for i in range(n)]


def wait_read_ahead(r: sync_redis.Redis, stream: str, since: float, proc, timeout_s: float = 600) -> int:
    """Until the learner group holds entries its current process has read (a first read, or a restarted
    learner reading back its own pending: either renews their idle time); how many it holds."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        assert proc.poll() is None, f"train exited early with {proc.returncode}"
        try:
            rows = r.xpending_range(stream, LEARNER_GROUP, "-", "+", 1000)
        except sync_redis.ResponseError:  # no group yet
            rows = []
        if rows and max(p["time_since_delivered"] for p in rows) < (time.monotonic() - since) * 1000:
            return len(rows)
        time.sleep(0.02)
    raise AssertionError("the learner never read its batch")


def wait_inside(run_dir: Path, entry: str, strikes: int, proc, timeout_s: float = 600) -> None:
    """Until the current process, having struck `entry` `strikes` times, is training it (in-flight file)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        assert proc.poll() is None, f"train exited early with {proc.returncode}"
        try:
            d = json.loads((run_dir / "learner_inflight.json").read_text())
        except (OSError, ValueError):
            d = {}
        if d.get("entries") == [entry] and d.get("strikes", {}).get(entry, 0) == strikes:
            return
        time.sleep(0.003)
    raise AssertionError(f"{entry} never entered an update with {strikes} strikes")


def wait_update(run_dir: Path, since_unix: float, proc, timeout_s: float = 600) -> None:
    """Until the current process (started at `since_unix`) is inside an update: its in-flight file lists entries.
    A fixed pause instead let an idle machine finish the run between kills (the tiny model's updates take
    tens of milliseconds), so a later start exited 0 before it could be killed."""
    path = run_dir / "learner_inflight.json"
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        assert proc.poll() is None, f"train exited early with {proc.returncode}"
        try:
            if path.stat().st_mtime >= since_unix and json.loads(path.read_text()).get("entries"):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.003)
    raise AssertionError("the learner never began an update")


def kill(proc) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def dead_letters(r: sync_redis.Redis, stream: str) -> list[tuple[str, str]]:
    """(source entry id, reason kind) of every dead letter of `stream`."""
    return [(f[b"source_id"].decode(), f[b"error"].decode().split(":")[0])
            for _, f in r.xrange(dead_letter_stream(stream))]


@pytest.mark.timeout(2400)  # seven starts of a job: ~1 min each on a loaded 2-core machine
def test_six_learner_kills_in_a_row_dead_letter_no_good_trajectory_it_did_not_die_in_twice(tmp_path, data_dir,
                                                                                            tiny_dir):
    name, run_dir, log = "six-kills", tmp_path / "runs" / "six-kills", tmp_path / "train.log"
    prefix, total = f"dreamgym:{name}", 6
    overrides = train_overrides(tmp_path, data_dir, tiny_dir, total, "actors.num_workers=0",
                                "learner.groups_per_update=1", "actors.group_size=2", "learner.checkpoint_every=1",
                                "infra.train_budget_s=0")
    with EmbeddedRedis() as server:
        overrides.append(f"infra.redis_url={server.url}")
        # spare: six kills can land in updates twice three times (3 units of 2 dead-lettered), and the run
        # must still fill its updates
        ids = inject(server.url, prefix, good_trajectories(tiny_dir, 2 * total + 6))
        r = sync_redis.Redis.from_url(server.url)
        stream = trajectories_stream(prefix)
        in_flight_at_kill: list[list[str]] = []
        held_at_kill = []
        for life in range(6):
            started, started_unix = time.monotonic(), time.time()
            proc = start_train(overrides, name, log, resume=life > 0)
            held_at_kill.append(wait_read_ahead(r, stream, started, proc))
            wait_update(run_dir, started_unix, proc)
            kill(proc)
            in_flight_at_kill.append(InflightLedger(run_dir).entries)
        proc = start_train(overrides, name, log, resume=True)
        finish(proc, log)
        summary = json.loads((run_dir / "summary.json").read_text())
        dead = dead_letters(r, stream)
        figures = account(server.url, prefix, run_dir)
        r.close()
    died_in_twice = {e for e in ids if sum(e in k for k in in_flight_at_kill) >= 2}
    figures.update(kills=6, held_at_kill=held_at_kill, killed_inside_an_update=sum(map(bool, in_flight_at_kill)),
                   dead=dead, redelivered=summary["trajectories_redelivered"])
    report("six learner kills", figures)
    assert all(reason == "LearnerCrash" and e in died_in_twice for e, reason in dead), dead
    assert figures["lost"] == 0 and figures["trained"] == 2 * total and summary["updates"] == total
    assert min(held_at_kill) > 2  # the learner had read ahead of its update every time


@pytest.mark.timeout(1500)  # 7 min on a loaded 2-core machine, with the games made and collected
def test_a_batch_readers_death_on_the_4th_of_10_dead_letters_the_4th_only(tmp_path, data_dir, tiny_dir):
    """PPO, one trajectory per update: the learner reads all ten at once and is killed twice while the 4th
    (a long one, so its update lasts) is being trained; the third start dead-letters it, trains the rest."""
    name, run_dir, log = "batch-death", tmp_path / "runs" / "batch-death", tmp_path / "train.log"
    prefix = f"dreamgym:{name}"
    overrides = train_overrides(tmp_path, data_dir, tiny_dir, 9, "actors.num_workers=0",
                                "learner.groups_per_update=1", "actors.group_size=1", "learner.checkpoint_every=1",
                                "learner.epochs_per_batch=4", "infra.max_deliveries=2", "infra.train_budget_s=0")
    trajs = good_trajectories(tiny_dir, 10)
    fourth = trajs[3]
    fourth.steps = [Step(**{**vars(fourth.steps[0]), "done": i == 39, "reward": float(i == 39)}) for i in range(40)]
    with EmbeddedRedis() as server:
        overrides.append(f"infra.redis_url={server.url}")
        ids = inject(server.url, prefix, trajs)
        for life in range(2):
            proc = start_train(overrides, name, log, resume=life > 0)
            wait_inside(run_dir, ids[3], life, proc)
            kill(proc)
            assert InflightLedger(run_dir).entries == [ids[3]]  # killed inside the 4th's update
        proc = start_train(overrides, name, log, resume=True)
        finish(proc, log)
        r = sync_redis.Redis.from_url(server.url)
        dead = dead_letters(r, trajectories_stream(prefix))
        r.close()
        figures = account(server.url, prefix, run_dir)
    figures.update(dead=dead)
    report("batch reader death on the 4th of 10", figures)
    assert [e for e, _ in dead] == [ids[3]] and dead[0][1] in ("LearnerCrash", "MaxDeliveries")
    assert figures["lost"] == 0 and figures["trained"] == 9 and figures["updates"] == 9


@pytest.mark.timeout(1500)
def test_the_handler_deadline_nacks_a_ray_workers_hung_group_and_the_run_finishes(tmp_path, tiny_dir, monkeypatch):
    """actors.runtime=ray: the worker actors get infra.handler_timeout_s; `stall-1` never finishes a step
    there, so its task is nacked at 2 s (counted), redelivered, and dead-lettered after 2 deliveries."""
    name, run_dir, log = "deadline", tmp_path / "runs" / "deadline", tmp_path / "train.log"
    # a loaded 2-core machine: Ray's raylet gives its dashboard agent 30 s to report its ports, then aborts
    # (node_manager.cc WaitForDashboardAgentPorts), and `ray.init` fails with "timed out during startup"
    monkeypatch.setenv("RAY_agent_register_timeout_ms", "300000")
    prefix = f"dreamgym:{name}"
    with EmbeddedRedis() as server:
        overrides = [f"infra.run_dir={tmp_path / 'runs'}", f"infra.data_dir={tmp_path / 'data'}",
                     f"infra.redis_url={server.url}", "infra.handler_timeout_s=2", "infra.max_deliveries=2",
                     "infra.reclaim_idle_ms=1500", f"engines.model={tiny_dir}", "engines.max_batch_size=4",
                     f"simulator.checkpoint={tiny_dir}", f"actors.env_family={STALL_FAMILY}", "data.env_tasks=4",
                     "data.env_heldout=1", "data.policies=[expert]", "data.episodes_per_task=1", "data.workers=1",
                     "actors.env_kind=real", "actors.env_isolation=false", "actors.runtime=ray",
                     "actors.num_workers=1", "actors.group_size=2", "actors.concurrent_episodes=4",
                     "actors.max_steps=2", "learner.algo=ppo", "learner.groups_per_update=2",
                     "learner.total_updates=8", "learner.max_staleness=1000", "curriculum.variants_per_seed=0",
                     "evaluation.before=false"]
        proc = start_train(overrides, name, log)
        finish(proc, log)
        r = sync_redis.Redis.from_url(server.url)
        dead = [(decode_as(f[b"d"], Task).task_id, f[b"error"].decode())
                for _, f in r.xrange(dead_letter_stream(tasks_stream(prefix)))]
        pending = r.xpending(tasks_stream(prefix), "workers")["pending"]
        r.close()
    summary = json.loads((run_dir / "summary.json").read_text())
    report("handler deadline, ray workers", {"dead": dead, "updates": summary["updates"], "pending": pending,
                                              "timeouts_logged": log.read_text().count("held past infra.handler")})
    assert summary["updates"] == 8
    assert dead and all(t.startswith("stall-") and "HandlerTimeout" in e and "MaxDeliveries: handled 2 times" in e
                        for t, e in dead), dead
