"""A tiny end-to-end run on real parts: Redis streams, in-process rollout workers, the real GRPO
learner on the tiny random Llama of conftest (SmolLM2's tokenizer, kilobytes of weights). The environment and the policy sampler are the deterministic in-test ones
(tests/rollout_fakes.py) so the run takes seconds; `dreamgym train` is the full-size version.

Checks: the weight version advances, the parameters change, and the learner consumes exactly
trajectories the workers produced (each at most once, every stream entry accounted for).
The learner's acks trim the stream (infra/streams.py trim_acked), so each test first makes an
`audit` consumer group that reads nothing until the end: it keeps every entry for the counts,
and once it has read them trimming leaves exactly what the learner still needs.
"""

from __future__ import annotations

import asyncio
import pytest
import torch

from actors.rollout_worker import RolloutWorker
from infra.config import ActorsConfig, CurriculumConfig, LearnerConfig
from infra.run.workers import LocalWorkerHandle, WorkerPool
from infra.schema import Task, Trajectory, decode_as
from infra.streams import StreamConsumer, connect, trajectories_stream, trim_acked
from simulator.curriculum import CurriculumScheduler
from tests.rollout_fakes import LadderEnv, ScriptedPolicy

pytestmark = [pytest.mark.slow]
PREFIX = "e2e"


async def audit_group(client) -> StreamConsumer:
    """A consumer group made before any push that reads nothing until asked: the trajectory stream
    keeps every entry while it has not read them (the learner's acks alone trim nothing)."""
    audit = StreamConsumer(client, trajectories_stream(PREFIX), "audit", "a0", lambda b: decode_as(b, Trajectory),
                           trim_every_s=None)
    await audit.ensure_group()
    return audit


async def test_tiny_async_run_trains_on_exactly_the_workers_trajectories(redis_url, tiny_dir, tmp_path):
    from learner.learner import Learner
    from learner.policy_model import PolicyModel

    policy_model = PolicyModel(str(tiny_dir), lora_rank=0)
    before = {n: p.detach().clone() for n, p in policy_model.named_parameters() if p.requires_grad}
    client = connect(redis_url)
    lcfg = LearnerConfig(groups_per_update=2, total_updates=2, lr=1e-4, checkpoint_every=1, max_staleness=4)
    consumer = StreamConsumer(client, trajectories_stream(PREFIX), "learner", "l0", lambda b: decode_as(b, Trajectory))
    learner = Learner(lcfg, str(tiny_dir), tmp_path, consumer, None, group_size=4, policy=policy_model)
    audit = await audit_group(client)
    acfg = ActorsConfig(group_size=4, concurrent_episodes=4, max_steps=3)
    policies: list[ScriptedPolicy] = []

    def spawn(wid):
        policies.append(ScriptedPolicy(seed=len(policies), p_first=0.6))
        return LocalWorkerHandle(RolloutWorker(wid, client, PREFIX, policies[-1], lambda: LadderEnv(2), acfg))

    def on_update(s):
        for p in policies:  # what publishing to the policy engine does to the served version
            p.version = s.version

    pool, stop = WorkerPool(spawn), asyncio.Event()
    sampler = CurriculumScheduler(client, CurriculumConfig(enabled=False, batch_size=2, max_backlog=2), PREFIX,
                                  [Task(task_id=f"e{i}", instruction="climb") for i in range(4)])
    await pool.scale_to(2)
    feeder = asyncio.create_task(sampler.run(stop))
    stats = await asyncio.wait_for(learner.run(on_update=on_update), 300)
    stop.set()
    await feeder
    await pool.stop_all(drain=False)

    assert [s.version for s in stats] == [1, 2] and learner.version == 2
    changed = sum(not torch.equal(before[n], p.detach()) for n, p in policy_model.named_parameters() if n in before)
    assert changed > 0
    stream = trajectories_stream(PREFIX)
    produced = {decode_as(f[b"d"], Trajectory).trajectory_id: i for i, f in await client.xrange(stream)}
    assert sum(s["trajectories_pushed"] for s in pool.retired) == len(produced)
    assert (await client.xinfo_stream(stream))["entries-added"] == len(produced)  # the audit group kept them all
    consumed = learner.consumed_ids
    assert len(consumed) == len(set(consumed)) == sum(s.trajectories for s in stats)
    assert set(consumed) <= set(produced)
    groups = {g["name"].decode(): g for g in await client.xinfo_groups(stream)}
    pending, lag = groups["learner"]["pending"], groups["learner"]["lag"]
    discarded = sum(sum(s.discarded.values()) for s in stats) + sum(learner.discarded.values())
    # every stream entry was trained on, discarded (both acked once a checkpoint covers them: one per
    # update here), is held unacked, or was not read yet
    assert len(consumed) + discarded + pending + lag == len(produced)
    # once the audit group has read everything, trimming keeps from the learner's oldest pending (or
    # last delivered) entry on: every entry it holds unacked or has not read yet, nothing before
    await audit.ack([d.entry_id for d in await audit.read(count=10_000, block_ms=50)])
    held = [p["message_id"] for p in await client.xpending_range(stream, "learner", "-", "+", 10_000)]
    floor = min([groups["learner"]["last-delivered-id"], *held], key=_entry_key)
    await trim_acked(client, stream, approximate=False)
    assert [i for i, _ in await client.xrange(stream)] == [i for i in produced.values()
                                                            if _entry_key(i) >= _entry_key(floor)]
    await client.aclose()


