"""Sim-to-real's real phase plays where the policy still splits: the selection rule against a slow
reading of its docstring, the scheduler that applies it against real Redis, a simulated real phase
against the curriculum's own sampler, and the summary's account of what reached an update."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from infra.config import CurriculumConfig, load_config
from infra.run.driver import S2R_PHASE, s2r_share
from infra.schema import Task
from infra.streams import connect
from infra.task_stats import TaskStats, TaskStatsStore, group_variance
from simulator.curriculum import CurriculumScheduler, pass_order, selection_weights
from simulator.s2r_selection import pick_splitting, split_order, split_tier, still_played


def stats_of(groups: list[list[float]], tid: str = "t") -> TaskStats:
    """A task's stats from explicit groups of rewards, oldest first (the store keeps the newest first)."""
    flat = [r for g in groups for r in g]
    return TaskStats(tid, len(flat), float(sum(flat)), float(sum(r * r for r in flat)), len(groups),
                     [group_variance(g) for g in reversed(groups)][:4])


def slow_order(ids: list[str], stats: dict[str, TaskStats], played: set[str]) -> list[str]:
    """The module docstring read literally: buckets filled by explicit tests, each sorted, then joined."""
    def bucket(tid: str) -> int:
        s = stats.get(tid)
        if s is None or s.groups == 0:
            return 3
        if s.recent_group_variances and s.recent_group_variances[0] > 0:
            return 0
        if any(v > 0 for v in s.recent_group_variances):
            return 1
        rewards_differ = s.n and s.total_sq / s.n - (s.total / s.n) ** 2 > 1e-12
        return 2 if rewards_differ else 4

    out = []
    for was_played in (False, True):
        for b in range(5):
            members = [t for t in ids if (t in played) == was_played and bucket(t) == b]
            members.sort()  # stable sorts, the least significant key first
            members.sort(key=lambda t: abs((stats[t].mean if t in stats and stats[t].n else 0.5) - 0.5))
            members.sort(key=lambda t: -(stats[t].recent_group_variances[0]
                                         if t in stats and stats[t].recent_group_variances else 0.0))
            out += members
    return out


def test_tiers_follow_the_newest_group_then_any_recent_then_ever_split():
    assert split_tier(None) == 3 and split_tier(TaskStats("t")) == 3
    assert split_tier(stats_of([[1, 1, 1, 1], [1, 0, 1, 0]])) == 0  # split in its newest group
    assert split_tier(stats_of([[1, 0, 0, 0], [1, 1, 1, 1]])) == 1  # an older recent group split
    assert split_tier(stats_of([[0, 0, 0, 0], [1, 1, 1, 1]])) == 2  # solved once, failed once, never in one group
    assert split_tier(stats_of([[1, 1, 1, 1], [1, 1, 1, 1]])) == 4  # always solved
    assert split_tier(stats_of([[0, 0, 0, 0]])) == 4  # always failed
    # older groups beyond the recent window no longer count as recent, but still as "solved and failed once"
    old = stats_of([[1, 0, 1, 0]] + [[1, 1, 1, 1]] * 4)
    assert old.recent_group_variances == [0.0] * 4 and split_tier(old) == 2


group = st.lists(st.sampled_from([0.0, 1.0]), min_size=4, max_size=4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(group, max_size=6), min_size=1, max_size=12), st.data())
def test_order_matches_the_slow_reading(task_groups, data):
    ids = [f"t{i:02d}" for i in range(len(task_groups))]
    stats = {tid: stats_of(g, tid) for tid, g in zip(ids, task_groups) if g}  # no record: never played
    played = set(data.draw(st.lists(st.sampled_from(ids), max_size=len(ids))))
    got = split_order(ids, stats, played)
    assert got == slow_order(ids, stats, played)
    k = data.draw(st.integers(0, len(ids) + 2))
    batch = pick_splitting(ids, stats, k, played)
    assert batch == got[:k] and len(set(batch)) == len(batch) == min(k, len(ids))


