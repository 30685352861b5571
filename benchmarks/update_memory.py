"""Peak memory and seconds of one score-mode learner update, by micro-batching, on real ALFWorld steps.

A score-mode step runs its prompt and every admissible command through the policy, so what a
forward/backward pass holds grows with its tokens, not its steps: ALFWorld's real GRPO was
killed at `learner.micro_batch` 32 (23.2 GB) and needed 4 (collection 55). This measures, in
one run, one GRPO update (`learner.update.apply_update`: forward, backward, AdamW) of the same
batch under each setting given, each in a fresh child process (its peak resident memory is
the kernel's ru_maxrss; the model's own load is printed too, so the update's increment reads
off). The batch: `--groups` groups of `--group-size` episodes of real ALFWorld problems of the
config's train split, at most `--steps` steps each, following the expert 70 % of the time
(about an SFT policy's agreement), prompts and candidates as actors/score_mode.py builds them.

    python benchmarks/update_memory.py [configs/experiments/base/alfworld_cpu.yaml] \
        [--settings micro_batch=4 micro_batch=32,micro_batch_tokens=2048] [--groups 1 --group-size 4 --steps 8]

Every setting trains the same batch from the same weights; their gradients are equal by
construction (tests/test_update.py): the loss printed is the same, and the weights after the
update differ from the first setting's by float noise that AdamW's normalised step can raise to
about its learning rate on entries whose gradient is near zero. Figures are printed with the load average.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import resource
import sys
import tempfile
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's code

import torch  # noqa: E402

from actors.envs.registry import load_or_make_splits, make_env  # noqa: E402
from actors.score_mode import score_turn  # noqa: E402
from infra.config import LearnerConfig, load_config  # noqa: E402
from infra.engine.models import load_tokenizer  # noqa: E402
from infra.schema import Status, Step, Trajectory  # noqa: E402
from learner.advantages import group_advantages  # noqa: E402
from learner.policy_model import PolicyModel  # noqa: E402
from learner.update import Unit, apply_update, micro_batches, rows_of, step_costs  # noqa: E402


def load() -> str:
    return "load %.2f %.2f %.2f" % os.getloadavg()


def alfworld_batch(cfg, tok, groups: int, group_size: int, steps: int, seed: int = 0) -> list[Unit]:
    """Score-mode GRPO groups of real ALFWorld episodes (expert 70 % of the time, else a random command)."""
    rng = random.Random(seed)
    splits = load_or_make_splits("alfworld", cfg.data, cfg.infra.data_dir, seed=cfg.infra.seed)
    env = make_env("alfworld", max_steps=steps)
    units = []
    try:
        for g, task in enumerate(splits.train[:groups]):
            members = []
            for i in range(group_size):
                state, info = env.reset_sync(task)
                traj = Trajectory(task_id=task.task_id, group_id=f"g{g}", task=task, status=Status.FAILURE)
                history: list[str] = []
                for _ in range(steps):
                    cands, expert = info["candidates"], info.get("expert_action")
                    expert = expert() if callable(expert) else expert  # ALFWorld replans only when asked
                    act = expert if expert in cands and rng.random() < 0.7 else rng.choice(cands)
                    turn = score_turn(tok, task, state, cands, history=history)
                    k = cands.index(act)
                    before = state
                    state, reward, done, info = env.step_sync(act)
                    traj.steps.append(Step(state=before, action=act, reward=float(reward), done=done,
                                           policy_prompt=turn.prompt, action_token_ids=list(turn.continuations[k]),
                                           logprobs=[-float(torch.log(torch.tensor(float(len(cands)))))],
                                           loss_mask=[1], choice_token_ids=[t for c in turn.continuations for t in c],
                                           choice_lengths=[len(c) for c in turn.continuations]))
                    history.append(act)
                    if done:
                        break
                traj.status = Status.SUCCESS if traj.total_reward > 0 else Status.FAILURE
                members.append(traj)
            rewards = [t.total_reward for t in members]
            if len(set(rewards)) == 1:  # equal rewards give zero advantages: no gradient to measure
                rewards = [float(j % 2) for j in range(group_size)]
            units.append(Unit(members, group_advantages(rewards), [False] * group_size))
    finally:
        env.close_sync()
    return units


def one_update(setting: dict, units: list[Unit], reference: str, out: "mp.Queue") -> None:
    """A fresh process: load the policy, make one update under `setting`; report memory, time and the
    weights' largest difference to `reference` (saved there by the first setting's process)."""
    torch.manual_seed(0)
    policy = PolicyModel("smollm2")
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cfg = LearnerConfig(**setting)
    rows = rows_of(units)
    passes = len(micro_batches(rows, cfg.micro_batch, cfg.micro_batch_tokens,
                               step_costs(policy, rows) if cfg.micro_batch_tokens else None)[1])
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=cfg.lr, weight_decay=0.0)
    t0 = time.perf_counter()
    stats = apply_update(policy, opt, cfg, units, version=0)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    weights = {n: p.detach() for n, p in policy.named_parameters() if p.requires_grad}
    if os.path.exists(reference):
        first = torch.load(reference)
        gap = max(float((weights[n] - w).abs().max()) for n, w in first.items())
    else:
        torch.save(weights, reference)
        gap = 0.0
    out.put((loaded, peak, seconds, passes, stats.tokens, stats.loss, gap))


def parse_setting(text: str) -> dict:
    d = {}
    for kv in text.split(","):
        k, _, v = kv.partition("=")
        d[k.strip()] = int(v)
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default="configs/experiments/base/alfworld_cpu.yaml")
    ap.add_argument("--settings", nargs="+", default=["micro_batch=4", "micro_batch=32,micro_batch_tokens=2048"],
                    help="learner settings per run, e.g. micro_batch=32,micro_batch_tokens=2048")
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8, help="most steps an episode")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = load_config(args.config)
    tok = load_tokenizer(cfg.engines.model)
    t0 = time.perf_counter()
    units = alfworld_batch(cfg, tok, args.groups, args.group_size, args.steps)
    rows = rows_of(units)
    n_steps = sum(len(r.steps) for r in rows)
    costs = step_costs(SimpleNamespace(tokenizer=tok), rows)
    per_traj = [sum(c) for c in costs]
    print(f"batch: {len(units)} group(s), {len(rows)} ALFWorld episodes, {n_steps} score-mode steps, "
          f"{sum(per_traj)} tokens ({min(per_traj)}-{max(per_traj)} an episode, "
          f"{max(c for r in costs for c in r)} the largest step), built in {time.perf_counter() - t0:.0f} s")
    ctx = mp.get_context("spawn")
    reference = os.path.join(tempfile.mkdtemp(prefix="update-memory-"), "weights.pt")
    for text in args.settings:
        setting = parse_setting(text)
        q = ctx.Queue()
        p = ctx.Process(target=one_update, args=(setting, units, reference, q))
        p.start()
        loaded, peak, seconds, passes, tokens, loss, gap = q.get()
        p.join()
        print(f"{text:>40}: peak {peak / 1024:5.2f} GB (model loaded {loaded / 1024:.2f} GB, the update "
              f"+{(peak - loaded) / 1024:.2f} GB), {seconds:6.1f} s, {passes} passes, {tokens} tokens run, "
              f"loss {loss:+.5f}, weights vs the first {gap:.1e}  ({load()})")


if __name__ == "__main__":
    main()
