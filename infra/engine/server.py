"""The embedded engine: SGLang's native HTTP API (and the OpenAI one) served on CPU or CUDA.

Owns the HTTP face of `infra.engine.batcher.Batcher`: request validation, the JSON
shapes of SGLang's `/generate`, `/health`, `/health_generate`, `/get_model_info`,
`/update_weights_from_disk` (and, through infra/engine/weight_group.py, `/init_weights_update_group`
and `/update_weights_from_distributed`), the OpenAI-compatible `/v1/completions` and
`/v1/chat/completions` (non-streaming), `/metrics`, and the `dreamgym serve` command.
The shapes are pinned in tests/test_engine_contract.py.

Guards, so that one client cannot hurt the others:
- a body limit (`engines.max_body_mb`, 413), a cap on prompts per request (400) and a
  bounded queue (429 with Retry-After; a stopping engine answers 503);
- JSON parsing and tokenization run in worker threads, never on the event loop, so
  `/health` answers while a large prompt is being read or the engine is saturated;
- with `api_key` set, every route but `/health*` and `/metrics` needs
  `Authorization: Bearer <key>` (401 otherwise), as SGLang's `--api-key` does;
- `/update_weights_from_disk` loads only from under the allowed weights roots (403).

Where it departs from SGLang: no streaming, no `n > 1`, no input-token log-probs,
and `weight_version` is an integer (SGLang's is a free string; our client accepts
both). Bad requests get a 400 with `{"error": {"message": ...}}`. A client that
disconnects mid-generation cancels its sequence, which leaves the batch at the next
decode step.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from infra.config import EngineConfig, add_config_arguments, config_from_args
from infra.engine import weight_group
from infra.engine.batcher import Batcher, model_device
from infra.engine.models import cache_dir, load_model, load_weights
from infra.engine.request import (EngineStopped, GenOutput, GenRequest, QueueFull, RequestError, RequestFailed,
                                  SamplingParams)
from infra.processes import stop_process

log = logging.getLogger(__name__)


CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
CHARS_PER_TOKEN_MAX = 64  # a prompt longer than this many characters per context token cannot fit: refuse it untokenized


def _error(status: int, message: str, headers: dict | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status, headers=headers)


class EngineApp:
    """Routes over one Batcher. `model_name` is what /get_model_info reports.

    `api_key`: the Bearer token required on every route but /health* and /metrics ('' = none).
    `weights_roots`: directories /update_weights_from_disk may load from (their subdirectories too).
    """

    def __init__(self, batcher: Batcher, model_name: str, dtype: str = "float32", default_max_new_tokens: int = 128,
                 device: str = "cpu", *, api_key: str = "", weights_roots: list[str] | None = None,
                 max_body_mb: float = 4.0, max_prompts_per_request: int = 256):
        self.batcher = batcher
        self.device = device
        self.tokenizer = batcher.tokenizer
        self.model_name = model_name
        self.dtype = dtype
        self.default_max_new_tokens = default_max_new_tokens
        self.api_key = api_key
        self.weights_roots = [os.path.realpath(r) for r in (weights_roots or [])]
        self.max_prompts = max_prompts_per_request
        self._update_lock = asyncio.Lock()
        self.app = web.Application(middlewares=[self._auth, self._errors], client_max_size=int(max_body_mb * 2 ** 20))
        self.app.add_routes([
            web.get("/health", self.health), web.get("/health_generate", self.health_generate),
            web.get("/get_model_info", self.model_info), web.get("/model_info", self.model_info),
            web.post("/generate", self.generate), web.post("/update_weights_from_disk", self.update_weights),
            web.post("/v1/completions", self.oai_completions), web.post("/v1/chat/completions", self.oai_chat),
            web.get("/v1/models", self.oai_models), web.get("/metrics", self.metrics),
        ])
        self.weight_group = weight_group.add_routes(self)  # SGLang's weight-update group (a learner's broadcast)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if (not self.api_key or request.method == "OPTIONS" or request.path.startswith("/health")
                or request.path.startswith("/metrics")):
            return await handler(request)
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            self.batcher.metrics.rejected.labels(reason="unauthorized").inc()
            return web.json_response({"error": "Unauthorized"}, status=401)  # SGLang's body
        return await handler(request)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except RequestError as exc:
            self.batcher.metrics.rejected.labels(reason="invalid").inc()
            return _error(400, str(exc))
        except QueueFull as exc:
            self.batcher.metrics.rejected.labels(reason="queue_full").inc()
            return _error(429, str(exc), {"Retry-After": str(int(exc.retry_after))})
        except EngineStopped as exc:  # no Retry-After: this engine is going away, clients fail over
            return _error(503, str(exc))
        except RequestFailed as exc:
            return _error(500, str(exc))
        except web.HTTPException as exc:
            if exc.status == 413:
                self.batcher.metrics.rejected.labels(reason="body_too_large").inc()
            if exc.status >= 400:
                return _error(exc.status, exc.reason)
            raise

    async def _json_body(self, request: web.Request) -> Any:
        raw = await request.read()  # over client_max_size: HTTPRequestEntityTooLarge (413)
        try:
            return await asyncio.to_thread(json.loads, raw)  # a 4 MB body parses for tens of ms: not on the loop
        except ValueError as exc:
            raise RequestError(f"request body is not valid JSON: {exc}") from None
        except RecursionError:  # the decoder's own depth limit (about 1,000 levels): a client error, not a crash
            raise RequestError("request body is JSON nested too deeply") from None

    async def _tokenize(self, texts: list[str]) -> list[list[int]]:
        limit = CHARS_PER_TOKEN_MAX * self.batcher.max_positions
        for t in texts:
            if len(t) > limit:
                raise RequestError(f"prompt of {len(t)} characters cannot fit the model's context of "
                                   f"{self.batcher.max_positions} tokens")
        return await asyncio.to_thread(lambda: [self.tokenizer(t, add_special_tokens=False).input_ids for t in texts])

    # --- SGLang native ---
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        await self._run([self.tokenizer.eos_token_id or 0], SamplingParams(max_new_tokens=1, temperature=0.0), None)
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_name, "tokenizer_path": self.model_name,
                                  "is_generation": True, "weight_version": self.batcher.weight_version,
                                  "max_batch_size": self.batcher.max_batch_size, "dtype": self.dtype,
                                  "engine": "dreamgym-embedded", "torch_threads": _torch_threads(),
                                  "prefix_cache_mb": self.batcher.prefix_cache.budget_bytes / 2 ** 20,
                                  "score_cache_mb": (c.budget / 2 ** 20 if (c := self.batcher.scorer.cache) is not None else 0.0)})

    async def generate(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        if body.get("stream"):
            raise RequestError("stream=true is not supported by the embedded engine")
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise RequestError("give exactly one of 'text' or 'input_ids'")
        batched = isinstance(text, list) or (isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list))
        count = len(text) if isinstance(text, list) else len(input_ids) if batched else 1
        if count > self.max_prompts:
            raise RequestError(f"{count} prompts in one request; the limit is {self.max_prompts}")
        if text is not None:
            texts = text if isinstance(text, list) else [text]
            if not texts or not all(isinstance(t, str) for t in texts):
                raise RequestError("'text' must be a string or a non-empty list of strings")
            prompts = await self._tokenize(texts)
        else:
            prompts = input_ids if batched else [input_ids]
            if not isinstance(prompts, list) or not prompts or not all(
                    isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                    for p in prompts):
                raise RequestError("'input_ids' must be a non-empty list of integers (or a list of such lists)")
        sp = body.get("sampling_params")
        sps = sp if isinstance(sp, list) else [sp] * len(prompts)
        if len(sps) != len(prompts):
            raise RequestError("sampling_params list must have one entry per prompt")
        params = [SamplingParams.from_dict(s, self.default_max_new_tokens) for s in sps]
        return_logprob = body.get("return_logprob", False)
        if not isinstance(return_logprob, bool):
            raise RequestError("'return_logprob' must be true or false")
        tids = body.get("token_ids_logprob")
        if tids is not None:
            if isinstance(tids, list) and tids and isinstance(tids[0], list):
                tids = tids[0]  # per-prompt lists: the embedded engine takes one shared list
            if not isinstance(tids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tids):
                raise RequestError("'token_ids_logprob' must be a list of token ids")
        start = body.get("logprob_start_len", -1)
        if not isinstance(start, int) or isinstance(start, bool):
            raise RequestError("'logprob_start_len' must be an integer")
        t0 = time.monotonic()
        if return_logprob and start >= 0 and all(p.max_new_tokens == 0 for p in params):
            return web.json_response(await self._score(prompts, start, batched, t0))
        outs = await self._run_many([GenRequest(list(p), s, token_ids_logprob=tids or None)
                                     for p, s in zip(prompts, params)])
        results = [self._sglang_json(o, return_logprob, tids, time.monotonic() - t0) for o in outs]
        return web.json_response(results if batched else results[0])

    async def _score(self, prompts: list[list[int]], start: int, batched: bool, t0: float) -> Any:
        """Prefill log-probs only (max_new_tokens 0, return_logprob, logprob_start_len), as SGLang
        answers them: `input_token_logprobs` from `start` on, no output tokens. Off the event loop."""
        lps, version = await asyncio.wrap_future(self.batcher.submit_score(prompts, start))
        latency = time.monotonic() - t0
        self.batcher.metrics.server_seconds.observe(latency)  # one request, as a decode batch of them is one
        results = [{"text": "", "output_ids": [],
                    "meta_info": {"id": uuid.uuid4().hex, "finish_reason": {"type": "length", "length": 0},
                                  "prompt_tokens": len(p), "completion_tokens": 0, "cached_tokens": 0,
                                  "weight_version": version, "e2e_latency": latency,
                                  "input_token_logprobs": [[lp, tok, None] for lp, tok in zip(lp_row, p[start:])],
                                  "output_token_logprobs": []}}
                   for p, lp_row in zip(prompts, lps)]
        return results if batched else results[0]

    async def _run(self, input_ids: list[int], params: SamplingParams, tids: list[int] | None) -> GenOutput:
        return (await self._run_many([GenRequest(list(input_ids), params, token_ids_logprob=tids or None)]))[0]

    async def _run_many(self, reqs: list[GenRequest]) -> list[GenOutput]:
        """Queue all of `reqs` at once (or none) and wait for them; a disconnect cancels them all."""
        t0 = time.monotonic()
        futs = [asyncio.wrap_future(f) for f in self.batcher.submit_many(reqs)]
        try:
            outs = list(await asyncio.gather(*futs))
        except BaseException:
            for req in reqs:
                req.cancel()  # the client went away, or a sibling failed: free the batch slots
            raise
        self.batcher.metrics.server_seconds.observe(time.monotonic() - t0)
        self.batcher.metrics.server_tokens.inc(sum(len(o.output_ids) for o in outs))
        return outs

    def _sglang_json(self, o: GenOutput, return_logprob: bool, tids: list[int] | None, latency: float) -> dict:
        meta: dict[str, Any] = {"id": uuid.uuid4().hex, "finish_reason": o.finish_reason,
                                "prompt_tokens": o.prompt_tokens, "completion_tokens": len(o.output_ids),
                                "cached_tokens": o.cached_tokens, "weight_version": o.weight_version, "e2e_latency": latency}
        if return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(o.output_logprobs, o.output_ids)]
        if tids:
            meta["output_token_ids_logprobs"] = [[[row[t], t, None] for t in tids] for row in (o.token_ids_logprobs or [])]
        return {"text": o.text, "output_ids": o.output_ids, "meta_info": meta}

    async def update_weights(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            raise RequestError("'model_path' (a Hugging Face model directory) is required")
        version = body.get("weight_version")
        if version is None:
            version = self.batcher.weight_version + 1
        else:
            try:
                version = int(version)
            except (TypeError, ValueError):
                raise RequestError(f"'weight_version' must be an integer, got {version!r}") from None
        if not allowed_weights_path(body["model_path"], self.weights_roots):
            self.batcher.metrics.rejected.labels(reason="weights_path").inc()
            return web.json_response({"success": False, "message": f"{body['model_path']} is outside the allowed "
                                      f"weights roots {self.weights_roots} (engines.weights_root)"}, status=403)
        async with self._update_lock:
            try:
                model = await asyncio.to_thread(_load_weights, body["model_path"], self.dtype, self.device)
            except (FileNotFoundError, OSError, ValueError) as exc:
                return web.json_response({"success": False, "message": f"cannot load {body['model_path']}: {exc}"},
                                         status=400)
            await asyncio.wrap_future(self.batcher.swap_weights(model, version))
            self.model_name = body["model_path"]
        return web.json_response({"success": True, "message": f"serving {body['model_path']} as weight version {version}",
                                  "num_paused_requests": 0})

    # --- OpenAI-compatible ---
    async def oai_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "dreamgym"}]})

    def _oai_params(self, body: dict) -> SamplingParams:
        raw = {"max_new_tokens": body.get("max_tokens") or body.get("max_completion_tokens") or 16,
               "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
               "stop": body.get("stop"), "sampling_seed": body.get("seed")}
        if body.get("n", 1) not in (1, None):
            raise RequestError("n > 1 is not supported")
        return SamplingParams.from_dict(raw, 16)

    async def oai_completions(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), (str, list)):
            raise RequestError("'prompt' (a string or a list of strings) is required")
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise RequestError("'prompt' must be a string or a non-empty list of strings")
        if len(prompts) > self.max_prompts:
            raise RequestError(f"{len(prompts)} prompts in one request; the limit is {self.max_prompts}")
        params = self._oai_params(body)
        ids = await self._tokenize(prompts)
        outs = await self._run_many([GenRequest(p, params) for p in ids])
        choices = [{"index": i, "text": o.text, "logprobs": None, "finish_reason": _oai_finish(o)} for i, o in enumerate(outs)]
        return web.json_response({"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()),
                                  "model": self.model_name, "choices": choices, "usage": _usage(outs)})

    async def oai_chat(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        msgs = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(msgs, list) or not msgs:
            raise RequestError("'messages' must be a non-empty list of {role, content} objects")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
                raise RequestError(f"messages[{i}] must be {{role: one of {sorted(CHAT_ROLES)}, content: a string}}")
        params = self._oai_params(body)
        limit = CHARS_PER_TOKEN_MAX * self.batcher.max_positions
        if sum(len(m["content"]) for m in msgs) > limit:
            raise RequestError(f"messages cannot fit the model's context of {self.batcher.max_positions} tokens")
        prompt = await asyncio.to_thread(self.tokenizer.apply_chat_template, [{"role": m["role"], "content": m["content"]}
                                                                             for m in msgs],
                                         tokenize=False, add_generation_prompt=True)
        o = await self._run((await self._tokenize([prompt]))[0], params, None)
        return web.json_response({
            "id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name, "usage": _usage([o]),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": o.text}, "logprobs": None,
                         "finish_reason": _oai_finish(o)}]})

    async def metrics(self, request: web.Request) -> web.Response:
        # This engine's registry only: an engine embedded in the driver does not export the driver's metrics.
        return web.Response(body=generate_latest(self.batcher.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def _load_weights(path: str, dtype: str, device: str = "cpu"):
    """Only the model: a learner checkpoint need not carry tokenizer files (the tokenizer never changes).
    Safetensors only: a directory without them (a pickled .bin) is refused as the client's error."""
    if not os.path.isdir(path) or not any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise ValueError(f"{path} holds no .safetensors weights (published weights are safetensors; .bin is refused)")
    return load_weights(path, dtype, device)


