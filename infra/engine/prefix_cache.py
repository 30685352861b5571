"""The embedded engine's prefix cache: a radix tree of token ids holding their KV, LRU-evicted under a byte budget.

Owns which prompt prefixes have their keys and values kept between requests, as
SGLang's RadixAttention does: the G rollouts of a GRPO group share the task and the
state, and an episode's successive turns share its history (the client's affinity
routing sends them to one server). Each edge of the tree is a run of token ids and
the KV of those positions, one tensor `[layers, 2, kv_heads, tokens, head_dim]`.
The KV of a token depends only on the tokens before it (and on the weights: the
batcher clears the tree when it swaps them), so any path from the root is reusable
by any prompt that starts with it.

Where it departs from SGLang: SGLang's tree points into one shared paged KV pool, so
a hit costs nothing and nodes in use are locked; here a hit is *copied* into the
requesting sequence's row of the batch cache (one copy per edge, a few MB for
hundreds of tokens, small beside a forward pass), so nothing is ever locked and
eviction is free to drop any leaf. Eviction drops least-recently-used leaves until
the tree fits `budget_bytes`.

Pure data structure: no model, no threads (the batcher's loop is its only user);
tested against a brute-force reference in tests/test_engine_prefix_cache.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

# kv_of(start, stop) -> [layers, 2, kv_heads, stop - start, head_dim]: the KV of positions start..stop-1
KVSource = Callable[[int, int], torch.Tensor]


class _Node:
    __slots__ = ("tokens", "kv", "children", "parent", "last_used")

    def __init__(self, tokens: tuple[int, ...], kv: torch.Tensor | None, parent: "_Node | None", stamp: int):
        self.tokens = tokens
        self.kv = kv
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.last_used = stamp


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token sequences."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on slice equality (C-speed comparisons)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixCache:
    """Radix tree of token-id prefixes with their KV. `budget_bytes` 0 disables it (every call is a no-op).

    `bytes_per_token` is the KV size of one position (all layers, keys and values).
    """

    def __init__(self, budget_bytes: int, bytes_per_token: int):
        self.budget_bytes = max(0, int(budget_bytes))
        self.bytes_per_token = bytes_per_token
        self._clock = itertools.count(1)
        self.root = _Node((), None, None, 0)
        self.bytes = 0
        self.tokens = 0
        self.evicted_tokens = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def clear(self) -> None:
        """Forget everything (the weights changed)."""
        self.root = _Node((), None, None, 0)
        self.bytes = self.tokens = 0

    def match(self, ids: Sequence[int], limit: int | None = None) -> tuple[int, list[torch.Tensor]]:
        """(m, pieces): the longest cached prefix of `ids` (at most `limit` tokens) and its KV, in order.

        The pieces are views of the tree's tensors, concatenated along dim -2 they hold
        positions 0..m-1. Marks the path as recently used.
        """
        if not self.enabled:
            return 0, []
        ids = tuple(ids[: len(ids) if limit is None else max(0, limit)])
        node, pos, pieces, stamp = self.root, 0, [], next(self._clock)
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            k = common_prefix_length(child.tokens, ids[pos:pos + len(child.tokens)])
            child.last_used = stamp
            pieces.append(child.kv if k == len(child.tokens) else child.kv[..., :k, :])
            pos += k
            if k < len(child.tokens):
                break
            node = child
        return pos, pieces

    def insert(self, ids: Sequence[int], kv_of: KVSource) -> int:
        """Cache the KV of `ids` (asking `kv_of` only for positions not cached yet); returns tokens added."""
        if not self.enabled or not ids:
            return 0
        ids = tuple(ids)
        if len(ids) * self.bytes_per_token > self.budget_bytes:
            return 0  # it would evict everything, itself included
        node, pos, stamp = self.root, 0, next(self._clock)
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                kv = kv_of(pos, len(ids)).contiguous()
                leaf = _Node(ids[pos:], kv, node, stamp)
                node.children[ids[pos]] = leaf
                self._account(leaf, +1)
                added = len(ids) - pos
                self._evict(protect=leaf)
                return added
            k = common_prefix_length(child.tokens, ids[pos:pos + len(child.tokens)])
            child.last_used = stamp
            if k < len(child.tokens):
                self._split(child, k)
            node, pos = child, pos + k
        return 0

    def _split(self, node: _Node, k: int) -> None:
        """Cut `node` after k tokens: it keeps the head, a new child takes the tail and the children."""
        tail = _Node(node.tokens[k:], node.kv[..., k:, :].clone(), node, node.last_used)
        tail.children, node.children = node.children, {node.tokens[k]: tail}
        for c in tail.children.values():
            c.parent = tail
        node.tokens, node.kv = node.tokens[:k], node.kv[..., :k, :].clone()

    def _account(self, node: _Node, sign: int) -> None:
        self.bytes += sign * node.kv.numel() * node.kv.element_size()
        self.tokens += sign * len(node.tokens)

    def _evict(self, protect: _Node | None = None) -> None:
        """Drop least-recently-used leaves until the tree fits the budget (`protect` goes last)."""
        if self.bytes <= self.budget_bytes:
            return
        leaves = sorted(self._leaves(), key=lambda n: (n is protect, n.last_used))
        while self.bytes > self.budget_bytes and leaves:
            leaf = leaves.pop(0)
            parent = leaf.parent
            del parent.children[leaf.tokens[0]]
            self._account(leaf, -1)
            self.evicted_tokens += len(leaf.tokens)
            if parent is not self.root and not parent.children:
                # the parent became a leaf: it takes its place by recency
                idx = next((i for i, n in enumerate(leaves) if (n is protect, n.last_used) > (parent is protect,
                                                                                               parent.last_used)),
                           len(leaves))
                leaves.insert(idx, parent)

    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            else:
                out.append(n)
        return out
