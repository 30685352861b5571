"""`dreamgym generate`: one request to any SGLang-compatible endpoint, printed.

Owns nothing but the command: it goes through `infra.engine.client.EngineClient`, so
it exercises exactly what rollout workers use. With `--chat` the prompt is wrapped in
the served model's chat template (read from the local tokenizer of `--model`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

from infra.engine.client import EngineClient, EngineError
from infra.engine.models import load_tokenizer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:30000", help="engine base URL (default: %(default)s)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=64, help="cap on generated tokens (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--logprobs", action="store_true", help="print each generated token's log-prob")
    p.add_argument("--chat", action="store_true", help="apply the chat template of --model to the prompt")
    p.add_argument("--model", default="smollm2", help="tokenizer for --chat (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the raw result as JSON")
    p.add_argument("--timeout", type=float, default=300.0, help="request timeout in seconds (default: %(default)s)")
    p.add_argument("--api-key", default=None,
                   help="Bearer token for an engine started with --api-key (default: DREAMGYM_API_KEY from the environment)")


def run(args: argparse.Namespace) -> int:
    prompt = args.prompt
    if args.chat:
        prompt = load_tokenizer(args.model).apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                                add_generation_prompt=True)
    sp: dict = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p}
    if args.seed is not None:
        sp["sampling_seed"] = args.seed
    if args.stop:
        sp["stop"] = args.stop

    async def once():
        key = args.api_key if args.api_key is not None else os.environ.get("DREAMGYM_API_KEY", "")
        async with EngineClient([args.url], role="cli", timeout_s=args.timeout, max_retries=0, api_key=key) as client:
            return await client.generate(prompt, sampling_params=sp, return_logprob=args.logprobs)

    try:
        res = asyncio.run(once())
    except EngineError as exc:
        print(f"dreamgym generate: {exc}")
        return 1
    if args.json:
        print(json.dumps({"text": res.text, "output_ids": res.output_ids, "output_logprobs": res.output_logprobs,
                          "finish_reason": res.finish_reason, "weight_version": res.weight_version,
                          "prompt_tokens": res.prompt_tokens}))
        return 0
    print(res.text)
    print(f"-- {len(res.output_ids)} tokens, finish={res.finish_reason}, weight_version={res.weight_version}, "
          f"prompt_tokens={res.prompt_tokens}")
    if args.logprobs:
        for tok, lp in zip(res.output_ids, res.output_logprobs):
            print(f"{tok:>8} {lp:9.4f}")
    return 0
