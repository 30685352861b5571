"""Continuous batching over a transformers causal LM: the embedded engine's decode loop.

Owns the scheduling of generation requests onto one model: a worker thread that
admits queued prompts, prefills them, and decodes one token for every running
sequence per step. A request that arrives while a batch is decoding joins at the
next step (it never waits for the batch to finish); a finished or cancelled
sequence leaves the batch at once.

Memory: the running batch lives in one preallocated `SlotCache` (infra/engine_kv.py):
a row per sequence, columns shared and left-padded, keys and values written in place,
positions kept per row on the device. A decode step is one forward over the batch's
next tokens with a 4-D mask that is a view of the cache's mask; nothing is
concatenated or re-allocated per step. Prompts that start with a cached prefix
(infra/engine_prefix_cache.py) get its KV copied into their row and prefill only
the rest; every prefilled prompt and every finished sequence is offered to that
cache. Requests in one admission round that share a long prefix not cached yet are
staggered by one step, so the first one's prefill fills the cache for the others
(SGLang's in-batch prefix caching does the same).

Speculation (`speculative_tokens` > 0): a step feeds each greedy row its next token and up
to k prompt-lookup drafts (infra/engine/speculation.py) in one forward of k + 1 columns; a row
keeps the drafts its greedy choices agree with, and the cells of the rest are masked off, so a
row's tokens may sit in non-adjacent columns (`SlotCache.live_columns` finds them for the prefix
cache). Sampled rows ride along with no drafts. Outputs are the greedy outputs.

On a GPU the other steps replay CUDA graphs, one per batch-size bucket (`decode_graphs='cuda'`,
engines.cuda_graphs; infra/engine/decode_graph.py says how their step departs from this one).

Isolation: a request that fails alone (its sampling, its prefill) fails alone: the
others in the batch go on. Only a failure of the batched decode forward fails every
running request. The queue is bounded (`max_queue`): beyond it `submit` raises
`QueueFull`, which the server answers 429 with Retry-After.

Departures from SGLang (whose API the server speaks):
- Log-probs are log-softmax of the *raw* logits (temperature 1, before top-p/top-k),
  i.e. SGLang's behaviour with SGLANG_RETURN_ORIGINAL_LOGPROB=1, which our SGLang
  launcher sets. SGLang's default returns the temperature-scaled ones; raw values
  are what a learner recomputes with a plain forward pass, so they are what the
  importance ratios need.
- Weight swaps drain: once a swap is requested no new sequence is admitted, the
  running ones finish on the old weights, then the model is replaced, the prefix
  cache is cleared and admission resumes. Every token of a response therefore comes
  from one weight version, the one reported (SGLang likewise holds new requests while
  it updates weights).
- No paged attention, no input-token log-probs; a prefix hit is copied, not shared.

Every tensor the loop creates (ids, masks, positions, the cache, per-request seeded
generators) lives on the model's device, so the same code serves on CPU or CUDA.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from typing import Any

import torch

from infra.engine.decode_graph import DecodeGraphs
from infra.engine.kv import SlotCache, cache_arg, kv_bytes_per_token, kv_geometry
from infra.engine.prefix_cache import PrefixCache, common_prefix_length
from infra.engine.request import (EngineStopped, GenOutput, GenRequest, QueueFull, RequestError, RequestFailed,
                                  SamplingParams)
from infra.engine.sampling import sample_tokens
from infra.engine.scorer import Scorer, batch_budget, use_threads
from infra.engine.speculation import NgramIndex, accepted
from infra.metrics import EngineServerMetrics

__all__ = ["Batcher", "EngineStopped", "GenOutput", "GenRequest", "QueueFull", "RequestError", "RequestFailed",
           "SamplingParams", "generate_sync"]

log = logging.getLogger(__name__)

# A request whose prompt shares at least this many more tokens with one admitted in
# the same round than the prefix cache holds waits one step for that one's prefill.
STAGGER_MIN_TOKENS = 16


class Batcher:
    """The decode loop. `submit` is thread-safe and returns a concurrent Future of GenOutput."""

    def __init__(self, model, tokenizer, max_batch_size: int = 16, weight_version: int = 0,
                 max_prefill_tokens: int = 4096, prefix_cache_mb: float = 0.0, max_queue: int = 1024,
                 metrics: EngineServerMetrics | None = None, score_batch_tokens: int = -1,
                 speculative_tokens: int = 0, threads: int = 0, decode_graphs: str = "off", score_cache_mb: float = 0.0):
        self.model = model
        # Torch threads of the decode and scoring threads (0: as the starting thread had them); set_threads.
        self.threads = threads
        self.threads_in_force = 0  # as the decode thread's last round found them
        # Prompt-lookup drafts verified per greedy row and step (infra/engine/speculation.py); 0 = off.
        self.speculative_tokens = speculative_tokens
        # This engine's own registry: an engine exports its queue, never another's (infra/metrics.py).
        self.metrics = metrics if metrics is not None else EngineServerMetrics()
        self.metrics.weight_version.set(weight_version)
        self.device = model_device(model)
        # Prompts prefilled together are padded to the longest; bound the padded block so a
        # burst of long Mexp prompts does not allocate attention for all of them at once.
        self.max_prefill_tokens = max_prefill_tokens
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.weight_version = weight_version
        self.eos_ids = _eos_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.max_positions = getattr(model.config, "max_position_embeddings", 1 << 30)
        self._queue: deque[GenRequest] = deque()
        self._cv = threading.Condition()
        self._swap: tuple[Any, int, Any] | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._running: list[GenRequest] = []  # row i of the slot cache is _running[i]
        self._slots: SlotCache | None = None
        self._next: torch.Tensor | None = None  # [n] token each row feeds at the next step
        self.prefix_cache = PrefixCache(int(prefix_cache_mb * 2 ** 20), kv_bytes_per_token(model))
        # Plain decode steps as CUDA graphs per batch bucket ('cuda'), or their static step run eagerly ('eager').
        self.graphs = (DecodeGraphs(model, self.pad_id, max_batch_size, decode_graphs, self.metrics)
                       if decode_graphs != "off" else None)
        self.steps = 0
        self.max_batch_seen = 0
        self.requests_total = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        # Scoring requests, beside the loop: padded batches on a GPU, token trees (and a prompt cache) on a CPU.
        self.scorer = Scorer(self._serving, batch_budget(score_batch_tokens, self.device), tree=self.device.type == "cpu",
                             cache_bytes=int(score_cache_mb * 2 ** 20), on_cached=self.metrics.score_cached_tokens.inc)
        self.scorer.threads = threads

    # --- public, any thread ---
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine-batcher", daemon=True)
        self._thread.start()
        self.scorer.start()

    def set_threads(self, threads: int) -> None:
        """Torch intra-op threads of this engine's decode and scoring threads from their next round on
        (a CPU engine: more while it computes alone, as during an evaluation; fewer beside other engines)."""
        self.threads = self.scorer.threads = threads

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.scorer.stop()
        for req in list(self._queue) + self._running:
            req.fail(EngineStopped("engine stopped"))

    def check(self, req: GenRequest) -> None:
        """Raise RequestError if `req` can never be served (the server checks before queueing anything)."""
        total = len(req.input_ids) + req.params.max_new_tokens
        if not req.input_ids:
            raise RequestError("empty prompt")
        if total > self.max_positions:
            raise RequestError(f"prompt ({len(req.input_ids)} tokens) + max_new_tokens ({req.params.max_new_tokens}) "
                               f"exceeds the model's context of {self.max_positions}")
        vocab = self.model.config.vocab_size
        if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 or t >= vocab for t in req.input_ids):
            raise RequestError(f"input_ids must be integers in [0, {vocab})")
        if req.token_ids_logprob and any(not isinstance(t, int) or t < 0 or t >= vocab for t in req.token_ids_logprob):
            raise RequestError(f"token_ids_logprob must be integers in [0, {vocab})")

    def submit_many(self, reqs: list[GenRequest]) -> list:
        """Queue all of `reqs` or none (QueueFull when they do not fit, RequestError when one is invalid)."""
        for req in reqs:
            self.check(req)
        for req in reqs:
            if req.params.seed is not None and req.generator is None:
                req.generator = torch.Generator(device=self.device).manual_seed(req.params.seed)
        with self._cv:
            if self._stopping:
                raise EngineStopped("engine stopped")
            if len(self._queue) + len(reqs) > self.max_queue:
                raise QueueFull(f"engine queue full ({len(self._queue)} waiting, limit {self.max_queue})",
                                retry_after=self._retry_after())
            self._queue.extend(reqs)
            self.requests_total += len(reqs)
            self.metrics.queue_depth.set(len(self._queue) + len(self._running))
            self._cv.notify_all()
        return [r.future for r in reqs]

    def submit(self, req: GenRequest):
        return self.submit_many([req])[0]

    def _retry_after(self) -> float:
        # about the time the running batch takes to make room: a few decode steps per queued batch
        return float(max(1, min(30, round(len(self._queue) / max(1, self.max_batch_size)))))

    def swap_weights(self, model, version: int):
        """Replace the model once the running sequences have finished; resolves to the new version."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._swap is not None:
                raise RequestError("a weight update is already in progress")
            self._swap = (model, version, fut)
            self._cv.notify_all()
        return fut

    def submit_score(self, prompts: list[list[int]], start: int) -> concurrent.futures.Future:
        """Queue a scoring request; its future gives, for each prompt, log p(token) at positions
        `start`.. given everything before it, and the weight version they came from. Prompts that
        share their first `start` tokens run that prefix once; requests waiting together run in one
        batch (infra/engine/scorer.py), beside the decode loop, on the model being served then."""
        if start < 1:
            raise RequestError("logprob_start_len must be at least 1 for prefill log-probs")
        for p in prompts:
            if len(p) <= start:
                raise RequestError(f"a prompt of {len(p)} tokens has nothing at or after logprob_start_len={start}")
            if len(p) > self.max_positions:
                raise RequestError(f"prompt of {len(p)} tokens exceeds the model's {self.max_positions} positions")
        future = self.scorer.submit(prompts, start)
        tokens = sum(len(p) for p in prompts)
        with self._cv:  # the decode loop's thread updates the same counters
            self.requests_total += len(prompts)
            self.prompt_tokens_total += tokens
        self.metrics.prompt_tokens.inc(tokens)  # /metrics counts scored prompts too
        return future

    def _serving(self) -> tuple[Any, int]:
        with self._cv:
            return self.model, self.weight_version

    @property
    def load(self) -> int:
        return len(self._queue) + len(self._running)

    # --- the worker thread ---
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while not self._stopping and not self._queue and not self._running and self._swap is None:
                    self._cv.wait()
                if self._stopping:
                    return
                if self._swap is not None and not self._running:
                    self._do_swap()
                    continue
                admit = self._admit() if self._swap is None else []
            self.threads_in_force = use_threads(self.threads)
            try:
                self._drop_cancelled()
                admit = [r for r in admit if not _finish_if_cancelled(r)]
                if admit:
                    self._prefill(admit)
                if self._running:
                    self._decode_step()
            except Exception as exc:  # the batched forward failed: a bug or OOM; fail what it held
                log.exception("decode step failed; failing %d running requests", len(self._running))
                for req in self._running:
                    req.fail(RequestFailed(f"decode step failed: {exc!r}"))
                self._running, self._next = [], None
                if self._slots is not None:
                    self._slots.reset()
            self.metrics.queue_depth.set(self.load)

    def _do_swap(self) -> None:
        model, version, fut = self._swap
        self.model, self.weight_version, self._swap = model, version, None
        self.metrics.weight_version.set(version)
        self.device = model_device(model)
        self._slots = None  # shapes or dtype may differ
        if self.graphs is not None:
            self.graphs.reset(model)
        self.prefix_cache = PrefixCache(self.prefix_cache.budget_bytes, kv_bytes_per_token(model))
        self.metrics.prefix_cache_bytes.set(0)
        fut.set_result(version)
        log.info("engine now serves weight version %d", version)

    def _admit(self) -> list[GenRequest]:
        """Pop the requests to prefill this round (called under the lock); each gets its prefix-cache match."""
        admit: list[GenRequest] = []
        width = 0  # widest uncached suffix among the admitted: the prefill block's width
        while self._queue and len(self._running) + len(admit) < self.max_batch_size:
            req = self._queue[0]
            ids = req.input_ids
            m, pieces = self.prefix_cache.match(ids, limit=len(ids) - 1)
            if admit and self.prefix_cache.enabled and any(
                    _shared(a.input_ids, ids, len(ids) - 1) >= m + STAGGER_MIN_TOKENS for a in admit):
                break  # let the first one's prefill fill the cache for this one
            w = max(width, len(ids) - m)
            if admit and w * (len(admit) + 1) > self.max_prefill_tokens:
                break  # the rest joins at the next step
            self._queue.popleft()
            req.cached_tokens, req._pieces = m, pieces  # type: ignore[attr-defined]
            admit.append(req)
            width = w
        return admit

    def _slot_cache(self) -> SlotCache:
        if self._slots is None:
            layers, kv_heads, dim, dtype = kv_geometry(self.model)
            self._slots = SlotCache(layers, kv_heads, dim, self.max_batch_size, dtype, self.device)
        return self._slots

    def _forward(self, ids: torch.Tensor, mask4d: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=mask4d, position_ids=positions, **cache_arg(self._slots),
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :].float()

    def _prefill(self, reqs: list[GenRequest]) -> None:
        """Prefill `reqs` into new rows after the running ones; a failure fails these requests only."""
        slots = self._slot_cache()
        n, k = slots.n, len(reqs)
        lens = [len(r.input_ids) for r in reqs]
        width = max(t - r.cached_tokens for t, r in zip(lens, reqs))  # query block: columns end-width..end-1
        try:
            slots.make_room(max(lens))
            end, lo = slots.end, slots.end - max(lens)
            ids = torch.full((k, width), self.pad_id, dtype=torch.long)
            rel = torch.arange(width)
            positions = torch.empty((k, width), dtype=torch.long)
            for i, (r, t) in enumerate(zip(reqs, lens)):
                row = n + i
                r.cached_tokens = max(0, min(r.cached_tokens, t - width))  # the part of the hit actually used
                tail = r.input_ids[max(0, t - width):]
                ids[i, width - len(tail):] = torch.tensor(tail)
                positions[i] = (rel + (t - width)).clamp(min=0)
                slots.mask[row].zero_()
                slots.mask[row, end - t:end] = True
                slots.pos[row] = t
                if t > width:  # the cached prefix that precedes the query block
                    slots.put(row, end - t, r._pieces, t - width)  # type: ignore[attr-defined]
                r._pieces = None  # type: ignore[attr-defined]
            ids, positions = ids.to(self.device), positions.to(self.device)
            cols = torch.arange(end - lo, device=self.device)
            qcol = torch.arange(width, device=self.device) + (end - width - lo)
            causal = cols[None, :] <= qcol[:, None]
            own = cols[None, :] == qcol[:, None]  # a padding query attends to itself: no empty softmax row
            mask4d = ((slots.mask[n:n + k, lo:end][:, None, :] & causal[None]) | own[None])[:, None]
            slots.window(n, n + k, end - width, end, lo)
            logits = self._forward(ids, mask4d, positions)
        except Exception as exc:
            log.exception("prefill of %d requests failed; the running batch goes on", k)
            for r in reqs:
                r.fail(RequestFailed(f"prefill failed: {exc!r}"))
            return
        self.metrics.batch_size.observe(k)
        cached = sum(r.cached_tokens for r in reqs)
        self.prompt_tokens_total += sum(lens)
        self.cached_tokens_total += cached
        self.metrics.prompt_tokens.inc(sum(lens))
        self.metrics.prefix_cached_tokens.inc(cached)
        for i, (r, t) in enumerate(zip(reqs, lens)):
            self._remember(n + i, r.input_ids, end)
        slots.n = n + k
        slots.start = min(slots.start if n else end, lo)
        self._running = self._running + reqs
        keep = self._sample_and_advance(list(range(n, n + k)), logits, insert=False)
        self._next_tokens()
        self._keep(list(range(n)) + keep)

    def _decode_step(self) -> None:
        drafts = self._drafts() if self.speculative_tokens else None
        if drafts is not None and any(drafts):
            self._speculative_step(drafts)
            return
        slots = self._slots
        n = slots.n
        slots.ensure_free_column()
        end = slots.end
        slots.mask[:n, end] = True
        logits = self.graphs.step(slots, self._next, n) if self.graphs is not None else None
        if logits is None:  # eager: the live window only
            slots.window(0, n, end, end + 1, slots.start)
            logits = self._forward(self._next[:, None], slots.mask[:n, None, None, slots.start:end + 1], slots.pos[:n, None])
        slots.pos[:n] += 1
        slots.end = end + 1
        self._count_step(n)
        keep = self._sample_and_advance(list(range(n)), logits, insert=True)
        self._next_tokens()
        self._keep(keep)

    def _count_step(self, n: int) -> None:
        self.steps += 1
        self.max_batch_seen = max(self.max_batch_seen, n)
        self.metrics.batch_size.observe(n)

    def _remember(self, row: int, seq: list[int], end: int) -> None:
        """Offer the KV of `seq`, held by `row` in its first live columns before `end`, to the prefix cache."""
        if not self.prefix_cache.enabled:
            return
        cols = self._slots.live_columns(row, end)[:len(seq)]
        self.prefix_cache.insert(seq, lambda a, b: self._slots.take(row, cols[a:b]))
        self.metrics.prefix_cache_bytes.set(self.prefix_cache.bytes)

    def _drafts(self) -> list[list[int]]:
        """Each running row's prompt-lookup drafts: none for a sampled (non-greedy) row or one about to end."""
        out: list[list[int]] = []
        for req in self._running:
            p = req.params
            room = p.max_new_tokens - len(req.output_ids) - 1
            if (p.temperature != 0.0 and p.top_k != 1) or room <= 0:
                out.append([])
                continue
            if req.ngrams is None:
                req.ngrams = NgramIndex(req.input_ids)
            req.ngrams.extend(req.output_ids[len(req.ngrams) - len(req.input_ids):])
            out.append(req.ngrams.propose(min(self.speculative_tokens, room)))
        return out

    def _speculative_step(self, drafts: list[list[int]]) -> None:
        """One forward over each row's next token and its drafts; keep the drafts the model agrees with.

        Every row writes k + 1 columns; a row that accepts j drafts keeps j + 1 of them and masks
        the rest off (holes that attention skips), and takes the model's token after the last
        accepted draft as its next token. Greedy rows therefore emit exactly their greedy output."""
        slots, k = self._slots, self.speculative_tokens
        n = slots.n
        slots.ensure_free_column(k + 1)
        end, lo = slots.end, slots.start
        ids = torch.full((n, k + 1), self.pad_id, dtype=torch.long)
        for i, (req, d) in enumerate(zip(self._running, drafts)):
            ids[i, 0] = req.output_ids[-1]
            ids[i, 1:1 + len(d)] = torch.tensor(d, dtype=torch.long)
        slots.mask[:n, end:end + k + 1] = True
        cols = torch.arange(end + k + 1 - lo, device=self.device)
        qcol = torch.arange(k + 1, device=self.device) + (end - lo)
        mask4d = (slots.mask[:n, lo:end + k + 1][:, None, :] & (cols[None, :] <= qcol[:, None])[None])[:, None]
        positions = slots.pos[:n, None] + torch.arange(k + 1, device=self.device)
        slots.window(0, n, end, end + k + 1, lo)
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask4d, position_ids=positions,
                         use_cache=True, logits_to_keep=k + 1, **cache_arg(slots))
        logits = out.logits.float()  # [n, k + 1, vocab]
        greedy = logits.argmax(dim=-1).tolist()
        acc = [accepted(g, d) for g, d in zip(greedy, drafts)]
        for i, j in enumerate(acc):
            slots.mask[i, end + 1 + j:end + k + 1] = False  # rejected drafts' KV
        slots.pos[:n] += torch.tensor(acc, device=self.device) + 1
        slots.end = end + k + 1
        self._count_step(n)
        self.metrics.draft_tokens.inc(sum(len(d) for d in drafts))
        self.metrics.accepted_tokens.inc(sum(acc))
        rows = torch.arange(n, device=self.device)
        at = torch.tensor(acc, device=self.device)
        nxt = self._sample(self._running, logits[rows, at])
        logprobs = torch.log_softmax(logits, dim=-1)
        toks = [d[:j] + [t] if t is not None else [] for d, j, t in zip(drafts, acc, nxt)]
        at_row = [i for i, ts in enumerate(toks) for _ in ts]
        at_pos = [p for ts in toks for p in range(len(ts))]
        flat = logprobs[at_row, at_pos, [t for ts in toks for t in ts]].tolist()  # one gather for every row
        keep, offset = [], 0
        for i, req in enumerate(self._running):
            got, offset = flat[offset:offset + len(toks[i])], offset + len(toks[i])
            if nxt[i] is None:
                continue  # failed alone (its future holds the error)
            done = False
            for t, (tok, lp) in enumerate(zip(toks[i], got)):
                req.output_ids.append(tok)
                req.logprobs.append(lp)
                if req.token_ids_logprob:
                    req.tid_logprobs.append(dict(zip(req.token_ids_logprob, logprobs[i, t, req.token_ids_logprob].tolist())))
                if self._check_finished(req, tok):
                    done = True
                    break
            if done:
                self._remember(i, req.input_ids + req.output_ids[:-1], slots.end)
                self._complete(req)
            elif req.cancelled:
                req.future.cancel()
            else:
                keep.append(i)
        self._next_tokens()
        self._keep(keep)

    def _next_tokens(self) -> None:
        self._next = torch.tensor([r.output_ids[-1] if r.output_ids else self.pad_id for r in self._running],
                                  device=self.device)

    def _keep(self, rows: list[int]) -> None:
        """Keep the running rows `rows` (ascending); the others have finished, failed or been cancelled."""
        if len(rows) == len(self._running):
            return
        self._slots.keep_rows(rows)
        self._running = [self._running[i] for i in rows]
        self._next = self._next[torch.tensor(rows, dtype=torch.long, device=self.device)] if rows else None

    def _drop_cancelled(self) -> None:
        if self._running:
            self._keep([i for i, r in enumerate(self._running) if not _finish_if_cancelled(r)])

    def _sample_and_advance(self, rows: list[int], logits: torch.Tensor, insert: bool) -> list[int]:
        """Sample one token for each of `rows` (logits row j is rows[j]); returns the rows that go on."""
        reqs = [self._running[i] for i in rows]
        logprobs = torch.log_softmax(logits, dim=-1)
        toks = self._sample(reqs, logits)
        ok = [j for j, t in enumerate(toks) if t is not None]
        chosen = [0.0] * len(reqs)
        if ok:
            idx = torch.tensor(ok, device=logprobs.device)
            got = logprobs[idx].gather(1, torch.tensor([toks[j] for j in ok], device=logprobs.device)[:, None])
            for j, v in zip(ok, got[:, 0].tolist()):
                chosen[j] = v
        keep = []
        for j, (row, req, tok) in enumerate(zip(rows, reqs, toks)):
            if tok is None:
                continue  # failed alone (its future holds the error)
            req.output_ids.append(tok)
            req.logprobs.append(chosen[j])
            if req.token_ids_logprob:
                req.tid_logprobs.append(dict(zip(req.token_ids_logprob, logprobs[j, req.token_ids_logprob].tolist())))
            if self._check_finished(req, tok):
                if insert:
                    self._remember(row, req.input_ids + req.output_ids[:-1], self._slots.end)
                self._complete(req)
            elif req.cancelled:
                req.future.cancel()
            else:
                keep.append(row)
        return keep

    def _sample(self, reqs: list[GenRequest], logits: torch.Tensor) -> list[int | None]:
        """One token per request; a request whose sampling fails gets None and fails alone."""
        args = ([r.params.temperature for r in reqs], [r.params.top_p for r in reqs], [r.params.top_k for r in reqs],
                [r.generator for r in reqs])
        try:
            return list(sample_tokens(logits, *args))
        except Exception:
            pass  # find the culprit: one row at a time
        out: list[int | None] = []
        for j, req in enumerate(reqs):
            try:
                out.append(sample_tokens(logits[j:j + 1], *([a[j]] for a in args))[0])
            except Exception as exc:
                log.warning("sampling failed for one request (%r); the batch goes on", exc)
                req.fail(RequestFailed(f"sampling failed: {exc!r}"))
                out.append(None)
        return out

    def _check_finished(self, req: GenRequest, tok: int) -> bool:
        p = req.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            req.finish = {"type": "stop", "matched": tok}
        if p.stop:
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=p.skip_special_tokens)
            hits = [(text.find(s), s) for s in p.stop if s in text]
            if hits:
                idx, s = min(hits)
                req.text = text[:idx]
                req.finish = {"type": "stop", "matched": s}
                return True
        if req.finish is None and len(req.output_ids) >= p.max_new_tokens:
            req.finish = {"type": "length", "length": p.max_new_tokens}
        return req.finish is not None

    def _complete(self, req: GenRequest) -> None:
        if req.finish.get("type") != "stop" or not isinstance(req.finish.get("matched"), str):
            req.text = self.tokenizer.decode(req.output_ids, skip_special_tokens=req.params.skip_special_tokens)
        out = GenOutput(text=req.text, output_ids=list(req.output_ids), output_logprobs=list(req.logprobs),
                        token_ids_logprobs=list(req.tid_logprobs) if req.token_ids_logprob else None,
                        finish_reason=req.finish, prompt_tokens=len(req.input_ids),
                        weight_version=self.weight_version, cached_tokens=req.cached_tokens)
        if not req.future.done():
            req.future.set_result(out)


def _finish_if_cancelled(req: GenRequest) -> bool:
    if req.cancelled:
        req.future.cancel()
        return True
    return False


def _shared(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of a and b, at most `limit`."""
    return common_prefix_length(a[:limit], b[:limit])


def model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for v in (getattr(model.generation_config, "eos_token_id", None) if getattr(model, "generation_config", None) else None,
              model.config.eos_token_id, tokenizer.eos_token_id):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return ids


def generate_sync(batcher: Batcher, prompts: list[list[int]], params: SamplingParams, timeout: float = 600) -> list[GenOutput]:
    """Submit several prompts and wait (for scripts and tests that have no event loop)."""
    futs = [batcher.submit(GenRequest(list(p), params)) for p in prompts]
    t0 = time.monotonic()
    return [f.result(timeout=max(1.0, timeout - (time.monotonic() - t0))) for f in futs]
