"""The policy as the rollout worker, evaluation and the warm start see it: one interface, a
strategy per action mode.

Owns `Policy` (what `act()` returns for one step, whatever the mode) and the choice of
strategy, `actors.action_mode`:
- `label` (actors/label_mode.py): the candidates listed under single-token letters; one
  forward pass, the letter's log-prob renormalised over the labels;
- `score` (actors/score_mode.py): every candidate's length-normalised log-likelihood after
  the prompt, softmaxed over the candidates (per-step prompts only);
- `generate` (actors/generate_mode.py): the paper's agent. It writes
  `<think>...</think><action>...</action>` token by token; the decision carries the exact
  token ids the engine sampled and their log-probs, and the learner trains those ids.

Every strategy returns an `actors.decision.PolicyDecision`, which actors/episode.py records
into the Step the learner trains on. The learner-side twins of these log-probs live in
learner/ (learner/choice_logprobs.py, learner/policy_model.py, learner/token_logprobs.py):
nothing under actors/ imports torch.

Departures from the paper: the paper's agents generate free-form reasoning then an
action (the `generate` mode). A 135M model on a CPU cannot do that well (zero-shot,
SmolLM2-135M answered with no valid action number 55 % of the time), so the CPU presets
pick among the candidates (`label`, `score`). Workers should sample at temperature 1: the
learner optimises the temperature-1 distribution and a tempered behaviour log-prob would
bias the ratio.
"""

from __future__ import annotations

import random
from typing import Any, Protocol, Sequence

from actors.decision import PolicyDecision, PolicyError, pick, renormalise
from actors.generate_mode import GenerateMode
from actors.label_mode import (LABELS, MAX_CHAT_CHARS, MAX_CHOICES, SYSTEM_PROMPT, ChoicePrompt, LabelMode,
                               build_choice_prompt, choice_turn, label_token_ids)
from actors.score_mode import SCORE_SYSTEM_PROMPT, ScoreMode, ScorePrompt, score_turn, split_choices
from infra.schema import Task

__all__ = ["ACTION_MODES", "LABELS", "MAX_CHAT_CHARS", "MAX_CHOICES", "PROMPT_FORMAT", "SCORE_SYSTEM_PROMPT",
           "SYSTEM_PROMPT", "ActionMode", "ChoicePrompt", "Policy", "PolicyDecision", "PolicyError", "ScorePrompt",
           "build_choice_prompt", "choice_turn", "label_token_ids", "pick", "renormalise", "score_turn",
           "split_choices"]

# Bump when the policy prompt changes: cached warm-started policies are keyed by it (and by the
# mode when multi-turn; the per-step prompt is unchanged, so its caches stay valid). 2: score mode
# scores a web action with its element's text (TextWorld's command candidates read as before).
PROMPT_FORMAT = 2
ACTION_MODES = ("label", "score", "generate")


class ActionMode(Protocol):
    """One action mode's strategy: the decision for one step."""

    name: str

    async def act(self, task: Task | None, state: str, candidates: Sequence[str], history: Sequence[Any] = (),
                  affinity_key: str | None = None) -> PolicyDecision: ...


class Policy:
    """Acts through a policy engine in the mode asked for (see the module docstring)."""

    def __init__(self, client: Any, tokenizer: Any, temperature: float = 1.0, seed: int | None = None,
                 history_window: int = 3, multi_turn: bool = False, max_chat_chars: int = MAX_CHAT_CHARS,
                 action_mode: str = "label", max_reply_tokens: int = 64, think: bool = True,
                 format_penalty: float = 0.0, free_text_actions: bool = False, max_chat_tokens: int = 1_536):
        if action_mode not in ACTION_MODES:
            raise ValueError(f"action_mode must be one of {ACTION_MODES}, got {action_mode!r}")
        if action_mode == "score" and multi_turn:
            raise ValueError("action_mode 'score' uses per-step prompts (multi_turn false)")
        if action_mode == "generate" and not multi_turn:
            raise ValueError("action_mode 'generate' plays an episode as one chat (multi_turn true)")
        self.client, self.tokenizer = client, tokenizer
        self.action_mode = action_mode
        self.temperature = temperature
        self.rng = random.Random(seed)
        if action_mode == "score":
            self.mode: ActionMode = ScoreMode(client, tokenizer, temperature, self.rng, history_window)
        elif action_mode == "generate":
            self.mode = GenerateMode(client, tokenizer, temperature, self.rng, history_window, max_chat_chars,
                                     max_reply_tokens, think, format_penalty, free_text_actions, max_chat_tokens)
        else:
            self.mode = LabelMode(client, tokenizer, temperature, self.rng, history_window, multi_turn, max_chat_chars)

    @classmethod
    def from_config(cls, actors: Any, client: Any, tokenizer: Any, temperature: float | None = None,
                    seed: int | None = None) -> Policy:
        """The policy `actors` (infra/config.py ActorsConfig) asks for; `temperature` overrides its own
        (evaluation is greedy by default)."""
        return cls(client, tokenizer, actors.temperature if temperature is None else temperature, seed=seed,
                   multi_turn=actors.multi_turn, max_chat_chars=actors.chat_max_chars,
                   action_mode=actors.action_mode, max_reply_tokens=getattr(actors, "max_reply_tokens", 64),
                   think=getattr(actors, "think", True), format_penalty=getattr(actors, "format_penalty", 0.0),
                   free_text_actions=getattr(actors, "free_text_actions", False),
                   max_chat_tokens=getattr(actors, "chat_max_tokens", 1_536))

    async def act(self, task: Task | None, state: str, candidates: Sequence[str], history: Sequence[Any] = (),
                  affinity_key: str | None = None) -> PolicyDecision:
        return await self.mode.act(task, state, candidates, history, affinity_key)
