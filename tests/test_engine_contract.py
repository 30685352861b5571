"""SGLang's native HTTP API, pinned: what our client sends and what our server answers.

Shapes pinned from SGLang's own source and docs (sgl-project/sglang):
- `python/sglang/srt/managers/io_struct.py`: `GenerateReqInput` (text, input_ids,
  sampling_params, rid, return_logprob, logprob_start_len, top_logprobs_num,
  token_ids_logprob, return_text_in_logprobs, stream, ...), `UpdateWeightFromDiskReqInput`
  (model_path, load_format, abort_all_requests, weight_version: Optional[str], ...) and
  `UpdateWeightFromDiskReqOutput` (success, message, num_paused_requests);
- `docs/backend/sampling_params.md` (docs.sglang.ai "Sampling Parameters"):
  max_new_tokens, stop, stop_token_ids, temperature, top_p, top_k, min_p, ignore_eos,
  skip_special_tokens, sampling_seed, ...; `/generate` answers `{"text", "output_ids",
  "meta_info": {"id", "finish_reason": {"type": "stop"|"length"|"abort", "matched"|"length"},
  "prompt_tokens", "completion_tokens", "cached_tokens", "output_token_logprobs":
  [[logprob, token_id, text|None], ...], "output_token_ids_logprobs": [[[logprob, token_id,
  text|None], ...] per position], "weight_version": str}}`; a list of prompts gets a list.
  With `return_logprob` and `logprob_start_len` = k, `meta_info.input_token_logprobs` holds
  [logprob, token_id, text|None] for the input tokens at positions k.. (SGLang's
  `TokenizerManager.convert_logprob_style`; position 0 has no log-prob, so k >= 1 gives
  numbers only); with max_new_tokens 0 nothing is generated (prefill only: scoring).
- the same `io_struct.py` (read at commit 001067fffe33427bee0ed2f007fb7551a1d76b44):
  `InitWeightsUpdateGroupReqInput` (master_address, master_port, rank_offset, world_size,
  group_name = "weight_update_group", backend = "nccl") and
  `UpdateWeightsFromDistributedReqInput` (names, dtypes, shapes, group_name, flush_cache,
  abort_all_requests, weight_version: Optional[str], load_format, torch_empty_cache), both
  answered `{success, message}`; `ModelRunner.init_weights_update_group` joins as rank
  `rank_offset + tp_rank` through `init_custom_process_group(init_method="tcp://addr:port")`
  and `update_weights_from_distributed` receives one broadcast from rank 0 per name, into
  `torch.empty(shape, dtype=getattr(torch, dtype))` (dtypes spelled "bfloat16", no "torch.").
- `docs/basic_usage/native_api.md`: `/health` (200, empty), `/get_model_info`
  (`model_path`, `tokenizer_path`, `is_generation`, ...).
- `python/sglang/srt/utils.py` `add_api_key_middleware` (`--api-key`): every path but
  `/health*` and `/metrics*` (and OPTIONS) needs `Authorization: Bearer <key>`, else
  401 `{"error": "Unauthorized"}`. An overloaded server refuses with 429 or 503, with
  or without Retry-After; on a 429, or a 503 that names a Retry-After, the client waits
  and tries again rather than failing.

The fake SGLang server below is the only stand-in for SGLang in the project: it checks
each request strictly against these shapes and answers in exactly SGLang's shape
(including its string `weight_version`), so the client is tested against SGLang's
contract rather than against our own server's leniency.
"""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from infra.engine.client import EngineClient, parse_generate_response

GENERATE_FIELDS = {
    "text": (str, list), "input_ids": list, "sampling_params": (dict, list), "rid": (str, list),
    "return_logprob": (bool, list), "logprob_start_len": (int, list), "top_logprobs_num": (int, list),
    "token_ids_logprob": list, "return_text_in_logprobs": bool, "stream": bool, "lora_path": (str, list),
}
SAMPLING_FIELDS = {
    "max_new_tokens": int, "stop": (str, list), "stop_token_ids": list, "temperature": (int, float),
    "top_p": (int, float), "top_k": int, "min_p": (int, float), "frequency_penalty": (int, float),
    "presence_penalty": (int, float), "repetition_penalty": (int, float), "min_new_tokens": int,
    "ignore_eos": bool, "skip_special_tokens": bool, "spaces_between_special_tokens": bool, "no_stop_trim": bool,
    "n": int, "sampling_seed": int, "json_schema": str, "regex": str, "ebnf": str,
}
UPDATE_FIELDS = {"model_path": str, "load_format": (str, type(None)), "abort_all_requests": bool,
                 "weight_version": (str, type(None)), "is_async": bool, "torch_empty_cache": bool,
                 "keep_pause": bool, "recapture_cuda_graph": bool, "token_step": int, "flush_cache": bool}
