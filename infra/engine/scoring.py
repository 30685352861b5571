"""Log-likelihoods of continuations of a shared prefix: the engine's prefill log-probs
(SGLang's `logprob_start_len`) and the learner's recomputation, in three functions that
compute the same thing: one prefix at a time, many at once as a padded batch, or many at
once as one token tree.

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

`tree_continuation_logprobs(model, items)` is the learner's layout on a CPU: one forward over
the trie of all the items' token paths, so tokens that several paths share run once and
nothing is padding (its docstring has the measured speed).

Departure from SGLang: SGLang computes input log-probs inside its batched prefill with
the radix cache; here scoring requests are batched apart from the decode loop, one
forward for their prefixes and one for their continuations.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from transformers import DynamicCache

from infra.engine.kv import cache_arg, returned_cache
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
    for li, layer in enumerate(returned_cache(out).layers):
        cache.update(layer.keys.expand(b, *layer.keys.shape[1:]), layer.values.expand(b, *layer.values.shape[1:]), li)
    ids = torch.zeros((b, width - 1), dtype=torch.long, device=device)
    for i, c in enumerate(continuations):
        ids[i, :len(c) - 1] = torch.tensor(list(c[:-1]), dtype=torch.long, device=device)
    n = len(prefix)
    positions = torch.arange(n, n + width - 1, device=device).expand(b, -1)
    rest = model(input_ids=ids, position_ids=positions, use_cache=True, **cache_arg(cache)).logits.float()
    rest = rest.log_softmax(-1)  # [b, width-1, V]: position t predicts token t+1
    result = []
    for i, c in enumerate(continuations):
        tail = torch.tensor(list(c[1:]), dtype=torch.long, device=device)
        lps = rest[i, :len(c) - 1].gather(-1, tail[:, None])[:, 0]
        result.append(torch.cat([first[c[0]].reshape(1), lps]))
    return result, hidden


def _check_items(caller: str, items: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]]) -> None:
    """ValueError unless there are items, each with a prefix and continuations of a token or more."""
    if not items:
        raise ValueError(f"{caller}: no items")
    for prefix, conts in items:
        if not prefix:
            raise ValueError(f"{caller}: empty prefix")
        if not conts or any(len(c) == 0 for c in conts):
            raise ValueError(f"{caller}: every continuation needs at least one token")


def batched_continuation_logprobs(model: Any, items: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]],
                                  want_hidden: bool = False) -> tuple[list[list[torch.Tensor]], torch.Tensor | None]:
    """(per item, `continuation_logprobs(model, prefix, continuations)[0]`; each prefix's last hidden
    state [n, H] or None), computed for all items in two forwards (module docstring). The engine
    calls it under no_grad, the learner with gradients (learner/policy_model.py)."""
    _check_items("batched_continuation_logprobs", items)
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
    for li, layer in enumerate(returned_cache(out).layers):
        if n == 1:  # one prefix: its rows as a view, no copy (the engine's CPU path, a request at a time)
            cache.update(layer.keys.expand(len(rows), *layer.keys.shape[1:]),
                         layer.values.expand(len(rows), *layer.values.shape[1:]), li)
        else:
            cache.update(layer.keys.index_select(0, owner), layer.values.index_select(0, owner), li)
    r = len(rows)
    cids = torch.zeros((r, tail_width), dtype=torch.long)
    nxt = torch.zeros((r, tail_width), dtype=torch.long)
    for k, (_, c) in enumerate(rows):
        cids[k, :len(c) - 1] = torch.tensor(list(c[:-1]), dtype=torch.long)
        nxt[k, :len(c) - 1] = torch.tensor(list(c[1:]), dtype=torch.long)
    tcols = torch.arange(tail_width, device=device)
    cpos = positions[:, -1].index_select(0, owner)[:, None] + 1 + tcols[None, :]
    # Keys: the owner's real prefix columns, then the continuation causally (right padding sits
    # after every real token, so it never reaches a real query).
    tail_causal = (tcols[None, :] <= tcols[:, None])[None].expand(r, -1, -1)
    cmask = torch.cat([real.index_select(0, owner)[:, None, :].expand(-1, tail_width, -1), tail_causal], dim=-1)[:, None]
    rest = model(input_ids=cids.to(device), attention_mask=cmask, position_ids=cpos, **cache_arg(cache),
                 use_cache=True).logits.float().log_softmax(-1)  # [r, tail_width, V]
    # One gather for every row: a per-row select would make its backward write a zero tensor the
    # size of all the rows' logits, once per row.
    heads = first[owner, torch.tensor([c[0] for _, c in rows], dtype=torch.long, device=device)]
    lps = torch.cat([heads[:, None], rest.gather(-1, nxt.to(device)[..., None])[..., 0]], dim=1)  # [r, 1 + tail_width]
    for k, (i, c) in enumerate(rows):
        result[i].append(lps[k, :len(c)])
    return result, hidden


class TokenTrie:
    """The token tree of `tree_continuation_logprobs`: every item's prefix, and the prefix followed
    by each continuation but its last token, as paths of nodes (node n: token ids[n], its parent
    node or -1, its depth = its position; len(ids) tokens run through the model). reads[k] = (node whose logits predict a token, that
    token), in item, continuation, token order; spans[i][j] = (first read, count) of item i's
    continuation j; last[i]: the node of item i's last prefix token; prefix_nodes[i]: the nodes of
    item i's prefix, in order."""

    def __init__(self, items: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]]):
        _check_items("tree_continuation_logprobs", items)
        self.ids: list[int] = []
        self.parent: list[int] = []
        self.depth: list[int] = []
        self._kids: list[dict[int, int]] = [{}]  # _kids[0]: the root's; _kids[n + 1]: node n's
        self.reads: list[tuple[int, int]] = []
        self.spans: list[list[tuple[int, int]]] = []
        self.last: list[int] = []
        self.prefix_nodes: list[list[int]] = []
        for prefix, conts in items:
            n = len(prefix)
            self.prefix_nodes.append(self._insert(prefix))
            self.last.append(self.prefix_nodes[-1][-1])
            mine = []
            for c in conts:
                path = self._insert([*prefix, *c[:-1]])
                mine.append((len(self.reads), len(c)))
                self.reads += zip(path[n - 1:], (int(t) for t in c))
            self.spans.append(mine)

    def ancestors(self) -> torch.Tensor:
        """[n, n] bool: node i sees node j (j is i or one of its ancestors), the tree's attention mask."""
        mask = torch.zeros((len(self.ids), len(self.ids)), dtype=torch.bool)
        for node, up in enumerate(self.parent):  # a node sees its parent's ancestors and itself
            if up >= 0:
                mask[node] = mask[up]
            mask[node, node] = True
        return mask

    def _insert(self, seq: Sequence[int]) -> list[int]:
        """The node of each token of `seq`, created where no path shares it yet."""
        path, at = [], -1
        for t in seq:
            node = self._kids[at + 1].get(int(t))
            if node is None:
                node = len(self.ids)
                self.ids.append(int(t))
                self.parent.append(at)
                self.depth.append(self.depth[at] + 1 if at >= 0 else 0)
                self._kids.append({})
                self._kids[at + 1][int(t)] = node
            path.append(node)
            at = node
        return path


