"""The scorer's prompt cache on a real workload: the warm start's validation, cache off against on.

Plays the validation games of a config's best warm start (learner/sft_validation.py: the same
seeded split of the offline data, the same greedy score-mode episodes in real TextWorld) with a
policy, once with `engines.score_cache_mb=0` and once with it set, in one process, one after the
other. Prints each pass's wall time, the ratio, the share of prompt tokens taken from the cache,
whether every game went the same way (success and steps), and the load average beside each.

    python benchmarks/score_cache.py configs/experiments/base/textworld_long.yaml --limit 12
    python benchmarks/score_cache.py CONFIG --model runs/<exp>/<regime>/... --cache-mb 256

Needs the config's offline data (any `dreamgym experiment` or `dreamgym collect` of it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="a train config whose data directory holds offline data")
    p.add_argument("--model", default="", help="the policy to play (default: the config's engines.model, untrained)")
    p.add_argument("--limit", type=int, default=12, help="validation games to play (default 12)")
    p.add_argument("--cache-mb", type=float, default=256.0, help="engines.score_cache_mb of the cached pass")
    p.add_argument("--json", default="", help="also write the figures to this file")
    args = p.parse_args()

    import torch

    from infra.config import load_config
    from infra.engine import scorer
    from learner.policy_model import PolicyModel
    from learner.policy_sft import is_expert
    from learner.precision import Precision
    from learner.sft_validation import play_validation, validation_split
    from simulator.mexp_data import load_offline

    cfg = load_config(args.config, [f"engines.model={args.model}"] if args.model else [])
    lc = cfg.learner
    offline = load_offline(cfg.infra.data_dir, cfg.actors.env_family)
    _, _, tasks = validation_split(offline, lc.warm_start_val_fraction, lc.warm_start_val_min_tasks, cfg.infra.seed,
                                   eligible=lambda t: is_expert(t) and t.success)
    tasks = tasks[:args.limit]
    torch.set_num_threads(lc.threads)
    policy = PolicyModel(cfg.engines.model, precision=Precision.checked(lc.device, lc.dtype, "learner.device",
                                                                       "learner.dtype"), score_layout=lc.score_layout)
    seen: list = []  # the cached pass's ScoreCache objects, for its hit counts
    real = scorer.ScoreCache

    def spy(*a, **k):
        seen.append(real(*a, **k))
        return seen[-1]

    scorer.ScoreCache = spy
    rows = {}
    for mb in (0.0, args.cache_mb):
        cfg.engines.score_cache_mb = mb
        t0 = time.perf_counter()
        report = play_validation(policy.lm, policy.tokenizer, cfg, tasks)
        wall = time.perf_counter() - t0
        rows[mb] = {"cache_mb": mb, "seconds": round(wall, 1), "success": report["success_rate"],
                    "outcomes": [(t["task_id"], t["success"], t["steps"]) for t in report["per_task"]],
                    "load": [round(x, 2) for x in os.getloadavg()]}
        print(f"cache {mb:g} MB: {len(tasks)} games in {wall:.1f} s, success {report['success_rate']:.3f} "
              f"[load {rows[mb]['load'][0]:.2f}]", flush=True)
    scorer.ScoreCache = real
    off, on = rows[0.0], rows[args.cache_mb]
    hit = sum(c.hit_tokens for c in seen)
    asked = sum(c.prompt_tokens for c in seen)
    out = {"config": args.config, "model": cfg.engines.model, "games": len(tasks), "off": off, "on": on,
           "speedup": round(off["seconds"] / on["seconds"], 2), "same_outcomes": off["outcomes"] == on["outcomes"],
           "cached_token_share": round(hit / asked, 3) if asked else None}
    print(f"speedup {out['speedup']}x; prompt tokens from the cache {hit} of {asked} "
          f"({100 * (out['cached_token_share'] or 0):.0f} %); same outcomes game for game: {out['same_outcomes']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
