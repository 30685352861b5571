"""Label mode: the candidates listed under single-token letters, one forward, the letter's log-prob.

Owns the label-mode contract between the policy, the engine and the learner. At each
step the admissible actions are listed under single-token letter labels (a..z, then
A..Z; SmolLM2 splits numbers into digit tokens, so labels are letters). The policy
engine runs one forward pass (`max_new_tokens=1`) and returns, for the label tokens
only, their log-probs at the first generated position (`token_ids_logprob`). The
policy renormalises them over the labels (a log-softmax, at the sampling temperature),
samples one label and records its log-prob: that is the behaviour log-prob a Step
carries. learner/choice_logprobs.py recomputes it from a model forward pass,
temperature 1, renormalised over the same label ids.

Prompt modes, both built by `choice_turn` (the one function the rollout, the warm start
and the benchmarks build label prompts with):
- multi-turn (`actors.multi_turn`, the default): an episode is one chat. Turn 1 is the
  system prompt and a user message with the goal, the state and the options; every
  later turn appends the chosen letter as the assistant's answer and a user message
  with the new state and options. Each step's prompt is therefore a prefix of the
  next one's, the engine's prefix cache serves the history, and the learner packs a
  trajectory into ONE sequence. A chat longer than `actors.chat_max_chars` restarts as
  a fresh first turn (listing the last actions).
- per-step: a fresh prompt per step with the last `history_window` actions.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Any, Sequence

from actors.decision import PolicyDecision, PolicyError, logprob_temperature, pick
from actors.prompt_text import context_lines, option_text, recent_actions
from infra.schema import Task

LABELS = string.ascii_lowercase + string.ascii_uppercase
MAX_CHOICES = len(LABELS)
MAX_CHAT_CHARS = 12_000  # default for actors.chat_max_chars
SYSTEM_PROMPT = ("You are an agent acting in a text environment. Read the goal and the current state, "
                 "then answer with the single letter of the best next action.")


@dataclass
class ChoicePrompt:
    """One step's prompt: the text (chat template applied), the label ids, and the chat's messages."""

    prompt: str
    labels: list[int]
    messages: list[dict]


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


def _turn_text(task: Task | None, state: str, candidates: Sequence[str], recent: Sequence[str],
               first: bool) -> str:
    """A user message: (goal, previous actions: first turn only), state, options."""
    lines, items = context_lines(task, state, recent, first)
    lines.append("Options:")
    lines += [f"{LABELS[i]}) {option_text(c, items)}" for i, c in enumerate(candidates)]
    lines.append("Answer with one letter.")
    return "\n".join(lines)


def _continues(prev: Any) -> bool:
    """Whether a history item is a multi-turn decision a next turn can extend."""
    return bool(getattr(prev, "messages", None)) and isinstance(getattr(prev, "prompt", None), str) \
        and isinstance(getattr(prev, "index", None), int)


def choice_turn(tokenizer: Any, task: Task | None, state: str, candidates: Sequence[str],
                history: Sequence[Any] = (), history_window: int = 3, multi_turn: bool = False,
                max_chat_chars: int = MAX_CHAT_CHARS) -> ChoicePrompt:
    """The prompt of one step, in either mode (see the module docstring).

    `history` holds the previous actions, most recent last: strings, or objects with
    `.action` (Steps, PolicyDecisions). In multi-turn mode a last item that is a
    multi-turn decision (`.messages`, `.prompt`, `.index`) is extended by one turn; the
    new prompt is checked to start with the previous prompt plus the chosen letter (the
    learner's packing relies on it), else, or past `max_chat_chars`, a fresh chat starts.
    """
    if not candidates:
        raise ValueError("no candidate actions to choose from")
    candidates = list(candidates)[:MAX_CHOICES]
    labels = label_token_ids(tokenizer, len(candidates))
    prev = history[-1] if history else None
    if multi_turn and prev is not None and _continues(prev) and len(prev.prompt) <= max_chat_chars:
        msgs = list(prev.messages) + [{"role": "assistant", "content": LABELS[prev.index]},
                                      {"role": "user", "content": _turn_text(task, state, candidates, (), False)}]
        prompt = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        if prompt.startswith(prev.prompt + LABELS[prev.index]):
            return ChoicePrompt(prompt, labels, msgs)
    recent = recent_actions(history, history_window)
    msgs = [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": _turn_text(task, state, candidates, recent, True)}]
    prompt = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return ChoicePrompt(prompt, labels, msgs if multi_turn else [])


def build_choice_prompt(tokenizer: Any, task: Task | None, state: str, candidates: Sequence[str],
                        history: Sequence[Any] = (), history_window: int = 3, multi_turn: bool = False,
                        max_chat_chars: int = MAX_CHAT_CHARS) -> tuple[str, list[int]]:
    """(prompt text with the chat template applied, label token ids for the candidates): `choice_turn`'s text.

    Per-step mode: only the last `history_window` previous actions appear, to keep prompts short on CPU.
    """
    turn = choice_turn(tokenizer, task, state, candidates, history, history_window, multi_turn, max_chat_chars)
    return turn.prompt, turn.labels


class LabelMode:
    """Samples one labelled candidate per step from a policy engine (the contract above)."""

    name = "label"

    def __init__(self, client: Any, tokenizer: Any, temperature: float, rng: random.Random, history_window: int = 3,
                 multi_turn: bool = False, max_chat_chars: int = MAX_CHAT_CHARS):
        self.client, self.tokenizer, self.temperature, self.rng = client, tokenizer, temperature, rng
        self.history_window, self.multi_turn, self.max_chat_chars = history_window, multi_turn, max_chat_chars

    async def act(self, task: Task | None, state: str, candidates: Sequence[str], history: Sequence[Any] = (),
                  affinity_key: str | None = None) -> PolicyDecision:
        candidates = list(candidates)[:MAX_CHOICES]
        turn = choice_turn(self.tokenizer, task, state, candidates, history, self.history_window, self.multi_turn,
                           self.max_chat_chars)
        prompt, labels = turn.prompt, turn.labels
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
        index, logps, probs = pick([first[t] for t in labels], self.temperature, self.rng)
        return PolicyDecision(action=candidates[index], index=index, prompt=prompt,
                              action_token_ids=[labels[index]], logprobs=[logps[index]],
                              choice_token_ids=labels, weight_version=int(result.weight_version), probs=probs,
                              messages=turn.messages, temperature=logprob_temperature(self.temperature))