INIT_GROUP_FIELDS = {"master_address": str, "master_port": int, "rank_offset": int, "world_size": int,
                     "group_name": str, "backend": str}
DISTRIBUTED_FIELDS = {"names": list, "dtypes": list, "shapes": list, "group_name": str, "flush_cache": bool,
                      "abort_all_requests": bool, "weight_version": (str, type(None)), "load_format": (str, type(None)),
                      "torch_empty_cache": bool}


def check_fields(obj: dict, pinned: dict, where: str) -> None:
    assert isinstance(obj, dict), f"{where}: not an object"
    for key, value in obj.items():
        assert key in pinned, f"{where}: SGLang has no field {key!r}"
        assert isinstance(value, pinned[key]) and not (pinned[key] is int and isinstance(value, bool)), \
            f"{where}.{key}: {type(value).__name__} is not {pinned[key]}"


def check_generate_request(body: dict) -> None:
    check_fields(body, GENERATE_FIELDS, "GenerateReqInput")
    assert ("text" in body) != ("input_ids" in body), "exactly one of text / input_ids"
    if "sampling_params" in body:
        check_fields(body["sampling_params"], SAMPLING_FIELDS, "sampling_params")
    if "token_ids_logprob" in body:
        assert all(isinstance(t, int) for t in body["token_ids_logprob"])


def _triple(e) -> None:
    assert isinstance(e, list) and len(e) == 3
    assert isinstance(e[0], float) and isinstance(e[1], int) and (e[2] is None or isinstance(e[2], str))


def check_generate_response(body: dict, return_logprob: bool, token_ids: list[int] | None) -> None:
    assert set(body) >= {"text", "output_ids", "meta_info"} and isinstance(body["text"], str)
    assert all(isinstance(t, int) for t in body["output_ids"])
    meta = body["meta_info"]
    assert isinstance(meta["id"], str)
    assert isinstance(meta["prompt_tokens"], int) and isinstance(meta["completion_tokens"], int)
    fr = meta["finish_reason"]
    assert isinstance(fr, dict) and fr["type"] in ("stop", "length", "abort")
    if fr["type"] == "length":
        assert isinstance(fr["length"], int)
    if return_logprob:
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
        for e in meta["output_token_logprobs"]:
            _triple(e)
    if token_ids:
        rows = meta["output_token_ids_logprobs"]
        assert len(rows) == meta["completion_tokens"]
        for row in rows:
            assert [e[1] for e in row] == token_ids
            for e in row:
                _triple(e)
    assert isinstance(meta["weight_version"], (str, int))


