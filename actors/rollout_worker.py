"""The rollout worker: takes tasks off the task stream, plays GRPO groups, pushes trajectories.

Owns task delivery around the episode loop (actors/episode.py, shared with evaluation),
nothing about Ray (a thin actor in infra/run/cluster/worker_actor.py wraps it) and
nothing about which environment it plays:

- a task is read from the task stream through the `WORKERS_GROUP` consumer group;
- its group of G rollouts runs concurrently in fresh environments (synthetic by
  default, a real one for the RL baseline and S2R), at most `concurrent_episodes`
  episodes at once across the worker so the engines see batches;
- every action comes from the policy with its log-probs and weight version; an
  episode whose simulator or real environment broke ends as `sim_error`/`env_error`
  (the learner sets it aside), while any other failure (an engine outage) fails the
  group, whose task is handed back;
- the finished group is pushed to the trajectory stream in one MULTI/EXEC together
  with a "group done" marker keyed by the task's stream entry id, then the task's
  reward statistics are recorded, synthetic transitions are written back into the
  replay buffer, and only then is the task acked. A worker that dies mid-group leaves
  the task pending; another worker reclaims it (XAUTOCLAIM) and re-runs it; a task
  whose group was already pushed is only acked, so no group is pushed twice;
- while a group runs, its entry's idle time is refreshed (a lease), so a slow but
  live worker is not robbed by XAUTOCLAIM;
- the handler deadline (`infra.handler_timeout_s`, infra/streams.py), local and Ray workers
  alike: the lease timer also expires tasks held past it; each is nacked with
  `HandlerTimeout` and counted (redelivered, dead-lettered after `max_deliveries`), and
  its group is cancelled, so a group that hangs where no other timeout reaches (an engine
  call, an in-process environment) frees its slots and stops renewing its lease;
- backpressure: before taking a task, a worker waits (polling with capped backoff, never
  busy) while more than `max_trajectory_backlog` trajectories wait undelivered to the
  learner group, so producers that outpace the learner stop at a bounded stream instead
  of filling Redis. Only undelivered entries count: the learner keeps the entries of its
  last `checkpoint_every` updates pending until the checkpoint, and they clear only after
  updates that need new trajectories; counting them could stall both sides;
- a group that fails (an engine outage, a task its environment cannot build: `EnvUnplayable`
  when no episode got past the environment's reset, so nothing is pushed) is
  `nack`ed with the error: the task is left for redelivery to any worker, and after
  `infra.max_deliveries` failed deliveries it moves to `<tasks stream>:dead` with the
  last error, so one bad task never loops through the fleet forever;
- `stop(drain=True)` finishes in-flight groups; `stop(drain=False)` cancels them and
  hands their tasks back (idle time set high, so the next XAUTOCLAIM takes them; a
  handed-back task is not a failure, but its redelivery still counts).

Departure from the paper: none in substance; the paper does not describe its workers.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
from typing import Any, Callable, Protocol

import redis.asyncio as aioredis

from actors.envs.base import Environment
from actors.episode import run_episode
from infra import metrics
from infra.budget import Hold, StepBudget, count_key
from infra.config import ActorsConfig
from infra.schema import REPLAYED, EnvKind, Status, Task, Trajectory, decode_as, encode, new_id
from infra.stream_backlog import stream_backlog
from infra.streams import (DATA_FIELD, DEFAULT_MAX_DELIVERIES, LEARNER_GROUP, WORKERS_GROUP, StreamConsumer, key,
                          tasks_stream, trajectories_stream, with_retry)
from infra.task_stats import TaskStatsStore
from simulator.replay_buffer import Transition

log = logging.getLogger(__name__)
# The counters `status()` reports (a worker actor still starting reports them at zero).
STATUS_COUNTERS = ("groups_done", "episodes_done", "trajectories_pushed", "groups_failed", "steps_taken",
                   "tasks_dead_lettered", "tasks_timed_out", "backpressure_s")

HANDBACK_CONSUMER = "handed-back"
GROUP_DONE_TTL_S = 7 * 24 * 3600
BACKPRESSURE_POLL_S = (0.05, 2.0)  # first and longest wait between two looks at the trajectory backlog



class EnvUnplayable(RuntimeError):
    """No episode of a group got past its environment's reset (a missing or corrupt game file, a task the crash
    book refuses): the group fails, nothing is pushed, and the task goes the way of any failed group (nacked,
    dead-lettered with this text after `max_deliveries`), instead of a stream of empty env_error trajectories
    as fast as the environment can fail (a moved data directory once pushed 61,000 in ten minutes)."""

    def __init__(self, task: Task, trajs: list[Trajectory]):
        where = f" ({task.game_file})" if task.game_file else ""
        why = sorted({str(t.timings.get("env_error_detail") or t.timings.get("env_error", "?")) for t in trajs})
        super().__init__(f"task {task.task_id}{where}: its environment failed before a first step in all "
                         f"{len(trajs)} episodes: {'; '.join(why)[:600]}")

class Policy(Protocol):
    """What the worker needs of actors/policy.py's Policy."""

    async def act(self, task: Task, state: str, candidates: list[str], history: list, affinity_key: str) -> Any:
        """A decision with .action, .prompt, .action_token_ids, .logprobs, .choice_token_ids, .weight_version."""


