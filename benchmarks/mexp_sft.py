"""Seconds per Mexp SFT step in each batch layout (simulator.sft_layout), on the real examples.

Builds the Mexp SFT examples of a config exactly as `dreamgym train` does (learner/mexp_sft.py
`sft_data`: the offline trajectories in its data directory, retrieval from a buffer of the train
split, the preset's cap and reward share), then, in one process and one run, times `--steps`
training steps (forward, backward, AdamW on `simulator.sft_batch_size` examples) from the same
weights in each layout: 'padded' (one right-padded forward, logits everywhere: the GPU's) and
'unpadded' (one forward per example, the LM head only where a target token is predicted: the
CPU's). The batches are the same in both; their losses must agree.

    python benchmarks/mexp_sft.py [--config configs/experiments/base/textworld_cpu.yaml] [--steps 6]
        [--threads 2] [override ...]

Needs the config's offline data (`dreamgym collect`, or any `dreamgym train` / `dreamgym
experiment` run with that config, builds it). Prints seconds per step, tokens/s and the ratio,
with the load average beside each figure: a shared CPU is noisy, compare ratios of one run.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's code

from infra.config import load_config  # noqa: E402
from learner.mexp_sft import IGNORE, prepare_model, sft_data, train_step  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/experiments/base/textworld_cpu.yaml")
    ap.add_argument("--steps", type=int, default=6, help="training steps timed per layout (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)
    sim = cfg.simulator
    base, tok = prepare_model(sim.mexp_model or cfg.engines.model, sim.sft_lora_rank, "cpu")
    data = sft_data(sim, cfg.infra.data_dir, tok, cfg.actors.env_family, cfg.infra.seed)
    order = list(range(len(data.train)))
    random.Random(cfg.infra.seed).shuffle(order)
    batches = [[data.train[j] for j in order[i:i + sim.sft_batch_size]]
               for i in range(0, sim.sft_batch_size * args.steps, sim.sft_batch_size)]
    real = sum(len(e.input_ids) for b in batches for e in b)
    padded_tokens = sum(len(b) * max(len(e.input_ids) for e in b) for b in batches)
    target = sum(len(e.labels) - e.labels.count(IGNORE) for b in batches for e in b)
    print(f"{len(data.train)} examples; {args.steps} steps of {sim.sft_batch_size}: {real} tokens "
          f"({padded_tokens} padded), {target} of them targets; {args.threads} threads")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    seconds, losses = {}, {}
    for layout in ("padded", "unpadded"):
        model = copy.deepcopy(base).train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=sim.sft_lr, weight_decay=0.0)
        losses[layout] = []
        t0 = time.perf_counter()
        for b in batches:
            losses[layout].append(train_step(model, opt, b, pad, sim.sft_outcome_weight, layout=layout))
        seconds[layout] = time.perf_counter() - t0
        load = os.getloadavg()[0]
        print(f"{layout:>9}: {seconds[layout] / args.steps:6.1f} s/step, {real / seconds[layout]:6.0f} tokens/s "
              f"(losses {' '.join(f'{x:.3f}' for x in losses[layout])}) [load {load:.1f}]")
    gap = max(abs(a - b) for a, b in zip(losses["padded"], losses["unpadded"]))
    print(f"unpadded / padded speed: {seconds['padded'] / seconds['unpadded']:.2f}x; largest loss gap over "
          f"{args.steps} steps {gap:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
