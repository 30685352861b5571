"""The rollout worker against real Redis: groups, stats, acks, write-back, drain and hand-back."""

from __future__ import annotations

import asyncio
import logging

import pytest

from actors.rollout_worker import RolloutWorker
from infra.budget import StepBudget, run_counts
from infra import metrics
from infra.config import ActorsConfig
from actors.envs.base import AbstractState
from infra.schema import EnvKind, Status, Task, Trajectory, decode_as, encode
from infra.stream_backlog import stream_backlog
from infra.streams import (LEARNER_GROUP, WORKERS_GROUP, StreamConsumer, StreamProducer, connect, tasks_stream,
                          trajectories_stream)
from infra.task_stats import TaskStatsStore
from infra.config import SimulatorConfig
from infra.engine.models import load_tokenizer
from simulator.embedder import Embedder
from simulator.experience_model import ExperienceModel
from simulator.replay_buffer import EdgeBuffer, Transition
from simulator.synthetic_env import SyntheticEnv
from tests.rollout_fakes import LadderEnv, ScriptedPolicy
from tests.test_experience_model import ScriptedClient

PREFIX = "t"


class ListSink:
    def __init__(self):
        self.items = []

    def add(self, transitions):
        self.items += transitions


def make_worker(client, policy=None, delay_s=0.0, wid="w0", **cfg):
    c = ActorsConfig(group_size=cfg.pop("group_size", 3), concurrent_episodes=cfg.pop("concurrent_episodes", 3),
                     max_steps=cfg.pop("max_steps", 4), **cfg)
    return RolloutWorker(wid, client, PREFIX, policy or ScriptedPolicy(version=3), lambda: LadderEnv(2, delay_s), c,
                         reclaim_idle_ms=300)


async def push_tasks(client, n):
    tasks = [Task(task_id=f"task{i}", instruction=f"climb {i}") for i in range(n)]
    await StreamProducer(client, tasks_stream(PREFIX)).add([encode(t) for t in tasks])
    return tasks


async def read_trajs(client):
    entries = await client.xrange(trajectories_stream(PREFIX))
    return [decode_as(f[b"d"], Trajectory) for _, f in entries]


async def test_group_has_g_scored_trajectories(redis_url):
    client = connect(redis_url)
    w = make_worker(client)
    trajs = await w.run_group(Task(task_id="x", instruction="climb"), "g1")
    assert len(trajs) == 3 and {t.group_id for t in trajs} == {"g1"}
    for t in trajs:
        assert t.env_kind == EnvKind.SYNTHETIC and t.policy_version == 3 and 1 <= len(t.steps) <= 4
        assert t.status in (Status.SUCCESS, Status.TRUNCATED)
        assert t.success == (t.total_reward == 1.0)
        s = t.steps[0]
        assert s.logprobs == [-0.5] and s.loss_mask == [1] and s.choice_token_ids[:2] == [81, 82]
        assert s.next_state and s.reasoning.startswith("moved")
    await client.aclose()


async def test_worker_pushes_records_writes_back_and_acks(redis_url):
    client = connect(redis_url)
    await push_tasks(client, 4)
    try:  # write-back needs simulator.replay_buffer.Transition
        import simulator.replay_buffer  # noqa: F401
        sink = ListSink()
    except ImportError:
        sink = None
    w = make_worker(client)
    w.buffer = sink
    await asyncio.wait_for(w.run(max_groups=4), 30)
    trajs = await read_trajs(client)
    assert len(trajs) == 12 and w.trajectories_pushed == 12
    assert sorted({t.task_id for t in trajs}) == [f"task{i}" for i in range(4)]
    # The run-wide counts the summary reports, written in the XADD's transaction (survive a --resume).
    assert await run_counts(client, PREFIX) == {"trajectories_pushed": 12, "real_steps_pushed": 0,
                                                "synthetic_steps_pushed": sum(len(t.steps) for t in trajs)}
    stats = await TaskStatsStore(client, PREFIX).all()
    assert all(stats[f"task{i}"].n == 3 and stats[f"task{i}"].groups == 1 for i in range(4))
    if sink is not None:
        assert len(sink.items) == sum(len(t.steps) for t in trajs)
        assert {x.source for x in sink.items} == {"synthetic"}
    pending = await client.xpending(tasks_stream(PREFIX), WORKERS_GROUP)
    assert pending["pending"] == 0
    await client.aclose()


