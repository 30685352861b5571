"""Log-likelihoods of continuations of a shared prefix: the engine's prefill log-probs
(SGLang's `logprob_start_len`) and the learner's recomputation, in two functions that
compute the same thing, one prefix at a time or many at once.

Owns `continuation_logprobs(model, prefix, continuations)`: the per-token log-probs
log p(c_t | prefix, c_<t) of each continuation. The prefix runs once and keeps its
key/value cache; the continuations then run as one right-padded batch on that cache
(padding sits after every real token, so causal attention keeps it out of the real
positions' logits). Both sides computing the same number is what lets the learner's importance ratio
compare like with like (actors/policy.py, action mode "score").

`batched_continuation_logprobs(model, items)` is the same computation for many
(prefix, continuations) items at once: the engine's path (infra/engine/scorer.py) and
the learner's, whose gradients flow back through the copied caches
(learner/policy_model.py). The prefixes run as one left-padded batch, then every
item's continuations as one batch on a copy of its prefix's cache rows (a view when
there is one item, as in `continuation_logprobs`). A padding key is masked out (it gets exactly zero weight) and a
padding query attends to itself only, so each item's log-probs are those of
`continuation_logprobs` up to the order of floating-point sums. On a GPU an eager
forward costs about the same for 1 row or 500 (host-bound), so the engine answers
concurrent scoring requests together instead of one forward pair each.

Departure from SGLang: SGLang computes input log-probs inside its batched prefill with
the radix cache; here scoring requests are batched apart from the decode loop, one
forward for their prefixes and one for their continuations.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from transformers import DynamicCache

from infra.engine.padding import left_padded_mask


def continuation_logprobs(model: Any, prefix: Sequence[int], continuations: Sequence[Sequence[int]],
                          want_hidden: bool = False) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """([per continuation: log-probs of its tokens, shape [len]], the prefix's last hidden state [H] or None).

    Every continuation must be non-empty; the prefix must hold at least one token."""
    if not prefix:
        raise ValueError("continuation_logprobs: empty prefix")
    if not continuations or any(len(c) == 0 for c in continuations):
        raise ValueError("continuation_logprobs: every continuation needs at least one token")
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([list(prefix)], dtype=torch.long, device=device), use_cache=True,
                logits_to_keep=1, output_hidden_states=want_hidden)
    first = out.logits[0, -1].float().log_softmax(-1)  # predicts every continuation's first token
    hidden = out.hidden_states[-1][0, -1] if want_hidden else None
    width = max(len(c) for c in continuations)
    if width == 1:
        return [first[list(c)] for c in continuations], hidden
    b = len(continuations)
    cache = DynamicCache(config=model.config)
    for li, layer in enumerate(out.past_key_values.layers):
        cache.update(layer.keys.expand(b, *layer.keys.shape[1:]), layer.values.expand(b, *layer.values.shape[1:]), li)
    ids = torch.zeros((b, width - 1), dtype=torch.long, device=device)
    for i, c in enumerate(continuations):
        ids[i, :len(c) - 1] = torch.tensor(list(c[:-1]), dtype=torch.long, device=device)
    n = len(prefix)
    positions = torch.arange(n, n + width - 1, device=device).expand(b, -1)
    rest = model(input_ids=ids, past_key_values=cache, position_ids=positions, use_cache=True).logits.float()
    rest = rest.log_softmax(-1)  # [b, width-1, V]: position t predicts token t+1
    result = []
    for i, c in enumerate(continuations):
        tail = torch.tensor(list(c[1:]), dtype=torch.long, device=device)
        lps = rest[i, :len(c) - 1].gather(-1, tail[:, None])[:, 0]
        result.append(torch.cat([first[c[0]].reshape(1), lps]))
    return result, hidden


def batched_continuation_logprobs(model: Any, items: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]],
                                  want_hidden: bool = False) -> tuple[list[list[torch.Tensor]], torch.Tensor | None]:
    """(per item, `continuation_logprobs(model, prefix, continuations)[0]`; each prefix's last hidden
    state [n, H] or None), computed for all items in two forwards (module docstring). The engine
    calls it under no_grad, the learner with gradients (learner/policy_model.py)."""
    for prefix, conts in items:
        if not prefix:
            raise ValueError("batched_continuation_logprobs: empty prefix")
        if not conts or any(len(c) == 0 for c in conts):
            raise ValueError("batched_continuation_logprobs: every continuation needs at least one token")
    device = next(model.parameters()).device
    n, width = len(items), max(len(p) for p, _ in items)
    ids = torch.zeros((n, width), dtype=torch.long)
    real = torch.zeros((n, width), dtype=torch.bool)
    for i, (prefix, _) in enumerate(items):  # left-padded: every prefix ends at column width-1
        ids[i, width - len(prefix):] = torch.tensor(list(prefix), dtype=torch.long)
        real[i, width - len(prefix):] = True
    ids, real = ids.to(device), real.to(device)
    positions = (real.long().cumsum(-1) - 1).clamp(min=0)
    mask = left_padded_mask(real)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                output_hidden_states=want_hidden)
    first = out.logits[:, -1].float().log_softmax(-1)  # [n, V]: predicts each item's first continuation token
    hidden = out.hidden_states[-1][:, -1] if want_hidden else None
    rows = [(i, c) for i, (_, conts) in enumerate(items) for c in conts]
    result: list[list[torch.Tensor]] = [[] for _ in items]
    tail_width = max(len(c) for _, c in rows) - 1
    if tail_width == 0:
        for i, c in rows:
            result[i].append(first[i, list(c)])
        return result, hidden
    owner = torch.tensor([i for i, _ in rows], dtype=torch.long, device=device)
    cache = DynamicCache(config=model.config)
    for li, layer in enumerate(out.past_key_values.layers):
        if n == 1:  # one prefix: its rows as a view, no copy (the engine's CPU path, a request at a time)
            cache.update(layer.keys.expand(len(rows), *layer.keys.shape[1:]),
                         layer.values.expand(len(rows), *layer.values.shape[1:]), li)
        else:
            cache.update(layer.keys.index_select(0, owner), layer.values.index_select(0, owner), li)
    r = len(rows)
    cids = torch.zeros((r, tail_width), dtype=torch.long)
    for k, (_, c) in enumerate(rows):
        cids[k, :len(c) - 1] = torch.tensor(list(c[:-1]), dtype=torch.long)
    tcols = torch.arange(tail_width, device=device)
    cpos = positions[:, -1].index_select(0, owner)[:, None] + 1 + tcols[None, :]
    # Keys: the owner's real prefix columns, then the continuation causally (right padding sits
    # after every real token, so it never reaches a real query).
    tail_causal = (tcols[None, :] <= tcols[:, None])[None].expand(r, -1, -1)
    cmask = torch.cat([real.index_select(0, owner)[:, None, :].expand(-1, tail_width, -1), tail_causal], dim=-1)[:, None]
    rest = model(input_ids=cids.to(device), attention_mask=cmask, position_ids=cpos, past_key_values=cache,
                 use_cache=True).logits.float().log_softmax(-1)  # [r, tail_width, V]
    for k, (i, c) in enumerate(rows):
        tail = torch.tensor(list(c[1:]), dtype=torch.long, device=device)
        lps = rest[k, :len(c) - 1].gather(-1, tail[:, None])[:, 0]
        result[i].append(torch.cat([first[i, c[0]].reshape(1), lps]))
    return result, hidden


def mean_logprobs(per_token: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each continuation's length-normalised log-likelihood (mean over its tokens): [n]."""
    return torch.stack([t.mean() for t in per_token])
