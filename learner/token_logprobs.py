"""Generate-mode log-probs on the learner's side: the tokens the policy engine sampled, recomputed.

Owns the learner's half of the token-in-token-out contract of issue 60 (the worker's half is
actors/generate_mode.py). The learner never tokenises text in this mode: it rebuilds each
trajectory's chat from the ids its Steps carry and reads the log-prob of every token the
policy wrote from one forward per chat.

- `build_sequences`: for each step in order, a `new_chat` step starts a new sequence; the
  step's `prompt_token_ids` are appended with mask 0 (the prompt, the end of the previous
  turn, the observation: in the sequence, out of the loss), then its `action_token_ids` with
  its `loss_mask` (1 = trained; all 1 when the step has none). So each engine call's
  `input_ids + output_ids` is a prefix of its sequence (tests/test_token_logprobs.py).
- `sequence_logprobs`: the log-prob of the token at position p is read from the logits at
  p - 1, log-softmax over the whole vocabulary at temperature 1 in fp32, as the engine's
  `output_token_logprobs` (SGLang's too), or at `learner.logprob_temperature` (the tempered
  policy that sampled, learner/update.py). Only the read positions hit the LM head, and a
  GRPO group's chats, which start alike (same task, same first observation), run their
  common prefix once (`learner/choice_logprobs.packed_forward`, which also serves the
  multi-turn choice mode). PPO's value head reads the last hidden state at the position
  before each trained step's first reply token: the state the reply was written in.

Order, which learner/update.py relies on: the trained tokens come out trajectory by
trajectory, step by step, token by token; the values one per trained step (a step with at
least one trained token), in the same order.

Departure from the paper: none here; the paper's agents write their actions as these do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from learner.choice_logprobs import Segment, packed_forward


def is_generate_chat(steps: Sequence[Any]) -> bool:
    """Whether a trajectory's steps are in generate mode (they carry prompt ids or open a chat)."""
    return any(bool(s.new_chat) or bool(s.prompt_token_ids) for s in steps)


def trained_indices(step: Any) -> list[int]:
    """Indices into a generate step's `action_token_ids` of the tokens that train (loss_mask 1; all without one)."""
    mask = step.loss_mask
    if not mask:
        return list(range(len(step.action_token_ids)))
    return [j for j, m in enumerate(mask) if int(m) == 1]


def check_chat(steps: Sequence[Any], vocab: int | None = None) -> None:
    """Raise ValueError (naming the step) unless `steps` form well-made generate-mode chats: the first
    step opens a chat, every chat opens with prompt ids, no step carries choice-mode labels, and every
    step has one behaviour log-prob (and at most one mask entry) per sampled id; with `vocab`, every
    id is below it."""
    if not steps:
        return
    if not steps[0].new_chat:
        raise ValueError("generate-mode trajectory: its first step does not open a chat (new_chat false)")
    for i, s in enumerate(steps):
        if s.choice_token_ids or s.choice_lengths:
            raise ValueError(f"generate-mode trajectory: step {i} carries choice-mode labels "
                             "(a trajectory mixes generate and label/score steps)")
        if s.new_chat and not s.prompt_token_ids:
            raise ValueError(f"generate-mode trajectory: step {i} opens a chat without prompt ids")
        if len(s.logprobs) != len(s.action_token_ids):
            raise ValueError(f"generate-mode trajectory: step {i} has {len(s.logprobs)} log-probs for "
                             f"{len(s.action_token_ids)} sampled ids")
        if s.loss_mask and len(s.loss_mask) != len(s.action_token_ids):
            raise ValueError(f"generate-mode trajectory: step {i} has {len(s.loss_mask)} loss-mask entries for "
                             f"{len(s.action_token_ids)} sampled ids")
        if vocab is not None:
            top = max((int(t) for t in (*s.prompt_token_ids, *s.action_token_ids)), default=0)
            if top >= vocab:
                raise IndexError(f"token id {top} is beyond the policy's vocabulary of {vocab}")


