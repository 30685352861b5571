"""From the trajectory stream to training units: intake, dedupe, groups, filters, acks.

Owns the learner's bookkeeping of stream entries, not the update maths
(learner/update.py) nor the transport's delivery rules (infra/streams.py):

1. read the trajectory stream through the learner's consumer group, only while the
   next update's units are not all ready (no unbounded read-ahead); dedupe on
   trajectory_id (delivery is at-least-once): a second entry of a held or already-used
   trajectory is acked at once, counted as `duplicate`, and never trained;
2. hold GRPO members until all G of a group arrived (or `group_timeout_s` passed);
   PPO takes trajectories one by one;
3. set aside episodes the simulator or the environment broke (sim_error / env_error,
   or no trainable step: their reward says nothing about the policy) as `broken`, episodes
   of another environment kind than the phase's (`env_kind`: sim-to-real's real phase
   never trains on the DreamGym phase's leftovers) as `other_env`, drop
   stale ones or mark them for importance correction (learner/staleness.py), and drop
   GRPO groups whose rewards are all equal (`zero_variance`: no advantage to learn from);
   every set-aside entry is counted, never left pending;
4. hand out `groups_per_update` units at a time; the learner `charge`s a batch as it enters an
   update (the consumer counts a delivery there, `count_on_use` in infra/streams.py: what is
   read ahead and never trained costs nothing when a restarted learner reads it back), then
   reports it as `trained`, `requeue`d (a failed update: retried once) or `dead_letter`ed. With
   `max_groups_per_update`, a batch is handed out short once that many groups have come
   in since the last one (DAPO's dynamic sampling bounds its generation batches the same
   way, `max_num_gen_batches`, but stops with an error where this trains on what it has).

Acks of used entries are deferred: an entry used by an update or set aside is only
*queued* for acking; `flush_acks()` XACKs the queue, and the learner calls it
right after a checkpoint that covers those entries is on disk (learner/learner.py).
So every entry the learner group has acked is in the latest checkpoint's dedupe
memory (trained, or deliberately set aside) or in the dead-letter stream; entries
used since the last checkpoint stay pending and are redelivered to a restarted
learner, which retrains them. The ids of used trajectories (the dedupe memory,
bounded), the trained lineage and the last entry used are saved with checkpoints,
so a resumed learner does not train twice on a redelivery it already saved.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from infra import metrics
from infra.config import LearnerConfig
from infra.schema import EnvKind, Status, Trajectory, encode
from infra.streams import Delivery
from learner.advantages import group_advantages
from learner.staleness import StalenessFilter, Verdict, staleness
from learner.update import Unit, trainable_steps

BROKEN = (Status.SIM_ERROR, Status.ENV_ERROR)
SEEN_IDS_KEPT = 50_000


@dataclass
class Held:
    entry_id: bytes
    traj: Trajectory
    deliveries: int = 1


def entry_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id ("ms-seq") as a sortable pair."""
    ms, _, seq = entry_id.partition("-")
    return (int(ms or 0), int(seq or 0))


