"""The learner loop: trajectories in from the stream, one GRPO/PPO update, weights out.

Owns the order of things, not the maths (learner/advantages.py, learner/losses.py)
nor the transport (infra/streams.py):

1. read the trajectory stream through a consumer group; dedupe on trajectory_id
   (delivery is at-least-once);
2. hold GRPO members until all G of a group arrived (or `group_timeout_s` passed);
   PPO takes trajectories one by one;
3. drop or importance-correct stale trajectories (learner/staleness.py), set aside
   episodes the simulator or the environment broke (sim_error / env_error: their
   reward says nothing about the policy), filter zero-variance groups;
4. one update on `groups_per_update` groups: only the action (label) tokens train;
5. ack exactly the entries that update used (and those it decided to discard), then
   publish weights every `publish_every` and checkpoint every `checkpoint_every`.

The weight version is the number of updates applied; a trajectory's staleness is
that minus the version the worker's engine served. Departures from the paper: the
outcome reward is the trajectory's summed reward (1 at a successful final step);
the heavy update runs in a worker thread so an engine sharing the event loop keeps
serving.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import torch

from infra import metrics
from infra.config import LearnerConfig
from infra.schema import Status, Trajectory
from learner import checkpoint as ckpt
from learner.advantages import gae, group_advantages
from learner.losses import policy_loss, value_loss
from learner.policy_model import PolicyModel
from learner.staleness import StalenessFilter, Verdict, staleness, truncated_is_weight

log = logging.getLogger(__name__)
BROKEN = (Status.SIM_ERROR, Status.ENV_ERROR)
SEEN_IDS_KEPT = 50_000


@dataclass
class UpdateStats:
    version: int
    loss: float
    policy_loss: float
    kl: float
    value_loss: float
    clip_fraction: float
    mean_reward: float
    success_rate: float
    trajectories: int
    steps: int
    groups: int
    mean_staleness: float
    seconds: float
    discarded: dict = field(default_factory=dict)  # outcome -> count since the previous update


@dataclass
class _Held:
    entry_id: bytes
    traj: Trajectory


@dataclass
class _Unit:
    """A batch unit: one GRPO group (or one PPO trajectory) with per-trajectory advantages."""

    members: list[_Held]
    advantages: list[float] | None  # GRPO: one per member; PPO: None (GAE at update time)
    corrected: list[bool]


@dataclass
class _Row:
    steps: list[Any]  # trainable Steps
    advantage: float | None
    corrected: bool
    traj: Trajectory


def trainable_steps(traj: Trajectory) -> list[Any]:
    """Steps whose action token trains: a choice label with its behaviour log-prob, mask 1."""
    return [s for s in traj.steps if s.action_token_ids and s.logprobs and s.choice_token_ids and s.policy_prompt
            and (not s.loss_mask or int(s.loss_mask[0]) == 1)]


class Learner:
    """GRPO/PPO learner on a StreamConsumer[Trajectory]; `publisher` is a WeightPublisher or None."""

    def __init__(self, cfg: LearnerConfig, model_name: str, run_dir: str | Path, consumer: Any,
                 publisher: Any = None, *, group_size: int = 4, policy: PolicyModel | None = None,
                 read_block_ms: int = 500):
        self.cfg, self.run_dir, self.consumer, self.publisher = cfg, Path(run_dir), consumer, publisher
        self.group_size = group_size
        self.read_block_ms = read_block_ms
        self.policy = policy or PolicyModel(model_name, cfg.lora_rank, value_head=cfg.algo == "ppo",
                                            gradient_checkpointing=cfg.gradient_checkpointing)
        if cfg.kl_coef > 0:
            self.policy.snapshot_reference()
        self.optimizer = torch.optim.AdamW(self.policy.trainable_parameters(), lr=cfg.lr, weight_decay=0.0)
        self.staleness = StalenessFilter(cfg.max_staleness, cfg.staleness_mode, cfg.is_cap)
        self.version = 0
        self.updates = 0
        self.last_entry_id = ""
        self.extra: dict[str, Any] = {}  # saved with checkpoints (curriculum state etc.)
        self._state_hooks: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self._groups: "OrderedDict[str, list[_Held]]" = OrderedDict()
        self._group_seen_at: dict[str, float] = {}
        self._held_ids: dict[str, bytes] = {}
        self._seen: "OrderedDict[str, None]" = OrderedDict()
        self._ready: list[_Unit] = []
        self._discarded: dict[str, int] = {}
        self.consumed_ids: list[str] = []  # trajectory ids used by updates, in order (tests, summaries)

    # ---- intake ---------------------------------------------------------------------
    async def _intake(self) -> None:
        deliveries = await self.consumer.read(count=64, block_ms=self.read_block_ms)
        dup_acks = []
        for d in deliveries:
            t: Trajectory = d.message
            tid = t.trajectory_id
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
            self._groups.setdefault(key, []).append(_Held(d.entry_id, t))
            self._group_seen_at.setdefault(key, time.monotonic())
            self._held_ids[tid] = d.entry_id
        await self.consumer.ack(dup_acks)

    def _count(self, outcome: str, n: int = 1) -> None:
        if n:
            metrics.LEARNER_TRAJECTORIES.labels(outcome).inc(n)
            self._discarded[outcome] = self._discarded.get(outcome, 0) + n

    def _release(self, members: list[_Held]) -> None:
        for h in members:
            tid = h.traj.trajectory_id
            self._held_ids.pop(tid, None)
            self._seen[tid] = None
        while len(self._seen) > SEEN_IDS_KEPT:
            self._seen.popitem(last=False)

    async def _discard(self, members: list[_Held], outcome: str) -> None:
        """Ack members that will never train, counted under `outcome`."""
        if members:
            self._release(members)
            await self.consumer.ack([h.entry_id for h in members])
            self._count(outcome, len(members))

    async def _form_units(self) -> None:
        need = self.group_size if self.cfg.algo == "grpo" else 1
        now = time.monotonic()
        for key in list(self._groups):
            members = self._groups[key]
            timed_out = now - self._group_seen_at[key] > self.cfg.group_timeout_s
            if len(members) < need and not timed_out:
                continue
            del self._groups[key]
            self._group_seen_at.pop(key, None)
            kept, corrected, broken, stale = [], [], [], []
            for h in members:
                t = h.traj
                if t.status in BROKEN or not trainable_steps(t):
                    broken.append(h)
                    continue
                verdict = self.staleness.classify(t.policy_version, self.version)
                metrics.LEARNER_STALENESS.observe(staleness(t.policy_version, self.version))
                if verdict is Verdict.DROP:
                    stale.append(h)
                else:
                    kept.append(h)
                    corrected.append(verdict is Verdict.CORRECT)
            await self._discard(broken, "broken")
            await self._discard(stale, "stale")
            if self.cfg.algo == "ppo":
                if kept:
                    self._ready.append(_Unit(kept, None, corrected))
                continue
            adv = group_advantages([h.traj.total_reward for h in kept], self.cfg.std_normalize) if kept else None
            if adv is None:
                if kept:
                    metrics.LEARNER_ZERO_VARIANCE_GROUPS.inc()
                await self._discard(kept, "zero_variance")
                continue
            self._ready.append(_Unit(kept, adv, corrected))

    def _units_needed(self) -> int:
        return self.cfg.groups_per_update * (1 if self.cfg.algo == "grpo" else self.group_size)

    # ---- the loop -----------------------------------------------------------------
    async def step(self) -> UpdateStats | None:
        """Read once; if a full batch is ready, apply one update and return its stats."""
        await self._intake()
        await self._form_units()
        n = self._units_needed()
        if len(self._ready) < n:
            return None
        units, self._ready = self._ready[:n], self._ready[n:]
        t0 = time.monotonic()
        stats = await asyncio.to_thread(self._update, units)
        members = [h for u in units for h in u.members]
        self._release(members)
        await self.consumer.ack([h.entry_id for h in members])
        self.consumed_ids += [h.traj.trajectory_id for h in members]
        self.last_entry_id = max((h.entry_id.decode() if isinstance(h.entry_id, bytes) else str(h.entry_id)
                                  for h in members), key=_entry_key, default=self.last_entry_id)
        metrics.LEARNER_TRAJECTORIES.labels("trained").inc(len(members))
        self.updates += 1
        self.version += 1
        stats.version = self.version
        stats.discarded, self._discarded = self._discarded, {}
        if self.publisher is not None and self.updates % self.cfg.publish_every == 0:
            try:
                await self.publisher.publish(self.policy, self.version)
            except Exception:  # engines down or disk full: keep training; staleness will show it
                log.exception("publishing weights v%d failed; workers keep the previous version", self.version)
        if self.updates % self.cfg.checkpoint_every == 0:
            await asyncio.to_thread(self.save)
        stats.seconds = time.monotonic() - t0
        metrics.LEARNER_UPDATES.inc()
        metrics.LEARNER_UPDATE_SECONDS.observe(stats.seconds)
        return stats

    async def run(self, total_updates: int | None = None,
                  on_update: Callable[[UpdateStats], Awaitable[None] | None] | None = None,
                  stop: asyncio.Event | None = None) -> list[UpdateStats]:
        """Update until `total_updates` (absolute, so a resumed run finishes the same budget)."""
        total = total_updates if total_updates is not None else self.cfg.total_updates
        await self.consumer.ensure_group()
        out = []
        while self.updates < total and not (stop is not None and stop.is_set()):
            s = await self.step()
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

    @property
    def discarded(self) -> dict[str, int]:
        """Trajectories set aside (by outcome) since the last update's stats were taken."""
        return dict(self._discarded)

    async def warm_start(self, trajectories, on_step=None) -> list[float]:
        """cfg.warm_start_steps of supervised choice training on expert trajectories, then
        publish the result as the current version (workers start from it)."""
        from learner.policy_sft import expert_examples, train_on_examples

        cfg = self.cfg
        examples = expert_examples(trajectories, self.policy.tokenizer)
        losses = await asyncio.to_thread(train_on_examples, self.policy, examples, cfg.warm_start_steps, cfg.warm_start_lr,
                                         cfg.warm_start_batch, 0, cfg.max_grad_norm, on_step)
        log.info("warm start: %d steps on %d expert transitions, loss %s", len(losses), len(examples),
                 f"{losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "n/a")
        if losses:
            if cfg.kl_coef > 0 and self.policy.lora_rank == 0:
                self.policy.snapshot_reference(force=True)  # the warm-started policy is the KL reference
            await self.publish()
        return losses

    async def publish(self) -> None:
        """Publish the current weights now (after a warm start or a resume)."""
        if self.publisher is not None:
            await self.publisher.publish(self.policy, self.version)

    # ---- the update -----------------------------------------------------------------
    def _rows(self, units: list[_Unit]) -> list[_Row]:
        rows = []
        for u in units:
            for i, h in enumerate(u.members):
                adv = u.advantages[i] if u.advantages is not None else None
                rows.append(_Row(trainable_steps(h.traj), adv, u.corrected[i], h.traj))
        return rows

    def _chunks(self, rows: list[_Row]) -> list[list[int]]:
        chunks, cur, n = [], [], 0
        for i, r in enumerate(rows):
            if cur and n + len(r.steps) > self.cfg.micro_batch:
                chunks.append(cur)
                cur, n = [], 0
            cur.append(i)
            n += len(r.steps)
        if cur:
            chunks.append(cur)
        return chunks

    def _forward(self, rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor | None]:
        steps = [s for r in rows for s in r.steps]
        return self.policy.forward_choice([s.policy_prompt for s in steps], [s.choice_token_ids for s in steps],
                                          [s.action_token_ids[0] for s in steps])

    @staticmethod
    def _pad(rows: list[_Row], flat: torch.Tensor) -> torch.Tensor:
        width = max(len(r.steps) for r in rows)
        out = flat.new_zeros((len(rows), width))
        k = 0
        for i, r in enumerate(rows):
            out[i, :len(r.steps)] = flat[k:k + len(r.steps)]
            k += len(r.steps)
        return out

    def _update(self, units: list[_Unit]) -> UpdateStats:
        cfg = self.cfg
        rows = self._rows(units)
        chunks = self._chunks(rows)
        self.policy.train()
        # Per-row fixed inputs: old log-probs (behaviour, or proximal for corrected rows),
        # importance weights, advantages per step.
        old, isw, adv = [], [], []
        prox_values: list[list[float]] = []
        need_prox = any(r.corrected for r in rows) or cfg.algo == "ppo"
        for idx in chunks:
            part = [rows[i] for i in idx]
            if need_prox:
                with torch.no_grad():
                    lp, v = self._forward(part)
                lp = lp.tolist()
                vals = v.tolist() if v is not None else [0.0] * len(lp)
            else:
                lp = vals = None
            k = 0
            for r in part:
                n = len(r.steps)
                mu = [float(s.logprobs[0]) for s in r.steps]
                if r.corrected:
                    prox = lp[k:k + n]
                    old.append(prox)
                    isw.append([truncated_is_weight(p, m, cfg.is_cap) for p, m in zip(prox, mu)])
                else:
                    old.append(mu)
                    isw.append([1.0] * n)
                if cfg.algo == "ppo":
                    a, ret = gae([float(s.reward) for s in r.steps], vals[k:k + n], cfg.gamma, cfg.gae_lambda)
                    adv.append(list(zip(a, ret, vals[k:k + n])))
                else:
                    adv.append([(r.advantage, 0.0, 0.0)] * n)
                k += n
        total_rows = sum(1 for r in rows if r.steps)
        total_tokens = sum(len(r.steps) for r in rows)
        sums = {"loss": 0.0, "pl": 0.0, "kl": 0.0, "vl": 0.0, "clip": 0.0}
        for _ in range(cfg.epochs_per_batch):
            self.optimizer.zero_grad(set_to_none=True)
            for idx in chunks:
                part = [rows[i] for i in idx]
                logp_flat, v_flat = self._forward(part)
                logp = self._pad(part, logp_flat)
                mask = self._pad(part, torch.ones_like(logp_flat))

                def table(src: list, j: int | None = None) -> torch.Tensor:
                    flat = [x if j is None else x[j] for i in idx for x in src[i]]
                    return self._pad(part, torch.tensor(flat, dtype=logp.dtype))

                ref = None
                if cfg.kl_coef > 0:
                    steps = [s for r in part for s in r.steps]
                    ref = self._pad(part, self.policy.reference_logprobs(
                        [s.policy_prompt for s in steps], [s.choice_token_ids for s in steps],
                        [s.action_token_ids[0] for s in steps]))
                out = policy_loss(logp, table(old), table(adv, 0), mask, cfg.clip_eps, ref, cfg.kl_coef,
                                  table(isw), cfg.aggregate)
                scale = (len(part) / total_rows) if cfg.aggregate == "sequence" else (len(logp_flat) / total_tokens)
                loss = out.loss * scale
                vl = torch.zeros(())
                if cfg.algo == "ppo" and v_flat is not None:
                    vl = value_loss(self._pad(part, v_flat), table(adv, 1), mask, table(adv, 2), cfg.clip_eps)
                    loss = loss + cfg.value_coef * vl * (len(logp_flat) / total_tokens)
                loss.backward()
                w = len(logp_flat) / total_tokens
                sums["loss"] += float(loss.detach()) / cfg.epochs_per_batch
                sums["pl"] += float(out.policy_loss) * scale / cfg.epochs_per_batch
                sums["kl"] += float(out.kl) * scale / cfg.epochs_per_batch
                sums["vl"] += float(vl.detach()) * w / cfg.epochs_per_batch
                sums["clip"] += float(out.clip_fraction) * w / cfg.epochs_per_batch
            torch.nn.utils.clip_grad_norm_(self.policy.trainable_parameters(), cfg.max_grad_norm)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        trajs = [r.traj for r in rows]
        mean_reward = sum(t.total_reward for t in trajs) / len(trajs)
        lags = [staleness(t.policy_version, self.version) for t in trajs]
        metrics.LEARNER_LOSS.set(sums["loss"])
        metrics.LEARNER_KL.set(sums["kl"])
        metrics.LEARNER_CLIP_FRACTION.set(sums["clip"])
        metrics.LEARNER_MEAN_REWARD.set(mean_reward)
        return UpdateStats(version=self.version, loss=sums["loss"], policy_loss=sums["pl"], kl=sums["kl"],
                           value_loss=sums["vl"], clip_fraction=sums["clip"], mean_reward=mean_reward,
                           success_rate=sum(1 for t in trajs if t.success) / len(trajs), trajectories=len(trajs),
                           steps=total_tokens, groups=len(units), mean_staleness=sum(lags) / len(lags), seconds=0.0)

    # ---- checkpoints --------------------------------------------------------------
    def register_state(self, name: str, get: Callable[[], Any], set_: Callable[[Any], None]) -> None:
        """Checkpoint another component's state with the learner's (the curriculum's pool, say):
        `get()` is called at every save (msgpack-able or torch-saveable data), `set_(value)` on resume."""
        self._state_hooks[name] = (get, set_)

    def save(self) -> Path:
        for name, (get, _) in self._state_hooks.items():
            self.extra[name] = get()
        state = ckpt.TrainState(self.version, self.updates, self.last_entry_id,
                                list(self._seen.keys())[-SEEN_IDS_KEPT:], dict(self.extra))
        path = ckpt.save(self.run_dir, self.policy, self.optimizer, state, keep=self.cfg.keep_checkpoints)
        log.info("checkpoint %s (version %d)", path, self.version)
        return path

    def resume(self, path: str | Path | None = None) -> bool:
        """Restore the latest checkpoint of run_dir (or `path`); False if there is none."""
        path = Path(path) if path is not None else ckpt.latest(self.run_dir)
        if path is None:
            return False
        state = ckpt.load(path, self.policy, self.optimizer)
        self.version, self.updates, self.last_entry_id = state.weight_version, state.updates, state.last_entry_id
        self._seen = OrderedDict((t, None) for t in state.consumed_ids)
        self.extra = state.extra
        for name, (_, set_) in self._state_hooks.items():
            if name in self.extra:
                set_(self.extra[name])
        log.info("resumed from %s at version %d", path, self.version)
        return True


def _entry_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return (int(ms or 0), int(seq or 0))
