"""The run's shared real-step budget (infra/budget.py): exact grants to concurrent takers, holds sized to a
group's worst case, and holds that lapse when their worker dies. Against a real Redis.
"""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from infra.budget import StepBudget


async def test_step_budget_grants_exactly_its_limit_to_concurrent_takers(redis_url):
    clients = [aioredis.from_url(redis_url) for _ in range(3)]
    try:
        budgets = [StepBudget(c, "exp", 37) for c in clients]  # three workers sharing one run's budget

        async def worker(b: StepBudget) -> int:
            return sum([await b.take() for _ in range(30)])

        granted = await asyncio.gather(*(worker(b) for b in budgets))
        assert sum(granted) == 37 and await budgets[0].used() == 37 and await budgets[1].spent()
        unlimited = StepBudget(clients[0], "exp-free", 0)
        assert all([await unlimited.take() for _ in range(5)]) and await unlimited.used() == 5
        assert not await unlimited.spent()
        with pytest.raises(ValueError):
            StepBudget(clients[0], "exp", -1)
    finally:
        for c in clients:
            await c.aclose()


async def test_a_group_starts_only_when_its_worst_case_fits_and_the_last_takes_the_remainder(redis_url):
    """Holds: 16-step groups on a 40-step budget. Two fit, a third waits until both released their
    unused steps; once the free budget is below a group's worst case, one group alone (none other
    holding) gets the remainder, so exactly 40 are spent; a take past a hold is refused."""
    client = aioredis.from_url(redis_url)
    try:
        b = StepBudget(client, "holds", 40)
        h1, h2 = await b.hold("g1", 16, 10_000), await b.hold("g2", 16, 10_000)
        assert h1.steps == h2.steps == 16 and await b.hold("g3", 16, 10_000) is None  # 8 free
        assert all([await h1.take() for _ in range(10)])
        await h1.release()
        assert await b.hold("g3", 16, 10_000) is None  # 40 - 10 used - 16 held: 14 free
        assert all([await h2.take() for _ in range(12)])
        await h2.release()
        h3 = await b.hold("g3", 16, 10_000)  # 18 free
        assert [await h3.take() for _ in range(17)] == [True] * 16 + [False]
        assert await b.hold("g4", 16, 10_000) is None  # the remainder waits for h3's release
        await h3.release()
        h4 = await b.hold("g4", 16, 10_000)
        assert h4.steps == 2 and [await h4.take() for _ in range(3)] == [True, True, False]
        assert await b.used() == 40 and await b.spent() and await b.hold("g5", 16, 10_000) is None
    finally:
        await client.aclose()


async def test_a_dead_workers_hold_lapses_and_a_live_ones_is_renewed(redis_url):
    client = aioredis.from_url(redis_url)
    try:
        b = StepBudget(client, "lapse", 20)
        dead = await b.hold("dead", 16, 200)
        assert await dead.take() and await b.hold("next", 16, 200) is None
        await asyncio.sleep(0.3)  # never renewed: it lapses, its 15 unused steps return
        live = await b.hold("live", 16, 200)
        assert live is not None and not await dead.take()  # the lapsed hold takes nothing more
        for _ in range(3):  # renewed past its first deadline, it stays
            await asyncio.sleep(0.1)
            assert await b.renew(["live", "dead"], 200) == 1
        assert await live.take() and await b.used() == 2
    finally:
        await client.aclose()
