"""Continuous batching over a transformers causal LM: the embedded engine's decode loop.

Owns the scheduling of generation requests onto one model: a worker thread that
prefills newly arrived prompts, merges them into the running batch and decodes one
token for every running sequence per step. A request that arrives while a batch is
decoding joins at the next step (it never waits for the batch to finish); a finished
or cancelled sequence leaves the batch at once.

The KV cache is one batched `DynamicCache`, left-padded: each row's padding is
masked out through the 2-D attention mask and positions come from the mask, so a
sequence produces the same greedy tokens alone or in a batch. Joining re-pads the
two caches to a common length; leaving selects the remaining rows and trims columns
that are padding in every row.

Departures from SGLang (whose API the server speaks):
- Log-probs are log-softmax of the *raw* logits (temperature 1, before top-p/top-k),
  i.e. SGLang's behaviour with SGLANG_RETURN_ORIGINAL_LOGPROB=1, which our SGLang
  launcher sets. SGLang's default returns the temperature-scaled ones; raw values
  are what a learner recomputes with a plain forward pass, so they are what the
  importance ratios need.
- Weight swaps drain: once a swap is requested no new sequence is admitted, the
  running ones finish on the old weights, then the model is replaced and admission
  resumes. Every token of a response therefore comes from one weight version, the
  one reported (SGLang likewise holds new requests while it updates weights).
- No prefix cache, no paged attention, no input-token log-probs.

Every tensor the loop creates (ids, masks, positions, the cache, per-request seeded
generators) lives on the model's device, so the same code serves on CPU or CUDA.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from infra.engine_sampling import sample_tokens
from infra.metrics import ENGINE_BATCH_SIZE, ENGINE_QUEUE_DEPTH

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A generation request that cannot be served as given (the server answers 400)."""


class EngineStopped(RuntimeError):
    """The engine stopped before the request finished (the server answers 503)."""


