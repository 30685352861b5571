"""The uniform task sampler: the stand-in for the curriculum scheduler.

Owns pushing batches of tasks onto the task stream, and nothing about which tasks
are worth training on: it draws uniformly (without replacement within a pass) from
the train split. simulator/curriculum.py replaces it behind the same two methods:

    async next_batch() -> list[Task]      # the next batch to push
    async run(stop_event) -> None         # push batches until stop_event is set

`run` keeps the stream's backlog (tasks not yet delivered to any worker) at most
`max_backlog`, so tasks are not sampled long before the policy that will play them
exists (that would only feed staleness). `limit` caps the total tasks pushed, for
synchronous mode and tests. This is the curriculum-off ablation of the paper.
"""

from __future__ import annotations

import asyncio
import random
from typing import Protocol

import redis.asyncio as aioredis

from infra import metrics
from infra.schema import Task, encode
from infra.streams import StreamProducer, tasks_stream, with_retry


class TaskSource(Protocol):
    """What the driver needs of a task sampler or the curriculum scheduler."""

    async def next_batch(self) -> list[Task]: ...

    async def run(self, stop_event: asyncio.Event) -> None: ...


async def stream_backlog(client: aioredis.Redis, stream: str, group: str = "workers") -> int:
    """Entries in `stream` not yet delivered to `group` (all entries when the group does not exist yet)."""
    async def op() -> int:
        if not await client.exists(stream):
            return 0
        for g in await client.xinfo_groups(stream):
            name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
            if name == group:
                return int(g.get("lag") or 0)
        return int(await client.xlen(stream))
    return await with_retry(op, f"backlog {stream}", deadline_s=30)


class UniformTaskSampler:
    def __init__(self, client: aioredis.Redis, prefix: str, tasks: list[Task], batch_size: int = 4, seed: int = 0,
                 max_backlog: int = 4, limit: int | None = None, poll_s: float = 0.2):
        if not tasks:
            raise ValueError("the task sampler needs at least one task")
        self.client, self.tasks, self.batch_size = client, list(tasks), batch_size
        self.stream = tasks_stream(prefix)
        self.producer = StreamProducer(client, self.stream)
        self.rng = random.Random(seed)
        self.max_backlog, self.limit, self.poll_s = max_backlog, limit, poll_s
        self.pushed = 0
        self._order: list[Task] = []

    async def next_batch(self) -> list[Task]:
        out = []
        for _ in range(self.batch_size):
            if not self._order:
                self._order = self.rng.sample(self.tasks, len(self.tasks))
            out.append(self._order.pop())
        return out

    async def push(self, tasks: list[Task]) -> None:
        await self.producer.add([encode(t) for t in tasks])
        self.pushed += len(tasks)
        metrics.CURRICULUM_TASKS_PUSHED.labels("real").inc(len(tasks))

    async def run(self, stop_event: asyncio.Event) -> None:
        while not stop_event.is_set() and (self.limit is None or self.pushed < self.limit):
            if await stream_backlog(self.client, self.stream) < self.max_backlog:
                batch = await self.next_batch()
                if self.limit is not None:
                    batch = batch[: self.limit - self.pushed]
                await self.push(batch)
                continue
            try:
                await asyncio.wait_for(stop_event.wait(), self.poll_s)
            except asyncio.TimeoutError:
                pass
