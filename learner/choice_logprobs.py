"""Choice-mode log-probs on the learner's side: the very numbers the policy engine returned.

Owns the torch twin of actors/label_mode.py and the packing of multi-turn choice
trajectories: `choice_forward` reads the last prompt position's logits as the engine
does (left padding with explicit position ids), `gather_choice_logprobs` renormalises
them over the label ids at temperature 1, and `pack_prompts` / `packed_forward` run a
multi-turn trajectory (each step's prompt a prefix of the next one's) as ONE sequence,
read at one position per step, as verl-agent and RAGEN do. Score mode's twin is
learner/policy_model.py's `scored_logprobs`; generate mode's is learner/token_logprobs.py.

Departure from the paper: none here (the paper's agents generate; see actors/policy.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from infra.engine.kv import cache_arg, returned_cache
from infra.engine.padding import left_padded_mask

def choice_forward(model: Any, tokenizer: Any, prompts: Sequence[str], want_hidden: bool = False):
    """Last-position logits (and final hidden state) of each prompt, one padded batch.

    Left padding with explicit position ids, so every row's last position is the one
    the engine reads, and `logits_to_keep=1` so only that position hits the LM head. A
    padding query attends to itself (`left_padded_mask`), so no attention row is empty.
    Returns (logits [B, V], hidden [B, H] or None).
    """
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


def gather_choice_logprobs(logits: Any, choice_token_ids: Sequence[Sequence[int]], chosen_ids: Sequence[int],
                           temperatures: Sequence[float] | None = None):
    """log p(chosen | labels) per row: log-softmax of the label logits, at the row's temperature in
    `temperatures` (the one its rollout sampled at), else 1."""
    rows = []
    for i, (labels, chosen) in enumerate(zip(choice_token_ids, chosen_ids)):
        labels = [int(t) for t in labels]
        if int(chosen) not in labels:
            raise ValueError(f"row {i}: chosen token {chosen} is not one of the labels {labels}")
        t = temperatures[i] if temperatures is not None else 1.0
        row = torch.log_softmax(logits[i, labels].float() / t, dim=-1)
        rows.append(row[labels.index(int(chosen))])
    return torch.stack(rows)


def choice_logprobs(model: Any, tokenizer: Any, prompts: Sequence[str], choice_token_ids: Sequence[Sequence[int]],
                    chosen_ids: Sequence[int]):
    """The learner-side twin of actors/label_mode.py's LabelMode: log-prob of each chosen label (tensor [B], differentiable)."""
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
    from transformers import DynamicCache  # heavy: only when packing runs

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
                    output_hidden_states=want_hidden, use_cache=cache is not None, **cache_arg(cache))
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
        prefix_cache = returned_cache(out)
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

