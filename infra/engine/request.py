"""What one generation request to the embedded engine is: its sampling parameters, its state, its result, its errors.

Owns the validation of SGLang's `sampling_params` (the subset the embedded engine
implements) and the typed errors the HTTP face maps to status codes:
`RequestError` 400, `QueueFull` 429 with Retry-After, `EngineStopped` 503,
`RequestFailed` 500 for one request that failed inside the decode loop while the
others went on.

As in SGLang, a temperature below 1e-5 means greedy (dividing logits by 1e-45 would
overflow to inf and poison the sampler). Values must be finite: JSON allows NaN and
Infinity literals, and one of them must fail its own request with a 400, not the batch.
"""

from __future__ import annotations

import concurrent.futures
import math
from dataclasses import dataclass, field
from typing import Any

import torch

GREEDY_BELOW = 1e-5  # SGLang: temperature < 1e-5 is greedy
MAX_SEED = 2 ** 63 - 1  # seeds are int64 everywhere (torch generators, SGLang)


class RequestError(ValueError):
    """A generation request that cannot be served as given (the server answers 400)."""


class EngineStopped(RuntimeError):
    """The engine stopped before the request finished (the server answers 503)."""


class QueueFull(RuntimeError):
    """The engine's queue is full; try again in `retry_after` seconds (the server answers 429)."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class RequestFailed(RuntimeError):
    """This request failed inside the decode loop; the rest of the batch went on (the server answers 500)."""


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
        for key in cls._IGNORED & set(raw):
            if isinstance(raw[key], float) and not math.isfinite(raw[key]):
                raise RequestError(f"sampling_params.{key} must be finite, got {raw[key]!r}")
        p = cls(max_new_tokens=default_max_new_tokens)
        p.max_new_tokens = _number(raw, "max_new_tokens", int, p.max_new_tokens, lo=0)
        p.temperature = _number(raw, "temperature", float, 1.0, lo=0.0)
        if p.temperature < GREEDY_BELOW:
            p.temperature = 0.0
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
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED):
            raise RequestError(f"sampling_params.sampling_seed must be an integer in [0, 2**63 - 1], got {seed!r}")
        p.seed = seed
        return p


def _number(raw: dict, key: str, typ: type, default: Any, lo: float | None = None) -> Any:
    value = raw.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (typ is int and not isinstance(value, int)):
        raise RequestError(f"sampling_params.{key} must be {'an integer' if typ is int else 'a number'}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise RequestError(f"sampling_params.{key} must be finite, got {value!r}")
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
    cached_tokens: int = 0


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
    cached_tokens: int = 0
    ngrams: Any = None  # the prompt-lookup draft index (infra/engine/speculation.py), built at the first draft

    def cancel(self) -> None:
        """Drop the sequence at the next step (the client went away)."""
        self.cancelled = True

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)
