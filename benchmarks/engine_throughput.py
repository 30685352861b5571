"""Aggregate generated tokens/s of the embedded engine at 1, 4 and 16 concurrent requests.

Baseline: sequential `model.generate` (greedy, KV cache) on the same model in the
same process, one request at a time, which is what a worker without an engine
would do. Every request generates exactly `--tokens` tokens (EOS ignored) from a
chat-templated prompt, so token counts are equal on both sides. The engine is
reached over HTTP through `EngineClient`, as the rollout workers reach it. With
`--compare-url` the same concurrency levels are also run against any
OpenAI-compatible `/v1/completions` server (such as llama-cpp-python's).

    python benchmarks/engine_throughput.py [--tokens 64] [--compare-url http://127.0.0.1:8000]

On a GPU, with a randomly initialised model of a real size (its text is garbage,
which does not matter: every request generates exactly --tokens tokens):

    PYTHONPATH=. python benchmarks/engine_throughput.py --device cuda --random-init llama-1b \
        --tokenizer DIR --tokens 128 --concurrency 1,8,32,64

`--random-init` takes a preset (llama-1b, llama-3b) or a LlamaConfig as JSON (a
string or a file); the model is built in bf16 with SmolLM2's tokenizer, saved to a
temporary Hugging Face directory and loaded from there as `dreamgym serve` would.
Only torch, transformers, aiohttp and prometheus-client are imported (no gguf when
--tokenizer names a directory).

Prints tokens/s per setting and the ratios to sequential generate; the issue's target
is >= 5x at 16 concurrent requests. Figures from a shared CPU are noisy: compare the
ratios measured in one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time

import torch

# Llama shapes with SmolLM2's vocabulary (its tokenizer drives the prompts).
PRESETS = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=49152, max_position_embeddings=4096),
    "llama-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                     num_key_value_heads=8, vocab_size=49152, max_position_embeddings=4096),
}

TOPICS = ["a lighthouse", "the moon", "a robot cook", "an old map", "a quiet library", "a mountain village",
          "a lost key", "the ocean", "a clockmaker", "a desert train", "a winter garden", "a paper boat",
          "a city at night", "a talking cat", "a volcano", "a music box"]


def prompts(tok, n: int) -> list[str]:
    return [tok.apply_chat_template([{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]}."}],
                                    tokenize=False, add_generation_prompt=True) for i in range(n)]


def random_init_model(spec: str, tokenizer: str, out_dir: str) -> str:
    """Save a random-init bf16 Llama (preset name or LlamaConfig JSON) with `tokenizer` into `out_dir`."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from infra.model_loading import load_tokenizer

    if spec in PRESETS:
        kw = dict(PRESETS[spec])
    elif os.path.exists(spec):
        with open(spec) as f:
            kw = json.load(f)
    else:
        kw = json.loads(spec)
    tok = load_tokenizer(tokenizer)
    if len(tok) > kw.get("vocab_size", 0):
        raise SystemExit(f"vocab_size {kw.get('vocab_size')} is smaller than the tokenizer's {len(tok)}")
    kw.setdefault("bos_token_id", tok.bos_token_id)
    kw.setdefault("eos_token_id", tok.eos_token_id)
    kw.setdefault("pad_token_id", tok.pad_token_id)
    config = LlamaConfig(**kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    print(f"random-init {spec}: {params / 1e9:.2f} B parameters, bf16, saved to {out_dir}; config {kw}")
    del model
    return out_dir


def sequential_generate(model, tok, texts: list[str], tokens: int) -> float:
    done = 0
    device = model.device
    t0 = time.perf_counter()
    for text in texts:
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids.to(device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                                 do_sample=False, pad_token_id=tok.pad_token_id)
        done += out.shape[1] - ids.shape[1]
    return done / (time.perf_counter() - t0)


async def engine_rate(url: str, texts: list[str], tokens: int, concurrency: int) -> float:
    from infra.engine_client import EngineClient

    sp = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    queue = list(texts)
    done = 0

    async def worker(client) -> None:
        nonlocal done
        while queue:
            res = await client.generate(queue.pop(), sampling_params=sp)
            done += len(res.output_ids)

    async with EngineClient([url], role="bench", timeout_s=1800) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return done / (time.perf_counter() - t0)


async def openai_rate(url: str, texts: list[str], tokens: int, concurrency: int) -> float:
    import aiohttp

    queue = list(texts)
    done = 0

    async def worker(session) -> None:
        nonlocal done
        while queue:
            body = {"prompt": queue.pop(), "max_tokens": tokens, "temperature": 0.0}
            async with session.post(url.rstrip("/") + "/v1/completions", json=body) as r:
                done += (await r.json())["usage"]["completion_tokens"]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
        return done / (time.perf_counter() - t0)


async def main(args: argparse.Namespace) -> None:
    from infra.model_loading import load_model

    tmp = None
    name, dtype = args.model, args.dtype
    if args.random_init:
        tmp = tempfile.mkdtemp(prefix="dreamgym-randinit-")
        name, dtype = random_init_model(args.random_init, args.tokenizer, tmp), "bfloat16"
    try:
        model, tok = load_model(name, dtype, args.device)
        await run_benchmark(args, model, tok, name if not args.random_init else f"random-init {args.random_init}")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


async def run_benchmark(args: argparse.Namespace, model, tok, label: str) -> None:
    from infra.engine_server import start_embedded_engine

    cores = len(os.sched_getaffinity(0))
    if model.device.type == "cpu":
        torch.set_num_threads(min(torch.get_num_threads(), cores))
        where = f"cpu, torch threads={torch.get_num_threads()}"
    else:
        where = f"{model.device} ({torch.cuda.get_device_name(model.device)})"
    print(f"model={label} dtype={model.dtype} device={where} tokens/request={args.tokens} "
          f"cores={cores} load average={os.getloadavg()[0]:.1f}")
    levels = [int(c) for c in args.concurrency.split(",")]
    texts = prompts(tok, max(levels) * args.rounds)

    # warm-up, then the baseline
    sequential_generate(model, tok, texts[:1], 4)
    seq_before = sequential_generate(model, tok, texts[: args.sequential_requests], args.tokens)
    print(f"sequential model.generate (before): {seq_before:7.1f} tokens/s  load average={os.getloadavg()[0]:.1f}")

    handle = await start_embedded_engine(loaded=(model, tok), max_batch_size=max(levels))
    rows = []
    try:
        await engine_rate(handle.url, texts[:1], 4, 1)
        for c in levels:
            n = c * args.rounds if c > 1 else args.sequential_requests
            rate = await engine_rate(handle.url, texts[:n], args.tokens, c)
            rows.append(("embedded engine", c, rate))
            print(f"embedded engine, {c:2d} concurrent: {rate:7.1f} tokens/s  load average={os.getloadavg()[0]:.1f}")
    finally:
        await handle.stop()
    # The CPU is shared: measure the baseline again afterwards and compare with the mean.
    seq_after = sequential_generate(model, tok, texts[: args.sequential_requests], args.tokens)
    seq = (seq_before + seq_after) / 2
    print(f"sequential model.generate (after):  {seq_after:7.1f} tokens/s  load average={os.getloadavg()[0]:.1f}")
    print(f"sequential model.generate (mean):   {seq:7.1f} tokens/s")
    for _, c, rate in rows:
        print(f"  ratio, embedded engine at {c:2d} concurrent / sequential generate: {rate / seq:5.2f}x")
    if args.compare_url:
        for c in levels:
            n = c * args.rounds if c > 1 else args.sequential_requests
            rate = await openai_rate(args.compare_url, texts[:n], args.tokens, c)
            engine = next(r for _, cc, r in rows if cc == c)
            print(f"{args.compare_url}, {c:2d} concurrent: {rate:7.1f} tokens/s  = {rate / seq:5.2f}x sequential; "
                  f"embedded engine = {engine / rate:5.2f}x this server")
    top = rows[-1]
    verdict = "meets" if top[2] / seq >= 5 else "misses"
    print(f"ratio at {top[1]} concurrent: {top[2] / seq:.2f}x sequential generate ({verdict} the 5x target)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--rounds", type=int, default=1, help="requests per concurrent client")
    p.add_argument("--sequential-requests", type=int, default=3, help="requests for the sequential baselines")
    p.add_argument("--compare-url", default="", help="an OpenAI-compatible server to compare with")
    p.add_argument("--device", default="cpu", help="torch device for the model and the engine (cpu, cuda, cuda:1)")
    p.add_argument("--dtype", default="float32", help="torch dtype of --model (random-init models are bfloat16)")
    p.add_argument("--random-init", default="", metavar="CONFIG_JSON_OR_PRESET",
                   help=f"benchmark a random-init Llama instead of --model: a preset ({', '.join(PRESETS)}), "
                        "a LlamaConfig JSON string or a JSON file")
    p.add_argument("--tokenizer", default="smollm2",
                   help="tokenizer for --random-init: 'smollm2' or a directory holding its tokenizer files")
    asyncio.run(main(p.parse_args()))
