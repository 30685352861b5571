"""The embedded engine: SGLang's native HTTP API (and the OpenAI one) served on CPU or CUDA.

Owns the HTTP face of `infra.engine_batcher.Batcher`: request validation, the JSON
shapes of SGLang's `/generate`, `/health`, `/health_generate`, `/get_model_info`,
`/update_weights_from_disk`, the OpenAI-compatible `/v1/completions` and
`/v1/chat/completions` (non-streaming), `/metrics`, and the `dreamgym serve` command.
The shapes are pinned in tests/test_engine_contract.py.

Where it departs from SGLang: no streaming, no `n > 1`, no input-token log-probs,
and `weight_version` is an integer (SGLang's is a free string; our client accepts
both). Bad requests get a 400 with `{"error": {"message": ...}}`. A client that
disconnects mid-generation cancels its sequence, which leaves the batch at the next
decode step.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from infra.engine_batcher import Batcher, EngineStopped, GenOutput, GenRequest, RequestError, SamplingParams
from infra.processes import stop_process

log = logging.getLogger(__name__)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


async def _json_body(request: web.Request) -> Any:
    try:
        return await request.json()
    except Exception as exc:  # aiohttp raises JSONDecodeError or ContentTypeError
        raise RequestError(f"request body is not valid JSON: {exc}") from None


class EngineApp:
    """Routes over one Batcher. `model_name` is what /get_model_info reports."""

    def __init__(self, batcher: Batcher, model_name: str, dtype: str = "float32", default_max_new_tokens: int = 128,
                 device: str = "cpu"):
        self.batcher = batcher
        self.device = device
        self.tokenizer = batcher.tokenizer
        self.model_name = model_name
        self.dtype = dtype
        self.default_max_new_tokens = default_max_new_tokens
        self._update_lock = asyncio.Lock()
        self.app = web.Application(middlewares=[self._errors], client_max_size=64 * 1024 * 1024)
        self.app.add_routes([
            web.get("/health", self.health), web.get("/health_generate", self.health_generate),
            web.get("/get_model_info", self.model_info), web.get("/model_info", self.model_info),
            web.post("/generate", self.generate), web.post("/update_weights_from_disk", self.update_weights),
            web.post("/v1/completions", self.oai_completions), web.post("/v1/chat/completions", self.oai_chat),
            web.get("/v1/models", self.oai_models), web.get("/metrics", self.metrics),
        ])

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except RequestError as exc:
            return _error(400, str(exc))
        except EngineStopped as exc:
            return _error(503, str(exc))
        except web.HTTPException as exc:
            if exc.status >= 400:
                return _error(exc.status, exc.reason)
            raise

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
                                  "engine": "dreamgym-embedded"})

    async def generate(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        if body.get("stream"):
            raise RequestError("stream=true is not supported by the embedded engine")
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise RequestError("give exactly one of 'text' or 'input_ids'")
        batched = isinstance(text, list) or (isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list))
        if text is not None:
            texts = text if isinstance(text, list) else [text]
            if not texts or not all(isinstance(t, str) for t in texts):
                raise RequestError("'text' must be a string or a non-empty list of strings")
            prompts = [self.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
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
        t0 = time.monotonic()
        outs = await asyncio.gather(*(self._run(p, s, tids) for p, s in zip(prompts, params)))
        results = [self._sglang_json(o, return_logprob, tids, time.monotonic() - t0) for o in outs]
        return web.json_response(results if batched else results[0])

    async def _run(self, input_ids: list[int], params: SamplingParams, tids: list[int] | None) -> GenOutput:
        req = GenRequest(list(input_ids), params, token_ids_logprob=tids or None)
        fut = asyncio.wrap_future(self.batcher.submit(req))
        try:
            return await fut
        except asyncio.CancelledError:
            req.cancel()  # the client went away: free the batch slot at the next step
            raise

    def _sglang_json(self, o: GenOutput, return_logprob: bool, tids: list[int] | None, latency: float) -> dict:
        meta: dict[str, Any] = {"id": uuid.uuid4().hex, "finish_reason": o.finish_reason,
                                "prompt_tokens": o.prompt_tokens, "completion_tokens": len(o.output_ids),
                                "cached_tokens": 0, "weight_version": o.weight_version, "e2e_latency": latency}
        if return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(o.output_logprobs, o.output_ids)]
        if tids:
            meta["output_token_ids_logprobs"] = [[[row[t], t, None] for t in tids] for row in (o.token_ids_logprobs or [])]
        return {"text": o.text, "output_ids": o.output_ids, "meta_info": meta}

    async def update_weights(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
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
        async with self._update_lock:
            try:
                model = await asyncio.to_thread(_load_weights, body["model_path"], self.dtype, self.device)
            except (FileNotFoundError, OSError, ValueError) as exc:
                return web.json_response({"success": False, "message": f"cannot load {body['model_path']}: {exc}"},
                                         status=400)
            await asyncio.wrap_future(self.batcher.swap_weights(model, version))
            self.model_name = body["model_path"]
        _set_version_metric(version)
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
        body = await _json_body(request)
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), (str, list)):
            raise RequestError("'prompt' (a string or a list of strings) is required")
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        if not all(isinstance(p, str) for p in prompts):
            raise RequestError("'prompt' must be a string or a list of strings")
        params = self._oai_params(body)
        outs = await asyncio.gather(*(self._run(self.tokenizer(p, add_special_tokens=False).input_ids, params, None)
                                      for p in prompts))
        choices = [{"index": i, "text": o.text, "logprobs": None, "finish_reason": _oai_finish(o)} for i, o in enumerate(outs)]
        return web.json_response({"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()),
                                  "model": self.model_name, "choices": choices, "usage": _usage(outs)})

    async def oai_chat(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        msgs = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
            raise RequestError("'messages' must be a non-empty list of {role, content} objects")
        params = self._oai_params(body)
        prompt = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        o = await self._run(self.tokenizer(prompt, add_special_tokens=False).input_ids, params, None)
        return web.json_response({
            "id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name, "usage": _usage([o]),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": o.text}, "logprobs": None,
                         "finish_reason": _oai_finish(o)}]})

    async def metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def _load_weights(path: str, dtype: str, device: str = "cpu"):
    """Only the model: a learner checkpoint need not carry tokenizer files (the tokenizer never changes)."""
    import torch
    from transformers import AutoModelForCausalLM

    from infra.model_loading import resolve

    model = AutoModelForCausalLM.from_pretrained(resolve(path), dtype=getattr(torch, dtype)).to(device)
    return model.eval()


def _oai_finish(o: GenOutput) -> str:
    return "length" if o.finish_reason.get("type") == "length" else "stop"


def _usage(outs: list[GenOutput]) -> dict:
    p, c = sum(o.prompt_tokens for o in outs), sum(len(o.output_ids) for o in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _set_version_metric(version: int) -> None:
    from infra.metrics import ENGINE_WEIGHT_VERSION

    ENGINE_WEIGHT_VERSION.labels(role="embedded").set(version)


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


def _limit_threads(device: str = "cpu") -> None:
    """CPU only: a CUDA engine's host threads only launch kernels, and its process may share no cores."""
    import torch

    if not str(device).startswith("cpu"):
        return
    # Several engines and workers share the machine's cores; never oversubscribe them.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if torch.get_num_threads() > cores:
        torch.set_num_threads(cores)