@dataclass
class SamplingParams:
    """SGLang's sampling parameters (the subset the embedded engine implements)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None

    # Accepted and ignored: they change nothing the embedded engine does.
    _IGNORED = frozenset({"no_stop_trim", "spaces_between_special_tokens", "n", "min_new_tokens",
                          "frequency_penalty", "presence_penalty", "repetition_penalty", "min_p"})

    @classmethod
    def from_dict(cls, raw: Any, default_max_new_tokens: int = 128) -> "SamplingParams":
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise RequestError(f"sampling_params must be an object, got {type(raw).__name__}")
        known = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos",
                 "skip_special_tokens", "sampling_seed", "seed"}
        unknown = set(raw) - known - cls._IGNORED
        if unknown:
            raise RequestError(f"unknown sampling_params: {', '.join(sorted(unknown))}")
        if raw.get("n", 1) not in (1, None):
            raise RequestError("sampling_params.n > 1 is not supported; send a batch of prompts instead")
        p = cls(max_new_tokens=default_max_new_tokens)
        p.max_new_tokens = _number(raw, "max_new_tokens", int, p.max_new_tokens, lo=0)
        p.temperature = _number(raw, "temperature", float, 1.0, lo=0.0)
        p.top_p = _number(raw, "top_p", float, 1.0, lo=0.0)
        if not 0.0 < p.top_p <= 1.0:
            raise RequestError(f"sampling_params.top_p must be in (0, 1], got {p.top_p}")
        p.top_k = _number(raw, "top_k", int, -1)
        if p.top_k == 0 or p.top_k < -1:
            raise RequestError(f"sampling_params.top_k must be -1 (off) or positive, got {p.top_k}")
        stop = raw.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError("sampling_params.stop must be a non-empty string or a list of them")
        p.stop = stop
        ids = raw.get("stop_token_ids") or []
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise RequestError("sampling_params.stop_token_ids must be a list of integers")
        p.stop_token_ids = ids
        for flag in ("ignore_eos", "skip_special_tokens"):
            if flag in raw:
                if not isinstance(raw[flag], bool):
                    raise RequestError(f"sampling_params.{flag} must be true or false")
                setattr(p, flag, raw[flag])
        seed = raw.get("sampling_seed", raw.get("seed"))
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise RequestError("sampling_params.sampling_seed must be an integer")
        p.seed = seed
        return p


def _number(raw: dict, key: str, typ: type, default: Any, lo: float | None = None) -> Any:
    value = raw.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (typ is int and not isinstance(value, int)):
        raise RequestError(f"sampling_params.{key} must be {'an integer' if typ is int else 'a number'}, got {value!r}")
    if lo is not None and value < lo:
        raise RequestError(f"sampling_params.{key} must be >= {lo}, got {value!r}")
    return typ(value)


@dataclass
class GenOutput:
    """One finished generation, in the engine's terms (the server maps it to SGLang's JSON)."""

    text: str
    output_ids: list[int]
    output_logprobs: list[float]
    token_ids_logprobs: list[dict[int, float]] | None
    finish_reason: dict
    prompt_tokens: int
    weight_version: int


@dataclass
class GenRequest:
    input_ids: list[int]
    params: SamplingParams
    token_ids_logprob: list[int] | None = None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    cancelled: bool = False
    # decode state
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tid_logprobs: list[dict[int, float]] = field(default_factory=list)
    generator: torch.Generator | None = None
    finish: dict | None = None
    text: str = ""

    def cancel(self) -> None:
        """Drop the sequence at the next step (the client went away)."""
        self.cancelled = True


class Batcher:
    """The decode loop. `submit` is thread-safe and returns a concurrent Future of GenOutput."""

    def __init__(self, model, tokenizer, max_batch_size: int = 16, weight_version: int = 0,
                 max_prefill_tokens: int = 4096):
        self.model = model
        self.device = _model_device(model)
        # Prompts prefilled together are padded to the longest; bound the padded block so a
        # burst of long Mexp prompts does not allocate attention for all of them at once.
        self.max_prefill_tokens = max_prefill_tokens
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self.eos_ids = _eos_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.max_positions = getattr(model.config, "max_position_embeddings", 1 << 30)
        self._queue: deque[GenRequest] = deque()
        self._cv = threading.Condition()
        self._swap: tuple[Any, int, concurrent.futures.Future] | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        # running batch
        self._running: list[GenRequest] = []
        self._cache = None
        self._mask: torch.Tensor | None = None  # [B, L] 1 = real token
        self._next: torch.Tensor | None = None  # [B] token to feed at the next step
        self.steps = 0
        self.max_batch_seen = 0
        self.requests_total = 0

    # --- public, any thread ---
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine-batcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for req in list(self._queue) + self._running:
            if not req.future.done():
                req.future.set_exception(EngineStopped("engine stopped"))

    def submit(self, req: GenRequest) -> concurrent.futures.Future:
        total = len(req.input_ids) + req.params.max_new_tokens
        if not req.input_ids:
            raise RequestError("empty prompt")
        if total > self.max_positions:
            raise RequestError(f"prompt ({len(req.input_ids)} tokens) + max_new_tokens ({req.params.max_new_tokens}) "
                               f"exceeds the model's context of {self.max_positions}")
        vocab = self.model.config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in req.input_ids):
            raise RequestError(f"input_ids must be integers in [0, {vocab})")
        if req.token_ids_logprob and any(t < 0 or t >= vocab for t in req.token_ids_logprob):
            raise RequestError(f"token_ids_logprob must be integers in [0, {vocab})")
        if req.params.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(req.params.seed)
        with self._cv:
            if self._stopping:
                raise EngineStopped("engine stopped")
            self._queue.append(req)
            self.requests_total += 1
            ENGINE_QUEUE_DEPTH.set(len(self._queue) + len(self._running))
            self._cv.notify_all()
        return req.future

    def swap_weights(self, model, version: int) -> concurrent.futures.Future:
        """Replace the model once the running sequences have finished; resolves to the new version."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._swap is not None:
                raise RequestError("a weight update is already in progress")
            self._swap = (model, version, fut)
            self._cv.notify_all()
        return fut

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
                admit: list[GenRequest] = []
                if self._swap is None:
                    longest = 0
                    while self._queue and len(self._running) + len(admit) < self.max_batch_size:
                        longest = max(longest, len(self._queue[0].input_ids))
                        if admit and longest * (len(admit) + 1) > self.max_prefill_tokens:
                            break  # the rest joins at the next step
                        admit.append(self._queue.popleft())
                elif not self._running:
                    model, version, fut = self._swap
                    self.model, self.weight_version, self._swap = model, version, None
                    self.device = _model_device(model)
                    fut.set_result(version)
                    log.info("engine now serves weight version %d", version)
                    continue
            try:
                self._drop_cancelled()
                admit = [r for r in admit if not self._finish_if_cancelled(r)]
                if admit:
                    self._prefill(admit)
                if self._running:
                    self._decode_step()
            except Exception as exc:  # a bug or OOM must fail the requests, not hang them
                log.exception("decode loop failed; failing %d running requests", len(self._running) + len(admit))
                for req in self._running + admit:
                    if not req.future.done():
                        req.future.set_exception(exc)
                self._running, self._cache, self._mask, self._next = [], None, None, None
            ENGINE_QUEUE_DEPTH.set(self.load)

    def _forward(self, input_ids: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1]:]
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         past_key_values=cache, use_cache=True)
        return out.logits[:, -1, :].float()

    def _prefill(self, reqs: list[GenRequest]) -> None:
        from transformers import DynamicCache

        n = max(len(r.input_ids) for r in reqs)
        ids = torch.full((len(reqs), n), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), n), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, n - len(r.input_ids):] = torch.tensor(r.input_ids)
            mask[i, n - len(r.input_ids):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)  # built on the host, one copy each
        cache = DynamicCache()
        logits = self._forward(ids, mask, cache)
        ENGINE_BATCH_SIZE.observe(len(reqs))
        keep = self._sample_and_advance(reqs, logits)
        if not keep:
            return
        sel = torch.tensor(keep, device=self.device)
        if len(keep) < len(reqs):
            cache.batch_select_indices(sel)
        new = [reqs[i] for i in keep]
        new_mask = mask[sel]
        new_next = torch.tensor([r.output_ids[-1] for r in new], device=self.device)
        if not self._running:
            self._running, self._cache, self._mask, self._next = new, cache, new_mask, new_next
        else:
            self._cache, self._mask = _merge(self._cache, self._mask, cache, new_mask)
            self._running = self._running + new
            self._next = torch.cat([self._next, new_next])
        self._trim()

    def _decode_step(self) -> None:
        self._mask = torch.cat([self._mask, torch.ones((len(self._running), 1), dtype=torch.long, device=self.device)], dim=1)
        logits = self._forward(self._next[:, None], self._mask, self._cache)
        self.steps += 1
        self.max_batch_seen = max(self.max_batch_seen, len(self._running))
        ENGINE_BATCH_SIZE.observe(len(self._running))
        keep = self._sample_and_advance(self._running, logits)
        self._next = torch.tensor([r.output_ids[-1] for r in self._running], device=self.device)
        self._select(keep)

    def _drop_cancelled(self) -> None:
        if not self._running:
            return
        keep = [i for i, r in enumerate(self._running) if not self._finish_if_cancelled(r)]
        if len(keep) < len(self._running):
            self._select(keep)

    def _finish_if_cancelled(self, req: GenRequest) -> bool:
        if req.cancelled:
            req.future.cancel()
            return True
        return False

    def _select(self, keep: list[int]) -> None:
        if len(keep) == len(self._running):
            return
        if not keep:
            self._running, self._cache, self._mask, self._next = [], None, None, None
            return
        sel = torch.tensor(keep, device=self.device)
        self._cache.batch_select_indices(sel)
        self._running = [self._running[i] for i in keep]
        self._mask = self._mask[sel]
        self._next = self._next[sel]
        self._trim()

    def _trim(self) -> None:
        """Drop leading cache columns that are padding in every row."""
        real = self._mask.any(dim=0).nonzero()
        start = int(real[0]) if len(real) else 0
        if start > 0:
            self._mask = self._mask[:, start:]
            for layer in self._cache.layers:
                layer.keys = layer.keys[:, :, start:, :]
                layer.values = layer.values[:, :, start:, :]

    def _sample_and_advance(self, reqs: list[GenRequest], logits: torch.Tensor) -> list[int]:
        """Sample one token per row, record it, finish rows that are done; returns the rows to keep."""
        logprobs = torch.log_softmax(logits, dim=-1)
        toks = sample_tokens(logits, [r.params.temperature for r in reqs], [r.params.top_p for r in reqs],
                             [r.params.top_k for r in reqs], [r.generator for r in reqs])
        chosen = logprobs.gather(1, torch.tensor(toks, device=logprobs.device)[:, None])[:, 0].tolist()
        keep = []
        for i, (req, tok) in enumerate(zip(reqs, toks)):
            req.output_ids.append(tok)
            req.logprobs.append(chosen[i])
            if req.token_ids_logprob:
                row = logprobs[i, req.token_ids_logprob].tolist()
                req.tid_logprobs.append(dict(zip(req.token_ids_logprob, row)))
            if self._check_finished(req, tok):
                self._complete(req)
            elif req.cancelled:
                req.future.cancel()
            else:
                keep.append(i)
        return keep

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
                        weight_version=self.weight_version)
        if not req.future.done():
            req.future.set_result(out)


