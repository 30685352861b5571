"""The strict parser of Mexp's tagged output.

Owns the target format the experience model writes and the rules for reading it:

    <think>reasoning</think>
    <state>abstract state with numbered items</state>
    <reward>0 or 1</reward>
    <done>true or false</done>

The think block is optional (the w/o-reasoning ablation omits it). Everything else
is exact: the text, stripped, must start with `<think>` or `<state>` and end with
`</done>`; nothing may sit between the blocks but whitespace.

Observation text may itself contain tag-like strings (a note reading "<state>",
a web page with "</done>"). The parser therefore reads the tightly-formatted tail
first, anchored at the end: `<reward>NUMBER</reward> <done>BOOL</done>`, which
cannot contain free text; the state is what lies between the first
`</think><state>` boundary (or the leading `<state>`) and the `</state>` just before
`<reward>`. So a state may contain any tags at all; only the reasoning may not
contain the exact boundary `</think>` + `<state>`.

Every failure is a `MexpParseError` with a short `reason` (used as the metric
label): "not_text", "structure", "reward", "done", "state" (and "actions", raised by the
experience model's action check, simulator/experience_model.py).

`contradicted_reward(out, state)` reads a parsed reply against itself: a reward of 1
whose own reasoning does not show the step achieving every item of the state's To do line (the
env-facts rationale's check, actors/envs/textworld_env.py `facts_rationale`). The experience
model applies it (`simulator.reward_check`); this module only says whether the reply
contradicts itself. `affirmed_reward(out, state)` is the same check read the other way: a reward
of 0 whose reasoning shows every item achieved (applied with `simulator.reward_affirm`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from actors.envs.base import StateFormatError, to_do_items, validate_state

_TAIL = re.compile(r"</state>\s*<reward>\s*([^<>]*?)\s*</reward>\s*<done>\s*([^<>]*?)\s*</done>\s*\Z", re.S)
_BOUNDARY = re.compile(r"</think>\s*<state>", re.S)
_NOW = re.compile(r"\bnow (.*?)(?:;|$)", re.M)  # the rationale's "now A, B" clause: what the step made true
_TRUE = {"true", "yes", "1"}
_FALSE = {"false", "no", "0"}
MAX_CHARS = 20_000


class MexpParseError(ValueError):
    """Mexp output not in the target format; `reason` names what was wrong."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass
class MexpOutput:
    reasoning: str
    next_state: str
    reward: float
    done: bool
    contradicted: bool = False  # a reward of 1 set to 0 by the reward check (simulator/experience_model.py)
    affirmed: bool = False  # a reward of 0 set to 1 (and done) by simulator.reward_affirm
    replayed: bool = False  # a real transition's outcome, not Mexp's (simulator.replay_real)


def parse_mexp_output(text: str) -> MexpOutput:
    """Parse one Mexp reply; raise MexpParseError (never anything else) if it is not exactly the format."""
    if not isinstance(text, str):
        raise MexpParseError("not_text", f"expected str, got {type(text).__name__}")
    if len(text) > MAX_CHARS:
        raise MexpParseError("structure", f"output longer than {MAX_CHARS} characters")
    body = text.strip()
    tail = _TAIL.search(body)
    if tail is None:
        raise MexpParseError("structure", "does not end with </state><reward>…</reward><done>…</done>")
    head = body[:tail.start()]  # "<think>R</think><state>S" or "<state>S"
    if head.startswith("<think>"):
        boundary = _BOUNDARY.search(head)
        if boundary is None:
            raise MexpParseError("structure", "no </think><state> after the <think> block")
        reasoning = head[len("<think>"):boundary.start()].strip()
        state = head[boundary.end():]
    elif head.startswith("<state>"):
        reasoning, state = "", head[len("<state>"):]
    else:
        raise MexpParseError("structure", "must start with <think> or <state>")
    reward = _parse_reward(tail.group(1))
    done = _parse_done(tail.group(2))
    state = state.strip()
    try:
        validate_state(state)
    except StateFormatError as exc:
        raise MexpParseError("state", str(exc)) from None
    return MexpOutput(reasoning, state, reward, done)


