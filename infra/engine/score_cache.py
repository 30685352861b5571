"""The CPU scorer's prompt cache: key/value tensors of recent scoring prompts, reused by later ones.

Owns `ScoreCache` (an LRU of prompts' per-layer keys and values, bounded in bytes and tied to
one weight version) and `cached_tree_logprobs`, the token-tree forward of
`tree_continuation_logprobs` (infra/engine/scoring.py) that takes the tokens a cached prompt
shares with the request from the cache instead of running them.

Why: a score-mode policy sends one request per episode step (actors/score_mode.py), and the
next step's prompt repeats the system prompt, the goal and often the room: on textworld_long's
offline steps a prompt is 221 tokens, 117 of them the previous step's. Concurrent requests of
different games share almost nothing, so the token tree alone (which runs a token that several
waiting requests share once) could not see it; a step's prompt meets its own episode's previous
prompt only across requests. The warm start's validation, held-out evaluation and rollouts all
score this way on a CPU, where every prompt token costs a forward (compute-bound).

A cached token's key/value depend only on the tokens up to it, so any cached prompt that starts
with the same tokens holds them. The request's nodes that no cache entry holds run as one tree
attending to the cached ones (the `past`) and to their own ancestors; its logits are those of the
uncached tree up to the order of floating-point sums (tests/test_score_cache.py bounds the gap).
The last token of every prompt always runs (its logits predict the first continuation token).
A new weight version empties the cache.

Departure from SGLang: SGLang's radix cache is shared by generation and prefill-only (scoring)
requests alike; here the decode loop's prefix cache (infra/engine/prefix_cache.py) and this one
are apart, as the CPU scorer's token trees are apart from the decode batches.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from transformers import DynamicCache

from infra.engine.kv import cache_arg, returned_cache
from infra.engine.scoring import TokenTrie


@dataclass
class _Entry:
    key: tuple[int, ...]  # the prompt's token ids, as the cache's key
    ids: np.ndarray  # the same, for comparing
    keys: list[torch.Tensor]  # per layer [1, kv_heads, len(ids), head_dim]
    values: list[torch.Tensor]
    nbytes: int


class ScoreCache:
    """Prompts' keys and values, least recently used first out, at most `budget_bytes` in all, for one
    weight version at a time. `hit_tokens` / `prompt_tokens`: prompt tokens taken from the cache / asked."""

    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self.version: int | None = None
        self.bytes = 0
        self.hit_tokens = 0
        self.prompt_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def for_version(self, version: int) -> None:
        """Empty the cache when the weights are no longer those its tensors came from."""
        if version != self.version:
            self._entries.clear()
            self.bytes, self.version = 0, version

    def match(self, prompt: Sequence[int]) -> tuple[_Entry | None, int]:
        """The entry sharing the longest start with `prompt`, and how many tokens it shares (at most all
        but the prompt's last token, which must run for its logits)."""
        ids = np.asarray(prompt, dtype=np.int64)
        limit = len(ids) - 1
        best, shared = None, 0
        for entry in self._entries.values():
            n = min(limit, len(entry.ids))
            if n <= shared:
                continue
            same = entry.ids[:n] == ids[:n]
            k = n if same.all() else int(np.argmin(same))
            if k > shared:
                best, shared = entry, k
        if best is not None:
            self._entries.move_to_end(best.key)
        return best, shared

    def holds(self, prompt: Sequence[int]) -> bool:
        """Whether `prompt` itself is kept (then it counts as just used)."""
        key = tuple(int(t) for t in prompt)
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        return False

    def store(self, prompt: Sequence[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Keep `prompt`'s keys and values (evicting the least recently used); one larger than the budget
        is not kept."""
        if self.holds(prompt):
            return
        key = tuple(int(t) for t in prompt)
        nbytes = sum(t.numel() * t.element_size() for t in (*keys, *values))
        if nbytes > self.budget:
            return
        while self._entries and self.bytes + nbytes > self.budget:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes
        self._entries[key] = _Entry(key, np.asarray(key, dtype=np.int64), keys, values, nbytes)
        self.bytes += nbytes


def cached_tree_logprobs(model: Any, items: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]],
                         cache: ScoreCache) -> list[list[torch.Tensor]]:
    """`tree_continuation_logprobs(model, items)[0]`, the tokens `cache` holds taken from it (module
    docstring); every item's prompt is then stored in `cache`. Under no_grad (the engine's path)."""
    trie = TokenTrie(items)
    device = next(model.parameters()).device
    must_run = {node for node, _ in trie.reads} | set(trie.last)
    held: dict[int, tuple[_Entry, int]] = {}  # node -> (entry holding it, its position there)
    for (prefix, _), nodes in zip(items, trie.prefix_nodes):
        cache.prompt_tokens += len(prefix)
        entry, shared = cache.match(prefix)
        for depth in range(shared):
            if nodes[depth] not in must_run:
                held.setdefault(nodes[depth], (entry, depth))
    cache.hit_tokens += len(held)
    by_entry: dict[int, tuple[_Entry, list[int]]] = {}
    for node, (entry, _) in held.items():
        by_entry.setdefault(id(entry), (entry, []))[1].append(node)
    past = [node for _, nodes in by_entry.values() for node in nodes]
    run = [node for node in range(len(trie.ids)) if node not in held]
    column = {node: i for i, node in enumerate(past + run)}

    ancestors = trie.ancestors()
    order = torch.tensor(past + run, dtype=torch.long)
    mask = ancestors[torch.tensor(run, dtype=torch.long)][:, order]

    kv = DynamicCache(config=model.config)
    if past:
        n_layers = len(next(iter(by_entry.values()))[0].keys)
        for layer in range(n_layers):
            ks, vs = [], []
            for entry, nodes in by_entry.values():
                at = torch.tensor([held[n][1] for n in nodes], dtype=torch.long, device=device)
                ks.append(entry.keys[layer].index_select(2, at))
                vs.append(entry.values[layer].index_select(2, at))
            kv.update(torch.cat(ks, 2), torch.cat(vs, 2), layer)
    keep = sorted(must_run)
    row = {node: i for i, node in enumerate(keep)}
    local = {node: i for i, node in enumerate(run)}
    out = model(input_ids=torch.tensor([[trie.ids[n] for n in run]], dtype=torch.long, device=device),
                attention_mask=mask[None, None].to(device),
                position_ids=torch.tensor([[trie.depth[n] for n in run]], dtype=torch.long, device=device),
                use_cache=True, **cache_arg(kv),
                logits_to_keep=torch.tensor([local[n] for n in keep], dtype=torch.long, device=device))
    logp = out.logits[0].float().log_softmax(-1)
    flat = logp[torch.tensor([row[node] for node, _ in trie.reads], dtype=torch.long, device=device),
                torch.tensor([t for _, t in trie.reads], dtype=torch.long, device=device)]

    layers = returned_cache(out).layers
    for (prefix, _), nodes in zip(items, trie.prefix_nodes):
        if cache.holds(prefix):  # asked again: no copy of what is kept
            continue
        at = torch.tensor([column[n] for n in nodes], dtype=torch.long, device=device)
        cache.store(prefix, [layer.keys.index_select(2, at) for layer in layers],
                    [layer.values.index_select(2, at) for layer in layers])
    return [[flat[start:start + length] for start, length in mine] for mine in trie.spans]