class TransitionSink(Protocol):
    """The replay buffer as the worker sees it (simulator/replay_buffer.py)."""

    def add(self, transitions: list) -> Any: ...


EnvFactory = Callable[[], Environment]


async def _maybe_await(x: Any) -> Any:
    return await x if inspect.isawaitable(x) else x


class RolloutWorker:
    """Plain async episode logic; `run()` until `stop()`."""

    def __init__(self, worker_id: str, client: aioredis.Redis, prefix: str, policy: Policy, env_factory: EnvFactory,
                 cfg: ActorsConfig, buffer: TransitionSink | None = None, stats: TaskStatsStore | None = None,
                 env_kind: EnvKind | str | None = None, reclaim_idle_ms: int = 30_000, maxlen: int = 100_000,
                 max_deliveries: int = DEFAULT_MAX_DELIVERIES, handler_timeout_s: float = 0.0):
        self.worker_id, self.client, self.prefix = worker_id, client, prefix
        self.policy, self.env_factory, self.cfg, self.buffer = policy, env_factory, cfg, buffer
        self.stats = stats or TaskStatsStore(client, prefix)
        self.env_kind = EnvKind(env_kind or cfg.env_kind)
        self.reclaim_idle_ms, self.maxlen = reclaim_idle_ms, maxlen
        self.task_stream, self.traj_stream = tasks_stream(prefix), trajectories_stream(prefix)
        # A fresh consumer name per incarnation: a restarted worker's old entries are
        # reclaimed like any dead consumer's, never re-read as "own pending" mid-flight.
        self.consumer = StreamConsumer(client, self.task_stream, WORKERS_GROUP, f"{worker_id}-{new_id()[:6]}",
                                       lambda b: decode_as(b, Task), reclaim_idle_ms=reclaim_idle_ms, reclaim_every=3,
                                       max_deliveries=max_deliveries, handler_timeout_s=handler_timeout_s,
                                       on_expire=self._expired)
        # Real rollouts draw from the run's exact budget of real transitions (infra/budget.py).
        self.budget = StepBudget(client, prefix, cfg.real_transitions) if self.env_kind == EnvKind.REAL else None
        self._episode_slots = asyncio.Semaphore(cfg.concurrent_episodes)
        self._read_lock = asyncio.Lock()
        self._inflight: dict[bytes, asyncio.Task] = {}
        self._holds: dict[str, Hold] = {}  # budget holds of the groups in flight, renewed with the task leases
        self._stopping = asyncio.Event()
        self._drain = True
        self.groups_done = 0
        self.groups_failed = 0
        self.trajectories_pushed = 0
        self.episodes_done = 0
        self.steps_taken = 0
        self.tasks_dead_lettered = 0
        self.tasks_timed_out = 0  # tasks nacked by the handler deadline
        self.backpressure_s = 0.0  # seconds this worker's task loops waited on the trajectory backlog

    # ----- the loop -----
    async def run(self, max_groups: int | None = None) -> None:
        """Serve tasks until stop() (or `max_groups` groups are done)."""
        await self.consumer.ensure_group()
        metrics.ROLLOUT_WORKERS.inc()
        # Enough task loops that G-sized groups fill `concurrent_episodes` slots.
        n_loops = max(1, math.ceil(self.cfg.concurrent_episodes / self.cfg.group_size))
        lease = asyncio.create_task(self._renew_leases())
        try:
            await asyncio.gather(*(self._task_loop(max_groups) for _ in range(n_loops)))
        finally:
            lease.cancel()
            metrics.ROLLOUT_WORKERS.dec()

    async def _task_loop(self, max_groups: int | None) -> None:
        while not self._stopping.is_set() and (max_groups is None or self.groups_done < max_groups):
            async with self._read_lock:
                await self._wait_for_learner()
                if self._stopping.is_set():
                    return
                hold = await self._hold_group()
                if hold is None and self.budget is not None:  # stop() came while it waited for room
                    return
                job = None
                try:
                    deliveries = [d for d in await self.consumer.read(count=1, block_ms=200)
                                  if d.entry_id not in self._inflight]
                    if deliveries and self._stopping.is_set():  # stop() came while we were reading
                        await self.hand_back([x.entry_id for x in deliveries])
                        return
                    if not deliveries:
                        continue
                    d = deliveries[0]
                    if self.env_kind == EnvKind.REAL and _synthetic_only(d.message):
                        # A curriculum variant still queued when sim-to-real switched to the real env: no
                        # real environment can play it. Set aside with its reason.
                        await self.consumer.dead_letter([d], f"NoRealCounterpart: task {d.message.task_id} has no "
                                                             "game file; only the synthetic environment can play it",
                                                        expected=True)
                        self.tasks_dead_lettered += 1
                        continue
                    job = asyncio.create_task(self._serve(d.entry_id, d.message, hold))
                    self._inflight[d.entry_id] = job
                finally:
                    if job is None:  # no group started: its hold goes back (one kept renewed would never lapse)
                        await self._release(hold)
            try:
                await asyncio.shield(job)
            except asyncio.CancelledError:
                if not job.done():
                    raise
            except Exception as exc:  # an engine outage or a bad task: retry it elsewhere, bounded; keep serving
                log.error("%s: group of %s failed (%s: %s); the task is left for redelivery (delivery %d of %d)",
                          self.worker_id, d.message.task_id, type(exc).__name__, exc, d.deliveries,
                          self.consumer.max_deliveries)
                self.groups_failed += 1
                try:
                    self.tasks_dead_lettered += len(await self.consumer.nack([d], exc))
                except Exception as nack_exc:  # Redis gone for good: the entry stays pending, reclaimed later
                    log.warning("nack failed (%s); the task will be reclaimed when idle", nack_exc)
                await asyncio.sleep(1.0)
            finally:
                self._inflight.pop(d.entry_id, None)

    async def _wait_for_learner(self) -> None:
        """Backpressure: return once the trajectories undelivered to the learner are at most
        `max_trajectory_backlog` (or at stop()). Called under the read lock: one loop polls."""
        bound = self.cfg.max_trajectory_backlog
        if not bound:
            return
        loop = asyncio.get_running_loop()
        delay, started = BACKPRESSURE_POLL_S[0], None
        try:
            while not self._stopping.is_set():
                backlog = await stream_backlog(self.client, self.traj_stream, LEARNER_GROUP)
                if backlog <= bound:
                    return
                if started is None:
                    started = loop.time()
                    metrics.ROLLOUT_BACKPRESSURE_WAITING.inc()
                    log.info("%s: %d trajectories wait for the learner (bound %d); holding new tasks",
                             self.worker_id, backlog, bound)
                try:
                    await asyncio.wait_for(self._stopping.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                delay = min(BACKPRESSURE_POLL_S[1], delay * 2)
        finally:
            if started is not None:
                waited = loop.time() - started
                self.backpressure_s += waited
                metrics.ROLLOUT_BACKPRESSURE_SECONDS.inc(waited)
                metrics.ROLLOUT_BACKPRESSURE_WAITING.dec()

    async def _hold_group(self) -> Hold | None:
        """Real rollouts: reserve the next group's worst case (G x max_steps) before taking a task, waiting
        while the budget has no room (infra/budget.py; on an unlimited budget a hold only counts steps);
        None at stop() or without a budget (synthetic rollouts)."""
        if self.budget is None:
            return None
        delay = 0.05
        while not self._stopping.is_set():
            hold = await self.budget.hold(new_id(), self.cfg.group_size * self.cfg.max_steps, self.reclaim_idle_ms)
            if hold is not None:
                self._holds[hold.hold_id] = hold
                return hold
            try:  # groups in flight will finish and release their unused steps, or the run stops
                await asyncio.wait_for(self._stopping.wait(), delay)
            except asyncio.TimeoutError:
                delay = min(1.0, delay * 2)
        return None

    async def _release(self, hold: Hold | None) -> None:
        if hold is not None:
            self._holds.pop(hold.hold_id, None)
            try:
                await hold.release()
            except Exception as exc:  # Redis gone for good: the hold lapses at its deadline instead
                log.warning("budget hold release failed (%s); it lapses in %d ms", exc, self.reclaim_idle_ms)

    async def _serve(self, entry_id: bytes, task: Task, hold: Hold | None = None) -> None:
        try:
            await self._serve_group(entry_id, task, hold)
        finally:
            await self._release(hold)

    async def _serve_group(self, entry_id: bytes, task: Task, hold: Hold | None) -> None:
        done_key = key(self.prefix, f"groupdone:{entry_id.decode()}")
        if await with_retry(lambda: self.client.exists(done_key), "group-done check"):
            await self.consumer.ack([entry_id])  # pushed by a worker that died before acking
            return
        trajs = await self.run_group(task, group_id=f"{task.task_id}:{entry_id.decode()}", hold=hold)
        if trajs and all(t.status == Status.ENV_ERROR and not t.steps for t in trajs):
            raise EnvUnplayable(task, trajs)
        await self._push(trajs, done_key)
        await self.stats.record_group(task.task_id, [t.total_reward for t in trajs])
        if self.buffer is not None and self.env_kind == EnvKind.SYNTHETIC:
            await self._write_back(trajs)
        await self.consumer.ack([entry_id])
        self.groups_done += 1

    async def _push(self, trajs: list[Trajectory], done_key: str) -> None:
        payloads = [encode(t) for t in trajs]

        async def op() -> Any:
            pipe = self.client.pipeline(transaction=True)
            for p in payloads:
                pipe.xadd(self.traj_stream, {DATA_FIELD: p}, maxlen=self.maxlen, approximate=True)
            pipe.set(done_key, self.worker_id, ex=GROUP_DONE_TTL_S)
            # Run-wide counts (infra/budget.run_counts), atomic with the XADDs they count.
            pipe.incrby(count_key(self.prefix, "trajectories_pushed"), len(trajs))
            pipe.incrby(count_key(self.prefix, f"{self.env_kind.value}_steps_pushed"), sum(len(t.steps) for t in trajs))
            return await pipe.execute()

        await with_retry(op, f"XADD {self.traj_stream}")
        metrics.STREAM_MESSAGES_ADDED.labels(self.traj_stream).inc(len(payloads))
        metrics.STREAM_BYTES_ADDED.labels(self.traj_stream).inc(sum(map(len, payloads)))
        self.trajectories_pushed += len(payloads)

    async def _renew_leases(self) -> None:
        """Keep in-flight task entries fresh so XAUTOCLAIM leaves a live worker's tasks alone; first, end
        the groups whose task is past the handler deadline (their reads may all be waiting on groups)."""
        period = max(0.05, self.reclaim_idle_ms / 3000)
        if self.consumer.handler_timeout_s > 0:
            period = min(period, max(0.05, self.consumer.handler_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            try:
                await self.consumer.expire_held()  # calls _expired with what it nacked
            except Exception as exc:  # Redis away: the next tick tries again
                log.warning("handler-deadline check failed: %s", exc)
            ids = list(self._inflight)
            if ids:
                try:
                    await self.client.xclaim(self.task_stream, WORKERS_GROUP, self.consumer.consumer, 0, ids, justid=True)
                except Exception as exc:  # a missed renewal only risks a duplicate run, never a loss
                    log.warning("lease renewal failed: %s", exc)
            if self._holds:
                try:
                    await self.budget.renew(list(self._holds), self.reclaim_idle_ms)
                except Exception as exc:  # a lapsed hold ends its episodes early (truncated), loses nothing
                    log.warning("budget hold renewal failed: %s", exc)

    def _expired(self, late: list) -> None:
        """The handler deadline nacked (and counted) these tasks: cancel their groups."""
        for d in late:
            log.error("%s: task %s held past infra.handler_timeout_s=%g s without ack or nack; nacked (delivery "
                      "%d of %d), its group cancelled", self.worker_id, d.message.task_id,
                      self.consumer.handler_timeout_s, d.deliveries, self.consumer.max_deliveries)
            self.groups_failed += 1
            self.tasks_timed_out += 1
            job = self._inflight.pop(d.entry_id, None)
            if job is not None:
                job.cancel()

    # ----- one group, one episode -----
    async def run_group(self, task: Task, group_id: str | None = None, hold: Hold | None = None) -> list[Trajectory]:
        """G episodes of `task`; real steps come from `hold` (the group's reservation) or else the budget itself."""
        group_id = group_id or new_id()
        return list(await asyncio.gather(*(self._slot_episode(task, group_id, hold)
                                           for _ in range(self.cfg.group_size))))

    async def _slot_episode(self, task: Task, group_id: str, hold: Hold | None) -> Trajectory:
        async with self._episode_slots:
            return await self.play(task, group_id, hold)

    async def play(self, task: Task, group_id: str, hold: Hold | None = None) -> Trajectory:
        """One episode in a fresh environment (actors/episode.py), closed afterwards."""
        env = self.env_factory()
        trajectory_id = new_id()  # also the policy engine's affinity key: one episode stays on one server
        try:
            traj = await run_episode(env, task, functools.partial(self.policy.act, affinity_key=trajectory_id),
                                     self.cfg.max_steps, env_kind=self.env_kind, worker_id=self.worker_id,
                                     group_id=group_id, trajectory_id=trajectory_id, budget=hold or self.budget)
        finally:
            try:
                await _maybe_await(env.close())
            except Exception as exc:  # a failing close must not lose the episode
                log.warning("env close failed: %s", exc)
        self.episodes_done += 1
        self.steps_taken += len(traj.steps)
        return traj

    async def _write_back(self, trajs: list[Trajectory]) -> None:
        transitions = [Transition(task_id=t.task_id, instruction=t.task.instruction if t.task else "", state=s.state,
                                  action=s.action, reasoning=s.reasoning, next_state=s.next_state, reward=s.reward,
                                  done=s.done, source="synthetic", episode_id=t.trajectory_id,
                                  policy_version=t.policy_version)
                       for t in trajs if t.status != Status.SIM_ERROR for s in t.steps
                       # a real transition the buffer already holds; an invalid reply, or an action the synthetic
                       # environment refused (free text its grammar rules out), which Mexp never saw
                       if s.reasoning_source != REPLAYED and not s.invalid_reason and s.valid]
        if transitions:
            try:
                await _maybe_await(self.buffer.add(transitions))  # type: ignore[union-attr]
            except Exception as exc:  # the buffer growing is a bonus; the group is already pushed
                log.warning("replay-buffer write-back failed: %s", exc)

    # ----- shutdown -----
    async def stop(self, drain: bool = True, timeout_s: float = 600.0) -> None:
        """Stop taking tasks; finish in-flight groups (drain) or cancel them and hand their tasks back."""
        self._stopping.set()
        jobs = dict(self._inflight)
        if drain:
            if jobs:
                await asyncio.wait(list(jobs.values()), timeout=timeout_s)
            return
        for job in jobs.values():
            job.cancel()
        await asyncio.gather(*jobs.values(), return_exceptions=True)
        await self.hand_back(list(jobs))

    async def hand_back(self, entry_ids: list[bytes]) -> None:
        """Give unacked tasks to a parking consumer with a huge idle time, so the next XAUTOCLAIM takes them."""
        if not entry_ids:
            return
        await with_retry(lambda: self.client.xclaim(self.task_stream, WORKERS_GROUP, HANDBACK_CONSUMER, 0, entry_ids,
                                                     idle=10 ** 9, justid=True), "hand back tasks")
        log.info("%s handed %d task(s) back", self.worker_id, len(entry_ids))

    def status(self) -> dict:
        return {"worker_id": self.worker_id, **{c: getattr(self, c) for c in STATUS_COUNTERS},
                "inflight": len(self._inflight), "stopping": self._stopping.is_set()}


def _synthetic_only(task: Task) -> bool:
    """A task Mtask wrote (a curriculum variant) with no real game behind it. A plug-in environment's own
    tasks need no game_file: the environment knows what to play from the task itself."""
    return (task.generated or bool(task.parent_id)) and not task.game_file
