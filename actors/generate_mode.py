"""Generate mode: the paper's agent. It writes `<think>...</think><action>...</action>` token by token.

Owns the worker's side of the token-in-token-out contract (the design of issue 60): an
episode is ONE chat, kept as the list of token ids the engine has seen, never re-tokenised.

- Turn 1 (`new_chat`): `prompt_token_ids` = the chat template over [system, user] with the
  generation prompt, tokenised (no special tokens added). The system prompt states the reply
  format (`actors.think` false: the action alone).
- Turn k > 1: `prompt_token_ids` = the tokenisation, alone, of the text that closes the
  previous reply and opens the next one (end of turn, user message, assistant header). That
  text is taken from the tokenizer's own template (rendered with and without one more
  exchange), minus the end-of-turn token when the reply already ended with it. The engine
  is sent `chat_ids + prompt_token_ids`: exactly the previous turns' prompt and reply ids.
- The reply: `client.generate(input_ids=..., max_new_tokens=actors.max_reply_tokens,
  temperature, stop=["</action>"], return_logprob=True)`; `action_token_ids` = the sampled
  `output_ids` (the stop string's tokens included), `logprobs` = `output_logprobs` (one per id,
  temperature 1, as SGLang). The text decoded from those ids is parsed (actors/reply.py) and
  matched to the candidates; an invalid reply is a decision with `action` "" and
  `invalid_reason`, which actors/episode.py records without stepping the environment. The
  next user message says why.
- A chat whose text (`chat_text`: the decoded ids, special tokens shown) would pass
  `actors.chat_max_chars` characters, or whose ids plus a full reply (`max_reply_tokens`)
  would pass `actors.chat_max_tokens`, restarts as a fresh turn 1 that lists the last
  actions, as the label mode's chat does. The token bound is the one that keeps a request
  inside the model's context (TextWorld text is about 6 characters a token, a sampled
  reply can be anything).

`expert_turns` / `expert_reply` build the SFT warm start's teacher-forced turns with the same
code path (`next_turn`), so the warm start and the worker lay out tokens identically. An
expert reply's ids end at "</action>", as a sampled one does (the engine stops on that
string); the end-of-turn token goes into the next turn's prompt ids, masked out of the loss.

Departure from the paper: the paper does not give its agents' prompt; this one follows
verl-agent's ALFWorld/WebShop `<think>`/`<action>` prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

from actors.decision import PolicyDecision, PolicyError
from actors.label_mode import MAX_CHAT_CHARS
from actors.prompt_text import context_lines, option_text, recent_actions
from actors.reply import ACTION_CLOSE, NOT_ADMISSIBLE, REASON_TEXT, match_action, parse_reply
from infra.schema import Task

THINK_SYSTEM_PROMPT = ("You are an agent acting in a text environment. Each turn, read the goal, the state and the "
                       "available actions, reason briefly inside <think>...</think>, then write exactly one available "
                       "action, copied as listed, inside <action>...</action>.")
ACTION_SYSTEM_PROMPT = ("You are an agent acting in a text environment. Each turn, read the goal, the state and the "
                        "available actions, then write exactly one available action, copied as listed, inside "
                        "<action>...</action>, and nothing else.")
MAX_CHAT_TOKENS = 1_536  # default for actors.chat_max_tokens
_PLACEHOLDER = "A"  # the assistant message the chat template's turn delta is measured around


def system_prompt(think: bool) -> str:
    return THINK_SYSTEM_PROMPT if think else ACTION_SYSTEM_PROMPT


def reply_format(think: bool) -> str:
    return ("Reply as <think>your reasoning</think><action>one available action</action>." if think
            else "Reply as <action>one available action</action>.")


def expert_reply(action: str, rationale: str, think: bool) -> str:
    """The reply the policy should write for `action`: `<think>{rationale}</think><action>{action}</action>`
    (the action alone when `think` is false). No end-of-turn: a sampled reply ends at "</action>" too."""
    act = f"<action>{action.strip()}</action>"
    return f"<think>{' '.join(str(rationale).split())}</think>{act}" if think else act


def user_message(task: Task | None, state: str, candidates: Sequence[str], recent: Sequence[str], first: bool,
                 think: bool, invalid_reason: str = "") -> tuple[str, list[str]]:
    """(a user message: why the last reply was invalid, goal and previous actions on a first turn, state,
    the available actions, the reply format; the candidates as shown)."""
    lines = [f"{REASON_TEXT.get(invalid_reason, 'Your last reply was invalid.')} The state is unchanged."] \
        if invalid_reason else []
    ctx, items = context_lines(task, state, recent, first)
    shown = [option_text(c, items) for c in candidates]
    lines += ctx + ["Available actions:"] + [f"- {s}" for s in shown] + [reply_format(think)]
    return "\n".join(lines), shown


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_delta_text(tokenizer: Any, user_text: str, closing: str = "") -> str:
    """The text the chat template puts between an assistant reply and the next assistant reply: the end of
    turn, the user message `user_text`, the assistant header; less `closing` (the reply's own end-of-turn
    token, when it ended with one). Raises PolicyError when the template does not extend a chat."""
    base = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    head = tokenizer.apply_chat_template(base, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(base + [{"role": "assistant", "content": _PLACEHOLDER},
                                                 {"role": "user", "content": user_text}],
                                         tokenize=False, add_generation_prompt=True)
    if not full.startswith(head + _PLACEHOLDER):
        raise PolicyError("the tokenizer's chat template does not extend a chat by appending turns; "
                          "generate mode needs one that does (multi-turn token in, token out)")
    delta = full[len(head) + len(_PLACEHOLDER):]
    return delta[len(closing):] if closing and delta.startswith(closing) else delta


def _closing(tokenizer: Any, reply_ids: Sequence[int]) -> str:
    """The reply's last token as text when it is a special one (the end of turn it stopped on), else ""."""
    if reply_ids and int(reply_ids[-1]) in set(getattr(tokenizer, "all_special_ids", []) or []):
        return tokenizer.decode([int(reply_ids[-1])], skip_special_tokens=False)
    return ""