async def test_a_step_that_replays_a_real_transition_skips_mexp_and_is_not_written_back(redis_url, tmp_path):
    """simulator.replay_real: the first step's (task, state, action) is an offline real transition in the
    buffer, so its outcome is the real one and Mexp answers only the second; only that one is written back."""
    client = connect(redis_url)
    rung = [AbstractState(f"Rung {i} of 2", [(1, "up"), (2, "down")]).render() for i in range(2)]
    task = Task(task_id="task0", instruction="climb", initial_state=rung[0])
    await StreamProducer(client, tasks_stream(PREFIX)).add([encode(task)])
    buffer = EdgeBuffer(tmp_path / "edge", Embedder(cache_path=tmp_path / "emb.sqlite"))
    buffer.add([Transition("task0", "climb", rung[0], "up", "moved up", rung[1], 0.0, False, "real", "offline")])
    mexp = ScriptedClient(["moved up</think><state>\nRung 2 of 2\nActions:\n[1] down\n</state>"
                           "<reward>1</reward><done>true"])
    replayed = metrics.SIMULATOR_REPLAYED_STEPS._value.get()
    model = ExperienceModel(mexp, buffer, SimulatorConfig(top_k=2), load_tokenizer())
    w = RolloutWorker("w0", client, PREFIX, ScriptedPolicy(p_first=1.0), lambda: SyntheticEnv(model, max_steps=4),
                      ActorsConfig(group_size=1, concurrent_episodes=1, max_steps=4), reclaim_idle_ms=300)
    w.buffer = sink = ListSink()
    try:
        await asyncio.wait_for(w.run(max_groups=1), 60)
    finally:
        buffer.close()
    [traj] = await read_trajs(client)
    assert [(s.action, s.reasoning_source, s.reward) for s in traj.steps] == [("up", "replay", 0.0), ("up", "mexp", 1.0)]
    assert traj.steps[0].next_state == rung[1] and traj.success
    assert len(mexp.prompts) == 1 and metrics.SIMULATOR_REPLAYED_STEPS._value.get() == replayed + 1
    assert [(x.state, x.source) for x in sink.items] == [(rung[1], "synthetic")]
    await client.aclose()


async def test_stop_without_drain_hands_task_back_and_another_worker_finishes_it(redis_url):
    client = connect(redis_url)
    await push_tasks(client, 1)
    slow = make_worker(client, delay_s=0.5, wid="slow")
    run = asyncio.create_task(slow.run())
    while not slow._inflight:
        await asyncio.sleep(0.05)
    await slow.stop(drain=False)
    await run
    assert await read_trajs(client) == []
    pending = await client.xpending(tasks_stream(PREFIX), WORKERS_GROUP)
    assert pending["pending"] == 1  # not acked: handed back
    fresh = make_worker(client, wid="fresh")
    await asyncio.wait_for(fresh.run(max_groups=1), 30)
    trajs = await read_trajs(client)
    assert len(trajs) == 3 and {t.worker_id for t in trajs} == {"fresh"}
    assert (await client.xpending(tasks_stream(PREFIX), WORKERS_GROUP))["pending"] == 0
    await client.aclose()


async def test_drain_finishes_inflight_group(redis_url):
    client = connect(redis_url)
    await push_tasks(client, 2)
    w = make_worker(client, delay_s=0.2, concurrent_episodes=3)
    run = asyncio.create_task(w.run())
    while not w._inflight:
        await asyncio.sleep(0.05)
    await w.stop(drain=True)
    await run
    assert len(await read_trajs(client)) == 3 * w.groups_done and w.groups_done == 1
    info = await client.xinfo_groups(tasks_stream(PREFIX))
    assert info[0]["pending"] == 0 and info[0]["lag"] == 1  # the second task is still there for others
    await client.aclose()