def fake_sglang(api_key: str = "", busy: list[tuple[int, str | None]] | None = None) -> tuple[web.Application, list]:
    """Strict SGLang stand-in; records every request body it accepted.

    `api_key`: required as SGLang's --api-key requires it. `busy`: (status, Retry-After)
    answers given to the first /generate calls, as an overloaded server gives them.
    """
    seen: list = []
    busy = list(busy or [])

    @web.middleware
    async def auth(request: web.Request, handler):
        if api_key and not request.path.startswith(("/health", "/metrics")) and request.method != "OPTIONS":
            if request.headers.get("Authorization") != "Bearer " + api_key:
                seen.append(("unauthorized", request.path))
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def generate(request: web.Request) -> web.Response:
        if busy:
            status, retry_after = busy.pop(0)
            seen.append(("busy", status))
            return web.json_response({"error": {"message": "The request queue is full."}}, status=status,
                                     headers={"Retry-After": retry_after} if retry_after else None)
        body = await request.json()
        try:
            check_generate_request(body)
        except AssertionError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        seen.append(("generate", body))
        n = body.get("sampling_params", {}).get("max_new_tokens", 2)
        start = body.get("logprob_start_len", -1)
        if body.get("return_logprob") and start >= 1 and n == 0 and isinstance(body.get("input_ids", [None])[0], list):
            return web.json_response([
                {"text": "", "output_ids": [], "meta_info": {
                    "id": f"s{i}", "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": len(ids),
                    "completion_tokens": 0, "cached_tokens": 0, "weight_version": "default",
                    "input_token_logprobs": [[-0.25 * (j + 1), t, None] for j, t in enumerate(ids[start:])],
                    "output_token_logprobs": []}}
                for i, ids in enumerate(body["input_ids"])])
        meta = {"id": "abc", "finish_reason": {"type": "length", "length": n}, "prompt_tokens": 4,
                "completion_tokens": n, "cached_tokens": 0, "weight_version": "default", "e2e_latency": 0.01}
        if body.get("return_logprob"):
            meta["input_token_logprobs"] = [[None, 1, None]]
            meta["output_token_logprobs"] = [[-0.5, 100 + i, None] for i in range(n)]
        if body.get("token_ids_logprob"):
            meta["output_token_ids_logprobs"] = [[[-1.0 - j, t, None] for j, t in enumerate(body["token_ids_logprob"])]
                                                 for _ in range(n)]
        return web.json_response({"text": "x" * n, "output_ids": [100 + i for i in range(n)], "meta_info": meta})

    async def update(request: web.Request) -> web.Response:
        body = await request.json()
        try:
            check_fields(body, UPDATE_FIELDS, "UpdateWeightFromDiskReqInput")
            assert isinstance(body.get("model_path"), str)
        except AssertionError as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        seen.append(("update", body))
        return web.json_response({"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0})

    async def weight_group(request: web.Request) -> web.Response:
        body, path = await request.json(), request.path.strip("/")
        try:
            if path == "init_weights_update_group":
                check_fields(body, INIT_GROUP_FIELDS, "InitWeightsUpdateGroupReqInput")
                assert {"master_address", "master_port", "rank_offset", "world_size"} <= body.keys()
                assert 0 < body["rank_offset"] < body["world_size"], "rank 0 is the trainer's"
            else:
                check_fields(body, DISTRIBUTED_FIELDS, "UpdateWeightsFromDistributedReqInput")
                assert len(body["names"]) == len(body["dtypes"]) == len(body["shapes"]) > 0
                import torch  # the dtype names SGLang resolves with getattr(torch, dtype)

                assert all(isinstance(getattr(torch, d, None), torch.dtype) for d in body["dtypes"]), body["dtypes"]
                assert all(isinstance(s, list) and all(isinstance(x, int) for x in s) for s in body["shapes"])
        except AssertionError as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        seen.append((path, body))
        return web.json_response({"success": True, "message": "Succeeded."})

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": "/models/x", "tokenizer_path": "/models/x", "is_generation": True,
                                  "preferred_sampling_params": None, "weight_version": "default"})

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application(middlewares=[auth])
    app.add_routes([web.post("/generate", generate), web.post("/update_weights_from_disk", update),
                    web.get("/get_model_info", model_info), web.get("/health", health),
                    web.post("/init_weights_update_group", weight_group),
                    web.post("/update_weights_from_distributed", weight_group)])
    return app, seen


async def _serve(app: web.Application) -> tuple[str, web.AppRunner]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return f"http://127.0.0.1:{runner.addresses[0][1]}", runner


@pytest.fixture
async def fake_url():
    app, seen = fake_sglang()
    url, runner = await _serve(app)
    yield url, seen
    await runner.cleanup()


async def test_client_sends_the_api_key_and_waits_out_a_busy_server():
    import time

    from infra.engine.client import EngineRequestError

    app, seen = fake_sglang(api_key="s3cret", busy=[(429, None), (503, "1")])
    url, runner = await _serve(app)
    try:
        async with EngineClient([url], role="test", max_retries=0, api_key="s3cret") as client:
            t0 = time.monotonic()
            res = await client.generate("hi", sampling_params={"max_new_tokens": 2})
            waited = time.monotonic() - t0
            assert len(res.output_ids) == 2
            # 429 without Retry-After (1 s by default), then 503 with Retry-After: 1: waited, never failed
            assert [k for k, _ in seen] == ["busy", "busy", "generate"] and waited >= 1.9
            await client.update_weights_from_disk("/ckpt/v1", 1)
        async with EngineClient([url], role="test", max_retries=0, api_key="wrong") as client:
            with pytest.raises(EngineRequestError) as err:
                await client.generate("hi", sampling_params={"max_new_tokens": 2})
            assert err.value.status == 401 and "Unauthorized" in err.value.message
            assert await client.health() == {url: True}  # /health needs no key, as in SGLang
        assert ("unauthorized", "/generate") in seen and ("update", {"model_path": "/ckpt/v1", "load_format": "auto",
                                                                     "weight_version": "1"}) in seen
    finally:
        await runner.cleanup()


