"""Redis stream transport: the task stream (curriculum -> workers) and the trajectory
stream (workers -> learner).

Owns the delivery guarantees, nothing about what the messages mean:
- producers XADD with `MAXLEN ~` and pipeline batches;
- consumers read through a consumer group, first their own pending entries (so a
  restarted consumer with the same name resumes), then new ones;
- entries are XACKed only when the caller says it has used them;
- entries idle in a dead consumer's pending list are taken over with XAUTOCLAIM;
- entries that fail to decode are copied to a dead-letter stream with the reason,
  then acked, and counted: never dropped silently;
- every call retries connection errors with capped exponential backoff, and a
  group lost with a non-persistent Redis is recreated.

Delivery is at-least-once: a batch retried after a connection drop may be added
twice, and a reclaimed entry may have been half-used. Consumers that care dedupe
on the message's own id (Trajectory.trajectory_id).
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Generic, Iterable, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError, TimeoutError as RedisTimeoutError

from infra import metrics
from infra.config import redact_url
from infra.schema import SchemaError

log = logging.getLogger(__name__)

T = TypeVar("T")
DATA_FIELD = b"d"
RETRYABLE = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


def key(prefix: str, name: str) -> str:
    """Every Redis key of a run lives under one prefix."""
    return f"{prefix}:{name}"


def tasks_stream(prefix: str) -> str:
    return key(prefix, "tasks")


def trajectories_stream(prefix: str) -> str:
    return key(prefix, "trajectories")


def dead_letter_stream(stream: str) -> str:
    return f"{stream}:dead"


def connect(url: str, tls_ca: str = "") -> aioredis.Redis:
    """An async client for `url` (password, ACL user and rediss:// TLS as given)."""
    kwargs: dict[str, Any] = {"socket_connect_timeout": 5, "socket_keepalive": True, "health_check_interval": 15}
    if url.startswith("rediss://") and tls_ca:
        kwargs["ssl_ca_certs"] = tls_ca
        kwargs["ssl_cert_reqs"] = ssl.CERT_REQUIRED
    log.info("connecting to redis at %s", redact_url(url))
    return aioredis.from_url(url, **kwargs)


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
    """A decoded entry and the id to ack once it has been used."""

    entry_id: bytes
    message: T
    reclaimed: bool = False


class StreamConsumer(Generic[T]):
    """Reads one stream through a consumer group, decoding with `decode`.

    `read()` returns decoded deliveries; the caller acks them with `ack()` after use.
    Undecodable entries go to `<stream>:dead` with the error and are acked there and then.
    """

    def __init__(self, client: aioredis.Redis, stream: str, group: str, consumer: str,
                 decode: Callable[[bytes], T], reclaim_idle_ms: int = 30_000, reclaim_every: int = 10):
        self.client, self.stream, self.group, self.consumer = client, stream, group, consumer
        self.decode = decode
        self.reclaim_idle_ms = reclaim_idle_ms
        self.reclaim_every = reclaim_every
        self.dead_letters = dead_letter_stream(stream)
        self._reads = 0
        self._own_pending_done = False
        self._reclaim_cursor = b"0-0"

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
        entries: list[tuple[bytes, dict, bool]] = []
        if not self._own_pending_done:
            resp = await self._call(lambda: self.client.xreadgroup(
                self.group, self.consumer, {self.stream: "0"}, count=count), f"XREADGROUP {self.stream}")
            own = resp[0][1] if resp else []
            own = [(i, f) for i, f in own if f]  # trimmed entries come back with no fields
            if len(own) < count:
                self._own_pending_done = True
            entries += [(i, f, False) for i, f in own]
        self._reads += 1
        if not entries and (self._reads - 1) % self.reclaim_every == 0:
            entries += [(i, f, True) for i, f in await self.reclaim(count)]
        if not entries:
            resp = await self._call(lambda: self.client.xreadgroup(
                self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms), f"XREADGROUP {self.stream}")
            entries += [(i, f, False) for i, f in (resp[0][1] if resp else [])]
        metrics.STREAM_MESSAGES_READ.labels(self.stream).inc(len(entries))
        return await self._decode_all(entries)

    async def reclaim(self, count: int = 100) -> list[tuple[bytes, dict]]:
        """Take over entries idle longer than reclaim_idle_ms in any consumer's pending list."""
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
        if claimed:
            metrics.STREAM_MESSAGES_RECLAIMED.labels(self.stream).inc(len(claimed))
            log.info("reclaimed %d idle entries on %s", len(claimed), self.stream)
        return claimed

    async def _decode_all(self, entries: list[tuple[bytes, dict, bool]]) -> list[Delivery[T]]:
        out: list[Delivery[T]] = []
        dead: list[tuple[bytes, dict, str]] = []
        for entry_id, fields, reclaimed in entries:
            raw = fields.get(DATA_FIELD)
            try:
                if raw is None:
                    raise SchemaError(f"entry has no {DATA_FIELD!r} field")
                out.append(Delivery(entry_id, self.decode(raw), reclaimed))
            except SchemaError as exc:
                dead.append((entry_id, fields, f"{type(exc).__name__}: {exc}"))
        if dead:
            await self._dead_letter(dead)
        return out

    async def _dead_letter(self, dead: list[tuple[bytes, dict, str]]) -> None:
        async def op() -> None:
            pipe = self.client.pipeline(transaction=True)
            for entry_id, fields, reason in dead:
                pipe.xadd(self.dead_letters, {**fields, b"source_id": entry_id, b"error": reason.encode()})
            pipe.xack(self.stream, self.group, *[d[0] for d in dead])
            await pipe.execute()
        await self._call(op, f"dead-letter {self.stream}")
        for _, _, reason in dead:
            metrics.STREAM_DEAD_LETTERS.labels(self.stream, reason.split(":")[0]).inc()
            log.error("dead-lettered an entry of %s: %s", self.stream, reason)

    async def ack(self, entry_ids: Iterable[bytes]) -> int:
        """Acknowledge entries the caller has used; returns how many were pending."""
        ids = list(entry_ids)
        if not ids:
            return 0
        n = await self._call(lambda: self.client.xack(self.stream, self.group, *ids), f"XACK {self.stream}")
        metrics.STREAM_MESSAGES_ACKED.labels(self.stream).inc(len(ids))
        return int(n)


async def stream_status(client: aioredis.Redis, stream: str) -> dict:
    """Length, per-group pending counts and dead letters of one stream."""
    async def op() -> dict:
        length = await client.xlen(stream) if await client.exists(stream) else 0
        dead = dead_letter_stream(stream)
        dead_len = await client.xlen(dead) if await client.exists(dead) else 0
        groups = []
        if length or await client.exists(stream):
            for g in await client.xinfo_groups(stream):
                groups.append({"group": _s(g["name"]), "consumers": g["consumers"], "pending": g["pending"],
                               "lag": g.get("lag")})
        return {"stream": stream, "length": length, "dead_letters": dead_len, "groups": groups}
    return await with_retry(op, f"status {stream}", deadline_s=10)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