def _torch_threads() -> int:
    import torch  # heavy: only a serving process asks

    return torch.get_num_threads()


def allowed_weights_path(path: str, roots: list[str]) -> bool:
    """True when `path` (links resolved) lies inside one of `roots`."""
    real = os.path.realpath(path)
    return any(os.path.commonpath([real, root]) == root for root in roots)


def default_weights_roots(model: str, run_dir: str = "runs", configured: str = "", weights_dir: str = "") -> list[str]:
    """`engines.weights_root` when set; else the runs directory, the shared weights directory
    (`infra.weights_dir`, where the learner publishes when it is set) and the directory holding the served model."""
    if configured:
        return [os.path.abspath(configured)]
    served = os.path.dirname(os.path.abspath(model)) if os.path.isdir(model) else str(cache_dir())
    return [os.path.abspath(run_dir), *([os.path.abspath(weights_dir)] if weights_dir else []), served]


def _oai_finish(o: GenOutput) -> str:
    return "length" if o.finish_reason.get("type") == "length" else "stop"


def _usage(outs: list[GenOutput]) -> dict:
    p, c = sum(o.prompt_tokens for o in outs), sum(len(o.output_ids) for o in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


@dataclass
class EngineHandle:
    """A running in-process engine: `.url`, `await .stop()`; `.batcher` for introspection."""

    url: str
    batcher: Batcher
    runner: web.AppRunner
    app: EngineApp = field(repr=False)

    async def stop(self) -> None:
        """Stop at once: requests in flight fail with 503 (a client fails them over), then the socket closes."""
        await asyncio.to_thread(self.batcher.stop)
        await self.runner.cleanup()


def apply_threads(device: str = "cpu", threads: int = 0) -> int:
    """Set torch's intra-op threads for a CPU engine; returns the count in force.

    `threads` > 0 is taken as given (engines.threads); 0 caps torch's default at the cores
    this process may run on. The setting is per process: an engine embedded in the
    driver shares it with the learner there. A CUDA engine's host threads only launch
    kernels, so its process is left alone.
    """
    import torch  # heavy: only a serving process sets threads

    if not str(device).startswith("cpu"):
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    want = threads if threads > 0 else min(torch.get_num_threads(), cores)
    if torch.get_num_threads() != want:
        torch.set_num_threads(want)
    return want


async def start_embedded_engine(model: str = "smollm2", host: str = "127.0.0.1", port: int = 0,
                                max_batch_size: int = 16, dtype: str = "float32", *, loaded: tuple | None = None,
                                weight_version: int = 0, default_max_new_tokens: int = 128,
                                device: str = "cpu", engine_cfg=None, weights_roots: list[str] | None = None
                                ) -> EngineHandle:
    """Serve `model` on the running event loop; the decode loop runs in a worker thread.

    `loaded=(model, tokenizer)` reuses an already loaded model (tests share one); the
    engine then runs on that model's device whatever `device` says.
    `device` is a torch device ('cpu', 'cuda', 'cuda:1'): the model is loaded there and
    every tensor the batcher makes lives there.
    `engine_cfg` (an EngineConfig; None: its defaults, but the process's thread count left
    as it is) gives the prefix cache budget, the threads, the API key and the request limits; `weights_roots` the directories
    /update_weights_from_disk may load from (None: `default_weights_roots(model)`).
    """
    e = engine_cfg if engine_cfg is not None else EngineConfig(threads=0)  # no config: leave the process's threads
    m, tok = loaded if loaded is not None else await asyncio.to_thread(load_model, model, dtype, device)
    device = str(model_device(m))
    threads = apply_threads(device, e.threads) if device.startswith("cpu") else 0
    batcher = Batcher(m, tok, max_batch_size=max_batch_size, weight_version=weight_version,
                      prefix_cache_mb=e.prefix_cache_mb, max_queue=e.max_queue, score_batch_tokens=e.score_batch_tokens,
                      score_cache_mb=e.score_cache_mb,
                      speculative_tokens=e.speculative_tokens, threads=threads,
                      decode_graphs="cuda" if e.cuda_graphs and device.startswith("cuda") else "off")
    batcher.start()
    engine = EngineApp(batcher, model, dtype, default_max_new_tokens, device, api_key=e.api_key,
                       weights_roots=weights_roots if weights_roots is not None else default_weights_roots(model),
                       max_body_mb=e.max_body_mb, max_prompts_per_request=e.max_prompts_per_request)
    runner = web.AppRunner(engine.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    return EngineHandle(url=f"http://{host}:{bound}", batcher=batcher, runner=runner, app=engine)


class EngineProcess:
    """`dreamgym serve` in a subprocess; waits for /health. `.url`, `.stop()`."""

    def __init__(self, proc: subprocess.Popen, url: str):
        self.proc, self.url = proc, url

    def stop(self, timeout: float = 10.0) -> None:
        stop_process(self.proc, timeout)

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch_engine_process(model: str = "smollm2", port: int = 0, host: str = "127.0.0.1", max_batch_size: int = 16,
                          dtype: str = "float32", startup_timeout_s: float = 180.0, api_key: str = "",
                          **overrides) -> EngineProcess:
    """Start `python -m infra.cli serve` on `port` (0: a free one) and wait until it answers /health.

    `api_key` travels in the environment (DREAMGYM_API_KEY), not on the command line.
    """
    if port == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "infra.cli", "serve", f"engines.model={model}", f"engines.max_batch_size={max_batch_size}",
           f"engines.dtype={dtype}", *(f"engines.{k}={v}" for k, v in overrides.items()), "--host", host, "--port", str(port)]
    env = {**os.environ, "DREAMGYM_API_KEY": api_key} if api_key else None
    proc = subprocess.Popen(cmd, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env=env)
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine process exited with code {proc.returncode} before serving: {' '.join(cmd)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return EngineProcess(proc, url)
        except OSError:
            time.sleep(0.5)
    EngineProcess(proc, url).stop()
    raise TimeoutError(f"engine at {url} not healthy after {startup_timeout_s:.0f} s")


# --- `dreamgym serve` ---
def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--host", default=None, help="interface to bind (default: engines.host, loopback)")
    p.add_argument("--port", type=int, default=30000, help="port (0: a free one; default: %(default)s)")
    p.add_argument("--model", default=None, help="model to serve (default: engines.model from the config)")
    p.add_argument("--device", default=None, help="torch device, e.g. cpu, cuda, cuda:1 (default: engines.device)")
    p.add_argument("--api-key", default=None,
                   help="Bearer token every request but /health and /metrics must carry, as SGLang's --api-key "
                        "(default: engines.api_key, or the DREAMGYM_API_KEY environment variable)")


def run(args: argparse.Namespace) -> int:
    full = config_from_args(args)
    cfg = full.engines
    api_key = args.api_key if args.api_key is not None else (cfg.api_key or os.environ.get("DREAMGYM_API_KEY", ""))
    cfg = dataclasses.replace(cfg, api_key=api_key)
    model = args.model or cfg.model
    device = args.device or cfg.device
    host = args.host or cfg.host
    roots = default_weights_roots(model, full.infra.run_dir, cfg.weights_root, full.infra.weights_dir)

    async def main() -> None:
        handle = await start_embedded_engine(model, host, args.port, cfg.max_batch_size, cfg.dtype,
                                             default_max_new_tokens=cfg.max_new_tokens, device=device,
                                             engine_cfg=cfg, weights_roots=roots)
        print(f"dreamgym serve: {model} at {handle.url} (max batch {cfg.max_batch_size}, {cfg.dtype}, {device}, "
              f"{_torch_threads()} torch threads, prefix cache {cfg.prefix_cache_mb:g} MB, "
              f"api key {'on' if api_key else 'off'}, "
              f"weights from {', '.join(roots)})", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await handle.stop()

    asyncio.run(main())
    return 0
