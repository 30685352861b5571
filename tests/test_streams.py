"""Redis stream transport against a real Redis server: delivery, ack, reclaim, dead letters, restarts."""

from __future__ import annotations

import asyncio

import uuid

import msgpack
import pytest
import redis as syncredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infra import metrics, schema
from infra.redis_server import EmbeddedRedis
from infra.schema import Step, Trajectory
from infra.stream_backlog import stream_backlog, stream_status
from infra.streams import (StreamConsumer, StreamProducer, connect, dead_letter_stream, trajectories_stream,
                          trim_acked)
from infra.task_stats import TaskStatsStore, group_variance
from tests.test_schema import POISON, _poisoned


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
    assert syncredis.Redis.from_url(server.url).ping()
    server.stop()
    with pytest.raises(syncredis.exceptions.ConnectionError):
        syncredis.Redis.from_url(server.url, socket_connect_timeout=0.5).ping()


# ----- bounded redelivery: nack, max_deliveries, crash loops, leases -----
async def _pending(client, stream, group="learner") -> dict:
    return {p["message_id"]: p for p in await client.xpending_range(stream, group, "-", "+", 100)}


async def test_a_handler_that_always_fails_is_retried_then_dead_lettered(redis_url):
    """The issue's probe: a message whose handler always raises used to come back forever."""
    client = connect(redis_url)
    stream = trajectories_stream("nack")
    await StreamProducer(client, stream).add([schema.encode(_traj(i)) for i in range(3)])
    c = StreamConsumer(client, stream, "learner", "c", _decode, reclaim_every=1, max_deliveries=3)
    await c.ensure_group()
    handled: dict[str, int] = {}
    for _ in range(12):
        for d in await c.read(count=10, block_ms=20):
            tid = d.message.trajectory_id
            handled[tid] = handled.get(tid, 0) + 1
            assert d.deliveries == handled[tid]  # the PEL's counter, not a guess
            if tid == "tr1":
                await c.nack([d], RuntimeError("handler exploded"))
            else:
                await c.ack([d.entry_id])
    assert handled == {"tr0": 1, "tr1": 3, "tr2": 1}  # handled exactly max_deliveries times, no more
    dead = await client.xrange(dead_letter_stream(stream))
    assert len(dead) == 1
    fields = dead[0][1]
    assert schema.decode_as(fields[b"d"], Trajectory).trajectory_id == "tr1"  # the original bytes
    assert fields[b"error"].decode().startswith("MaxDeliveries: handled 3 times")
    assert "RuntimeError: handler exploded" in fields[b"error"].decode()
    assert await _pending(client, stream) == {}  # acked: nothing stays pending
    await client.aclose()


async def test_a_retried_message_goes_to_another_consumer_and_can_succeed(redis_url):
    client = connect(redis_url)
    stream = trajectories_stream("nack2")
    await StreamProducer(client, stream).add([schema.encode(_traj(0))])
    flaky = StreamConsumer(client, stream, "learner", "flaky", _decode, reclaim_every=1)
    good = StreamConsumer(client, stream, "learner", "good", _decode, reclaim_every=1)
    await flaky.ensure_group()
    [d] = await flaky.read(count=1, block_ms=20)
    assert await flaky.nack([d], "ConnectionError: engine down") == []  # 1 of 5: retried, not dead
    [again] = await good.read(count=1, block_ms=20)
    assert again.entry_id == d.entry_id and again.deliveries == 2 and again.reclaimed
    await good.ack([again.entry_id])
    assert await _pending(client, stream) == {} and await client.xlen(dead_letter_stream(stream)) == 0
    await client.aclose()


