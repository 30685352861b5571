"""A generate-mode reply read as an action: parsing, normalising, matching to the candidates.

Owns the reply format the `generate` action mode asks for, `<think>...</think><action>...</action>`
(the think part optional), and the reasons a reply names no legal action:

- `truncated`: the engine stopped at the token limit (`finish_reason` "length") before a
  complete `<action>...</action>`; a reply that closed its action just at the limit is fine;
- `no_action`: no complete, non-empty `<action>...</action>` (the first one counts);
- `not_admissible`: the action text matches no candidate after `normalise` (case, spacing,
  surrounding quotes/backticks, trailing punctuation), and free text is not taken.

Everything here is pure and total: any string (unicode, nested or unbalanced tags, megabytes)
gives a `Reply`, never an exception; tests/test_reply.py fuzzes it. Departure from the paper:
the paper does not say how its agents' actions are parsed; this follows verl-agent's
`<think>`/`<action>` tags, with a stricter rule (an unclosed `<action>` is not an action).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

TRUNCATED, NO_ACTION, NOT_ADMISSIBLE = "truncated", "no_action", "not_admissible"
INVALID_REASONS = (TRUNCATED, NO_ACTION, NOT_ADMISSIBLE)
ACTION_OPEN, ACTION_CLOSE, THINK_OPEN, THINK_CLOSE = "<action>", "</action>", "<think>", "</think>"
MAX_ACTION_CHARS = 500  # an "action" longer than this is prose, not a command

_ACTION = re.compile(r"<action>(.*?)</action>", re.DOTALL | re.IGNORECASE)
_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL | re.IGNORECASE)
_QUOTES = "\"'`\u201c\u201d\u2018\u2019"
_TRAILING = ".!;,:"

# What the next user message says about an invalid reply (actors/generate_mode.py).
REASON_TEXT = {
    TRUNCATED: "Your last reply was cut off before </action>. Keep the reasoning short.",
    NO_ACTION: "Your last reply had no <action>...</action>.",
    NOT_ADMISSIBLE: "Your last action is not one of the available actions. Copy one exactly.",
}


@dataclass(frozen=True)
class Reply:
    """A reply as read: its reasoning, its action text (as written, stripped) and why it names no action."""

    think: str
    action: str
    invalid_reason: str  # "" or one of INVALID_REASONS (not_admissible is decided by match_action)


def parse_reply(text: str, finish_reason: str = "stop") -> Reply:
    """Read `text` (the decoded reply). Never raises; `action` is "" exactly when it is invalid here."""
    text = text if isinstance(text, str) else ""
    think_m = _THINK.search(text)
    think = think_m.group(1).strip() if think_m else ""
    m = _ACTION.search(text)
    action = m.group(1).strip() if m else ""
    if action and len(action) <= MAX_ACTION_CHARS and ACTION_OPEN not in action.lower():
        return Reply(think, action, "")
    reason = TRUNCATED if str(finish_reason) == "length" and m is None else NO_ACTION
    return Reply(think, "", reason)


def normalise(text: str) -> str:
    """Case, inner spacing, surrounding quotes/backticks and trailing punctuation folded away."""
    s = " ".join(str(text).split()).lower()
    prev = None
    while s != prev:
        prev = s
        s = s.rstrip(_TRAILING).strip()
        if len(s) >= 2 and s[0] in _QUOTES and s[-1] in _QUOTES:
            s = s[1:-1].strip()
    return s


def match_action(action: str, candidates: Sequence[str]) -> str | None:
    """The candidate `action` names (exactly, else after `normalise`), or None."""
    if not isinstance(action, str) or not action.strip():
        return None
    if action in candidates:
        return action
    want = normalise(action)
    if not want:
        return None
    for c in candidates:
        if normalise(c) == want:
            return c
    return None
