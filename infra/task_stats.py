"""Per-task reward statistics in Redis, written by rollout workers, read by the curriculum.

Owns the storage of outcome statistics, not their interpretation. For each task a
hash holds n (episodes), sum and sum of squares of the episode rewards (hence mean
and variance) and the number of groups; a capped list holds the reward variance of
its most recent GRPO groups (the paper's V_tau, Eq. 7, is a group's variance). One
MULTI/EXEC transaction applies a whole group, so readers never see half of one.
No task id ever becomes a metric label; the stats live here instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis.asyncio as aioredis

from infra.streams import key, with_retry


@dataclass
class TaskStats:
    task_id: str
    n: int = 0
    total: float = 0.0
    total_sq: float = 0.0
    groups: int = 0
    recent_group_variances: list = field(default_factory=list)  # newest first

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else 0.0

    @property
    def variance(self) -> float:
        """Population variance of all episode rewards seen."""
        if not self.n:
            return 0.0
        return max(0.0, self.total_sq / self.n - self.mean ** 2)

    @property
    def group_variance(self) -> float:
        """V_tau: mean reward variance over the recent groups (0 when none)."""
        v = self.recent_group_variances
        return sum(v) / len(v) if v else 0.0


def group_variance(rewards: list[float]) -> float:
    """Eq. 7: V_tau = 1/n sum_i (r_i - mean)^2 over one group's rewards."""
    if not rewards:
        return 0.0
    m = sum(rewards) / len(rewards)
    return sum((r - m) ** 2 for r in rewards) / len(rewards)


class TaskStatsStore:
    def __init__(self, client: aioredis.Redis, prefix: str, recent_groups: int = 4):
        self.client, self.prefix, self.recent_groups = client, prefix, recent_groups
        self.index_key = key(prefix, "taskstats:index")

    def _hash(self, task_id: str) -> str:
        return key(self.prefix, f"taskstats:{task_id}")

    def _recent(self, task_id: str) -> str:
        return key(self.prefix, f"taskstats:{task_id}:recent")

    async def record_group(self, task_id: str, rewards: list[float]) -> None:
        """Apply one group's episode rewards atomically."""
        if not rewards:
            return
        s, sq, var = sum(rewards), sum(r * r for r in rewards), group_variance(rewards)

        async def op() -> None:
            pipe = self.client.pipeline(transaction=True)
            h = self._hash(task_id)
            pipe.hincrby(h, "n", len(rewards))
            pipe.hincrbyfloat(h, "sum", s)
            pipe.hincrbyfloat(h, "sumsq", sq)
            pipe.hincrby(h, "groups", 1)
            pipe.lpush(self._recent(task_id), repr(var))
            pipe.ltrim(self._recent(task_id), 0, self.recent_groups - 1)
            pipe.sadd(self.index_key, task_id)
            await pipe.execute()

        await with_retry(op, "record task stats")

    async def put_many(self, stats: list[TaskStats]) -> None:
        """Overwrite the records of these tasks with snapshots (restoring a checkpoint)."""
        if not stats:
            return

        async def op() -> None:
            pipe = self.client.pipeline(transaction=True)
            for s in stats:
                h, r = self._hash(s.task_id), self._recent(s.task_id)
                pipe.delete(h, r)
                pipe.hset(h, mapping={"n": s.n, "sum": repr(float(s.total)), "sumsq": repr(float(s.total_sq)),
                                      "groups": s.groups})
                recent = list(s.recent_group_variances)[: self.recent_groups]
                if recent:
                    pipe.rpush(r, *[repr(float(v)) for v in recent])
                pipe.sadd(self.index_key, s.task_id)
            await pipe.execute()

        await with_retry(op, "restore task stats")

    async def get(self, task_id: str) -> TaskStats:
        return (await self.get_many([task_id]))[task_id]

    async def get_many(self, task_ids: list[str]) -> dict[str, TaskStats]:
        async def op() -> list:
            pipe = self.client.pipeline(transaction=False)
            for t in task_ids:
                pipe.hgetall(self._hash(t))
                pipe.lrange(self._recent(t), 0, -1)
            return await pipe.execute()

        raw = await with_retry(op, "read task stats")
        out = {}
        for i, t in enumerate(task_ids):
            h, recent = raw[2 * i], raw[2 * i + 1]
            out[t] = TaskStats(t, int(h.get(b"n", 0)), float(h.get(b"sum", 0.0)), float(h.get(b"sumsq", 0.0)),
                               int(h.get(b"groups", 0)), [float(v) for v in recent])
        return out

    async def all(self) -> dict[str, TaskStats]:
        ids = sorted(m.decode() for m in await with_retry(lambda: self.client.smembers(self.index_key), "task index"))
        return await self.get_many(ids)
