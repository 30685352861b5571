"""Async vs sync actor-learner throughput: the same workload, rollout workers of unequal speed.

What it measures: trajectories per second and wall time to finish U learner updates of
B GRPO groups (G episodes each), in two schedules:

- sync: push B tasks, wait until all B groups are back, "train", repeat (no overlap; the
  slowest worker holding a task stalls everyone: the straggler effect);
- async: the scheduler keeps tasks queued, workers play continuously, the learner takes
  the first B complete groups whenever it is free (rollout overlaps training).

Real parts: Redis streams and consumer groups (embedded server), the real rollout
worker (actors/rollout_worker.py) as real Ray actors (infra/run/cluster/worker_actor.py),
the real curriculum scheduler with `curriculum.enabled=false` (uniform sampling, as the
run's ablation) and the real ack protocol. Stand-ins, so it runs in about a minute on a
2-core CPU: the environment is tests/rollout_fakes.LadderEnv whose steps sleep
(worker w's step takes `--step-s * 2**w`: speeds 1x, 2x, 4x, 8x slower), the policy
is the scripted sampler, and an update is a sleep of `--update-s` seconds (the
accelerator time of a real learner step). Both modes consume exactly U*B groups.

    python benchmarks/async_vs_sync.py [--workers 4] [--updates 8] [--groups 4]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from infra.run.cluster.runtime import init_ray, shutdown_ray  # noqa: E402
from infra.run.cluster.worker_actor import RayWorkerHandle  # noqa: E402
from infra.config import ActorsConfig, CurriculumConfig  # noqa: E402
from infra.redis_server import EmbeddedRedis  # noqa: E402
from infra.schema import Task, Trajectory, decode_as, encode  # noqa: E402
from infra.streams import StreamConsumer, StreamProducer, connect, tasks_stream, trajectories_stream  # noqa: E402
from simulator.curriculum import CurriculumScheduler  # noqa: E402
from tests.rollout_fakes import LadderEnv, ScriptedPolicy  # noqa: E402


class StandInLearner:
    """Collects complete groups from the trajectory stream; an update sleeps `update_s` and acks them."""

    def __init__(self, client, prefix: str, group_size: int, groups_per_update: int, update_s: float):
        self.consumer = StreamConsumer(client, trajectories_stream(prefix), "learner", "l0",
                                       lambda b: decode_as(b, Trajectory))
        self.g, self.b, self.update_s = group_size, groups_per_update, update_s
        self.groups: dict[str, list] = defaultdict(list)
        self.ready: list[list] = []
        self.updates = self.trajectories = 0

    async def step(self) -> bool:
        for d in await self.consumer.read(count=64, block_ms=50):
            members = self.groups[d.message.group_id]
            members.append(d.entry_id)
            if len(members) == self.g:
                self.ready.append(self.groups.pop(d.message.group_id))
        if len(self.ready) < self.b:
            return False
        batch, self.ready = self.ready[: self.b], self.ready[self.b:]
        await asyncio.sleep(self.update_s)  # the accelerator's forward/backward/optimizer time
        await self.consumer.ack([e for grp in batch for e in grp])
        self.updates += 1
        self.trajectories += sum(map(len, batch))
        return True


def load() -> str:
    return "load %.2f %.2f %.2f" % os.getloadavg()


async def one_mode(mode: str, url: str, args: argparse.Namespace) -> tuple[float, int, str]:
    prefix = f"bench-{mode}"
    client = connect(url)
    cfg = ActorsConfig(group_size=args.group_size, concurrent_episodes=args.group_size, max_steps=4)
    workers = [RayWorkerHandle.spawn(f"{mode}-w{i}", url, prefix, cfg, functools.partial(ScriptedPolicy, seed=i),
                                     functools.partial(LadderEnv, 3, args.step_s * 2 ** i), options={"num_cpus": 0.25})
               for i in range(args.workers)]
    learner = StandInLearner(client, prefix, args.group_size, args.groups, args.update_s)
    await learner.consumer.ensure_group()
    tasks = [Task(task_id=f"b{i}", instruction="climb") for i in range(16)]
    uniform = CurriculumConfig(enabled=False, batch_size=args.groups, max_backlog=2 * args.workers)
    sampler = CurriculumScheduler(client, uniform, prefix, tasks)
    await sampler.start()  # the pool is in Redis before the clock starts
    for w in workers:  # wait until every actor is up before the clock starts
        await w.status()
    t0 = time.perf_counter()
    if mode == "sync":
        producer = StreamProducer(client, tasks_stream(prefix))
        while learner.updates < args.updates:
            await producer.add(encode(t) for t in await sampler.next_batch())
            while not await learner.step():
                pass
    else:
        stop = asyncio.Event()
        feeder = asyncio.create_task(sampler.run(stop))
        while learner.updates < args.updates:
            await learner.step()
        stop.set()
        await feeder
    wall, at_end = time.perf_counter() - t0, load()
    for w in workers:
        await w.stop(drain=False)
    await client.aclose()
    return wall, learner.trajectories, at_end


async def main(args: argparse.Namespace) -> None:
    with EmbeddedRedis() as redis:
        init_ray(num_cpus=2, memory_bytes=2 * 1024 ** 3, object_store_bytes=128 * 1024 ** 2)
        try:
            results = {m: await one_mode(m, redis.url, args) for m in ("sync", "async")}
        finally:
            shutdown_ray()
    print(f"workload: {args.updates} updates x {args.groups} groups x G={args.group_size}; {args.workers} workers, "
          f"step time {args.step_s:.3f}s x (1,2,4,..); update {args.update_s:.2f}s")
    for m, (wall, n, at_end) in results.items():
        print(f"{m:>5}: {n} trajectories in {wall:6.2f} s = {n / wall:6.2f} trajectories/s  ({at_end})")
    (ws, ns, _), (wa, na, _) = results["sync"], results["async"]
    print(f"async/sync throughput ratio: {(na / wa) / (ns / ws):.2f}x  (target >= 2.5x; AReaL reports 2.77x on GPUs)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--updates", type=int, default=8)
    p.add_argument("--groups", type=int, default=4, help="groups per update (B)")
    p.add_argument("--group-size", type=int, default=4, help="G")
    p.add_argument("--step-s", type=float, default=0.03, help="step time of the fastest worker")
    p.add_argument("--update-s", type=float, default=0.4, help="seconds per learner update")
    asyncio.run(main(p.parse_args()))
