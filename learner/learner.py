"""The learner loop: trajectories in from the stream, one GRPO/PPO update, weights out.

Owns the order of things and what a crash may cost, not the bookkeeping of stream
entries (learner/batching.py: dedupe, groups, staleness and zero-variance filters,
deferred acks) nor the maths (learner/update.py over learner/advantages.py and
learner/losses.py) nor the transport (infra/streams.py):

1. ask the batcher for the next `groups_per_update` units (it reads the stream once);
   units whose entries already failed twice go to the dead-letter stream instead;
   the others are charged a delivery as they enter the update, not when they were read
   ahead (the consumer is `count_on_use`, infra/streams.py);
2. record the update's entries in the in-flight file (learner/inflight.py), snapshot
   the trainable weights and optimizer state (learner/guard.py), and apply one update
   in the learner's own update thread, so the workers and an engine sharing the event
   loop keep serving: that thread runs `learner.threads` torch threads at `learner.nice`
   (Linux sets both per thread, so the engines' threads keep their count and priority);
   only the tokens the policy wrote train (a label, or in generate mode every reply token),
   a multi-turn trajectory as one packed sequence;
3. if the loss, a gradient or the new weights are not finite, or the update raises,
   restore the snapshot, count it (`learner_nonfinite_updates_total`,
   `learner_update_errors_total`), publish nothing, and give the batch a strike: it is
   retried once, and dead-lettered with the reason if it fails again;
4. otherwise publish weights every `publish_every` updates and checkpoint every
   `checkpoint_every`; only *after* a checkpoint is on disk are the entries it covers
   acked (the batcher queues them until then);
5. hand the memory the update freed back to the OS (`release_freed_memory`: glibc
   keeps freed activation and serialisation buffers in its arenas, and a CPU run's
   process grew by GBs per update without it) and record the resident size.

Ack after checkpoint, not checkpoint after every ack: the two designs lose no
trajectory, and this one keeps `checkpoint_every` a free knob (a full-model save per
update costs more than the update on a small CPU model). A `kill -9` costs at most the
compute of the updates since the last checkpoint: their entries are still pending in
the learner group, the restarted learner (same consumer name, `--resume`) reads them
back first and retrains them (counted as `redelivered`: what an update of an earlier
process had; entries only read ahead are neither charged nor counted); entries of the update it died
in get a strike (retrain once, then dead-letter), so a message that kills the learner
cannot crash-loop it. A crash between the checkpoint and its XACK only causes
redeliveries that the checkpoint's dedupe memory recognises (never trained twice).

The policy, its KL reference and the proximal (old-policy) passes share one device and
precision, `learner.device` and `learner.dtype` (learner/precision.py: 'bfloat16' keeps
fp32 master weights and AdamW state and runs the forwards under bf16 autocast); the
snapshot of step 2 is a second copy of the trainable weights on that device.

With `learner.num_gpus` = N > 1 this process is rank 0 of N FSDP ranks (learner/fsdp.py),
the others started by a `RankLauncher`: torch's elastic launcher on this node
(learner/elastic_ranks.py), or Ray actors on the `learner_gpu` nodes when the learner is
itself a Ray actor (infra/run/cluster/learner_ranks.py). Each keeps 1/N of the policy's
weights, gradients and AdamW state and runs its share of every update's micro-batches; the
update, the guard's snapshot and restore, publishing and checkpoints go through `Ranks`,
and the loop above is unchanged. A rank that dies (`RankFailure`: the shards are out of
step, nothing can be undone) costs what a learner crash costs, without the crash: the
entries of the update it died in get their strike, the ranks start again (rank 0's policy
built anew), the last checkpoint is loaded on all of them, the batcher goes back to that
checkpoint and the consumer reads its own pending entries again from the first, so what
the checkpoint did not cover is retrained (counted as `redelivered`), and the restored
weights are published. `RANK_RESTARTS` restarts in a row without an update between them
end the run.

The weight version is the number of updates applied; a trajectory's staleness is
that minus the version the worker's engine served. Departures from the paper: the
outcome reward is the trajectory's summed reward (1 at a successful final step).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import inspect
import logging
import os
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import torch

from infra import metrics
from infra.config import Config, LearnerConfig
from infra.schema import EnvKind, Trajectory, decode_as
from infra.streams import LEARNER_GROUP, StreamConsumer, trajectories_stream
from learner import checkpoint as ckpt
from learner.batching import GroupBatcher
from learner.elastic_ranks import ElasticRanks
from learner.fsdp import RankFailure, RankLauncher, Ranks, RanksGuard
from learner.guard import NonFiniteUpdate, WeightGuard
from learner.inflight import STRIKES_TO_DEAD_LETTER, InflightLedger
from learner.policy_model import PolicyModel
from learner.precision import Precision
from learner.staleness import StalenessFilter
from learner.trained_record import TrainedRecord
from learner.update import UpdateStats, apply_update, new_optimizer
from learner.weight_sync import distributed_sync
from learner.weights import WeightPublisher

log = logging.getLogger(__name__)

STALE_CATCH_UP_S = 10.0  # at most this often, stale trajectories make the learner check the engines' versions
RANK_RESTARTS = 3  # restarts of the FSDP ranks in a row, with no update between them, before the run stops
ACKED_AT_ONCE = ("duplicate", "dead_letter")  # set-aside outcomes acked when seen: a rollback keeps their counts


def init_update_thread(threads: int, nice: int) -> tuple[int, int]:
    """Run first in the learner's update thread: its torch intra-op threads (0 = leave) and its
    niceness (added; this thread and the compute threads it starts). Returns (threads, nice) in force."""
    if threads > 0:
        torch.set_num_threads(threads)
    if nice > 0:
        try:
            os.nice(nice)
        except OSError as exc:  # not permitted here: run at the same priority
            log.warning("learner.nice=%d not applied: %s", nice, exc)
    in_force = torch.get_num_threads(), os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else 0
    log.info("learner update thread: %d torch threads, niceness %d", *in_force)
    return in_force


_LIBC = ctypes.CDLL(None) if os.name == "posix" else None  # the process's own symbols: libc's among them


def resident_mb() -> float:
    """This process's resident memory in MB (Linux /proc; 0.0 where that is not available)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def release_freed_memory() -> float:
    """Give the heap pages freed since the last call back to the OS; the resident MB after.

    An update allocates its micro-batches' activations (GBs for score-mode batches of a
    135M model), a checkpoint and a weight publish serialise the model, and glibc keeps
    what they free in its arenas for reuse: with MALLOC_ARENA_MAX=2 a `dreamgym train`
    process still went 3.4 -> 10.9 -> 13.2 GB over its first 2 updates (stop 37).
    `malloc_trim(0)` returns every arena's free pages. A no-op without glibc."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)
    return resident_mb()


class Learner:
    """GRPO/PPO learner on a StreamConsumer[Trajectory]; `publisher` is a WeightPublisher or None."""

    def __init__(self, cfg: LearnerConfig, model_name: str, run_dir: str | Path, consumer: Any,
                 publisher: Any = None, *, group_size: int = 4, policy: PolicyModel | None = None,
                 read_block_ms: int = 500, launcher: RankLauncher | None = None):
        """`launcher`: how ranks 1..N-1 start with `learner.num_gpus` = N > 1 (torch elastic on this node
        by default)."""
        self.cfg, self.run_dir, self.consumer, self.publisher = cfg, Path(run_dir), consumer, publisher
        self.model_name, self.group_size, self.read_block_ms = model_name, group_size, read_block_ms
        self.launcher = launcher if launcher is not None else ElasticRanks()
        if policy is None:
            if cfg.num_gpus > 1:
                self.launcher.check(cfg)
            policy = PolicyModel.for_learner(cfg, model_name, self._precision())
        elif cfg.num_gpus > 1:
            raise ValueError("learner.num_gpus > 1: every rank loads `model_name` itself; pass no policy")
        self.ranks: Ranks | None = None
        self._build(policy)
        self.staleness = StalenessFilter(cfg.max_staleness, cfg.staleness_mode, cfg.is_cap)
        self.batches = GroupBatcher(consumer, cfg, group_size, self.staleness, read_block_ms)
        self._at_checkpoint: tuple[dict[str, int], int] = ({}, 0)  # set aside and redelivered, as last saved
        self.rank_restarts = 0  # FSDP rank groups started again after a rank died (learner.num_gpus > 1)
        self._restarts_in_a_row = 0
        self.ledger = InflightLedger(self.run_dir)
        self.record = TrainedRecord(self.run_dir)  # which trajectories entered which update (audits)
        self._recovered = False
        self._stale_seen, self._caught_up_at = 0, float("-inf")  # stale set-asides seen, last engine catch-up
        self.version = 0
        self.updates = 0
        self.failed_updates: dict[str, int] = {}  # reason kind -> updates undone (non-finite, errors)
        self.dead_lettered = 0  # trajectories this learner moved to the dead-letter stream
        self._trained_before = 0  # trajectories trained by the run's earlier segments (from the checkpoint)
        self.extra: dict[str, Any] = {}  # saved with checkpoints (curriculum state etc.)
        # One dedicated update thread with its own torch threads and priority (see the module docstring).
        self._compute = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="learner-update", initializer=init_update_thread,
            initargs=(cfg.threads, cfg.nice))
        self._state_hooks: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}

    def _precision(self) -> Precision:
        return Precision.checked(self.cfg.device, self.cfg.dtype, "learner.device", "learner.dtype")

    def _build(self, policy: PolicyModel) -> None:
        """`policy` as the learner's, with its FSDP ranks (learner.num_gpus > 1: every rank shards its policy
        before its optimizer is made), optimizer and guard."""
        self.policy = policy
        if self.cfg.kl_coef > 0:
            self.policy.snapshot_reference()
        if self.cfg.num_gpus > 1:
            self.ranks = Ranks.start(self.cfg, self.model_name, policy, self.launcher)
        self.optimizer = new_optimizer(self.policy, self.cfg)
        self.guard: WeightGuard | RanksGuard = WeightGuard(self.policy.trainable_parameters(), self.optimizer)
        if self.ranks is not None:
            self.guard = RanksGuard(self.ranks, self.guard)

    @property
    def consumed_ids(self) -> list[str]:
        """Trajectory ids used by updates, in order."""
        return self.batches.consumed_ids

    @property
    def trained(self) -> int:
        """Trajectories used by updates so far, counting the segments before a resume."""
        return self._trained_before + len(self.batches.consumed_ids)

    @property
    def discarded(self) -> dict[str, int]:
        """Trajectories set aside (by outcome) since the last update's stats were taken."""
        return self.batches.discarded

    @property
    def set_aside(self) -> dict[str, int]:
        """Trajectories set aside (zero_variance, stale, broken, duplicate, ...) since this learner started."""
        return dict(self.batches.set_aside)

    @property
    def env_kind(self) -> EnvKind | None:
        """The environment kind this learner trains on (the RL phase's); trajectories of another kind are
        set aside as `other_env` (sim-to-real's real phase never trains on the DreamGym phase's leftovers)."""
        return self.batches.env_kind

    @env_kind.setter
    def env_kind(self, kind: EnvKind | str | None) -> None:
        self.batches.env_kind = None if kind is None else EnvKind(kind)

    @property
    def waiting(self) -> int:
        """Trajectories read and held for an update not made yet."""
        return self.batches.waiting

    @property
    def groups_missing(self) -> int:
        """Task groups the next update still waits for (the synchronous schedule pushes that many tasks)."""
        return self.batches.groups_missing

    @property
    def redelivered(self) -> int:
        """Trajectories trained here that an update of an earlier learner process had (lost with a crash
        before its checkpoint, so retrained); read-ahead never counts."""
        return self.batches.redelivered

    # ---- the loop -----------------------------------------------------------------
    async def step(self, final: bool = False) -> UpdateStats | None:
        """Read once; if a full batch is ready, apply one update and return its stats.

        `final`: nothing more will arrive; train on whatever is ready, even a short batch.
        None when no update was applied (not enough data, or the update was undone)."""
        if not self._recovered:
            self.ledger.recover()  # a previous process died inside an update: strike its entries
            self._recovered = True
        units = await self.batches.next_batch(self.version, final)
        await self._catch_up_stale_engines()
        if units is None:
            return None
        kept = await self._drop_struck_out(units)
        if len(kept) < len(units):  # some went to the dead-letter stream: wait for a full batch
            self.batches.requeue(kept)
            return None
        try:
            return await self._update(units)
        except RankFailure as exc:  # FSDP ranks out of step: nothing can be undone on them (learner/fsdp.py)
            await self._restart_ranks(exc)
            return None

    async def _catch_up_stale_engines(self) -> None:
        """Trajectories too stale to train mean an engine serves old weights: one restarted by its supervisor
        serves the model it was started with, and if every worker's episodes come from it no update follows,
        so no publish would ever bring it up to date (issue 63's soak: a policy engine killed right after a
        resume, 280 s without an update). Push the last published weights to any engine behind them, at most
        every STALE_CATCH_UP_S."""
        stale = self.batches.set_aside.get("stale", 0)
        if stale <= self._stale_seen or self.publisher is None:
            return
        if time.monotonic() - self._caught_up_at < STALE_CATCH_UP_S:
            return
        self._stale_seen, self._caught_up_at = stale, time.monotonic()
        try:
            pushed = await self.publisher.catch_up()
        except Exception:  # the engines are down: their supervisor's business; try again later
            log.exception("bringing the engines up to weight version %d failed", self.version)
            return
        if pushed:
            log.warning("stale trajectories: %s served old weights; pushed version %s", ", ".join(pushed),
                        self.publisher.last_published)

    async def _update(self, units: list) -> UpdateStats | None:
        t0 = time.monotonic()
        await self.batches.charge(units)
        self.ledger.begin(self.updates + 1, [e for u in units for e in u.entry_ids])
        self.guard.snapshot()
        update = self.ranks.update if self.ranks is not None else apply_update
        try:
            stats = await asyncio.get_running_loop().run_in_executor(
                self._compute, update, self.policy, self.optimizer, self.cfg, units, self.version)
        except RankFailure:
            raise
        except NonFiniteUpdate as exc:
            metrics.LEARNER_NONFINITE_UPDATES.labels(exc.where).inc()
            await self._undo(units, exc.reason)
            return None
        except Exception as exc:  # a bug or a hostile trajectory the schema let through: not a crash loop
            log.exception("update %d failed", self.updates + 1)
            metrics.LEARNER_UPDATE_ERRORS.inc()
            await self._undo(units, f"UpdateFailed: {type(exc).__name__}: {exc}")
            return None
        self.ledger.end()
        self._restarts_in_a_row = 0
        self.batches.trained(units)
        self.updates += 1
        self.version += 1
        self.record.append(self.version, [t.trajectory_id for u in units for t in u.trajs])
        stats.version = self.version
        stats.discarded = self.batches.take_discarded()
        if self.publisher is not None and self.updates % self.cfg.publish_every == 0:
            try:
                await self.publisher.publish(self.exported, self.version)
            except RankFailure:
                raise
            except Exception:  # engines down or disk full: keep training; staleness will show it
                log.exception("publishing weights v%d failed; workers keep the previous version", self.version)
        if self.updates % self.cfg.checkpoint_every == 0:
            await self.checkpoint()
        stats.resident_mb = await asyncio.to_thread(release_freed_memory)
        stats.seconds = time.monotonic() - t0
        metrics.LEARNER_UPDATES.inc()
        metrics.LEARNER_UPDATE_SECONDS.observe(stats.seconds)
        return stats

    async def _restart_ranks(self, failure: RankFailure) -> None:
        """A rank died (see the module docstring): start the ranks again from the last checkpoint."""
        self.ledger.end(failed=True)  # the update it died in: a strike, as a killed learner's (recover)
        self.failed_updates["RankFailure"] = self.failed_updates.get("RankFailure", 0) + 1
        metrics.LEARNER_UPDATE_ERRORS.inc()
        self._restarts_in_a_row += 1
        if self._restarts_in_a_row > RANK_RESTARTS:
            log.error("FSDP ranks failed %d times in a row; the learner stops", self._restarts_in_a_row)
            raise failure
        log.error("%s; starting the ranks again from the last checkpoint", failure)
        self.ranks = None  # closed by the failure

        def rebuild() -> Path | None:
            self._build(PolicyModel.for_learner(self.cfg, self.model_name, self._precision()))
            return ckpt.latest(self.run_dir)
        path = await asyncio.get_running_loop().run_in_executor(self._compute, rebuild)
        old, (aside, redelivered) = self.batches, self._at_checkpoint
        self.batches = GroupBatcher(self.consumer, self.cfg, self.group_size, self.staleness, self.read_block_ms)
        self.batches.env_kind = old.env_kind
        self.batches.set_aside = {**aside, **{k: n for k, n in old.set_aside.items() if k in ACKED_AT_ONCE}}
        self.batches.redelivered = redelivered
        self.consumer.rewind()  # what the checkpoint does not cover is still pending here: read it again
        if path is not None:
            state = await asyncio.get_running_loop().run_in_executor(self._compute, self.ranks.load, path,
                                                                     self.optimizer)
            self._restore(state)
        else:  # none saved yet: the start, the policy as built
            self.version = self.updates = self._trained_before = 0
        self.rank_restarts += 1
        log.info("FSDP ranks started again at version %d (%s)", self.version, path or "no checkpoint yet")
        await self.publish()

    async def _undo(self, units: list, reason: str) -> None:
        """The update failed: weights and optimizer as before, nothing published, the batch struck."""
        self.guard.restore()
        self.ledger.end(failed=True)
        kind = reason.split(":")[0]
        self.failed_updates[kind] = self.failed_updates.get(kind, 0) + 1
        log.error("update %d undone (%s); weights restored, nothing published", self.updates + 1, reason)
        units = await self._drop_struck_out(units, reason)
        self.batches.requeue(units)

    async def _drop_struck_out(self, units: list, reason: str | None = None) -> list:
        """Dead-letter the units an update already failed on twice; the others are returned."""
        keep, out = [], []
        for u in units:
            (out if any(self.ledger.strikes_of(e) >= STRIKES_TO_DEAD_LETTER for e in u.entry_ids) else keep).append(u)
        if out:
            why = reason or "LearnerCrash: the learner process died twice while training it (kill, OOM or a crash)"
            ids = await self.batches.dead_letter(out, why)
            self.ledger.forget(ids)
            self.dead_lettered += len(ids)
        return keep

    async def checkpoint(self) -> Path:
        """Save, then ack every entry the saved state covers."""
        path = await asyncio.to_thread(self.save)
        self.ledger.forget(await self.batches.flush_acks())
        self._at_checkpoint = (dict(self.batches.set_aside), self.batches.redelivered)
        return path

    async def run(self, total_updates: int | None = None,
                  on_update: Callable[[UpdateStats], Awaitable[None] | None] | None = None,
                  stop: asyncio.Event | None = None,
                  before_step: Callable[[], Awaitable[None]] | None = None) -> list[UpdateStats]:
        """Update until `total_updates` (absolute, so a resumed run finishes the same budget) or `stop`.

        `before_step` is awaited before every read (the synchronous schedule pushes tasks there)."""
        await self.consumer.ensure_group()
        return await run_updates(self, total_updates if total_updates is not None else self.cfg.total_updates,
                                 on_update, stop, before_step)

    async def publish(self) -> None:
        """Publish the current weights now (after a resume, before an evaluation between phases); nothing
        to do when the engines already serve this version (sim-to-real resumed past its DreamGym phase
        published the restored weights, then again before evaluating that phase: 0.5 GB saved twice)."""
        if self.publisher is not None and self.publisher.last_published != self.version:
            await self.publisher.publish(self.exported, self.version)

    @property
    def exported(self) -> Any:
        """What publishing saves (`save_hf`): the policy, or with FSDP ranks their gathered weights."""
        return self.ranks if self.ranks is not None else self.policy

    def close(self) -> None:
        """Stop the FSDP ranks (learner.num_gpus > 1); nothing to do for one process."""
        if self.ranks is not None:
            self.ranks.close()
        if self.publisher is not None:
            self.publisher.close()

    async def finish(self) -> None:
        """End of training: publish the weights if the last update's were not, and checkpoint."""
        if self.updates % self.cfg.publish_every:
            await self.publish()
        if self.publisher is not None:
            await self.publisher.keep_final(self.exported, self.version)
        await self.checkpoint()

    # ---- checkpoints --------------------------------------------------------------
    def register_state(self, name: str, get: Callable[[], Any], set_: Callable[[Any], None]) -> None:
        """Checkpoint another component's state with the learner's (the curriculum's pool, say):
        `get()` is called at every save (msgpack-able or torch-saveable data), `set_(value)` on resume."""
        self._state_hooks[name] = (get, set_)

    def save(self) -> Path:
        for name, (get, _) in self._state_hooks.items():
            self.extra[name] = get()
        state = ckpt.TrainState(self.version, self.updates, self.batches.last_entry_id, self.batches.seen_ids(),
                                dict(self.extra), list(self.batches.lineage), self.trained)
        tensors = self.ranks.state(self.optimizer) if self.ranks is not None else None
        path = ckpt.save(self.run_dir, self.policy, self.optimizer, state, keep=self.cfg.keep_checkpoints,
                         tensors=tensors)
        log.info("checkpoint %s (version %d)", path, self.version)
        return path

    def resume(self, path: str | Path | None = None) -> bool:
        """Restore the latest checkpoint of run_dir (or `path`); False if there is none."""
        path = Path(path) if path is not None else ckpt.latest(self.run_dir)
        if path is None:
            return False
        state = self.ranks.load(path, self.optimizer) if self.ranks is not None \
            else ckpt.load(path, self.policy, self.optimizer)
        self._restore(state)
        self.extra = state.extra
        for name, (_, set_) in self._state_hooks.items():
            if name in self.extra:
                set_(self.extra[name])
        log.info("resumed from %s at version %d", path, self.version)
        return True

    def _restore(self, state: ckpt.TrainState) -> None:
        self.version, self.updates = state.weight_version, state.updates
        self._trained_before = state.trained - len(self.batches.consumed_ids)
        self.batches.restore(state.consumed_ids, state.last_entry_id, state.lineage)


