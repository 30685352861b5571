"""Deliveries counted where they are used (issue 63 part 2), against the real Redis the suite starts.

A consumer with `count_on_use` (the learner's) charges an entry when its caller starts handling it
(`handling()`), not when it is read ahead: entries read and never handled cost nothing when a
restarted reader reads them back, or another one reclaims them. The reader of these tests reads a
batch of 10 and dies on the 4th, again and again, as the issue's probe did."""

from __future__ import annotations

import asyncio
import uuid

from infra import metrics, schema
from infra.schema import Task, encode
from infra.streams import StreamConsumer, StreamProducer, connect, dead_letter_stream
from learner import checkpoint as ckpt
from tests.test_faults import dead_reasons, make_learner, pending, steps, tiny_policy, traj


def _decode(b: bytes) -> Task:
    return schema.decode_as(b, Task)


async def _counts(client, stream: str) -> dict[str, int]:
    """task id -> the group's delivery counter, for every pending entry."""
    rows = await client.xpending_range(stream, "g", min="-", max="+", count=100)
    ids = {e: schema.decode_as(f[b"d"], Task).task_id for e, f in await client.xrange(stream)}
    return {ids[r["message_id"]]: int(r["times_delivered"]) for r in rows}


async def _batch(client, prefix: str, n: int = 10) -> str:
    stream = f"{prefix}-{uuid.uuid4().hex[:8]}:tasks"
    await StreamProducer(client, stream).add([schema.encode(Task(task_id=f"t{i}", instruction="x"))
                                              for i in range(1, n + 1)])
    return stream


async def _reader(client, stream: str, name: str, count_on_use: bool = True, max_deliveries: int = 5,
                  **kw) -> StreamConsumer:
    c = StreamConsumer(client, stream, "g", name, _decode, max_deliveries=max_deliveries, reclaim_every=1,
                       count_on_use=count_on_use, **kw)
    await c.ensure_group()
    return c


async def _read_and_die_on_the_4th(c: StreamConsumer) -> list[str]:
    """Read a batch of 10; handle and ack in order until the 4th, whose handler kills the process
    (nothing after it runs: no ack, no nack). Returns the ids this incarnation was given."""
    got = await c.read(count=10, block_ms=20)
    for d in got:
        await c.handling([d])
        if d.message.task_id == "t4":
            break
        await c.ack([d.entry_id])
    return [d.message.task_id for d in got]


async def test_a_batch_reader_that_dies_on_the_4th_again_and_again_dead_letters_the_4th_only(redis_url):
    client = connect(redis_url)
    stream = await _batch(client, "batchdeath")
    for life in range(1, 6):  # five deaths with the same consumer name: each restart reads its pending back
        c = await _reader(client, stream, "reader-0")
        got = await _read_and_die_on_the_4th(c)
        assert got[0] == ("t1" if life == 1 else "t4")
        counts = await _counts(client, stream)
        assert counts["t4"] == life and all(counts[f"t{i}"] == 0 for i in range(5, 11)), counts
    c = await _reader(client, stream, "reader-0")
    rest = await c.read(count=10, block_ms=20)  # the sixth start: t4 was handled 5 times, it goes
    assert [d.message.task_id for d in rest] == [f"t{i}" for i in range(5, 11)]
    assert all(d.deliveries == 0 for d in rest)
    dead = await client.xrange(dead_letter_stream(stream))
    assert len(dead) == 1 and schema.decode_as(dead[0][1][b"d"], Task).task_id == "t4"
    assert dead[0][1][b"error"].startswith(b"MaxDeliveries: handled 5 times")
    await c.handling(rest)
    assert set((await _counts(client, stream)).values()) == {1}
    await c.ack([d.entry_id for d in rest])
    await client.aclose()


async def test_a_reader_counting_at_read_charges_the_whole_batch(redis_url):
    """The rule before count_on_use, kept for the workers (one task per read): the same five deaths
    charge every entry read back, so the sixth start dead-letters the 4th and the six never handled."""
    client = connect(redis_url)
    stream = await _batch(client, "batchdeath-old")
    for _ in range(5):
        await _read_and_die_on_the_4th(await _reader(client, stream, "reader-0", count_on_use=False))
    rest = await (await _reader(client, stream, "reader-0", count_on_use=False)).read(count=10, block_ms=20)
    assert rest == [] and len(await client.xrange(dead_letter_stream(stream))) == 7
    await client.aclose()


