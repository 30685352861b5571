"""The policy in "choice" action mode: prompt building, sampling through the engine,
and the learner-side recomputation of the very same log-prob.

Owns contract 4. At each step the admissible actions are listed under single-token
letter labels (a..z, then A..Z; SmolLM2 splits numbers into digit tokens, so labels
are letters). The policy engine runs one forward pass (`max_new_tokens=1`) and returns,
for the label tokens only, their log-probs at the first generated position
(`token_ids_logprob`). The client renormalises them over the labels (a log-softmax,
at the sampling temperature), samples one label and records its log-prob: that is
the behaviour log-prob a Step carries. `choice_logprobs` recomputes it from a model
forward pass, temperature 1, renormalised over the same label ids, so the learner's
importance ratio compares like with like.

Departures from the paper: the paper's agents generate free-form reasoning then an
action; a 135M model cannot, so the policy's action space is the candidate list
(the "constrained" remedy in FACTS.md). The renormalised distribution is the
policy; nothing outside the labels can be sampled. Workers should sample at
temperature 1: the learner optimises the temperature-1 distribution and a
tempered behaviour log-prob would bias the ratio.
"""

from __future__ import annotations

import math
import random
import string
from dataclasses import dataclass, field
from typing import Any, Sequence

from actors.envs.base import AbstractState, ActionFormatError, StateFormatError, parse_action
from infra.schema import Task

LABELS = string.ascii_lowercase + string.ascii_uppercase
MAX_CHOICES = len(LABELS)
SYSTEM_PROMPT = ("You are an agent acting in a text environment. Read the goal and the current state, "
                 "then answer with the single letter of the best next action.")


class PolicyError(RuntimeError):
    """The engine's answer cannot be turned into a choice (no label log-probs returned)."""


@dataclass
class PolicyDecision:
    """What the policy chose and everything the learner needs to recompute its log-prob."""

    action: str
    index: int  # into the candidate list given to act()
    prompt: str
    action_token_ids: list[int]  # [label id]
    logprobs: list[float]  # [behaviour log-prob of that label, renormalised over the labels]
    choice_token_ids: list[int]  # label ids, in candidate order
    weight_version: int
    probs: list[float] = field(default_factory=list)  # the renormalised distribution (diagnostics)


def label_token_ids(tokenizer: Any, n: int) -> list[int]:
    """Token ids of the first `n` labels; each must be exactly one token."""
    if n > MAX_CHOICES:
        raise ValueError(f"{n} candidates; choice mode labels at most {MAX_CHOICES}")
    ids = []
    for ch in LABELS[:n]:
        toks = tokenizer.encode(ch, add_special_tokens=False)
        if len(toks) != 1:
            raise ValueError(f"label {ch!r} is {len(toks)} tokens in this tokenizer; choice mode needs 1")
        ids.append(toks[0])
    return ids


_GOAL_PREFIXES = ("goal:", "task:", "objective:")


def _norm(text: str) -> str:
    return " ".join(text.split()).lower()


def _state_view(state: str, instruction: str) -> tuple[str, dict[int, str]]:
    """(the state's description without its item list and without a line repeating the
    instruction, item text by ref); the raw text and no items if it does not parse."""
    try:
        parsed = AbstractState.parse(state)
    except StateFormatError:
        return state.strip(), {}
    goal = _norm(instruction)
    lines = [ln for ln in parsed.description.splitlines()
             if not (goal and ln.strip().lower().startswith(_GOAL_PREFIXES) and _norm(ln.split(":", 1)[1]) == goal)]
    return "\n".join(lines).strip(), dict(parsed.items)


def _option_text(candidate: str, items: dict[int, str]) -> str:
    """A web action names an element by ref only; show the element too ("click [4] (button 'okay')")."""
    try:
        action = parse_action(candidate)
    except ActionFormatError:
        return candidate
    if action.kind in ("click", "type") and action.ref in items:
        return f"{candidate} ({items[action.ref]})"
    return candidate


def build_choice_prompt(tokenizer: Any, task: Task | None, state: str, candidates: Sequence[str],
                        history: Sequence[str] = (), history_window: int = 3) -> tuple[str, list[int]]:
    """(prompt text with the chat template applied, label token ids for the candidates).

    `history` holds the previous actions (strings, or Steps whose `.action` is used; most
    recent last); only the last
    `history_window` appear, to keep prompts short on CPU.
    """
    if not candidates:
        raise ValueError("no candidate actions to choose from")
    candidates = list(candidates)[:MAX_CHOICES]
    labels = label_token_ids(tokenizer, len(candidates))
    lines = []
    if task is not None and task.instruction:
        lines.append(f"Goal: {task.instruction.strip()}")
    desc, items = _state_view(state, task.instruction if task is not None else "")
    if desc:
        lines.append(f"State:\n{desc}")
    recent = [h if isinstance(h, str) else str(getattr(h, "action", h)) for h in history]
    recent = recent[-history_window:] if history_window > 0 else []
    if recent:
        lines.append("Previous actions: " + "; ".join(recent))
    lines.append("Options:")
    lines += [f"{LABELS[i]}) {_option_text(c, items)}" for i, c in enumerate(candidates)]
    lines.append("Answer with one letter.")
    msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "\n".join(lines)}]
    prompt = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return prompt, labels


