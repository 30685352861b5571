"""Mexp's data: the offline trajectories, their train/held-out split, teacher-forced examples.

Owns how real trajectories become (prompt, target) pairs for Mexp, shared by SFT
(learner/mexp_sft.py) and the fidelity replay (simulator/fidelity.py) so both see
exactly the inference prompt (simulator/prompts.py):

- the split is by task, never by step: a trajectory is held out when its task is
  in the environment's held-out split (`<data_dir>/<family>/splits.json`); when the
  offline file holds no held-out tasks (collection usually runs on train tasks
  only), a deterministic `heldout_frac` of the task ids (by hash) is held out;
- each step's context retrieves its top-k neighbours from a buffer seeded with the
  TRAIN trajectories only, excluding the step's own episode, as at inference;
- the target is `format_mexp_output` of the real next state, reward and done, with
  the real env-derived rationale (`Step.reasoning`) as the <think> text.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.dataset import TaskSplits, read_trajectories, splits_path, trajectories_path
from infra.config import SimulatorConfig
from infra.schema import Task, Trajectory
from simulator import prompts
from simulator.mexp_output import MexpOutput, MexpParseError, format_mexp_output, parse_mexp_output
from simulator.replay_buffer import ReplayBuffer, Transition


def load_offline(data_dir: str | Path, family: str) -> list[Trajectory]:
    path = trajectories_path(data_dir, family)
    if not path.exists():
        raise FileNotFoundError(f"no offline data at {path}; run `dreamgym collect` first")
    return [t for t in read_trajectories(path) if t.steps]


def _hash_frac(task_id: str) -> float:
    return int(hashlib.sha1(task_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def split_trajectories(trajs: list[Trajectory], heldout_frac: float = 0.2, data_dir: str | Path | None = None,
                       family: str = "textworld") -> tuple[list[Trajectory], list[Trajectory]]:
    """(train, held-out) by task, per the module docstring."""
    heldout_ids: set[str] = set()
    if data_dir is not None:
        sp = splits_path(data_dir, family)
        if sp.exists():
            heldout_ids = {t.task_id for t in TaskSplits.load(sp).heldout}
    present = {t.task_id for t in trajs}
    if not heldout_ids & present or len(heldout_ids & present) == len(present):
        tasks = sorted(present)
        heldout_ids = {t for t in tasks if _hash_frac(t) < heldout_frac}
        if not heldout_ids and len(tasks) > 1:
            heldout_ids = {min(tasks, key=_hash_frac)}
    train = [t for t in trajs if t.task_id not in heldout_ids]
    held = [t for t in trajs if t.task_id in heldout_ids]
    return train, held


def task_of(traj: Trajectory) -> Task:
    if traj.task is not None:
        return traj.task
    return Task(task_id=traj.task_id, instruction="")


@dataclass
class MexpExample:
    prompt: str  # chat-templated, ending with the assistant pre-fill
    reasoning_target: str  # generated text up to and including </think> ("" without reasoning)
    rest_target: str  # the state, reward and done blocks
    truth: MexpOutput
    task: Task
    history: list[str]
    state: str
    action: str
    episode_id: str


def build_examples(trajs: list[Trajectory], tokenizer: Any, cfg: SimulatorConfig,
                   buffer: ReplayBuffer | None) -> list[MexpExample]:
    """One example per step, its prompt built exactly as ExperienceModel builds it.

    Steps whose real next state the strict parser would reject (no numbered items)
    are left out, and so are generate-mode invalid replies (the environment never saw them).
    """
    steps = [(traj, i) for traj in trajs for i in range(len(traj.steps)) if not traj.steps[i].invalid_reason]
    retrieved: list[list[Transition]] = [[] for _ in steps]
    if cfg.retrieval and buffer is not None and cfg.top_k > 0:
        # One batched query per episode: its own transitions excluded.
        for traj in trajs:
            idx = [j for j, (t, _) in enumerate(steps) if t is traj]
            res = buffer.query([(traj.steps[i].state, traj.steps[i].action) for _, i in (steps[j] for j in idx)],
                               cfg.top_k, [traj.trajectory_id])
            for j, hits in zip(idx, res):
                retrieved[j] = hits
    out = []
    head = prompts.prefill(cfg.reasoning)
    for (traj, i), hits in zip(steps, retrieved):
        s = traj.steps[i]
        task = task_of(traj)
        history = [p.action for p in traj.steps[:i] if not p.invalid_reason]
        msgs = prompts.step_messages(task, history, hits, s.state, s.action, reasoning=cfg.reasoning,
                                     history_window=cfg.history_window, state_chars=cfg.state_chars,
                                     retrieved_todo=cfg.retrieved_todo)
        truth = MexpOutput(s.reasoning, s.next_state, float(s.reward), bool(s.done))
        target = MexpOutput(s.reasoning, prompts.split_goal(s.next_state)[1], truth.reward, truth.done)
        full = format_mexp_output(target, with_reasoning=cfg.reasoning)
        try:  # a target the strict parser rejects (e.g. a final state with no items) teaches nothing usable
            parse_mexp_output(full)
        except MexpParseError:
            continue
        gen = full[len(head):]
        cut = gen.index("</think>") + len("</think>") if cfg.reasoning else 0
        out.append(MexpExample(prompts.render(tokenizer, msgs, head), gen[:cut], gen[cut:], truth, task, history,
                               s.state, s.action, traj.trajectory_id))
    return out