async def run_updates(learner: Any, total: int, on_update: Callable[[UpdateStats], Awaitable[None] | None] | None = None,
                      stop: asyncio.Event | None = None,
                      before_step: Callable[[], Awaitable[None]] | None = None) -> list[UpdateStats]:
    """The update loop of `learner` (a Learner, or the driver's handle on a learner actor: anything with
    `updates` and `async step()`): step until `total` updates or `stop`, awaiting `before_step` before each read."""
    out = []
    while learner.updates < total and not (stop is not None and stop.is_set()):
        if before_step is not None:
            await before_step()
        s = await learner.step()
        if s is None:
            continue
        out.append(s)
        log.info("update %d: loss %.4f reward %.3f clip %.3f (%d traj, %.1fs)", s.version, s.loss,
                 s.mean_reward, s.clip_fraction, s.trajectories, s.seconds)
        if on_update is not None:
            r = on_update(s)
            if inspect.isawaitable(r):
                await r
    return out


def stream_learner(cfg: Config, client: Any, prefix: str, run_dir: str | Path, policy_engines: Any,
                   policy_model: str, launcher: RankLauncher | None = None) -> Learner:
    """The run's learner: GRPO/PPO on the trajectory stream of `prefix` (consumer `learner-0` of the
    learner group, so a restarted learner reads back its own pending entries, counting a delivery as an
    entry enters an update), publishing to `policy_engines`."""
    consumer = StreamConsumer(client, trajectories_stream(prefix), LEARNER_GROUP, "learner-0",
                              lambda b: decode_as(b, Trajectory), reclaim_idle_ms=cfg.infra.reclaim_idle_ms,
                              max_deliveries=cfg.infra.max_deliveries, count_on_use=True)
    dtype = cfg.engines.dtype if cfg.learner.publish_dtype == "auto" else cfg.learner.publish_dtype
    publisher = WeightPublisher(run_dir, policy_engines, keep=cfg.learner.keep_weights, dtype=dtype,
                                root=cfg.infra.weights_dir, sync=distributed_sync(cfg, policy_engines, dtype))
    return Learner(cfg.learner, policy_model, run_dir, consumer, publisher, group_size=cfg.actors.group_size,
                   launcher=launcher)
