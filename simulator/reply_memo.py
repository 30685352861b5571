"""Greedy Mexp replies kept by request, so an identical step is generated once.

Owns `ReplyMemo`: with temperature 0 Mexp's reply is a function of its prompt (and of its
weights, fixed during RL), and a GRPO group asks the same thing many times: its rollouts start
in the same state, often take the same first action, and then share the next prompt too. The
memo answers a repeat from the first reply, and a request identical to one still being generated
waits for that one instead of generating it again (the group's rollouts run concurrently). A
greedy retry of an unparseable reply would only reproduce it, so it costs nothing either.

Sampled requests (temperature > 0) are never kept: their replies are meant to differ. The memo
is bounded (least recently used out first) and shared by every experience model of a process
(infra/run/services.py, one per run; a rollout actor keeps its own).

Departure from running Mexp every time: batched greedy decoding is deterministic only up to
floating-point order, so a repeat may have come out differently in another batch; the memo
returns the same reply for the same request, which the paper's greedy Mexp means.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any, Awaitable, Callable, Hashable

from infra import metrics

GREEDY = 1e-5  # as the engines read it (infra/engine/request.py): below this, greedy


class ReplyMemo:
    def __init__(self, size: int) -> None:
        self.size = size
        self._kept: OrderedDict[Hashable, Any] = OrderedDict()
        self._running: dict[Hashable, asyncio.Task] = {}
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(prompt: str, sampling_params: dict) -> Hashable | None:
        """The request's key, or None for a request that must not be kept (sampled, or the memo off)."""
        if float(sampling_params.get("temperature", 1.0)) >= GREEDY:
            return None
        return prompt, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in sampling_params.items()))

    async def get(self, key: Hashable | None, make: Callable[[], Awaitable[Any]]) -> Any:
        """`make()`'s result for `key`: kept, awaited from the identical request in flight, or made now.
        A failed or cancelled `make()` keeps nothing; whoever waited on it makes its own."""
        if key is None or self.size <= 0:
            return await make()
        while True:
            if key in self._kept:
                self._kept.move_to_end(key)
                return self._hit(self._kept[key])
            running = self._running.get(key)
            if running is None:
                break
            await asyncio.wait({running})
            if not running.cancelled() and running.exception() is None:
                return self._hit(running.result())
        self.misses += 1
        task = asyncio.ensure_future(make())
        self._running[key] = task
        try:
            value = await task
        finally:
            self._running.pop(key, None)
        self._kept[key] = value
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)
        return value

    def _hit(self, value: Any) -> Any:
        self.hits += 1
        metrics.SIMULATOR_MEMO_HITS.inc()
        return value
