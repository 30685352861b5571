"""The policy in "choice" action mode: prompt building, sampling through the engine,
and the learner-side recomputation of the very same log-prob.

Owns the choice-mode contract between the policy, the engine and the learner. At each
step the admissible actions are listed under single-token letter labels (a..z, then
A..Z; SmolLM2 splits numbers into digit tokens, so labels are letters). The policy
engine runs one forward pass (`max_new_tokens=1`) and returns, for the label tokens
only, their log-probs at the first generated position (`token_ids_logprob`). The
client renormalises them over the labels (a log-softmax, at the sampling temperature),
samples one label and records its log-prob: that is the behaviour log-prob a Step
carries. `choice_logprobs` recomputes it from a model forward pass, temperature 1,
renormalised over the same label ids, so the learner's importance ratio compares like
with like.

Departures from the paper: the paper's agents generate free-form reasoning then an
action; a 135M model cannot (zero-shot, SmolLM2-135M answered with no valid action
number 55 % of the time), so the policy's action space is the candidate list. The
renormalised distribution is the policy; nothing outside the labels can be sampled.
Workers should sample at temperature 1: the learner optimises the temperature-1
distribution and a tempered behaviour log-prob would bias the ratio.

Prompt modes, both built by `choice_turn` (the one function the rollout, the warm start
and the benchmarks build prompts with):
- multi-turn (`actors.multi_turn`, the default): an episode is one chat. Turn 1 is the
  system prompt and a user message with the goal, the state and the options; every
  later turn appends the chosen letter as the assistant's answer and a user message
  with the new state and options. Each step's prompt is therefore a prefix of the
  next one's, the engine's prefix cache serves the history, and the learner packs a
  trajectory into ONE sequence and reads every step's label logits from it
  (`pack_prompts`, `packed_forward`), as verl-agent and RAGEN do. A chat longer than
  `actors.chat_max_chars` restarts as a fresh first turn (listing the last actions);
  the learner then starts a new packed segment there.
- per-step: a fresh prompt per step with the last `history_window` actions.

What the behaviour log-prob conditions on is exactly the step's `policy_prompt`
text in both modes; packing only changes how many forwards the learner runs.

Action mode "score" (`actors.action_mode`; per-step prompts only): no letters. The
prompt lists the possible actions and asks for the next one; the policy engine returns
the log-likelihood of every candidate's text as listed (a web action with its element's
text, `click [4] (button 'okay')`; plus the end-of-turn token) after the
prompt (`EngineClient.score`, SGLang's prefill log-probs), and the policy is the
softmax over candidates of their length-normalised log-likelihoods (`score_turn`,
`ChoicePolicy`, and learner/policy_model.py's `scored_logprobs`, both through
infra/engine/scoring.py). Measured on 96 held-out TextWorld decisions: SmolLM2-135M
picks the expert's action 26 % of the time with letters (chance) and 48 % by scoring,
and 20 supervised steps on train-game decisions took scoring to 88 % while letters
stayed at chance after 75. This is how small LMs act in text games in GLAM (Carta et
al., 2023); the paper's 3-8B agents generate their action instead.
"""

from __future__ import annotations

import math
import random
import string
from dataclasses import dataclass, field
from typing import Any, Sequence

from actors.envs.base import AbstractState, ActionFormatError, StateFormatError, parse_action
from infra.engine.padding import left_padded_mask
from infra.schema import Task

LABELS = string.ascii_lowercase + string.ascii_uppercase
MAX_CHOICES = len(LABELS)
# Bump when the policy prompt changes: cached warm-started policies are keyed by it (and by the
# mode when multi-turn; the per-step prompt is unchanged, so its caches stay valid). 2: score mode
# scores a web action with its element's text (TextWorld's command candidates read as before).
PROMPT_FORMAT = 2
MAX_CHAT_CHARS = 12_000  # default for actors.chat_max_chars
SYSTEM_PROMPT = ("You are an agent acting in a text environment. Read the goal and the current state, "
                 "then answer with the single letter of the best next action.")