def test_balanced_tasks_come_before_lopsided_ones_and_played_ones_last():
    stats = {"lopsided": stats_of([[1, 0, 0, 0]], "lopsided"), "balanced": stats_of([[1, 0, 1, 0]], "balanced"),
             "solved": stats_of([[1, 1, 1, 1]], "solved")}
    assert split_order(["solved", "lopsided", "balanced", "new"], stats) == ["balanced", "lopsided", "new", "solved"]
    assert split_order(["solved", "lopsided", "balanced", "new"], stats, {"balanced"}) == \
        ["lopsided", "new", "solved", "balanced"]


async def test_scheduler_real_phase_plays_splitting_seeds_once_per_pass(redis_url):
    client = connect(redis_url)
    cfg = CurriculumConfig(batch_size=2, lam=1.0)
    seeds = [Task(f"s{i}", "do", game_file=f"/g{i}.z8") for i in range(6)]
    try:
        sched = CurriculumScheduler(client, cfg, "s2rsel", seeds)
        await sched.start()
        await sched.pool.add([Task("v-1", "a variant", generated=True, parent_id="s0")])
        store = TaskStatsStore(client, "s2rsel")
        for tid, rewards in (("s0", [1, 1, 1, 1]), ("s1", [1, 0, 1, 0]), ("s2", [0, 0, 0, 0]),
                             ("s3", [1, 0, 0, 0]), ("s4", [1, 1, 1, 1]), ("s5", [1, 1, 0, 1]), ("v-1", [1, 0, 1, 0])):
            await store.record_group(tid, rewards)
        sched.real_only, sched.real_selection = True, "split"
        batches = [[t.task_id for t in await sched.next_batch()] for _ in range(3)]
        # the balanced split, then the 3:1 splits (equally far from 0.5: by id), then the rest by id;
        # one pass hands out every seed once, and never the variant (no real counterpart)
        assert batches == [["s1", "s3"], ["s5", "s0"], ["s2", "s4"]]
        # a real group of s1 that did not split: its newest group says so, the next pass starts elsewhere
        await store.record_group("s1", [1, 1, 1, 1])
        assert [t.task_id for t in await sched.next_batch()] == ["s3", "s5"]
        assert [t.task_id for t in await sched.next_batch()] == ["s1", "s0"]  # still a recent split: tier 1
        # s3's real group split: it is played again at once, ahead of the pass's rest
        await store.record_group("s3", [1, 0, 1, 0])
        assert [t.task_id for t in await sched.next_batch()] == ["s3", "s2"]
        # the real GRPO baseline (and a run that asks for it) keeps the curriculum's sampling
        sched.real_selection = "curriculum"
        handed = dict(sched._real_handed)
        picked = {t.task_id for _ in range(6) for t in await sched.next_batch()}
        assert picked <= {f"s{i}" for i in range(6)} and sched._real_handed == handed
    finally:
        await client.aclose()


