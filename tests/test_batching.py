"""learner/batching.py against a real Redis stream: how many groups one update waits through.

`learner.max_groups_per_update` bounds an update's rollout cost where few groups carry reward
variance (a Mexp without retrieval scored 2 of 38 groups informative): once that many groups
came in since the last batch, the learner takes the usable units it holds, even a short batch.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from infra.config import LearnerConfig
from infra.schema import Status, Step, Task, Trajectory, decode_as, encode
from infra.streams import StreamConsumer, StreamProducer, trajectories_stream
from learner.batching import GroupBatcher
from learner.staleness import StalenessFilter


def traj(group: str, reward: float) -> Trajectory:
    step = Step(state="Room: hall", action="go east", reward=reward, done=True, policy_prompt="p",
                action_token_ids=[7], logprobs=[-0.7], loss_mask=[1], choice_token_ids=[7, 8])
    return Trajectory(task_id=group, group_id=group, steps=[step], task=Task(group, "reach the east"),
                      status=Status.SUCCESS if reward else Status.FAILURE, success=bool(reward))


def group(name: str, *rewards: float) -> list[Trajectory]:
    return [traj(name, r) for r in rewards]


def short_updates() -> float:
    return REGISTRY.get_sample_value("learner_short_updates_total", {"reason": "group_cap"}) or 0.0


async def batcher(redis_url: str, name: str, **cfg) -> tuple[GroupBatcher, StreamProducer, object]:
    client = aioredis.from_url(redis_url)
    stream = trajectories_stream(name)
    consumer = StreamConsumer(client, stream, "learner", "l0", lambda b: decode_as(b, Trajectory))
    await consumer.ensure_group()
    lc = LearnerConfig(groups_per_update=2, group_timeout_s=3600.0, **cfg)
    return GroupBatcher(consumer, lc, 2, StalenessFilter(5), read_block_ms=50), StreamProducer(client, stream), client


async def drain(b: GroupBatcher, tries: int = 6):
    for _ in range(tries):
        if (units := await b.next_batch(0)) is not None:
            return units
    return None


async def test_an_update_waits_through_at_most_max_groups_then_trains_what_it_has(redis_url):
    b, producer, client = await batcher(redis_url, "cap", max_groups_per_update=3)
    before = short_updates()
    # two zero-variance groups and one informative: 3 groups came in, 1 usable of the 2 an update wants
    await producer.add(encode(t) for t in [*group("z1", 0, 0), *group("a", 1, 0), *group("z2", 1, 1)])
    units = await drain(b)
    assert units is not None and [u.trajs[0].group_id for u in units] == ["a"]
    assert b.discarded == {"zero_variance": 4} and short_updates() == before + 1
    # the count starts again after a batch: 2 more groups (one usable) are not enough to cut it short ...
    await producer.add(encode(t) for t in [*group("z3", 0, 0), *group("b", 0, 1)])
    assert await drain(b) is None
    # ... and a full batch is a full batch, not a short one
    await producer.add(encode(t) for t in group("c", 1, 0))
    units = await drain(b)
    assert [u.trajs[0].group_id for u in units] == ["b", "c"] and short_updates() == before + 1
    await client.aclose()


async def test_without_a_cap_an_update_waits_for_its_usable_groups(redis_url):
    b, producer, client = await batcher(redis_url, "nocap")  # max_groups_per_update=0, the default
    await producer.add(encode(t) for t in [*group("z1", 0, 0), *group("a", 1, 0), *group("z2", 1, 1),
                                           *group("z3", 0, 0), *group("z4", 1, 1)])
    assert await drain(b) is None and b.waiting == 2  # "a" is held for a second usable group
    # all-zero-variance groups alone never make a batch, however many came in
    b2, producer2, client2 = await batcher(redis_url, "allzero", max_groups_per_update=2)
    await producer2.add(encode(t) for t in [*group("z1", 0, 0), *group("z2", 1, 1), *group("z3", 0, 0)])
    assert await drain(b2) is None
    await producer2.add(encode(t) for t in group("a", 0, 1))  # the first usable one then trains at once
    assert [u.trajs[0].group_id for u in await drain(b2)] == ["a"]
    await client.aclose()
    await client2.aclose()
