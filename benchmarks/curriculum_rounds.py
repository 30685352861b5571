"""Curriculum rounds on real TextWorld seed tasks with the real SmolLM2 Mtask.

Prints, from one run: Mtask acceptance by outcome, the share of generated tasks
handed out, how often each value tier was picked, and the `dreamgym tasks` table.
The task outcomes are *simulated* (each task gets a fixed success probability and
groups of G Bernoulli rewards are recorded in Redis as the rollout workers would),
so the selection figures show the scheduler's behaviour, not a policy's.

    python benchmarks/curriculum_rounds.py --seeds 6 --batches 24 --generate-every 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from collections import Counter

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's code


def load() -> str:
    return "load %.2f %.2f %.2f" % os.getloadavg()


async def main(args: argparse.Namespace) -> None:
    from rich.console import Console

    from actors.envs.textworld_env import make_textworld_tasks
    from infra.config import CurriculumConfig
    from infra.engine.client import EngineClient
    from infra.engine.server import start_embedded_engine
    from infra.engine.models import load_model
    from infra.redis_server import EmbeddedRedis
    from infra.streams import connect
    from infra.task_stats import TaskStatsStore
    from simulator.curriculum import CurriculumScheduler, tier
    from simulator.embedder import Embedder
    from simulator.task_pool import pool_report, render_table
    from simulator.task_variants import TaskVariantGenerator

    seeds = make_textworld_tasks(args.data_dir, args.seeds, 0, ["tw-simple", "custom"]).train
    rng = random.Random(0)
    p_success = {t.task_id: p for t, p in zip(seeds, [0.0, 0.5, 1.0, 0.25, 0.5, 0.0, 0.75, 1.0] * 4)}
    cfg = CurriculumConfig(batch_size=args.batch_size, lam=args.lam, generate_every=args.generate_every,
                           seeds_per_round=2, variants_per_seed=args.variants_per_seed,
                           variant_max_new_tokens=args.max_new_tokens)
    loaded = load_model("smollm2")
    console = Console(width=150)
    with EmbeddedRedis() as server:
        client = connect(server.url)
        stats = TaskStatsStore(client, "bench")
        engine = await start_embedded_engine("smollm2", max_batch_size=16, loaded=loaded)
        try:
            async with EngineClient([engine.url], role="mexp", timeout_s=1800) as mexp:  # a shared, loaded CPU
                gen = TaskVariantGenerator(mexp, loaded[1], cfg, Embedder())
                sched = CurriculumScheduler(client, cfg, "bench", seeds, variants=gen, seed=0)
                outcomes: Counter = Counter()
                picked_tier: Counter = Counter()
                gen_seconds = 0.0
                for b in range(args.batches):
                    batch = await sched.next_batch()
                    for t in batch:
                        picked_tier[("generated " if t.generated else "seed ") + str(tier(sched.last_stats.get(t.task_id)))] += 1
                        p = p_success.setdefault(t.task_id, rng.choice([0.0, 0.25, 0.5, 1.0]))
                        await stats.record_group(t.task_id, [float(rng.random() < p) for _ in range(4)])
                    t0 = time.perf_counter()
                    await sched.wait_generation()
                    gen_seconds += time.perf_counter() - t0
                    if (b + 1) % cfg.generate_every == 0:
                        r = gen.last_round
                        console.print(f"round after batch {b + 1}: {len(r.accepted)} accepted, {len(r.rejected)} "
                                      f"rejected, {time.perf_counter() - t0:.0f} s  ({load()})")
                        outcomes.update(["accepted"] * len(r.accepted) + [x.reason for x in r.rejected])
                        for x in r.rejected[:3]:
                            console.print(f"  rejected ({x.reason}: {x.detail}): {x.raw[:100]!r}")
                        for t in r.accepted:
                            console.print(f"  accepted (parent {t.parent_id}): {t.instruction[:120]!r}")
                total = sum(outcomes.values())
                console.print(f"Mtask: {outcomes['accepted']}/{total} accepted ({outcomes['accepted'] / max(1, total):.0%}); "
                              f"by outcome {dict(outcomes)}; {gen_seconds:.0f} s waiting on generation  ({load()})")
                share = sched.generated_handed_out / max(1, sched.handed_out)
                console.print(f"handed out {sched.handed_out} tasks, {sched.generated_handed_out} generated "
                              f"({share:.0%}, λ = {cfg.lam})  ({load()})")
                console.print(f"picks by tier (0 informative, 1 unseen, 2 zero variance): {dict(picked_tier)}")
                console.print(render_table(await pool_report(client, "bench"), limit=20))
                console.print(f"ratio generated share handed out / λ: {share / cfg.lam if cfg.lam else float('nan'):.2f} "
                              f"(Mtask acceptance {outcomes['accepted']}/{total})  ({load()})")
        finally:
            await engine.stop()
            await client.aclose()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="data")
    p.add_argument("--seeds", type=int, default=6)
    p.add_argument("--batches", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lam", type=float, default=0.3)
    p.add_argument("--generate-every", type=int, default=4)
    p.add_argument("--variants-per-seed", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96)
    asyncio.run(main(p.parse_args()))
