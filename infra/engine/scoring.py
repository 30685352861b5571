"""Log-likelihoods of continuations of one shared prefix: the engine's prefill log-probs
(SGLang's `logprob_start_len`) and the learner's recomputation, in one function.

Owns `continuation_logprobs(model, prefix, continuations)`: the per-token log-probs
log p(c_t | prefix, c_<t) of each continuation. The prefix runs once and keeps its
key/value cache; the continuations then run as one right-padded batch on that cache
(padding sits after every real token, so causal attention keeps it out of the real
positions' logits). The engine calls it under no_grad; the learner calls it with
gradients, which flow back through the shared cache. Both sides computing the same
number is what lets the learner's importance ratio compare like with like
(actors/policy.py, action mode "score").

Departure from SGLang: SGLang computes input log-probs inside its batched prefill with
the radix cache; here a scoring request is computed apart from the decode loop, one
forward for the prefix and one for the batch of continuations.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from transformers import DynamicCache


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


def mean_logprobs(per_token: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each continuation's length-normalised log-likelihood (mean over its tokens): [n]."""
    return torch.stack([t.mean() for t in per_token])