def _entry_key(entry_id: bytes) -> tuple[int, int]:
    ms, seq = entry_id.split(b"-")
    return int(ms), int(seq)


async def test_tiny_sync_run_trains_only_on_fresh_trajectories(redis_url, tiny_dir, tmp_path):
    """--sync: roll out, then train; every trajectory an update uses was played by the current weights."""
    from infra.run.driver import SyncFeed
    from learner.learner import Learner
    from learner.policy_model import PolicyModel

    client = connect(redis_url)
    lcfg = LearnerConfig(groups_per_update=2, total_updates=2, lr=1e-4, checkpoint_every=100, max_staleness=0)
    consumer = StreamConsumer(client, trajectories_stream(PREFIX), "learner", "l0", lambda b: decode_as(b, Trajectory))
    learner = Learner(lcfg, str(tiny_dir), tmp_path, consumer, None, group_size=4,
                      policy=PolicyModel(str(tiny_dir), lora_rank=0))
    await audit_group(client)
    acfg = ActorsConfig(group_size=4, concurrent_episodes=4, max_steps=3)
    policies: list[ScriptedPolicy] = []

    def spawn(wid):
        policies.append(ScriptedPolicy(seed=10 + len(policies), p_first=0.6))
        return LocalWorkerHandle(RolloutWorker(wid, client, PREFIX, policies[-1], lambda: LadderEnv(2), acfg))

    def on_update(s):
        for p in policies:
            p.version = s.version

    pool = WorkerPool(spawn)
    sampler = CurriculumScheduler(client, CurriculumConfig(enabled=False, batch_size=2), PREFIX,
                                  [Task(task_id=f"s{i}", instruction="climb") for i in range(4)])
    await pool.scale_to(2)
    feed = SyncFeed(sampler, learner, pool, client, PREFIX)
    await asyncio.wait_for(learner.run(on_update=on_update, before_step=feed), 900)
    await pool.stop_all(drain=False)
    assert learner.version == 2
    by_id = {t.trajectory_id: t for t in (decode_as(f[b"d"], Trajectory)
                                          for _, f in await client.xrange(trajectories_stream(PREFIX)))}
    half = len(learner.consumed_ids) // 2  # both updates use groups_per_update * G trajectories
    assert [by_id[i].policy_version for i in learner.consumed_ids] == [0] * half + [1] * half
    await client.aclose()