async def test_group_already_pushed_is_only_acked(redis_url):
    """A worker that pushed a group and died before acking: the reclaimer acks without re-running."""
    client = connect(redis_url)
    await push_tasks(client, 1)
    a = make_worker(client, wid="a")
    await a.consumer.ensure_group()
    d = (await a.consumer.read(count=1))[0]
    trajs = await a.run_group(d.message, "g")
    from infra.streams import key
    await a._push(trajs, key(PREFIX, f"groupdone:{d.entry_id.decode()}"))  # ... and a dies here, unacked
    await asyncio.sleep(0.4)
    b = make_worker(client, wid="b")
    b.consumer.reclaim_every = 1
    await b.consumer.ensure_group()
    job = asyncio.create_task(b._task_loop(None))
    for _ in range(50):
        if (await client.xpending(tasks_stream(PREFIX), WORKERS_GROUP))["pending"] == 0:
            break
        await asyncio.sleep(0.1)
    b._stopping.set()
    await job
    assert len(await read_trajs(client)) == 3 and b.trajectories_pushed == 0
    await client.aclose()


class BrokenEnv(LadderEnv):
    async def step(self, action):
        raise ConnectionError("engine down")


async def test_failing_group_is_handed_back_and_worker_keeps_serving(redis_url):
    client = connect(redis_url)
    await push_tasks(client, 1)
    c = ActorsConfig(group_size=2, concurrent_episodes=2, max_steps=3)
    broken = RolloutWorker("broken", client, PREFIX, ScriptedPolicy(), BrokenEnv, c, reclaim_idle_ms=300)
    run = asyncio.create_task(broken.run())
    while not broken.groups_failed:
        await asyncio.sleep(0.05)
    await broken.stop(drain=True)
    await run
    assert await read_trajs(client) == []
    healthy = make_worker(client, wid="healthy")
    await asyncio.wait_for(healthy.run(max_groups=1), 30)
    assert len(await read_trajs(client)) == 3
    await client.aclose()


class PoisonTaskPolicy(ScriptedPolicy):
    """Fails every episode of one task (as an engine that rejects its prompt would), plays the others."""

    async def act(self, task, state, candidates, history, affinity_key):
        if task.task_id == "task0":
            raise RuntimeError("engine rejected the prompt")
        return await super().act(task, state, candidates, history, affinity_key)


async def serve_until_a_task_is_dead_lettered(worker: RolloutWorker, client, within_s: float = 30.0) -> list:
    """Run `worker` until a task is dead-lettered and a group is done (or `within_s`); the dead-letter entries."""
    worker.consumer.reclaim_every = 1
    run = asyncio.create_task(worker.run())
    dead_stream = f"{tasks_stream(PREFIX)}:dead"
    for _ in range(int(within_s / 0.1)):
        if await client.xlen(dead_stream) and worker.groups_done:
            break
        await asyncio.sleep(0.1)
    await worker.stop(drain=True)
    await run
    return await client.xrange(dead_stream)


async def test_a_task_that_always_fails_is_nacked_then_dead_lettered_and_others_are_served(redis_url):
    """Bounded redelivery on the task stream: `max_deliveries` failed groups, then `<tasks>:dead` with
    the error; the worker keeps serving the healthy task meanwhile."""
    client = connect(redis_url)
    await push_tasks(client, 2)
    c = ActorsConfig(group_size=2, concurrent_episodes=2, max_steps=3)
    worker = RolloutWorker("w", client, PREFIX, PoisonTaskPolicy(), lambda: LadderEnv(2), c, reclaim_idle_ms=300,
                           max_deliveries=3)
    dead = await serve_until_a_task_is_dead_lettered(worker, client)
    assert len(dead) == 1 and decode_as(dead[0][1][b"d"], Task).task_id == "task0"
    reason = dead[0][1][b"error"].decode()
    assert reason.startswith("MaxDeliveries: handled 3 times") and "engine rejected the prompt" in reason
    assert worker.groups_failed == 3 and worker.tasks_dead_lettered == 1 and worker.groups_done == 1
    assert {t.task_id for t in await read_trajs(client)} == {"task1"}
    assert (await client.xpending(tasks_stream(PREFIX), WORKERS_GROUP))["pending"] == 0
    await client.aclose()


