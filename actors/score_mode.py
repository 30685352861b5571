"""Score mode: each candidate's log-likelihood after the prompt; the policy is their softmax.

Owns the score-mode contract (per-step prompts only). The prompt lists the possible
actions and asks for the next one; the policy engine returns the log-likelihood of
every candidate's text as listed (a web action with its element's text,
`click [4] (button 'okay')`; plus the end-of-turn token) after the prompt
(`EngineClient.score`, SGLang's prefill log-probs), and the policy is the softmax over
candidates of their length-normalised log-likelihoods (learner/policy_model.py's
`scored_logprobs` is the learner's twin, both through infra/engine/scoring.py).
Measured on 96 held-out TextWorld decisions: SmolLM2-135M picks the expert's action
26 % of the time with letters (chance) and 48 % by scoring, and 20 supervised steps on
train-game decisions took scoring to 88 % while letters stayed at chance after 75. This
is how small LMs act in text games in GLAM (Carta et al., 2023).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

from actors.decision import PolicyDecision, logprob_temperature, pick
from actors.label_mode import MAX_CHOICES
from actors.prompt_text import context_lines, option_text, recent_actions
from infra.schema import Task

SCORE_SYSTEM_PROMPT = ("You are an agent acting in a text environment. Read the goal and the current state, "
                       "then answer with the next action.")


@dataclass
class ScorePrompt:
    """One step's prompt in score mode: the text, its token ids, and each candidate's continuation ids."""

    prompt: str
    prefix: list[int]
    continuations: list[list[int]]


def score_turn(tokenizer: Any, task: Task | None, state: str, candidates: Sequence[str],
               history: Sequence[Any] = (), history_window: int = 3) -> ScorePrompt:
    """The score-mode prompt: goal, state, previous actions, the possible actions, the question;
    each candidate's continuation is its text as listed (a web action with its element:
    `click [4] (button 'okay')`) followed by the end-of-turn token."""
    if not candidates:
        raise ValueError("no candidate actions to choose from")
    lines, items = context_lines(task, state, recent_actions(history, history_window), True)
    shown = [option_text(c, items) for c in candidates]
    lines.append("Possible actions: " + "; ".join(shown))
    lines.append("What is the next action?")
    msgs = [{"role": "system", "content": SCORE_SYSTEM_PROMPT}, {"role": "user", "content": "\n".join(lines)}]
    prompt = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    end = tokenizer.eos_token or ""
    # scored as shown: a web action with its element's text, so its likelihood is about the element
    # and not only the digits of its ref
    conts = [tokenizer(s + end, add_special_tokens=False)["input_ids"] for s in shown]
    return ScorePrompt(prompt, tokenizer(prompt, add_special_tokens=False)["input_ids"], conts)


def split_choices(choice_token_ids: Sequence[int], choice_lengths: Sequence[int]) -> list[list[int]]:
    """Score mode: the flat candidate token ids of a Step back into one list per candidate."""
    out, k = [], 0
    for n in choice_lengths:
        out.append([int(t) for t in choice_token_ids[k:k + n]])
        k += n
    return out


class ScoreMode:
    """Scores every candidate through a policy engine and samples one (the contract above)."""

    name = "score"

    def __init__(self, client: Any, tokenizer: Any, temperature: float, rng: random.Random, history_window: int = 3):
        self.client, self.tokenizer, self.temperature, self.rng = client, tokenizer, temperature, rng
        self.history_window = history_window

    async def act(self, task: Task | None, state: str, candidates: Sequence[str], history: Sequence[Any] = (),
                  affinity_key: str | None = None) -> PolicyDecision:
        candidates = list(candidates)[:MAX_CHOICES]  # as many as label mode lists
        turn = score_turn(self.tokenizer, task, state, candidates, history, self.history_window)
        rows, version = await self.client.score(turn.prefix, turn.continuations, affinity_key=affinity_key)
        raw = [sum(r) / len(r) for r in rows]  # length-normalised log-likelihood per candidate
        index, logps, probs = pick(raw, self.temperature, self.rng)
        return PolicyDecision(action=candidates[index], index=index, prompt=turn.prompt,
                              action_token_ids=list(turn.continuations[index]), logprobs=[logps[index]],
                              choice_token_ids=[t for c in turn.continuations for t in c], weight_version=int(version),
                              probs=probs, choice_lengths=[len(c) for c in turn.continuations],
                              temperature=logprob_temperature(self.temperature))
