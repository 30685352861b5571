"""Supervised warm start of the policy on expert transitions, in the mode the policy acts in.

Owns turning offline expert trajectories (actors/dataset.py) into the exact prompts
the policy sees at rollout time (actors/policy.py's `choice_turn`, the
candidates recovered from the abstract state's numbered items, the previous actions
as history, the episode as one chat in multi-turn mode) and a cross-entropy run on the expert's label. Measured: 2 epochs
on 128 expert steps took SmolLM2 from 0/9 to 6/9 treasure-hunter games.

Generate mode (`actors.action_mode=generate`): an expert episode is one chat laid out by the
worker's own code (actors/generate_mode.py `expert_turns`): the expert's replies are
`<think>{the environment's rationale, Step.reasoning}</think><action>{action}</action>` (the
action alone with `actors.think=false`), as Mexp's SFT data takes the same rationale; the loss is
the cross-entropy of the reply tokens only (`ChatExample.mask`), one forward per chat.

How long (`learner.warm_start`): 'fixed' trains `warm_start_steps` steps; 'best' holds out a
validation split of the training tasks and keeps the checkpoint with the best greedy success on
them in the real environment (learner/sft_validation.py), the curve saved and plotted beside it.

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
from actors.generate_mode import expert_reply, expert_turns
from actors.policy import MAX_CHAT_CHARS, MAX_CHOICES, PROMPT_FORMAT, PolicyDecision, choice_turn, score_turn
from infra.config import ActorsConfig, LearnerConfig, add_config_arguments, config_from_args, section_settings, settings_key
from infra.engine.models import load_tokenizer
from infra.schema import Task, Trajectory
from learner.policy_model import PolicyModel
from learner.precision import Precision
from learner.sft_validation import (CurvePoint, best_index, episode_cap, play_validation, should_stop, validation_split,
                                    write_curve)

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


@dataclass
class ChatExample:
    """Generate mode: one expert episode's chat (or a part of it, where a long chat restarts) as the
    token ids the worker would have sent and sampled; `mask` is 1 on the expert's reply tokens."""

    ids: list[int]
    mask: list[int]


def expert_chats(trajectories: Iterable[Trajectory], tokenizer, think: bool = True, only_successful: bool = True,
                 history_window: int = 3, max_chat_chars: int = MAX_CHAT_CHARS, **layout: Any) -> list[ChatExample]:
    """Generate mode's examples: one per chat of each successful expert episode, its turns laid out by
    `actors.generate_mode.expert_turns` (the worker's own layout: prompt ids masked out, reply ids in;
    `layout`: its chat bounds, max_chat_tokens and max_reply_tokens, as the worker's config has them).
    An episode stops at its first step whose action is not among the state's candidates (training on
    what comes after would teach a chat that says the agent's last reply was invalid)."""
    out: list[ChatExample] = []
    cut = replies = too_long = 0
    limit = int(layout.get("max_reply_tokens") or 0)
    for traj in trajectories:
        if not is_expert(traj) or (only_successful and not traj.success) or not traj.steps:
            continue
        turns = []
        for step in traj.steps:
            try:
                cands = candidate_actions(AbstractState.parse(step.state))[:MAX_CHOICES]
            except StateFormatError:
                cands = []
            if not (step.valid and step.action in cands):
                cut += 1
                break
            turns.append((step.state, cands, expert_reply(step.action, step.reasoning, think)))
        chats: list[ChatExample] = []
        for turn in expert_turns(tokenizer, _task_of(traj, traj.steps[0].state), turns, think, max_chat_chars,
                                 history_window, **layout):
            if turn.new_chat or not chats:
                chats.append(ChatExample([], []))
            chats[-1].ids += [*turn.prompt_token_ids, *turn.reply_token_ids]
            chats[-1].mask += [0] * len(turn.prompt_token_ids) + [1] * len(turn.reply_token_ids)
            replies += 1
            too_long += bool(limit and len(turn.reply_token_ids) > limit)
        out += [c for c in chats if any(c.mask)]
    if cut:
        log.info("warm start: %d expert episodes cut at a step whose action is not among the state's items", cut)
    if too_long:  # the policy is taught replies it could not finish: each would be an invalid step ('truncated')
        log.warning("warm start: %d of %d expert replies are longer than actors.max_reply_tokens=%d; a policy "
                    "writing them is cut off (an invalid step): raise actors.max_reply_tokens", too_long, replies, limit)
    return out