async def test_a_consumer_that_crashes_on_a_message_does_not_crash_loop(redis_url):
    """The issue's learner probe: each restart re-read its own pending entry first and died again.
    Now each re-read raises the delivery counter, and past max_deliveries the entry is
    dead-lettered before the restarted consumer's caller ever sees it."""
    client = connect(redis_url)
    stream = trajectories_stream("crash")
    await StreamProducer(client, stream).add([schema.encode(_traj(i)) for i in range(2)])
    seen = []
    for incarnation in range(5):  # same consumer name each time, as the learner's "learner-0"
        c = StreamConsumer(client, stream, "learner", "learner-0", _decode, max_deliveries=3)
        await c.ensure_group()
        got = await c.read(count=10, block_ms=20)
        seen.append(sorted((d.message.trajectory_id, d.deliveries) for d in got))
        for d in got:
            if d.message.trajectory_id == "tr1":
                await c.ack([d.entry_id])  # the good one is used; tr0 "crashes the process": no ack, no nack
    assert seen[0] == [("tr0", 1), ("tr1", 1)]
    assert seen[1] == [("tr0", 2)] and seen[2] == [("tr0", 3)]
    assert seen[3] == [] and seen[4] == []  # the 4th restart finds it over the bound: dead, not delivered
    dead = await client.xrange(dead_letter_stream(stream))
    assert len(dead) == 1 and b"none reported" in dead[0][1][b"error"]
    assert await _pending(client, stream) == {}
    await client.aclose()


async def test_held_entries_keep_their_lease_and_their_count(redis_url):
    """A learner holding entries for longer than reclaim_idle_ms (waiting for the rest of a GRPO
    group, or for a checkpoint) must not have them reclaimed by itself or anyone else, and
    their delivery counters must not grow: otherwise healthy messages would be dead-lettered."""
    client = connect(redis_url)
    stream = trajectories_stream("lease")
    await StreamProducer(client, stream).add([schema.encode(_traj(i)) for i in range(3)])
    holder = StreamConsumer(client, stream, "learner", "holder", _decode, reclaim_idle_ms=150, reclaim_every=1,
                            max_deliveries=2)
    thief = StreamConsumer(client, stream, "learner", "thief", _decode, reclaim_idle_ms=150, reclaim_every=1)
    await holder.ensure_group()
    held = await holder.read(count=10, block_ms=20)
    assert len(held) == 3
    for _ in range(6):
        await asyncio.sleep(0.1)
        assert await holder.read(count=10, block_ms=10) == []  # its own entries do not come back
    pending = await _pending(client, stream)
    assert {p["times_delivered"] for p in pending.values()} == {1}
    assert {p["consumer"] for p in pending.values()} == {b"holder"}
    # the holder stops reading (a long update): the entries go idle and another consumer may take them
    await asyncio.sleep(0.3)
    stolen = await thief.read(count=10, block_ms=10)
    assert len(stolen) == 3 and all(d.deliveries == 2 for d in stolen)
    await thief.ack([d.entry_id for d in stolen])
    await holder.ack([d.entry_id for d in held])  # late ack of the same entries: harmless
    assert await _pending(client, stream) == {} and await client.xlen(dead_letter_stream(stream)) == 0
    await client.aclose()


async def test_a_handed_back_entry_is_not_taken_back_by_the_lease(redis_url):
    """The rollout worker hands a failed task back by XCLAIMing it to a parking consumer; the
    lease renewal must not pull it back (it only renews entries this consumer still owns)."""
    client = connect(redis_url)
    stream = trajectories_stream("handback")
    await StreamProducer(client, stream).add([schema.encode(_traj(0))])
    c = StreamConsumer(client, stream, "learner", "w0", _decode, reclaim_idle_ms=100, reclaim_every=1)
    await c.ensure_group()
    [d] = await c.read(count=1, block_ms=20)
    await client.xclaim(stream, "learner", "parked", 0, [d.entry_id], idle=10 ** 9, justid=True)
    [again] = await c.read(count=1, block_ms=20)  # reclaimed from the parking consumer, not swallowed
    assert again.entry_id == d.entry_id and again.deliveries == 2
    await client.aclose()