SCORE_SYSTEM_PROMPT = ("You are an agent acting in a text environment. Read the goal and the current state, "
                       "then answer with the next action.")
ACTION_MODES = ("label", "score")


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
    choice_lengths: list[int] = field(default_factory=list)  # score mode: candidate lengths in choice_token_ids
    messages: list[dict] = field(default_factory=list)  # multi-turn: the chat so far (the next turn extends it)


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


def _recent_actions(history: Sequence[Any], history_window: int) -> list[str]:
    """The last `history_window` previous actions as text (strings, or objects with `.action`)."""
    recent = [h if isinstance(h, str) else str(getattr(h, "action", h)) for h in history]
    return recent[-history_window:] if history_window > 0 else []


def _context_lines(task: Task | None, state: str, recent: Sequence[str], first: bool) -> tuple[list[str], dict[int, str]]:
    """The lines both action modes open a user message with: goal and previous actions (first turn
    only), the state; and the state's items by ref (for the options' text)."""
    lines = []
    if first and task is not None and task.instruction:
        lines.append(f"Goal: {task.instruction.strip()}")
    desc, items = _state_view(state, task.instruction if task is not None else "")
    if desc:
        lines.append(f"State:\n{desc}")
    if first and recent:
        lines.append("Previous actions: " + "; ".join(recent))
    return lines, items


def _turn_text(task: Task | None, state: str, candidates: Sequence[str], recent: Sequence[str],
               first: bool) -> str:
    """A user message: (goal, previous actions: first turn only), state, options."""
    lines, items = _context_lines(task, state, recent, first)
    lines.append("Options:")
    lines += [f"{LABELS[i]}) {_option_text(c, items)}" for i, c in enumerate(candidates)]
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
    recent = _recent_actions(history, history_window)
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
    lines, items = _context_lines(task, state, _recent_actions(history, history_window), True)
    shown = [_option_text(c, items) for c in candidates]
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


def renormalise(label_logps: Sequence[float], temperature: float = 1.0) -> list[float]:
    """log-softmax over the label log-probs at `temperature` (0 = greedy, returned at temperature 1)."""
    t = temperature if temperature > 0 else 1.0
    z = [lp / t for lp in label_logps]
    m = max(z)
    lse = m + math.log(sum(math.exp(v - m) for v in z))
    return [v - lse for v in z]


class ChoicePolicy:
    """Samples one labelled candidate per step from a policy engine (the choice-mode contract above)."""

    def __init__(self, client: Any, tokenizer: Any, temperature: float = 1.0, seed: int | None = None,
                 history_window: int = 3, multi_turn: bool = False, max_chat_chars: int = MAX_CHAT_CHARS,
                 action_mode: str = "label"):
        if action_mode not in ACTION_MODES:
            raise ValueError(f"action_mode must be one of {ACTION_MODES}, got {action_mode!r}")
        if action_mode == "score" and multi_turn:
            raise ValueError("action_mode 'score' uses per-step prompts (multi_turn false)")
        self.client, self.tokenizer = client, tokenizer
        self.action_mode = action_mode
        self.temperature = temperature
        self.history_window = history_window
        self.multi_turn, self.max_chat_chars = multi_turn, max_chat_chars
        self.rng = random.Random(seed)

    async def act(self, task: Task | None, state: str, candidates: Sequence[str], history: Sequence[Any] = (),
                  affinity_key: str | None = None) -> PolicyDecision:
        candidates = list(candidates)[:MAX_CHOICES]
        if self.action_mode == "score":
            return await self._act_by_score(task, state, candidates, history, affinity_key)
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
                              choice_token_ids=labels, weight_version=int(result.weight_version), probs=probs,
                              messages=turn.messages)

    def _pick(self, raw: list[float]) -> tuple[int, list[float], list[float]]:
        """(index, log-probs at temperature 1, probabilities sampled from) of raw candidate scores."""
        if self.temperature > 0:  # the behaviour log-prob is the sampled distribution's, as in label mode
            logps = renormalise(raw, self.temperature)
            probs = [math.exp(v) for v in logps]
            return self.rng.choices(range(len(raw)), weights=probs)[0], logps, probs
        logps = renormalise(raw, 1.0)
        probs = [math.exp(v) for v in logps]
        return max(range(len(raw)), key=lambda i: logps[i]), logps, probs

    async def _act_by_score(self, task: Task | None, state: str, candidates: list[str], history: Sequence[Any],
                            affinity_key: str | None) -> PolicyDecision:
        turn = score_turn(self.tokenizer, task, state, candidates, history, self.history_window)
        rows, version = await self.client.score(turn.prefix, turn.continuations, affinity_key=affinity_key)
        raw = [sum(r) / len(r) for r in rows]  # length-normalised log-likelihood per candidate
        index, logps, probs = self._pick(raw)
        return PolicyDecision(action=candidates[index], index=index, prompt=turn.prompt,
                              action_token_ids=list(turn.continuations[index]), logprobs=[logps[index]],
                              choice_token_ids=[t for c in turn.continuations for t in c], weight_version=int(version),
                              probs=probs, choice_lengths=[len(c) for c in turn.continuations])


