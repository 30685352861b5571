"""Seconds per learner update and trained prompt tokens/s: full fine-tuning vs LoRA.

Builds one GRPO batch the way workers do (choice prompts from actors/policy.py with
the real tokenizer, behaviour log-probs from `choice_logprobs`), then times
`Learner._update` (forward, backward, AdamW; no streams) on the same batch for full
fine-tuning and for LoRA, in one process and one run. Use it to size
`learner.groups_per_update`, `actors.group_size` and `max_steps` for a machine.

    python benchmarks/learner_update.py [--groups 2] [--group-size 4] [--steps 4] [--repeats 2]

Prints seconds per update, prompt tokens/s and the LoRA/full speed ratio. A shared
CPU is noisy: compare the ratio measured in one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from actors.policy import build_choice_prompt, choice_logprobs
from infra.config import LearnerConfig
from infra.model_loading import load_model
from infra.schema import Status, Step, Task, Trajectory
from learner.advantages import group_advantages
from learner.learner import Learner, _Held, _Unit
from learner.policy_model import PolicyModel

ROOMS = ["Kitchen", "Hall", "Study", "Cellar", "Garden", "Attic"]


def batch(model, tok, groups: int, group_size: int, steps: int) -> list[_Unit]:
    units = []
    for g in range(groups):
        task = Task(f"t{g}", f"find the key in the {ROOMS[g % len(ROOMS)].lower()} and open the chest")
        members = []
        for i in range(group_size):
            traj = Trajectory(task_id=task.task_id, group_id=f"g{g}", task=task, status=Status.FAILURE)
            hist: list[str] = []
            for t in range(steps):
                cands = [f"go {d}" for d in ("north", "south", "east", "west")] + ["take key", "open chest", "look"]
                state = (f"Goal: {task.instruction}\nRoom: {ROOMS[(g + t) % len(ROOMS)]}. A dusty room with a table "
                         f"and a chest.\nInventory: nothing\nActions:\n" + "\n".join(f"[{k + 1}] {c}" for k, c in enumerate(cands)))
                prompt, labels = build_choice_prompt(tok, task, state, cands, hist)
                c = (g + i + t) % len(cands)
                with torch.no_grad():
                    lp = float(choice_logprobs(model, tok, [prompt], [labels], [labels[c]])[0])
                traj.steps.append(Step(state=state, action=cands[c], reward=float(i % 2) if t == steps - 1 else 0.0,
                                       done=t == steps - 1, policy_prompt=prompt, action_token_ids=[labels[c]],
                                       logprobs=[lp], loss_mask=[1], choice_token_ids=labels))
                hist.append(cands[c])
            members.append(_Held(b"0-0", traj))
        units.append(_Unit(members, group_advantages([m.traj.total_reward for m in members]), [False] * group_size))
    return units


def time_updates(learner: Learner, units, repeats: int) -> float:
    learner._update(units)  # warm-up (allocator, first AdamW state)
    t0 = time.perf_counter()
    for _ in range(repeats):
        learner._update(units)
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--lora-rank", type=int, default=8)
    args = ap.parse_args()
    model, tok = load_model("smollm2")
    units = batch(model, tok, args.groups, args.group_size, args.steps)
    prompts = [s.policy_prompt for u in units for m in u.members for s in m.traj.steps]
    tokens = sum(len(tok(p, add_special_tokens=False).input_ids) for p in prompts)
    print(f"batch: {len(prompts)} prompts, {tokens} prompt tokens ({tokens / len(prompts):.0f}/prompt), "
          f"torch threads {torch.get_num_threads()}")
    results = {}
    for name, rank in (("full", 0), (f"lora-r{args.lora_rank}", args.lora_rank)):
        policy = PolicyModel(lora_rank=rank, model=copy.deepcopy(model), tokenizer=tok)
        learner = Learner(LearnerConfig(lora_rank=rank), "smollm2", "/tmp", consumer=None, policy=policy)
        s = time_updates(learner, units, args.repeats)
        results[name] = s
        print(f"{name:>10}: {s:7.1f} s/update, {tokens / s:6.1f} prompt tokens/s")
        del learner, policy
    full, lora = results["full"], results[f"lora-r{args.lora_rank}"]
    print(f"LoRA speed-up over full fine-tuning: {full / lora:.2f}x")


if __name__ == "__main__":
    main()