async def test_own_pending_is_read_in_pages_without_repeats(redis_url):
    client = connect(redis_url)
    stream = trajectories_stream("pages")
    await StreamProducer(client, stream).add([schema.encode(_traj(i)) for i in range(7)])
    first = StreamConsumer(client, stream, "learner", "l0", _decode)
    await first.ensure_group()
    assert len(await first.read(count=10, block_ms=20)) == 7  # dies holding all seven
    again = StreamConsumer(client, stream, "learner", "l0", _decode)
    pages = [await again.read(count=3, block_ms=20) for _ in range(4)]
    ids = [d.message.trajectory_id for page in pages for d in page]
    assert ids == [f"tr{i}" for i in range(7)]  # each once, in order, though none was acked
    assert all(d.deliveries == 2 for page in pages for d in page)
    await client.aclose()


async def test_dead_letter_moves_deliveries_the_caller_cannot_use(redis_url):
    client = connect(redis_url)
    stream = trajectories_stream("dl")
    await StreamProducer(client, stream).add([schema.encode(_traj(i)) for i in range(4)])
    c = await _consumer(client, "c", stream)
    got = await c.read(count=10, block_ms=20)
    before = metrics.STREAM_DEAD_LETTERS.labels(stream, "NonFiniteLoss")._value.get()
    await c.dead_letter(got[:2], "NonFiniteLoss: loss was nan in update 4")
    dead = await client.xrange(dead_letter_stream(stream))
    assert [schema.decode_as(f[b"d"], Trajectory).trajectory_id for _, f in dead] == ["tr0", "tr1"]
    assert all(f[b"error"] == b"NonFiniteLoss: loss was nan in update 4" and f[b"consumer"] == b"c" for _, f in dead)
    assert metrics.STREAM_DEAD_LETTERS.labels(stream, "NonFiniteLoss")._value.get() == before + 2
    assert set(await _pending(client, stream)) == {d.entry_id for d in got[2:]}
    await client.aclose()


def test_max_deliveries_must_be_positive():
    with pytest.raises(ValueError, match="max_deliveries"):
        StreamConsumer(None, "s", "g", "c", _decode, max_deliveries=0)  # type: ignore[arg-type]


_NON_FINITE = st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e308 * 10])
_POISON_MESSAGES = st.one_of(
    st.sampled_from(POISON).map(lambda p: _poisoned(*p)),
    _NON_FINITE.map(lambda x: _poisoned("step", "reward", x)),
    _NON_FINITE.map(lambda x: _poisoned("step", "logprobs", [-0.1, x])),
    st.lists(st.integers(0, 9), min_size=2, max_size=4).map(lambda ids: _poisoned("step", "action_token_ids", ids)),
    st.binary(max_size=40),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.booleans(), _POISON_MESSAGES), min_size=1, max_size=8))
def test_poison_through_a_real_consumer_lands_in_the_dead_letter_stream(redis_server, mix):
    """Good and poisoned messages interleaved on a real stream: the consumer hands over exactly
    the good ones, every poisoned one is in the dead-letter stream with a SchemaError reason and
    its original bytes, and none stays pending."""
    async def run() -> None:
        client = connect(redis_server.url)
        stream = trajectories_stream(f"poison-{uuid.uuid4().hex[:8]}")
        payloads, good = [], []
        for i, (is_good, poison) in enumerate(mix):
            payloads.append(schema.encode(_traj(i)) if is_good else poison)
            if is_good:
                good.append(f"tr{i}")
        await StreamProducer(client, stream).add(payloads)
        consumer = await _consumer(client, "c", stream)
        got = await consumer.read(count=100, block_ms=20)
        assert [d.message.trajectory_id for d in got] == good
        dead = await client.xrange(dead_letter_stream(stream))
        assert sorted(f[b"d"] for _, f in dead) == sorted(p for (ok, p) in mix if not ok)
        reasons = {f[b"error"].decode().split(":")[0] for _, f in dead}
        assert reasons <= {"InvalidField", "MalformedMessage", "UnknownSchemaVersion"}, reasons
        await consumer.ack([d.entry_id for d in got])
        assert (await stream_status(client, stream))["groups"][0]["pending"] == 0
        await client.delete(stream, dead_letter_stream(stream))
        await client.aclose()

    asyncio.run(run())


