"""How each curriculum sampler spends rollouts: groups played, and how many distinct games they train.

The learner sets zero-variance groups aside (GRPO gives them no advantage), so a run trains on
its first `--informative` informative groups whichever sampler fed it. This benchmark plays the
real `CurriculumScheduler` (simulator/curriculum.py) against a real Redis server until that many
informative groups came back, and prints, averaged over `--runs` runs:

- groups played (rollouts spent: fewer is cheaper);
- distinct seed games among the informative groups, and the most groups on one game (how
  diverse the training signal is);
- seed games played at all.

Samplers: `uniform` (`curriculum.enabled=false`, the no-curriculum ablation), `draw` (batches
drawn by variance weight from the whole pool, the sampler until 2026-11-29) and `pass` (the
default: passes over the pool, each game kept with probability its weight).

Outcomes are *simulated*, so the figures show the scheduler, not a policy: each seed game gets a
fixed success probability (30 % never solved, 30 % solved 95 % of the time, 40 % uniform in
[0.2, 0.8]: with groups of 4 that sets about 64 % of uniform groups aside, as the real runs of
docs/experiments.md footnote 24 did), groups of G 0/1 rewards are written to Redis as the rollout
workers write them. No Mtask runs: with `--variants N`, N generated tasks (success rates drawn
alike) join the pool at the start, as accepted Mtask variants would, and the λ cap
(`curriculum.lam`, 0.3) lets them in; the last columns then say how many groups went to variants
and the most on one variant. The uniform sampler (the ablation) never plays variants.

    python benchmarks/curriculum_sampling.py [--runs 100] [--seeds 64] [--informative 40] [--variants 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's code

from infra.config import CurriculumConfig  # noqa: E402
from infra.redis_server import EmbeddedRedis  # noqa: E402
from infra.schema import Task  # noqa: E402
from infra.streams import connect  # noqa: E402
from infra.task_stats import TaskStatsStore, group_variance  # noqa: E402
from simulator.curriculum import CurriculumScheduler  # noqa: E402

SAMPLERS = {"uniform": {"enabled": False}, "draw": {"sampling": "draw"}, "pass": {"sampling": "pass"}}


def load() -> str:
    return "load %.2f %.2f %.2f" % os.getloadavg()


def success_rates(n: int, rng: random.Random) -> list[float]:
    out = []
    for _ in range(n):
        u = rng.random()
        out.append(0.0 if u < 0.3 else 0.95 if u < 0.6 else rng.uniform(0.2, 0.8))
    return out


async def one_run(client, sampler: str, run: int, args: argparse.Namespace) -> list[float]:
    """[groups played, distinct seeds among the informative groups, most groups on one of them, seeds played,
    groups on variants, most groups on one variant]."""
    rng = random.Random(run)  # the same games and outcomes stream for every sampler
    p = dict(zip((f"seed-{i}" for i in range(args.seeds)), success_rates(args.seeds, rng)))
    seeds = [Task(task_id=t, family="bench", instruction=f"game {t}") for t in p]
    variants = [Task(task_id=f"v-{i}", family="bench", instruction=f"variant {i}", parent_id=f"seed-{i}",
                     generated=True) for i in range(args.variants)]
    p.update(zip((v.task_id for v in variants), success_rates(args.variants, rng)))
    prefix = f"bench:{sampler}:{run}"
    cfg = CurriculumConfig(batch_size=args.batch_size, variants_per_seed=0, **SAMPLERS[sampler])
    sched = CurriculumScheduler(client, cfg, prefix, seeds, seed=run)
    await sched.start()
    await sched.pool.add(variants)
    stats = TaskStatsStore(client, prefix, cfg.recent_groups)
    played: list[str] = []
    informative: list[str] = []
    while len(informative) < args.informative:
        for task in await sched.next_batch():
            rewards = [float(rng.random() < p[task.task_id]) for _ in range(args.group_size)]
            await stats.record_group(task.task_id, rewards)
            played.append(task.task_id)
            if group_variance(rewards) > 0:
                informative.append(task.task_id)
    trained = [t for t in informative[: args.informative] if t.startswith("seed-")]
    on_variants = [t for t in played if t.startswith("v-")]
    return [len(played), len(set(trained)), max(trained.count(t) for t in set(trained)),
            len({t for t in played if t.startswith("seed-")}), len(on_variants),
            max((on_variants.count(t) for t in set(on_variants)), default=0)]


async def main(args: argparse.Namespace) -> None:
    with EmbeddedRedis() as server:
        client = connect(server.url)
        try:
            rows = {}
            for sampler in SAMPLERS:
                runs = [await one_run(client, sampler, r, args) for r in range(args.runs)]
                rows[sampler] = [statistics.mean(r[i] for r in runs) for i in range(6)]
                g, d, m, s, v, vm = rows[sampler]
                print(f"{sampler:8s} groups played {g:6.1f}   distinct seeds trained {d:5.1f}   most groups on one "
                      f"{m:4.1f}   seeds played {s:5.1f} of {args.seeds}   groups on variants {v:5.1f}, most on one "
                      f"{vm:4.1f}   ({load()})")
        finally:
            await client.aclose()
    u, d, p = rows["uniform"], rows["draw"], rows["pass"]
    print(f"pass/draw ratios: groups played {p[0] / d[0]:.2f}, distinct seeds trained {p[1] / d[1]:.2f}, "
          f"most groups on one {p[2] / d[2]:.2f}; pass/uniform groups played {p[0] / u[0]:.2f}  ({load()})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=100, help="simulated runs per sampler (default: %(default)s)")
    ap.add_argument("--seeds", type=int, default=64, help="seed games in the pool (default: %(default)s, the CPU preset's)")
    ap.add_argument("--informative", type=int, default=40,
                    help="informative groups a run trains on (default: %(default)s = 5 updates of 8 groups)")
    ap.add_argument("--group-size", type=int, default=4, help="rollouts per group (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=4, help="tasks per curriculum batch (default: %(default)s)")
    ap.add_argument("--variants", type=int, default=0,
                    help="generated tasks in the pool from the start (default: %(default)s: seeds only)")
    asyncio.run(main(ap.parse_args()))