class GroupBatcher:
    """Turns a StreamConsumer[Trajectory] into training units; the learner asks for a batch, then commits it."""

    def __init__(self, consumer: Any, cfg: LearnerConfig, group_size: int, staleness_filter: StalenessFilter,
                 read_block_ms: int = 500):
        self.consumer, self.cfg, self.group_size = consumer, cfg, group_size
        self.staleness, self.read_block_ms = staleness_filter, read_block_ms
        self.consumed_ids: list[str] = []  # trajectory ids used by updates of this process, in order
        self.lineage: "OrderedDict[str, None]" = OrderedDict()  # ids trained into the weights (checkpointed, bounded)
        self.redelivered = 0  # trajectories trained here that had entered an update of an earlier process
        self.last_entry_id = ""
        self._to_ack: "OrderedDict[bytes, None]" = OrderedDict()  # used or set aside; acked after the next checkpoint
        self._deliveries: dict[bytes, Delivery] = {}  # held entries' deliveries, charged when they enter an update
        self._first_use: dict[bytes, int] = {}  # an entry's delivery count at its first update in this process
        self._groups: "OrderedDict[str, list[Held]]" = OrderedDict()
        self._group_seen_at: dict[str, float] = {}
        self._held_ids: dict[str, bytes] = {}
        self._seen: "OrderedDict[str, None]" = OrderedDict()
        self._ready: list[Unit] = []
        self._came_in = 0  # groups completed (any outcome) since the last batch was handed out
        self._discarded: dict[str, int] = {}
        self.set_aside: dict[str, int] = {}  # trajectories set aside by outcome, since this process started
        self.env_kind: EnvKind | None = None  # the RL phase's environment kind; others are set aside (None: any)

    @property
    def units_needed(self) -> int:
        """Units in one update: groups for GRPO, trajectories (groups_per_update x G) for PPO."""
        return self.cfg.groups_per_update * (1 if self.cfg.algo == "grpo" else self.group_size)

    @property
    def groups_missing(self) -> int:
        """Task groups the next update still waits for (set-aside ones do not count; PPO: trajectories / G)."""
        per_group = 1 if self.cfg.algo == "grpo" else self.group_size
        return -(-max(0, self.units_needed - len(self._ready)) // per_group)

    @property
    def waiting(self) -> int:
        """Trajectories read and kept for an update not made yet: members of incomplete groups and ready units."""
        return sum(len(m) for m in self._groups.values()) + sum(len(u.trajs) for u in self._ready)

    @property
    def discarded(self) -> dict[str, int]:
        """Trajectories set aside (by outcome) since the last `take_discarded`."""
        return dict(self._discarded)

    def take_discarded(self) -> dict[str, int]:
        out, self._discarded = self._discarded, {}
        return out

    async def next_batch(self, version: int, final: bool = False) -> list[Unit] | None:
        """Read once; the next update's units when enough are ready (the learner is at `version`), else None.

        `final`: no more trajectories will come (a real-transition budget is spent): incomplete
        groups are formed as if timed out, and a short batch (at least one unit) is returned.

        No read while a whole update's units are ready: what the learner cannot use yet stays
        undelivered in Redis, where the workers' backpressure sees it, instead of piling up here."""
        if len(self._ready) < self.units_needed:
            await self._intake()
        await self._form_units(version, final)
        n = self.units_needed
        cap = self.cfg.max_groups_per_update
        capped = bool(cap) and self._came_in >= cap
        if (final or capped) and self._ready:
            n = min(n, len(self._ready))
        if len(self._ready) < n:
            return None
        units, self._ready = self._ready[:n], self._ready[n:]
        if len(units) < self.units_needed:
            metrics.LEARNER_SHORT_UPDATES.labels(reason="final" if final else "group_cap").inc()
        self._came_in = 0
        return units

    async def charge(self, units: list[Unit]) -> None:
        """`units` enter an update: their entries count as delivered now (StreamConsumer.handling)."""
        ds = [self._deliveries[e] for u in units for e in u.entry_ids if e in self._deliveries]
        for d in await self.consumer.handling(ds):
            self._first_use.setdefault(d.entry_id, d.deliveries)

    def trained(self, units: list[Unit]) -> None:
        """An update used `units`: remember their ids; their entries are acked at the next `flush_acks`."""
        trajs = [t for u in units for t in u.trajs]
        ids = [e for u in units for e in u.entry_ids]
        self._release(trajs)
        self._queue_ack(ids)
        self.redelivered += sum(self._first_use.pop(e, 1) > 1 for e in ids)  # retrained: an update had it before
        for e in ids:
            self._deliveries.pop(e, None)
        self.consumed_ids += [t.trajectory_id for t in trajs]
        for t in trajs:
            self.lineage[t.trajectory_id] = None
        while len(self.lineage) > SEEN_IDS_KEPT:
            self.lineage.popitem(last=False)
        self.last_entry_id = max((e.decode() if isinstance(e, bytes) else str(e) for e in ids), key=entry_key,
                                 default=self.last_entry_id)
        metrics.LEARNER_TRAJECTORIES.labels("trained").inc(len(trajs))

    def requeue(self, units: list[Unit]) -> None:
        """A failed update's units go back to the front, for the next update to retry."""
        self._ready = list(units) + self._ready

    async def dead_letter(self, units: list[Unit], reason: str) -> list[bytes]:
        """Move the units' entries to the dead-letter stream with `reason` (acked there and then)."""
        deliveries = [Delivery(e, t, raw=encode(t)) for u in units for e, t in zip(u.entry_ids, u.trajs)]
        if not deliveries:
            return []
        await self.consumer.dead_letter(deliveries, reason)
        self._release([d.message for d in deliveries])
        for d in deliveries:
            self._deliveries.pop(d.entry_id, None)
            self._first_use.pop(d.entry_id, None)
        self._count("dead_letter", len(deliveries))
        return [d.entry_id for d in deliveries]

    @property
    def unacked(self) -> int:
        """Entries used or set aside whose ack waits for the next checkpoint."""
        return len(self._to_ack)

    async def flush_acks(self) -> list[bytes]:
        """XACK every queued entry (call once a checkpoint covering them is durable); returns them."""
        ids = list(self._to_ack)
        if ids:
            await self.consumer.ack(ids)
            for e in ids:
                self._to_ack.pop(e, None)
        return ids

    def _queue_ack(self, ids: list[bytes]) -> None:
        for e in ids:
            self._to_ack[e] = None

    def seen_ids(self) -> list[str]:
        """The dedupe memory, oldest first (saved with checkpoints)."""
        return list(self._seen.keys())[-SEEN_IDS_KEPT:]

    def restore(self, seen_ids: list[str], last_entry_id: str, lineage: list[str] | None = None) -> None:
        self._seen = OrderedDict((t, None) for t in seen_ids)
        self.lineage = OrderedDict((t, None) for t in (lineage or []))
        self.last_entry_id = last_entry_id

    # ---- intake -------------------------------------------------------------------
    async def _intake(self) -> None:
        deliveries = await self.consumer.read(count=64, block_ms=self.read_block_ms)
        dup_acks = []
        for d in deliveries:
            t: Trajectory = d.message
            tid = t.trajectory_id
            if d.entry_id in self._to_ack:  # our own used entry, reclaimed back while its ack waits
                continue
            if tid in self._held_ids:
                if self._held_ids[tid] != d.entry_id:  # the same episode added twice: drop the copy
                    dup_acks.append(d.entry_id)
                    self._count("duplicate")
                continue  # else: our own held entry, reclaimed back to us while we waited
            if tid in self._seen:
                dup_acks.append(d.entry_id)
                self._count("duplicate")
                continue
            key = t.group_id if self.cfg.algo == "grpo" else tid
            self._groups.setdefault(key, []).append(Held(d.entry_id, t, d.deliveries))
            self._group_seen_at.setdefault(key, time.monotonic())
            self._held_ids[tid] = d.entry_id
            self._deliveries[d.entry_id] = d
        await self.consumer.ack(dup_acks)  # safe at once: the trajectory's own entry carries it to the lineage

    def _count(self, outcome: str, n: int = 1) -> None:
        if n:
            metrics.LEARNER_TRAJECTORIES.labels(outcome).inc(n)
            self._discarded[outcome] = self._discarded.get(outcome, 0) + n
            self.set_aside[outcome] = self.set_aside.get(outcome, 0) + n

    def _release(self, trajs: list[Trajectory]) -> None:
        for t in trajs:
            self._held_ids.pop(t.trajectory_id, None)
            self._seen[t.trajectory_id] = None
        while len(self._seen) > SEEN_IDS_KEPT:
            self._seen.popitem(last=False)

    async def _discard(self, members: list[Held], outcome: str) -> None:
        """Members that will never train, counted under `outcome`, acked with the next checkpoint."""
        if members:
            self._release([h.traj for h in members])
            self._queue_ack([h.entry_id for h in members])
            for h in members:
                self._deliveries.pop(h.entry_id, None)
            self._count(outcome, len(members))

    # ---- groups -------------------------------------------------------------------
    async def _form_units(self, version: int, final: bool = False) -> None:
        need = self.group_size if self.cfg.algo == "grpo" else 1
        now = time.monotonic()
        for key in list(self._groups):
            members = self._groups[key]
            timed_out = final or now - self._group_seen_at[key] > self.cfg.group_timeout_s
            if len(members) < need and not timed_out:
                continue
            del self._groups[key]
            self._group_seen_at.pop(key, None)
            self._came_in += 1
            kept, corrected, broken, stale, other = [], [], [], [], []
            for h in members:
                t = h.traj
                if self.env_kind is not None and t.env_kind != self.env_kind:
                    other.append(h)
                    continue
                if t.status in BROKEN or not trainable_steps(t):
                    broken.append(h)
                    continue
                verdict = self.staleness.classify(t.policy_version, version)
                metrics.LEARNER_STALENESS.observe(staleness(t.policy_version, version))
                if verdict is Verdict.DROP:
                    stale.append(h)
                else:
                    kept.append(h)
                    corrected.append(verdict is Verdict.CORRECT)
            await self._discard(other, "other_env")
            await self._discard(broken, "broken")
            await self._discard(stale, "stale")
            if not kept:
                continue
            trajs, ids = [h.traj for h in kept], [h.entry_id for h in kept]
            if self.cfg.algo == "ppo":
                self._ready.append(Unit(trajs, None, corrected, ids))
                continue
            adv = group_advantages([t.total_reward for t in trajs], self.cfg.std_normalize)
            if adv is None:
                metrics.LEARNER_ZERO_VARIANCE_GROUPS.inc()
                await self._discard(kept, "zero_variance")
                continue
            self._ready.append(Unit(trajs, adv, corrected, ids))
