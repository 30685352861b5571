"""Seconds per learner update and learner tokens/s: per-step vs packed multi-turn, against bare fwd+bwd.

Builds one GRPO batch the way workers do (prompts from actors/policy.py's `choice_turn`
with the real tokenizer, behaviour log-probs from `choice_logprobs`), once per prompt
mode: per-step (a fresh prompt per step, the last 3 actions) and multi-turn (the episode
as one chat, so the learner packs each trajectory into one sequence). Then, in one
process and one run, it times `learner.update.apply_update` (forward, backward, AdamW;
no streams) on each batch, and a bare forward+backward over exactly the sequences the
update runs (the packed ones, one per trajectory) with nothing else: the update's
share of the bare tokens/s is the learner's overhead (goal >= 90 %). `--lora-rank`
adds a LoRA run of the packed batch.

    python benchmarks/learner_update.py [--groups 1] [--group-size 2] [--steps 4] [--repeats 1] [--lora-rank 0]
        [--device cuda --dtype bfloat16]

`--score N` times instead the score-mode forward+backward of N steps of real TextWorld games
(the policy scores each candidate action's text; learner/policy_model.py's `scored_logprobs`),
groups of 4 episodes of 3 steps in micro-batches of `--micro-batch` steps as the learner runs
them, in each layout (learner.score_layout): a forward pair per prompt, the padded batch (the
GPU's default) and the token tree (the CPU's), and checks they agree.

On a GPU (`--device cuda --dtype bfloat16`: the learner's mixed precision, fp32 master
weights under bf16 autocast, learner/precision.py) `--model` may name any Hugging Face
directory, e.g. a random-init one of SmolLM2's config: the compute is the same.

Prints seconds per update, learner tokens/s (tokens through the model) and the steps
trained per second, with the load average beside each figure. A shared CPU is noisy:
compare ratios measured in one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's code

from actors.envs.textworld_env import TextWorldEnv, generate_game, tasks_from_games  # noqa: E402
from actors.policy import PolicyDecision, choice_turn, score_turn  # noqa: E402
from learner.choice_logprobs import choice_logprobs, pack_prompts, packed_forward
from infra.config import LearnerConfig  # noqa: E402
from infra.engine.models import load_model  # noqa: E402
from infra.schema import Status, Step, Task, Trajectory  # noqa: E402
from learner.advantages import group_advantages  # noqa: E402
from learner.policy_model import PolicyModel, scored_logprobs  # noqa: E402
from learner.precision import Precision  # noqa: E402
from learner.update import Unit, apply_update, chunks_of, rows_of  # noqa: E402

ROOMS = ["Kitchen", "Hall", "Study", "Cellar", "Garden", "Attic"]
CANDS = [f"go {d}" for d in ("north", "south", "east", "west")] + ["take key", "open chest", "look"]


def batch(model, tok, groups: int, group_size: int, steps: int, multi_turn: bool) -> list[Unit]:
    units = []
    for g in range(groups):
        task = Task(f"t{g}", f"find the key in the {ROOMS[g % len(ROOMS)].lower()} and open the chest")
        members = []
        for i in range(group_size):
            traj = Trajectory(task_id=task.task_id, group_id=f"g{g}", task=task, status=Status.FAILURE)
            history: list = []
            for t in range(steps):
                state = (f"Goal: {task.instruction}\nRoom: {ROOMS[(g + t) % len(ROOMS)]}. A dusty room with a table "
                         f"and a chest.\nInventory: nothing\nActions:\n" + "\n".join(f"[{k + 1}] {c}" for k, c in enumerate(CANDS)))
                turn = choice_turn(tok, task, state, CANDS, history, multi_turn=multi_turn)
                c = (g + i + t) % len(CANDS)
                with torch.no_grad():
                    lp = float(choice_logprobs(model, tok, [turn.prompt], [turn.labels], [turn.labels[c]])[0])
                traj.steps.append(Step(state=state, action=CANDS[c], reward=float(i % 2) if t == steps - 1 else 0.0,
                                       done=t == steps - 1, policy_prompt=turn.prompt, action_token_ids=[turn.labels[c]],
                                       logprobs=[lp], loss_mask=[1], choice_token_ids=turn.labels))
                history.append(PolicyDecision(CANDS[c], c, turn.prompt, [turn.labels[c]], [lp], turn.labels, 0,
                                              messages=turn.messages))
            members.append(traj)
        units.append(Unit(members, group_advantages([t.total_reward for t in members]), [False] * group_size))
    return units


def load() -> str:
    return "load %.2f %.2f %.2f" % os.getloadavg()


def time_update(policy: PolicyModel, cfg: LearnerConfig, units, repeats: int) -> tuple[float, int]:
    """(seconds per update, tokens per update); a one-step update first warms the allocator and AdamW."""
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=cfg.lr, weight_decay=0.0)
    first = units[0].trajs[0]
    warm = Unit([Trajectory(task_id=first.task_id, group_id="w", steps=first.steps[:1], task=first.task)], [1.0], [False])
    apply_update(policy, optimizer, cfg, [warm], 0)
    sync(cfg.device)
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(repeats):
        tokens = apply_update(policy, optimizer, cfg, units, 0).tokens
    sync(cfg.device)
    return (time.perf_counter() - t0) / repeats, tokens


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def time_bare(model, tok, cfg: LearnerConfig, units, repeats: int) -> tuple[float, int]:
    """A bare forward+backward over the very sequences a packed update runs (its micro-batches, a
    group's common first turn run once as learner/policy_model.py does): no loss maths, no optimizer."""
    rows = rows_of(units)
    chunks = []
    for idx in chunks_of(rows, cfg.micro_batch):
        steps = [s for i in idx for s in rows[i].steps]
        chunks.append(pack_prompts(tok, [s.policy_prompt for s in steps], [s.action_token_ids[0] for s in steps]))
    model.train()
    precision = Precision(cfg.device, cfg.dtype)
    model.to(cfg.device)
    sync(cfg.device)
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(repeats):
        tokens = 0
        for segments in chunks:
            with precision.autocast():
                logits, _, n = packed_forward(model, segments, share_prefix=True)
            logits.float().sum().backward()
            tokens += n
        model.zero_grad(set_to_none=True)
    sync(cfg.device)
    return (time.perf_counter() - t0) / repeats, tokens


def textworld_steps(tok, groups: int, group_size: int, steps: int, games_dir: str, seed: int = 0) -> list[tuple]:
    """Score-mode steps of real TextWorld games (family 'custom', made with tw-make once into
    `games_dir`), in the learner's row order: per game a group of `group_size` episodes of at most
    `steps` steps, each following the expert 70 % of the time and else a random candidate (about an
    SFT policy's agreement). (prompt, candidates' token ids, chosen index) per step."""
    rng = random.Random(seed)
    paths = [generate_game("custom", s, games_dir) for s in range(groups)]
    env = TextWorldEnv(max_steps=steps)
    out = []
    try:
        for task in tasks_from_games(paths, [("custom", s) for s in range(groups)]):
            for _ in range(group_size):
                state, info = env.reset_sync(task)
                history: list[str] = []
                for _ in range(steps):
                    cands, expert = info["candidates"], info["expert_action"]
                    act = expert if expert in cands and rng.random() < 0.7 else rng.choice(cands)
                    turn = score_turn(tok, task, state, cands, history=history)
                    out.append((turn.prompt, turn.continuations, cands.index(act)))
                    history.append(act)
                    state, _, done, info = env.step_sync(act)
                    if done:
                        break
    finally:
        env.close_sync()
    return out


def time_scored(model, tok, precision: Precision, n: int, repeats: int, micro_batch: int, games_dir: str) -> None:
    """Score mode's forward+backward over n real TextWorld steps (groups of 4 episodes of 3 steps),
    in micro-batches of `micro_batch` steps as the learner runs them, per layout in one run."""
    steps = textworld_steps(tok, max(1, -(-n // 12)), 4, 3, games_dir)[:n]
    chunks = [steps[i:i + micro_batch] for i in range(0, len(steps), micro_batch)]
    model.to(precision.device).train()
    layouts = ("per-prompt", "padded", "tree")
    seconds = {k: [] for k in layouts}
    tokens, got = {}, {}
    for _ in range(repeats + 1):  # the first round warms up
        for layout in layouts:
            sync(precision.device)
            t0 = time.perf_counter()
            tokens[layout], lps = 0, []
            for chunk in chunks:
                with precision.autocast():
                    lp, _, k = scored_logprobs(model, tok, [c[0] for c in chunk], [c[1] for c in chunk],
                                               [c[2] for c in chunk], layout=layout)
                lp.float().sum().backward()
                model.zero_grad(set_to_none=True)
                tokens[layout] += k
                lps.append(lp.detach().float())
            sync(precision.device)
            seconds[layout].append(time.perf_counter() - t0)
            got[layout] = torch.cat(lps)
    best = {k: min(v[1:]) for k, v in seconds.items()}
    gap = max(float((got[k] - got["per-prompt"]).abs().max()) for k in layouts)
    print(f"score mode, {len(steps)} real TextWorld steps in micro-batches of {micro_batch}, forward+backward "
          f"(best of {repeats}); largest log-prob gap {gap:.1e}")
    for layout in layouts:
        print(f"{layout:>12}: {best[layout]:6.1f} s, {tokens[layout]:6d} tokens run; "
              f"{best['padded'] / best[layout]:.2f}x the padded batch's speed  ({load()})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--lora-rank", type=int, default=0, help="also time LoRA of this rank on the packed batch (0 = no)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    ap.add_argument("--model", default="smollm2", help="'smollm2' or a Hugging Face model directory")
    ap.add_argument("--device", default="cpu", help="the learner's torch device: cpu, cuda, cuda:N")
    ap.add_argument("--dtype", default="float32", help="float32, or bfloat16 (mixed precision, learner/precision.py)")
    ap.add_argument("--score", type=int, default=0, metavar="N",
                    help="time score mode's forward+backward over N real TextWorld steps per layout "
                         "(per-prompt, padded, tree), and stop")
    ap.add_argument("--micro-batch", type=int, default=8, help="--score: steps per forward+backward (learner.micro_batch)")
    ap.add_argument("--games-dir", default=os.path.join(tempfile.gettempdir(), "dreamgym-bench-games"),
                    help="--score: where the TextWorld games are made (once) and read")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    where = f"{args.device} {args.dtype}" + (f" ({torch.cuda.get_device_name(args.device)})"
                                             if args.device.startswith("cuda") else "")
    if args.score:
        precision = Precision.checked(args.device, args.dtype, "--device", "--dtype")
        print(f"torch threads {torch.get_num_threads()}, {where}")
        time_scored(model, tok, precision, args.score, args.repeats, args.micro_batch, args.games_dir)
        return
    n_steps = args.groups * args.group_size * args.steps
    print(f"{args.groups} group(s) x {args.group_size} trajectories x {args.steps} steps = {n_steps} steps, "
          f"torch threads {torch.get_num_threads()}, {where}")
    results = {}
    runs = [("per-step", False, 0), ("packed", True, 0)]
    if args.lora_rank:
        runs.append((f"packed lora-r{args.lora_rank}", True, args.lora_rank))
    for name, multi_turn, rank in runs:
        units = batch(model, tok, args.groups, args.group_size, args.steps, multi_turn)
        cfg = LearnerConfig(lora_rank=rank, device=args.device, dtype=args.dtype)
        policy = PolicyModel(lora_rank=rank, model=copy.deepcopy(model), tokenizer=tok,
                             precision=Precision.checked(args.device, args.dtype, "--device", "--dtype"))
        s, tokens = time_update(policy, cfg, units, args.repeats)
        results[name] = s
        print(f"{name:>16}: {s:6.1f} s/update, {tokens:5d} tokens, {tokens / s:6.1f} learner tokens/s, "
              f"{n_steps / s:5.2f} steps/s  ({load()})")
        del policy
        if name == "packed":
            bare_s, bare_tokens = time_bare(copy.deepcopy(model), tok, cfg, units, args.repeats)
            assert bare_tokens == tokens, (bare_tokens, tokens)
            print(f"{'bare fwd+bwd':>16}: {bare_s:6.1f} s, {bare_tokens:5d} tokens, {bare_tokens / bare_s:6.1f} tokens/s"
                  f"  ({load()})")
            print(f"{'':>16}  packed update = {bare_s / s:.0%} of bare fwd+bwd tokens/s (goal >= 90 %)")
    print(f"packed vs per-step: {results['per-step'] / results['packed']:.2f}x faster per update")


if __name__ == "__main__":
    main()
