"""The handler deadline of infra/streams.py (issue 63 part 3): an entry held past `handler_timeout_s`
without ack or nack is nacked and counted, redelivered, and dead-lettered once its deliveries are spent;
a consumer without a deadline (the learner) keeps holding. Against the real Redis the suite starts."""

from __future__ import annotations

import asyncio
import uuid

from infra import metrics, schema
from infra.schema import Task
from infra.streams import StreamConsumer, StreamProducer, connect, dead_letter_stream


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