async def start_embedded_engine(model: str = "smollm2", host: str = "127.0.0.1", port: int = 0,
                                max_batch_size: int = 16, dtype: str = "float32", *, loaded: tuple | None = None,
                                weight_version: int = 0, default_max_new_tokens: int = 128,
                                device: str = "cpu") -> EngineHandle:
    """Serve `model` on the running event loop; the decode loop runs in a worker thread.

    `loaded=(model, tokenizer)` reuses an already loaded model (tests share one); the
    engine then runs on that model's device whatever `device` says.
    `device` is a torch device ('cpu', 'cuda', 'cuda:1'): the model is loaded there and
    every tensor the batcher makes lives there.
    """
    from infra.engine_batcher import _model_device
    from infra.model_loading import load_model

    m, tok = loaded if loaded is not None else await asyncio.to_thread(load_model, model, dtype, device)
    device = str(_model_device(m))
    _limit_threads(device)
    batcher = Batcher(m, tok, max_batch_size=max_batch_size, weight_version=weight_version)
    batcher.start()
    engine = EngineApp(batcher, model, dtype, default_max_new_tokens, device)
    runner = web.AppRunner(engine.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    _set_version_metric(weight_version)
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
                          dtype: str = "float32", startup_timeout_s: float = 180.0, **overrides) -> EngineProcess:
    """Start `python -m infra.cli serve` on `port` (0: a free one) and wait until it answers /health."""
    import socket
    import urllib.request

    if port == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "infra.cli", "serve", f"engines.model={model}", f"engines.max_batch_size={max_batch_size}",
           f"engines.dtype={dtype}", *(f"engines.{k}={v}" for k, v in overrides.items()), "--host", host, "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
    from infra.cli import add_config_arguments

    add_config_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=30000, help="port (0: a free one; default: %(default)s)")
    p.add_argument("--model", default=None, help="model to serve (default: engines.model from the config)")
    p.add_argument("--device", default=None, help="torch device, e.g. cpu, cuda, cuda:1 (default: engines.device)")


def run(args: argparse.Namespace) -> int:
    from infra.cli import config_from_args

    cfg = config_from_args(args).engines
    model = args.model or cfg.model
    device = args.device or cfg.device

    async def main() -> None:
        handle = await start_embedded_engine(model, args.host, args.port, cfg.max_batch_size, cfg.dtype,
                                             default_max_new_tokens=cfg.max_new_tokens, device=device)
        print(f"dreamgym serve: {model} at {handle.url} (max batch {cfg.max_batch_size}, {cfg.dtype}, {device})",
              flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        import signal

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await handle.stop()

    asyncio.run(main())
    return 0