async def test_a_dead_readers_batch_reclaimed_by_another_is_charged_only_what_was_handled(redis_url):
    """Fresh consumer names (a reader that restarts under a new name): the next reader takes the dead
    one's pending entries with XAUTOCLAIM, which raises Redis's counter; count_on_use sets it back."""
    client = connect(redis_url)
    stream = await _batch(client, "batchdeath-reclaim")
    for life in range(1, 6):
        await asyncio.sleep(0.02)  # the dead reader's entries idle past reclaim_idle_ms (a fast machine is within 1 ms)
        c = await _reader(client, stream, f"reader-{life}", reclaim_idle_ms=1)
        await _read_and_die_on_the_4th(c)
        counts = await _counts(client, stream)
        assert counts["t4"] == life and all(counts[f"t{i}"] == 0 for i in range(5, 11)), counts
    await asyncio.sleep(0.02)
    c = await _reader(client, stream, "reader-6", reclaim_idle_ms=1)
    rest = await c.read(count=10, block_ms=20)
    assert sorted(d.message.task_id for d in rest) == sorted(f"t{i}" for i in range(5, 11))
    assert [schema.decode_as(f[b"d"], Task).task_id for _, f in await client.xrange(dead_letter_stream(stream))] \
        == ["t4"]
    await client.aclose()


async def test_read_ahead_is_not_a_redelivery_and_a_nack_is_a_use(redis_url):
    client = connect(redis_url)
    stream = await _batch(client, "readahead", n=3)
    before = metrics.STREAM_MESSAGES_REDELIVERED.labels(stream)._value.get()
    for _ in range(3):  # three restarts that only read ahead
        got = await (await _reader(client, stream, "reader-0", max_deliveries=2)).read(count=10, block_ms=20)
        assert [d.deliveries for d in got] == [0, 0, 0]
    assert metrics.STREAM_MESSAGES_REDELIVERED.labels(stream)._value.get() == before
    c = await _reader(client, stream, "reader-0", max_deliveries=2)
    got = await c.read(count=10, block_ms=20)
    assert await c.nack(got[:1], "Boom: handler failed") == []  # never handled: the nack counts as its first use
    assert (await _counts(client, stream))["t1"] == 1
    again = [d for d in await c.read(count=10, block_ms=20) if d.message.task_id == "t1"]  # reclaimed (parked)
    assert [d.deliveries for d in again] == [1]
    assert metrics.STREAM_MESSAGES_REDELIVERED.labels(stream)._value.get() == before + 1
    await c.handling(again)
    assert [d.message.task_id for d in await c.nack(again, "Boom: failed again")] == ["t1"]  # 2 of 2
    await client.aclose()


async def test_the_handler_deadline_of_a_batch_reader_starts_when_it_handles(redis_url):
    client = connect(redis_url)
    stream = await _batch(client, "usedeadline", n=2)
    c = await _reader(client, stream, "reader-0", handler_timeout_s=0.2)
    got = await c.read(count=10, block_ms=20)
    await asyncio.sleep(0.3)
    assert await c.expire_held() == []  # read ahead, not handled: no deadline runs
    await c.handling(got[:1])
    await asyncio.sleep(0.3)
    assert [d.message.task_id for d in await c.expire_held()] == ["t1"]
    await client.aclose()


async def test_six_learner_deaths_after_reading_ahead_dead_letter_nothing_and_count_only_the_retrained(
        redis_url, tiny_dir, tmp_path):
    """The learner in this process (tests/test_faults.py's tiny one), six lives on one stream of six GRPO
    groups: each life reads all of them ahead, trains one update (checkpointed, acked) and dies; the
    third dies inside its update instead. Before count_on_use the sixth life's read found the read-ahead
    delivered 6 times and dead-lettered it (MaxDeliveries) though no update ever had it."""
    policy = tiny_policy(tiny_dir)
    client, producer, learner, stream = await make_learner(redis_url, tmp_path, tiny_dir, prefix="sixdeaths",
                                                           policy=policy)
    tok = policy.tokenizer
    groups = {g: [traj(tok, g, 1.0), traj(tok, g, 0.0)] for g in "ABCDEF"}
    await producer.add(encode(t) for g in groups.values() for t in g)
    lives, redelivered = [learner], []
    for life in range(1, 7):
        lr = lives[-1]
        lr.resume()
        if life == 3:  # killed inside the update: charged, listed in flight, never finished
            lr.ledger.recover()
            units = None
            while units is None:
                units = await lr.batches.next_batch(lr.version)
            await lr.batches.charge(units)
            lr.ledger.begin(lr.updates + 1, [e for u in units for e in u.entry_ids])
        else:
            assert len(await steps(lr, 1)) == 1
            assert lr.waiting == 2 * (6 - lr.updates)  # the rest was read ahead
        redelivered.append(lr.redelivered)
        lives.append((await make_learner(redis_url, tmp_path, tiny_dir, prefix="sixdeaths", policy=policy))[2])
    last = lives[-1]
    last.resume()
    done = await steps(last, 4)
    redelivered.append(last.redelivered)
    assert last.updates == 6 and len(done) == 1 and await pending(client, stream) == 0
    assert await dead_reasons(client, stream) == []
    state = ckpt.load(ckpt.latest(tmp_path), policy)
    assert sorted(state.lineage) == sorted(t.trajectory_id for g in groups.values() for t in g)
    assert redelivered == [0, 0, 0, 2, 0, 0, 0]  # the group the third life died inside, retrained by the fourth
    await client.aclose()
