"""Redis stream transport: the task stream (curriculum -> workers) and the trajectory
stream (workers -> learner).

Owns the delivery guarantees, nothing about what the messages mean:
- producers XADD with `MAXLEN ~` and pipeline batches;
- consumers read through a consumer group, first their own pending entries (so a
  restarted consumer with the same name resumes), then new ones;
- entries are XACKed only when the caller says it has used them;
- entries idle in a dead consumer's pending list are taken over with XAUTOCLAIM;
- entries that fail to decode (schema.SchemaError: corrupt bytes, a foreign version,
  a NaN reward, mismatched per-token lists ...) are copied to a dead-letter stream
  with the reason, then acked, and counted: never dropped silently;
- delivery is bounded: every Delivery carries the times Redis delivered it (the
  PEL's counter, which XREADGROUP history reads and XAUTOCLAIM raise). A caller whose
  handler fails calls `nack(deliveries, error)`: the entry is left for redelivery
  (to any consumer of the group, at its next reclaim) until it has been handled
  `max_deliveries` times, then it is dead-lettered with the last error and acked. An
  entry read back with a count above the bound (its consumer crashed on it every time,
  so no one could nack) is dead-lettered before the caller sees it: a poison message
  cannot crash-loop a restarted learner or stop a worker. `dead_letter(deliveries,
  reason)` moves entries the caller can never use at once;
- a batch reader counts a delivery where it is used, not where it is read
  (`count_on_use`, the learner's consumer): every read sets an entry's counter back to
  the times it was handled before (Redis raised it on the read), and `handling(deliveries)`
  raises it by one as the caller starts on them (the learner: as they enter an update).
  Entries read ahead and never handled, then re-read after a restart or reclaimed from a
  dead reader, are charged nothing: a reader that dies on the 4th entry of a batch of
  10 again and again dead-letters the 4th only. Each step checks that the entry is still
  this consumer's, in one Lua script. A reader killed between its read and that reset
  leaves one extra count (it errs toward dead-lettering, never toward a loop). Entries a live consumer
  still holds are not counted again: before each reclaim their idle time is renewed
  (XCLAIM JUSTID, which leaves the counter alone), so XAUTOCLAIM does not take them;
- a handler deadline (`handler_timeout_s`, off by default): an entry the caller has held
  (with `count_on_use`: since `handling()`) longer than that without ack, nack or
  dead-letter is nacked at the consumer's next `read()` (or `expire_held()`; a caller
  whose reads wait on its handlers calls it on a timer) with a `HandlerTimeout` error and counted in
  stream_handler_timeouts_total, so a handler that forgot it, or hangs, no longer keeps
  it pending (its lease renewed) for ever; past `max_deliveries` it is dead-lettered;
- every call retries connection errors with capped exponential backoff, and a
  group lost with a non-persistent Redis is recreated;
- acked entries are trimmed (`trim_acked`): `XTRIM MINID ~ floor`, where floor is the
  smallest, over every group of the stream, of its oldest pending id and its
  last-delivered id, computed and applied in one Lua script so no group appears or
  moves in between. An entry still pending in some group, or not yet delivered to
  some group, is never trimmed; a stream with no group is never trimmed (MAXLEN still
  bounds it). Each consumer trims from its ack path, at most once per `trim_every_s`:
  that is where entries become acked, it runs in every process that acks (learner,
  local and Ray workers) with no extra task to start or stop, and the floor covers
  every group, so whichever group acks last lets the stream shrink.

Delivery is at-least-once: a batch retried after a connection drop may be added
twice, and a reclaimed entry may have been half-used. Consumers that care dedupe
on the message's own id (Trajectory.trajectory_id).
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Generic, Iterable, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError, TimeoutError as RedisTimeoutError

from infra import metrics
from infra.config import redact_url
from infra.schema import SchemaError
from infra.stream_scripts import SET_COUNTS_SCRIPT, TRIM_ACKED_SCRIPT

log = logging.getLogger(__name__)

T = TypeVar("T")
DATA_FIELD = b"d"
WORKERS_GROUP = "workers"  # the rollout workers' consumer group on the task stream
LEARNER_GROUP = "learner"  # the learner's consumer group on the trajectory stream
RETRYABLE = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)
DEFAULT_MAX_DELIVERIES = 5  # the default of infra.max_deliveries
PARKED_IDLE_MS = 10 ** 9  # idle time given to a nacked entry: the next XAUTOCLAIM takes it
ERRORS_KEPT = 10_000  # last handler errors remembered for the dead-letter reason


def key(prefix: str, name: str) -> str:
    """Every Redis key of a run lives under one prefix."""
    return f"{prefix}:{name}"


def run_prefix(stream_prefix: str, run: str) -> str:
    """The prefix of run `run`'s keys (`infra.stream_prefix` and the run's name)."""
    return key(stream_prefix, run)


def tasks_stream(prefix: str) -> str:
    return key(prefix, "tasks")


def trajectories_stream(prefix: str) -> str:
    return key(prefix, "trajectories")


def dead_letter_stream(stream: str) -> str:
    return f"{stream}:dead"


def connect(url: str, tls_ca: str = "") -> aioredis.Redis:
    """An async client for `url` (password, ACL user and rediss:// TLS as given), verifying the
    server against the CA bundle `tls_ca` (infra.redis_tls_ca) when one is given. Every Redis
    client of DreamGym is made here."""
    kwargs: dict[str, Any] = {"socket_connect_timeout": 5, "socket_keepalive": True, "health_check_interval": 15}
    if url.startswith("rediss://") and tls_ca:
        kwargs["ssl_ca_certs"] = tls_ca
        kwargs["ssl_cert_reqs"] = ssl.CERT_REQUIRED
    elif tls_ca:
        log.warning("infra.redis_tls_ca is set but %s is not a rediss:// URL: the connection is not encrypted",
                    redact_url(url))
    log.debug("connecting to redis at %s", redact_url(url))
    return aioredis.from_url(url, **kwargs)


class RedisUnreachable(ConnectionError):
    """Redis did not answer (refused, timed out, wrong password, TLS): the message names the URL
    without its password and the cause, in one line; the CLI prints it and exits non-zero."""


async def ping(client: aioredis.Redis, url: str, timeout_s: float = 5.0) -> None:
    """Check once, fast, that `client` reaches its server; raises RedisUnreachable otherwise.
    Commands and runs call it first, so a wrong URL fails in seconds instead of after the
    retry deadline of with_retry (which is for a server that was there and went away)."""
    try:
        await asyncio.wait_for(client.ping(), timeout_s)
    except (asyncio.TimeoutError, RedisError, OSError) as exc:
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else "no answer"
        raise RedisUnreachable(f"cannot reach Redis at {redact_url(url)} ({type(exc).__name__}: {cause})") from None


async def with_retry(op: Callable[[], Awaitable[T]], what: str, deadline_s: float = 120.0,
                     base_s: float = 0.05, cap_s: float = 2.0) -> T:
    """Run `op`, retrying connection errors with jittered exponential backoff until `deadline_s`."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    attempt = 0
    while True:
        try:
            return await op()
        except RETRYABLE as exc:
            attempt += 1
            if loop.time() >= end:
                raise
            delay = min(cap_s, base_s * 2 ** attempt) * (0.5 + random.random() / 2)
            metrics.STREAM_RECONNECTS.inc()
            log.warning("redis %s failed (%s); retry %d in %.2fs", what, type(exc).__name__, attempt, delay)
            await asyncio.sleep(delay)


async def trim_acked(client: aioredis.Redis, stream: str, approximate: bool = True) -> int:
    """Remove the entries of `stream` that every consumer group has acked; returns how many went.

    Only entries below the floor (see the module docstring) go: none pending anywhere, none
    undelivered to any group. `approximate` (MINID ~) lets Redis drop whole radix-tree nodes
    only, so a few acked entries may stay until the next call; exact trimming costs more."""
    async def op() -> Any:
        return await client.eval(TRIM_ACKED_SCRIPT, 1, stream, "~" if approximate else "=")
    _floor, n = await with_retry(op, f"XTRIM {stream}", deadline_s=10)
    if n:
        metrics.STREAM_MESSAGES_TRIMMED.labels(stream).inc(int(n))
    return int(n)


class StreamProducer:
    """Appends encoded messages to one stream."""

    def __init__(self, client: aioredis.Redis, stream: str, maxlen: int = 100_000):
        self.client, self.stream, self.maxlen = client, stream, maxlen

    async def add(self, payloads: Iterable[bytes]) -> list[bytes]:
        """XADD every payload in one pipeline round trip; returns the entry ids."""
        payloads = list(payloads)
        if not payloads:
            return []

        async def op() -> list[bytes]:
            pipe = self.client.pipeline(transaction=False)
            for p in payloads:
                pipe.xadd(self.stream, {DATA_FIELD: p}, maxlen=self.maxlen, approximate=True)
            return await pipe.execute()

        ids = await with_retry(op, f"XADD {self.stream}")
        metrics.STREAM_MESSAGES_ADDED.labels(self.stream).inc(len(payloads))
        metrics.STREAM_BYTES_ADDED.labels(self.stream).inc(sum(len(p) for p in payloads))
        return ids


@dataclass
class Delivery(Generic[T]):
    """A decoded entry, the id to ack once it has been used, and how often it was delivered."""

    entry_id: bytes
    message: T
    reclaimed: bool = False
    deliveries: int = 1  # times Redis delivered this entry, this delivery included (count_on_use: handled)
    raw: bytes = b""  # the encoded bytes, kept for the dead-letter stream


Entry = tuple[bytes, dict, bool, int]  # (entry id, fields, reclaimed, times delivered)


class StreamConsumer(Generic[T]):
    """Reads one stream through a consumer group, decoding with `decode`.

    `read()` returns decoded deliveries; the caller acks them with `ack()` after use, or
    reports a failure with `nack()`. Undecodable entries, and entries handled
    `max_deliveries` times without success, go to `<stream>:dead` with the reason and
    are acked there and then.
    """

    def __init__(self, client: aioredis.Redis, stream: str, group: str, consumer: str,
                 decode: Callable[[bytes], T], reclaim_idle_ms: int = 30_000, reclaim_every: int = 10,
                 max_deliveries: int = DEFAULT_MAX_DELIVERIES, trim_every_s: float | None = 1.0,
                 handler_timeout_s: float = 0.0, count_on_use: bool = False,
                 on_expire: Callable[[list[Delivery[T]]], None] | None = None):
        """`trim_every_s`: least seconds between two `trim_acked` calls from `ack` (0: after every
        ack; None: never, the stream keeps acked entries until MAXLEN). `handler_timeout_s`: the
        handler deadline of the module docstring (0: none; the learner holds entries until its
        checkpoint on purpose). `count_on_use`: a delivery counts at `handling()`, not at `read()`
        (a batch reader that reads ahead; see the module docstring). `on_expire(deliveries)`: called
        with the entries the handler deadline nacked, wherever that happens (a worker cancels their work)."""
        if max_deliveries < 1:
            raise ValueError(f"max_deliveries must be >= 1, got {max_deliveries}")
        self.trim_every_s = trim_every_s
        self._trimmed_at: float | None = None
        self.client, self.stream, self.group, self.consumer = client, stream, group, consumer
        self.decode = decode
        self.reclaim_idle_ms = reclaim_idle_ms
        self.reclaim_every = reclaim_every
        self.max_deliveries = max_deliveries
        self.count_on_use = count_on_use
        self.on_expire = on_expire
        self.dead_letters = dead_letter_stream(stream)
        self._reads = 0
        self._own_pending_done = False
        self._own_cursor = "0-0"
        self._reclaim_cursor = b"0-0"
        self._held: set[bytes] = set()  # delivered to the caller, not yet acked, nacked or dead-lettered
        self._in_use: set[bytes] = set()  # count_on_use: held entries the caller started handling
        self.handler_timeout_s = handler_timeout_s
        self._held_since: dict[bytes, tuple[float, Delivery]] = {}  # with a deadline: when each was handed out
        self._errors: "OrderedDict[bytes, str]" = OrderedDict()  # last nack error per entry
        for counter in (metrics.STREAM_MESSAGES_READ, metrics.STREAM_MESSAGES_ACKED, metrics.STREAM_MESSAGES_RECLAIMED,
                        metrics.STREAM_MESSAGES_REDELIVERED, metrics.STREAM_MESSAGES_NACKED,
                        metrics.STREAM_MESSAGES_TRIMMED, metrics.STREAM_HANDLER_TIMEOUTS):
            counter.labels(stream)  # a series at 0 from the start: rate() and increase() see the first event

    def rewind(self) -> None:
        """Read this consumer's own pending entries again from the first, as a restarted consumer of the
        same name does (a learner that went back to its checkpoint retrains what that did not cover)."""
        self._own_pending_done, self._own_cursor = False, "0-0"
        self._held.clear()
        self._held_since.clear()
        self._in_use.clear()

    async def ensure_group(self) -> None:
        """Create the group (and the stream) if absent; idempotent."""
        async def op() -> None:
            try:
                await self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        await with_retry(op, f"XGROUP CREATE {self.stream}")

    async def _call(self, op: Callable[[], Awaitable[Any]], what: str) -> Any:
        """with_retry, plus recreation of a group lost when a non-persistent Redis restarted."""
        try:
            return await with_retry(op, what)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning("group %s on %s vanished (redis restarted without persistence?); recreating", self.group, self.stream)
            await self.ensure_group()
            return await with_retry(op, what)

    async def read(self, count: int = 100, block_ms: int = 1000) -> list[Delivery[T]]:
        """Up to `count` deliveries: own pending first, then reclaimed idle ones, then new."""
        await self.expire_held()
        entries: list[Entry] = []
        if not self._own_pending_done:
            entries += await self._read_own(count)
        self._reads += 1
        if not entries and (self._reads - 1) % self.reclaim_every == 0:
            entries += await self._reclaim(count)
        if not entries:
            resp = await self._call(lambda: self.client.xreadgroup(
                self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms), f"XREADGROUP {self.stream}")
            entries += [(i, f, False, 1) for i, f in (resp[0][1] if resp else [])]  # new: first delivery
        metrics.STREAM_MESSAGES_READ.labels(self.stream).inc(len(entries))
        return await self._deliver(entries)

    async def _read_own(self, count: int) -> list[Entry]:
        """The next page of this consumer's pending entries (a restarted consumer resumes them),
        with their delivery counters, read atomically."""
        cursor = self._own_cursor

        async def op() -> list:
            pipe = self.client.pipeline(transaction=True)
            pipe.xpending_range(self.stream, self.group, min=f"({cursor}", max="+", count=count,
                                consumername=self.consumer)
            pipe.xreadgroup(self.group, self.consumer, {self.stream: cursor}, count=count)
            return await pipe.execute()

        pending, resp = await self._call(op, f"XREADGROUP {self.stream} (own pending)")
        own = resp[0][1] if resp else []
        if len(own) < count:
            self._own_pending_done = True
        if own:
            last = own[-1][0]
            self._own_cursor = last.decode() if isinstance(last, bytes) else str(last)
        times = {p["message_id"]: int(p["times_delivered"]) + 1 for p in pending}  # + this read
        trimmed = [i for i, f in own if not f]
        if trimmed:  # trimmed by MAXLEN while pending: nothing is left to deliver or dead-letter
            log.warning("%d pending entries of %s were trimmed before use; acking them", len(trimmed), self.stream)
            await self.ack(trimmed)
        return [(i, f, False, times.get(i, 1)) for i, f in own if f]

    async def _reclaim(self, count: int = 100) -> list[Entry]:
        """Take over entries idle longer than reclaim_idle_ms in any consumer's pending list."""
        await self._renew_leases()

        async def op() -> Any:
            return await self.client.xautoclaim(self.stream, self.group, self.consumer,
                                                min_idle_time=self.reclaim_idle_ms,
                                                start_id=self._reclaim_cursor, count=count)
        resp = await self._call(op, f"XAUTOCLAIM {self.stream}")
        self._reclaim_cursor = resp[0] if resp and resp[0] else b"0-0"
        claimed = [(i, f) for i, f in (resp[1] if resp else []) if f]
        deleted = resp[2] if resp and len(resp) > 2 else []
        if deleted:  # entries trimmed by MAXLEN while pending: nothing left to deliver
            log.warning("%d pending entries of %s were trimmed before reclaim", len(deleted), self.stream)
        if not claimed:
            return []
        metrics.STREAM_MESSAGES_RECLAIMED.labels(self.stream).inc(len(claimed))
        log.info("reclaimed %d idle entries on %s", len(claimed), self.stream)
        times = await self._delivery_counts([i for i, _ in claimed])
        return [(i, f, True, times.get(i, 1)) for i, f in claimed]

    async def _delivery_counts(self, ids: list[bytes]) -> dict[bytes, int]:
        async def op() -> list:
            pipe = self.client.pipeline(transaction=False)
            for i in ids:
                pipe.xpending_range(self.stream, self.group, min=i, max=i, count=1)
            return await pipe.execute()
        rows = await self._call(op, f"XPENDING {self.stream}")
        return {r[0]["message_id"]: int(r[0]["times_delivered"]) for r in rows if r}

    async def _renew_leases(self) -> None:
        """Reset the idle time of entries the caller still holds, so XAUTOCLAIM (ours or another
        consumer's) leaves them alone and their delivery counter is not raised by a non-delivery.
        Only entries this consumer still owns are touched; ids it no longer owns are forgotten."""
        if not self._held:
            return
        limit = len(self._held) + 100

        async def op() -> list:
            return await self.client.xpending_range(self.stream, self.group, min="-", max="+", count=limit,
                                                    consumername=self.consumer)
        pending = await self._call(op, f"XPENDING {self.stream}")
        if len(pending) < limit:  # the whole list: held ids missing from it were acked or taken elsewhere
            self._held.intersection_update(p["message_id"] for p in pending)
            self._in_use.intersection_update(self._held)
        old = [p["message_id"] for p in pending
               if p["message_id"] in self._held and p["time_since_delivered"] >= self.reclaim_idle_ms // 2]
        if old:
            await self._call(lambda: self.client.xclaim(self.stream, self.group, self.consumer, 0, old, justid=True),
                             f"XCLAIM {self.stream} (lease)")

    async def _deliver(self, entries: list[Entry]) -> list[Delivery[T]]:
        out: list[Delivery[T]] = []
        dead: list[tuple[bytes, dict, str]] = []
        for entry_id, fields, reclaimed, times in entries:
            if times > self.max_deliveries:  # its consumers died on it every time: no one could nack
                dead.append((entry_id, fields, self._exhausted(entry_id, times - 1)))
                continue
            raw = fields.get(DATA_FIELD)
            try:
                if raw is None:
                    raise SchemaError(f"entry has no {DATA_FIELD!r} field")
                message = self.decode(raw)
            except Exception as exc:  # decoding is deterministic: retrying the same bytes cannot help
                dead.append((entry_id, fields, f"{type(exc).__name__}: {exc}"))
                continue
            out.append(Delivery(entry_id, message, reclaimed, times, raw))
        if dead:
            await self._dead_letter(dead)
        if self.count_on_use and out:  # this read is no delivery: back to the times handled before it
            out = await self._set_counts(out, "set", [d.deliveries - 1 for d in out])
        redelivered = sum(d.deliveries > (0 if self.count_on_use else 1) for d in out)
        if redelivered:
            metrics.STREAM_MESSAGES_REDELIVERED.labels(self.stream).inc(redelivered)
        self._held.update(d.entry_id for d in out)
        if not self.count_on_use:
            self._start_deadline(out)
        return out

    def _start_deadline(self, deliveries: list[Delivery[T]]) -> None:
        if self.handler_timeout_s > 0:
            now = asyncio.get_running_loop().time()
            self._held_since.update((d.entry_id, (now, d)) for d in deliveries)

    async def _set_counts(self, deliveries: list[Delivery[T]], mode: str, values: list[int]) -> list[Delivery[T]]:
        """SET_COUNTS_SCRIPT: each delivery's counter set to its value ('set') or raised by it ('add');
        stores the counters in force in `deliveries` and returns those still this consumer's."""
        args: list[Any] = [self.group, self.consumer, mode]
        for d, v in zip(deliveries, values):
            args += [d.entry_id, v]

        async def op() -> Any:
            return await self.client.eval(SET_COUNTS_SCRIPT, 1, self.stream, *args)
        counts = await self._call(op, f"XCLAIM {self.stream} (delivery counts)")
        kept = []
        for d, n in zip(deliveries, counts):
            if int(n) < 0:  # acked meanwhile, or another consumer's now: not ours to hand out
                self._held.discard(d.entry_id)
                continue
            d.deliveries = int(n)
            kept.append(d)
        return kept

    async def handling(self, deliveries: Iterable[Delivery[T]]) -> list[Delivery[T]]:
        """The caller starts handling `deliveries`. With `count_on_use`, this is their delivery: each
        counter rises by one (`Delivery.deliveries` becomes the attempt number, as a read gives it
        without `count_on_use`) and the handler deadline starts; an entry handled `max_deliveries`
        times by callers that died on it is dead-lettered at its next read. Returns the deliveries
        still this consumer's (all of them without `count_on_use`, where the read counted already)."""
        deliveries = list(deliveries)
        if not self.count_on_use or not deliveries:
            return deliveries
        kept = await self._set_counts(deliveries, "add", [1] * len(deliveries))
        self._in_use.update(d.entry_id for d in kept)
        if len(kept) < len(deliveries):
            log.warning("%d of %d entries of %s were no longer this consumer's when handled",
                        len(deliveries) - len(kept), len(deliveries), self.stream)
        self._start_deadline(kept)
        return kept

    async def expire_held(self) -> list[Delivery[T]]:
        """Nack (and count) the entries held past `handler_timeout_s` without ack, nack or dead-letter;
        returns them. `read()` calls it first."""
        if self.handler_timeout_s <= 0 or not self._held_since:
            return []
        now = asyncio.get_running_loop().time()
        late: list[Delivery[T]] = []
        for entry_id, (since, delivery) in list(self._held_since.items()):
            if entry_id not in self._held:  # acked, nacked or dead-lettered since
                del self._held_since[entry_id]
            elif now - since >= self.handler_timeout_s:
                del self._held_since[entry_id]
                late.append(delivery)
        if late:
            metrics.STREAM_HANDLER_TIMEOUTS.labels(self.stream).inc(len(late))
            await self.nack(late, f"HandlerTimeout: held {self.handler_timeout_s:g} s without ack or nack "
                                  "(infra.handler_timeout_s)")
            if self.on_expire is not None:
                self.on_expire(late)
        return late

    def _exhausted(self, entry_id: bytes, handled: int, error: str | None = None) -> str:
        last = error or self._errors.get(entry_id) or "none reported (its consumer stopped or died while handling it)"
        return f"MaxDeliveries: handled {handled} times without success (max_deliveries={self.max_deliveries}); " \
               f"last error: {last}"

    async def nack(self, deliveries: Iterable[Delivery[T]], error: BaseException | str) -> list[Delivery[T]]:
        """Report that handling these deliveries failed with `error`.

        Each is retried: left pending with a high idle time, so the group's next reclaim
        (this consumer's or another's) delivers it again, until it has been delivered
        `max_deliveries` times; then it goes to the dead-letter stream with the error and
        is acked. Returns the deliveries dead-lettered by this call.
        """
        deliveries = list(deliveries)
        if not deliveries:
            return []
        reason = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        if self.count_on_use:  # a failure is a use: one not started yet counts now, or it could loop for ever
            fresh = [d for d in deliveries if d.entry_id not in self._in_use]
            if fresh:
                await self.handling(fresh)
            self._in_use.difference_update(d.entry_id for d in deliveries)
        metrics.STREAM_MESSAGES_NACKED.labels(self.stream).inc(len(deliveries))
        self._held.difference_update(d.entry_id for d in deliveries)
        spent = [d for d in deliveries if d.deliveries >= self.max_deliveries]
        retry = [d.entry_id for d in deliveries if d.deliveries < self.max_deliveries]
        if retry:
            for i in retry:
                self._errors[i] = reason
                self._errors.move_to_end(i)
            while len(self._errors) > ERRORS_KEPT:
                self._errors.popitem(last=False)
            await self._call(lambda: self.client.xclaim(self.stream, self.group, self.consumer, 0, retry,
                                                        idle=PARKED_IDLE_MS, justid=True), f"XCLAIM {self.stream} (nack)")
            log.warning("%d entries of %s failed (%s); left for redelivery", len(retry), self.stream, reason)
        if spent:
            await self._dead_letter([(d.entry_id, {DATA_FIELD: d.raw}, self._exhausted(d.entry_id, d.deliveries, reason))
                                     for d in spent])
        return spent

    async def dead_letter(self, deliveries: Iterable[Delivery[T]], reason: str, expected: bool = False) -> None:
        """Move deliveries the caller can never use to the dead-letter stream now, and ack them.

        `reason` reads "Kind: detail"; the part before the first colon labels the
        dead-letter metric, so keep it to a fixed vocabulary (e.g. "NonFiniteLoss").
        `expected`: the run's own course set them aside (a synthetic-only task when sim-to-real
        switches to the real environment), logged at INFO rather than as an error.
        """
        deliveries = list(deliveries)
        if deliveries:
            await self._dead_letter([(d.entry_id, {DATA_FIELD: d.raw}, reason) for d in deliveries],
                                    logging.INFO if expected else logging.ERROR)

    async def _dead_letter(self, dead: list[tuple[bytes, dict, str]], level: int = logging.ERROR) -> None:
        async def op() -> None:
            pipe = self.client.pipeline(transaction=True)
            for entry_id, fields, reason in dead:
                pipe.xadd(self.dead_letters, {**fields, b"source_id": entry_id, b"error": reason.encode(),
                                              b"group": self.group.encode(), b"consumer": self.consumer.encode()})
            pipe.xack(self.stream, self.group, *[d[0] for d in dead])
            await pipe.execute()
        await self._call(op, f"dead-letter {self.stream}")
        for entry_id, _, reason in dead:
            self._held.discard(entry_id)
            self._in_use.discard(entry_id)
            self._errors.pop(entry_id, None)
            metrics.STREAM_DEAD_LETTERS.labels(self.stream, reason.split(":")[0]).inc()
            log.log(level, "dead-lettered an entry of %s: %s", self.stream, reason)

    async def ack(self, entry_ids: Iterable[bytes]) -> int:
        """Acknowledge entries the caller has used; returns how many were pending."""
        ids = list(entry_ids)
        if not ids:
            return 0
        n = await self._call(lambda: self.client.xack(self.stream, self.group, *ids), f"XACK {self.stream}")
        self._held.difference_update(ids)
        self._in_use.difference_update(ids)
        if self._errors:
            for i in ids:
                self._errors.pop(i, None)
        metrics.STREAM_MESSAGES_ACKED.labels(self.stream).inc(len(ids))
        await self._maybe_trim()
        return int(n)

    async def _maybe_trim(self) -> None:
        if self.trim_every_s is None:
            return
        now = asyncio.get_running_loop().time()
        if self._trimmed_at is not None and now - self._trimmed_at < self.trim_every_s:
            return
        self._trimmed_at = now
        try:
            await trim_acked(self.client, self.stream)
        except Exception as exc:  # housekeeping: the ack stands, the next one trims
            log.warning("trimming acked entries of %s failed: %s", self.stream, exc)