@dataclass
class Turn:
    """One turn's prompt: the ids it appends, the whole chat the engine is sent, its text, the options shown."""

    prompt_token_ids: list[int]
    input_ids: list[int]
    text: str
    new_chat: bool
    shown: list[str]


def _continues(prev: Any) -> bool:
    return prev is not None and bool(getattr(prev, "chat_ids", None)) and isinstance(getattr(prev, "chat_text", None), str)


def _valid_actions(history: Sequence[Any]) -> list[Any]:
    return [h for h in history if isinstance(h, str) or (not getattr(h, "invalid_reason", "") and getattr(h, "action", ""))]


def next_turn(tokenizer: Any, task: Task | None, state: str, candidates: Sequence[str], history: Sequence[Any],
              think: bool, max_chat_chars: int = MAX_CHAT_CHARS, history_window: int = 3,
              max_chat_tokens: int = MAX_CHAT_TOKENS, max_reply_tokens: int = 0) -> Turn:
    """This turn's prompt ids after `history` (previous decisions, most recent last; a last one with
    `chat_ids`/`chat_text` is extended, unless the chat would pass `max_chat_chars` characters, or
    `max_chat_tokens` tokens with a reply of `max_reply_tokens`; strings or other objects start a chat
    that lists them as the previous actions)."""
    prev = history[-1] if history else None
    reason = str(getattr(prev, "invalid_reason", "") or "") if prev is not None and not isinstance(prev, str) else ""
    if _continues(prev):
        user, shown = user_message(task, state, candidates, (), False, think, reason)
        delta = chat_delta_text(tokenizer, user, _closing(tokenizer, getattr(prev, "action_token_ids", [])))
        ids = encode(tokenizer, delta) if len(prev.chat_text) + len(delta) <= max_chat_chars else None
        if ids is not None and len(prev.chat_ids) + len(ids) + max_reply_tokens <= max_chat_tokens:
            return Turn(ids, list(prev.chat_ids) + ids, prev.chat_text + delta, False, shown)
    recent = recent_actions(_valid_actions(history), history_window)
    user, shown = user_message(task, state, candidates, recent, True, think, reason)
    text = tokenizer.apply_chat_template([{"role": "system", "content": system_prompt(think)},
                                          {"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
    ids = encode(tokenizer, text)
    return Turn(ids, list(ids), text, True, shown)


def judge(text: str, finish_reason: str, candidates: Sequence[str], shown: Sequence[str],
          free_text: bool = False) -> tuple[str, int, str, str, str]:
    """(action, candidate index or -1, invalid reason, free-text action, reasoning) of a decoded reply.
    An action may name a candidate as listed or as shown (a web action with its element's text)."""
    reply = parse_reply(text, finish_reason)
    if reply.invalid_reason:
        return "", -1, reply.invalid_reason, "", reply.think
    hit = match_action(reply.action, candidates)
    if hit is None:
        as_shown = match_action(reply.action, shown)
        hit = candidates[list(shown).index(as_shown)] if as_shown is not None else None
    if hit is not None:
        return hit, list(candidates).index(hit), "", "", reply.think
    return "", -1, NOT_ADMISSIBLE, reply.action if free_text else "", reply.think


@dataclass
class TurnIds:
    """One teacher-forced turn: the prompt ids it appends (mask 0), the reply ids (mask 1), a fresh chat or not."""

    prompt_token_ids: list[int]
    reply_token_ids: list[int]
    new_chat: bool


@dataclass
class _Said:
    """What a turn leaves for the next one (the fields `next_turn` reads of a decision)."""

    action: str
    invalid_reason: str
    action_token_ids: list[int]
    chat_ids: list[int]
    chat_text: str


def expert_turns(tokenizer: Any, task: Task | None, turns: Sequence[tuple[str, Sequence[str], str]], think: bool,
                 max_chat_chars: int = MAX_CHAT_CHARS, history_window: int = 3, max_chat_tokens: int = MAX_CHAT_TOKENS,
                 max_reply_tokens: int = 64) -> list[TurnIds]:
    """Teacher-forced turns of one episode, laid out exactly as the worker lays out its own: `turns` are
    (state, candidates, reply text) in order (replies from `expert_reply`); the reply ids are the reply
    text tokenised alone. An invalid reply is kept, and the next turn says why, as in a rollout."""
    out: list[TurnIds] = []
    history: list[Any] = []
    for state, candidates, reply in turns:
        turn = next_turn(tokenizer, task, state, candidates, history, think, max_chat_chars, history_window,
                         max_chat_tokens, max_reply_tokens)
        rids = encode(tokenizer, reply)
        out.append(TurnIds(turn.prompt_token_ids, rids, turn.new_chat))
        action, _, reason, _, _ = judge(reply, "stop", candidates, turn.shown)
        history.append(_Said(action, reason, rids, turn.input_ids + rids, turn.text + reply))
    return out


class GenerateMode:
    """Writes each reply through a policy engine and reads the action out of it (the contract above)."""

    name = "generate"

    def __init__(self, client: Any, tokenizer: Any, temperature: float, rng: random.Random, history_window: int = 3,
                 max_chat_chars: int = MAX_CHAT_CHARS, max_reply_tokens: int = 64, think: bool = True,
                 format_penalty: float = 0.0, free_text_actions: bool = False, max_chat_tokens: int = MAX_CHAT_TOKENS):
        self.client, self.tokenizer, self.temperature, self.rng = client, tokenizer, temperature, rng
        self.history_window, self.max_chat_chars, self.max_reply_tokens = history_window, max_chat_chars, max_reply_tokens
        self.think, self.format_penalty, self.free_text_actions = think, format_penalty, free_text_actions
        self.max_chat_tokens = max_chat_tokens

    async def act(self, task: Task | None, state: str, candidates: Sequence[str], history: Sequence[Any] = (),
                  affinity_key: str | None = None) -> PolicyDecision:
        if not candidates:
            raise ValueError("no candidate actions to choose from")
        candidates = list(candidates)
        turn = next_turn(self.tokenizer, task, state, candidates, history, self.think, self.max_chat_chars,
                         self.history_window, self.max_chat_tokens, self.max_reply_tokens)
        result = await self.client.generate(
            input_ids=turn.input_ids, return_logprob=True, affinity_key=affinity_key,
            sampling_params={"max_new_tokens": self.max_reply_tokens, "temperature": self.temperature,
                             "stop": [ACTION_CLOSE]})
        ids = [int(t) for t in result.output_ids]
        lps = [float(x) for x in result.output_logprobs]
        if len(lps) != len(ids):
            raise PolicyError(f"engine returned {len(lps)} log-probs for {len(ids)} sampled ids")
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        action, index, reason, free, _ = judge(text, result.finish_reason, candidates, turn.shown,
                                               self.free_text_actions)
        return PolicyDecision(action=action, index=index, prompt=turn.text, action_token_ids=ids, logprobs=lps,
                              choice_token_ids=[], weight_version=int(result.weight_version),
                              prompt_token_ids=turn.prompt_token_ids, new_chat=turn.new_chat, reply=text,
                              invalid_reason=reason, finish_reason=str(result.finish_reason),
                              chat_ids=turn.input_ids + ids,
                              chat_text=turn.text + self.tokenizer.decode(ids, skip_special_tokens=False),
                              free_text=free, format_penalty=self.format_penalty if reason else 0.0)
