"""ReplyMemo: greedy replies kept by request, in-flight repeats awaited, failures and sampled requests never kept."""

from __future__ import annotations

import asyncio

import pytest

from infra import metrics
from simulator.reply_memo import ReplyMemo

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "stop": ["</done>"]}


class Maker:
    """Counts calls; each waits on `gate` (so concurrent requests overlap), then answers or raises."""

    def __init__(self, fail: int = 0) -> None:
        self.calls, self.fail, self.gate = 0, fail, asyncio.Event()

    def __call__(self, text: str):
        async def make():
            self.calls += 1
            await self.gate.wait()
            if self.fail:
                self.fail -= 1
                raise RuntimeError("engine down")
            return f"{text}#{self.calls}"
        return make


async def test_a_repeat_and_an_identical_request_in_flight_generate_once():
    memo, maker = ReplyMemo(8), Maker()
    key = ReplyMemo.key("p", GREEDY)
    hits0 = metrics.counted(metrics.SIMULATOR_MEMO_HITS)
    first = [asyncio.ensure_future(memo.get(key, maker("p"))) for _ in range(3)]
    await asyncio.sleep(0)
    maker.gate.set()
    assert await asyncio.gather(*first) == ["p#1"] * 3
    assert await memo.get(key, maker("p")) == "p#1"
    other = await memo.get(ReplyMemo.key("q", GREEDY), maker("q"))
    assert other == "q#2" and maker.calls == 2 and (memo.hits, memo.misses) == (3, 2)
    assert metrics.counted(metrics.SIMULATOR_MEMO_HITS) == hits0 + 3


async def test_sampled_requests_and_a_memo_of_size_0_are_never_kept():
    assert ReplyMemo.key("p", {**GREEDY, "temperature": 0.7}) is None
    maker = Maker()
    maker.gate.set()
    memo = ReplyMemo(8)
    assert [await memo.get(None, maker("p")) for _ in range(2)] == ["p#1", "p#2"]
    off = ReplyMemo(0)
    key = ReplyMemo.key("p", GREEDY)
    assert [await off.get(key, maker("p")) for _ in range(2)] == ["p#3", "p#4"]


async def test_the_key_holds_every_sampling_parameter():
    assert ReplyMemo.key("p", GREEDY) != ReplyMemo.key("p", {**GREEDY, "max_new_tokens": 9})
    assert ReplyMemo.key("p", GREEDY) != ReplyMemo.key("p", {**GREEDY, "stop": ["</state>"]})
    assert ReplyMemo.key("p", GREEDY) == ReplyMemo.key("p", dict(reversed(list(GREEDY.items()))))


async def test_a_failed_request_keeps_nothing_and_its_waiters_make_their_own():
    memo, maker = ReplyMemo(8), Maker(fail=1)
    key = ReplyMemo.key("p", GREEDY)
    owner = asyncio.ensure_future(memo.get(key, maker("p")))
    await asyncio.sleep(0)
    waiter = asyncio.ensure_future(memo.get(key, maker("p")))
    await asyncio.sleep(0)
    maker.gate.set()
    with pytest.raises(RuntimeError, match="engine down"):
        await owner
    assert await waiter == "p#2" and maker.calls == 2
    assert await memo.get(key, maker("p")) == "p#2"  # the waiter's reply is the one kept


async def test_a_cancelled_request_keeps_nothing_and_its_waiter_makes_its_own():
    memo, maker = ReplyMemo(8), Maker()
    key = ReplyMemo.key("p", GREEDY)
    owner = asyncio.ensure_future(memo.get(key, maker("p")))
    await asyncio.sleep(0)
    waiter = asyncio.ensure_future(memo.get(key, maker("p")))
    await asyncio.sleep(0)
    owner.cancel()
    await asyncio.sleep(0)
    maker.gate.set()
    assert await waiter == "p#2" and owner.cancelled()


async def test_the_least_recently_used_reply_goes_first():
    memo, maker = ReplyMemo(2), Maker()
    maker.gate.set()
    keys = {t: ReplyMemo.key(t, GREEDY) for t in "abc"}
    await memo.get(keys["a"], maker("a"))
    await memo.get(keys["b"], maker("b"))
    await memo.get(keys["a"], maker("a"))  # a used again: b is now the oldest
    await memo.get(keys["c"], maker("c"))
    assert await memo.get(keys["a"], maker("a")) == "a#1"
    assert await memo.get(keys["b"], maker("b")) == "b#4"  # made again