async def test_a_real_worker_sets_aside_tasks_without_a_real_counterpart(redis_url, caplog):
    """After a sim-to-real switch the task stream can still hold curriculum variants (no game file):
    a real-env worker dead-letters them with their reason (logged as the run's course, not an error),
    never crashes an env on them, and plays the rest, a plug-in environment's task without a game file too."""
    client = connect(redis_url)
    tasks = [Task(task_id="variant", instruction="climb", generated=True, parent_id="real"),
             Task(task_id="real", instruction="climb", game_file="ladder.z8"),
             Task(task_id="plugin", instruction="climb")]  # a plug-in env's own task: no game file, still real
    await StreamProducer(client, tasks_stream(PREFIX)).add([encode(t) for t in tasks])
    made = []

    def env():
        made.append(1)
        return LadderEnv(2)

    c = ActorsConfig(group_size=2, concurrent_episodes=2, max_steps=3, env_kind="real")
    worker = RolloutWorker("w", client, PREFIX, ScriptedPolicy(version=1), env, c, reclaim_idle_ms=300)
    run = asyncio.create_task(worker.run(max_groups=2))
    await asyncio.wait_for(run, 30)
    dead = await client.xrange(f"{tasks_stream(PREFIX)}:dead")
    assert [decode_as(f[b"d"], Task).task_id for _, f in dead] == ["variant"]
    assert dead[0][1][b"error"].decode().startswith("NoRealCounterpart: task variant")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR and "dead-lettered" in r.getMessage()]
    assert {t.task_id for t in await read_trajs(client)} == {"real", "plugin"} and worker.tasks_dead_lettered == 1
    assert (await client.xpending(tasks_stream(PREFIX), WORKERS_GROUP))["pending"] == 0
    await client.aclose()


class MissingGameEnv(LadderEnv):
    """The real environment of a task whose game file is gone (a data directory moved after its splits were made)."""

    async def reset(self, task: Task):
        if task.task_id == "gone":
            raise FileNotFoundError(f"no such game file: {task.game_file}")
        return await super().reset(task)


async def test_a_task_no_environment_can_start_pushes_nothing_and_is_dead_lettered_by_name(redis_url):
    """A task whose real environment fails at every reset used to come back as a group of empty env_error
    trajectories, pushed as fast as the environment failed (61,000 in ten minutes of a soak whose data
    directory had moved). Now the group fails: nothing is pushed, the task is nacked and, after
    `max_deliveries`, dead-lettered with the game file and the error; the other task is played."""
    client = connect(redis_url)
    tasks = [Task(task_id="gone", instruction="climb", game_file="/moved/away.z8"),
             Task(task_id="here", instruction="climb", game_file="ladder.z8")]
    await StreamProducer(client, tasks_stream(PREFIX)).add([encode(t) for t in tasks])
    c = ActorsConfig(group_size=2, concurrent_episodes=2, max_steps=3, env_kind="real")
    worker = RolloutWorker("w", client, PREFIX, ScriptedPolicy(version=1), lambda: MissingGameEnv(2), c,
                           reclaim_idle_ms=300, max_deliveries=2)
    dead = await serve_until_a_task_is_dead_lettered(worker, client)
    assert [decode_as(f[b"d"], Task).task_id for _, f in dead] == ["gone"]
    reason = dead[0][1][b"error"].decode()
    assert "EnvUnplayable" in reason and "/moved/away.z8" in reason and "no such game file" in reason, reason
    assert {t.task_id for t in await read_trajs(client)} == {"here"}  # nothing of "gone" was pushed
    assert worker.groups_failed == 2 and worker.tasks_dead_lettered == 1
    await client.aclose()


