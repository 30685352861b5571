"""The curriculum: selection maths against obvious references, the scheduler against real Redis."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from infra.config import CurriculumConfig
from infra.schema import Task, decode_as
from infra.streams import connect, tasks_stream
from infra.task_stats import TaskStats, TaskStatsStore
from simulator.curriculum import (CurriculumScheduler, generated_quota, pass_order, rank_tasks, selection_weights,
                                  task_value, variance_summary, weighted_sample)


def stats_from(groups: dict[str, list[list[float]]]) -> dict[str, TaskStats]:
    """TaskStats built the slow, obvious way from explicit groups of rewards."""
    out = {}
    for tid, gs in groups.items():
        flat = [r for g in gs for r in g]
        variances = []
        for g in gs:
            m = sum(g) / len(g)
            variances.append(sum((r - m) ** 2 for r in g) / len(g))
        out[tid] = TaskStats(tid, len(flat), sum(flat), sum(r * r for r in flat), len(gs), list(reversed(variances)))
    return out


KNOWN = stats_from({
    "always-solved": [[1, 1, 1, 1], [1, 1, 1, 1]],
    "always-failed": [[0, 0, 0, 0]],
    "balanced": [[1, 0, 1, 0], [0, 1, 1, 0]],   # V = 0.25, the maximum for 0/1 rewards
    "sometimes": [[1, 0, 0, 0]],                # V = 0.1875
})


def test_task_value_is_eq7_group_variance():
    assert task_value(KNOWN["balanced"]) == pytest.approx(0.25)
    assert task_value(KNOWN["sometimes"]) == pytest.approx(3 / 16)
    assert task_value(KNOWN["always-solved"]) == 0.0
    assert task_value(None) == 0.0


def test_ranking_puts_high_variance_first_and_zero_variance_last():
    ranked = rank_tasks(["always-solved", "unseen", "sometimes", "always-failed", "balanced"], KNOWN)
    assert ranked[:2] == ["balanced", "sometimes"]
    assert ranked[2] == "unseen"
    assert set(ranked[3:]) == {"always-solved", "always-failed"}


def test_selection_picks_the_high_variance_task():
    ids = ["always-solved", "always-failed", "balanced", "sometimes"]
    w = selection_weights(ids, KNOWN, min_weight=0.1)
    assert w == pytest.approx([0.1, 0.1, 1.0, 0.75])
    rng = random.Random(0)
    firsts = [weighted_sample(ids, w, 1, rng)[0] for _ in range(4000)]
    share = firsts.count("balanced") / len(firsts)
    assert share == pytest.approx(1.0 / 1.95, abs=0.03)  # w / sum(w)
    assert max(set(firsts), key=firsts.count) == "balanced"


def test_weighted_sample_is_without_replacement_until_exhausted():
    rng = random.Random(1)
    got = weighted_sample(["a", "b", "c"], [1.0, 1.0, 1.0], 3, rng)
    assert sorted(got) == ["a", "b", "c"]
    got = weighted_sample(["a", "b"], [1.0, 0.1], 5, rng)
    assert len(got) == 5 and sorted(got[:2]) == ["a", "b"] and sorted(got[2:4]) == ["a", "b"]


def test_generated_quota_matches_a_brute_force_reference():
    def reference(b, lam, total, gen):  # the largest g in 0..b with gen + g <= lam * (total + b)
        return max([g for g in range(b + 1) if gen + g <= lam * (total + b) + 1e-9], default=0)
    for b in (1, 2, 3, 4, 8):
        for lam in (0.0, 0.1, 0.25, 0.3, 0.5, 1.0):
            for total in range(0, 40, 3):
                for gen in range(0, int(lam * total) + 1):
                    assert generated_quota(b, lam, total, gen) == reference(b, lam, total, gen)


def test_variance_summary():
    mean_v, zero = variance_summary(KNOWN)
    assert mean_v == pytest.approx((0 + 0 + 0.25 + 0.1875) / 4)
    assert zero == pytest.approx(3 / 6)  # 3 of the 6 recent groups had all-equal rewards


def _seeds(n: int) -> list[Task]:
    return [Task(task_id=f"seed-{i}", instruction=f"find the key number {i}", family="tw-simple") for i in range(n)]


class AlwaysVariants:
    """A VariantSource that writes one variant per seed deterministically (the real one needs an LLM;
    tests/test_task_variants.py covers it)."""

    def __init__(self):
        self.calls = 0

    async def generate(self, seeds, existing):
        self.calls += 1
        return [Task(task_id=f"{s.task_id}.v{self.calls}", instruction=s.instruction + f" variant {self.calls}",
                     parent_id=s.task_id, generated=True) for s in seeds]


async def test_lambda_holds_over_many_batches(redis_url):
    client = connect(redis_url)
    cfg = CurriculumConfig(lam=0.3, batch_size=2, generate_every=1, seeds_per_round=2, variants_per_seed=1)
    sched = CurriculumScheduler(client, cfg, "lam", _seeds(6), variants=AlwaysVariants(), seed=3)
    total = gen = 0
    for i in range(200):
        batch = await sched.next_batch()
        await sched.wait_generation()
        total += len(batch)
        gen += sum(t.generated for t in batch)
        assert gen <= 0.3 * total + 1e-9, f"after batch {i}: {gen}/{total}"
    assert len(sched.pool.generated()) > 0
    assert gen / total == pytest.approx(0.3, abs=0.02)
    assert sched.generated_handed_out == gen
    await client.aclose()


async def test_a_generated_task_without_reward_variance_is_not_handed_out_again(redis_url):
    """λ caps the generated share; it does not make a zero-variance variant fill it."""
    client = connect(redis_url)
    store = TaskStatsStore(client, "zv")
    cfg = CurriculumConfig(lam=0.3, batch_size=2, generate_every=10_000, seeds_per_round=1, variants_per_seed=1)
    sched = CurriculumScheduler(client, cfg, "zv", _seeds(4), variants=AlwaysVariants(), seed=1)
    await sched.start()
    await sched.pool.add([Task(task_id="v-dead", instruction="garbled", parent_id="seed-0", generated=True),
                          Task(task_id="v-live", instruction="fine", parent_id="seed-1", generated=True)])
    await store.record_group("v-dead", [0, 0, 0, 0])
    await store.record_group("v-live", [1, 0, 0, 1])
    picks = [t.task_id for _ in range(100) for t in await sched.next_batch()]
    assert "v-dead" not in picks
    live = picks.count("v-live")  # played once per pass over the seeds (sampling "pass"), within the cap
    assert 0 < live <= sched._started_passes["seed"] and live <= 0.3 * len(picks)
    for _ in range(cfg.recent_groups):  # its recent groups now carry no signal either
        await store.record_group("v-live", [1, 1, 1, 1])
    later = [t.task_id for _ in range(20) for t in await sched.next_batch()]
    assert not any(t.startswith("v-") for t in later)
    await client.aclose()


async def test_scheduler_prefers_high_variance_tasks_from_redis_stats(redis_url):
    client = connect(redis_url)
    store = TaskStatsStore(client, "pref")
    for _ in range(2):
        await store.record_group("seed-0", [1, 0, 1, 0])
        await store.record_group("seed-1", [1, 1, 1, 1])
        await store.record_group("seed-2", [0, 0, 0, 0])
    cfg = CurriculumConfig(batch_size=1, min_weight=0.1, lam=0.0)
    sched = CurriculumScheduler(client, cfg, "pref", _seeds(3), seed=0)
    picks = [(await sched.next_batch())[0].task_id for _ in range(300)]
    assert picks.count("seed-0") / 300 == pytest.approx(1 / 1.2, abs=0.07)
    await client.aclose()


def test_a_pass_keeps_each_item_once_with_probability_its_weight():
    items, weights = ["sure", "never", "half", "tenth"], [1.0, 0.0, 0.5, 0.1]
    rng = random.Random(0)
    passes = [pass_order(items, weights, rng) for _ in range(4000)]
    assert all(len(p) == len(set(p)) for p in passes)  # without replacement within a pass
    kept = {t: sum(t in p for p in passes) / len(passes) for t in items}
    assert kept["sure"] == 1.0 and kept["never"] == 0.0
    assert kept["half"] == pytest.approx(0.5, abs=0.03) and kept["tenth"] == pytest.approx(0.1, abs=0.02)
    firsts = [p[0] for p in passes if len(p) == 2 and set(p) == {"sure", "half"}]
    assert firsts.count("sure") / len(firsts) == pytest.approx(0.5, abs=0.05)  # the order is random


async def test_pass_sampling_plays_no_seed_twice_before_every_kept_one_once(redis_url):
    client = connect(redis_url)
    store = TaskStatsStore(client, "pass")
    cfg = CurriculumConfig(batch_size=1, lam=0.0, min_weight=0.0, sampling="pass")
    sched = CurriculumScheduler(client, cfg, "pass", _seeds(6), seed=3)
    first = [(await sched.next_batch())[0].task_id for _ in range(6)]
    assert sorted(first) == [f"seed-{i}" for i in range(6)]  # unseen seeds weigh 1: a permutation
    for i in range(6):  # seeds 0-2 never vary (weight min_weight = 0), 3-5 are balanced (weight 1)
        await store.record_group(f"seed-{i}", [1, 0, 1, 0] if i >= 3 else [0, 0, 0, 0])
    assert not sched._passes["seed"]  # the first pass is spent: the next starts on these statistics
    picks = [(await sched.next_batch())[0].task_id for _ in range(30)]
    for k in range(0, 30, 3):  # every pass is exactly the three balanced seeds, in some order
        assert sorted(picks[k:k + 3]) == ["seed-3", "seed-4", "seed-5"], picks
    await client.aclose()


async def test_pass_sampling_hands_a_variant_out_at_most_once_per_pass_over_the_seeds(redis_url):
    client = connect(redis_url)
    variant = Task(task_id="v-0", instruction="a variant", family="tw", parent_id="seed-0", generated=True)
    for sampling in ("draw", "pass"):
        prefix = f"vpass-{sampling}"
        await TaskStatsStore(client, prefix).record_group("v-0", [1, 0, 1, 0])  # informative: eligible, weight 1
        sched = CurriculumScheduler(client, CurriculumConfig(batch_size=2, lam=0.5, sampling=sampling), prefix,
                                    _seeds(4), seed=1)
        await sched.start()
        await sched.pool.add([variant])
        picks = [t.task_id for _ in range(20) for t in await sched.next_batch()]
        if sampling == "draw":  # the λ cap filled as a quota: the one variant takes half of everything
            assert picks.count("v-0") == 20
        else:  # once per pass over the 4 seeds (each kept: unseen), seeds fill the rest of the batch
            assert 1 <= picks.count("v-0") <= sched._started_passes["seed"] <= 10
            assert sched.generated_handed_out <= 0.5 * sched.handed_out
    await client.aclose()


async def test_a_pass_that_keeps_nothing_still_hands_out_a_batch(redis_url):
    client = connect(redis_url)
    store = TaskStatsStore(client, "empty")
    for i in range(3):
        await store.record_group(f"seed-{i}", [1, 1, 1, 1])
    sched = CurriculumScheduler(client, CurriculumConfig(batch_size=2, lam=0.0, min_weight=0.0), "empty", _seeds(3))
    batch = await asyncio.wait_for(sched.next_batch(), 5)
    assert len(batch) == 2 and {t.task_id for t in batch} <= {"seed-0", "seed-1", "seed-2"}
    await client.aclose()


async def test_ablation_switch_samples_seeds_uniformly_without_variants(redis_url):
    client = connect(redis_url)
    cfg = CurriculumConfig(enabled=False, batch_size=3, generate_every=1)
    variants = AlwaysVariants()
    sched = CurriculumScheduler(client, cfg, "abl", _seeds(6), variants=variants, seed=0)
    seen = []
    for _ in range(4):
        seen += [t.task_id for t in await sched.next_batch()]
    assert sorted(seen[:6]) == sorted(seen[6:]) == [f"seed-{i}" for i in range(6)]  # one pass = each once
    assert variants.calls == 0 and not sched.pool.generated()
    await sched.next_batch()  # mid-pass
    state = sched.state_dict()
    ahead = [t.task_id for _ in range(3) for t in await sched.next_batch()]
    resumed = CurriculumScheduler(client, cfg, "abl", _seeds(6), seed=42)
    await resumed.load_state_dict(state)
    assert [t.task_id for _ in range(3) for t in await resumed.next_batch()] == ahead
    await client.aclose()


async def test_state_is_restored_after_the_scheduler_restarts(redis_server, redis_url):
    client = connect(redis_url)
    cfg = CurriculumConfig(lam=0.5, batch_size=2, generate_every=1, seeds_per_round=1)
    store = TaskStatsStore(client, "rs")
    await store.record_group("seed-1", [1, 0, 0, 1])
    sched = CurriculumScheduler(client, cfg, "rs", _seeds(4), variants=AlwaysVariants(), seed=7)
    for _ in range(5):
        await sched.next_batch()
        await sched.wait_generation()
    sched.variants = None  # the pool stays as checkpointed while we look ahead
    state = json.loads(json.dumps(sched.state_dict()))  # must survive a JSON checkpoint
    assert len(state["pool"]) > 4
    expected_next = [[t.task_id for t in await sched.next_batch()] for _ in range(3)]

    # 1. A new scheduler process against the same Redis picks up the pool and counters by itself.
    again = CurriculumScheduler(client, cfg, "rs", _seeds(4), variants=None, seed=99)
    await again.start()
    assert set(again.pool.tasks) == set(sched.pool.tasks)
    assert again.handed_out == sched.handed_out and again.batches == sched.batches
    gen = next(t for t in again.pool.generated())
    assert gen.parent_id.startswith("seed-") and gen.generated

    # 2. --resume from the checkpoint into an empty Redis restores pool, stats, RNG and counters.
    await client.flushall()
    resumed = CurriculumScheduler(client, cfg, "rs", _seeds(4), variants=None, seed=12345)
    await resumed.load_state_dict(state)
    assert {t["task_id"] for t in state["pool"]} == set(resumed.pool.tasks)
    assert (await TaskStatsStore(client, "rs").get("seed-1")).group_variance == pytest.approx(0.25)
    assert resumed.handed_out == state["counters"]["pushed"]
    assert [[t.task_id for t in await resumed.next_batch()] for _ in range(3)] == expected_next
    await client.aclose()


async def test_run_pushes_batches_with_backpressure(redis_url):
    client = connect(redis_url)
    cfg = CurriculumConfig(batch_size=2, max_backlog=4, lam=0.0)
    sched = CurriculumScheduler(client, cfg, "run", _seeds(3), seed=0, poll_s=0.05)
    stop = asyncio.Event()
    runner = asyncio.create_task(sched.run(stop))
    await asyncio.sleep(0.5)
    stop.set()
    await runner
    entries = await client.xrange(tasks_stream("run"))
    assert len(entries) == 4  # stopped at max_backlog: nobody consumed
    assert all(decode_as(f[b"d"], Task).task_id.startswith("seed-") for _, f in entries)
    await client.aclose()


@pytest.mark.ray
@pytest.mark.slow
async def test_scheduler_actor_pushes_batches_and_checkpoints(redis_url):
    from infra.run.cluster.runtime import init_ray, shutdown_ray
    from infra.run.cluster.scheduler_actor import spawn_scheduler

    import sys

    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ship AlwaysVariants by value
    init_ray(num_cpus=2, memory_bytes=1024 ** 3, object_store_bytes=96 * 1024 ** 2)
    try:
        cfg = CurriculumConfig(batch_size=2, lam=0.5, generate_every=1, seeds_per_round=1, max_backlog=6)
        actor = spawn_scheduler(redis_url, "act", cfg, _seeds(3), make_variants=AlwaysVariants, seed=1,
                                options={"num_cpus": 0}, limit=6)
        status = await actor.run.remote()
        assert status["handed_out"] == 6 and status["pool"] >= 3
        client = connect(redis_url)
        assert await client.xlen(tasks_stream("act")) == 6
        state = await actor.state_dict.remote()
        assert state["counters"]["pushed"] == 6 and len(state["pool"]) >= status["pool"] > 3
        await client.aclose()
    finally:
        shutdown_ray()
