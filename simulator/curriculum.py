"""The curriculum: which tasks the rollout workers play next (paper §4.2, Eq. 6-7).

Owns task selection and the scheduler loop that pushes task batches to the task
stream. The maths are pure functions at the top (tested against obvious loops);
`CurriculumScheduler` below is a plain async class (Ray wraps it in
infra/run/cluster/scheduler_actor.py).

- Task value V_tau (Eq. 7) is the reward variance of a task's recent GRPO groups,
  kept in Redis by the rollout workers (infra/task_stats.py). Ranking: tasks with
  non-zero variance first, highest V_tau first (for 0/1 rewards V = p(1-p), so the
  balanced ones, p = 0.5, rank highest; ties go to the mean nearest 0.5); then tasks
  never played (unknown value, worth a look); zero-variance tasks (always solved or
  always failed) last.
- Weights are V_tau / max V_tau (unseen tasks 1, zero-variance ones `min_weight`).
  Departure from drawing batches by weight (`sampling: draw`, the sampler until
  2026-11-29): by default (`sampling: pass`) the scheduler walks the seed tasks in
  passes, each a random order of them, each kept in the pass with probability its
  weight; the variants the λ cap lets in walk passes of their own, at most one of
  theirs per pass over the seeds (so a variant, too, is played at most once a pass,
  and λ stays a cap: with one variant's pass per seed pass fewer than λ of the
  tasks may be variants). Why: the learner sets zero-variance groups aside (GRPO gives them no
  advantage), so every update trains on informative groups whichever sampler fed it;
  what the weights still buy is fewer wasted rollouts, and drawn by weight they
  bought it by replaying the same few balanced games. benchmarks/curriculum_sampling.py
  (the real scheduler and Redis, simulated 0/1 outcomes for 64 seeds, groups of 4,
  until 40 informative groups, 100 runs): draws played 91 groups, training on 22.3
  distinct seeds with up to 4.3 groups on one; passes 93 groups, 24.3 seeds, 2.7 at
  most; uniform 112 groups, 28.5 seeds, 2.1 at most. With 8 variants in the pool
  (`--variants 8`) draws gave one variant 9.5 groups; passes 2.2. In the real runs of
  docs/experiments.md footnote 24 the drawn curriculum played 53-58 of the 64 seeds.
- Every `generate_every` batches the top-ranked tasks (non-zero variance or unseen;
  never zero-variance ones, which carry no signal) are handed to Mtask
  (simulator/task_variants.py), which writes variants that join the pool once valid.
- λ: departure from a literal per-batch bound. With the small batches of one CPU
  machine (2-4 tasks, λ = 0.3) `floor(λ·B)` is 0 and no generated task would ever
  be played, so the bound is kept on the running totals instead: after every batch,
  generated tasks handed out <= λ · all tasks handed out. Over many batches the
  share tends to λ and never exceeds it at a batch boundary. The share is a cap,
  not a quota: a generated task whose recent groups all had equal rewards is not
  handed out again (a seed task keeps `min_weight`; it is a real task, a variant may
  be garbled). Filled as a quota, one variant whose rollouts always failed took 21
  of a run's first 100 tasks while 171 trajectories went untrained as zero variance.
- `cfg.enabled = False` is the paper's "w/o task generation" ablation: uniform
  sampling over the seed tasks, no variants.
- Sim-to-real's real phase (`real_selection = "split"`, from `learner.s2r_selection`):
  the seed tasks are ranked, not sampled, by simulator/s2r_selection.py (where the
  policy's recent groups split first), each once per pass unless its real group split.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from dataclasses import asdict
from typing import Protocol, Sequence

import redis.asyncio as aioredis

from infra import metrics
from infra.config import CurriculumConfig
from infra.schema import Task, encode, from_dict, to_dict
from infra.stream_backlog import stream_backlog
from infra.streams import StreamProducer, tasks_stream, with_retry
from infra.task_stats import TaskStats, TaskStatsStore
from simulator.s2r_selection import pick_splitting, still_played
from simulator.task_pool import PoolFull, TaskPool, counters_key

log = logging.getLogger(__name__)

STATE_VERSION = 1


# ----- pure selection maths -----

def task_value(s: TaskStats | None) -> float:
    """V_tau (Eq. 7): the mean reward variance of the task's recent groups; 0 when never played."""
    return s.group_variance if s is not None else 0.0