def _model_device(model) -> torch.device:
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


def _merge(cache_a, mask_a: torch.Tensor, cache_b, mask_b: torch.Tensor):
    """Stack two left-padded batched caches into one, re-padding the shorter on the left."""
    from transformers import DynamicCache

    la, lb = mask_a.shape[1], mask_b.shape[1]
    n = max(la, lb)

    def pad(t: torch.Tensor, length: int) -> torch.Tensor:
        if length == n:
            return t
        shape = list(t.shape)
        shape[-2] = n - length
        return torch.cat([t.new_zeros(shape), t], dim=-2)

    layers = []
    for a, b in zip(cache_a.layers, cache_b.layers):
        layers.append((torch.cat([pad(a.keys, la), pad(b.keys, lb)]), torch.cat([pad(a.values, la), pad(b.values, lb)])))
    mask = torch.cat([torch.nn.functional.pad(mask_a, (n - la, 0)), torch.nn.functional.pad(mask_b, (n - lb, 0))])
    return DynamicCache(layers), mask


def generate_sync(batcher: Batcher, prompts: list[list[int]], params: SamplingParams, timeout: float = 600) -> list[GenOutput]:
    """Submit several prompts and wait (for scripts and tests that have no event loop)."""
    futs = [batcher.submit(GenRequest(list(p), params)) for p in prompts]
    t0 = time.monotonic()
    return [f.result(timeout=max(1.0, timeout - (time.monotonic() - t0))) for f in futs]
