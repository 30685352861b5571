"""The one async client for every inference engine (SGLang or the embedded engine).

Owns how rollout code reaches a model over HTTP: SGLang's native `/generate` (plus
`/health`, `/get_model_info`, `/update_weights_from_disk`), pooled aiohttp
connections, per-request timeouts, bounded retries with exponential backoff, and the
choice of server:
- a request with an `affinity_key` (an episode id) goes to the same server every time
  while that server is healthy (rendezvous hashing), so an episode's growing prompt
  hits that server's prefix cache;
- otherwise the server with the fewest requests in flight from this client;
- a server that fails a request (connection error, timeout, 5xx) is marked dead and
  skipped until a background probe of its `/health` passes (every
  `health_interval_s`); the failed request moves to another server (failover);
- a server that comes back is given the latest weights (if it missed an update)
  before it is used again, so a restart never serves an old policy.
A 4xx answer is the caller's fault and is raised at once as `EngineRequestError`,
except 429, and 503 with Retry-After: the server is busy, not broken, so the request
moves to another server that is not busy, or waits the Retry-After the server asked
for (1 s when a 429 names none) and tries again, until `timeout_s` has passed. These
waits do not count as failures. A 503 without Retry-After (an engine stopping) is a
failure like a 5xx: the server is marked dead and the request fails over.
With `api_key` every request carries `Authorization: Bearer <key>` (SGLang's --api-key).
`init_weights_update_group` and `update_weights_from_distributed` (learner.weight_sync=distributed)
go to every server, each its own request, with no failover: a weight-update group needs them all.

Prompts are plain text or token ids; callers apply chat templates themselves.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from infra.metrics import (ENGINE_GENERATED_TOKENS, ENGINE_REQUEST_SECONDS, ENGINE_REQUESTS, ENGINE_RETRY_AFTER_WAITS,
                           ENGINE_SERVER_FAILOVERS)

MAX_RETRY_AFTER_S = 60.0  # never sleep longer than this on one Retry-After

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """No server could answer the request within the retry budget."""


class EngineRequestError(EngineError):
    """The server rejected the request (4xx): retrying cannot help."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


@dataclass
class GenerateResult:
    text: str
    output_ids: list[int]
    output_logprobs: list[float]
    token_ids_logprobs: list[dict[int, float]] | None
    weight_version: int
    finish_reason: str
    prompt_tokens: int
    meta: dict = field(default_factory=dict)


def parse_generate_response(body: Any) -> GenerateResult:
    """SGLang's /generate JSON (one prompt) -> GenerateResult; raises EngineError on a wrong shape."""
    try:
        meta = body["meta_info"]
        ids = [int(t) for t in body.get("output_ids") or []]
        lps = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
        tid = meta.get("output_token_ids_logprobs")
        tid_lps = [{int(e[1]): float(e[0]) for e in row} for row in tid] if tid is not None else None
        if not ids and meta.get("output_token_logprobs"):
            ids = [int(entry[1]) for entry in meta["output_token_logprobs"]]
        fr = meta.get("finish_reason")
        finish = fr.get("type", "") if isinstance(fr, dict) else str(fr or "")
        return GenerateResult(text=body["text"], output_ids=ids, output_logprobs=lps, token_ids_logprobs=tid_lps,
                              weight_version=_version(meta.get("weight_version")), finish_reason=finish,
                              prompt_tokens=int(meta.get("prompt_tokens", 0)), meta=meta)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise EngineError(f"malformed /generate response ({exc!r}): {str(body)[:200]}") from None


def _version(v: Any) -> int:
    # SGLang reports a free-form string ("default" until the first update); ours is an int.
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


class _Server:
    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.healthy = True
        self.inflight = 0
        self.dead_since = 0.0