@dataclass
class TokenSequence:
    """One chat as the engine saw it: its ids, which of them train, and where each trained step starts."""

    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1 on a reply token that trains
    value_positions: list[int] = field(default_factory=list)  # per trained step: its first reply position - 1
    steps: list[int] = field(default_factory=list)  # indices (into the steps given) of the trained steps

    @property
    def trained_positions(self) -> list[int]:
        return [p for p, m in enumerate(self.mask) if m]

    @property
    def read_positions(self) -> list[int]:
        """Positions whose logits or hidden state are read: p - 1 for every trained p, and the value positions."""
        return sorted({p - 1 for p in self.trained_positions} | set(self.value_positions))


def build_sequences(steps: Sequence[Any]) -> list[TokenSequence]:
    """The chats of one trajectory's steps (see the module docstring); `check_chat` first."""
    check_chat(steps)
    seqs: list[TokenSequence] = []
    for i, s in enumerate(steps):
        if s.new_chat or not seqs:
            seqs.append(TokenSequence())
        seq = seqs[-1]
        seq.ids += [int(t) for t in s.prompt_token_ids]
        seq.mask += [0] * len(s.prompt_token_ids)
        start = len(seq.ids)
        trained = set(trained_indices(s))
        seq.ids += [int(t) for t in s.action_token_ids]
        seq.mask += [1 if j in trained else 0 for j in range(len(s.action_token_ids))]
        if trained:
            if start == 0:
                raise ValueError(f"generate-mode trajectory: step {i} has a trained token at a chat's first position")
            seq.value_positions.append(start - 1)
            seq.steps.append(i)
    return seqs


def behaviour_logprobs(steps: Sequence[Any]) -> list[float]:
    """The engine's log-prob of every trained token of `steps`, in the order `sequence_logprobs` returns them."""
    return [float(s.logprobs[j]) for s in steps for j in trained_indices(s)]


def trained_token_count(step: Any) -> int:
    return len(trained_indices(step))


def sequence_logprobs(model: Any, sequences: Sequence[TokenSequence], want_hidden: bool = False,
                      share_prefix: bool = True, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(log-prob of every trained token [T], fp32, differentiable; the last hidden state at each trained
    step's value position [S, H] or None; tokens run through the model). One forward per sequence
    (a common prefix of consecutive sequences once, with `share_prefix`); sequences without a
    trained token are not run. `temperature`: the log-probs of softmax(logits / temperature)."""
    live = [s for s in sequences if s.steps]
    device = next(model.parameters()).device
    if not live:
        empty = torch.zeros(0, device=device)
        return empty, (torch.zeros(0, model.config.hidden_size, device=device) if want_hidden else None), 0
    segments = [Segment(list(s.ids), s.read_positions, [i]) for i, s in enumerate(live)]
    logits, hidden, tokens = packed_forward(model, segments, want_hidden=want_hidden, share_prefix=share_prefix)
    tok_rows, targets, value_rows = [], [], []
    base = 0
    for s, seg in zip(live, segments):
        row = {p: base + k for k, p in enumerate(seg.positions)}
        for p in s.trained_positions:
            tok_rows.append(row[p - 1])
            targets.append(s.ids[p])
        value_rows += [row[p] for p in s.value_positions]
        base += len(seg.positions)
    index = torch.tensor(tok_rows, dtype=torch.long, device=logits.device)
    target = torch.tensor(targets, dtype=torch.long, device=logits.device)
    logp = gather_token_logprobs(logits.index_select(0, index), target, temperature)
    values_hidden = None
    if want_hidden:
        values_hidden = hidden.index_select(0, torch.tensor(value_rows, dtype=torch.long, device=hidden.device))
    return logp, values_hidden, tokens


def gather_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[target] per row, over the whole vocabulary, in fp32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.view(-1, 1)).squeeze(-1)


def token_logprobs(model: Any, steps: Sequence[Any]) -> list[list[float]]:
    """The learner-side twin of actors/generate_mode.py for one trajectory: per step, the log-prob of
    each of its sampled tokens that trains (no grad), to compare with the engine's `logprobs`."""
    seqs = build_sequences(steps)
    with torch.no_grad():
        flat, _, _ = sequence_logprobs(model, seqs)
    out, k = [], 0
    for s in steps:
        n = trained_token_count(s)
        out.append(flat[k:k + n].tolist())
        k += n
    return out