def choice_forward(model: Any, tokenizer: Any, prompts: Sequence[str], want_hidden: bool = False):
    """Last-position logits (and final hidden state) of each prompt, one padded batch.

    Left padding with explicit position ids, so every row's last position is the one
    the engine reads, and `logits_to_keep=1` so only that position hits the LM head. A
    padding query attends to itself (`left_padded_mask`), so no attention row is empty.
    Returns (logits [B, V], hidden [B, H] or None).
    """
    import torch  # the learner's side only: workers never load torch

    enc = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(len(e) for e in enc)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(enc), width), pad, dtype=torch.long)
    real = torch.zeros((len(enc), width), dtype=torch.bool)
    for i, e in enumerate(enc):
        ids[i, width - len(e):] = torch.tensor(e, dtype=torch.long)
        real[i, width - len(e):] = True
    pos = (real.long().cumsum(-1) - 1).clamp(min=0)
    device = next(model.parameters()).device
    out = model(input_ids=ids.to(device), attention_mask=left_padded_mask(real.to(device)),
                position_ids=pos.to(device), logits_to_keep=1, output_hidden_states=want_hidden, use_cache=False)
    logits = out.logits[:, -1, :]
    hidden = out.hidden_states[-1][:, -1, :] if want_hidden else None
    return logits, hidden


def gather_choice_logprobs(logits: Any, choice_token_ids: Sequence[Sequence[int]], chosen_ids: Sequence[int]):
    """log p(chosen | labels) per row: log-softmax of the label logits, temperature 1."""
    import torch  # the learner's side only

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


@dataclass
class Segment:
    """Consecutive steps of one episode whose prompts chain (each the previous one plus its
    chosen label and more): one sequence, read at one position per step."""

    ids: list[int]  # token ids of the segment's last (longest) prompt
    positions: list[int]  # per step: the position whose logits are that step's choice
    steps: list[int]  # indices into the prompts given to `pack_prompts`


def pack_prompts(tokenizer: Any, prompts: Sequence[str], chosen_ids: Sequence[int]) -> list[Segment]:
    """Group prompts (in order) into segments: prompt i+1 joins prompt i's segment when its
    token ids start with prompt i's ids followed by the label chosen at i. Multi-turn
    trajectories become one segment each; per-step prompts stay one step per segment.
    Token ids are those of each prompt tokenized alone, as the engine tokenized it, so
    a packed position sees exactly the tokens the behaviour log-prob saw."""
    enc = tokenizer(list(prompts), add_special_tokens=False)["input_ids"] if prompts else []
    segs: list[Segment] = []
    for i, ids in enumerate(enc):
        if segs:
            s = segs[-1]
            n = len(s.ids)
            if len(ids) > n and ids[n] == int(chosen_ids[s.steps[-1]]) and ids[:n] == s.ids:
                s.ids = list(ids)
                s.positions.append(len(ids) - 1)
                s.steps.append(i)
                continue
        segs.append(Segment(list(ids), [len(ids) - 1], [i]))
    return segs


