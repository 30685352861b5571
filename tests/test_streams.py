"""Redis stream transport against a real Redis server: delivery, ack, reclaim, dead letters, restarts."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import redis as syncredis

from infra import metrics, schema
from infra.redis_server import EmbeddedRedis
from infra.schema import Step, Trajectory
from infra.streams import (StreamConsumer, StreamProducer, connect, dead_letter_stream, stream_status,
                           trajectories_stream)
from infra.task_stats import TaskStatsStore, group_variance


def _traj(i: int) -> Trajectory:
    return Trajectory(task_id=f"task{i % 3}", group_id=f"g{i // 4}", trajectory_id=f"tr{i}",
                      steps=[Step(f"state {i}", "[1]", float(i % 2), True, logprobs=[-0.5], action_token_ids=[81])])


def _decode(b: bytes) -> Trajectory:
    return schema.decode_as(b, Trajectory)


async def _consumer(client, name: str, stream: str, idle_ms: int = 30_000) -> StreamConsumer:
    c = StreamConsumer(client, stream, "learner", name, _decode, reclaim_idle_ms=idle_ms, reclaim_every=1)
    await c.ensure_group()
    return c


async def test_group_delivery_and_ack(redis_url):
    client = connect(redis_url)
    stream = trajectories_stream("t1")
    producer = StreamProducer(client, stream, maxlen=1000)
    consumer = await _consumer(client, "c0", stream)
    await producer.add([schema.encode(_traj(i)) for i in range(10)])
    got = await consumer.read(count=100, block_ms=100)
    assert [d.message.trajectory_id for d in got] == [f"tr{i}" for i in range(10)]
    status = await stream_status(client, stream)
    assert status["length"] == 10 and status["groups"][0]["pending"] == 10  # read but not yet used
    assert await consumer.ack([d.entry_id for d in got[:6]]) == 6
    assert (await stream_status(client, stream))["groups"][0]["pending"] == 4
    # nothing new: a second read returns nothing, and a new consumer in the group sees nothing either
    assert await consumer.read(count=100, block_ms=50) == []
    other = await _consumer(client, "c1", stream)
    assert await other.read(count=100, block_ms=50) == []
    await client.aclose()


async def test_restarted_consumer_resumes_its_own_pending(redis_url):
    client = connect(redis_url)
    stream = trajectories_stream("t2")
    await StreamProducer(client, stream).add([schema.encode(_traj(i)) for i in range(5)])
    first = await _consumer(client, "learner-0", stream)
    got = await first.read(count=3, block_ms=50)
    await first.ack([got[0].entry_id])
    # the process dies; a new one with the same consumer name gets the unacked ones first
    again = await _consumer(client, "learner-0", stream)
    resumed = await again.read(count=10, block_ms=50)
    assert [d.message.trajectory_id for d in resumed] == ["tr1", "tr2"]
    rest = await again.read(count=10, block_ms=50)
    assert [d.message.trajectory_id for d in rest] == ["tr3", "tr4"]
    await client.aclose()


async def test_dead_consumer_entries_are_reclaimed(redis_url):
    client = connect(redis_url)
    stream = trajectories_stream("t3")
    await StreamProducer(client, stream).add([schema.encode(_traj(i)) for i in range(6)])
    dead = await _consumer(client, "dies", stream, idle_ms=200)
    held = await dead.read(count=6, block_ms=50)
    assert len(held) == 6  # dies here, never acks
    survivor = await _consumer(client, "lives", stream, idle_ms=200)
    assert await survivor.read(count=10, block_ms=50) == []  # not idle long enough yet
    await asyncio.sleep(0.3)
    reclaimed = await survivor.read(count=10, block_ms=50)
    assert sorted(d.message.trajectory_id for d in reclaimed) == [f"tr{i}" for i in range(6)]
    assert all(d.reclaimed for d in reclaimed)
    await survivor.ack([d.entry_id for d in reclaimed])
    assert (await stream_status(client, stream))["groups"][0]["pending"] == 0
    await client.aclose()


async def test_corrupt_and_foreign_messages_go_to_dead_letters(redis_url):
    client = connect(redis_url)
    stream = trajectories_stream("t4")
    producer = StreamProducer(client, stream)
    foreign = schema.to_dict(_traj(1))
    foreign["v"] = 42
    await producer.add([schema.encode(_traj(0)), b"\x00garbage\xff", msgpack.packb(foreign), schema.encode(_traj(2))])
    await client.xadd(stream, {b"other": b"no data field"})
    consumer = await _consumer(client, "c", stream)
    got = await consumer.read(count=10, block_ms=50)
    assert [d.message.trajectory_id for d in got] == ["tr0", "tr2"]
    dead = await client.xrange(dead_letter_stream(stream))
    reasons = [fields[b"error"].decode() for _, fields in dead]
    assert len(dead) == 3
    assert reasons[0].startswith("MalformedMessage") and reasons[1].startswith("UnknownSchemaVersion")
    assert dead[0][1][b"d"] == b"\x00garbage\xff"  # the original bytes are kept for inspection
    # dead letters are acked on the source stream: only the two good ones stay pending
    status = await stream_status(client, stream)
    assert status["groups"][0]["pending"] == 2 and status["dead_letters"] == 3
    await client.aclose()


async def test_redis_restart_mid_stream_loses_nothing(tmp_path):
    server = EmbeddedRedis(data_dir=tmp_path / "redis", appendonly=True).start()
    try:
        client = connect(server.url)
        stream = trajectories_stream("restart")
        producer = StreamProducer(client, stream)
        consumer = await _consumer(client, "c", stream)
        await producer.add([schema.encode(_traj(i)) for i in range(20)])
        first = await consumer.read(count=8, block_ms=50)
        await consumer.ack([d.entry_id for d in first])

        retries_before = metrics.STREAM_RECONNECTS._value.get()
        server.stop(cleanup=False)  # Redis goes away with 12 entries unread and 8 acked
        adding = asyncio.create_task(producer.add([schema.encode(_traj(i)) for i in range(20, 30)]))
        await asyncio.sleep(0.5)
        assert not adding.done()  # the producer is retrying with backoff, not failing
        await asyncio.to_thread(server.start)
        await adding
        assert metrics.STREAM_RECONNECTS._value.get() > retries_before
        seen = [d.message.trajectory_id for d in first]
        for _ in range(10):
            batch = await consumer.read(count=100, block_ms=100)
            if not batch:
                break
            seen += [d.message.trajectory_id for d in batch]
            await consumer.ack([d.entry_id for d in batch])
        assert sorted(set(seen)) == sorted(f"tr{i}" for i in range(30))
        assert (await stream_status(client, stream))["groups"][0]["pending"] == 0
        await client.aclose()
    finally:
        server.stop()


async def test_maxlen_bounds_the_stream(redis_url):
    client = connect(redis_url)
    stream = trajectories_stream("t5")
    producer = StreamProducer(client, stream, maxlen=100)
    for _ in range(10):
        await producer.add([b"x" * 10] * 100)
    assert 100 <= await client.xlen(stream) < 300  # approximate trimming
    await client.aclose()


async def test_task_stats_are_atomic_and_correct(redis_url):
    client = connect(redis_url)
    store = TaskStatsStore(client, "stats", recent_groups=2)
    groups = [[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]]
    await asyncio.gather(*(store.record_group("a", g) for g in groups))
    await store.record_group("b", [0.0, 0.0])
    stats = await store.all()
    a = stats["a"]
    flat = [r for g in groups for r in g]
    mean = sum(flat) / len(flat)
    assert a.n == 12 and a.groups == 3 and a.mean == pytest.approx(mean)
    assert a.variance == pytest.approx(sum((r - mean) ** 2 for r in flat) / len(flat))
    assert len(a.recent_group_variances) == 2  # capped at recent_groups
    assert set(a.recent_group_variances) <= {group_variance(g) for g in groups}
    assert stats["b"].group_variance == 0.0
    await client.aclose()


def test_group_variance_reference():
    assert group_variance([1, 0]) == 0.25
    assert group_variance([1, 1, 1]) == 0.0
    assert group_variance([]) == 0.0


def test_embedded_server_stops_cleanly():
    server = EmbeddedRedis().start()
    port = server.port
    assert syncredis.Redis(port=port).ping()
    server.stop()
    with pytest.raises(syncredis.exceptions.ConnectionError):
        syncredis.Redis(port=port, socket_connect_timeout=0.5).ping()