def chat_logprobs(policy, examples: list[ChatExample]) -> torch.Tensor:
    """The log-prob of every reply token of `examples` [T] (chat by chat, in order), differentiable: one
    forward per chat (a right-padded batch), the token at p read from the logits at p - 1, log-softmax
    over the whole vocabulary in fp32, as learner/token_logprobs.py reads a sampled reply."""
    device = next(policy.lm.parameters()).device
    width = max(len(e.ids) for e in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long, device=device)
    attn = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        ids[i, :len(e.ids)] = torch.tensor(e.ids, dtype=torch.long)
        attn[i, :len(e.ids)] = 1
    with policy.precision.autocast():
        logits = policy.lm(input_ids=ids, attention_mask=attn).logits
    rows = [(i, p) for i, e in enumerate(examples) for p, m in enumerate(e.mask) if m and p > 0]
    bi = torch.tensor([r[0] for r in rows], device=device)
    pi = torch.tensor([r[1] for r in rows], device=device)
    picked = logits[bi, pi - 1].float()
    return torch.log_softmax(picked, dim=-1).gather(-1, ids[bi, pi].view(-1, 1)).squeeze(-1)


def example_logprobs(policy, batch: list) -> torch.Tensor:
    """Per expert label (choice modes) or per reply token (generate mode): the log-prob the loss lowers."""
    if isinstance(batch[0], ChatExample):
        return chat_logprobs(policy, batch)
    logp, _ = policy.forward_choice([e.prompt for e in batch], [e.labels for e in batch], [e.target for e in batch])
    return logp


class SupervisedSteps:
    """AdamW steps of cross-entropy on the expert's choice (or reply tokens), batches drawn from
    seeded shuffles of `examples`, one step per `step()`; the optimizer lives across calls."""

    def __init__(self, policy, examples: list, lr: float = 1e-4, batch_size: int = 8, seed: int = 0,
                 max_grad_norm: float = 1.0):
        self.policy, self.examples, self.batch_size, self.max_grad_norm = policy, examples, batch_size, max_grad_norm
        self.rng = random.Random(seed)
        self.order: list[int] = []
        self.params = policy.trainable_parameters()
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0)

    def step(self) -> float:
        if len(self.order) < self.batch_size:
            more = list(range(len(self.examples)))
            self.rng.shuffle(more)
            self.order += more
        batch = [self.examples[j] for j in self.order[:self.batch_size]]
        self.order = self.order[self.batch_size:]
        self.policy.train()
        loss = -example_logprobs(self.policy, batch).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())