async def test_a_worker_waits_while_the_learner_is_behind_and_resumes_when_it_drains(redis_url):
    """Backpressure: with more than `max_trajectory_backlog` trajectories undelivered to the learner
    group, the worker takes no task (the rest stay on the task stream); once the learner reads and
    acks them (and the stream is trimmed) it goes on, and stop() ends a wait at once."""
    client = connect(redis_url)
    learner = StreamConsumer(client, trajectories_stream(PREFIX), LEARNER_GROUP, "l0",
                             lambda b: decode_as(b, Trajectory), trim_every_s=0)
    await learner.ensure_group()
    await push_tasks(client, 6)
    waited_before = metrics.ROLLOUT_BACKPRESSURE_SECONDS._value.get()
    w = make_worker(client, max_trajectory_backlog=4)  # groups of 3: the third group must wait
    run = asyncio.create_task(w.run())
    for _ in range(100):
        if metrics.ROLLOUT_BACKPRESSURE_WAITING._value.get() >= 1:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # waiting, not busy: nothing more is pushed or taken
    assert w.trajectories_pushed == 6 and w.groups_done == 2
    assert await stream_backlog(client, trajectories_stream(PREFIX), LEARNER_GROUP) == 6
    assert await stream_backlog(client, tasks_stream(PREFIX)) == 4  # untouched, for any worker
    trained = []
    for _ in range(200):  # the learner drains the stream; the worker follows
        got = await learner.read(count=10, block_ms=50)
        trained += [d.message.trajectory_id for d in got]
        await learner.ack([d.entry_id for d in got])
        if w.groups_done == 6 and len(trained) == 18:
            break
    assert w.groups_done == 6 and len(set(trained)) == 18
    assert w.backpressure_s > 0 and metrics.ROLLOUT_BACKPRESSURE_SECONDS._value.get() > waited_before
    assert await client.xlen(trajectories_stream(PREFIX)) < 18  # acked entries were trimmed
    await push_tasks(client, 3)  # the learner stops reading: the worker waits again ...
    for _ in range(100):
        if metrics.ROLLOUT_BACKPRESSURE_WAITING._value.get() >= 1:
            break
        await asyncio.sleep(0.05)
    assert metrics.ROLLOUT_BACKPRESSURE_WAITING._value.get() >= 1
    await asyncio.wait_for(w.stop(drain=True), 1.0)  # ... until stop()
    await asyncio.wait_for(run, 1.0)
    assert metrics.ROLLOUT_BACKPRESSURE_WAITING._value.get() == 0
    await client.aclose()


async def test_real_groups_start_only_when_they_can_finish_so_a_spent_budget_cuts_at_most_one(redis_url):
    """Three real groups in flight on a 30-step budget (worst case 3 x 4 = 12 each): every group is
    reserved before it starts, so a spent budget cuts no group short except the one that got the
    remainder; without holds every group in flight at the end was cut (truncated before max_steps,
    reward 0, read by GRPO as a failure). The steps pushed are exactly the budget."""
    client = connect(redis_url)
    tasks = [Task(task_id=f"t{i}", instruction="climb", game_file="ladder.z8") for i in range(30)]
    await StreamProducer(client, tasks_stream(PREFIX)).add([encode(t) for t in tasks])
    c = ActorsConfig(group_size=3, concurrent_episodes=9, max_steps=4, env_kind="real", real_transitions=30)
    worker = RolloutWorker("w", client, PREFIX, ScriptedPolicy(p_first=0.3, delay_s=0.01),
                           lambda: LadderEnv(3, 0.01), c, reclaim_idle_ms=300)
    budget = StepBudget(client, PREFIX, 30)
    run = asyncio.create_task(worker.run())
    for _ in range(600):
        if await budget.spent() and not worker._inflight:
            break
        await asyncio.sleep(0.05)
    await asyncio.wait_for(worker.stop(drain=True), 10)
    await asyncio.wait_for(run, 10)
    trajs = await read_trajs(client)
    cut = {t.group_id for t in trajs if t.status == Status.TRUNCATED and len(t.steps) < 4}
    assert await budget.used() == 30 and sum(len(t.steps) for t in trajs) == 30
    assert len(trajs) % 3 == 0 and len(cut) <= 1
    assert await client.hlen(budget.key + ":holds") == 0  # every hold released
    await client.aclose()