def tree_continuation_logprobs(model: Any, items: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]],
                               want_hidden: bool = False,
                               trie: TokenTrie | None = None) -> tuple[list[list[torch.Tensor]], torch.Tensor | None]:
    """`batched_continuation_logprobs(model, items, want_hidden)` in one forward over a token tree:
    every distinct token path (each prefix, then each of its continuations but the last token) is
    inserted into a trie, its nodes laid out as one sequence, each attending to itself and its
    ancestors (a [L, L] mask) at the position of its depth. A token shared by several paths runs
    once (a GRPO group's steps share the system prompt, the goal and most of the room) and no
    position is padding. Only the positions whose logits are read reach the LM head.

    The learner's layout on a CPU (learner.score_layout), where compute is the bound: on 21 real
    TextWorld steps (groups of 4 episodes) forward+backward ran 1.7x the padded two-forward batch's
    speed in micro-batches of 8 steps, and 2.3x as one micro-batch (benchmarks/learner_update.py
    --score). The padded batch stays the GPU's: a forward there costs about the same whatever its
    size, and the mask grows as the square of the tokens.

    `trie`: the items' TokenTrie, when the caller built it already (the learner counts its tokens)."""
    if trie is None:
        trie = TokenTrie(items)
    device = next(model.parameters()).device
    mask = trie.ancestors()
    keep = sorted({node for node, _ in trie.reads} | set(trie.last))
    row = {node: i for i, node in enumerate(keep)}
    out = model(input_ids=torch.tensor([trie.ids], dtype=torch.long, device=device),
                attention_mask=mask[None, None].to(device),
                position_ids=torch.tensor([trie.depth], dtype=torch.long, device=device),
                logits_to_keep=torch.tensor(keep, dtype=torch.long, device=device),
                output_hidden_states=want_hidden, use_cache=False)
    logp = out.logits[0].float().log_softmax(-1)  # [len(keep), V]
    flat = logp[torch.tensor([row[node] for node, _ in trie.reads], dtype=torch.long, device=device),
                torch.tensor([t for _, t in trie.reads], dtype=torch.long, device=device)]
    result = [[flat[start:start + length] for start, length in mine] for mine in trie.spans]
    hidden = None
    if want_hidden:  # the last prefix token's final hidden state (its row among all positions)
        hidden = out.hidden_states[-1][0].index_select(0, torch.tensor(trie.last, dtype=torch.long, device=device))
    return result, hidden


def mean_logprobs(per_token: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each continuation's length-normalised log-likelihood (mean over its tokens): [n]."""
    return torch.stack([t.mean() for t in per_token])
