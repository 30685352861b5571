"""Trajectories per second through DreamGym's whole stream path vs raw XADD on the same server.

Whole path: schema encode -> pipelined XADD (MAXLEN ~) in a producer process, and
XREADGROUP (COUNT 100) -> schema decode -> XACK in a consumer process running at the
same time; the rate is trajectories fully acked per second. Raw: a plain XADD of the
same bytes from one client (unpipelined, and pipelined in batches of 100) on the same
server. Prints both and their ratios, for 2 KB and 20 KB trajectories.

    python benchmarks/stream_throughput.py [--n 20000] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import time

import redis

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's code

from infra import schema  # noqa: E402
from infra.redis_server import EmbeddedRedis  # noqa: E402
from infra.schema import Step, Trajectory  # noqa: E402
from infra.streams import StreamConsumer, StreamProducer, connect  # noqa: E402


def load() -> str:
    return "load %.2f %.2f %.2f" % os.getloadavg()


def make_trajectory(target_bytes: int, i: int = 0) -> Trajectory:
    """A trajectory shaped like DreamGym's: per step a ~0.5 KB state, the same for the next
    state, and the policy prompt (task + state + labelled candidates, ~1.4 KB): ~2.5 KB a step,
    so 2 KB is a one-step episode and 20 KB about eight steps."""
    state = "Goal: put the apple in the fridge.\nRoom: Kitchen. You see a fridge, a counter and an apple.\n" \
            "Inventory: nothing\nActions:\n" + "".join(f"[{k}] take object number {k} from the counter\n" for k in range(1, 10))
    steps: list[Step] = []
    while True:
        steps.append(Step(state=state, action="open fridge", reward=0.0, next_state=state,
                          reasoning="The fridge was closed; opening it reveals its contents.", reasoning_source="mexp",
                          policy_prompt=("<|im_start|>user\nChoose the next action." + state * 2)[:1400],
                          action_token_ids=[81], logprobs=[-0.69], loss_mask=[1], choice_token_ids=list(range(81, 90))))
        traj = Trajectory(f"task{i}", f"g{i}", steps, trajectory_id=f"t{i}")
        size = len(schema.encode(traj))
        if size >= target_bytes * 0.9:
            if size > target_bytes * 1.25 and len(steps) > 1:  # overshot: trim the prompt of the last step
                steps[-1].policy_prompt = steps[-1].policy_prompt[: max(0, len(steps[-1].policy_prompt) - (size - target_bytes))]
            return traj


async def _produce(url: str, stream: str, n: int, traj: Trajectory, batch: int) -> None:
    client = connect(url)
    producer = StreamProducer(client, stream, maxlen=max(10 * n, 100_000))
    for start in range(0, n, batch):
        payloads = []
        for i in range(start, min(n, start + batch)):
            traj.trajectory_id = f"t{i}"
            payloads.append(schema.encode(traj))
        await producer.add(payloads)
    await client.aclose()


async def _consume(url: str, stream: str, n: int) -> float:
    client = connect(url)
    consumer = StreamConsumer(client, stream, "bench", "c0", lambda b: schema.decode_as(b, Trajectory))
    await consumer.ensure_group()
    got = 0
    while got < n:
        batch = await consumer.read(count=100, block_ms=1000)
        got += len(batch)
        await consumer.ack([d.entry_id for d in batch])
    end = time.perf_counter()
    await client.aclose()
    return end


def _producer_main(url: str, stream: str, n: int, size: int, ready) -> None:
    traj = make_trajectory(size)
    ready.wait()
    asyncio.run(_produce(url, stream, n, traj, batch=100))


def whole_path_rate(url: str, n: int, size: int) -> float:
    stream = f"bench:path:{size}:{time.time_ns()}"
    redis.Redis.from_url(url).xgroup_create(stream, "bench", id="0", mkstream=True)
    ready = mp.get_context("spawn").Event()
    proc = mp.get_context("spawn").Process(target=_producer_main, args=(url, stream, n, size, ready))
    proc.start()
    time.sleep(2.0)  # let the producer import and build its payload before the clock starts
    start = time.perf_counter()
    ready.set()
    end = asyncio.run(_consume(url, stream, n))
    proc.join()
    redis.Redis.from_url(url).delete(stream)
    return n / (end - start)


def raw_xadd_rate(url: str, n: int, size: int, pipelined: bool) -> float:
    client = redis.Redis.from_url(url)
    data = schema.encode(make_trajectory(size))
    stream = f"bench:raw:{size}:{pipelined}:{time.time_ns()}"
    start = time.perf_counter()
    if pipelined:
        for s in range(0, n, 100):
            pipe = client.pipeline(transaction=False)
            for _ in range(min(100, n - s)):
                pipe.xadd(stream, {b"d": data})
            pipe.execute()
    else:
        for _ in range(n):
            client.xadd(stream, {b"d": data})
    rate = n / (time.perf_counter() - start)
    client.delete(stream)
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=20_000, help="trajectories per measurement")
    parser.add_argument("--redis-url", default="", help="an existing server (default: start an embedded one)")
    args = parser.parse_args()
    server = None if args.redis_url else EmbeddedRedis().start()
    url = args.redis_url or server.url  # type: ignore[union-attr]
    try:
        print(f"{'size':>6} {'encoded':>8} {'path traj/s':>12} {'raw XADD/s':>11} {'raw piped/s':>12} {'ratio':>6} {'ratio vs piped':>15}  load at end")
        ratios = []
        for size in (2_000, 20_000):
            encoded = len(schema.encode(make_trajectory(size)))
            path = whole_path_rate(url, args.n, size)
            raw = raw_xadd_rate(url, args.n, size, pipelined=False)
            piped = raw_xadd_rate(url, args.n, size, pipelined=True)
            ratios.append(f"{path / raw:.2f} ({size // 1000}KB)")
            print(f"{size // 1000:>4}KB {encoded:>8} {path:>12.0f} {raw:>11.0f} {piped:>12.0f} {path / raw:>6.2f} {path / piped:>15.2f}  {load()}")
        print("ratio = whole path (encode, XADD, XREADGROUP, decode, XACK; two processes) / plain unpipelined XADD of the same bytes")
        print(f"ours / raw XADD ratio: {', '.join(ratios)}")
    finally:
        if server:
            server.stop()


if __name__ == "__main__":
    main()