async def test_client_gives_up_when_retry_after_exceeds_its_timeout():
    from infra.engine.client import EngineError

    app, seen = fake_sglang(busy=[(429, "30")])
    url, runner = await _serve(app)
    try:
        async with EngineClient([url], role="test", timeout_s=2, max_retries=0) as client:
            with pytest.raises(EngineError, match="busy"):
                await client.generate("hi", sampling_params={"max_new_tokens": 2})
    finally:
        await runner.cleanup()


async def test_client_requests_conform_to_sglang(fake_url):
    url, seen = fake_url
    async with EngineClient([url], role="test", max_retries=0) as client:
        sp = {"max_new_tokens": 1, "temperature": 1.0, "top_p": 0.95, "stop": ["\n"], "sampling_seed": 3}
        res = await client.generate("Pick: a or b?", sampling_params=sp, return_logprob=True, token_ids_logprob=[81, 82])
        assert res.output_ids == [100] and res.output_logprobs == [-0.5]
        assert res.token_ids_logprobs == [{81: -1.0, 82: -2.0}]
        assert res.finish_reason == "length" and res.prompt_tokens == 4
        assert res.weight_version == 0  # SGLang's "default" string
        res = await client.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 3})
        assert len(res.output_ids) == 3 and res.token_ids_logprobs is None and res.output_logprobs == []
        await client.update_weights_from_disk("/ckpt/step-7", weight_version=7)
        assert (await client.model_info())["is_generation"] is True
        assert await client.health() == {url: True}
    kinds = [k for k, _ in seen]
    assert kinds == ["generate", "generate", "update"]
    assert seen[2][1]["weight_version"] == "7" and seen[2][1]["model_path"] == "/ckpt/step-7"


async def test_client_weight_group_requests_conform_to_sglang():
    """learner.weight_sync=distributed: one group for all servers (the learner rank 0, server i rank i + 1),
    then per version names, dtypes, shapes and a string weight_version, as SGLang's structs take them."""
    (app1, seen1), (app2, seen2) = fake_sglang(), fake_sglang()
    (url1, r1), (url2, r2) = await _serve(app1), await _serve(app2)
    try:
        async with EngineClient([url1, url2], role="test", max_retries=0) as client:
            await client.init_weights_update_group("10.0.0.5", 29500, "dreamgym-weights-1", "nccl")
            await client.update_weights_from_distributed(["model.norm.weight", "lm_head.weight"], ["bfloat16", "float32"],
                                                         [[576], [49152, 576]], "dreamgym-weights-1", 7)
            # servers of 2 GPUs each (tensor parallel): SGLang joins at rank_offset + tp_rank
            await client.init_weights_update_group("10.0.0.5", 29501, "dreamgym-weights-2", "nccl", ranks_per_server=2)
    finally:
        await r1.cleanup()
        await r2.cleanup()
    assert [(b["rank_offset"], b["world_size"]) for b in (seen1[2][1], seen2[2][1])] == [(1, 5), (3, 5)]
    for seen, rank in ((seen1, 1), (seen2, 2)):
        (init_path, init), (upd_path, upd) = seen[:2]
        assert init_path == "init_weights_update_group" and upd_path == "update_weights_from_distributed"
        assert init == {"master_address": "10.0.0.5", "master_port": 29500, "rank_offset": rank, "world_size": 3,
                        "group_name": "dreamgym-weights-1", "backend": "nccl"}
        assert upd["weight_version"] == "7" and upd["group_name"] == "dreamgym-weights-1"
        assert upd["dtypes"] == ["bfloat16", "float32"] and upd["shapes"] == [[576], [49152, 576]]


async def test_client_scores_continuations_as_sglang_prefill_logprobs(fake_url):
    url, seen = fake_url
    async with EngineClient([url], role="test", max_retries=0) as client:
        rows, version = await client.score([1, 2, 3], [[7], [8, 9]])
    assert rows == [[-0.25], [-0.25, -0.5]] and version == 0
    body = seen[0][1]
    assert body["input_ids"] == [[1, 2, 3, 7], [1, 2, 3, 8, 9]] and body["logprob_start_len"] == 3
    assert body["return_logprob"] is True and body["sampling_params"]["max_new_tokens"] == 0


def test_parse_accepts_sglang_variants():
    body = {"text": "hi", "output_ids": [5], "meta_info": {
        "id": "1", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 3, "completion_tokens": 1,
        "weight_version": "12", "output_token_logprobs": [[-0.1, 5, "hi"]]}}
    res = parse_generate_response(body)
    assert (res.weight_version, res.finish_reason, res.output_logprobs) == (12, "stop", [-0.1])
    from infra.engine.client import EngineError

    with pytest.raises(EngineError, match="malformed"):
        parse_generate_response({"text": "no meta"})


