"""An exact budget of real-environment transitions, shared by every rollout worker of a run.

Owns the count that the real-environment baseline and sim-to-real are compared by
(the paper's x-axis: real transitions used). One Redis counter per run and phase:
before each step of a real episode, the episode loop calls `take()`, an atomic INCR; the
step runs only when the counter is still within the limit. Concurrent workers on any node
therefore never use more than the limit between them, and `used()` is exact: every
granted take is one step that ran (a step that then crashed still counts: the
environment was touched; a generate-mode reply that named no action counts too: the
agent spent that turn of the real episode, and its trajectory trains on it,
actors/episode.py). Takes refused past the limit overshoot the raw counter,
which is why `used()` clips it. A limit of 0 means no limit: steps are only counted.

Holds: a rollout worker reserves a whole group's worst case (G episodes x max_steps) before it
starts the group (`hold()`), and the group's steps are taken from that hold. So a group starts
only when it can finish, and a spent budget no longer cuts every group in flight short: a cut-off
episode ends `truncated` with reward 0, which GRPO would read as a failure of a policy that was
on its way (stop 46's sim-to-real phase: 46 of its 284 trajectories). When the free budget is
smaller than a group's worst case, one group at a time (none other holding) gets the remainder,
so the budget is still spent exactly; only that last group can be cut off. A hold lives in Redis
with a deadline the worker renews (`renew`); a dead worker's hold lapses after it, and its unused
steps return to the budget. The hard limit stays absolute: a take from a hold also checks the count.

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


# KEYS: the step count, the holds (hash: hold id -> steps left), their deadlines (zset, ms).
# ARGV: hold id, steps wanted, limit, ttl ms. Returns the steps granted (0: none). Lapsed holds
# are dropped first; a hold is granted in full, or, with no other hold alive, the remainder.
NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

HOLD_SCRIPT = NOW_MS + """
for _, g in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)) do
  redis.call('HDEL', KEYS[2], g)
  redis.call('ZREM', KEYS[3], g)
end
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local held, alive = 0, 0
for _, v in ipairs(redis.call('HVALS', KEYS[2])) do
  held = held + tonumber(v)
  alive = alive + 1
end
local free = tonumber(ARGV[3]) - used - held
local want = tonumber(ARGV[2])
local grant = 0
if free >= want then grant = want elseif alive == 0 and free > 0 then grant = free end
if grant > 0 then
  redis.call('HSET', KEYS[2], ARGV[1], grant)
  redis.call('ZADD', KEYS[3], now + tonumber(ARGV[4]), ARGV[1])
end
return grant
"""

# KEYS: the step count, the holds. ARGV: hold id, limit. One step from a live hold, within the limit.
TAKE_SCRIPT = """
local left = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if left <= 0 or tonumber(redis.call('GET', KEYS[1]) or '0') >= tonumber(ARGV[2]) then return 0 end
redis.call('HINCRBY', KEYS[2], ARGV[1], -1)
redis.call('INCR', KEYS[1])
return 1
"""

# KEYS: the holds' deadlines. ARGV: ttl ms, then hold ids. Pushes the live ones' deadlines on.
RENEW_SCRIPT = NOW_MS + """
local deadline = now + tonumber(ARGV[1])
local n = 0
for i = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], deadline, ARGV[i])
    n = n + 1
  end
end
return n
"""


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
        self.holds_key, self.deadlines_key = self.key + ":holds", self.key + ":deadlines"
        # EVALSHA, the script text sent again only after a Redis restart: a take runs before every real step
        self._hold, self._take = client.register_script(HOLD_SCRIPT), client.register_script(TAKE_SCRIPT)
        self._renew = client.register_script(RENEW_SCRIPT)

    async def hold(self, hold_id: str, steps: int, ttl_ms: int) -> "Hold | None":
        """Reserve up to `steps` for one group (module docstring); None when no group fits now.
        With no limit every hold is granted and its steps are only counted."""
        if steps <= 0:
            raise ValueError(f"a hold is for >= 1 step, got {steps}")
        if not self.limit:
            return Hold(self, hold_id, steps)
        granted = await with_retry(lambda: self._hold(keys=[self.key, self.holds_key, self.deadlines_key],
                                                      args=[hold_id, steps, self.limit, ttl_ms]),
                                   f"hold {steps} of {self.key}")
        return Hold(self, hold_id, int(granted)) if int(granted) > 0 else None

    async def renew(self, hold_ids: list[str], ttl_ms: int) -> int:
        """Push the deadlines of live holds `ttl_ms` on; returns how many were still live."""
        if not self.limit or not hold_ids:
            return 0
        return int(await with_retry(lambda: self._renew(keys=[self.deadlines_key], args=[ttl_ms, *hold_ids]),
                                    f"renew holds on {self.key}"))

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


class Hold:
    """One group's reservation on a StepBudget: `take()` per step (as StepBudget.take), `release()` at the end."""

    def __init__(self, budget: StepBudget, hold_id: str, steps: int):
        self.budget, self.hold_id, self.steps = budget, hold_id, steps

    async def take(self) -> bool:
        b = self.budget
        if not b.limit:
            return await b.take()
        ok = await with_retry(lambda: b._take(keys=[b.key, b.holds_key], args=[self.hold_id, b.limit]),
                              f"take from hold {self.hold_id}")
        return bool(int(ok))

    async def release(self) -> None:
        """Return the hold's unused steps to the budget (idempotent)."""
        b = self.budget
        if not b.limit:
            return

        async def op() -> None:
            pipe = b.client.pipeline(transaction=True)
            pipe.hdel(b.holds_key, self.hold_id)
            pipe.zrem(b.deadlines_key, self.hold_id)
            await pipe.execute()

        await with_retry(op, f"release hold {self.hold_id}")