SHARE_MIN_TOKENS = 32  # a common prefix shorter than this is not worth a separate forward


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    for x, y in zip(a[:limit], b[:limit]):
        if x != y:
            break
        n += 1
    return n


def shared_prefix_groups(segments: Sequence[Segment], min_tokens: int = SHARE_MIN_TOKENS) -> list[tuple[int, list[Segment]]]:
    """Runs of consecutive segments whose first `n` tokens are equal (n >= min_tokens, and each keeps
    at least one token of its own): (n, segments). A GRPO group's trajectories share their first
    turn (same task, same initial state). A lone segment is (len - 1, [it])."""
    groups: list[tuple[int, list[Segment]]] = []
    for s in segments:
        if groups:
            n, members = groups[-1]
            k = min(_common_prefix(members[0].ids, s.ids, n), len(s.ids) - 1)
            if k >= min_tokens:
                groups[-1] = (k, members + [s])
                continue
        groups.append((len(s.ids) - 1, [s]))
    return groups


def packed_forward(model: Any, segments: Sequence[Segment], want_hidden: bool = False, share_prefix: bool = True):
    """Logits (and final hidden states) at every step position of each segment: one forward
    per segment, no padding, only the step positions hit the LM head. With `share_prefix`,
    consecutive segments that start alike (`shared_prefix_groups`) run their common prefix
    once and continue from its key/value cache, gradients flowing back through it.
    Returns (logits [steps, V], hidden [steps, H] or None, tokens run), steps in segment order."""
    import torch  # the learner's side only
    from transformers import DynamicCache  # the learner's side only: workers never load transformers models

    device = next(model.parameters()).device
    checkpointing = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.x's name
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    share_prefix = share_prefix and not checkpointing  # checkpointed layers run without a cache
    groups = shared_prefix_groups(segments) if share_prefix else [(len(s.ids) - 1, [s]) for s in segments]
    logits, hidden = [], []
    tokens = 0

    def run(ids: Sequence[int], keep: Sequence[int], cache: Any = None):
        out = model(input_ids=torch.tensor([list(ids)], dtype=torch.long, device=device),
                    logits_to_keep=torch.tensor(list(keep) or [len(ids) - 1], dtype=torch.long, device=device),
                    output_hidden_states=want_hidden, past_key_values=cache, use_cache=cache is not None)
        lg = out.logits[0][:len(keep)]
        hd = out.hidden_states[-1][0].index_select(0, torch.tensor(list(keep), dtype=torch.long, device=device)) \
            if want_hidden else None
        return out, lg, hd

    for n, members in groups:
        if len(members) == 1:
            s = members[0]
            _, lg, hd = run(s.ids, s.positions)
            logits.append(lg)
            hidden.append(hd)
            tokens += len(s.ids)
            continue
        head = sorted({p for s in members for p in s.positions if p < n})
        out = model(input_ids=torch.tensor([members[0].ids[:n]], dtype=torch.long, device=device),
                    logits_to_keep=torch.tensor(head or [n - 1], dtype=torch.long, device=device),
                    output_hidden_states=want_hidden, use_cache=True)
        row = {p: i for i, p in enumerate(head)}
        head_hidden = out.hidden_states[-1][0] if want_hidden else None
        prefix_cache = out.past_key_values
        tokens += n
        for s in members:
            cache = DynamicCache(config=model.config)
            for li, layer in enumerate(prefix_cache.layers):
                cache.update(layer.keys, layer.values, li)
            tail = [p - n for p in s.positions if p >= n]
            _, lg, hd = run(s.ids[n:], tail, cache)
            mine = [row[p] for p in s.positions if p < n]
            if mine:
                index = torch.tensor(mine, dtype=torch.long, device=device)
                lg = torch.cat([out.logits[0].index_select(0, index), lg])
                if want_hidden:
                    hd = torch.cat([head_hidden.index_select(0, torch.tensor([p for p in s.positions if p < n],
                                                                             dtype=torch.long, device=device)), hd])
            logits.append(lg)
            hidden.append(hd)
            tokens += len(s.ids) - n
    return torch.cat(logits), (torch.cat(hidden) if want_hidden else None), tokens
