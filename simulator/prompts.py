"""The experience model's prompt: what Mexp is conditioned on, in one place.

Owns the chat messages for one Mexp step (paper §4.1, Eq. 4): the task instruction,
a window of past actions, the top-k retrieved transitions (each as its action and
effect), the current state and the action; and the prompt for inventing a task's initial state. Inference
(simulator/experience_model.py) and SFT (learner/mexp_sft.py) both build prompts
here, so the model is trained on exactly what it sees when serving.

Departure from the paper: prompts are kept short for a 135M model on CPU (target
under ~400 tokens). The history window shows past actions only (the current state
already summarises their effect), and a retrieved transition is shown as its action,
its effect (its reasoning, clipped to `state_chars` characters; its next state when it
has none), reward and done, not as two full states. With `retrieved_todo=False` (`simulator.retrieved_todo`) the
effect loses its "to do: ..." clause: a neighbour's to-do list is another episode's, and the 135M Mexp copied it
in place of the current state's (docs/experiments.md, collections 47-48: reward recall 12 -> 28 of 40 without it). The state's "Goal: ..." line never changes within an
episode and repeats the task instruction, so Mexp neither sees it in states nor
writes it: `split_goal` removes it from every state in the prompt and from the
target, and `join_goal` puts the current state's goal line back on the parsed next
state. That saves ~100 tokens per state on TextWorld. The assistant turn is
pre-filled with the first tag (`<think>` or `<state>`) so the model starts in format.
"""

from __future__ import annotations

from typing import Any, Sequence

from infra.schema import Task
from simulator.replay_buffer import Transition

# Bump when the prompt or the target format changes: cached Mexp checkpoints are keyed by it.
PROMPT_FORMAT = 1
SYSTEM = ("You simulate a text environment. Given the task, the current state and an action, "
          "write the next state as a short description followed by numbered actions like [1] open door. "
          "Reply exactly in the format")
FORMAT_REASONING = "<think>why</think><state>next state</state><reward>0 or 1</reward><done>true or false</done>"
FORMAT_PLAIN = "<state>next state</state><reward>0 or 1</reward><done>true or false</done>"
INITIAL_SYSTEM = ("You simulate a text environment. Write the initial state for the task: a short description "
                  "followed by numbered actions like [1] open door. Reply exactly as <state>…</state>")


GOAL_PREFIX = "Goal:"


def split_goal(state: str) -> tuple[str, str]:
    """(the leading "Goal: ..." line or "", the rest of the state)."""
    text = state.strip()
    first, _, rest = text.partition("\n")
    if first.startswith(GOAL_PREFIX):
        return first, rest.strip()
    return "", text


def join_goal(goal: str, body: str) -> str:
    if not goal or body.lstrip().startswith(GOAL_PREFIX):
        return body.strip()
    return f"{goal}\n{body.strip()}"


def clip(text: str, n: int) -> str:
    text = text.strip()
    return text if len(text) <= n else text[:n].rstrip() + " …"


TODO_CLAUSE = "to do:"


def drop_todo(effect: str) -> str:
    """`effect` without its "to do: ..." clause ('take apple: now apple in inventory; to do: apple in fridge
    (not yet)' -> 'take apple: now apple in inventory'); the other "; "-separated clauses stay."""
    return "; ".join(c for c in effect.split("; ") if not c.strip().startswith(TODO_CLAUSE))


def _example(t: Transition, state_chars: int, todo: bool = True) -> str:
    # An example is its action and effect, not its two full states: on TextWorld the
    # states cost ~150 tokens each, the effect (the env-facts rationale, or Mexp's
    # reasoning for synthetic ones) ~30, and the effect is what grounds the dynamics.
    reasoning = t.reasoning.strip() if todo else drop_todo(t.reasoning.strip())
    effect = clip(reasoning, state_chars) if reasoning else clip(split_goal(t.next_state)[1], state_chars)
    return f"- {t.action} -> {effect} (reward {t.reward:g}, done {str(bool(t.done)).lower()})"


def step_messages(task: Task, history: Sequence[Any], retrieved: Sequence[Transition], state: str, action: str,
                  *, reasoning: bool = True, history_window: int = 3, state_chars: int = 600,
                  retrieved_todo: bool = True) -> list[dict]:
    """Chat messages for one step. `history` holds past steps (anything with `.action`, or action strings)."""
    parts = [f"Task: {task.instruction.strip()}"]
    if retrieved:
        parts.append("Similar past transitions:\n" + "\n".join(_example(t, state_chars, retrieved_todo)
                                                                  for t in retrieved))
    past = [h if isinstance(h, str) else h.action for h in history][-history_window:] if history_window else []
    if past:
        parts.append("Previous actions: " + "; ".join(past))
    parts.append(f"Current state:\n{split_goal(state)[1]}")
    parts.append(f"Action: {action.strip()}")
    system = f"{SYSTEM} {FORMAT_REASONING if reasoning else FORMAT_PLAIN}"
    return [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]


def prefill(reasoning: bool) -> str:
    """The text the assistant turn starts with (part of the prompt, not generated)."""
    return "<think>" if reasoning else "<state>"


def initial_messages(task: Task) -> list[dict]:
    return [{"role": "system", "content": INITIAL_SYSTEM}, {"role": "user", "content": f"Task: {task.instruction}"}]


def render(tokenizer, messages: list[dict], assistant_prefix: str = "") -> str:
    """Apply the chat template and append the assistant pre-fill."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text + assistant_prefix
