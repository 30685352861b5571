"""Supervised warm start of the policy on expert transitions, in choice form.

Owns turning offline expert trajectories (actors/dataset.py) into the exact prompts
the policy sees at rollout time (actors/policy.py's `choice_turn`, the
candidates recovered from the abstract state's numbered items, the previous actions
as history, the episode as one chat in multi-turn mode) and a short cross-entropy run on the expert's label. Measured: 2 epochs
on 128 expert steps took SmolLM2 from 0/9 to 6/9 treasure-hunter games.

Not in the paper (its policies start from instruction-tuned 3-8B models); here a
135M model needs it to be a non-trivial starting point for RL. The loss is the
negative of `choice_logprobs`, the same quantity RL optimises.

It trains on `learner.device` in `learner.dtype`, like the RL learner it hands over to
(learner/precision.py); the saved model is fp32 either way, loadable by any engine.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from rich.progress import Progress

from actors.dataset import offline_settings, read_trajectories, trajectories_path
from actors.envs.base import AbstractState, StateFormatError, candidate_actions
from actors.policy import MAX_CHAT_CHARS, MAX_CHOICES, PROMPT_FORMAT, PolicyDecision, choice_turn, score_turn
from infra.config import LearnerConfig, add_config_arguments, config_from_args, section_settings, settings_key
from infra.engine.models import load_tokenizer
from infra.schema import Task, Trajectory
from learner.policy_model import PolicyModel
from learner.precision import Precision

log = logging.getLogger(__name__)


@dataclass
class ChoiceExample:
    prompt: str
    labels: list  # label token ids; score mode: each candidate's token ids
    target: int  # the expert's label token id; score mode: the expert candidate's index


def is_expert(traj: Trajectory) -> bool:
    """Written by the scripted expert of `dreamgym collect` (noisy and random ones are not)."""
    return traj.timings.get("policy_name") == "expert" or traj.worker_id == "collect-expert"


def _task_of(traj: Trajectory, state: str) -> Task:
    if traj.task is not None:
        return traj.task
    goal = next((line[5:].strip() for line in state.splitlines() if line.startswith("Goal:")), "")
    return Task(traj.task_id, goal)


def expert_examples(trajectories: Iterable[Trajectory], tokenizer, history_window: int = 3,
                    only_successful: bool = True, permutations: int = 1, seed: int = 0, multi_turn: bool = False,
                    max_chat_chars: int = MAX_CHAT_CHARS, action_mode: str = "label") -> list[ChoiceExample]:
    """One example per valid expert step whose action is among the state's candidates, prompted
    as the rollout prompts it (`multi_turn`: the expert's earlier choices are the chat's answers),
    and `permutations - 1` more with the candidate list shuffled (seeded): environments list their
    admissible actions in a fixed order, so without shuffles a small policy learns the expert's
    usual letter rather than the action. The chat continues from the unshuffled turn. Score mode
    (`action_mode="score"`, per-step prompts): the shuffles reorder the listed possible actions."""
    out: list[ChoiceExample] = []
    skipped = 0
    rng = random.Random(seed)
    for traj in trajectories:
        if not is_expert(traj) or (only_successful and not traj.success):
            continue
        history: list = []
        for step in traj.steps:
            try:
                cands = candidate_actions(AbstractState.parse(step.state))[:MAX_CHOICES]
            except StateFormatError:
                cands = []
            if step.valid and step.action in cands:
                task = _task_of(traj, step.state)
                orders = [cands] + [rng.sample(cands, len(cands)) for _ in range(permutations - 1)]
                if action_mode == "score":
                    for order in orders:
                        turn = score_turn(tokenizer, task, step.state, order, history, history_window)
                        out.append(ChoiceExample(turn.prompt, turn.continuations, order.index(step.action)))
                    history.append(step.action)
                    continue
                turns = [choice_turn(tokenizer, task, step.state, order, history, history_window, multi_turn,
                                     max_chat_chars) for order in orders]
                for order, turn in zip(orders, turns):
                    out.append(ChoiceExample(turn.prompt, turn.labels, turn.labels[order.index(step.action)]))
                index = cands.index(step.action)
                history.append(PolicyDecision(step.action, index, turns[0].prompt, [turns[0].labels[index]], [0.0],
                                              turns[0].labels, 0, messages=turns[0].messages))
            else:
                skipped += 1
                history.append(step.action)
    if skipped:
        log.info("warm start: %d expert steps skipped (action not among the state's items)", skipped)
    return out


def train_on_examples(policy, examples: list[ChoiceExample], steps: int, lr: float = 1e-4, batch_size: int = 8,
                      seed: int = 0, max_grad_norm: float = 1.0,
                      on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """`steps` AdamW steps of cross-entropy on the expert label; returns the loss per step."""
    if not examples or steps <= 0:
        return []
    rng = random.Random(seed)
    order: list[int] = []
    params = policy.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    policy.train()
    losses = []
    for i in range(steps):
        if len(order) < batch_size:
            more = list(range(len(examples)))
            rng.shuffle(more)
            order += more
        batch = [examples[j] for j in order[:batch_size]]
        order = order[batch_size:]
        logp, _ = policy.forward_choice([e.prompt for e in batch], [e.labels for e in batch], [e.target for e in batch])
        loss = -logp.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(i, losses[-1])
    opt.zero_grad(set_to_none=True)
    return losses


def warm_start(cfg: Any, offline: Iterable[Trajectory], out_dir: str | Path,
               on_step: Callable[[int, float], None] | None = None) -> Path:
    """The driver's entry: warm-start `cfg.engines.model` on the expert trajectories in `offline`
    for cfg.learner.warm_start_steps steps and save a Hugging Face directory at `out_dir`
    (LoRA merged) that engines and the learner load. Returns `out_dir`."""
    lc = cfg.learner
    precision = Precision.checked(lc.device, lc.dtype, "learner.device", "learner.dtype")  # before any loading
    examples = expert_examples(offline, load_tokenizer(cfg.engines.model), permutations=lc.warm_start_permutations,
                               seed=cfg.infra.seed, multi_turn=cfg.actors.multi_turn,
                               max_chat_chars=cfg.actors.chat_max_chars, action_mode=cfg.actors.action_mode)
    if not examples:
        raise ValueError("warm start: no expert transitions in the offline data (collect with policies: [expert, ...])")
    policy = PolicyModel(cfg.engines.model, lora_rank=lc.lora_rank, gradient_checkpointing=lc.gradient_checkpointing,
                         precision=precision, score_layout=lc.score_layout)
    losses = train_on_examples(policy, examples, lc.warm_start_steps, lc.warm_start_lr, lc.warm_start_batch,
                               cfg.infra.seed, lc.max_grad_norm, on_step)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    policy.save_hf(out)
    (out / "warm_start.json").write_text(json.dumps({"examples": len(examples), "steps": len(losses),
                                                     "first_loss": losses[0], "last_loss": losses[-1]}))
    log.info("warm start: %d steps on %d expert transitions, loss %.3f -> %.3f", len(losses), len(examples),
             losses[0], losses[-1])
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--trajectories", default="", help="offline trajectory file (default: the dataset of actors.env_family)")
    p.add_argument("--out", default="", help="output model directory (default: <data_dir>/policy-warm/<family>-<settings key>, "
                                             "the one `dreamgym train` reuses)")


def run(args: argparse.Namespace) -> int:
    """`dreamgym warm-start`: the policy warm start alone, with a live loss readout."""
    cfg = config_from_args(args)
    family = cfg.actors.env_family
    src = Path(args.trajectories) if args.trajectories else trajectories_path(cfg.infra.data_dir, family)
    if not src.exists():
        print(f"no offline trajectories at {src}; run `dreamgym collect` first")
        return 2
    if cfg.learner.warm_start_steps <= 0:
        print("learner.warm_start_steps is 0: nothing to do (e.g. add learner.warm_start_steps=32)")
        return 2
    out = Path(args.out) if args.out else cache_dir(cfg)
    t0 = time.perf_counter()
    with Progress() as progress:
        bar = progress.add_task("policy warm start", total=cfg.learner.warm_start_steps)
        path = warm_start(cfg, read_trajectories(src), out,
                          on_step=lambda i, loss: progress.update(bar, advance=1, description=f"warm start loss {loss:.3f}"))
    report = json.loads((path / "warm_start.json").read_text())
    print(f"wrote {path}: {report['steps']} steps on {report['examples']} expert transitions, "
          f"loss {report['first_loss']:.3f} -> {report['last_loss']:.3f} ({time.perf_counter() - t0:.0f} s)")
    return 0


def cache_settings(cfg: LearnerConfig, model: str, offline_key: str, seed: int, multi_turn: bool = False,
                   action_mode: str = "label") -> dict:
    """What a cached warm-started policy depends on; the driver keys its cache directory by it.
    The device does not shape the weights (beyond float rounding); bf16 compute does, and float32,
    the default, stays out of the key so the caches written before `learner.dtype` existed still count."""
    return {"offline": offline_key, "model": model, "seed": seed, "prompt_format": PROMPT_FORMAT,
            **({"prompt_mode": "multi_turn"} if multi_turn else {}),
            **({"action_mode": action_mode} if action_mode != "label" else {}),
            **({"dtype": cfg.dtype} if cfg.dtype != "float32" else {}),
            **section_settings(cfg, ("lora_rank",), prefixes=("warm_start_",))}


def cache_dir(cfg: Any) -> Path:
    """Where `dreamgym train` keeps (and `dreamgym warm-start` writes by default) this artifact for the
    whole config `cfg`: `<data_dir>/policy-warm/<family>-<key of cache_settings>`."""
    family = cfg.actors.env_family
    offline = settings_key(offline_settings(family, cfg.data, cfg.infra.seed))
    key = settings_key(cache_settings(cfg.learner, cfg.engines.model, offline, cfg.infra.seed, cfg.actors.multi_turn,
                                      cfg.actors.action_mode))
    return Path(cfg.infra.data_dir) / "policy-warm" / f"{family}-{key}"