class EngineClient:
    """Async client over one or more SGLang-compatible servers. Use as `async with EngineClient([...]) as c:`."""

    def __init__(self, endpoints: list[str], role: str = "mexp", timeout_s: float = 300.0, max_retries: int = 3,
                 health_interval_s: float = 5.0, backoff_s: float = 0.2, api_key: str = ""):
        if not endpoints:
            raise ValueError("EngineClient needs at least one endpoint URL")
        self.servers = [_Server(u) for u in endpoints]
        self.role = role
        for counter in (ENGINE_SERVER_FAILOVERS, ENGINE_RETRY_AFTER_WAITS):
            counter.labels(role=role)  # a series at 0 from the start: rate() and increase() see the first event
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.health_interval_s = health_interval_s
        self.backoff_s = backoff_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None
        self._prober: asyncio.Task | None = None
        self._latest_weights: tuple[str, int] | None = None  # (path, version) of the last update

    @property
    def urls(self) -> list[str]:
        """The servers' base URLs (what another process needs to build its own client)."""
        return [s.url for s in self.servers]

    @classmethod
    def from_config(cls, cfg, endpoints: list[str], role: str) -> "EngineClient":
        return cls(endpoints, role, cfg.request_timeout_s, cfg.max_retries, cfg.health_interval_s,
                   api_key=cfg.api_key)

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=256, limit_per_host=64, keepalive_timeout=60),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s), headers=self._headers)
        return self._session

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            try:
                await self._prober
            except (asyncio.CancelledError, Exception):
                pass
            self._prober = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    # --- server choice ---
    def _pick(self, affinity_key: str | None, exclude: set[str]) -> _Server | None:
        live = [s for s in self.servers if s.healthy and s.url not in exclude]
        if not live:
            # every server is marked dead: try one anyway rather than fail without asking
            live = [s for s in self.servers if s.url not in exclude]
            if not live:
                return None
        if affinity_key is not None:
            # rendezvous hashing: the key keeps its server while that server lives
            return max(live, key=lambda s: hashlib.blake2b(f"{affinity_key}|{s.url}".encode(), digest_size=8).digest())
        least = min(s.inflight for s in live)
        return random.choice([s for s in live if s.inflight == least])

    def _mark_dead(self, server: _Server, why: str) -> None:
        if server.healthy:
            log.warning("engine %s marked dead (%s)", server.url, why)
        server.healthy = False
        server.dead_since = time.monotonic()
        if self._prober is None or self._prober.done():
            self._prober = asyncio.get_running_loop().create_task(self._probe_dead())

    async def _probe_dead(self) -> None:
        while any(not s.healthy for s in self.servers):
            await asyncio.sleep(self.health_interval_s)
            for s in [s for s in self.servers if not s.healthy]:
                if await self._health_one(s) and await self._catch_up(s):
                    log.info("engine %s healthy again", s.url)
                    s.healthy = True

    async def _health_one(self, s: _Server) -> bool:
        try:
            async with self._sess().get(s.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    # --- requests ---
    async def _post(self, path: str, payload: dict, affinity_key: str | None = None) -> Any:
        """POST with failover: each failed attempt goes to a server not yet tried (when there is one).

        A server that answers 429 (or 503 with Retry-After) is busy, not dead: the request
        goes to a server that is not busy, or, when all are, waits the Retry-After asked for.
        """
        tried: set[str] = set()
        busy: dict[str, float] = {}  # url -> when it said to come back
        last: Exception | None = None
        failures = 0
        deadline = time.monotonic() + self.timeout_s
        while True:
            server = (self._pick(affinity_key, tried | set(busy)) or self._pick(affinity_key, tried)
                      or self._pick(affinity_key, set()))
            if server.url in busy:  # every candidate is busy: wait for this one
                wait = busy.pop(server.url) - time.monotonic()
                if wait > 0:
                    if time.monotonic() + wait > deadline:
                        raise EngineError(f"{path}: every server is busy; Retry-After exceeds the {self.timeout_s:.0f} s "
                                          f"timeout: {last!r}")
                    ENGINE_RETRY_AFTER_WAITS.labels(role=self.role).inc()
                    await asyncio.sleep(wait)
            server.inflight += 1
            try:
                async with self._sess().post(server.url + path, json=payload) as r:
                    retry_after = _retry_after(r.headers.get("Retry-After"))
                    if r.status == 429 or (r.status == 503 and retry_after is not None):
                        last = EngineError(f"{server.url}{path}: HTTP {r.status}: {_message(await r.text())}")
                        busy[server.url] = time.monotonic() + (retry_after if retry_after is not None else 1.0)
                        continue
                    if 400 <= r.status < 500:
                        raise EngineRequestError(r.status, _message(await r.text()))
                    if r.status >= 500:
                        raise EngineError(f"{server.url}{path}: HTTP {r.status}: {_message(await r.text())}")
                    return await r.json(content_type=None)
            except EngineRequestError:
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, EngineError, ValueError) as exc:
                last = exc
                tried.add(server.url)
                self._mark_dead(server, f"{type(exc).__name__}: {exc}")
                failures += 1
                if failures > self.max_retries:
                    raise EngineError(f"{path} failed after {failures} attempts on {sorted(tried)}: {last!r}") from None
                ENGINE_SERVER_FAILOVERS.labels(role=self.role).inc()
                await asyncio.sleep(self.backoff_s * (2 ** (failures - 1)) * (0.5 + random.random()))
            finally:
                server.inflight -= 1

    async def generate(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
                       sampling_params: dict | None = None, return_logprob: bool = False,
                       token_ids_logprob: list[int] | None = None, affinity_key: str | None = None) -> GenerateResult:
        """One generation on the best server; see the module docstring for routing and retries."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        payload: dict[str, Any] = {"sampling_params": dict(sampling_params or {}), "return_logprob": bool(return_logprob)}
        if prompt is not None:
            payload["text"] = prompt
        else:
            payload["input_ids"] = list(input_ids)
        if token_ids_logprob is not None:
            payload["token_ids_logprob"] = list(token_ids_logprob)
        t0 = time.monotonic()
        try:
            body = await self._post("/generate", payload, affinity_key)
            result = parse_generate_response(body)
        except Exception:
            ENGINE_REQUESTS.labels(role=self.role, outcome="error").inc()
            raise
        ENGINE_REQUESTS.labels(role=self.role, outcome="ok").inc()
        ENGINE_REQUEST_SECONDS.labels(role=self.role).observe(time.monotonic() - t0)
        ENGINE_GENERATED_TOKENS.labels(role=self.role).inc(len(result.output_ids))
        return result

    async def score(self, prefix: list[int], continuations: list[list[int]], *,
                    affinity_key: str | None = None) -> tuple[list[list[float]], int]:
        """Log-probs of each continuation's tokens after `prefix`: (per continuation, weight version).

        One SGLang request: `input_ids` = prefix + continuation for each, `max_new_tokens` 0,
        `return_logprob` with `logprob_start_len` = len(prefix); the answer's
        `meta_info.input_token_logprobs` are [log-prob, token id, text] from that position on."""
        if not prefix or not continuations or any(not c for c in continuations):
            raise ValueError("score needs a non-empty prefix and non-empty continuations")
        payload = {"input_ids": [list(prefix) + list(c) for c in continuations],
                   "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
                   "return_logprob": True, "logprob_start_len": len(prefix)}
        t0 = time.monotonic()
        try:
            body = await self._post("/generate", payload, affinity_key)
            if not isinstance(body, list) or len(body) != len(continuations):
                raise EngineError(f"scoring answer: expected {len(continuations)} results, got {type(body).__name__}")
            rows, version = [], 0
            for c, item in zip(continuations, body):
                meta = item.get("meta_info", {}) if isinstance(item, dict) else {}
                lps = [e[0] for e in meta.get("input_token_logprobs") or []]
                if len(lps) != len(c) or any(not isinstance(v, (int, float)) for v in lps):
                    raise EngineError(f"scoring answer: {len(lps)} input log-probs for a {len(c)}-token continuation")
                rows.append([float(v) for v in lps])
                version = _version(meta.get("weight_version"))
        except Exception:
            ENGINE_REQUESTS.labels(role=self.role, outcome="error").inc()
            raise
        ENGINE_REQUESTS.labels(role=self.role, outcome="ok").inc()
        ENGINE_REQUEST_SECONDS.labels(role=self.role).observe(time.monotonic() - t0)
        return rows, version

    async def health(self) -> dict[str, bool]:
        """Probe every server now; updates which ones are used."""
        results = await asyncio.gather(*(self._health_one(s) for s in self.servers))
        for s, ok in zip(self.servers, results):
            if ok:
                s.healthy = True
            else:
                self._mark_dead(s, "health check failed")
        return {s.url: ok for s, ok in zip(self.servers, results)}

    async def model_info(self) -> dict:
        last: Exception | None = None
        for s in sorted(self.servers, key=lambda s: not s.healthy):
            try:
                async with self._sess().get(s.url + "/get_model_info") as r:
                    if r.status == 200:
                        return await r.json(content_type=None)
                    last = EngineError(f"{s.url}/get_model_info: HTTP {r.status}")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                last = exc
        raise EngineError(f"no server answered /get_model_info: {last!r}")

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> None:
        """Load `model_path` on every live server (SGLang's payload; its weight_version is a string).

        A server that cannot be reached is marked dead rather than failing the learner,
        and gets these weights before it is used again (see `_probe_dead`). Raises
        EngineError if no server took the update, or if a live server refused it.
        """
        self._latest_weights = (str(model_path), int(weight_version))
        results = await asyncio.gather(*(self._push_weights(s) for s in self.servers), return_exceptions=True)
        refused = [r for r in results if isinstance(r, EngineRequestError)]
        if refused or all(isinstance(r, Exception) for r in results):
            raise EngineError(f"weight update to {model_path} (version {weight_version}) failed: "
                              f"{[str(r) for r in results if isinstance(r, Exception)]}")

    async def _push_weights(self, s: _Server) -> None:
        path, version = self._latest_weights
        payload = {"model_path": path, "load_format": "auto", "weight_version": str(version)}
        try:
            async with self._sess().post(s.url + "/update_weights_from_disk", json=payload) as r:
                body = await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            self._mark_dead(s, f"weight update: {exc!r}")
            raise EngineError(f"{s.url}: unreachable for the weight update") from exc
        if r.status != 200 or not body.get("success", False):
            raise EngineRequestError(r.status, f"{s.url}: weight update to {path} refused: {body.get('message', body)}")

    async def init_weights_update_group(self, master_address: str, master_port: int, group_name: str,
                                        backend: str, ranks_per_server: int = 1) -> None:
        """SGLang's `/init_weights_update_group` on every server: the caller is rank 0 of 1 + N x R, server i
        ranks 1 + i x R .. (R = `ranks_per_server`: SGLang joins one rank per tensor-parallel GPU, at
        rank_offset + tp_rank). Each answer comes once the group has formed, so the caller joins meanwhile.
        Raises EngineError if a server did not join (the group cannot form without it)."""
        world = 1 + len(self.servers) * ranks_per_server
        await self._each("/init_weights_update_group", [
            {"master_address": master_address, "master_port": int(master_port), "rank_offset": 1 + i * ranks_per_server,
             "world_size": world, "group_name": group_name, "backend": backend} for i in range(len(self.servers))])

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str, weight_version: int) -> None:
        """SGLang's `/update_weights_from_distributed` on every server (each answers once it has received the
        broadcast of every named tensor, which the caller sends meanwhile). Raises EngineError on any refusal."""
        payload = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
                   "group_name": group_name, "flush_cache": True, "weight_version": str(weight_version)}
        await self._each("/update_weights_from_distributed", [payload] * len(self.servers))

    async def _each(self, path: str, payloads: list[dict]) -> None:
        """POST payloads[i] to server i (no failover: each call concerns that server); every one must succeed."""
        async def one(s: _Server, payload: dict) -> None:
            try:
                async with self._sess().post(s.url + path, json=payload) as r:
                    body = await r.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
                self._mark_dead(s, f"{path}: {exc!r}")
                raise EngineError(f"{s.url}{path}: unreachable: {exc!r}") from exc
            if r.status != 200 or not isinstance(body, dict) or not body.get("success", False):
                message = body.get("message", body) if isinstance(body, dict) else body
                raise EngineError(f"{s.url}{path}: HTTP {r.status}: {message}")

        results = await asyncio.gather(*(one(s, p) for s, p in zip(self.servers, payloads)), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise EngineError(f"{path} failed on {len(failed)} of {len(self.servers)} servers: "
                              f"{[str(f) for f in failed]}")

    async def catch_up(self) -> list[str]:
        """Push the latest published weights to every live server that serves another version: one that a
        supervisor restarted between two requests of this client (so it never looked dead here) serves what
        it was started with. The URLs pushed to; a server that fails is marked dead (and caught up later)."""
        if self._latest_weights is None:
            return []
        behind = [s for s in self.servers if s.healthy and await self._served_version(s) not in
                  (None, self._latest_weights[1])]
        results = await asyncio.gather(*(self._push_weights(s) for s in behind), return_exceptions=True)
        return [s.url for s, r in zip(behind, results) if not isinstance(r, Exception)]

    async def _served_version(self, s: _Server) -> int | None:
        """The weight version `s` reports; None when it cannot be asked."""
        try:
            async with self._sess().get(s.url + "/get_model_info", timeout=aiohttp.ClientTimeout(total=10)) as r:
                return _version((await r.json(content_type=None)).get("weight_version"))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            return None

    async def _catch_up(self, s: _Server) -> bool:
        """A server back from the dead gets the latest weights before it serves again."""
        if self._latest_weights is None:
            return True
        try:
            async with self._sess().get(s.url + "/get_model_info") as r:
                served = _version((await r.json(content_type=None)).get("weight_version"))
            if served != self._latest_weights[1]:
                log.info("engine %s serves weight version %d; pushing %d", s.url, served, self._latest_weights[1])
                await self._push_weights(s)
            return True
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, EngineError, ValueError) as exc:
            log.warning("engine %s is back but did not take the latest weights: %r", s.url, exc)
            return False


def _retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds form; an HTTP date counts as 1 s)."""
    if value is None:
        return None
    try:
        return min(MAX_RETRY_AFTER_S, max(0.1, float(value)))
    except ValueError:
        return 1.0


def _message(text: str) -> str:
    try:
        body = json.loads(text)
        err = body.get("error", body) if isinstance(body, dict) else body
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    except ValueError:
        return text[:500]
