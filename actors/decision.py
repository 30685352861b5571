"""What a policy decided at one step, and the sampling rule every action mode shares.

Owns `PolicyDecision` (the action plus everything the learner needs to recompute its
log-prob: the prompt, the tokens it trains, their behaviour log-probs, the weight
version), `PolicyError`, and `renormalise` / `pick` (a log-softmax over candidate
scores at the sampling temperature, then a sample or the argmax). Pure Python: the
worker side never imports torch.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Sequence


class PolicyError(RuntimeError):
    """The engine's answer cannot be turned into a choice (no label log-probs, no log-prob per sampled id)."""


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
    choice_lengths: list[int] = field(default_factory=list)  # score mode: candidate lengths in choice_token_ids
    messages: list[dict] = field(default_factory=list)  # multi-turn: the chat so far (the next turn extends it)
    # generate mode (actors/generate_mode.py): `action_token_ids` are the ids the engine sampled,
    # `logprobs` one per id, `index` -1 when the action is no candidate (free text, or invalid).
    prompt_token_ids: list[int] = field(default_factory=list)  # ids this turn appended to the chat before the reply
    new_chat: bool = False  # prompt_token_ids open a fresh chat (first turn, or past actors.chat_max_chars)
    reply: str = ""  # the text the policy wrote (decoded from action_token_ids)
    invalid_reason: str = ""  # "" or actors.reply.INVALID_REASONS: the step leaves the environment unchanged
    finish_reason: str = ""  # the engine's: "stop" (EOS or "</action>") or "length"
    chat_ids: list[int] = field(default_factory=list)  # the whole chat so far, this reply included (next turn appends)
    chat_text: str = ""  # its text (for the chat's length bound and diagnostics)
    free_text: str = ""  # an unmatched action an environment that takes free text may get (actors.free_text_actions)
    format_penalty: float = 0.0  # subtracted from the reward of the step when the reply is invalid
    # label and score mode: the temperature `logprobs` were read at (the sampling one; 1 for the argmax),
    # so the learner reads the policy at it too and its first ratio is 1 (learner/update.py)
    temperature: float = 1.0


def renormalise(label_logps: Sequence[float], temperature: float = 1.0) -> list[float]:
    """log-softmax over the label log-probs at `temperature` (0 = greedy, returned at temperature 1)."""
    t = temperature if temperature > 0 else 1.0
    z = [lp / t for lp in label_logps]
    m = max(z)
    lse = m + math.log(sum(math.exp(v - m) for v in z))
    return [v - lse for v in z]


def logprob_temperature(temperature: float) -> float:
    """The temperature `pick`'s log-probs are at: the sampling one, 1 for the argmax (0)."""
    return temperature if temperature > 0 else 1.0


def pick(raw: Sequence[float], temperature: float, rng: random.Random) -> tuple[int, list[float], list[float]]:
    """(index, log-probs, probabilities) of raw candidate scores: sampled at `temperature` (the
    behaviour log-prob is then the sampled distribution's), or the argmax at 0 (log-probs at 1)."""
    logps = renormalise(raw, logprob_temperature(temperature))
    probs = [math.exp(v) for v in logps]
    if temperature > 0:
        return rng.choices(range(len(raw)), weights=probs)[0], logps, probs
    return max(range(len(raw)), key=lambda i: logps[i]), logps, probs