def tier(s: TaskStats | None) -> int:
    """0: informative (V_tau > 0), 1: never played, 2: zero variance (always solved or always failed)."""
    if s is None or s.groups == 0:
        return 1
    return 0 if s.group_variance > 0 else 2


def rank_tasks(task_ids: Sequence[str], stats: dict[str, TaskStats]) -> list[str]:
    """Task ids, most valuable first: non-zero variance (highest, then most balanced), unseen, zero variance."""
    def k(tid: str) -> tuple:
        s = stats.get(tid)
        return (tier(s), -task_value(s), abs((s.mean if s else 0.5) - 0.5), s.n if s else 0, tid)
    return sorted(task_ids, key=k)


def selection_weights(task_ids: Sequence[str], stats: dict[str, TaskStats], min_weight: float) -> list[float]:
    """Sampling weight per task: V_tau relative to the pool's largest, floored at min_weight; unseen tasks 1."""
    vmax = max((task_value(stats.get(t)) for t in task_ids), default=0.0)
    out = []
    for t in task_ids:
        s = stats.get(t)
        if tier(s) == 1:
            out.append(1.0)
        elif vmax > 0:
            out.append(max(min_weight, task_value(s) / vmax))
        else:
            out.append(min_weight)
    return out


def weighted_sample(items: Sequence[str], weights: Sequence[float], k: int, rng: random.Random) -> list[str]:
    """k draws, each proportional to weight among the items not yet drawn; repeats only once all are drawn."""
    out: list[str] = []
    while len(out) < k and items:
        left = list(range(len(items)))
        while left and len(out) < k:
            total = sum(weights[i] for i in left)
            x, acc = rng.random() * total, 0.0
            for j, i in enumerate(left):
                acc += weights[i]
                if x < acc or j == len(left) - 1:
                    out.append(items[i])
                    left.pop(j)
                    break
    return out


def pass_order(items: Sequence[str], weights: Sequence[float], rng: random.Random) -> list[str]:
    """One pass: the items in random order, each kept with probability its weight (weights in [0, 1])."""
    order = rng.sample(list(items), len(items))
    keep = dict(zip(items, weights))
    return [t for t in order if rng.random() < keep[t]]


def generated_quota(batch_size: int, lam: float, handed_out: int, generated_handed_out: int) -> int:
    """Most generated tasks the next batch may hold so that, after it, generated <= λ · all."""
    allowed = math.floor(lam * (handed_out + batch_size) + 1e-9) - generated_handed_out
    return max(0, min(batch_size, allowed))


def generation_seeds(pool: TaskPool, stats: dict[str, TaskStats], k: int, max_children: int) -> list[Task]:
    """The k most valuable tasks worth expanding: informative or unseen, with room for more children."""
    ranked = rank_tasks(list(pool.tasks), stats)
    out = []
    for tid in ranked:
        if len(out) >= k:
            break
        if tier(stats.get(tid)) == 2 or len(pool.children(tid)) >= max_children:
            continue
        out.append(pool.tasks[tid])
    return out


def variance_summary(stats: dict[str, TaskStats]) -> tuple[float, float]:
    """(mean V_tau over played tasks, fraction of their recent groups with zero variance)."""
    played = [s for s in stats.values() if s.groups]
    groups = [v for s in played for v in s.recent_group_variances]
    mean_v = sum(s.group_variance for s in played) / len(played) if played else 0.0
    zero = sum(1 for v in groups if v <= 0.0) / len(groups) if groups else 0.0
    return mean_v, zero


# ----- the scheduler -----

class VariantSource(Protocol):
    """Mtask: writes validated variants of seed tasks (simulator/task_variants.py)."""

    async def generate(self, seeds: list[Task], existing: list[Task]) -> list[Task]: ...


