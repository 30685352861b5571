"""An exact budget of real-environment transitions, shared by every rollout worker of a run.

Owns the count that the real-environment baseline and sim-to-real are compared by
(the paper's x-axis: real transitions used). One Redis counter per run and phase:
before each real `env.step`, the episode loop calls `take()`, an atomic INCR; the step
runs only when the counter is still within the limit. Concurrent workers on any node
therefore never use more than the limit between them, and `used()` is exact: every
granted take is one step that ran (a step that then crashed still counts: the
environment was touched). Takes refused past the limit overshoot the raw counter,
which is why `used()` clips it. A limit of 0 means no limit: steps are only counted.

Also owns the run's pushed-experience counters (`count_key`, `run_counts`): each rollout
worker adds its group's trajectories and steps in the same transaction as their XADD, so
the counts survive a crashed driver and a `--resume` with the run's Redis, as the real
budget does.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from infra.streams import key, with_retry


def budget_key(prefix: str, phase: str = "real") -> str:
    return key(prefix, f"budget:{phase}_steps")


PUSH_COUNTS = ("trajectories_pushed", "synthetic_steps_pushed", "real_steps_pushed")


def count_key(prefix: str, name: str) -> str:
    return key(prefix, f"count:{name}")


async def run_counts(client: aioredis.Redis, prefix: str) -> dict[str, int]:
    """The run's pushed trajectories and their steps by environment kind, over every segment of the run."""
    raw = await with_retry(lambda: client.mget([count_key(prefix, n) for n in PUSH_COUNTS]), "MGET run counts")
    return {n: int(v or 0) for n, v in zip(PUSH_COUNTS, raw)}


class StepBudget:
    """At most `limit` granted `take()`s across every process that shares the Redis key (0: counted, no limit)."""

    def __init__(self, client: aioredis.Redis, prefix: str, limit: int, phase: str = "real"):
        if limit < 0:
            raise ValueError(f"a step budget is a count >= 0, got {limit}")
        self.client, self.key, self.limit = client, budget_key(prefix, phase), limit

    async def take(self) -> bool:
        """Reserve one step; False once the budget is spent (with no limit, the step is only counted)."""
        n = await with_retry(lambda: self.client.incr(self.key), f"INCR {self.key}")
        return self.limit == 0 or int(n) <= self.limit

    async def used(self) -> int:
        """Steps granted so far (exact)."""
        raw = await with_retry(lambda: self.client.get(self.key), f"GET {self.key}")
        return min(int(raw or 0), self.limit) if self.limit else int(raw or 0)

    async def spent(self) -> bool:
        return self.limit > 0 and await self.used() >= self.limit

    async def wait_spent(self, stop: asyncio.Event, poll_s: float = 0.5) -> bool:
        """Wait until the budget is spent (then set `stop` and return True) or `stop` is set (False)."""
        while not stop.is_set():
            if await self.spent():
                stop.set()
                return True
            try:
                await asyncio.wait_for(stop.wait(), poll_s)
            except asyncio.TimeoutError:
                pass
        return False