# ---- trimming acked entries (issue 12) -------------------------------------------------------

def _key(entry_id: bytes) -> tuple[int, int]:
    ms, seq = entry_id.split(b"-")
    return int(ms), int(seq)


async def _ids(client, stream) -> list[bytes]:
    return [i for i, _ in await client.xrange(stream)]


async def test_the_backlog_holds_when_redis_loses_a_groups_counters(redis_url):
    """After kill -9s and AOF reloads (the chaos soak), Redis reported a lag of thousands for a group
    that had been delivered every entry, so the workers waited for good, and no lag at all, read as
    0, so the curriculum flooded the task stream. The backlog is the undelivered entries regardless."""
    client = connect(redis_url)
    stream = trajectories_stream("lagless")
    consumer = await _consumer(client, "c0", stream)
    await StreamProducer(client, stream).add([schema.encode(_traj(i)) for i in range(5)])
    got = await consumer.read(count=5, block_ms=50)
    assert await stream_backlog(client, stream, "learner") == 0
    # counters lost: every entry delivered, but the group's entries-read says none was
    await client.xgroup_setid(stream, "learner", got[-1].entry_id, entries_read=0)
    assert (await client.xinfo_groups(stream))[0]["lag"] == 5
    assert await stream_backlog(client, stream, "learner") == 0
    # no lag at all (entries-read unknown), three entries undelivered: counted, not read as 0
    await client.xgroup_setid(stream, "learner", got[1].entry_id)
    assert (await client.xinfo_groups(stream))[0]["lag"] is None
    assert await stream_backlog(client, stream, "learner") == 3
    assert await stream_backlog(client, stream, "learner", cap=2) == 2
    assert await stream_backlog(client, stream, "no-such-group") == 5
    assert (await stream_status(client, stream))["groups"][0]["lag"] == 3  # what status and the gauge show
    await client.aclose()


async def test_trim_removes_only_what_every_group_acked(redis_url):
    """Exact trimming: entries below the oldest pending one go; the pending one, acked ones above it
    and undelivered ones stay; once all delivered ones are acked the floor is the last delivered id."""
    client = connect(redis_url)
    stream = trajectories_stream("trim1")
    consumer = await _consumer(client, "c0", stream)
    consumer.trim_every_s = None  # trimmed by hand below, exactly
    ids = await StreamProducer(client, stream).add([schema.encode(_traj(i)) for i in range(10)])
    got = await consumer.read(count=8, block_ms=50)  # 8 delivered, 2 undelivered
    await consumer.ack([got[i].entry_id for i in (0, 1, 2, 3, 5)])  # 4, 6 and 7 stay pending
    assert await trim_acked(client, stream, approximate=False) == 4
    assert await _ids(client, stream) == ids[4:]
    await consumer.ack([got[i].entry_id for i in (4, 6, 7)])
    assert await trim_acked(client, stream, approximate=False) == 3
    assert await _ids(client, stream) == ids[7:]  # the last delivered entry marks the floor, so it stays
    assert await stream_backlog(client, stream, "learner") == 2  # the group's lag survives trimming
    rest = await consumer.read(count=10, block_ms=50)
    assert [d.message.trajectory_id for d in rest] == ["tr8", "tr9"]
    await client.aclose()


async def test_a_group_that_has_not_read_keeps_everything(redis_url):
    client = connect(redis_url)
    stream = trajectories_stream("trim2")
    audit = await _consumer(client, "a0", stream)
    audit.group = "audit"
    await audit.ensure_group()  # a second group, created before the entries, that never reads
    consumer = await _consumer(client, "c0", stream)
    consumer.trim_every_s = 0
    ids = await StreamProducer(client, stream).add([schema.encode(_traj(i)) for i in range(250)])
    got = await consumer.read(count=300, block_ms=50)
    await consumer.ack([d.entry_id for d in got])
    assert await trim_acked(client, stream, approximate=False) == 0
    assert await _ids(client, stream) == ids
    # once the audit group has read and acked half, trimming follows the slower group
    seen = await audit.read(count=125, block_ms=50)
    await audit.ack([d.entry_id for d in seen])
    await trim_acked(client, stream, approximate=False)
    assert await _ids(client, stream) == ids[124:]
    await client.aclose()