@pytest.mark.slow
@pytest.mark.model
async def test_embedded_server_answers_in_sglang_shape(smollm2):
    from infra.engine.server import start_embedded_engine

    handle = await start_embedded_engine(loaded=smollm2, max_batch_size=4)
    try:
        async with aiohttp.ClientSession() as s:
            req = {"text": "Hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0.0},
                   "return_logprob": True, "token_ids_logprob": [81, 82]}
            check_generate_request(req)
            async with s.post(handle.url + "/generate", json=req) as r:
                check_generate_response(await r.json(), True, [81, 82])
            batch = {"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_new_tokens": 2}}
            async with s.post(handle.url + "/generate", json=batch) as r:
                bodies = await r.json()
            assert len(bodies) == 2
            for b in bodies:
                check_generate_response(b, False, None)
            score = {"input_ids": [[1, 2, 3, 4], [1, 2, 3, 5, 6]], "sampling_params": {"max_new_tokens": 0},
                     "return_logprob": True, "logprob_start_len": 3}
            check_generate_request(score)
            async with s.post(handle.url + "/generate", json=score) as r:
                bodies = await r.json()
            for b, tail in zip(bodies, ([4], [5, 6])):
                check_generate_response(b, True, None)
                assert b["output_ids"] == [] and [e[1] for e in b["meta_info"]["input_token_logprobs"]] == tail
                for e in b["meta_info"]["input_token_logprobs"]:
                    _triple(e)
            async with s.get(handle.url + "/get_model_info") as r:
                info = await r.json()
            assert isinstance(info["model_path"], str) and info["is_generation"] is True
            async with s.get(handle.url + "/health") as r:
                assert r.status == 200
            async with s.get(handle.url + "/health_generate") as r:
                assert r.status == 200
            # the embedded engine takes SGLang's update payload (string weight_version, extra flags)
            upd = {"model_path": "/does/not/exist", "load_format": "auto", "weight_version": "3", "flush_cache": True}
            check_fields(upd, UPDATE_FIELDS, "UpdateWeightFromDiskReqInput")
            async with s.post(handle.url + "/update_weights_from_disk", json=upd) as r:
                out = await r.json()
            assert isinstance(out["success"], bool) and isinstance(out["message"], str) and out["success"] is False
    finally:
        await handle.stop()


@pytest.mark.slow
@pytest.mark.model
async def test_embedded_server_counts_scoring_requests_in_its_metrics(smollm2):
    """A scoring request (prefill log-probs, the policy's score mode) shows in the engine's /metrics
    as a request and as prompt tokens, as a decoding one does: rl_throughput reads them there."""
    from infra.engine.server import start_embedded_engine

    handle = await start_embedded_engine(loaded=smollm2, max_batch_size=4)
    try:
        async with aiohttp.ClientSession() as s:
            score = {"input_ids": [[1, 2, 3, 4], [1, 2, 3, 5, 6]], "sampling_params": {"max_new_tokens": 0},
                     "return_logprob": True, "logprob_start_len": 3}
            async with s.post(handle.url + "/generate", json=score) as r:
                assert r.status == 200, await r.text()
            async with s.get(handle.url + "/metrics") as r:
                text = await r.text()
        values = {x.name: x.value for f in text_string_to_metric_families(text) for x in f.samples}
        assert values["engine_server_request_seconds_count"] == 1
        assert values["engine_prompt_tokens_total"] == 9
        assert values["engine_server_generated_tokens_total"] == 0
    finally:
        await handle.stop()


def test_launcher_flags_are_sglang_server_args():
    from infra.config import EngineConfig
    from infra.engine.sglang import build_command

    cfg = EngineConfig(model="/models/mexp", sglang_tp_size=2, sglang_mem_fraction=0.7, sglang_port=30100,
                       sglang_extra_args=["--enable-deterministic-inference"])
    cmd = build_command(cfg, python="python")
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--model-path"] == "/models/mexp" and flags["--port"] == "30100"
    assert flags["--tp-size"] == "2" and flags["--mem-fraction-static"] == "0.7" and flags["--dtype"] == "float32"
    assert cmd[-2:] == ["--enable-metrics", "--enable-deterministic-inference"]
    assert flags["--host"] == "127.0.0.1" and "--api-key" not in cmd  # loopback and no key by default
    cmd = build_command(EngineConfig(model="/m", host="0.0.0.0", api_key="k"), python="python")
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--host"] == "0.0.0.0" and flags["--api-key"] == "k"