def train_on_examples(policy, examples: list, steps: int, lr: float = 1e-4, batch_size: int = 8,
                      seed: int = 0, max_grad_norm: float = 1.0,
                      on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """`steps` AdamW steps of cross-entropy on the expert label; returns the loss per step."""
    if not examples or steps <= 0:
        return []
    run = SupervisedSteps(policy, examples, lr, batch_size, seed, max_grad_norm)
    losses = []
    for i in range(steps):
        losses.append(run.step())
        if on_step is not None:
            on_step(i, losses[-1])
    return losses


@torch.no_grad()
def validation_loss(policy, examples: list, batch_size: int = 8) -> float:
    """Mean cross-entropy over `examples` (per expert label; generate mode: per reply token), no grad."""
    total, n = 0.0, 0
    was = policy.training
    policy.eval()
    try:
        for i in range(0, len(examples), batch_size):
            logp = example_logprobs(policy, examples[i:i + batch_size])
            total, n = total - float(logp.sum()), n + logp.numel()
    finally:
        policy.train(was)
    return total / n if n else float("nan")


def make_examples(cfg: Any, trajectories: list, tokenizer, permutations: int) -> list:
    """The expert examples of `trajectories` in the mode `cfg.actors` names."""
    a = cfg.actors
    if a.action_mode == "generate":
        return expert_chats(trajectories, tokenizer, think=a.think, max_chat_chars=a.chat_max_chars,
                            max_chat_tokens=a.chat_max_tokens, max_reply_tokens=a.max_reply_tokens)
    return expert_examples(trajectories, tokenizer, permutations=permutations, seed=cfg.infra.seed,
                           multi_turn=a.multi_turn, max_chat_chars=a.chat_max_chars, action_mode=a.action_mode)


def _snapshot(policy) -> dict:
    return {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}


@torch.no_grad()
def _restore(policy, state: dict) -> None:
    for n, p in policy.named_parameters():
        if n in state:
            p.copy_(state[n])


def train_best(policy, cfg: Any, examples: list, val_examples: list, val_tasks: list,
               on_step: Callable[[int, float], None] | None = None,
               on_eval: Callable[[CurvePoint], None] | None = None) -> tuple[list[CurvePoint], int]:
    """Early-stopped warm start: measure (step 0 included), train `warm_start_eval_every` steps, measure,
    ... until `warm_start_patience` measurements do not raise the best validation success or `warm_start_max_steps` are
    taken; `policy` ends with the best point's weights. Returns (the curve, the best point's index)."""
    lc = cfg.learner
    run = SupervisedSteps(policy, examples, lc.warm_start_lr, lc.warm_start_batch, cfg.infra.seed, lc.max_grad_norm)
    curve: list[CurvePoint] = []
    best_state: dict | None = None
    pending: list[float] = []
    step = 0
    while True:
        t0 = time.perf_counter()
        played = play_validation(policy.lm, policy.tokenizer, cfg, val_tasks)
        point = CurvePoint(step, played["success_rate"], validation_loss(policy, val_examples, lc.warm_start_batch),
                           sum(pending) / len(pending) if pending else None, played["episodes"],
                           round(time.perf_counter() - t0, 1))
        curve.append(point)
        pending = []
        if best_index(curve) == len(curve) - 1:
            best_state = _snapshot(policy)
        if on_eval is not None:
            on_eval(point)
        if should_stop(curve, lc.warm_start_patience) or step >= lc.warm_start_max_steps:
            break
        for _ in range(min(lc.warm_start_eval_every, lc.warm_start_max_steps - step)):
            pending.append(run.step())
            if on_step is not None:
                on_step(step, pending[-1])
            step += 1
    best = best_index(curve)
    if best_state is not None:
        _restore(policy, best_state)
    return curve, best


def warm_start(cfg: Any, offline: Iterable[Trajectory], out_dir: str | Path,
               on_step: Callable[[int, float], None] | None = None,
               on_eval: Callable[[CurvePoint], None] | None = None) -> Path:
    """The driver's entry: warm-start `cfg.engines.model` on the expert trajectories in `offline`
    (`learner.warm_start`: 'fixed', warm_start_steps steps; 'best', early-stopped on a validation
    split of their tasks) and save a Hugging Face directory at `out_dir` (LoRA merged) that engines
    and the learner load, with warm_start.json (and in 'best' mode the curve) in it. Returns `out_dir`."""
    lc = cfg.learner
    precision = Precision.checked(lc.device, lc.dtype, "learner.device", "learner.dtype")  # before any loading
    offline = list(offline)
    tokenizer = load_tokenizer(cfg.engines.model)
    best_mode = lc.warm_start == "best"
    val_trajs, val_tasks = [], []
    if best_mode:
        offline, val_trajs, val_tasks = validation_split(offline, lc.warm_start_val_fraction,
                                                         lc.warm_start_val_min_tasks, cfg.infra.seed,
                                                         eligible=lambda t: is_expert(t) and t.success)
    examples = make_examples(cfg, offline, tokenizer, lc.warm_start_permutations)
    if not examples:
        raise ValueError("warm start: no expert transitions in the offline data (collect with policies: [expert, ...])")
    policy = PolicyModel(cfg.engines.model, lora_rank=lc.lora_rank, gradient_checkpointing=lc.gradient_checkpointing,
                         precision=precision, score_layout=lc.score_layout)
    info: dict = {"mode": lc.warm_start, "action_mode": cfg.actors.action_mode, "examples": len(examples)}
    if best_mode:
        curve, best = train_best(policy, cfg, examples, make_examples(cfg, val_trajs, tokenizer, 1), val_tasks,
                                 on_step, on_eval)
        losses = [p.train_loss for p in curve if p.train_loss is not None]
        info.update(steps=curve[best].step, trained_steps=curve[-1].step, val_success=curve[best].val_success,
                    val_loss=curve[best].val_loss, val_tasks=[t.task_id for t in val_tasks],
                    val_episodes=curve[best].val_episodes,
                    first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None)
    else:
        losses = train_on_examples(policy, examples, lc.warm_start_steps, lc.warm_start_lr, lc.warm_start_batch,
                                   cfg.infra.seed, lc.max_grad_norm, on_step)
        info.update(steps=len(losses), first_loss=losses[0], last_loss=losses[-1])
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    policy.save_hf(out)
    if best_mode:
        write_curve(out, curve, best, {k: info[k] for k in ("mode", "action_mode", "examples", "val_tasks")})
    (out / "warm_start.json").write_text(json.dumps(info))
    log.info("warm start: %s", describe(info))
    return out


def describe(info: dict) -> str:
    """A line on a warm start's warm_start.json."""
    if info.get("mode") == "best":
        return (f"best of {info['trained_steps']} steps: step {info['steps']}, validation success "
                f"{info['val_success']:.3f} on {len(info['val_tasks'])} held-back training tasks "
                f"(loss {info['val_loss']:.3f}), {info['examples']} examples")
    return (f"{info['steps']} steps on {info['examples']} expert examples, loss {info['first_loss']:.3f} -> "
            f"{info['last_loss']:.3f}")


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
    best = cfg.learner.warm_start == "best"
    t0 = time.perf_counter()
    with Progress() as progress:
        bar = progress.add_task("policy warm start",
                                total=cfg.learner.warm_start_max_steps if best else cfg.learner.warm_start_steps)

        def on_eval(p: CurvePoint) -> None:
            progress.console.print(f"step {p.step}: validation success {p.val_success:.3f}, loss {p.val_loss:.3f}")

        path = warm_start(cfg, read_trajectories(src), out,
                          on_step=lambda i, loss: progress.update(bar, advance=1, description=f"warm start loss {loss:.3f}"),
                          on_eval=on_eval)
    report = json.loads((path / "warm_start.json").read_text())
    print(f"wrote {path}: {describe(report)} ({time.perf_counter() - t0:.0f} s)")
    return 0


BEST_ONLY = ("warm_start_max_steps", "warm_start_eval_every", "warm_start_patience", "warm_start_val_fraction",
             "warm_start_val_min_tasks", "warm_start_val_max_steps")  # settings only learner.warm_start=best reads


def actor_settings(actors: Any, best: bool = False) -> dict:
    """What of the policy's config (`actors`) shapes a warm start: its examples are laid out as the
    worker prompts (the mode, the chat; generate mode: the reply format, the chat's character and token
    bounds and the reply budget, which decide where a chat restarts), and in 'best' mode its validation
    episodes are played by that worker (generate mode: free text too). Label mode's chat bound counts
    only off its default, so the caches written before it was keyed still count."""
    out: dict = {**({"prompt_mode": "multi_turn"} if actors.multi_turn else {}),
                 **({"action_mode": actors.action_mode} if actors.action_mode != "label" else {})}
    if actors.action_mode == "generate":
        out.update(think=actors.think, chat_max_chars=actors.chat_max_chars, chat_max_tokens=actors.chat_max_tokens,
                   max_reply_tokens=actors.max_reply_tokens)
        if best:
            out["free_text_actions"] = actors.free_text_actions
    elif actors.multi_turn and actors.action_mode == "label" and actors.chat_max_chars != MAX_CHAT_CHARS:
        out["chat_max_chars"] = actors.chat_max_chars
    return out


def cache_settings(cfg: LearnerConfig, model: str, offline_key: str, seed: int, actors: Any = None,
                   val_episode_steps: int = 0) -> dict:
    """What a cached warm-started policy depends on; the driver keys its cache directory by it.
    The device does not shape the weights (beyond float rounding); bf16 compute does, and float32,
    the default, stays out of the key so the caches written before `learner.dtype` existed still count.
    So do the early-stopping settings in 'fixed' mode. In 'best' mode the fixed step count does not
    count, and the validation episodes' step cap (`val_episode_steps`) does. `actors` (the policy's
    config, default ActorsConfig()): `actor_settings`."""
    warm = section_settings(cfg, ("lora_rank",), prefixes=("warm_start_",))
    if cfg.warm_start == "best":
        warm = {k: v for k, v in warm.items() if k != "warm_start_steps"}
        warm.update(warm_start="best", val_episode_steps=val_episode_steps)
    else:
        warm = {k: v for k, v in warm.items() if k not in BEST_ONLY}
    return {"offline": offline_key, "model": model, "seed": seed, "prompt_format": PROMPT_FORMAT,
            **actor_settings(actors if actors is not None else ActorsConfig(), cfg.warm_start == "best"),
            **({"dtype": cfg.dtype} if cfg.dtype != "float32" else {}),
            **warm}


def cache_dir(cfg: Any) -> Path:
    """Where `dreamgym train` keeps (and `dreamgym warm-start` writes by default) this artifact for the
    whole config `cfg`: `<data_dir>/policy-warm/<family>-<key of cache_settings>`."""
    family = cfg.actors.env_family
    offline = settings_key(offline_settings(family, cfg.data, cfg.infra.seed))
    key = settings_key(cache_settings(cfg.learner, cfg.engines.model, offline, cfg.infra.seed, cfg.actors,
                                      episode_cap(cfg)))
    return Path(cfg.infra.data_dir) / "policy-warm" / f"{family}-{key}"