def renormalise(label_logps: Sequence[float], temperature: float = 1.0) -> list[float]:
    """log-softmax over the label log-probs at `temperature` (0 = greedy, returned at temperature 1)."""
    t = temperature if temperature > 0 else 1.0
    z = [lp / t for lp in label_logps]
    m = max(z)
    lse = m + math.log(sum(math.exp(v - m) for v in z))
    return [v - lse for v in z]


class ChoicePolicy:
    """Samples one labelled candidate per step from a policy engine (contract 4)."""

    def __init__(self, client: Any, tokenizer: Any, temperature: float = 1.0, seed: int | None = None,
                 history_window: int = 3):
        self.client, self.tokenizer = client, tokenizer
        self.temperature = temperature
        self.history_window = history_window
        self.rng = random.Random(seed)

    async def act(self, task: Task | None, state: str, candidates: Sequence[str], history: Sequence[str] = (),
                  affinity_key: str | None = None) -> PolicyDecision:
        candidates = list(candidates)[:MAX_CHOICES]
        prompt, labels = build_choice_prompt(self.tokenizer, task, state, candidates, history, self.history_window)
        result = await self.client.generate(
            prompt, sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            return_logprob=True, token_ids_logprob=labels, affinity_key=affinity_key)
        positions = result.token_ids_logprobs
        if not positions or not isinstance(positions[0], dict):
            raise PolicyError("engine returned no token_ids_logprob for the label tokens")
        first = {int(k): float(v) for k, v in positions[0].items()}
        missing = [t for t in labels if t not in first]
        if missing:
            raise PolicyError(f"engine omitted log-probs for label tokens {missing}")
        raw = [first[t] for t in labels]
        if self.temperature > 0:
            logps = renormalise(raw, self.temperature)
            probs = [math.exp(v) for v in logps]
            index = self.rng.choices(range(len(labels)), weights=probs)[0]
        else:
            logps = renormalise(raw, 1.0)
            probs = [math.exp(v) for v in logps]
            index = max(range(len(labels)), key=lambda i: logps[i])
        return PolicyDecision(action=candidates[index], index=index, prompt=prompt,
                              action_token_ids=[labels[index]], logprobs=[logps[index]],
                              choice_token_ids=labels, weight_version=int(result.weight_version), probs=probs)


def choice_forward(model: Any, tokenizer: Any, prompts: Sequence[str], want_hidden: bool = False):
    """Last-position logits (and final hidden state) of each prompt, one padded batch.

    Left padding with explicit position ids, so every row's last position is the one
    the engine reads, and `logits_to_keep=1` so only that position hits the LM head.
    Returns (logits [B, V], hidden [B, H] or None).
    """
    import torch

    enc = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(len(e) for e in enc)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(enc), width), pad, dtype=torch.long)
    mask = torch.zeros((len(enc), width), dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, width - len(e):] = torch.tensor(e, dtype=torch.long)
        mask[i, width - len(e):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    device = next(model.parameters()).device
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device),
                logits_to_keep=1, output_hidden_states=want_hidden, use_cache=False)
    logits = out.logits[:, -1, :]
    hidden = out.hidden_states[-1][:, -1, :] if want_hidden else None
    return logits, hidden


def gather_choice_logprobs(logits: Any, choice_token_ids: Sequence[Sequence[int]], chosen_ids: Sequence[int]):
    """log p(chosen | labels) per row: log-softmax of the label logits, temperature 1."""
    import torch

    rows = []
    for i, (labels, chosen) in enumerate(zip(choice_token_ids, chosen_ids)):
        labels = [int(t) for t in labels]
        if int(chosen) not in labels:
            raise ValueError(f"row {i}: chosen token {chosen} is not one of the labels {labels}")
        row = torch.log_softmax(logits[i, labels].float(), dim=-1)
        rows.append(row[labels.index(int(chosen))])
    return torch.stack(rows)


def choice_logprobs(model: Any, tokenizer: Any, prompts: Sequence[str], choice_token_ids: Sequence[Sequence[int]],
                    chosen_ids: Sequence[int]):
    """The learner-side twin of ChoicePolicy: log-prob of each chosen label (tensor [B], differentiable)."""
    if not (len(prompts) == len(choice_token_ids) == len(chosen_ids)):
        raise ValueError("prompts, choice_token_ids and chosen_ids must have the same length")
    logits, _ = choice_forward(model, tokenizer, prompts)
    return gather_choice_logprobs(logits, choice_token_ids, chosen_ids)
