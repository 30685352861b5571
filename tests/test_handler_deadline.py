"""The handler deadline of infra/streams.py (issue 63 part 3): an entry held past `handler_timeout_s`
without ack or nack is nacked and counted, redelivered, and dead-lettered once its deliveries are spent;
a consumer without a deadline (the learner) keeps holding. Against the real Redis the suite starts."""

from __future__ import annotations

import asyncio
import uuid

from actors.rollout_worker import RolloutWorker
from infra import metrics, schema
from infra.config import ActorsConfig
from infra.schema import Task
from infra.streams import StreamConsumer, StreamProducer, connect, dead_letter_stream, tasks_stream
from tests.rollout_fakes import LadderEnv, ScriptedPolicy


def _decode(b: bytes) -> Task:
    return schema.decode_as(b, Task)


def _timeouts(stream: str) -> float:
    return metrics.STREAM_HANDLER_TIMEOUTS.labels(stream)._value.get()


async def _pending(client, stream: str) -> dict:
    rows = await client.xpending_range(stream, "workers", min="-", max="+", count=100)
    return {r["message_id"]: r for r in rows}


async def test_a_message_held_past_the_deadline_is_nacked_counted_then_dead_lettered(redis_url):
    client = connect(redis_url)
    stream = f"deadline-{uuid.uuid4().hex[:8]}:tasks"
    await StreamProducer(client, stream).add([schema.encode(Task(task_id=f"t{i}", instruction="x")) for i in range(2)])
    c = StreamConsumer(client, stream, "workers", "w0", _decode, reclaim_every=1, max_deliveries=2,
                       handler_timeout_s=0.3)
    await c.ensure_group()
    first = await c.read(count=10, block_ms=20)
    assert sorted(d.message.task_id for d in first) == ["t0", "t1"]
    done = next(d for d in first if d.message.task_id == "t0")
    await c.ack([done.entry_id])  # t0 handled in time; t1's handler neither acks nor nacks
    assert await c.read(count=10, block_ms=10) == []  # before the deadline: still held, not nacked
    await asyncio.sleep(0.4)
    again = await c.read(count=10, block_ms=10)  # the deadline nacks t1, and the reclaim hands it out again
    assert [(d.message.task_id, d.deliveries) for d in again] == [("t1", 2)]
    assert _timeouts(stream) == 1
    await asyncio.sleep(0.4)
    assert await c.read(count=10, block_ms=10) == []  # its second deadline spends its deliveries
    assert _timeouts(stream) == 2
    dead = await client.xrange(dead_letter_stream(stream))
    assert len(dead) == 1 and b"HandlerTimeout" in dead[0][1][b"error"] and b"MaxDeliveries" in dead[0][1][b"error"]
    assert await _pending(client, stream) == {}
    await client.aclose()


async def test_without_a_deadline_a_held_message_stays_held(redis_url):
    client = connect(redis_url)
    stream = f"nodeadline-{uuid.uuid4().hex[:8]}:tasks"
    await StreamProducer(client, stream).add([schema.encode(Task(task_id="t0", instruction="x"))])
    c = StreamConsumer(client, stream, "workers", "w0", _decode, reclaim_every=1)
    await c.ensure_group()
    held = await c.read(count=10, block_ms=20)
    await asyncio.sleep(0.4)
    assert await c.read(count=10, block_ms=10) == [] and await c.expire_held() == []
    assert _timeouts(stream) == 0
    assert list(await _pending(client, stream)) == [held[0].entry_id]
    await client.aclose()


class HangingPolicy(ScriptedPolicy):
    """Never answers for one task (an engine call that hangs with no timeout), plays the others."""

    async def act(self, task, state, candidates, history, affinity_key):
        if task.task_id == "task0":
            await asyncio.Event().wait()
        return await super().act(task, state, candidates, history, affinity_key)


async def test_a_worker_whose_group_hangs_is_nacked_at_the_deadline_its_group_cancelled_and_it_serves_on(redis_url):
    """The worker's lease timer applies the deadline (its only task loop waits on the hung group, so no
    read() would): the task is nacked and counted, its group cancelled, the next task served; the
    redelivered task hangs again and is dead-lettered with HandlerTimeout. The same RolloutWorker runs
    in a Ray actor (infra/run/cluster/worker_actor.py), which gets the deadline from the config too."""
    client = connect(redis_url)
    prefix = f"hang-{uuid.uuid4().hex[:8]}"
    await StreamProducer(client, tasks_stream(prefix)).add(
        [schema.encode(Task(task_id=f"task{i}", instruction="climb")) for i in range(2)])
    cfg = ActorsConfig(group_size=2, concurrent_episodes=2, max_steps=3)  # one task loop
    worker = RolloutWorker("w", client, prefix, HangingPolicy(), lambda: LadderEnv(2), cfg, reclaim_idle_ms=300,
                           max_deliveries=2, handler_timeout_s=0.5)
    worker.consumer.reclaim_every = 1
    run = asyncio.create_task(worker.run())
    dead_stream = dead_letter_stream(tasks_stream(prefix))
    for _ in range(150):
        if await client.xlen(dead_stream) and worker.groups_done:
            break
        await asyncio.sleep(0.1)
    await worker.stop(drain=True)
    await run
    dead = await client.xrange(dead_stream)
    assert [schema.decode_as(f[b"d"], Task).task_id for _, f in dead] == ["task0"]
    assert b"HandlerTimeout" in dead[0][1][b"error"] and b"MaxDeliveries: handled 2 times" in dead[0][1][b"error"]
    assert worker.tasks_timed_out == 2 and worker.groups_done == 1 and worker.status()["inflight"] == 0
    assert _timeouts(tasks_stream(prefix)) == 2
    assert await client.xpending(tasks_stream(prefix), "workers") == {"pending": 0, "min": None, "max": None,
                                                                       "consumers": []}
    await client.aclose()