class CurriculumScheduler:
    """Picks task batches from the pool, grows the pool with variants, pushes batches to the task stream."""

    def __init__(self, client: aioredis.Redis, cfg: CurriculumConfig, prefix: str, seeds: list[Task],
                 variants: VariantSource | None = None, seed: int = 0, stream_maxlen: int = 100_000,
                 limit: int | None = None, poll_s: float = 0.2):
        self.client, self.cfg, self.prefix = client, cfg, prefix
        self.seed_tasks = list(seeds)
        self.variants = variants
        self.pool = TaskPool(client, prefix, cfg.max_pool)
        self.stats = TaskStatsStore(client, prefix, cfg.recent_groups)
        self.stream = tasks_stream(prefix)
        self.producer = StreamProducer(client, self.stream, stream_maxlen)
        self.rng = random.Random(seed)
        self.batches = self.handed_out = self.generated_handed_out = 0
        self.last_stats: dict[str, TaskStats] = {}
        self.limit, self.poll_s = limit, poll_s  # limit: most tasks pushed by run() (sync mode, tests)
        self.pushed = 0  # by this process's run()/push_batch()
        self._order: list[Task] = []  # uniform mode: the rest of the current pass over the seeds
        self._passes: dict[str, list[str]] = {"seed": [], "generated": []}  # sampling "pass": the rest of each pass
        self._started_passes = {"seed": 0, "generated": 0}  # how many passes each kind has started
        self._generation: asyncio.Task | None = None
        self._started = False
        # Real rollouts (the real-environment baseline, the real phase of sim-to-real) can only
        # play tasks that have a real counterpart: a game file or page. Variants written by
        # Mtask have none, so they are neither handed out nor generated then.
        self.real_only = False
        # Sim-to-real's real phase (`learner.s2r_selection`): 'split' plays the seed tasks where the policy
        # still splits, ranked by simulator/s2r_selection.py; 'curriculum' samples as in the DreamGym phase.
        self.real_selection = "curriculum"
        # tasks the 'split' rule handed out in this pass of the real phase -> their group count then
        self._real_handed: dict[str, int] = {}

    async def start(self) -> None:
        """Load the pool and counters from Redis (a restart keeps them) and add the seed tasks."""
        await self.pool.load()
        await self.pool.add(self.seed_tasks)
        c = await with_retry(lambda: self.client.hgetall(counters_key(self.prefix)), "read curriculum counters")
        self.batches = int(float(c.get(b"batches", 0)))
        self.handed_out = int(float(c.get(b"pushed", 0)))
        self.generated_handed_out = int(float(c.get(b"generated_pushed", 0)))
        self._started = True

    async def next_batch(self) -> list[Task]:
        """The next `batch_size` tasks; starts a generation round in the background when one is due."""
        if not self._started:
            await self.start()
        if not self.cfg.enabled:
            batch = self._uniform_batch()
        else:
            batch = await self._curriculum_batch()
        n_gen = sum(t.generated for t in batch)
        self.batches += 1
        self.handed_out += len(batch)
        self.generated_handed_out += n_gen

        async def op() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.hincrby(counters_key(self.prefix), "batches", 1)
            pipe.hincrby(counters_key(self.prefix), "pushed", len(batch))
            pipe.hincrby(counters_key(self.prefix), "generated_pushed", n_gen)
            await pipe.execute()

        await with_retry(op, "write curriculum counters")
        metrics.CURRICULUM_GENERATED_SHARE.set(n_gen / len(batch) if batch else 0.0)
        metrics.CURRICULUM_TASKS_PUSHED.labels("generated").inc(n_gen)
        metrics.CURRICULUM_TASKS_PUSHED.labels("seed").inc(len(batch) - n_gen)
        if (self.cfg.enabled and self.variants is not None and not self.real_only
                and self.batches % self.cfg.generate_every == 0):
            if self._generation is None or self._generation.done():
                self._generation = asyncio.create_task(self._generate_logged())
        return batch

    def _uniform_batch(self) -> list[Task]:
        """The ablation (`curriculum.enabled=false`): uniform over the seeds, without replacement within a pass."""
        seeds = sorted(self.pool.seeds(), key=lambda t: t.task_id)  # seed tasks all have a real counterpart
        out: list[Task] = []
        while seeds and len(out) < self.cfg.batch_size:
            if not self._order:
                self._order = self.rng.sample(seeds, len(seeds))
            out.append(self._order.pop())
        return out

    async def _curriculum_batch(self) -> list[Task]:
        ids = sorted(self.pool.tasks)
        self.last_stats = await self.stats.get_many(ids) if ids else {}
        mean_v, zero = variance_summary(self.last_stats)
        metrics.CURRICULUM_MEAN_TASK_VARIANCE.set(mean_v)
        metrics.CURRICULUM_ZERO_VARIANCE_FRACTION.set(zero)
        # generated tasks whose recent groups carried no reward variance are not handed out (the docstring)
        gen_ids = [t for t in ids if self.pool.tasks[t].generated and not self.real_only
                   and tier(self.last_stats.get(t)) != 2]
        # every seed task has a real counterpart (a game file, a page, or a plug-in environment's own task,
        # which may name no file at all); only Mtask's variants have none
        seed_ids = [t for t in ids if not self.pool.tasks[t].generated]
        b = self.cfg.batch_size
        if self.real_only and self.real_selection == "split" and seed_ids:
            return [self.pool.tasks[t] for t in self._pick_splitting(seed_ids, b)]
        if not seed_ids:  # only generated tasks left (cannot happen with seeds given; guard anyway)
            weights = selection_weights(gen_ids, self.last_stats, self.cfg.min_weight)
            return [self.pool.tasks[t] for t in weighted_sample(gen_ids, weights, min(b, len(gen_ids)), self.rng)]
        n_gen = min(len(gen_ids), generated_quota(b, self.cfg.lam, self.handed_out, self.generated_handed_out))
        picks = self._pick("generated", gen_ids, n_gen)
        picks += self._pick("seed", seed_ids, b - len(picks))
        return [self.pool.tasks[t] for t in picks]

    def _pick(self, kind: str, ids: list[str], k: int) -> list[str]:
        """k of `ids` by the configured sampling; `kind` names the pass ("seed" or "generated")."""
        if k <= 0 or not ids:  # most batches hold no variant: nothing to weigh
            return []
        weights = selection_weights(ids, self.last_stats, self.cfg.min_weight)
        if self.cfg.sampling == "draw":
            return weighted_sample(ids, weights, k, self.rng)
        eligible = set(ids)
        rest = self._passes[kind] = [t for t in self._passes[kind] if t in eligible]  # a variant may have left
        out: list[str] = []
        while len(out) < k:
            if not rest:
                if kind == "generated" and self._started_passes["generated"] >= self._started_passes["seed"]:
                    break  # a variant is played at most once per pass over the seeds; seeds fill the batch
                self._started_passes[kind] += 1
                rest.extend(pass_order(ids, weights, self.rng))
                if not rest:  # every weight so small that a whole pass kept nothing: draw the rest by weight
                    return out + weighted_sample(ids, weights, k - len(out), self.rng)
            out.append(rest.pop())
        return out

    def _pick_splitting(self, ids: list[str], k: int) -> list[str]:
        """Sim-to-real's real phase: the k seed tasks where the policy splits most (simulator/s2r_selection.py),
        each once per pass over them."""
        played = still_played(self._real_handed, self.last_stats)
        if set(ids) <= played:  # every seed handed out and none split since: the next pass
            self._real_handed, played = {}, set()
        picks = pick_splitting(ids, self.last_stats, k, played)
        for t in picks:
            s = self.last_stats.get(t)
            self._real_handed[t] = s.groups if s is not None else 0
        return picks

    async def generate_round(self) -> list[Task]:
        """One Mtask round: expand the top-ranked tasks, add the validated variants to the pool."""
        if not self.cfg.enabled or self.variants is None or self.cfg.seeds_per_round == 0:
            return []
        if not self._started:
            await self.start()
        ids = sorted(self.pool.tasks)
        self.last_stats = await self.stats.get_many(ids)
        seeds = generation_seeds(self.pool, self.last_stats, self.cfg.seeds_per_round, self.cfg.max_children)
        if not seeds:
            return []
        accepted = await self.variants.generate(seeds, list(self.pool.tasks.values()))
        room = max(0, self.cfg.max_pool - len(self.pool))
        if len(accepted) > room:
            metrics.CURRICULUM_VARIANTS.labels("pool_full").inc(len(accepted) - room)
            accepted = accepted[:room]
        try:
            added = await self.pool.add(accepted)
        except PoolFull:  # raced with another writer; nothing was added
            metrics.CURRICULUM_VARIANTS.labels("pool_full").inc(len(accepted))
            return []
        log.info("curriculum: %d variants of %d seeds joined the pool (now %d tasks)", len(added), len(seeds), len(self.pool))
        return added

    async def _generate_logged(self) -> None:
        try:
            await self.generate_round()
        except Exception:  # a failed round must not stop task pushing; it is retried at the next due batch
            log.exception("curriculum generation round failed")

    async def wait_generation(self) -> None:
        """Wait for a background generation round, if one is running."""
        if self._generation is not None:
            await self._generation

    async def backlog(self) -> int:
        """Tasks on the stream not yet delivered to the workers (all pushed ones if no worker group exists)."""
        return await stream_backlog(self.client, self.stream)

    async def push_batch(self) -> list[Task]:
        """Hand out the next batch and XADD it to the task stream; returns what was pushed."""
        batch = await self.next_batch()
        if self.limit is not None:
            batch = batch[: self.limit - self.pushed]
        await self.producer.add(encode(t) for t in batch)
        self.pushed += len(batch)
        return batch

    async def run(self, stop_event: asyncio.Event) -> None:
        """Keep about `max_backlog` tasks waiting on the task stream until stop_event is set (or `limit`)."""
        if not self._started:
            await self.start()
        while not stop_event.is_set() and (self.limit is None or self.pushed < self.limit):
            if await self.backlog() < self.cfg.max_backlog and await self.push_batch():
                continue
            try:
                await asyncio.wait_for(stop_event.wait(), self.poll_s)
            except asyncio.TimeoutError:
                pass
        if self._generation is not None and not self._generation.done():
            self._generation.cancel()

    # ----- checkpointing (saved with the learner's checkpoints) -----

    def state_dict(self) -> dict:
        """Pool, the last statistics read, RNG and counters, as plain JSON/msgpack-able data."""
        version, internal, gauss = self.rng.getstate()
        return {
            "version": STATE_VERSION,
            "pool": [to_dict(t) for t in self.pool.tasks.values()],
            "stats": {tid: asdict(s) for tid, s in self.last_stats.items()},
            "rng": [version, list(internal), gauss],
            "counters": {"batches": self.batches, "pushed": self.handed_out, "generated_pushed": self.generated_handed_out},
            "uniform_order": [t.task_id for t in self._order],
            "passes": {kind: list(rest) for kind, rest in self._passes.items()},
            "started_passes": dict(self._started_passes),
        }

    async def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict: the pool and counters replace Redis's; statistics are restored only
        for tasks whose Redis record holds fewer groups (Redis lost them), never overwriting newer ones."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"curriculum state version {state.get('version')!r}; this build reads {STATE_VERSION}")
        tasks = [from_dict(d) for d in state["pool"]]
        await self.pool.replace_all(tasks)
        snap = {tid: TaskStats(**d) for tid, d in state.get("stats", {}).items()}
        current = await self.stats.get_many(list(snap)) if snap else {}
        await self.stats.put_many([s for tid, s in snap.items() if current[tid].groups < s.groups])
        self.last_stats = await self.stats.get_many(sorted(self.pool.tasks))
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        c = state["counters"]
        self.batches, self.handed_out, self.generated_handed_out = c["batches"], c["pushed"], c["generated_pushed"]
        self._order = [self.pool.tasks[t] for t in state.get("uniform_order", []) if t in self.pool.tasks]
        passes = state.get("passes", {})  # absent in checkpoints written before sampling "pass"
        self._passes = {kind: [t for t in passes.get(kind, []) if t in self.pool.tasks] for kind in ("seed", "generated")}
        self._started_passes = {"seed": 0, "generated": 0, **state.get("started_passes", {})}
        await with_retry(lambda: self.client.hset(counters_key(self.prefix), mapping=c), "restore curriculum counters")
        self._started = True
