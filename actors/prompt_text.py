"""The text every action mode opens a policy turn with: goal, state, previous actions, options.

Owns how an abstract state is shown to the policy: the state's description without
its item list and without a line that repeats the goal, and a web action named by
its element ("click [4] (button 'okay')"), so a prompt reads the same in the label,
score and generate modes.
"""

from __future__ import annotations

from typing import Any, Sequence

from actors.envs.base import AbstractState, ActionFormatError, StateFormatError, parse_action
from infra.schema import Task


_GOAL_PREFIXES = ("goal:", "task:", "objective:")


def _norm(text: str) -> str:
    return " ".join(text.split()).lower()


def state_view(state: str, instruction: str) -> tuple[str, dict[int, str]]:
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


def option_text(candidate: str, items: dict[int, str]) -> str:
    """A web action names an element by ref only; show the element too ("click [4] (button 'okay')")."""
    try:
        action = parse_action(candidate)
    except ActionFormatError:
        return candidate
    if action.kind in ("click", "type") and action.ref in items:
        return f"{candidate} ({items[action.ref]})"
    return candidate


def recent_actions(history: Sequence[Any], history_window: int) -> list[str]:
    """The last `history_window` previous actions as text (strings, or objects with `.action`)."""
    recent = [h if isinstance(h, str) else str(getattr(h, "action", h)) for h in history]
    return recent[-history_window:] if history_window > 0 else []


def context_lines(task: Task | None, state: str, recent: Sequence[str], first: bool) -> tuple[list[str], dict[int, str]]:
    """The lines both action modes open a user message with: goal and previous actions (first turn
    only), the state; and the state's items by ref (for the options' text)."""
    lines = []
    if first and task is not None and task.instruction:
        lines.append(f"Goal: {task.instruction.strip()}")
    desc, items = state_view(state, task.instruction if task is not None else "")
    if desc:
        lines.append(f"State:\n{desc}")
    if first and recent:
        lines.append("Previous actions: " + "; ".join(recent))
    return lines, items
