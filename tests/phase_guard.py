"""End a run's first RL phase once it has pushed a group, for tests whose DreamGym phase cannot train.

The tiny random Llama as Mexp writes output the parser rejects, so every synthetic episode
ends as `sim_error`, the learner sets each group aside, and a DreamGym phase never reaches
its update: it ends only when `infra.train_budget_s` runs out, minutes of waiting after
everything a test checks has happened. `first_group_ends` wraps the driver's phase guard
(`infra.run.driver.budget`) so that the first phase's stop event is also set as soon as the
run's push counter (infra/budget.run_counts) shows a group its worker played and pushed.
The phase then ends the way a spent budget ends it; later phases keep the plain guard.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from infra.budget import run_counts
from infra.streams import connect, run_prefix


class FirstGroupEnds:
    """The driver's `budget(seconds)`, plus: the first phase also stops at the run's first pushed group."""

    def __init__(self, budget: Callable[[float], asyncio.Event], redis_url: str, prefix: str, poll_s: float = 0.5):
        self.budget, self.redis_url, self.prefix, self.poll_s = budget, redis_url, prefix, poll_s
        self.watch: asyncio.Task | None = None
        self.fired = False  # the first phase ended at its first group, not at its guard

    def __call__(self, seconds: float) -> asyncio.Event:
        stop = self.budget(seconds)
        if self.watch is None:
            self.watch = asyncio.create_task(self._end_at_first_group(stop))
        return stop

    async def _end_at_first_group(self, stop: asyncio.Event) -> None:
        client = connect(self.redis_url)
        try:
            while not stop.is_set():
                if (await run_counts(client, self.prefix))["trajectories_pushed"] > 0:
                    self.fired = True
                    stop.set()
                    return
                try:
                    await asyncio.wait_for(stop.wait(), self.poll_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            await client.aclose()

    async def aclose(self) -> None:
        if self.watch is not None:
            self.watch.cancel()
            await asyncio.gather(self.watch, return_exceptions=True)


def first_group_ends(monkeypatch: Any, cfg: Any, name: str) -> FirstGroupEnds:
    """Install the guard for run `name` of `cfg` (which must name its Redis: `infra.redis_url`)."""
    from infra.run import driver

    assert cfg.infra.redis_url, "the watch reads the run's counters from infra.redis_url"
    ended = FirstGroupEnds(driver.budget, cfg.infra.redis_url, run_prefix(cfg.infra.stream_prefix, name))
    monkeypatch.setattr(driver, "budget", ended)
    return ended