def simulated_real_phase(select: str, solved_share: float = 0.5, trials: int = 150, tasks: int = 64,
                         groups_dg: int = 110, groups_real: int = 10, batch: int = 4, g: int = 4,
                         noise: float = 0.2, seed: int = 0) -> float:
    """Share of a real phase's trajectories that fall in groups with reward variance.

    Each task has a real success rate: `solved_share` of them near-solved (0.9-1), a sixth hopeless
    (0-0.1), the rest in between, as a DreamGym-trained policy on its training games. DreamGym's
    statistics come from `groups_dg` groups played at a simulator's rate that misses the real one by
    up to `noise`; then `groups_real` real groups, handed out `batch` at a time, each batch's
    outcomes recorded before the next: by the split rule as the scheduler applies it, or by the
    curriculum's passes over its weights (min_weight 0.1, the default)."""
    rng = random.Random(seed)
    hit = total = 0
    for _ in range(trials):
        p = []
        for _t in range(tasks):
            x = rng.random()
            p.append(rng.uniform(0.9, 1.0) if x < solved_share else rng.uniform(0.0, 0.1) if x < solved_share + 1 / 6
                     else rng.uniform(0.2, 0.8))
        sim = [min(1.0, max(0.0, x + rng.uniform(-noise, noise))) for x in p]
        ids = [f"t{i}" for i in range(tasks)]
        groups: dict[str, list[list[float]]] = {t: [] for t in ids}
        for j in range(groups_dg):
            i = j % tasks if j < tasks else rng.randrange(tasks)
            groups[ids[i]].append([float(rng.random() < sim[i]) for _ in range(g)])
        handed: dict[str, int] = {}
        order: list[str] = []
        done = 0
        while done < groups_real:
            stats = {t: stats_of(gs, t) for t, gs in groups.items() if gs}
            if select == "split":
                played = still_played(handed, stats)
                if set(ids) <= played:
                    handed, played = {}, set()
                picks = pick_splitting(ids, stats, batch, played)
                handed.update({t: stats[t].groups if t in stats else 0 for t in picks})
            else:
                if not order:
                    order = pass_order(ids, selection_weights(ids, stats, 0.1), rng)
                picks = [order.pop() for _ in range(min(batch, len(order)))]
            for t in picks[:groups_real - done]:
                rewards = [float(rng.random() < p[ids.index(t)]) for _ in range(g)]
                groups[t].append(rewards)
                total += g
                hit += g * (group_variance(rewards) > 0)
                done += 1
    return hit / total


def test_split_rule_trains_more_of_a_simulated_real_phase_than_the_curriculums_passes():
    for solved, margin in ((0.5, 0.1), (0.75, 0.1)):
        split, passes = simulated_real_phase("split", solved), simulated_real_phase("passes", solved)
        assert split > passes + margin, (solved, split, passes)


def test_summary_counts_the_real_transitions_that_reached_an_update():
    dg = {"phase": "DreamGym", "real_transitions": 0, "real_transitions_trained": 0}
    real = {"phase": S2R_PHASE, "real_transitions": 96, "real_transitions_trained": 60}
    assert s2r_share([dg]) == {}
    assert s2r_share([dg, real]) == {"s2r_real_transitions": 96, "s2r_real_transitions_trained": 60,
                                     "s2r_trained_share": 0.625}
    resumed = {"phase": S2R_PHASE, "real_transitions": 96, "earlier_segment": True}  # its updates not counted here
    assert s2r_share([dg, resumed])["s2r_real_transitions_trained"] is None
    assert load_config(None, []).learner.s2r_selection == "split"


def test_a_task_waits_until_a_group_recorded_since_its_hand_out_split():
    stats = {"a": stats_of([[1, 0, 1, 0]], "a"), "b": stats_of([[1, 0, 1, 0], [1, 1, 1, 1]], "b"),
             "c": stats_of([[1, 1, 1, 1], [1, 0, 0, 0]], "c")}
    # a: no group since its hand-out (its split is the simulator's, older); b: a group since, no split;
    # c: a group since that split
    assert still_played({"a": 1, "b": 1, "c": 1}, stats) == {"a", "b"}
    assert still_played({}, stats) == set()


def test_the_real_phase_has_a_temperature_of_its_own():
    from infra.run.driver import rl_plan

    cfg = load_config(None, ["learner.total_updates=2", "learner.s2r_real_transitions=8", "learner.s2r_temperature=1.5"])
    (dg, _l, _u), (real, label, _u2) = rl_plan(cfg)
    assert label == S2R_PHASE and real.actors.temperature == 1.5 and dg.actors.temperature == cfg.actors.temperature
    plain = load_config(None, ["learner.total_updates=2", "learner.s2r_real_transitions=8"])
    assert rl_plan(plain)[1][0].actors.temperature == plain.actors.temperature  # 0: the rollouts' own