async def test_the_ack_path_trims_at_a_bounded_rate_and_a_stream_without_groups_is_kept(redis_url):
    """Approximate trimming from `ack` (whole radix-tree nodes of 100 entries), counted in the metric;
    a second ack within `trim_every_s` does not trim; a stream no group reads is never trimmed."""
    client = connect(redis_url)
    stream = trajectories_stream("trim3")
    consumer = await _consumer(client, "c0", stream)
    consumer.trim_every_s = 3600.0
    await StreamProducer(client, stream).add([schema.encode(_traj(i)) for i in range(350)])
    got = await consumer.read(count=400, block_ms=50)
    before = metrics.STREAM_MESSAGES_TRIMMED.labels(stream)._value.get()
    await consumer.ack([d.entry_id for d in got[:320]])  # the first ack trims at once
    trimmed = metrics.STREAM_MESSAGES_TRIMMED.labels(stream)._value.get() - before
    assert 0 < trimmed <= 320 and await client.xlen(stream) == 350 - trimmed
    assert min(await _ids(client, stream)) <= got[320].entry_id  # nothing pending went
    await consumer.ack([d.entry_id for d in got[320:]])  # within the hour: no second trim
    assert metrics.STREAM_MESSAGES_TRIMMED.labels(stream)._value.get() - before == trimmed
    lone = trajectories_stream("trim3-nogroup")
    await StreamProducer(client, lone).add([b"x"] * 300)
    assert await trim_acked(client, lone) == 0 and await client.xlen(lone) == 300
    assert await trim_acked(client, trajectories_stream("trim3-absent")) == 0
    await client.aclose()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["add", "read", "ack"]), st.integers(0, 1), st.integers(1, 6)),
                min_size=1, max_size=25))
def test_trimming_never_drops_a_pending_or_undelivered_entry(redis_server, ops):
    """Random adds, reads and partial acks by two groups, an exact trim after each step: every entry
    pending in a group or not yet delivered to one is still in the stream, and every entry both
    groups acked below the floor is gone."""
    async def run() -> None:
        client = connect(redis_server.url)
        stream = trajectories_stream(f"trimprop-{uuid.uuid4().hex[:8]}")
        groups = [await _consumer(client, "c", stream), await _consumer(client, "c", stream)]
        groups[1].group = "other"
        await groups[1].ensure_group()
        for g in groups:
            g.trim_every_s = None
        added: list[bytes] = []
        held: list[list[bytes]] = [[], []]
        delivered: list[set] = [set(), set()]
        for op, gi, n in ops:
            if op == "add":
                added += await StreamProducer(client, stream).add([schema.encode(_traj(i)) for i in range(n)])
            elif op == "read":
                got = [d.entry_id for d in await groups[gi].read(count=n, block_ms=1)]
                held[gi] += got
                delivered[gi].update(got)
            elif held[gi]:
                done, held[gi] = held[gi][::2][:n], [e for e in held[gi] if e not in held[gi][::2][:n]]
                await groups[gi].ack(done)
            await trim_acked(client, stream, approximate=False)
            left = set(await _ids(client, stream))
            must_stay = {e for e in added if any(e in held[k] or e not in delivered[k] for k in (0, 1))}
            assert must_stay <= left
            floor = min((min(held[k] + [max(delivered[k], default=b"0-0", key=_key)], key=_key) for k in (0, 1)),
                        key=_key)
            assert not {e for e in left if _key(e) < _key(floor)}
        await client.delete(stream)
        await client.aclose()

    asyncio.run(run())