def contradicted_reward(out: MexpOutput, state: str) -> bool:
    """True when `out` rewards the step although its own reasoning does not show this step achieving
    every item that `state` (the state the step started from) lists under "To do:": an item its
    "now ..." clause (what the step made true) does not name, or one it marks "(not yet)". The To do
    line holds only what is not yet true, so a winning step makes every item true: on the 142
    rewarded real steps of the CPU preset's collection each item is in the clause.

    The env-facts rationale Mexp learns to write (actors/envs/textworld_env.py
    `facts_rationale`) copies each To do item and marks it done or not yet, and a quest is won
    exactly when every item is done. The 135M Mexp's false rewards mostly break that: its check
    says an item is still to do, or marks done an item its "now" clause did not bring about, and
    the state it writes next says "To do: nothing" with reward 1. Items its check copies from the retrieved neighbours ("chest locked
    (not yet)" in a game with no chest) do not count. A state with no To do line (other
    environments): any "(not yet)" in the reasoning. A reply with no reasoning is never contradicted."""
    if out.reward < 0.5 or not out.reasoning.strip():  # no reasoning (the w/o-reasoning ablation): no check
        return False
    reasoning = out.reasoning.lower()
    items = to_do_items(state)
    if items is None:
        return "(not yet)" in reasoning
    return not _checks_off(reasoning, items)


def affirmed_reward(out: MexpOutput, state: str) -> bool:
    """True when `out` does not reward the step although its own reasoning shows this step achieving
    every item that `state`'s "To do:" line lists: each is in its "now ..." clause and none is marked
    "(not yet)", exactly the check `contradicted_reward` reads the other way.

    The 135M Mexp on textworld_long's longer states writes the step's effect right ("close portal: now
    portal closed") and then copies a retrieved neighbour's to-do list instead of the state's, and
    answers reward 0: on 160 held-out real steps it found 12 of 40 rewarded steps, and read this way
    24 of 40, with no false reward on the 120 unrewarded ones (docs/experiments.md, collection 47). A
    state with no To do line, or one with nothing left to do, and a reply with no reasoning: never."""
    if out.reward >= 0.5 or not out.reasoning.strip():
        return False
    items = to_do_items(state)
    return bool(items) and _checks_off(out.reasoning.lower(), items)


def _checks_off(reasoning: str, items: list[str]) -> bool:
    """Whether lower-case `reasoning` shows every To do item made true: in its "now" clause, not "(not yet)"."""
    now = _NOW.search(reasoning)
    achieved = now.group(1) if now else ""
    return all(i in achieved and f"{i} (not yet)" not in reasoning for i in items)


def parse_state_only(text: str) -> str:
    """Parse `<state>…</state>` (Mexp's answer when asked for a task's initial state)."""
    if not isinstance(text, str):
        raise MexpParseError("not_text", f"expected str, got {type(text).__name__}")
    body = text.strip()
    if not (body.startswith("<state>") and body.endswith("</state>")):
        raise MexpParseError("structure", "expected exactly <state>…</state>")
    state = body[len("<state>"):-len("</state>")].strip()
    try:
        validate_state(state)
    except StateFormatError as exc:
        raise MexpParseError("state", str(exc)) from None
    return state


def _parse_reward(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise MexpParseError("reward", f"not a number: {raw[:40]!r}") from None
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise MexpParseError("reward", f"outside [0, 1]: {raw[:40]!r}")
    return value


def _parse_done(raw: str) -> bool:
    word = raw.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise MexpParseError("done", f"not true/false: {raw[:40]!r}")


def format_mexp_output(out: MexpOutput, with_reasoning: bool = True) -> str:
    """The target text for `out` (what SFT trains on and what the parser accepts)."""
    reward = "1" if out.reward >= 1.0 else ("0" if out.reward <= 0.0 else f"{out.reward:g}")
    think = f"<think>{out.reasoning.strip()}</think>\n" if with_reasoning else ""
    return (f"{think}<state>\n{out.next_state.strip()}\n</state>\n<reward>{reward}</reward>\n"
            f"<done>{'true' if out.done else 'false'}</done>")
